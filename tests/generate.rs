//! `refusion generate`: the golden cases through the command line, parameter and prompt
//! errors, and text prompts through the chat template with the real ReFusion tokenizer.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use common::*;
use serde_json::Value;

fn json_of(o: &std::process::Output) -> Value {
    assert!(o.status.success(), "generate failed:\n{}", stderr(o));
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{}", stdout(o)))
}

#[test]
fn golden_cases_through_the_command_line() {
    let text = std::fs::read_to_string(fixtures().join("goldens_public.json")).unwrap();
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut files: HashMap<String, PathBuf> = HashMap::new();
    for name in ["pub-a", "pub-b", "pub-c"] {
        let out = tmp.path().join(format!("{name}.gguf"));
        convert_quiet(&fixture_model(name), &out, "f32");
        files.insert(name.into(), out);
    }
    let cases = goldens["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 111);
    for case in cases {
        let id = case["id"].as_str().unwrap();
        let ids: Vec<String> = case["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect();
        let arg = |k: &str| case[k].to_string();
        let model = files[case["model"].as_str().unwrap()]
            .to_str()
            .unwrap()
            .to_string();
        let o = run(&[
            "generate",
            "-m",
            &model,
            "--prompt-ids",
            &ids.join(","),
            "--temp",
            "0",
            "--json",
            "-n",
            &arg("gen_length"),
            "--slot-size",
            &arg("slot_size"),
            "--serial-blocks",
            &arg("serial_num_blocks"),
            "--slot-threshold",
            &arg("slot_threshold"),
            "--token-threshold",
            &arg("token_threshold"),
            "-c",
            "1024",
        ]);
        let j = json_of(&o);
        assert_eq!(j["tokens"], case["tokens"], "{id}: tokens");
        let tpf = j["tpf"].as_f64().unwrap();
        assert!(
            (tpf - case["tpf"].as_f64().unwrap()).abs() <= 1e-6,
            "{id}: tpf {tpf}"
        );
        assert_eq!(j["forward_calls"], case["n_forward"], "{id}: forward calls");
        assert_eq!(j["prompt_tokens"].as_u64().unwrap() as usize, ids.len());
        // The answer stops at the first EOS by position, and after at most the gen length
        // (slot decoding rounds it up to whole slots; `-n` is a promise).
        let toks: Vec<u64> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let eos = case["eos_id"].as_u64().unwrap();
        let answer = toks
            .iter()
            .position(|&t| t == eos)
            .unwrap_or(toks.len())
            .min(case["gen_length"].as_u64().unwrap() as usize);
        assert_eq!(
            j["answer_tokens"].as_u64().unwrap() as usize,
            answer,
            "{id}: answer length"
        );
    }
}

#[test]
fn parameter_and_prompt_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &m, "q8_0");
    let m = m.to_str().unwrap();
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--prompt-ids", "1,2", "-n", "512", "--serial-blocks", "3"],
            &["serial blocks that work: 1, 2, 4, 8"],
        ),
        (
            &["--prompt-ids", "1,2", "--slot-threshold", "1.5"],
            &["--slot-threshold must be in [0, 1]"],
        ),
        (
            &["--prompt-ids", "1,2", "--token-threshold=-0.1"],
            &["--token-threshold must be in [0, 1]"],
        ),
        (
            &["--prompt-ids", "1,2", "-n", "0"],
            &["-n must be -1 (the file's gen length) or between 1 and"],
        ),
        (
            &["--prompt-ids", "1,2", "--slot-size", "0"],
            &["--slot-size must be between 1 and"],
        ),
        (
            &["--prompt-ids", "1,2", "--temp=-1"],
            &["--temp must be >= 0"],
        ),
        (
            &["--prompt-ids", "1,511,2"],
            &["contains the mask token (511) at index 1"],
        ),
        (
            &["--prompt-ids", "1,600"],
            &["prompt token 600 is outside the vocabulary (512)"],
        ),
        (
            &["--prompt-ids", "1,2", "-n", "512", "-c", "256"],
            &["need 514 tokens, more than the context of 256"],
        ),
        (&["-p", "   "], &["the prompt is empty"]),
        (&["-p", "x", "--prompt-ids", "1"], &["cannot be used with"]),
        (&[], &["required"]),
        (
            &["-f", "/nonexistent/prompt.txt"],
            &["/nonexistent/prompt.txt"],
        ),
    ];
    for (args, needles) in cases {
        let mut all = vec!["generate", "-m", m];
        all.extend_from_slice(args);
        assert_fails_with(&run(&all), needles);
    }
}

#[test]
fn text_prompts_through_the_chat_template_with_the_real_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("refusion-tiny");
    build_refusion_vocab_checkpoint(&dir, TokLayout::Slow);
    let m = tmp.path().join("r.gguf");
    convert_quiet(&dir, &m, "q8_0");
    let m = m.to_str().unwrap();
    let reference =
        tokenizers::Tokenizer::from_file(fixtures().join("tokenizers/refusion/tokenizer.json"))
            .unwrap();
    let rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n";
    let want = reference.encode(rendered, false).unwrap().get_ids().len();

    let o = run(&[
        "generate",
        "-m",
        m,
        "-p",
        "What is 2+2?",
        "--system",
        "Be brief.",
        "-n",
        "16",
        "--slot-size",
        "4",
        "--serial-blocks",
        "2",
        "--json",
    ]);
    let j = json_of(&o);
    assert_eq!(j["prompt_tokens"].as_u64().unwrap() as usize, want);
    assert_eq!(j["tokens"].as_array().unwrap().len(), 16);
    let ids: Vec<u32> = j["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let n = j["answer_tokens"].as_u64().unwrap() as usize;
    assert_eq!(
        j["text"].as_str().unwrap(),
        reference.decode(&ids[..n], true).unwrap()
    );

    // Without the template the text is tokenized as it is.
    let o = run(&[
        "generate",
        "-m",
        m,
        "-p",
        "What is 2+2?",
        "--no-chat-template",
        "-n",
        "8",
        "--slot-size",
        "4",
        "--serial-blocks",
        "1",
        "--json",
    ]);
    let j = json_of(&o);
    assert_eq!(
        j["prompt_tokens"].as_u64().unwrap() as usize,
        reference.encode("What is 2+2?", false).unwrap().len()
    );

    // From a file, streamed as text, with timings on stderr; sampling is seeded.
    let prompt = tmp.path().join("prompt.txt");
    std::fs::write(&prompt, "Tell me a story.").unwrap();
    let args = [
        "generate",
        "-m",
        m,
        "-f",
        prompt.to_str().unwrap(),
        "-n",
        "16",
        "--slot-size",
        "4",
        "--serial-blocks",
        "2",
        "--temp",
        "0.8",
        "--seed",
        "7",
    ];
    let a = run(&args);
    assert!(a.status.success(), "{}", stderr(&a));
    assert!(stderr(&a).contains("refusion: forward calls"));
    assert!(stderr(&a).contains("tokens/s"));
    let b = run(&args);
    assert_eq!(stdout(&a), stdout(&b), "same seed, same answer");

    // --visual draws the canvas on a terminal (a pseudo-terminal from util-linux's `script`).
    let line = format!(
        "'{}' generate -m '{m}' -p Hi -n 8 --slot-size 4 --serial-blocks 1 --visual",
        bin().display()
    );
    let o = std::process::Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .output()
        .expect("util-linux's script");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("\x1b[2J"), "{}", stdout(&o));
    assert!(stdout(&o).contains("committed"));
}

/// Outputs that are not a terminal get no escape codes (`--visual` into a pipe prints the
/// answer as text, with a note), and the prompt cache's note comes before the answer.
#[test]
fn no_escape_codes_off_a_terminal_and_notes_before_the_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let cache = tmp.path().join("prompt.kv");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "generate",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "Tell me about the sea.",
            "-n",
            "16",
            "--slot-size",
            "4",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let o = std::process::Command::new(bin())
        .args(args(&["--visual"]))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains('\x1b'), "escape codes in a pipe");
    assert!(
        stderr(&o).contains("--visual needs a terminal"),
        "{}",
        stderr(&o)
    );
    let answer = stdout(&o).trim().to_string();
    assert!(!answer.is_empty());

    let cache = cache.to_str().unwrap();
    let first = run(&args(&["--prompt-cache", cache])
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>());
    assert!(first.status.success(), "{}", stderr(&first));
    assert_eq!(stdout(&first).trim(), answer);
    // Both streams into one pipe, in the order they were written.
    let line = args(&["--prompt-cache", cache])
        .iter()
        .map(|a| format!("'{a}'"))
        .collect::<Vec<_>>()
        .join(" ");
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("'{}' {line} 2>&1", bin().display()))
        .output()
        .unwrap();
    let merged = String::from_utf8_lossy(&o.stdout).into_owned();
    let note = merged.find("prompt cache: reused").expect(&merged);
    let at = merged.find(&answer).expect(&merged);
    assert!(note < at, "the note comes after the answer:\n{merged}");
}

/// `refusion bench` as llama-bench: prompt tests (`-p`) and generation tests (`-n`), in its
/// table (`-o md`), one JSON array (`-o json`), JSON lines (`--json`) or CSV (`-o csv`).
#[test]
fn bench_output_formats_and_generation_tests() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let m = model.to_str().unwrap();
    let bench = |extra: &[&str]| {
        let mut args = vec!["bench", "-m", m, "-p", "4", "-n", "3", "-r", "1", "-d", "8"];
        args.extend(extra);
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let md = bench(&[]);
    assert!(md.contains("pp4 @ d8") && md.contains("tg3 @ d8"), "{md}");
    assert!(md.starts_with("| model"), "{md}");
    let json: serde_json::Value = serde_json::from_str(&bench(&["-o", "json"])).unwrap();
    let rows = json.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["test"], "tg3 @ d8");
    // The model columns CSV has, as llama-bench's JSON has them.
    assert!(rows[0]["model"].as_str().is_some() && rows[0]["size"].as_u64().unwrap() > 0);
    assert!(rows[0]["params"].as_u64().unwrap() > 0);
    assert!(rows
        .iter()
        .all(|r| r["tokens_per_s"].as_f64().unwrap() > 0.0));
    let lines = bench(&["--json"]);
    assert_eq!(lines.lines().count(), 2, "{lines}");
    for l in lines.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v["n_tokens"].as_u64().unwrap() > 0);
    }
    let csv = bench(&["-o", "csv"]);
    let mut it = csv.lines();
    assert!(it.next().unwrap().starts_with("model,size,params"));
    assert_eq!(
        it.filter(|l| l.contains(",tg3 @ d8,3,8,")).count(),
        1,
        "{csv}"
    );
    let o = run(&["bench", "-m", m, "-o", "xml"]);
    assert_fails_with(&o, &["xml"]);
    // 0 skips a kind of test, as in llama-bench.
    let o = run(&[
        "bench", "-m", m, "-p", "0", "-n", "2", "-r", "1", "-d", "4", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 1, "{}", stdout(&o));
    let o = run(&["bench", "-m", m, "-p", "0"]);
    assert_fails_with(&o, &["nothing to measure"]);
}
