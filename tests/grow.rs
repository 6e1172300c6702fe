//! `convert --synthetic SHAPE --grow-from DIR`: a larger file that computes the trained tiny
//! model's function. Here on a small grown shape (CI's time); the real 0.6B and 8B files are
//! checked by `grown_file_gives_the_goldens` with `REFUSION_GROWN_GGUF` (benches/README.md).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::*;
use refusion_convert::hf::config::Qwen3Config;
use refusion_convert::{ConvertOptions, Verbosity};
use refusion_engine::decode::generate;
use refusion_engine::kv::CacheType;
use refusion_engine::model::{Batch, Forward, LogitsFor, Qwen3};
use refusion_gguf::FileType;
use refusion_gguf::GgufFile;
use serde_json::Value;

fn tiny_dir() -> PathBuf {
    trained_tiny()
}

/// A shape a few times the tiny model's with every kind of padding: 4 times the hidden size (the
/// residual scale 2, exact), 2 more layers, twice the head size, 4 q heads per KV head (the tiny
/// model has 2), more KV heads, FFN units and vocabulary.
fn test_shape() -> Qwen3Config {
    let mut s = refusion_convert::synthetic::shape("0.6b").unwrap();
    s.hidden_size = 1024;
    s.intermediate_size = 1024;
    s.num_hidden_layers = 8;
    s.num_attention_heads = 12;
    s.num_key_value_heads = 3;
    s.vocab_size = 3000;
    s
}

fn grow(shape: &Qwen3Config, outtype: FileType, out: &Path) {
    let opts = ConvertOptions {
        outtype,
        verbosity: Verbosity::Quiet,
        ..ConvertOptions::default()
    };
    refusion_convert::grow::write_grown(out, shape, &tiny_dir(), &opts).unwrap();
}

fn load(path: &Path) -> Qwen3 {
    Qwen3::load_offloaded(Arc::new(GgufFile::open(path).unwrap()), None).unwrap()
}

/// The logits of every position of `tokens` fed in one forward.
fn logits(model: &Qwen3, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(64, CacheType::F32, None).unwrap();
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    let mut b = Batch::row(tokens, &pos, 0);
    b.logits_for = LogitsFor::Indices((0..tokens.len()).collect());
    let out = model.forward(&b, &mut cache).unwrap();
    let vocab = model.config().vocab;
    out.data.chunks(vocab).map(|r| r.to_vec()).collect()
}

#[test]
fn grown_model_keeps_every_logit_and_extra_tokens_never_win() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = tmp.path().join("tiny.gguf");
    let grown = tmp.path().join("grown.gguf");
    convert_quiet(&tiny_dir(), &tiny, "f32");
    grow(&test_shape(), FileType::F32, &grown);
    let (small, large) = (load(&tiny), load(&grown));
    assert_eq!(large.config().vocab, 3000);
    assert_eq!(large.config().n_layers, 8);
    // "What is 23 + 16?" in the chat template, then a few answer tokens.
    let prompt = [
        715, 278, 198, 378, 266, 220, 17, 18, 268, 220, 16, 21, 30, 716, 198, 715, 281, 198, 373,
        374, 220,
    ];
    let (a, b) = (logits(&small, &prompt), logits(&large, &prompt));
    let mut worst: f32 = 0.0;
    for (s, l) in a.iter().zip(&b) {
        let (real, extra) = l.split_at(s.len());
        for (x, y) in s.iter().zip(real) {
            worst = worst.max((x - y).abs() / x.abs().max(1.0));
        }
        let best_extra = extra.iter().cloned().fold(f32::MIN, f32::max);
        assert!(best_extra < -1e4, "an extra token scores {best_extra}");
    }
    assert!(worst < 1e-4, "logits differ by {worst} (relative)");
}

#[test]
fn grown_model_gives_the_trained_goldens_at_f32_and_its_answers_at_q8_0() {
    let tmp = tempfile::tempdir().unwrap();
    let grown = tmp.path().join("grown.gguf");
    grow(&test_shape(), FileType::F32, &grown);
    let (exact, total) = golden_matches(&grown);
    assert_eq!(exact, total, "{exact} of {total} golden cases exact");
    // Quantized, the answers survive (the tiny model's own Q8_0 file answers these too).
    let q8 = tmp.path().join("grown-q8.gguf");
    grow(&test_shape(), FileType::Q8_0, &q8);
    let o = run(&[
        "generate",
        "-m",
        q8.to_str().unwrap(),
        "-p",
        "What is 23 + 16?",
        "--log-disable",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("The answer is 39."), "{}", stdout(&o));
}

#[test]
fn grown_file_carries_the_held_out_questions() {
    let tmp = tempfile::tempdir().unwrap();
    let grown = tmp.path().join("grown.gguf");
    grow(&test_shape(), FileType::Q8_0, &grown);
    let f = GgufFile::open(&grown).unwrap();
    let questions = f.header.get("refusion.eval.question").unwrap();
    assert_eq!(questions.as_array().unwrap().len(), 200);
    assert!(f.header.get("refusion.eval.answer").is_some());
}

#[test]
fn growing_into_a_smaller_shape_or_without_synthetic_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.gguf");
    let o = run(&[
        "convert",
        "--grow-from",
        tiny_dir().to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_fails_with(&o, &["--synthetic"]);
    let mut shape = test_shape();
    shape.hidden_size = 384;
    let opts = ConvertOptions {
        verbosity: Verbosity::Quiet,
        ..ConvertOptions::default()
    };
    let e = refusion_convert::grow::write_grown(&out, &shape, &tiny_dir(), &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("hidden size (384)"), "{e}");
    assert!(!out.exists());
}

/// The real grown files (`REFUSION_GROWN_GGUF=grown-0.6b-f32.gguf`): how many of the 72 trained
/// goldens give the same tokens and TPF (padded float sums may reorder). Minutes on 2 cores.
#[test]
#[ignore]
fn grown_file_gives_the_goldens() {
    let path = std::env::var("REFUSION_GROWN_GGUF").expect("set REFUSION_GROWN_GGUF");
    let (exact, total) = golden_matches(Path::new(&path));
    println!("{path}: {exact} of {total} trained golden cases exact (tokens and TPF)");
    assert_eq!(exact, total);
}

/// (cases with the goldens' exact tokens and TPF, cases) over the trained tiny goldens.
fn golden_matches(path: &Path) -> (usize, usize) {
    let text = std::fs::read_to_string(fixtures().join("goldens_tiny.json")).unwrap();
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let cases = goldens["cases"].as_array().unwrap();
    let model = load(path);
    let mut exact = 0;
    for case in cases {
        let prompt = golden_ids(&case["prompt_ids"]);
        let p = golden_params(case);
        let capacity = prompt.len() + 2 * p.padded_gen_length() as usize + 8;
        let mut cache = model.new_cache(capacity, CacheType::F32, None).unwrap();
        let r = generate(&model, &mut cache, &prompt, &p, &mut |_| {}).unwrap();
        let same = r.tokens == golden_ids(&case["tokens"])
            && (r.tpf - case["tpf"].as_f64().unwrap()).abs() < 1e-6;
        if same {
            exact += 1;
        } else {
            eprintln!("{}: differs", case["id"]);
        }
    }
    (exact, cases.len())
}
