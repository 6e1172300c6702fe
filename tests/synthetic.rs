//! `convert --synthetic`: real-sized files with random weights for benchmarks and GPU checks.

mod common;

use std::sync::Arc;

use common::*;
use refusion::convert::gguf::{GgmlType, GgufFile};
use refusion::kv::CacheType;
use refusion::model::{Batch, Forward, Qwen3};

/// `convert --synthetic 0.6b --outtype q4_k_m` into `dir`.
fn synthetic_0_6b(dir: &std::path::Path) -> std::path::PathBuf {
    let out = dir.join("syn.gguf");
    let o = run(&[
        "convert",
        "--synthetic",
        "0.6b",
        "--outtype",
        "q4_k_m",
        "-o",
        out.to_str().unwrap(),
        "-q",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    out
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

    // candle's kernels (what runs without AVX-512 VNNI, and for Q8_0 and other types), with
    // weights read in place from the map and copied into memory (--no-mmap).
    let kernels_on = refusion::model::kquants::available();
    refusion::model::kquants::set_enabled(false);
    let load = |mmap| Qwen3::load_with(Arc::new(GgufFile::open(&out).unwrap()), None, mmap);
    let (mapped, copied) = (load(true), load(false));
    refusion::model::kquants::set_enabled(true);
    let (mapped, copied) = (mapped.unwrap(), copied.unwrap());
    let tokens: Vec<u32> = (0..9).map(|i| 100 + i * 997).collect();
    let positions: Vec<u32> = (0..9).collect();
    let logits_of = |m: &Qwen3, n: usize| {
        let mut cache = m.new_cache(16, CacheType::F32, None).unwrap();
        m.forward(&Batch::row(&tokens[..n], &positions[..n], 0), &mut cache)
            .unwrap()
    };
    for n in [1, 9] {
        // The same logits to the bit, for one row (candle's one-row kernels) and many.
        assert!(
            logits_of(&mapped, n).data == logits_of(&copied, n).data,
            "{n} tokens: mapped and copied weights differ"
        );

        // Our K-quant kernels against candle's on the whole model. Each product agrees with
        // candle's to ~1e-6 relative (unit tests, and `cargo bench --bench kquants`), but both
        // quantize every layer's input to 8 bits: a 1e-6 difference flips the rounding of a
        // few activations lying on a boundary, and through 28 layers the logits then differ by
        // about the 8-bit error itself (~1% of the largest logit), as any two implementations
        // do. A wrong scale or a misplaced row differs by far more. One token, 9 (two passes
        // of the tiled kernel), and the 7 padded rows of the 151671-row output. Without AVX2
        // both models run candle's kernels.
        if kernels_on {
            let ours = logits_of(&model, n);
            let want = logits_of(&mapped, n);
            let scale = want.data.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = ours
                .data
                .iter()
                .zip(&want.data)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                worst <= 0.02 * scale,
                "{n} tokens: logits differ by {worst} (largest {scale})"
            );
        }
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

/// Every kernel path this CPU runs (`REFUSION_CPU`) gives the same answer on a real-sized
/// Q4_K_M file: every row (the output matrix's last 7 in a padded run too) gets the same float
/// operations in the same order on 512- and 256-bit vectors. On a CPU with one path only this
/// checks the load line and the refusals; the kernels' own unit tests check each path's
/// products. An unknown or unavailable path is refused in one line, before loading.
#[test]
fn every_kernel_path_gives_the_same_answer() {
    let dir = tempfile::tempdir().unwrap();
    let out = synthetic_0_6b(dir.path());
    let generate = |path: &str| {
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
    };
    let ours: Vec<&str> = ["avx2", "avxvnni", "avx512"]
        .into_iter()
        .filter(|p| {
            refusion::model::kquants::CpuPath::runnable()
                .iter()
                .any(|r| r.name() == *p)
        })
        .collect();
    let mut answers = Vec::new();
    for path in &ours {
        let o = generate(path);
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
            tokens, &answers[0].1,
            "{path} differs from {}",
            answers[0].0
        );
    }
    let o = generate("generic");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("(kernels: candle)"), "{}", stderr(&o));
    let o = generate("sse9");
    assert_fails_with(&o, &["REFUSION_CPU=sse9: unknown kernel path"]);
}
