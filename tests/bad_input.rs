//! Bad input to `convert`, `quantize` and `info`: one clear line naming the file and the
//! problem, a non-zero exit, no panic, and no output file (an existing one stays untouched).

mod common;

use std::fs;
use std::path::PathBuf;

use common::*;

struct Case {
    tmp: tempfile::TempDir,
    dir: PathBuf,
}

impl Case {
    /// A valid tiny checkpoint to break.
    fn new(spec: Tiny) -> Case {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        build_checkpoint(&dir, &spec);
        Case { tmp, dir }
    }

    fn small() -> Case {
        Case::new(Tiny {
            hidden: 64,
            head_dim: 32,
            ffn: 128,
            layers: 1,
            ..Default::default()
        })
    }

    fn out(&self) -> PathBuf {
        self.tmp.path().join("out.gguf")
    }

    /// Converts and asserts the failure, that no output or partial file exists, and that an
    /// existing output file is left exactly as it was.
    fn fails(&self, extra: &[&str], needles: &[&str]) {
        let out = self.out();
        for existing in [false, true] {
            if existing {
                fs::write(&out, b"previous contents").unwrap();
            } else {
                let _ = fs::remove_file(&out);
            }
            let mut args = vec![
                "convert",
                self.dir.to_str().unwrap(),
                "--outfile",
                out.to_str().unwrap(),
                "-q",
            ];
            args.extend_from_slice(extra);
            let o = run(&args);
            assert_fails_with(&o, needles);
            assert_eq!(
                stderr(&o).trim().lines().count(),
                1,
                "one line:\n{}",
                stderr(&o)
            );
            if existing {
                assert_eq!(
                    fs::read(&out).unwrap(),
                    b"previous contents",
                    "existing output changed"
                );
            } else {
                assert!(!out.exists(), "output file left behind");
            }
            assert!(temporaries(&out).is_empty(), "partial file left behind");
        }
    }

    fn edit_config(&self, f: impl FnOnce(&mut serde_json::Value)) {
        let path = self.dir.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        f(&mut cfg);
        fs::write(&path, cfg.to_string()).unwrap();
    }

    fn rewrite_weights(
        &self,
        f: impl FnOnce(&mut Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)>),
    ) {
        let path = self.dir.join("model.safetensors");
        let bytes = fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<_> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec(), v.dtype(), v.data().to_vec()))
            .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        f(&mut tensors);
        write_weights(&self.dir, &tensors, 1);
    }
}

#[test]
fn checkpoint_folder_missing() {
    let c = Case::small();
    let o = run(&[
        "convert",
        "/nonexistent/ckpt",
        "-o",
        c.out().to_str().unwrap(),
    ]);
    assert_fails_with(&o, &["/nonexistent/ckpt", "does not exist"]);
}

/// Files and folders mixed up: one line naming the real problem, the OS's message once.
#[test]
fn a_folder_for_a_file_and_a_file_for_a_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    for cmd in ["generate", "bench", "serve", "info"] {
        let mut args = vec![cmd];
        if cmd != "info" {
            args.push("-m");
        }
        args.push(dir);
        if cmd == "generate" {
            args.extend(["-p", "hi"]);
        }
        let o = run(&args);
        assert_fails_with(&o, &["is a directory", "convert it first"]);
        assert_eq!(stderr(&o).lines().count(), 1, "{cmd}: {}", stderr(&o));
    }
    let missing = tmp.path().join("nope.gguf");
    let o = run(&["generate", "-m", missing.to_str().unwrap(), "-p", "hi"]);
    assert_fails_with(&o, &["nope.gguf", "No such file or directory"]);
    assert_eq!(
        stderr(&o).matches("No such file").count(),
        1,
        "the OS message twice: {}",
        stderr(&o)
    );
    let file = tmp.path().join("model.gguf");
    std::fs::write(&file, b"GGUF").unwrap();
    let out = tmp.path().join("out.gguf");
    let o = run(&[
        "convert",
        file.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_fails_with(&o, &["is a file, not a checkpoint folder", "quantize"]);
    assert!(!out.exists());
}

#[test]
fn missing_config() {
    let c = Case::small();
    fs::remove_file(c.dir.join("config.json")).unwrap();
    c.fails(&[], &["config.json", "not found"]);
}

#[test]
fn config_not_json() {
    let c = Case::small();
    fs::write(c.dir.join("config.json"), "{ not json").unwrap();
    c.fails(&[], &["config.json", "invalid JSON"]);
}

#[test]
fn unsupported_model_type() {
    let c = Case::small();
    c.edit_config(|cfg| {
        cfg["model_type"] = "llama".into();
        cfg["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    });
    c.fails(
        &[],
        &[
            "config.json",
            "unsupported model_type 'llama'",
            "LlamaForCausalLM",
        ],
    );
}

#[test]
fn config_field_missing_or_inconsistent() {
    let c = Case::small();
    c.edit_config(|cfg| {
        cfg.as_object_mut().unwrap().remove("hidden_size");
    });
    c.fails(&[], &["config.json", "missing hidden_size"]);
    let c = Case::small();
    c.edit_config(|cfg| cfg["num_key_value_heads"] = 3.into());
    c.fails(&[], &["not a multiple of num_key_value_heads"]);
    let c = Case::small();
    c.edit_config(|cfg| cfg["mask_token_id"] = 100000.into());
    c.fails(&[], &["mask_token_id 100000 is outside the vocabulary"]);
}

#[test]
fn shard_named_in_index_but_absent() {
    let c = Case::new(Tiny {
        hidden: 64,
        head_dim: 32,
        ffn: 128,
        layers: 1,
        shards: 2,
        ..Default::default()
    });
    fs::remove_file(c.dir.join("model-00002-of-00002.safetensors")).unwrap();
    c.fails(
        &[],
        &[
            "model.safetensors.index.json",
            "model-00002-of-00002.safetensors",
            "does not exist",
        ],
    );
}

#[test]
fn truncated_safetensors_header() {
    let c = Case::small();
    fs::write(c.dir.join("model.safetensors"), [1u8, 2, 3]).unwrap();
    c.fails(&[], &["model.safetensors", "too short"]);
}

#[test]
fn corrupt_safetensors_header() {
    let c = Case::small();
    let mut bytes = 20u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"a\": [garbage]]]]  ");
    fs::write(c.dir.join("model.safetensors"), bytes).unwrap();
    c.fails(&[], &["model.safetensors", "not valid JSON"]);
    let mut bytes = 1_000_000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    fs::write(c.dir.join("model.safetensors"), bytes).unwrap();
    c.fails(&[], &["model.safetensors", "past the end of the file"]);
}

#[test]
fn truncated_safetensors_data() {
    let c = Case::small();
    let path = c.dir.join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    c.fails(&[], &["model.safetensors", "truncated"]);
}

#[test]
fn tensor_shape_contradicts_config() {
    let c = Case::small();
    c.rewrite_weights(|ts| {
        let t = ts
            .iter_mut()
            .find(|t| t.0 == "model.layers.0.self_attn.k_proj.weight")
            .unwrap();
        t.1 = vec![t.1[0] / 2, t.1[1] * 2];
    });
    c.fails(
        &[],
        &[
            "model.layers.0.self_attn.k_proj.weight",
            "has shape",
            "config.json",
        ],
    );
}

#[test]
fn missing_and_unexpected_tensors() {
    let c = Case::small();
    c.rewrite_weights(|ts| ts.retain(|t| t.0 != "model.layers.0.mlp.up_proj.weight"));
    c.fails(&[], &["missing tensor 'model.layers.0.mlp.up_proj.weight'"]);
    let c = Case::small();
    c.rewrite_weights(|ts| {
        let extra = ts[0].clone();
        ts.push((
            "model.layers.0.self_attn.q_proj.bias".into(),
            vec![extra.3.len() / 2],
            extra.2,
            extra.3,
        ));
    });
    c.fails(&[], &["unexpected tensor", "q_proj.bias"]);
    let c = Case::small();
    c.rewrite_weights(|ts| ts.retain(|t| t.0 != "lm_head.weight"));
    c.fails(&[], &["missing tensor 'lm_head.weight'"]);
}

#[test]
fn unsupported_dtype() {
    let c = Case::small();
    c.rewrite_weights(|ts| {
        let t = ts.iter_mut().find(|t| t.0 == "model.norm.weight").unwrap();
        let n: usize = t.1.iter().product();
        t.2 = safetensors::Dtype::F64;
        t.3 = vec![0u8; n * 8];
    });
    c.fails(&[], &["model.norm.weight", "F64", "only F32, F16 and BF16"]);
}

#[test]
fn non_finite_weights() {
    let c = Case::new(Tiny {
        hidden: 64,
        head_dim: 32,
        ffn: 128,
        layers: 1,
        dtype: Dt::F32,
        ..Default::default()
    });
    c.rewrite_weights(|ts| {
        let t = ts
            .iter_mut()
            .find(|t| t.0 == "model.layers.0.mlp.gate_proj.weight")
            .unwrap();
        t.3[40..44].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    c.fails(
        &[],
        &[
            "model.safetensors",
            "model.layers.0.mlp.gate_proj.weight",
            "non-finite value (NaN)",
            "row 0, column 10",
        ],
    );
}

#[test]
fn tokenizer_missing_or_broken() {
    let c = Case::small();
    fs::remove_file(c.dir.join("tokenizer.json")).unwrap();
    c.fails(&[], &["no tokenizer found"]);
    let c = Case::small();
    fs::write(c.dir.join("tokenizer.json"), "[]").unwrap();
    c.fails(&[], &["tokenizer.json"]);
    // A token id beyond the model's vocabulary.
    let c = Case::small();
    c.edit_config(|cfg| {
        cfg["vocab_size"] = 500.into();
        for key in ["bos_token_id", "eos_token_id", "mask_token_id"] {
            cfg.as_object_mut().unwrap().remove(key);
        }
    });
    c.fails(&[], &["outside the model's vocab_size 500"]);
}

#[test]
fn unknown_outtype_and_bad_flags() {
    let c = Case::small();
    let o = run(&[
        "convert",
        c.dir.to_str().unwrap(),
        "-o",
        c.out().to_str().unwrap(),
        "--outtype",
        "q4_k_x",
    ]);
    assert_fails_with(&o, &["unknown output type 'q4_k_x'", "q4_k_m"]);
    assert!(!c.out().exists());
    let o = run(&[
        "convert",
        c.dir.to_str().unwrap(),
        "-o",
        c.out().to_str().unwrap(),
        "--output-tensor-type",
        "q9",
    ]);
    assert_fails_with(&o, &["unknown tensor type 'q9'"]);
    let o = run(&[
        "convert",
        c.dir.to_str().unwrap(),
        "-o",
        c.out().to_str().unwrap(),
        "--slot-size=-3",
    ]);
    assert_fails_with(&o, &["--slot-size"]);
}

#[test]
fn output_folder_missing() {
    let c = Case::small();
    let o = run(&[
        "convert",
        c.dir.to_str().unwrap(),
        "-o",
        "/nonexistent/dir/out.gguf",
    ]);
    assert_fails_with(&o, &["output folder '/nonexistent/dir' does not exist"]);
}

#[test]
fn quantize_and_info_on_bad_files() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q.gguf");
    let missing = tmp.path().join("missing.gguf");
    let o = run(&[
        "quantize",
        missing.to_str().unwrap(),
        out.to_str().unwrap(),
        "q8_0",
    ]);
    assert_fails_with(&o, &["missing.gguf", "No such file"]);
    assert!(!out.exists());

    let not_gguf = tmp.path().join("not.gguf");
    fs::write(&not_gguf, b"hello world, not a model").unwrap();
    let o = run(&["info", not_gguf.to_str().unwrap()]);
    assert_fails_with(&o, &["not.gguf", "not a GGUF file"]);

    let good = tmp.path().join("good.gguf");
    let o = run(&[
        "convert",
        fixture_model("pub-a").to_str().unwrap(),
        "-o",
        good.to_str().unwrap(),
        "--outtype",
        "f32",
        "-q",
    ]);
    assert!(o.status.success());
    let bytes = fs::read(&good).unwrap();
    for cut in [10, 100, 5_000, bytes.len() - 10] {
        let t = tmp.path().join(format!("cut{cut}.gguf"));
        fs::write(&t, &bytes[..cut]).unwrap();
        let o = run(&["info", t.to_str().unwrap()]);
        assert_fails_with(&o, &[&format!("cut{cut}.gguf")]);
        let o = run(&[
            "quantize",
            t.to_str().unwrap(),
            out.to_str().unwrap(),
            "q8_0",
        ]);
        assert_fails_with(&o, &[&format!("cut{cut}.gguf")]);
        assert!(!out.exists());
    }
    let o = run(&[
        "quantize",
        good.to_str().unwrap(),
        out.to_str().unwrap(),
        "q7_k",
    ]);
    assert_fails_with(&o, &["unknown output type 'q7_k'"]);
}

/// llama.cpp habits: negative numbers are values (refused by range, not as unknown flags),
/// sampling flags slot decoding cannot honour are refused by name, all before the model loads
/// (the model path does not exist).
#[test]
fn decoding_flags_are_checked_before_loading() {
    for (cmd, args, want) in [
        (
            "generate",
            &["--temp", "-1"][..],
            "--temp must be >= 0, got -1",
        ),
        (
            "generate",
            &["--slot-threshold", "-0.5"][..],
            "--slot-threshold must be in [0, 1]",
        ),
        (
            "chat",
            &["--token-threshold", "2"][..],
            "--token-threshold must be in [0, 1]",
        ),
        (
            "generate",
            &["--top-k", "40"][..],
            "--top-k is not supported",
        ),
        ("serve", &["--top-p", "0.9"][..], "--top-p is not supported"),
        (
            "generate",
            &["--min-p", "0.05"][..],
            "--min-p is not supported",
        ),
        (
            "chat",
            &["--repeat-penalty", "1.1"][..],
            "--repeat-penalty is not supported",
        ),
    ] {
        let mut all = vec![cmd, "-m", "/nonexistent.gguf"];
        if cmd == "generate" {
            all.extend_from_slice(&["-p", "hi"]);
        }
        all.extend_from_slice(args);
        let o = run(&all);
        assert_fails_with(&o, &[want]);
    }
}

/// llama.cpp's short flags `-s` (seed) and `-sys` (system prompt) work.
#[test]
fn llama_cpp_short_flags_for_seed_and_system() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    convert_quiet(&fixture_model("pub-a"), &model, "f32");
    let gen = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "hi",
            "-n",
            "8",
        ];
        args.extend_from_slice(&["--slot-size", "4", "--serial-blocks", "1", "--json"]);
        args.extend_from_slice(extra);
        let o = run(&args);
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        v
    };
    let long = gen(&["--seed", "7", "--temp", "0.7", "--system", "Be brief."]);
    let short = gen(&["-s", "7", "--temp", "0.7", "-sys", "Be brief."]);
    assert_eq!(long["tokens"], short["tokens"]);
    assert_eq!(long["prompt_tokens"], short["prompt_tokens"]);
    let plain = gen(&[]);
    assert_ne!(
        plain["prompt_tokens"], short["prompt_tokens"],
        "-sys was ignored"
    );
}

/// `quantize A A` would replace its own input: refused, the input untouched.
#[test]
fn quantize_refuses_to_overwrite_its_input() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    convert_quiet(&fixture_model("pub-a"), &model, "f32");
    let before = std::fs::read(&model).unwrap();
    let same = dir.path().join(".").join("m.gguf");
    let o = run(&[
        "quantize",
        model.to_str().unwrap(),
        same.to_str().unwrap(),
        "q8_0",
    ]);
    assert_fails_with(&o, &["the output would overwrite the input"]);
    assert!(
        std::fs::read(&model).unwrap() == before,
        "the input changed"
    );
}

/// Nothing silently exceeds what the user set: a bench test beyond `-c` is refused before
/// loading, and a context beyond the model's trained one is warned about.
#[test]
fn contexts_beyond_what_was_set_or_trained() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("never-opened.gguf");
    let o = run(&[
        "bench",
        "-m",
        missing.to_str().unwrap(),
        "-p",
        "16,600",
        "-c",
        "512",
    ]);
    assert_fails_with(
        &o,
        &["-d 256 plus -p 600 is 856 tokens", "-c 512", "raise -c"],
    );
    let model = tiny_refusion_gguf(tmp.path());
    let o = run(&[
        "generate",
        "-m",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "-n",
        "8",
        "--slot-size",
        "4",
        "-c",
        "8192",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o)
            .contains("the context (8192 tokens) is beyond what the model was trained on (4096)"),
        "{}",
        stderr(&o)
    );
}

/// llama.cpp's flags: -ctk/-ctv (each its own type), -fa and -cnv refused by name before
/// loading, `-f -` reads the prompt from standard input, `--log-disable` keeps stderr quiet, and
/// a missing `-f FILE` is refused before the model loads.
#[test]
fn llama_cpp_flags_work_or_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let never = tmp.path().join("never-opened.gguf");
    let m = never.to_str().unwrap();
    for (args, needle) in [
        (vec!["-fa", "on"], "-fa on: refusion has one attention path"),
        (vec!["-fa"], "-fa on: refusion has one attention path"),
        (vec!["-ctk", "q9", "-ctv", "f32"], "unknown cache type 'q9'"),
        (vec!["-ctv", "f8"], "unknown cache type 'f8'"),
        (vec!["-cnv"], "-cnv: for a conversation, use refusion chat"),
        (
            vec!["-f", "/nonexistent/prompt.txt"],
            "/nonexistent/prompt.txt",
        ),
    ] {
        let mut all = vec!["generate", "-m", m];
        if !args.contains(&"-f") {
            all.extend(["-p", "hi"]);
        }
        all.extend(args);
        let o = run(&all);
        assert_fails_with(&o, &[needle]);
        assert!(
            !stderr(&o).contains("never-opened"),
            "loaded first: {}",
            stderr(&o)
        );
    }
    let model = tiny_refusion_gguf(tmp.path());
    let mut child = std::process::Command::new(bin())
        .args(["generate", "-m", model.to_str().unwrap(), "-f", "-"])
        .args(["-n", "8", "--slot-size", "4", "--log-disable"])
        .args(["-ctk", "f16", "-ctv", "f32", "-fa", "off"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Tell me about the sea.")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).trim().is_empty());
    assert_eq!(stderr(&o), "", "--log-disable leaves stderr empty");
}
