//! Loading a broken model file: a clear error naming the file and the problem, never a panic
//! deep inside a matmul.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::*;
use refusion_gguf::{GgufFile, GgufWriter, TensorSpec, Value};

/// Converts pub-a to f32 and returns the path.
fn base(tmp: &Path) -> PathBuf {
    let out = tmp.join("base.gguf");
    let o = run(&[
        "convert",
        fixture_model("pub-a").to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--outtype",
        "f32",
        "-q",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    out
}

/// Rewrites a GGUF with edited metadata and tensors (tensor data kept as is).
fn rewrite(
    src: &Path,
    dst: &Path,
    edit_meta: impl Fn(&mut Vec<(String, Value)>),
    keep_tensor: impl Fn(&str) -> bool,
    edit_shape: impl Fn(&str, &mut Vec<u64>),
) {
    let f = GgufFile::open(src).unwrap();
    let mut meta = f.header.metadata.clone();
    edit_meta(&mut meta);
    let mut specs = Vec::new();
    let mut datas = Vec::new();
    for t in &f.header.tensors {
        if !keep_tensor(&t.name) {
            continue;
        }
        let mut ne = t.ne.clone();
        edit_shape(&t.name, &mut ne);
        specs.push(TensorSpec {
            name: t.name.clone(),
            ne: ne.clone(),
            ty: t.ty,
        });
        let want = TensorSpec {
            name: t.name.clone(),
            ne,
            ty: t.ty,
        }
        .n_bytes()
        .unwrap() as usize;
        let mut data = f.tensor_data(t).to_vec();
        data.resize(want, 0);
        datas.push(data);
    }
    let mut w = GgufWriter::new(fs::File::create(dst).unwrap(), &meta, &specs).unwrap();
    for d in &datas {
        w.write_data(d).unwrap();
    }
    w.finish().unwrap();
}

fn set(meta: &mut [(String, Value)], key: &str, v: Value) {
    meta.iter_mut().find(|(k, _)| k == key).unwrap().1 = v;
}

fn bench_fails(file: &Path, needles: &[&str]) {
    let o = run(&[
        "bench",
        "-m",
        file.to_str().unwrap(),
        "-p",
        "1",
        "-r",
        "1",
        "-d",
        "4",
    ]);
    let mut all = vec![file.to_str().unwrap()];
    all.extend_from_slice(needles);
    assert_fails_with(&o, &all);
}

#[test]
fn truncated_and_foreign_files() {
    let tmp = tempfile::tempdir().unwrap();
    let good = base(tmp.path());
    let bytes = fs::read(&good).unwrap();
    for cut in [3usize, 64, 2_000, bytes.len() / 2, bytes.len() - 1] {
        let p = tmp.path().join(format!("cut{cut}.gguf"));
        fs::write(&p, &bytes[..cut]).unwrap();
        bench_fails(&p, &[]);
    }
    let p = tmp.path().join("text.gguf");
    fs::write(&p, "not a model at all").unwrap();
    bench_fails(&p, &["not a GGUF file"]);
    let p = tmp.path().join("missing.gguf");
    bench_fails(&p, &["No such file"]);
}

#[test]
fn missing_tensor_wrong_shapes_and_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let good = base(tmp.path());
    let p = tmp.path().join("no-up.gguf");
    rewrite(&good, &p, |_| {}, |n| n != "blk.1.ffn_up.weight", |_, _| {});
    bench_fails(&p, &["tensor blk.1.ffn_up.weight is missing"]);

    let p = tmp.path().join("kv-heads.gguf");
    rewrite(
        &good,
        &p,
        |m| set(m, "qwen3.attention.head_count_kv", Value::U32(1)),
        |_| true,
        |_, _| {},
    );
    bench_fails(
        &p,
        &[
            "tensor blk.0.attn_k.weight has shape [64, 64]",
            "implies [64, 32]",
        ],
    );

    let p = tmp.path().join("ffn.gguf");
    rewrite(
        &good,
        &p,
        |_| {},
        |_| true,
        |n, ne| {
            if n == "blk.0.ffn_down.weight" {
                ne[0] = 128
            }
        },
    );
    bench_fails(&p, &["tensor blk.0.ffn_down.weight has shape [128, 64]"]);

    let p = tmp.path().join("arch.gguf");
    rewrite(
        &good,
        &p,
        |m| set(m, "general.architecture", Value::String("llama".into())),
        |_| true,
        |_, _| {},
    );
    bench_fails(&p, &["architecture 'llama' is not supported"]);

    let p = tmp.path().join("no-tokens.gguf");
    rewrite(
        &good,
        &p,
        |m| m.retain(|(k, _)| k != "tokenizer.ggml.tokens"),
        |_| true,
        |_, _| {},
    );
    bench_fails(&p, &["tokenizer.ggml.tokens is missing"]);

    let p = tmp.path().join("eos.gguf");
    rewrite(
        &good,
        &p,
        |m| set(m, "tokenizer.ggml.eos_token_id", Value::U32(9999)),
        |_| true,
        |_, _| {},
    );
    bench_fails(&p, &["tokenizer.ggml.eos_token_id", "not a token id"]);

    let p = tmp.path().join("heads.gguf");
    rewrite(
        &good,
        &p,
        |m| set(m, "qwen3.attention.head_count", Value::U32(3)),
        |_| true,
        |_, _| {},
    );
    bench_fails(&p, &["not a multiple of head_count_kv"]);
}

#[test]
fn device_and_flag_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let good = base(tmp.path());
    let m = good.to_str().unwrap();
    if !cfg!(feature = "cuda") {
        let o = run(&["bench", "-m", m, "-p", "1", "-r", "1", "--device", "cuda"]);
        assert_fails_with(&o, &["built without CUDA"]);
    }
    let o = run(&["bench", "-m", m, "--device", "tpu"]);
    assert_fails_with(&o, &["unknown device 'tpu'"]);
    let o = run(&["bench", "-m", m, "--cache-type", "q4"]);
    assert_fails_with(&o, &["unknown cache type 'q4'"]);
    let o = run(&["bench", "-m", m, "-p", "0"]);
    assert_fails_with(&o, &["nothing to measure"]);
    // A file-backed cache works and leaves its file.
    let kv = tmp.path().join("kv.bin");
    let o = run(&[
        "bench",
        "-m",
        m,
        "-p",
        "4",
        "-r",
        "1",
        "-d",
        "8",
        "--kv-file",
        kv.to_str().unwrap(),
        "--cache-type",
        "f16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(kv.exists());
    assert!(stdout(&o).contains("pp4 @ d8"));
    // llama.cpp's block types for the cache (`-ctk q8_0 -ctv q8_0`): rows of whole blocks, so
    // a head size that is not one is refused in one line before the weights load.
    let o = run(&[
        "bench", "-m", m, "-p", "4", "-r", "1", "-d", "8", "-ctk", "q8_0", "-ctv", "q8_0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("pp4 @ d8"));
    let b = tmp.path().join("b.gguf");
    convert_quiet(&fixture_model("pub-b"), &b, "f32");
    let o = run(&["bench", "-m", b.to_str().unwrap(), "--cache-type", "q4_0"]);
    assert_fails_with(
        &o,
        &["a q4_0 KV cache needs a head size that is a multiple of 32; this model's is 24"],
    );
    // llama.cpp's -ngl and -ub: bad values are refused; on the CPU, -ngl is a warning and the
    // plan shows every layer on the CPU; forwards longer than -ub run in chunks.
    let o = run(&["bench", "-m", m, "-ngl", "lots"]);
    assert_fails_with(&o, &["invalid -ngl 'lots'"]);
    let o = run(&["bench", "-m", m, "-ub", "0"]);
    assert_fails_with(&o, &["invalid micro-batch '0'"]);
    let o = run(&[
        "bench", "-m", m, "-p", "9", "-r", "1", "-d", "4", "-ngl", "3", "-ub", "4",
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("warning: -ngl 3 has no effect"), "{err}");
    assert!(err.contains("layers on the CPU"), "{err}");
    assert!(err.contains("chunks of up to 4 tokens"), "{err}");
    assert!(stdout(&o).contains("pp9 @ d4"));
}
