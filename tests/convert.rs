//! `refusion convert`, `quantize` and `info` on the public fixtures and on tiny checkpoints
//! built here in every layout a user downloads.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use common::*;
use refusion_convert::quant;
use refusion_gguf::{FileType, GgmlType, GgufFile, Value};

fn convert(dir: &Path, out: &Path, outtype: &str, extra: &[&str]) {
    let mut args = vec![
        "convert",
        dir.to_str().unwrap(),
        "--outfile",
        out.to_str().unwrap(),
        "--outtype",
        outtype,
        "-q",
    ];
    args.extend_from_slice(extra);
    let o = run(&args);
    assert!(o.status.success(), "convert failed:\n{}", stderr(&o));
    assert!(temporaries(out).is_empty());
}

fn decode(file: &GgufFile, name: &str) -> (GgmlType, Vec<u64>, Vec<f32>) {
    let t = file
        .header
        .tensor(name)
        .unwrap_or_else(|| panic!("no tensor {name}"));
    let mut v = vec![0f32; t.n_elements() as usize];
    assert!(quant::dequantize(t.ty, file.tensor_data(t), &mut v));
    (t.ty, t.ne.clone(), v)
}

fn rel_rmse(a: &[f32], b: &[f32]) -> f64 {
    let err: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let pow: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (err / pow.max(1e-30)).sqrt()
}

/// A bound on the relative RMSE of each type on the test weights.
fn bound(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::F32 => 0.0,
        GgmlType::F16 => 1e-3,
        GgmlType::BF16 => 5e-3,
        GgmlType::Q8_0 => 0.01,
        GgmlType::Q6_K => 0.03,
        GgmlType::Q5_K => 0.07,
        GgmlType::Q5_0 | GgmlType::Q5_1 => 0.085,
        GgmlType::Q4_K => 0.14,
        GgmlType::Q4_0 | GgmlType::Q4_1 => 0.17,
        GgmlType::Q3_K => 0.3,
        GgmlType::Q2_K => 0.5,
        other => panic!("unexpected type {other}"),
    }
}

fn meta<'a>(f: &'a GgufFile, key: &str) -> &'a Value {
    f.header
        .get(key)
        .unwrap_or_else(|| panic!("missing key {key}"))
}

fn meta_u64(f: &GgufFile, key: &str) -> u64 {
    meta(f, key)
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not an integer"))
}

#[test]
fn public_fixtures_convert_to_f32_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["pub-a", "pub-b", "pub-c"] {
        let dir = fixture_model(name);
        let out = tmp.path().join(format!("{name}.gguf"));
        convert(&dir, &out, "f32", &[]);
        let f = GgufFile::open(&out).unwrap();
        let cfg: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let tok_cfg: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
                .unwrap();

        assert_eq!(meta(&f, "general.architecture").as_str(), Some("qwen3"));
        assert_eq!(meta(&f, "general.name").as_str(), Some(name));
        assert_eq!(meta_u64(&f, "general.file_type"), 0);
        assert_eq!(meta_u64(&f, "general.quantization_version"), 2);
        for (key, hf) in [
            ("qwen3.block_count", "num_hidden_layers"),
            ("qwen3.context_length", "max_position_embeddings"),
            ("qwen3.embedding_length", "hidden_size"),
            ("qwen3.feed_forward_length", "intermediate_size"),
            ("qwen3.attention.head_count", "num_attention_heads"),
            ("qwen3.attention.head_count_kv", "num_key_value_heads"),
            ("qwen3.attention.key_length", "head_dim"),
            ("qwen3.attention.value_length", "head_dim"),
            ("tokenizer.ggml.eos_token_id", "eos_token_id"),
            ("tokenizer.ggml.mask_token_id", "mask_token_id"),
            ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ] {
            assert_eq!(meta_u64(&f, key), cfg[hf].as_u64().unwrap(), "{name} {key}");
        }
        assert_eq!(
            meta(&f, "qwen3.rope.freq_base").as_f64().unwrap(),
            cfg["rope_theta"].as_f64().unwrap()
        );
        let eps = meta(&f, "qwen3.attention.layer_norm_rms_epsilon")
            .as_f64()
            .unwrap();
        assert!((eps - cfg["rms_norm_eps"].as_f64().unwrap()).abs() < 1e-12);
        assert_eq!(meta(&f, "tokenizer.ggml.model").as_str(), Some("gpt2"));
        assert_eq!(meta(&f, "tokenizer.ggml.pre").as_str(), Some("qwen2"));
        assert_eq!(
            meta(&f, "tokenizer.ggml.add_bos_token").as_bool(),
            Some(false)
        );
        assert_eq!(
            meta(&f, "tokenizer.chat_template").as_str(),
            tok_cfg["chat_template"].as_str()
        );
        let vocab = cfg["vocab_size"].as_u64().unwrap() as usize;
        let tokens = meta(&f, "tokenizer.ggml.tokens").as_array().unwrap();
        let types = meta(&f, "tokenizer.ggml.token_type").as_array().unwrap();
        assert_eq!(tokens.len(), vocab);
        assert_eq!(types.len(), vocab);
        let mask = cfg["mask_token_id"].as_u64().unwrap() as usize;
        assert_eq!(tokens[mask].as_str(), Some("<|mask|>"));
        assert_eq!(types[mask], Value::I32(3), "mask is a control token");
        if name == "pub-b" {
            // ids 1000..1023 have weights but no token: llama.cpp's padding entries.
            assert_eq!(tokens[1000].as_str(), Some("[PAD1000]"));
            assert_eq!(types[1000], Value::I32(5));
        }
        assert_eq!(meta_u64(&f, "refusion.gen_length"), 512);
        assert_eq!(meta_u64(&f, "refusion.slot_size"), 4);
        assert_eq!(meta_u64(&f, "refusion.serial_num_blocks"), 32);

        let source = read_safetensors_f32(&dir.join("model.safetensors"));
        assert_eq!(f.header.tensors.len(), source.len());
        for (hf, (shape, values)) in &source {
            let (ty, ne, got) = decode(&f, &gguf_name(hf));
            assert_eq!(ty, GgmlType::F32);
            let rev: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            assert_eq!(ne, rev, "{name} {hf}");
            assert!(
                got.iter()
                    .zip(values)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name} {hf} differs"
            );
        }
        let tied = cfg["tie_word_embeddings"].as_bool().unwrap();
        assert_eq!(f.header.tensor("output.weight").is_some(), !tied, "{name}");
    }
}

/// Expected q4_k_m type of a tensor of the default tiny model (2 layers, rows of 256/512).
fn q4_k_m_type(name: &str, tied: bool) -> GgmlType {
    match name {
        "output.weight" => GgmlType::Q6_K,
        "token_embd.weight" if tied => GgmlType::Q6_K,
        // use_more_bits(1, 2): the last eighth of 2 layers is layer 1.
        "blk.1.attn_v.weight" | "blk.1.ffn_down.weight" => GgmlType::Q6_K,
        n if n.ends_with("norm.weight") => GgmlType::F32,
        _ => GgmlType::Q4_K,
    }
}

#[test]
fn tiny_checkpoints_in_every_layout_convert_to_q4_k_m() {
    let tmp = tempfile::tempdir().unwrap();
    let mut vocab_meta: Option<Vec<Value>> = None;
    let mut i = 0;
    for tokenizer in [TokLayout::Fast, TokLayout::Slow] {
        for tied in [false, true] {
            for (shards, dtype) in [(1, Dt::BF16), (3, Dt::F32), (2, Dt::F16)] {
                i += 1;
                let spec = Tiny {
                    tokenizer,
                    tied,
                    shards,
                    dtype,
                    seed: i,
                    ..Default::default()
                };
                let dir = tmp.path().join(format!("ckpt{i}"));
                let values = build_checkpoint(&dir, &spec);
                let out = tmp.path().join(format!("ckpt{i}.gguf"));
                convert(&dir, &out, "q4_k_m", &[]);
                let f = GgufFile::open(&out).unwrap();
                assert_eq!(
                    meta_u64(&f, "general.file_type"),
                    FileType::Q4_K_M.code() as u64
                );
                assert_eq!(meta_u64(&f, "tokenizer.ggml.mask_token_id"), 511);
                assert_eq!(
                    meta_u64(&f, "tokenizer.ggml.eos_token_id"),
                    508,
                    "eos comes from tokenizer_config"
                );
                assert_eq!(meta_u64(&f, "tokenizer.ggml.padding_token_id"), 506);
                // Both tokenizer layouts give the same vocabulary, types and merges.
                let v: Vec<Value> = [
                    "tokenizer.ggml.tokens",
                    "tokenizer.ggml.token_type",
                    "tokenizer.ggml.merges",
                ]
                .iter()
                .map(|k| meta(&f, k).clone())
                .collect();
                match &vocab_meta {
                    None => vocab_meta = Some(v),
                    Some(first) => assert!(first == &v, "tokenizer metadata differs for {spec:?}"),
                }
                assert_eq!(f.header.tensors.len(), values.len(), "{spec:?}");
                for (hf, (_, x)) in &values {
                    let name = gguf_name(hf);
                    let (ty, _, y) = decode(&f, &name);
                    assert_eq!(ty, q4_k_m_type(&name, tied), "{name} in {spec:?}");
                    let e = rel_rmse(x, &y);
                    assert!(e <= bound(ty), "{name}: rel rmse {e} for {ty} in {spec:?}");
                }
            }
        }
    }
}

#[test]
fn every_outtype_gives_its_types_and_error_bounds() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let values = build_checkpoint(
        &dir,
        &Tiny {
            layers: 1,
            ..Default::default()
        },
    );
    for ftype in FileType::ALL {
        let out = tmp.path().join(format!("{}.gguf", ftype.name()));
        convert(&dir, &out, ftype.name(), &[]);
        let f = GgufFile::open(&out).unwrap();
        assert_eq!(meta_u64(&f, "general.file_type"), ftype.code() as u64);
        let (ty, _, _) = decode(&f, "blk.0.attn_q.weight");
        assert_eq!(ty, ftype.base_type(), "{ftype}: attn_q gets the base type");
        for (hf, (_, x)) in &values {
            let (ty, ne, y) = decode(&f, &gguf_name(hf));
            if ne.len() == 1 {
                assert_eq!(ty, GgmlType::F32);
            }
            let e = rel_rmse(x, &y);
            assert!(e <= bound(ty), "{ftype} {hf}: rel rmse {e} for {ty}");
        }
    }
}

#[test]
fn bf16_checkpoint_to_bf16_and_f32_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let values = build_checkpoint(
        &dir,
        &Tiny {
            dtype: Dt::BF16,
            layers: 1,
            ..Default::default()
        },
    );
    for outtype in ["bf16", "f32"] {
        let out = tmp.path().join(format!("{outtype}.gguf"));
        convert(&dir, &out, outtype, &[]);
        let f = GgufFile::open(&out).unwrap();
        for (hf, (_, x)) in &values {
            let (_, _, y) = decode(&f, &gguf_name(hf));
            assert!(
                x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{outtype} {hf}"
            );
        }
    }
}

#[test]
fn pure_and_per_tensor_overrides() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    build_checkpoint(&dir, &Tiny::default());
    let out = tmp.path().join("pure.gguf");
    convert(&dir, &out, "q4_k_m", &["--pure"]);
    let f = GgufFile::open(&out).unwrap();
    for name in ["output.weight", "blk.1.attn_v.weight", "token_embd.weight"] {
        assert_eq!(decode(&f, name).0, GgmlType::Q4_K, "{name}");
    }
    let out = tmp.path().join("over.gguf");
    convert(
        &dir,
        &out,
        "q4_k_m",
        &[
            "--output-tensor-type",
            "q8_0",
            "--token-embedding-type",
            "f16",
        ],
    );
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(decode(&f, "output.weight").0, GgmlType::Q8_0);
    assert_eq!(decode(&f, "token_embd.weight").0, GgmlType::F16);
    assert_eq!(decode(&f, "blk.1.attn_v.weight").0, GgmlType::Q6_K);
}

#[test]
fn short_rows_fall_back_like_llama_cpp() {
    // pub-b: hidden 96, head_dim 24 (q rows of 144): no k-quant fits a 96-long row.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("b.gguf");
    convert(&fixture_model("pub-b"), &out, "q4_k_m", &[]);
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(decode(&f, "blk.0.attn_q.weight").0, GgmlType::Q5_0);
    assert_eq!(
        decode(&f, "blk.0.attn_output.weight").0,
        GgmlType::F16,
        "144 is not a multiple of 32"
    );
    assert_eq!(
        decode(&f, "blk.0.ffn_down.weight").0,
        GgmlType::Q4_K,
        "rows of 256 fit"
    );
    assert_eq!(decode(&f, "blk.2.ffn_down.weight").0, GgmlType::Q6_K);
    assert_eq!(decode(&f, "output.weight").0, GgmlType::Q8_0);
}

#[test]
fn decoding_defaults_are_stored_and_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    let dir = fixture_model("pub-a");
    convert(
        &dir,
        &out,
        "q8_0",
        &[
            "--gen-length",
            "256",
            "--slot-size",
            "8",
            "--serial-blocks",
            "4",
            "--slot-threshold",
            "0.9",
            "--token-threshold",
            "0.4",
        ],
    );
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(meta_u64(&f, "refusion.gen_length"), 256);
    assert_eq!(meta_u64(&f, "refusion.slot_size"), 8);
    assert_eq!(meta_u64(&f, "refusion.serial_num_blocks"), 4);
    assert_eq!(meta(&f, "refusion.slot_threshold"), &Value::F32(0.9));
    assert_eq!(meta(&f, "refusion.token_threshold"), &Value::F32(0.4));

    let bad = tmp.path().join("bad.gguf");
    let o = run(&[
        "convert",
        dir.to_str().unwrap(),
        "-o",
        bad.to_str().unwrap(),
        "--serial-blocks",
        "3",
    ]);
    assert_fails_with(&o, &["serial blocks", "1, 2, 4, 8"]);
    assert!(!bad.exists());
    let o = run(&[
        "convert",
        dir.to_str().unwrap(),
        "-o",
        bad.to_str().unwrap(),
        "--token-threshold",
        "1.5",
    ]);
    assert_fails_with(&o, &["token threshold must be in [0, 1]"]);
}

#[test]
fn conversion_is_deterministic_and_quantize_matches_convert() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    build_checkpoint(
        &dir,
        &Tiny {
            dtype: Dt::F32,
            ..Default::default()
        },
    );
    let a = tmp.path().join("a.gguf");
    let b = tmp.path().join("b.gguf");
    convert(&dir, &a, "q4_k_m", &["-t", "1"]);
    convert(&dir, &b, "q4_k_m", &["-t", "2"]);
    assert!(
        fs::read(&a).unwrap() == fs::read(&b).unwrap(),
        "same input, same bytes"
    );

    // f32 GGUF requantized == direct conversion, byte for byte.
    let f32_file = tmp.path().join("f32.gguf");
    convert(&dir, &f32_file, "f32", &[]);
    let q = tmp.path().join("q.gguf");
    let o = run(&[
        "quantize",
        f32_file.to_str().unwrap(),
        q.to_str().unwrap(),
        "q4_k_m",
        "-q",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        fs::read(&q).unwrap() == fs::read(&a).unwrap(),
        "quantize and convert agree"
    );

    // An already quantized input is refused, and nothing is written.
    let again = tmp.path().join("again.gguf");
    let o = run(&[
        "quantize",
        q.to_str().unwrap(),
        again.to_str().unwrap(),
        "q4_0",
    ]);
    assert_fails_with(&o, &["already quantized"]);
    assert!(!again.exists());
}

#[test]
fn info_prints_metadata_and_tensor_table() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert(&fixture_model("pub-a"), &out, "q8_0", &[]);
    let o = run(&["info", out.to_str().unwrap()]);
    assert!(o.status.success());
    let text = stdout(&o);
    for needle in [
        "GGUF v3",
        "Q8_0",
        "general.architecture",
        "\"qwen3\"",
        "tokenizer.ggml.mask_token_id",
        "= 511",
        "token_embd.weight",
        "blk.1.ffn_down.weight",
        "q8_0",
        "[160, 64]",
    ] {
        assert!(text.contains(needle), "info lacks {needle:?}:\n{text}");
    }
}

#[test]
fn an_independent_reader_accepts_our_files() {
    use gguf_rs_lib::prelude::*;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert(&fixture_model("pub-c"), &out, "q4_k_m", &[]);
    let file = fs::File::open(&out).unwrap();
    let reader = GGUFFileReader::new(std::io::BufReader::new(file)).expect("gguf-rs-lib reads it");
    assert_eq!(reader.header().version, 3);
    let ours = GgufFile::open(&out).unwrap();
    assert_eq!(reader.tensor_count(), ours.header.tensors.len());
    assert_eq!(reader.metadata().len(), ours.header.metadata.len());
}

/// The real ReFusion tokenizer (151671 entries, `<|mask|>` at 151670) in the slow layout the
/// ReFusion repository ships, on a tiny model with the real vocabulary size.
#[test]
fn refusion_tokenizer_in_the_slow_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("refusion-tiny");
    build_refusion_vocab_checkpoint(&dir, TokLayout::Slow);
    let real = fixtures().join("tokenizers/refusion");
    let out = tmp.path().join("r.gguf");
    convert(&dir, &out, "q8_0", &[]);
    let f = GgufFile::open(&out).unwrap();
    let tokens = meta(&f, "tokenizer.ggml.tokens").as_array().unwrap();
    let types = meta(&f, "tokenizer.ggml.token_type").as_array().unwrap();
    assert_eq!(tokens.len(), 151671);
    assert_eq!(tokens[151670].as_str(), Some("<|mask|>"));
    assert_eq!(tokens[151669].as_str(), Some("<|beginoftext|>"));
    assert_eq!(tokens[151645].as_str(), Some("<|im_end|>"));
    assert_eq!(types[151645], Value::I32(3));
    assert_eq!(
        types[151667],
        Value::I32(4),
        "<think> is user-defined, not control"
    );
    assert_eq!(meta_u64(&f, "tokenizer.ggml.mask_token_id"), 151670);
    assert_eq!(meta_u64(&f, "tokenizer.ggml.eos_token_id"), 151645);
    assert_eq!(meta_u64(&f, "tokenizer.ggml.padding_token_id"), 151643);
    let merges = meta(&f, "tokenizer.ggml.merges").as_array().unwrap();
    assert!(merges.len() > 150_000);
    let template = meta(&f, "tokenizer.chat_template").as_str().unwrap();
    assert!(template.contains("<|im_start|>"));

    // The same vocabulary through tokenizer.json.
    let fast_dir = tmp.path().join("fast");
    fs::create_dir(&fast_dir).unwrap();
    for entry in fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if !["vocab.json", "merges.txt", "added_tokens.json"].contains(&name.as_str()) {
            fs::copy(&p, fast_dir.join(&name)).unwrap();
        }
    }
    fs::copy(real.join("tokenizer.json"), fast_dir.join("tokenizer.json")).unwrap();
    let out2 = tmp.path().join("r2.gguf");
    convert(&fast_dir, &out2, "q8_0", &[]);
    let g = GgufFile::open(&out2).unwrap();
    let keys: BTreeMap<_, _> = [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    ]
    .iter()
    .map(|k| (k.to_string(), meta(&g, k) == meta(&f, k)))
    .collect();
    assert!(
        keys.values().all(|&same| same),
        "layouts disagree: {keys:?}"
    );
}

/// One truth per number: `convert` and `info` report the same bits per weight (tensor data
/// over weights, as llama.cpp counts them), for a plain and a mixed type.
#[test]
fn convert_and_info_agree_on_bits_per_weight() {
    let tmp = tempfile::tempdir().unwrap();
    let bpw = |text: &str| -> String {
        let at = text.find(" bits per weight").expect(text);
        let start = text[..at].rfind([' ', '(']).unwrap() + 1;
        text[start..at].to_string()
    };
    for outtype in ["q8_0", "q4_k_m"] {
        let out = tmp.path().join(format!("{outtype}.gguf"));
        let o = run(&[
            "convert",
            fixture_model("pub-a").to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--outtype",
            outtype,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let info = run(&["info", out.to_str().unwrap()]);
        assert!(info.status.success(), "{}", stderr(&info));
        assert_eq!(bpw(&stderr(&o)), bpw(&stdout(&info)), "{outtype}");
    }
}
