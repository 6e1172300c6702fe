//! `convert --synthetic`: real-sized files with random weights for benchmarks and GPU checks.

mod common;

use std::sync::Arc;

use common::*;
use refusion_engine::kv::CacheType;
use refusion_engine::model::{Batch, Forward, Qwen3};
use refusion_gguf::{GgmlType, GgufFile};

/// `convert --synthetic 0.6b --outtype q4_k_m` into `dir`.
fn synthetic_0_6b(dir: &std::path::Path) -> std::path::PathBuf {
    synthetic_0_6b_as(dir, "q4_k_m")
}

/// The logits of `tokens[..n]` from a fresh cache.
fn logits_of(m: &Qwen3, tokens: &[u32], n: usize) -> Vec<f32> {
    let positions: Vec<u32> = (0..n as u32).collect();
    let mut cache = m.new_cache(16, CacheType::F32, None).unwrap();
    m.forward(&Batch::row(&tokens[..n], &positions, 0), &mut cache)
        .unwrap()
        .data
}

#[test]
fn a_synthetic_qwen3_0_6b_has_the_real_shapes_and_types_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = synthetic_0_6b(dir.path());
    let file = Arc::new(GgufFile::open(&out).unwrap());
    let h = &file.header;
    let t = |n: &str| h.tensor(n).unwrap_or_else(|| panic!("{n} missing"));
    assert_eq!(t("blk.0.ffn_up.weight").ne, vec![1024, 3072]);
    assert_eq!(t("blk.27.attn_k.weight").ne, vec![1024, 1024]);
    assert_eq!(t("token_embd.weight").ne, vec![1024, 151_671]);
    assert!(h.tensor("output.weight").is_none(), "0.6B ties its output");
    // llama.cpp's Q4_K_M mix: Q4_K with Q6_K for some ffn_down/attn_v.
    assert_eq!(t("blk.1.attn_q.weight").ty, GgmlType::Q4_K);
    assert_eq!(t("blk.0.ffn_down.weight").ty, GgmlType::Q6_K);
    let model = Qwen3::load_offloaded(file, None).unwrap();
    let mut cache = model.new_cache(16, CacheType::F32, None).unwrap();
    let logits = model
        .forward(&Batch::row(&[1, 2, 3], &[0, 1, 2], 0), &mut cache)
        .unwrap();
    assert_eq!(logits.n(), 3);
    assert!(logits.data.iter().all(|x| x.is_finite()));
    // A different logit for different inputs: the weights are not all alike.
    assert_ne!(logits.row(0), logits.row(2));

    // candle's kernels (what runs without ours, and for other types), with weights read in
    // place from the map and copied into memory (--no-mmap). (The switch is process-wide; no
    // other test here loads a model in this process. Our kernels against candle's:
    // tests/kernel_accuracy.rs.)
    refusion_engine::model::kquants::set_enabled(false);
    let load = |mmap| Qwen3::load_with(Arc::new(GgufFile::open(&out).unwrap()), None, mmap);
    let (mapped, copied) = (load(true), load(false));
    refusion_engine::model::kquants::set_enabled(true);
    let (mapped, copied) = (mapped.unwrap(), copied.unwrap());
    let tokens: Vec<u32> = (0..9).map(|i| 100 + i * 997).collect();
    for n in [1, 9] {
        // The same logits to the bit, for one row (candle's one-row kernels) and many.
        assert!(
            logits_of(&mapped, &tokens, n) == logits_of(&copied, &tokens, n),
            "{n} tokens: mapped and copied weights differ"
        );
    }
}

#[test]
fn an_unknown_synthetic_shape_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.gguf");
    let o = run(&["convert", "--synthetic", "70b", "-o", out.to_str().unwrap()]);
    assert_fails_with(&o, &["unknown synthetic shape '70b'", "8b"]);
    assert!(!out.exists());
}

/// Every kernel path this CPU runs (`REFUSION_CPU`) gives the same answer on real-sized
/// Q4_K_M, Q8_0 and Q5_K_M files: every row (the output matrix's last 7 in a padded run too)
/// gets the same float operations in the same order on 512-, 256- and 128-bit vectors. On a
/// CPU with one path only this checks the load line and the refusals; the kernels' own unit
/// tests check each path's products. An unknown or unavailable path is refused in one line,
/// before loading.
#[test]
fn every_kernel_path_gives_the_same_answer() {
    let dir = tempfile::tempdir().unwrap();
    let out = synthetic_0_6b(dir.path());
    for outtype in ["q8_0", "q5_k_m"] {
        let other = synthetic_0_6b_as(dir.path(), outtype);
        same_answer_on_every_path(&other);
        std::fs::remove_file(&other).unwrap();
    }
    same_answer_on_every_path(&out);
    let o = generate_on(&out, "generic");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("(kernels: candle)"), "{}", stderr(&o));
    let o = generate_on(&out, "sse9");
    assert_fails_with(&o, &["REFUSION_CPU=sse9: unknown kernel path"]);
    // The default path (on AMD, one-row products on the 256-bit kernels) gives the same
    // tokens as every forced one; a bad prefetch distance is refused in one line.
    use refusion_engine::model::kquants::CpuPath;
    let default = generate_on(&out, "");
    assert!(default.status.success(), "{}", stderr(&default));
    let forced = generate_on(&out, CpuPath::detect().name());
    let tokens = |o: &std::process::Output| {
        serde_json::from_str::<serde_json::Value>(&stdout(o)).unwrap()["tokens"].clone()
    };
    assert_eq!(tokens(&default), tokens(&forced));
    let o = std::process::Command::new(bin())
        .env("REFUSION_PREFETCH", "far")
        .args([
            "generate",
            "-m",
            out.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "-n",
            "4",
        ])
        .output()
        .unwrap();
    assert_fails_with(&o, &["REFUSION_PREFETCH=far: expected a number of tiles"]);
}

/// 16 tokens from `file` with `REFUSION_CPU=path`.
fn generate_on(out: &std::path::Path, path: &str) -> std::process::Output {
    {
        std::process::Command::new(bin())
            .env("REFUSION_CPU", path)
            .env_remove("REFUSION_NO_NATIVE_KQUANTS")
            .args([
                "generate",
                "-m",
                out.to_str().unwrap(),
                "--prompt-ids",
                "1,2,3,4,5",
            ])
            .args([
                "-n",
                "16",
                "--slot-size",
                "4",
                "--serial-blocks",
                "2",
                "-c",
                "64",
                "-t",
                "2",
            ])
            .arg("--json")
            .output()
            .unwrap()
    }
}

/// The same tokens from `out` on each of our kernel paths this CPU runs.
fn same_answer_on_every_path(out: &std::path::Path) {
    use refusion_engine::model::kquants::CpuPath;
    let ours: Vec<&str> = CpuPath::runnable()
        .into_iter()
        .filter(|&p| p != CpuPath::Generic)
        .map(|p| p.name())
        .collect();
    let mut answers = Vec::new();
    for path in &ours {
        let o = generate_on(out, path);
        assert!(o.status.success(), "{path}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(&format!("(kernels: {path})")),
            "{}",
            stderr(&o)
        );
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        answers.push((path, v["tokens"].clone()));
    }
    for (path, tokens) in &answers {
        assert_eq!(
            tokens,
            &answers[0].1,
            "{} on {path} differs from {}",
            out.display(),
            answers[0].0
        );
    }
}
