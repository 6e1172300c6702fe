//! `convert --synthetic`: real-sized files with random weights for benchmarks and GPU checks.

mod common;

use std::sync::Arc;

use common::*;
use refusion::convert::gguf::{GgmlType, GgufFile};
use refusion::kv::CacheType;
use refusion::model::{Batch, Forward, Qwen3};

#[test]
fn a_synthetic_qwen3_0_6b_has_the_real_shapes_and_types_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("syn.gguf");
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

    // Weights read in place from the map and weights copied into memory (--no-mmap) give the
    // same logits to the bit, for one row (the direct kernels) and many (interleaved tiles).
    let copied = Qwen3::load_with(Arc::new(GgufFile::open(&out).unwrap()), None, false).unwrap();
    let tokens: Vec<u32> = (0..9).map(|i| 100 + i * 997).collect();
    let positions: Vec<u32> = (0..9).collect();
    for n in [1, 9] {
        let batch = Batch::row(&tokens[..n], &positions[..n], 0);
        let mut a = model.new_cache(16, CacheType::F32, None).unwrap();
        let mut b = copied.new_cache(16, CacheType::F32, None).unwrap();
        let la = model.forward(&batch, &mut a).unwrap();
        let lb = copied.forward(&batch, &mut b).unwrap();
        assert!(
            la.data == lb.data,
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
