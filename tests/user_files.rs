//! Nothing a user owns is ever overwritten: `--kv-file` and `--prompt-cache` write only to a
//! path that is absent, empty or already a cache of ours (never the model, another GGUF or a
//! file of the user's), and nothing that is not a regular file (a FIFO, a device) is opened
//! for reading, so no such path can hang a command.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn model(dir: &Path) -> PathBuf {
    let out = dir.join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    out
}

fn generate(m: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "generate",
        "-m",
        m.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "-n",
        "8",
    ];
    args.extend(extra);
    run(&args)
}

/// Asserts a clean refusal that leaves `file` byte for byte as it was.
fn refused_untouched(o: &Output, file: &Path, before: &[u8], needles: &[&str]) {
    assert_fails_with(o, needles);
    assert_eq!(
        stderr(o).lines().filter(|l| l.starts_with("error")).count(),
        1,
        "{}",
        stderr(o)
    );
    assert_eq!(std::fs::read(file).unwrap(), before, "the file was changed");
}

#[test]
fn a_kv_file_never_overwrites_a_model_or_a_file_that_is_not_ours() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let model_bytes = std::fs::read(&m).unwrap();

    // A copy of a model (another GGUF) under the cache's name.
    let kv = tmp.path().join("kv.bin");
    std::fs::copy(&m, &kv).unwrap();
    let o = generate(&m, &["--kv-file", kv.to_str().unwrap()]);
    refused_untouched(&o, &kv, &model_bytes, &["kv.bin: holds a GGUF model"]);

    // The model itself, by its name and through a hard link.
    let o = generate(&m, &["--kv-file", m.to_str().unwrap()]);
    refused_untouched(&o, &m, &model_bytes, &["is the model file itself"]);
    let link = tmp.path().join("link.bin");
    std::fs::hard_link(&m, &link).unwrap();
    let o = generate(&m, &["--kv-file", link.to_str().unwrap()]);
    refused_untouched(&o, &m, &model_bytes, &["is the model file itself"]);

    // Someone's notes.
    let notes = tmp.path().join("notes.txt");
    std::fs::write(&notes, b"do not lose me").unwrap();
    let o = generate(&m, &["--kv-file", notes.to_str().unwrap()]);
    refused_untouched(&o, &notes, b"do not lose me", &["not a refusion cache"]);

    // serve checks the same before it listens.
    let o = run(&[
        "serve",
        "-m",
        m.to_str().unwrap(),
        "--port",
        "0",
        "--kv-file",
        m.to_str().unwrap(),
    ]);
    refused_untouched(&o, &m, &model_bytes, &["is the model file itself"]);
}

#[test]
fn a_kv_file_of_ours_an_empty_file_or_a_new_path_is_used() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let plain = generate(&m, &[]);
    assert!(plain.status.success(), "{}", stderr(&plain));

    let kv = tmp.path().join("kv.bin");
    let o = generate(&m, &["--kv-file", kv.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), stdout(&plain));
    assert_eq!(&std::fs::read(&kv).unwrap()[..4], b"RFKC");
    // Ours: reused, for another context too (rebuilt).
    let o = generate(&m, &["--kv-file", kv.to_str().unwrap(), "-c", "64"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), stdout(&plain));

    let empty = tmp.path().join("empty.bin");
    std::fs::write(&empty, b"").unwrap();
    let o = generate(&m, &["--kv-file", empty.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(&std::fs::read(&empty).unwrap()[..4], b"RFKC");
}

#[test]
fn a_prompt_cache_never_overwrites_a_file_that_is_not_ours() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let model_bytes = std::fs::read(&m).unwrap();
    let notes = tmp.path().join("notes.txt");
    std::fs::write(&notes, b"do not lose me").unwrap();
    let o = generate(&m, &["--prompt-cache", notes.to_str().unwrap()]);
    refused_untouched(&o, &notes, b"do not lose me", &["not a refusion cache"]);
    assert!(
        !stdout(&o).contains("ma"),
        "answered before refusing: {}",
        stdout(&o)
    );
    let o = generate(&m, &["--prompt-cache", m.to_str().unwrap()]);
    refused_untouched(&o, &m, &model_bytes, &["is the model file itself"]);

    // A live KV cache is not a prompt cache (and the other way round).
    let kv = tmp.path().join("kv.bin");
    assert!(generate(&m, &["--kv-file", kv.to_str().unwrap()])
        .status
        .success());
    let kv_bytes = std::fs::read(&kv).unwrap();
    let o = generate(&m, &["--prompt-cache", kv.to_str().unwrap()]);
    refused_untouched(
        &o,
        &kv,
        &kv_bytes,
        &["holds a refusion KV cache (--kv-file)"],
    );

    // A new path is written, then reused; a cache of ours for another model is rebuilt.
    let pc = tmp.path().join("pc.bin");
    for _ in 0..2 {
        let o = generate(&m, &["--prompt-cache", pc.to_str().unwrap()]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    assert!(
        stderr(&generate(&m, &["--prompt-cache", pc.to_str().unwrap()]))
            .contains("prompt cache: reused")
    );
    let other = tmp.path().join("b.gguf");
    convert_quiet(&fixture_model("pub-b"), &other, "f32");
    let o = generate(&other, &["--prompt-cache", pc.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("starting fresh"), "{}", stderr(&o));
}

/// Runs `refusion ARGS` and kills it after `limit`: `None` when it had to be killed (a hang).
fn run_within(args: &[&str], limit: Duration) -> Option<Output> {
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while start.elapsed() < limit {
        if child.try_wait().unwrap().is_some() {
            return Some(child.wait_with_output().unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

#[test]
fn a_fifo_or_a_device_is_refused_at_once_wherever_a_file_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let m = m.to_str().unwrap();
    let fifo = tmp.path().join("f.gguf");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let f = fifo.to_str().unwrap();
    let out = tmp.path().join("q.gguf");
    let q = out.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["info", f], "is a FIFO"),
        (vec!["info", "/dev/zero"], "is a device"),
        (vec!["generate", "-m", f, "-p", "hi"], "is a FIFO"),
        (
            vec!["generate", "-m", "/dev/zero", "-p", "hi"],
            "is a device",
        ),
        (vec!["quantize", f, q, "q8_0"], "is a FIFO"),
        (vec!["bench", "-m", f], "is a FIFO"),
        (
            vec![
                "generate",
                "-m",
                m,
                "--prompt-ids",
                "1",
                "--prompt-cache",
                f,
            ],
            "is a FIFO",
        ),
        (
            vec!["generate", "-m", m, "--prompt-ids", "1", "--kv-file", f],
            "is a FIFO",
        ),
        (
            vec![
                "generate",
                "-m",
                m,
                "--prompt-ids",
                "1",
                "--kv-file",
                "/dev/null",
            ],
            "is a device",
        ),
    ];
    for (args, needle) in cases {
        let o =
            run_within(&args, Duration::from_secs(30)).unwrap_or_else(|| panic!("{args:?} hung"));
        assert_fails_with(&o, &[needle]);
    }
    assert!(!out.exists());
}

/// `refusion ... | head -c 1`: once the reader has gone, the command ends quietly (SIGPIPE, as
/// `cat` does, or 0), never with a panic.
#[test]
fn a_closed_stdout_ends_every_command_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let m = m.to_str().unwrap();
    for args in [
        vec![
            "generate",
            "-m",
            m,
            "--prompt-ids",
            "1,2,3",
            "-n",
            "256",
            "--serial-blocks",
            "64",
        ],
        vec!["bench", "-m", m, "-p", "1,2,3,4,5,6,7,8", "-r", "2"],
        vec!["info", m],
    ] {
        let mut child = Command::new(bin())
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = [0u8; 1];
        child.stdout.take().unwrap().read_exact(&mut first).unwrap();
        // The pipe's read end is closed here.
        let o = child.wait_with_output().unwrap();
        let err = stderr(&o);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        let quiet = o.status.success() || o.status.signal() == Some(libc_sigpipe());
        assert!(quiet, "{args:?}: {:?}\n{err}", o.status);
    }
}

fn libc_sigpipe() -> i32 {
    13
}
