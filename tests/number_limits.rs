//! Every size that comes from a file, a flag or a request, at any u32/u64/i64: the command
//! either works or refuses in one line naming the key or flag, with no panic and no hang.
//! The values are the edges (0, 1, powers of two and their neighbours, the types' limits) and
//! seeded random ones.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use refusion_gguf::Value;

/// What a run came to.
#[derive(Debug, PartialEq)]
enum Outcome {
    Works,
    Refused(String),
}

/// Runs refusion and classifies the run; panics (the test fails) on a panic, a crash, a hang or
/// a refusal that is not one clear line. A `serve` that starts listening works (and is
/// stopped).
fn outcome(args: &[String]) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let err_path = dir.path().join("stderr");
    let mut child = Command::new(bin())
        .args(args)
        // Plans past 1 GiB are refused rather than run.
        .env("REFUSION_MAX_MEMORY", (1u64 << 30).to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        let err = std::fs::read_to_string(&err_path).unwrap_or_default();
        if err.contains("listening on ") {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{args:?} hung:\n{err}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::fs::File::open(&err_path)
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    let Some(status) = status else {
        return Outcome::Works;
    };
    match status.code() {
        Some(0) => Outcome::Works,
        Some(1) | Some(2) => {
            let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
            assert_eq!(errors.len(), 1, "{args:?}: not one error line:\n{err}");
            Outcome::Refused(errors[0].to_string())
        }
        other => panic!("{args:?} exited with {other:?}:\n{err}"),
    }
}

/// Edge values and seeded random ones, as the strings a user would type.
fn values() -> Vec<String> {
    let mut v: Vec<i128> = vec![
        0,
        1,
        2,
        3,
        4,
        7,
        8,
        16,
        255,
        256,
        4096,
        65_535,
        65_536,
        1 << 20,
        (1 << 20) + 1,
        1 << 24,
        (1 << 24) + 1,
        i32::MAX as i128,
        1 << 31,
        u32::MAX as i128 - 1,
        u32::MAX as i128,
        1 << 32,
        1 << 53,
        i64::MAX as i128,
        u64::MAX as i128,
        -1,
        -2,
        i32::MIN as i128,
        i64::MIN as i128,
    ];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..6 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push((x >> (x % 60)) as i128);
    }
    v.iter().map(|n| n.to_string()).collect()
}

fn generate_args(m: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "generate",
        "-m",
        m.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// A refusal names the flag or key it is about (clap's own refusals name the flag too).
fn assert_names(o: &Outcome, names: &[&str], what: &str) {
    if let Outcome::Refused(line) = o {
        assert!(
            names.iter().any(|n| line.contains(n)),
            "{what}: the refusal does not name it: {line}"
        );
    }
}

#[test]
fn every_numeric_flag_works_or_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let m = pub_a_f32(tmp.path());
    let flags: &[(&str, &[&str])] = &[
        ("-n", &["-n", "--gen-length", "gen length"]),
        ("--slot-size", &["--slot-size", "slot size", "-token slots"]),
        ("--serial-blocks", &["--serial-blocks", "serial blocks"]),
        ("-c", &["-c", "context", "--ctx-size"]),
        ("-t", &["-t", "thread"]),
        ("-ub", &["micro-batch", "--ubatch-size"]),
        ("-s", &["-s", "--seed"]),
    ];
    let mut tried = 0;
    for v in values() {
        for (flag, names) in flags {
            // A run with a small answer unless the flag is the answer's length.
            let mut extra = vec![*flag, v.as_str()];
            if !matches!(*flag, "-n" | "--slot-size" | "--serial-blocks") {
                extra.extend(["-n", "8"]);
            }
            let o = outcome(&generate_args(&m, &extra));
            assert_names(&o, names, &format!("{flag} {v}"));
            tried += 1;
        }
    }
    // The decoding knobs over the server's (they are checked before the model loads).
    for v in values() {
        for (flag, names) in [
            ("--queue", &["--queue"][..]),
            ("--parallel", &["--parallel"]),
            ("--max-connections", &["--max-connections"]),
            ("--max-gen-length", &["--max-gen-length"]),
            ("--max-body-bytes", &["--max-body-bytes"]),
        ] {
            let args: Vec<String> = [
                "serve",
                "-m",
                m.to_str().unwrap(),
                "--port",
                "0",
                "-c",
                "256",
                flag,
                &v,
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let o = outcome(&args);
            assert_names(&o, names, &format!("{flag} {v}"));
            tried += 1;
        }
    }
    eprintln!("{tried} runs: no panic, no hang");
}

#[test]
fn every_refusion_key_works_or_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let m = pub_a_f32(tmp.path());
    let keys = [
        "refusion.gen_length",
        "refusion.slot_size",
        "refusion.serial_num_blocks",
        "qwen3.context_length",
    ];
    let edited = tmp.path().join("edited.gguf");
    let mut tried = 0;
    for v in values() {
        let n: i128 = v.parse().unwrap();
        // The value as each integer type that holds it.
        let mut typed = Vec::new();
        if let Ok(x) = u32::try_from(n) {
            typed.push(Value::U32(x));
        }
        if let Ok(x) = u64::try_from(n) {
            typed.push(Value::U64(x));
        }
        if let Ok(x) = i64::try_from(n) {
            typed.push(Value::I64(x));
        }
        for key in keys {
            for value in &typed {
                with_metadata(&m, &edited, |meta| {
                    meta.retain(|(k, _)| k != key);
                    meta.push((key.to_string(), value.clone()));
                });
                // -c 0: the file's trained context is the one used.
                let o = outcome(&generate_args(&edited, &["-c", "0"]));
                // A trained context too small for the answer is refused as the context.
                // Values in range that do not fit the context or each other are refused in
                // the decoder's words.
                let names: &[&str] = match key {
                    "qwen3.context_length" => &[key, "more than the context of", "-c"],
                    "refusion.gen_length" => &[key, "gen length"],
                    _ => &[key],
                };
                assert_names(&o, names, &format!("{key} = {value:?}"));
                tried += 1;
            }
        }
    }
    for key in ["refusion.slot_threshold", "refusion.token_threshold"] {
        for x in [f32::NAN, f32::INFINITY, -1.0, 0.0, 0.5, 1.0, 2.0, f32::MAX] {
            with_metadata(&m, &edited, |meta| {
                meta.retain(|(k, _)| k != key);
                meta.push((key.to_string(), Value::F32(x)));
            });
            let o = outcome(&generate_args(&edited, &["-n", "8"]));
            assert_names(&o, &[key], &format!("{key} = {x}"));
            tried += 1;
        }
    }
    eprintln!("{tried} files: no panic, no hang");
}

/// The file's gen length at u32::MAX, which once panicked every command that decodes.
#[test]
fn a_huge_gen_length_in_the_file_is_refused_by_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let m = pub_a_f32(tmp.path());
    let edited = tmp.path().join("edited.gguf");
    with_metadata(&m, &edited, |meta| {
        meta.retain(|(k, _)| k != "refusion.gen_length");
        meta.push(("refusion.gen_length".into(), Value::U32(u32::MAX)));
    });
    let e = edited.to_str().unwrap();
    let batch = tmp.path().join("b.jsonl");
    std::fs::write(&batch, "{\"prompt\": [1, 2, 3]}\n").unwrap();
    for args in [
        vec!["generate", "-m", e, "--prompt-ids", "1,2,3"],
        vec!["generate", "-m", e, "--batch", batch.to_str().unwrap()],
        vec!["chat", "-m", e],
        vec!["serve", "-m", e, "--port", "0"],
    ] {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        match outcome(&args) {
            Outcome::Refused(line) => assert!(
                line.contains("refusion.gen_length = 4294967295 is out of range"),
                "{args:?}: {line}"
            ),
            Outcome::Works => panic!("{args:?} accepted a gen length of 2^32 - 1"),
        }
    }
}

/// llama.cpp's -1s: `-n -1` is the file's gen length, `-s -1` a random seed, printed.
#[test]
fn minus_one_means_the_files_gen_length_and_a_random_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let m = pub_a_f32(tmp.path());
    let json = |extra: &[&str]| {
        let mut a = generate_args(&m, &["--json"]);
        a.extend(extra.iter().map(|s| s.to_string()));
        let o = Command::new(bin()).args(&a).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v, stderr(&o))
    };
    let (plain, _) = json(&[]);
    let (minus, _) = json(&["-n", "-1"]);
    assert_eq!(plain["tokens"], minus["tokens"]);
    let (random, err) = json(&["-s", "-1", "--temp", "1", "-n", "8"]);
    let seed = err
        .lines()
        .find_map(|l| l.strip_prefix("seed: "))
        .expect("the random seed is printed");
    let (a, _) = json(&["-s", seed, "--temp", "1", "-n", "8"]);
    assert_eq!(
        a["tokens"], random["tokens"],
        "the printed seed repeats the run"
    );
    let o = outcome(&generate_args(&m, &["-n", "-2"]));
    assert!(matches!(o, Outcome::Refused(l) if l.contains("-n must be -1")));
}

/// More threads than the CPUs this process may use is said; past llama.cpp's 512, refused.
#[test]
fn threads_beyond_the_cpus_are_warned_about_and_absurd_counts_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let m = pub_a_f32(tmp.path());
    let cpus = std::thread::available_parallelism().unwrap().get();
    let many = (cpus * 4).min(512).to_string();
    let mut a = generate_args(&m, &["-n", "8", "-t", &many]);
    let o = Command::new(bin()).args(&a).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("-t {many} is more threads than the {cpus} CPUs")),
        "{}",
        stderr(&o)
    );
    a.pop();
    a.push("100000".into());
    assert!(
        matches!(outcome(&a), Outcome::Refused(l) if l.contains("invalid thread count '100000'"))
    );
}
