//! Our GGUF files read back through llama.cpp's own Python `gguf` package.
//!
//! Needs `python3` with `gguf` and `numpy` (`.ci/run` installs them; set REFUSION_PYTHON to use
//! another interpreter). A missing package fails the test with the install command: this
//! check is part of what makes a file "llama.cpp-compatible", so it is never skipped silently.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

fn check(gguf: &Path, hf_dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/check_gguf.py");
    let o = Command::new(python())
        .arg(&script)
        .arg(gguf)
        .arg(hf_dir)
        .output()
        .expect("python3 not found: install Python 3 with `pip install gguf numpy`");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !err.contains("No module named"),
        "the interop check needs llama.cpp's gguf package: pip install gguf numpy\n{err}"
    );
    assert!(
        o.status.success(),
        "gguf-py check failed for {}:\n{err}",
        gguf.display()
    );
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("OK"));
}

#[test]
fn gguf_py_reads_public_fixtures() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, outtype) in [
        ("pub-a", "f32"),
        ("pub-b", "q4_k_m"),
        ("pub-c", "q8_0"),
        ("pub-a", "bf16"),
    ] {
        let out = tmp.path().join(format!("{name}-{outtype}.gguf"));
        convert_quiet(&fixture_model(name), &out, outtype);
        check(&out, &fixture_model(name));
    }
}

#[test]
fn gguf_py_reads_every_type() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    build_checkpoint(
        &dir,
        &Tiny {
            layers: 2,
            shards: 2,
            tokenizer: TokLayout::Slow,
            ..Default::default()
        },
    );
    for outtype in [
        "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m",
        "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
    ] {
        let out = tmp.path().join(format!("{outtype}.gguf"));
        convert_quiet(&dir, &out, outtype);
        check(&out, &dir);
    }
}
