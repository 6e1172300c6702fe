//! The bad-input matrix: every command meets broken files, hostile headers, impossible
//! parameters and a full disk, and answers each with a clear message and a non-zero exit, no
//! panic, and no output file left behind.

mod common;

use std::fs;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use common::*;
use refusion_gguf::Value;

struct Env {
    tmp: tempfile::TempDir,
}

impl Env {
    fn p(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }
    fn s(&self, name: &str) -> String {
        self.p(name).to_str().unwrap().to_string()
    }
}

fn gguf_bytes(n_tensors: u64, n_kv: u64, tail: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b.extend_from_slice(tail);
    b
}

fn setup() -> Env {
    let env = Env {
        tmp: tempfile::tempdir().unwrap(),
    };
    // A good checkpoint, its f32 and q8_0 GGUFs, and broken variants.
    let ck = env.p("ckpt");
    build_checkpoint(
        &ck,
        &Tiny {
            hidden: 64,
            head_dim: 32,
            ffn: 128,
            layers: 1,
            dtype: Dt::F32,
            ..Default::default()
        },
    );
    for (name, outtype) in [("good.gguf", "f32"), ("q8.gguf", "q8_0")] {
        let o = run(&[
            "convert",
            ck.to_str().unwrap(),
            "-o",
            &env.s(name),
            "--outtype",
            outtype,
            "-q",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    // Checkpoints with a NaN and with an Inf weight.
    for (name, bad) in [("nan", f32::NAN), ("inf", f32::INFINITY)] {
        let dir = env.p(name);
        build_checkpoint(
            &dir,
            &Tiny {
                hidden: 64,
                head_dim: 32,
                ffn: 128,
                layers: 1,
                dtype: Dt::F32,
                ..Default::default()
            },
        );
        let path = dir.join("model.safetensors");
        let bytes = fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut ts: Vec<_> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec(), v.dtype(), v.data().to_vec()))
            .collect();
        let t = ts
            .iter_mut()
            .find(|t| t.0 == "model.layers.0.mlp.up_proj.weight")
            .unwrap();
        t.3[8..12].copy_from_slice(&bad.to_le_bytes());
        write_weights(&dir, &ts, 1);
    }
    let trunc = env.p("trunc");
    fs::create_dir_all(&trunc).unwrap();
    for f in fs::read_dir(&ck).unwrap() {
        let f = f.unwrap().path();
        fs::copy(&f, trunc.join(f.file_name().unwrap())).unwrap();
    }
    let st = trunc.join("model.safetensors");
    let bytes = fs::read(&st).unwrap();
    fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let good = fs::read(env.p("good.gguf")).unwrap();
    fs::write(env.p("cut.gguf"), &good[..good.len() / 3]).unwrap();
    fs::write(env.p("magic.gguf"), b"GGML\x03\x00\x00\x00garbage").unwrap();
    fs::write(env.p("empty.gguf"), b"").unwrap();
    fs::write(env.p("counts.gguf"), gguf_bytes(1 << 62, 1 << 62, &[0; 64])).unwrap();
    let mut huge_key = (1u64 << 60).to_le_bytes().to_vec();
    huge_key.extend_from_slice(&[0; 32]);
    fs::write(env.p("string.gguf"), gguf_bytes(0, 1, &huge_key)).unwrap();
    let mut arr = 4u64.to_le_bytes().to_vec();
    arr.extend_from_slice(b"keys");
    arr.extend_from_slice(&9u32.to_le_bytes()); // array
    arr.extend_from_slice(&8u32.to_le_bytes()); // of strings
    arr.extend_from_slice(&(1u64 << 50).to_le_bytes());
    fs::write(env.p("array.gguf"), gguf_bytes(0, 1, &arr)).unwrap();
    with_metadata(&env.p("good.gguf"), &env.p("notemplate.gguf"), |m| {
        m.retain(|(k, _)| k != "tokenizer.chat_template")
    });
    // No mask id, and no <|mask|> in the vocabulary to take it from: not a ReFusion model.
    with_metadata(&env.p("good.gguf"), &env.p("nomask.gguf"), |m| {
        m.retain(|(k, _)| k != "tokenizer.ggml.mask_token_id");
        if let Some((_, Value::Array(_, tokens))) =
            m.iter_mut().find(|(k, _)| k == "tokenizer.ggml.tokens")
        {
            for t in tokens.iter_mut() {
                if matches!(t, Value::String(s) if s == "<|mask|>") {
                    *t = Value::String("<|unmask|>".into());
                }
            }
        }
    });
    with_metadata(&env.p("good.gguf"), &env.p("smallvocab.gguf"), |m| {
        m.iter_mut()
            .find(|(k, _)| k == "tokenizer.ggml.eos_token_id")
            .unwrap()
            .1 = Value::U32(600)
    });
    fs::create_dir_all(env.p("adir.gguf")).unwrap();
    env
}

struct Case {
    args: Vec<String>,
    needles: Vec<&'static str>,
    /// A file the command must not leave behind.
    output: Option<PathBuf>,
    /// Run under `ulimit -f` (a full disk) through bash.
    file_limit_kb: Option<u32>,
    env: Vec<(&'static str, &'static str)>,
}

fn case(args: &[&str], needles: &[&'static str]) -> Case {
    Case {
        args: args.iter().map(|s| s.to_string()).collect(),
        needles: needles.to_vec(),
        output: None,
        file_limit_kb: None,
        env: Vec::new(),
    }
}

fn run_case(c: &Case) -> Output {
    let mut cmd = match c.file_limit_kb {
        Some(kb) => {
            let mut cmd = Command::new("bash");
            cmd.arg("-c")
                .arg(format!("trap '' XFSZ; ulimit -f {kb}; exec \"$0\" \"$@\""))
                .arg(bin());
            cmd
        }
        None => Command::new(bin()),
    };
    cmd.args(&c.args).stdin(Stdio::null());
    for (k, v) in &c.env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn every_command_refuses_bad_input_cleanly() {
    let e = setup();
    let out = e.p("out.gguf");
    let o = out.to_str().unwrap();
    let ck = e.s("ckpt");
    let gen = |m: &str, extra: &[&str]| {
        let model = e.s(m);
        let mut v = vec!["generate", "-m", model.as_str()];
        v.extend_from_slice(extra);
        case(&v, &[])
    };
    let mut cases = vec![
        // convert
        case(
            &["convert", "/nonexistent/ckpt", "-o", o],
            &["does not exist"],
        ),
        case(
            &["convert", &e.s("nan"), "-o", o],
            &["non-finite value (NaN)"],
        ),
        case(
            &["convert", &e.s("inf"), "-o", o],
            &["non-finite value (inf)"],
        ),
        case(
            &["convert", &e.s("trunc"), "-o", o],
            &["model.safetensors", "truncated"],
        ),
        case(
            &["convert", &ck, "-o", o, "--outtype", "q9_k"],
            &["unknown output type 'q9_k'"],
        ),
        case(
            &["convert", &ck, "-o", "/nonexistent/dir/x.gguf"],
            &["output folder '/nonexistent/dir' does not exist"],
        ),
        case(
            &["convert", &ck, "-o", &e.s("adir.gguf")],
            &["is a directory"],
        ),
        case(
            &["convert", &ck, "-o", o, "--slot-threshold", "7"],
            &["slot threshold must be in [0, 1]"],
        ),
        case(
            &["convert", &ck, "-o", o, "--gen-length", "0"],
            &["must all be positive"],
        ),
        case(
            &["convert", &ck, "-o", o, "--token-embedding-type", "q9"],
            &["unknown tensor type 'q9'"],
        ),
        case(
            &["convert", &ck, "-o", o, "-t", "x"],
            &["invalid value 'x'"],
        ),
        // quantize
        case(
            &["quantize", "/nonexistent.gguf", o, "q8_0"],
            &["/nonexistent.gguf", "No such file"],
        ),
        case(
            &["quantize", &e.s("magic.gguf"), o, "q8_0"],
            &["not a GGUF file"],
        ),
        case(&["quantize", &e.s("cut.gguf"), o, "q8_0"], &["cut.gguf"]),
        case(
            &["quantize", &e.s("q8.gguf"), o, "q4_0"],
            &["already quantized"],
        ),
        case(
            &["quantize", &e.s("good.gguf"), o, "q4_zz"],
            &["unknown output type"],
        ),
        case(
            &[
                "quantize",
                &e.s("good.gguf"),
                "/nonexistent/dir/q.gguf",
                "q8_0",
            ],
            &["does not exist"],
        ),
        case(&["quantize", &e.s("empty.gguf"), o, "q8_0"], &["empty"]),
        // info
        case(&["info", &e.s("empty.gguf")], &["empty.gguf", "empty"]),
        case(&["info", &e.s("magic.gguf")], &["not a GGUF file"]),
        case(
            &["info", &e.s("counts.gguf")],
            &["count", "larger than the file can hold"],
        ),
        case(
            &["info", &e.s("string.gguf")],
            &["string length", "exceeds"],
        ),
        case(
            &["info", &e.s("array.gguf")],
            &["array of 1125899906842624 elements"],
        ),
        case(
            &["info", &e.s("cut.gguf")],
            &["extends past the end of the file"],
        ),
        case(&["info", &e.s("adir.gguf")], &["adir.gguf"]),
        // generate
        gen("good.gguf", &["-p", ""]),
        gen("good.gguf", &["--prompt-ids", "1,511"]),
        gen("good.gguf", &["--prompt-ids", "1,512"]),
        gen("good.gguf", &["--prompt-ids", "5", "-n", "0"]),
        gen(
            "good.gguf",
            &["--prompt-ids", "5", "-n", "64", "--serial-blocks", "3"],
        ),
        gen(
            "good.gguf",
            &["--prompt-ids", "5", "--token-threshold", "2"],
        ),
        gen(
            "good.gguf",
            &["--prompt-ids", "5", "-n", "4096", "-c", "1024"],
        ),
        gen("good.gguf", &["--prompt-ids", "5", "--temp", "nan"]),
        case(
            &["generate", "-m", &e.s("nomask.gguf"), "--prompt-ids", "5"],
            &["no mask token", "<|mask|>"],
        ),
        gen("smallvocab.gguf", &["--prompt-ids", "5"]),
        gen("cut.gguf", &["--prompt-ids", "5"]),
        gen("good.gguf", &["--prompt-ids", "5", "--device", "quantum"]),
        // chat
        case(
            &["chat", "-m", &e.s("notemplate.gguf")],
            &["no chat template"],
        ),
        case(&["chat", "-m", &e.s("magic.gguf")], &["not a GGUF file"]),
        case(
            &["chat", "-m", &e.s("good.gguf"), "--slot-size", "0"],
            &["--slot-size must be between 1 and 1048576, got 0"],
        ),
        // serve
        case(
            &[
                "serve",
                "-m",
                &e.s("good.gguf"),
                "--host",
                "0.0.0.0",
                "--port",
                "0",
            ],
            &["--api-key"],
        ),
        case(
            &["serve", "-m", &e.s("good.gguf"), "--queue", "0"],
            &["--queue must be between 1 and 65536, got 0"],
        ),
        case(
            &["serve", "-m", &e.s("counts.gguf")],
            &["larger than the file can hold"],
        ),
        case(
            &["serve", "-m", &e.s("good.gguf"), "--host", "not-an-ip"],
            &["invalid value 'not-an-ip'"],
        ),
    ];
    let needles_of_gen: [&[&'static str]; 12] = [
        &["the prompt is empty"],
        &["contains the mask token (511)"],
        &["prompt token 512 is outside the vocabulary (512)"],
        &["-n must be -1 (the file's gen length) or between 1 and 1048576, got 0"],
        &["serial blocks that work"],
        &["--token-threshold must be in [0, 1]"],
        &["more than the context of 1024"],
        &["--temp must be >= 0"],
        &["no mask token"],
        &["eos_token_id", "not a token id"],
        &["cut.gguf"],
        &["unknown device 'quantum'"],
    ];
    let mut gi = 0;
    for c in cases.iter_mut() {
        if c.args[0] == "generate" {
            c.needles = needles_of_gen[gi].to_vec();
            gi += 1;
        }
        if c.args[0] == "convert" || c.args[0] == "quantize" {
            c.output = Some(out.clone());
        }
    }
    // A full disk: the output cannot grow past 64 KiB.
    let mut full = case(
        &["convert", &ck, "-o", o, "--outtype", "f32", "-q"],
        &["File too large"],
    );
    full.file_limit_kb = Some(64);
    full.output = Some(out.clone());
    cases.push(full);
    // Not enough memory for the weights, or for the KV cache.
    let mut mem = case(
        &["generate", "-m", &e.s("good.gguf"), "--prompt-ids", "5"],
        &["the weights need about", "available"],
    );
    mem.env.push(("REFUSION_MAX_MEMORY", "1000"));
    cases.push(mem);
    cases.push(kv_short(&e, &["the KV cache for", "--kv-file"]));

    assert!(cases.len() >= 40, "{} cases", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        let o = run_case(c);
        let err = stderr(&o);
        let ok = !o.status.success()
            && !err.contains("panicked")
            && c.needles.iter().all(|n| err.contains(n))
            && c.output
                .as_ref()
                .is_none_or(|p| !p.exists() && temporaries(p).is_empty());
        if !ok {
            failures.push(format!("{:?}: exit {:?}\n{err}", c.args, o.status.code()));
        }
        if let Some(p) = &c.output {
            let _ = fs::remove_file(p);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn a_prompt_of_only_special_tokens_is_fine() {
    let e = setup();
    let o = run(&[
        "generate",
        "-m",
        &e.s("good.gguf"),
        "-p",
        "<|im_start|><|im_end|>",
        "--no-chat-template",
        "-n",
        "8",
        "--serial-blocks",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["prompt_tokens"], 2);
}

/// A plan that does not fit says why once, with the plan once: the file's name wraps the
/// reason in the message, not as a second error that `{:#}` would print again.
#[test]
fn a_refused_plan_says_why_once() {
    let e = setup();
    let o = run_case(&kv_short(&e, &[]));
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert_eq!(err.matches("the KV cache for").count(), 1, "{err}");
    assert_eq!(err.matches("memory plan:").count(), 1, "{err}");
}

/// `generate` with a context whose KV cache does not fit the memory left beside the weights.
fn kv_short(e: &Env, needles: &[&'static str]) -> Case {
    let mut kv = case(
        &[
            "generate",
            "-m",
            &e.s("good.gguf"),
            "--prompt-ids",
            "5",
            "-c",
            "200000",
            "-n",
            "150000",
        ],
        needles,
    );
    kv.env.push(("REFUSION_MAX_MEMORY", "2000000"));
    kv
}
