//! The README's quickstart: `refusion demo` writes, converts and generates end to end.

mod common;

use common::*;

#[test]
fn demo_runs_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    // `-t` sizes the thread pools once; every step of the demo honours it (issue 18).
    let o = run(&[
        "demo",
        "--dir",
        dir.to_str().unwrap(),
        "-p",
        "Hello",
        "-t",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    for step in ["1/3", "2/3", "3/3", "refusion: generated", "64 tokens"] {
        assert!(err.contains(step), "demo output lacks {step:?}:\n{err}");
    }
    assert!(dir.join("refusion-demo-Q4_K_M.gguf").is_file());
    assert!(!stdout(&o).trim().is_empty(), "no answer text");
}
