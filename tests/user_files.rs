//! Nothing a user owns is ever overwritten: `--kv-file` and `--prompt-cache` write only to a
//! path that is absent, empty or already a cache of ours (never the model, another GGUF or a
//! file of the user's), and nothing that is not a regular file (a FIFO, a device) is opened
//! for reading, so no such path can hang a command.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

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
    let m = pub_a_f32(tmp.path());
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
    let m = pub_a_f32(tmp.path());
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
    let m = pub_a_f32(tmp.path());
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
    let m = pub_a_f32(tmp.path());
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
    let m = pub_a_f32(tmp.path());
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

/// Runs `refusion ARGS` with `input` on its standard input (written from a thread, so that a
/// refusal that stops reading does not block the test).
fn run_with_stdin(args: &[&str], input: Vec<u8>) -> Output {
    use std::io::Write;
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let o = child.wait_with_output().unwrap();
    let _ = writer.join();
    o
}

/// Links planted where an older refusion put its fixed `TARGET.partial`, and where the hidden
/// temporaries go: a hard link to a copy of the model and a symbolic link to the user's notes.
/// Returns the two victims with their bytes.
fn plant_links(dir: &Path, target: &Path, model: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let name = target.file_name().unwrap().to_str().unwrap();
    let copy = dir.join(format!("{name}-victim.gguf"));
    std::fs::copy(model, &copy).unwrap();
    let notes = dir.join(format!("{name}-notes.txt"));
    std::fs::write(&notes, b"the user's notes").unwrap();
    std::fs::hard_link(&copy, dir.join(format!("{name}.partial"))).unwrap();
    std::os::unix::fs::symlink(&notes, dir.join(format!(".{name}.partial"))).unwrap();
    std::os::unix::fs::symlink(&notes, dir.join(format!(".{name}.AAAAAAAA.partial"))).unwrap();
    [copy, notes]
        .into_iter()
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect()
}

#[test]
fn no_writer_writes_through_a_planted_link() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let m = pub_a_f32(dir);
    let ms = m.to_str().unwrap();
    let batch = dir.join("in.jsonl");
    std::fs::write(&batch, "{\"prompt\":[1,2,3],\"max_tokens\":4}\n").unwrap();
    let f16 = dir.join("a-f16.gguf");
    convert_quiet(&fixture_model("pub-a"), &f16, "f16");
    let ckpt = fixture_model("pub-a");
    let at = |n: &str| dir.join(n);
    // Each writer, its target, and how to run it.
    let writers: Vec<(&str, PathBuf, Vec<String>, Option<&str>)> = vec![
        (
            "convert",
            at("conv.gguf"),
            vec![
                "convert".into(),
                ckpt.to_str().unwrap().into(),
                "-o".into(),
                at("conv.gguf").to_str().unwrap().into(),
                "--outtype".into(),
                "q8_0".into(),
                "-q".into(),
            ],
            None,
        ),
        (
            "quantize",
            at("quant.gguf"),
            vec![
                "quantize".into(),
                f16.to_str().unwrap().into(),
                at("quant.gguf").to_str().unwrap().into(),
                "q8_0".into(),
            ],
            None,
        ),
        (
            "--prompt-cache",
            at("pc.bin"),
            vec![
                "generate".into(),
                "-m".into(),
                ms.into(),
                "--prompt-ids".into(),
                "1,2,3".into(),
                "-n".into(),
                "4".into(),
                "--prompt-cache".into(),
                at("pc.bin").to_str().unwrap().into(),
            ],
            None,
        ),
        (
            "--batch -o",
            at("out.jsonl"),
            vec![
                "generate".into(),
                "-m".into(),
                ms.into(),
                "--no-chat-template".into(),
                "--batch".into(),
                batch.to_str().unwrap().into(),
                "-o".into(),
                at("out.jsonl").to_str().unwrap().into(),
            ],
            None,
        ),
        (
            "chat /save",
            at("saved.bin"),
            vec![
                "chat".into(),
                "-m".into(),
                ms.into(),
                "-n".into(),
                "4".into(),
            ],
            Some("hello"),
        ),
    ];
    for (what, target, args, chat_line) in writers {
        let victims = plant_links(dir, &target, &m);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = match chat_line {
            Some(line) => run_with_stdin(
                &args,
                format!("{line}\n/save {}\n/bye\n", target.display()).into_bytes(),
            ),
            None => run(&args),
        };
        assert!(o.status.success(), "{what}: {}", stderr(&o));
        assert!(!stderr(&o).contains("error"), "{what}: {}", stderr(&o));
        for (victim, before) in &victims {
            assert!(
                &std::fs::read(victim).unwrap() == before,
                "{what} wrote through a link into {}",
                victim.display()
            );
        }
        let written = std::fs::read(&target).unwrap();
        assert!(!written.is_empty(), "{what}: nothing written");
        // Only the planted links remain beside it: no temporary of the run's own.
        assert_eq!(
            temporaries(&target).len(),
            3,
            "{what}: {:?}",
            temporaries(&target)
        );
    }
}

#[test]
fn an_output_that_is_a_link_or_not_a_file_is_refused_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, b"the user's notes").unwrap();
    let link = dir.join("out.gguf");
    std::os::unix::fs::symlink(&notes, &link).unwrap();
    let ckpt = fixture_model("pub-a");
    let o = run(&[
        "convert",
        ckpt.to_str().unwrap(),
        "-o",
        link.to_str().unwrap(),
        "-q",
    ]);
    refused_untouched(
        &o,
        &notes,
        b"the user's notes",
        &["out.gguf' is a symbolic link; refusing to replace it"],
    );
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    let m = pub_a_f32(dir);
    let batch = dir.join("in.jsonl");
    std::fs::write(&batch, "{\"prompt\":[1,2,3],\"max_tokens\":4}\n").unwrap();
    let o = run(&[
        "generate",
        "-m",
        m.to_str().unwrap(),
        "--batch",
        batch.to_str().unwrap(),
        "-o",
        link.to_str().unwrap(),
    ]);
    refused_untouched(&o, &notes, b"the user's notes", &["is a symbolic link"]);
    let pc = dir.join("pc.bin");
    std::os::unix::fs::symlink(&notes, &pc).unwrap();
    let o = generate(&m, &["--prompt-cache", pc.to_str().unwrap()]);
    refused_untouched(
        &o,
        &notes,
        b"the user's notes",
        &["pc.bin: is a symbolic link"],
    );
    // The demo's checkpoint files too.
    let demo = dir.join("demo");
    std::fs::create_dir_all(demo.join("refusion-tiny")).unwrap();
    std::os::unix::fs::symlink(&notes, demo.join("refusion-tiny/config.json")).unwrap();
    let o = run(&["demo", "--dir", demo.to_str().unwrap()]);
    refused_untouched(
        &o,
        &notes,
        b"the user's notes",
        &["config.json' is a symbolic link"],
    );
    let kv = dir.join("kv.bin");
    std::os::unix::fs::symlink(dir.join("nowhere"), &kv).unwrap();
    let o = generate(&m, &["--kv-file", kv.to_str().unwrap()]);
    assert_fails_with(&o, &["kv.bin: is a symbolic link"]);
    assert!(!dir.join("nowhere").exists());
}

#[test]
fn two_converts_to_one_output_leave_one_whole_output() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let ckpt = fixture_model("pub-a");
    // Each type's output alone, to compare with.
    let types = ["q8_0", "q4_k_m"];
    let whole: Vec<Vec<u8>> = types
        .iter()
        .map(|t| {
            let p = dir.join(format!("ref-{t}.gguf"));
            convert_quiet(&ckpt, &p, t);
            std::fs::read(p).unwrap()
        })
        .collect();
    let out = dir.join("out.gguf");
    for round in 0..6 {
        let children: Vec<_> = types
            .iter()
            .map(|t| {
                Command::new(bin())
                    .args([
                        "convert",
                        ckpt.to_str().unwrap(),
                        "-o",
                        out.to_str().unwrap(),
                        "--outtype",
                        t,
                        "-q",
                    ])
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in children {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "round {round}: {}", stderr(&o));
        }
        let got = std::fs::read(&out).unwrap();
        assert!(
            whole.contains(&got),
            "round {round}: the output is neither conversion ({} bytes)",
            got.len()
        );
        assert!(temporaries(&out).is_empty(), "round {round}");
    }
}

#[test]
fn every_text_input_is_bounded_and_only_a_file_or_stdin_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let m = pub_a_f32(tmp.path());
    let m = m.to_str().unwrap();
    let fifo = tmp.path().join("prompt.txt");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let f = fifo.to_str().unwrap();
    // Not a file: refused at once, never read or waited on.
    for (args, needle) in [
        (vec!["generate", "-m", m, "-f", f], "is a FIFO"),
        (vec!["generate", "-m", m, "-f", "/dev/zero"], "is a device"),
        (
            vec!["generate", "-m", m, "-f", "/dev/urandom"],
            "is a device",
        ),
        (
            vec!["generate", "-m", m, "--batch", "/dev/zero"],
            "is a device",
        ),
        (vec!["generate", "-m", m, "--batch", f], "is a FIFO"),
    ] {
        let o =
            run_within(&args, Duration::from_secs(30)).unwrap_or_else(|| panic!("{args:?} hung"));
        assert_fails_with(&o, &[needle]);
    }
    // Standard input, endless: refused by name at the bound (8 MiB and a little more are sent).
    let endless = |line: &[u8]| {
        line.iter()
            .copied()
            .cycle()
            .take(9 << 20)
            .collect::<Vec<u8>>()
    };
    let o = run_with_stdin(&["generate", "-m", m, "-f", "-"], endless(b"y\n"));
    assert_fails_with(&o, &["standard input: more than 8 MiB of prompt text"]);
    let o = run_with_stdin(&["generate", "-m", m, "--batch", "-"], endless(b"x"));
    assert_fails_with(&o, &["standard input:1: a line is longer than 8 MiB"]);
    let o = run_with_stdin(&["chat", "-m", m], endless(b"x"));
    assert_fails_with(&o, &["standard input: a line is longer than 8 MiB"]);
    // A prompt file over the bound, and one under it (read whole).
    let big = tmp.path().join("big.txt");
    std::fs::write(&big, vec![b'a'; (8 << 20) + 1]).unwrap();
    let o = run(&["generate", "-m", m, "-f", big.to_str().unwrap()]);
    assert_fails_with(&o, &["big.txt: more than 8 MiB of prompt text"]);
    let small = tmp.path().join("small.txt");
    std::fs::write(&small, "hello").unwrap();
    let o = run(&[
        "generate",
        "-m",
        m,
        "-f",
        small.to_str().unwrap(),
        "-n",
        "4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}
