//! The README's quickstart: `refusion demo` writes the embedded trained tiny ReFusion, converts
//! it to Q8_0 and Q4_K_M and answers a question with real text in more than one token per
//! forward.

mod common;

use common::*;
use serde_json::Value;

fn demo(dir: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["demo", "--dir", dir.to_str().unwrap(), "-t", "2"];
    args.extend_from_slice(extra);
    run(&args)
}

#[test]
fn demo_runs_end_to_end_and_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let o = demo(&dir, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    for step in ["1/3", "2/3", "3/3", "refusion: generated", "TPF"] {
        assert!(err.contains(step), "demo output lacks {step:?}:\n{err}");
    }
    for f in ["refusion-tiny-Q8_0.gguf", "refusion-tiny-Q4_K_M.gguf"] {
        assert!(dir.join(f).is_file(), "{f}");
    }
    // The default question, "What is 47 + 38?", answered with the worked sum.
    let out = stdout(&o);
    assert!(out.contains("The answer is 85."), "{out}");
}

/// `--infill`: the tiny model writes the hidden "Ones" line between the known lines of the
/// worked sum, on both quantized files.
#[test]
fn demo_infill_fills_the_ones_line_of_a_worked_sum() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let o = demo(&dir, &["--infill"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("column by column.\nOnes: 7 + 8 = 15, write 5, carry 1.\nTens: 4 + 3 + 1 = 8"),
        "{out}"
    );
    for (q, line) in [
        ("What is 23 + 16?", "Ones: 3 + 6 = 9, write 9."),
        ("What is 58 + 27?", "Ones: 8 + 7 = 15, write 5, carry 1."),
    ] {
        let o = demo(&dir, &["--infill", "-p", q, "--quant", "q8_0", "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let fill = v["gaps"][0]["text"].as_str().unwrap();
        assert!(fill.starts_with(line), "{q}: {fill:?}");
    }
    let o = demo(&dir, &["--infill", "-p", "Tell me a story"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("two two-digit numbers"),
        "{}",
        stderr(&o)
    );
}

/// `--json` is `generate`'s object; the trained model commits more than one token per forward
/// (TPF at the model card's settings; random weights give 0.5).
#[test]
fn demo_json_is_generates_object_with_real_parallelism() {
    let tmp = tempfile::tempdir().unwrap();
    for quant in ["q4_k_m", "q8_0"] {
        let o = demo(
            &tmp.path().join(quant),
            &[
                "--json",
                "--quant",
                quant,
                "-p",
                "Write a Python function `sum_of_marks` that returns the sum of a list.",
            ],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
        let text = v["text"].as_str().unwrap();
        assert!(
            text.contains("def sum_of_marks(") && text.contains("return total"),
            "{quant}: {text}"
        );
        let tpf = v["tpf"].as_f64().unwrap();
        assert!(tpf > 1.0, "{quant}: TPF {tpf}");
        let calls = v["forward_calls"].as_u64().unwrap();
        assert!(calls < v["answer_tokens"].as_u64().unwrap(), "{quant}: {v}");
        let sizes = v["forward_sizes"].as_array().unwrap();
        assert_eq!(sizes.len() as u64, calls);
        let total: u64 = sizes.iter().map(|n| n.as_u64().unwrap()).sum();
        assert_eq!(total, v["forward_tokens"].as_u64().unwrap());
    }
}

/// Every kernel path this CPU runs gives the same tokens from the trained model's quantized
/// files (real weights, where near-ties are rarer than with random ones but do exist).
#[test]
fn the_tiny_models_quantized_files_answer_alike_on_every_kernel_path() {
    use refusion_engine::model::kquants::CpuPath;
    let tmp = tempfile::tempdir().unwrap();
    let model = trained_tiny();
    for outtype in ["q8_0", "q4_k_m"] {
        let file = tmp.path().join(format!("{outtype}.gguf"));
        convert_quiet(&model, &file, outtype);
        let mut answers = Vec::new();
        for path in CpuPath::runnable()
            .into_iter()
            .filter(|&p| p != CpuPath::Generic)
        {
            let o = std::process::Command::new(bin())
                .env("REFUSION_CPU", path.name())
                .env_remove("REFUSION_NO_NATIVE_KQUANTS")
                .args([
                    "generate",
                    "-m",
                    file.to_str().unwrap(),
                    "--json",
                    "-t",
                    "2",
                ])
                .args(["-p", "Reverse the list [12, 7, 93, 40]."])
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", stderr(&o));
            let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
            answers.push((path.name(), v["tokens"].clone(), v["text"].clone()));
        }
        for (path, tokens, _) in &answers {
            assert_eq!(
                tokens, &answers[0].1,
                "{outtype}: {path} vs {}",
                answers[0].0
            );
        }
        let text = answers[0].2.as_str().unwrap();
        assert!(text.contains("[40, 93, 7, 12]"), "{outtype}: {text}");
    }
}
