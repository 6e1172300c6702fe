//! A GGUF written by llama.cpp's own converter (`convert_hf_to_gguf.py`) from a checkpoint
//! whose tokenizer declares no `mask_token` and whose config has no `mask_token_id`, as
//! ReFusion's tokenizer is (tests/fixtures/llamacpp/make.py): the file has no
//! `tokenizer.ggml.mask_token_id`, so `<|mask|>` is taken from the vocabulary, with a note.
//! Needs python3 with `gguf` (`.ci/run` installs it; REFUSION_PYTHON picks the interpreter).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::*;
use serde_json::Value;

/// The fixture, stored gzipped, unpacked into `dir`.
fn llamacpp_file(dir: &std::path::Path) -> PathBuf {
    let gz = fixtures().join("llamacpp/refusion-tiny-llamacpp-q8_0.gguf.gz");
    let out = dir.join("refusion-tiny-llamacpp-q8_0.gguf");
    let o = Command::new("gzip")
        .arg("-dc")
        .arg(&gz)
        .output()
        .expect("gzip");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::write(&out, o.stdout).unwrap();
    out
}

fn generate(model: &std::path::Path) -> std::process::Output {
    run(&[
        "generate",
        "-m",
        model.to_str().unwrap(),
        "--prompt-ids",
        "9707,11,1879,0,3555,374",
        "-n",
        "16",
        "--slot-size",
        "4",
        "--serial-blocks",
        "2",
        "--json",
        "-c",
        "256",
    ])
}

#[test]
fn a_llama_cpp_file_without_a_mask_id_takes_mask_from_the_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    let file = llamacpp_file(tmp.path());
    let o = generate(&file);
    assert!(o.status.success(), "{}", stderr(&o));
    let note = stderr(&o);
    assert!(
        note.contains("no tokenizer.ggml.mask_token_id")
            && note.contains("<|mask|> = 151670 from its vocabulary"),
        "{note}"
    );
    let without: Value = serde_json::from_str(&stdout(&o)).unwrap();

    // The same file with the key added by llama.cpp's own gguf tool gives the same tokens, with
    // no note: the id from the vocabulary is the one the key names.
    let with_key = tmp.path().join("with-mask.gguf");
    let python = std::env::var("REFUSION_PYTHON").unwrap_or_else(|_| "python3".into());
    let py = Command::new(&python)
        .args([
            "-m",
            "gguf.scripts.gguf_new_metadata",
            "--special-token",
            "mask",
            "<|mask|>",
        ])
        .arg(&file)
        .arg(&with_key)
        .output()
        .expect("python3 with the gguf package");
    assert!(
        py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stderr)
    );
    let o = generate(&with_key);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("mask_token_id"), "{}", stderr(&o));
    let with: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(without["tokens"], with["tokens"]);
    assert!(!with["tokens"].as_array().unwrap().is_empty());
}
