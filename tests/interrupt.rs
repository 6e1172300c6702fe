//! Ctrl-C (SIGINT), SIGTERM and SIGKILL in the middle of a conversion: no partial file is left
//! (except after SIGKILL, which no process can clean up after), and an existing file of the same
//! name is untouched.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Starts a conversion, waits until it is writing tensor data, sends `signal`, and returns
/// the exit status and stderr.
fn interrupt_with(dir: &Path, out: &Path, signal: &str) -> (Option<i32>, String) {
    let child = Command::new(bin())
        .args([
            "convert",
            dir.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--outtype",
            "q2_k",
            "-t",
            "1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        let writing = temporaries(out)
            .iter()
            .any(|t| fs::metadata(t).is_ok_and(|m| m.len() > 256 * 1024));
        if writing {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "conversion never started writing"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args([signal, &pid])
        .status()
        .unwrap()
        .success());
    let o = child.wait_with_output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn signals_mid_write_leave_no_partial_and_keep_the_old_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    // About 40 MB of bf16: long enough to be caught mid-write.
    build_checkpoint(
        &dir,
        &Tiny {
            hidden: 1024,
            heads: 8,
            kv_heads: 2,
            head_dim: 128,
            ffn: 3072,
            layers: 3,
            vocab: 4096,
            ..Default::default()
        },
    );
    let out = tmp.path().join("model.gguf");
    for signal in ["-INT", "-TERM"] {
        fs::write(&out, b"the previous model").unwrap();
        let (code, err) = interrupt_with(&dir, &out, signal);
        assert_eq!(code, Some(130), "{signal}: {err}");
        assert!(err.contains("interrupted"), "{signal}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(temporaries(&out).is_empty(), "{signal}: partial file left");
        assert_eq!(
            fs::read(&out).unwrap(),
            b"the previous model",
            "{signal}: old file changed"
        );
    }
    // SIGKILL cannot be caught: the temporary remains (hidden, and unlocked now that its
    // writer is gone), but the target is untouched, and where there was none, there is none.
    let (code, _) = interrupt_with(&dir, &out, "-KILL");
    assert_eq!(code, None);
    assert_eq!(fs::read(&out).unwrap(), b"the previous model");
    let left = temporaries(&out);
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with(".model.gguf."));
    let fresh = tmp.path().join("fresh.gguf");
    let (code, _) = interrupt_with(&dir, &fresh, "-KILL");
    assert_eq!(code, None);
    assert!(
        !fresh.exists(),
        "a killed conversion must not leave a target file"
    );
    // A later run writes a temporary of its own and completes; the leftover, once old
    // enough that no writer can be just starting it (aged here), is swept.
    let old = std::time::SystemTime::now() - Duration::from_secs(60);
    fs::File::options()
        .write(true)
        .open(&left[0])
        .unwrap()
        .set_modified(old)
        .unwrap();
    let o = run(&[
        "convert",
        dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--outtype",
        "q8_0",
        "-q",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(temporaries(&out).is_empty());
    assert!(
        temporaries(&fresh).len() == 1,
        "another target's leftover is its own"
    );
    assert!(fs::read(&out).unwrap().starts_with(b"GGUF"));
}
