//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/*`, and crash reproducers in
//! `fuzz/regressions/<target>/*`) through the same entry points the fuzz targets call: a short
//! regression run in CI, not a fuzzing session.

use std::path::Path;

fn replay(target: &str, f: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut n = 0;
    for dir in [
        root.join("corpus").join(target),
        root.join("regressions").join(target),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries {
            let path = e.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let result = std::panic::catch_unwind(|| f(&data));
            assert!(result.is_ok(), "{target} panicked on {}", path.display());
            n += 1;
        }
    }
    assert!(n > 0, "no corpus for {target}");
}

#[test]
fn gguf_header() {
    replay("gguf_header", refusion::fuzzing::gguf_header);
}

#[test]
fn safetensors() {
    replay("safetensors", refusion::fuzzing::safetensors);
}

#[test]
fn tokenizer_metadata() {
    replay("tokenizer_metadata", refusion::fuzzing::tokenizer_metadata);
}

#[test]
fn chat_template() {
    replay("chat_template", refusion::fuzzing::chat_template);
}

#[test]
fn server_request() {
    replay("server_request", refusion::fuzzing::server_request);
}

#[test]
fn decoding_values() {
    replay("decoding_values", refusion::fuzzing::decoding_values);
}
