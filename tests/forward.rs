//! The forward engine against transformers' f32 logits (tests/fixtures/forward.json): prefill,
//! a planning call with non-contiguous masked positions, a commit, and two rows over a shared
//! cache, in that order on one cache.

mod common;

use std::path::Path;
use std::sync::Arc;

use candle_core::Device;
use common::*;
use refusion_engine::kv::{CacheType, KvCache};
use refusion_engine::model::{Batch, Forward, LogitsFor, Qwen3};
use refusion_gguf::GgufFile;
use serde_json::Value;

fn load_forward_json() -> Value {
    let text = std::fs::read_to_string(fixtures().join("forward.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Builds the batch of a forward.json call: every row's tokens, row ids 0.., flat.
fn batch_of(call: &Value) -> Batch {
    let mut b = Batch::default();
    for (r, (toks, pos)) in call["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .zip(call["positions"].as_array().unwrap())
        .enumerate()
    {
        let toks = golden_ids(toks);
        b.rows.extend(std::iter::repeat_n(r as u32, toks.len()));
        b.tokens.extend(toks);
        b.positions.extend(golden_ids(pos));
    }
    b.logits_for = LogitsFor::All;
    b
}

/// Largest violation of |got - ref| <= tol * (1 + |ref|), and whether every argmax agrees.
fn compare(call: &Value, got: &refusion_engine::model::Logits, tol: f32) -> (f32, bool) {
    let mut worst = 0f32;
    let mut argmax_ok = true;
    let mut i = 0;
    for row in call["logits"].as_array().unwrap() {
        for tok in row.as_array().unwrap() {
            let want: Vec<f32> = tok
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect();
            let have = got.row(i);
            assert_eq!(have.len(), want.len());
            for (h, w) in have.iter().zip(&want) {
                worst = worst.max((h - w).abs() / (tol * (1.0 + w.abs())));
            }
            let am = |v: &[f32]| {
                v.iter()
                    .enumerate()
                    .fold(0, |b, (j, &x)| if x > v[b] { j } else { b })
            };
            argmax_ok &= am(have) == am(&want);
            i += 1;
        }
    }
    (worst, argmax_ok)
}

fn run_calls(
    model: &Qwen3,
    calls: &Value,
    cache_type: CacheType,
    tol: f32,
) -> Vec<(String, f32, bool)> {
    let mut cache = KvCache::new(model.cache_shape(64), cache_type).unwrap();
    let mut results = Vec::new();
    for name in ["prefill", "plan", "commit", "rows"] {
        let call = &calls[name];
        let logits = model.forward(&batch_of(call), &mut cache).unwrap();
        let (worst, argmax) = compare(call, &logits, tol);
        results.push((name.to_string(), worst, argmax));
        match name {
            "prefill" | "commit" => cache.commit_row(0).unwrap(),
            "plan" => cache.clear_rows(),
            _ => {}
        }
        let expect_shared = match name {
            "prefill" | "plan" => 7,
            _ => 11,
        };
        assert_eq!(cache.shared_len(), expect_shared, "after {name}");
    }
    results
}

#[test]
fn forward_matches_transformers_at_f32() {
    let fw = load_forward_json();
    let tmp = tempfile::tempdir().unwrap();
    for name in ["pub-a", "pub-b", "pub-c"] {
        let out = tmp.path().join(format!("{name}.gguf"));
        convert_quiet(&fixture_model(name), &out, "f32");
        let file = Arc::new(GgufFile::open(&out).unwrap());
        let model = Qwen3::load(file, &Device::Cpu).unwrap();
        for (call, worst, argmax) in run_calls(&model, &fw["models"][name], CacheType::F32, 1e-4) {
            assert!(
                worst <= 1.0,
                "{name} {call}: error {worst} x the 1e-4 bound"
            );
            assert!(argmax, "{name} {call}: argmax differs");
        }
    }
}

/// Relative L2 error of all logits of a call.
fn rel_l2(call: &Value, got: &refusion_engine::model::Logits) -> f64 {
    let want: Vec<f64> = call["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .flat_map(|t| t.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
        })
        .collect();
    let err: f64 = want
        .iter()
        .zip(&got.data)
        .map(|(w, g)| (w - *g as f64).powi(2))
        .sum();
    let pow: f64 = want.iter().map(|w| w * w).sum();
    (err / pow).sqrt()
}

#[test]
fn forward_with_f16_cache_and_quantized_weights_stays_close() {
    let fw = load_forward_json();
    let tmp = tempfile::tempdir().unwrap();
    let name = "pub-b";
    // Relative L2 bounds: an f16 cache rounds K/V; Q8_0 also quantizes activations. These
    // random models amplify small errors (logits up to ~40): llama.cpp itself is 3.5e-2 off on
    // the Q8_0 prefill. A wrong layout or head mapping gives errors of order 1.
    for (outtype, cache_type, bound) in [
        ("f32", CacheType::F16, 2e-3),
        ("q8_0", CacheType::F32, 0.08),
    ] {
        let out = tmp.path().join(format!("{name}-{outtype}.gguf"));
        convert_quiet(&fixture_model(name), &out, outtype);
        let model = Qwen3::load(Arc::new(GgufFile::open(&out).unwrap()), &Device::Cpu).unwrap();
        let calls = &fw["models"][name];
        let mut cache = KvCache::new(model.cache_shape(64), cache_type).unwrap();
        for call_name in ["prefill", "plan", "commit", "rows"] {
            let call = &calls[call_name];
            let logits = model.forward(&batch_of(call), &mut cache).unwrap();
            let e = rel_l2(call, &logits);
            eprintln!("{outtype}/{cache_type:?} {call_name}: relative error {e:.2e}");
            assert!(
                e <= bound,
                "{outtype}/{cache_type:?} {call_name}: relative error {e} > {bound}"
            );
            match call_name {
                "prefill" | "commit" => cache.commit_row(0).unwrap(),
                "plan" => cache.clear_rows(),
                _ => {}
            }
        }
    }
}

#[test]
fn logits_for_a_subset_and_full_context_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    let model = Qwen3::load(Arc::new(GgufFile::open(&out).unwrap()), &Device::Cpu).unwrap();
    let toks = [5u32, 9, 13, 200];
    let pos = [0u32, 1, 2, 3];
    let mut cache = KvCache::new(model.cache_shape(8), CacheType::F32).unwrap();
    let all = model
        .forward(&Batch::row(&toks, &pos, 0), &mut cache)
        .unwrap();
    cache.clear_rows();
    let mut b = Batch::row(&toks, &pos, 0);
    b.logits_for = LogitsFor::Indices(vec![3, 1]);
    let some = model.forward(&b, &mut cache).unwrap();
    assert_eq!(some.n(), 2);
    for (j, &i) in [3usize, 1].iter().enumerate() {
        for (a, b) in some.row(j).iter().zip(all.row(i)) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()));
        }
    }
    cache.commit_row(0).unwrap();
    let err = model
        .forward(&Batch::row(&[1; 5], &[4, 5, 6, 7, 8], 0), &mut cache)
        .unwrap_err();
    assert!(err.to_string().contains("context is full"), "{err}");
    let err = model
        .forward(&Batch::row(&[100_000], &[4], 0), &mut cache)
        .unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
}

/// A qwen3 GGUF written by llama.cpp's own `gguf` library (not by us), and the same file
/// marked GGUF v2, load and give transformers' logits.
#[test]
fn files_written_by_llama_cpp_s_gguf_library_and_v2_files_load() {
    let python = std::env::var("REFUSION_PYTHON").unwrap_or_else(|_| "python3".into());
    let fw = load_forward_json();
    let tmp = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/write_with_gguf_py.py");
    for name in ["pub-b", "pub-c"] {
        let out = tmp.path().join(format!("{name}-gguf-py.gguf"));
        let o = std::process::Command::new(&python)
            .arg(&script)
            .arg(fixture_model(name))
            .arg(&out)
            .output()
            .expect("python3 with gguf and numpy is needed");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v2 = tmp.path().join(format!("{name}-v2.gguf"));
        let mut bytes = std::fs::read(&out).unwrap();
        bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
        std::fs::write(&v2, bytes).unwrap();
        for file in [&out, &v2] {
            let model = Qwen3::load(Arc::new(GgufFile::open(file).unwrap()), &Device::Cpu).unwrap();
            for (call, worst, argmax) in
                run_calls(&model, &fw["models"][name], CacheType::F32, 1e-4)
            {
                assert!(
                    worst <= 1.0 && argmax,
                    "{} {call}: error {worst}",
                    file.display()
                );
            }
            let t =
                refusion_engine::chat::Tokenizer::from_gguf(&GgufFile::open(file).unwrap().header)
                    .unwrap();
            assert!(t.mask_id.is_some());
        }
    }
}

/// Embedding rows are read from the file (not through the map): the same bytes as the map
/// holds, and a read past the tensor's end is refused, naming it.
#[test]
fn tensor_bytes_read_from_the_file_match_the_map() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "q8_0");
    let file = GgufFile::open(&out).unwrap();
    let t = file.header.tensor("token_embd.weight").unwrap().clone();
    let mapped = file.tensor_data(&t).to_vec();
    let mut buf = vec![0u8; 100];
    for offset in [0, 34, t.n_bytes - 100] {
        file.read_tensor_bytes(&t, offset, &mut buf).unwrap();
        assert_eq!(buf[..], mapped[offset as usize..offset as usize + 100]);
    }
    let err = file
        .read_tensor_bytes(&t, t.n_bytes - 99, &mut buf)
        .unwrap_err();
    assert!(err.to_string().contains("token_embd.weight"), "{err}");
    let err = file.read_tensor_bytes(&t, u64::MAX, &mut buf).unwrap_err();
    assert!(err.to_string().contains("past the end"), "{err}");
}

/// The host path (plain buffers, our kernels, element-wise work on the worker pool) gives the
/// logits of candle's tensor path to the bit, on the trained tiny model's quantized files (its
/// rows are multiples of 256, so every weight runs on our kernels): a prompt, a planning call
/// with masks, and a batch of several rows large enough for the parallel element-wise work.
#[test]
fn the_host_path_gives_the_tensor_paths_logits_to_the_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = trained_tiny();
    for outtype in ["q8_0", "q4_k_m"] {
        let out = tmp.path().join(format!("{outtype}.gguf"));
        convert_quiet(&ckpt, &out, outtype);
        let file = Arc::new(GgufFile::open(&out).unwrap());
        let host = Qwen3::load(file.clone(), &Device::Cpu).unwrap();
        let mut tensors = Qwen3::load(file, &Device::Cpu).unwrap();
        tensors.use_tensor_path();
        assert!(host.uses_host_path() && !tensors.uses_host_path());
        let vocab = host.config().vocab as u32;
        let mask = vocab - 1;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % (vocab - 8)).collect();
        let prefill = Batch::row(&prompt, &(0..40).collect::<Vec<_>>(), 0);
        // Planning: 16 masks after the prompt, logits for all.
        let plan = Batch::row(&[mask; 16], &(40..56).collect::<Vec<_>>(), 0);
        // 12 rows of 8 tokens, logits for every other token.
        let mut rows = Batch::default();
        for r in 0..12u32 {
            for j in 0..8u32 {
                rows.push((r * 101 + j * 7) % (vocab - 8), 40 + r * 8 + j, r);
            }
        }
        rows.logits_for = LogitsFor::Indices((0..96).step_by(2).collect());
        let mut caches: Vec<KvCache> = (0..2)
            .map(|_| KvCache::new(host.cache_shape(256), CacheType::F32).unwrap())
            .collect();
        for (name, b) in [("prefill", &prefill), ("plan", &plan), ("rows", &rows)] {
            let a = host.forward(b, &mut caches[0]).unwrap();
            let t = tensors.forward(b, &mut caches[1]).unwrap();
            assert_eq!(a.data.len(), t.data.len(), "{outtype} {name}");
            let differ = a
                .data
                .iter()
                .zip(&t.data)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            assert_eq!(differ, 0, "{outtype} {name}: {differ} logits differ");
            for c in &mut caches {
                match name {
                    "prefill" => c.commit_row(0).unwrap(),
                    _ => c.clear_rows(),
                }
            }
        }
    }
}
