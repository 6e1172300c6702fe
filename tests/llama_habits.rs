//! llama.cpp's spellings a user brings (issue 33, item 2), through the binary: its joined short
//! options are accepted or refused by their own name (never misread as other flags), `-a` is
//! `--alias`, `--host` takes a name that resolves to loopback, and `-i` points to `chat`.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;

use common::server::Server;
use common::*;

#[test]
fn joined_short_options_are_accepted_or_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    let m = out.to_str().unwrap();
    // Accepted: what the command does anyway.
    let o = run(&[
        "generate",
        "-m",
        m,
        "--prompt-ids",
        "5,9",
        "-n",
        "8",
        "-no-cnv",
        "-st",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Refused by their own names, with the reason, before the model loads.
    for (args, says) in [
        (
            vec!["generate", "-m", m, "-p", "x", "-i"],
            "-i: for a conversation, use refusion chat",
        ),
        (
            vec!["generate", "-m", m, "-p", "x", "--interactive"],
            "-i: for a conversation",
        ),
        (vec!["chat", "-m", m, "-mli"], "-mli is not supported"),
        (vec!["chat", "-m", m, "-st"], "-st: for one answer"),
        (vec!["chat", "-m", m, "-no-cnv"], "-no-cnv: for one answer"),
        (
            vec!["bench", "-m", m, "-pg", "512,128"],
            "-pg 512,128 is not supported",
        ),
        (vec!["serve", "-m", m, "-nocb"], "-nocb is not supported"),
        (
            vec!["serve", "-m", m, "--host", "no-such-host.invalid"],
            "cannot resolve host name",
        ),
    ] {
        let o = run(&args);
        assert!(!o.status.success(), "{args:?} succeeded");
        let err = stderr(&o);
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(
            !err.contains("memory plan"),
            "{args:?} loaded the model first: {err}"
        );
        for misread in ["cannot be used multiple times", "invalid value 't'"] {
            assert!(!err.contains(misread), "{args:?} misread: {err}");
        }
    }
}

#[test]
fn serve_takes_a_host_name_and_a_short_alias() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    // A llama-server launch line: its flags start the server (-to is not -t o, -ngl99 is not
    // -n gl99), and the one with nothing behind it here says so.
    let server = Server::start(
        &out,
        &[
            "--host",
            "localhost",
            "-a",
            "my-model",
            "-cb",
            "--jinja",
            "--metrics",
            "--slots",
            "-to",
            "60",
            "-ngl99",
            "-np2",
        ],
    );
    let log = server.startup.join("\n");
    assert!(log.contains("warning: -ngl 99 has no effect"), "{log}");
    assert!(!log.contains("/slots"), "{log}");
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.contains("\"id\":\"my-model\""), "{body}");
    assert!(server.base.contains("127.0.0.1") || server.base.contains("[::1]"));
}

/// Numbers that agree (item 3): the answer never holds more than `-n` tokens although slot
/// decoding rounds the gen length up to whole slots; generate's count is the answer's (before
/// EOS), as the server's `usage`; the figures name tokens fed per call and TPF apart.
#[test]
fn counts_agree_with_the_gen_length_and_each_other() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    let m = out.to_str().unwrap();
    for prompt in ["5,9,13", "100,7,7,7,42", "77,3"] {
        let o = run(&[
            "generate",
            "-m",
            m,
            "--prompt-ids",
            prompt,
            "-n",
            "16",
            "--slot-size",
            "3",
            "--serial-blocks",
            "1",
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let raw = v["tokens"].as_array().unwrap().len();
        let answer = v["answer_tokens"].as_u64().unwrap();
        assert!(answer <= 16, "{prompt}: {answer} answer tokens for -n 16");
        assert!(
            raw <= 18,
            "{prompt}: {raw} positions for 16 rounded to slots of 3"
        );
    }
    let o = run(&["generate", "-m", m, "--prompt-ids", "5,9,13", "-n", "16"]);
    let err = stderr(&o);
    assert!(err.contains("tokens fed per call"), "{err}");
    assert!(err.contains("tokens committed per forward"), "{err}");
}

/// bench checks the context before its table: a test beyond the model's trained context (below
/// the default) is refused citing that context, not a `-c` the user never gave.
#[test]
fn bench_checks_the_context_before_the_table() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    let o = run(&[
        "bench",
        "-m",
        out.to_str().unwrap(),
        "-p",
        "2000",
        "-r",
        "1",
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("more than the context of 2048 (the model's context"),
        "{err}"
    );
    assert!(!err.contains("-c 4096"), "{err}");
    assert!(
        !stdout(&o).contains("| model"),
        "the table started: {}",
        stdout(&o)
    );
    assert!(!err.contains("| model"), "the table started: {err}");
}

/// Request fields this server cannot honour are refused by name (item 6), never silently
/// ignored; their "off" values pass. On ollama's paths the error is ollama's `{"error": "..."}`.
#[test]
fn unsupported_request_fields_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    let server = Server::start(&out, &[]);
    let chat = |extra: &str| {
        format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":2{extra}}}"#)
    };
    let cmpl = |extra: &str| format!(r#"{{"prompt":"hi","max_tokens":2{extra}}}"#);
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            chat(r#","logprobs":true,"stream":true"#),
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            chat(r#","top_logprobs":3"#),
            "top_logprobs",
        ),
        ("/v1/chat/completions", chat(r#","echo":true"#), "echo"),
        (
            "/v1/completions",
            cmpl(r#","logprobs":1,"stop":["x"]"#),
            "logprobs",
        ),
        (
            "/v1/completions",
            cmpl(r#","top_logprobs":2"#),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            cmpl(r#","suffix":"end","logprobs":2"#),
            "logprobs",
        ),
        (
            "/v1/completions",
            cmpl(r#","decode_events":true"#),
            "decode_events",
        ),
        (
            "/tokenize",
            r#"{"content":"hi","parse_special":false}"#.into(),
            "parse_special",
        ),
    ] {
        let (status, answer) = server.post(path, &body);
        assert_eq!(status, 400, "{path} {body}: {answer}");
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(v["error"]["param"], param, "{path} {body}: {answer}");
        assert!(
            answer.contains("not supported") || answer.contains("served by"),
            "{answer}"
        );
    }
    for (path, body) in [
        (
            "/v1/chat/completions",
            chat(r#","logprobs":false,"top_logprobs":0,"response_format":{"type":"text"}"#),
        ),
        ("/v1/completions", cmpl(r#","logprobs":null,"echo":false"#)),
        (
            "/tokenize",
            r#"{"content":"hi","parse_special":true}"#.into(),
        ),
        (
            "/api/generate",
            r#"{"model":"m","prompt":"hi","stream":false,"format":"","options":{"num_predict":2}}"#
                .into(),
        ),
    ] {
        let (status, answer) = server.post(path, &body);
        assert_eq!(status, 200, "{path} {body}: {answer}");
    }
    for path in ["/api/generate", "/api/chat"] {
        let body = r#"{"model":"m","prompt":"hi","messages":[{"role":"user","content":"hi"}],"format":"xml"}"#;
        let (status, answer) = server.post(path, body);
        assert_eq!(status, 400, "{path}: {answer}");
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert!(
            v["error"]
                .as_str()
                .is_some_and(|e| e.contains("format must be")),
            "{path}: not ollama's error shape: {answer}"
        );
    }
}

/// llama-bench's lists (item 7): several models (`-m a,b` or `-m` repeated) and thread counts
/// (`-t 1,2`) make one table, one header, a row per pair; `-o json` one array; a missing file
/// or a bad count is refused before anything runs.
#[test]
fn bench_takes_lists_of_models_and_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a.gguf"), tmp.path().join("b.gguf"));
    convert_quiet(&fixture_model("pub-a"), &a, "f32");
    convert_quiet(&fixture_model("pub-a"), &b, "q8_0");
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let both = format!("{a},{b}");
    let o = run(&["bench", "-m", &both, "-t", "1,2", "-p", "1", "-r", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    assert_eq!(table.matches("| model").count(), 1, "{table}");
    let rows: Vec<&str> = table.lines().filter(|l| l.contains("pp1")).collect();
    assert_eq!(rows.len(), 4, "{table}");
    assert!(
        rows[0].contains("F32") && rows[3].contains("Q8_0"),
        "{table}"
    );
    let threads: Vec<&str> = rows
        .iter()
        .map(|r| r.split('|').nth(5).unwrap().trim())
        .collect();
    assert_eq!(threads, ["1", "2", "1", "2"], "{table}");
    let o = run(&[
        "bench", "-m", a, "-m", b, "-p", "1", "-r", "1", "-o", "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
    for (args, says) in [
        (
            vec!["-m", a, "-m", "/nonexistent.gguf"],
            "no such model file",
        ),
        (vec!["-m", a, "-t", "1,x"], "expected a thread count"),
    ] {
        let mut full = vec!["bench", "-p", "1", "-r", "1"];
        full.extend(args);
        let o = run(&full);
        assert_fails_with(&o, &[says]);
        assert!(stdout(&o).is_empty(), "ran before refusing: {}", stdout(&o));
    }
}

/// The memory plan counts the cache `serve` allocates (item 3): the context and its room for
/// answers, not the context alone (it planned 12 MiB of KV and allocated 24).
#[test]
fn serve_plans_the_cache_it_allocates() {
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("tiny.gguf");
    convert_quiet(&trained_tiny(), &m, "f32");
    let mut child = std::process::Command::new(bin())
        .args([
            "serve",
            "-m",
            m.to_str().unwrap(),
            "--port",
            "0",
            "-c",
            "2048",
            "-t",
            "1",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    for line in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        lines.push(line.unwrap());
        // The worker allocates the cache beside the listener starting.
        let seen = |n: &str| lines.iter().any(|l| l.contains(n));
        if seen("listening on") && seen("KV cache:") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let log = lines.join("\n");
    // "KV  24.00 MiB" planned; "KV cache: ... (f32, 23.9 MiB)" allocated.
    let planned: f64 = log
        .split("KV ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no plan: {log}"));
    let allocated: f64 = log
        .split("(f32, ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no allocation: {log}"));
    assert!(
        (planned - allocated).abs() <= 0.02 * allocated,
        "planned {planned} MiB, allocated {allocated} MiB:\n{log}"
    );
}

/// The memory plan printed before loading is what `generate` holds at its peak (item 3: a
/// 0.6B file at `-c 4096` planned 1.88 GiB for a 452 MiB peak): the cache is sized to the
/// request and resident from the start, the scratch is of the widest forward and the logits
/// it asks for, and the program (tokenizer included) is counted. Within 10% of the kernel's
/// high-water mark on a real-sized file (and 8 MiB on the tiny model).
#[test]
fn generate_plans_what_it_holds_at_its_peak() {
    let tmp = tempfile::tempdir().unwrap();
    let big = synthetic_gguf(tmp.path(), "0.6b", "q4_0");
    let tiny = trained_tiny_gguf(tmp.path(), "f32");
    for (m, n) in [(&big, "16"), (&tiny, "64")] {
        let args = [
            "generate",
            "-m",
            m.to_str().unwrap(),
            "-c",
            "4096",
            "-p",
            "What is 4 + 5?",
            "-n",
            n,
            "-t",
            "2",
            "--json",
        ];
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let planned = report["memory"]["planned_host_bytes"].as_f64().unwrap();
        let peak = report["memory"]["peak_resident_bytes"].as_f64().unwrap();
        // 10%, or 8 MiB on the tiny model: the worker threads' stacks and the allocator's
        // arenas, made after the plan, are a few MiB the plan does not count.
        let slack = (0.10 * peak).max(8.0 * (1 << 20) as f64);
        assert!(
            (planned - peak).abs() <= slack,
            "{args:?}: planned {planned}, peak {peak}\n{}",
            stderr(&o)
        );
        // The plan printed says the same, and names the cache it sized.
        let err = stderr(&o);
        assert!(err.contains("this prompt and its answer"), "{err}");
    }
    // A prompt and answer beyond the context are refused before the plan and the weights.
    let o = run(&[
        "generate",
        "-m",
        big.to_str().unwrap(),
        "-c",
        "64",
        "-p",
        "What is 4 + 5?",
        "-n",
        "128",
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("more than the context of 64"), "{err}");
    assert!(
        !err.contains("memory plan") && !err.contains("loaded "),
        "{err}"
    );
}

/// llama-cli's text habits: escapes in -p processed by default (`--no-escape` keeps them),
/// `--n-predict`, `--verbose-prompt`; `--color` and `--mlock` refused by name.
#[test]
fn llama_cli_text_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let m = model.to_str().unwrap();
    let args = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "-m",
            m,
            "--no-chat-template",
            "-p",
            r"one\ntwo",
            "--n-predict",
            "4",
            "--verbose-prompt",
        ];
        a.extend_from_slice(extra);
        run(&a)
    };
    let o = args(&[]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(r#"-> "\n""#),
        "no newline token in the prompt:\n{err}"
    );
    let o = args(&["--no-escape"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        !err.contains(r#"-> "\n""#),
        "--no-escape processed the escape:\n{err}"
    );
    assert!(
        err.contains(r"\\"),
        "the backslash is not in the prompt:\n{err}"
    );
    assert_fails_with(
        &args(&["--color"]),
        &["--color: refusion prints the answer as plain text"],
    );
    assert_fails_with(&args(&["--mlock"]), &["--mlock is not supported"]);
}

/// ollama's `OLLAMA_KV_CACHE_TYPE` sets `serve`'s KV cache type when no flag does; a bad value
/// is named in one line before the model loads.
#[test]
fn serve_honours_ollamas_kv_cache_type() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let o = Command::new(bin())
        .args(["serve", "-m", "/nonexistent.gguf", "--port", "0"])
        .env("OLLAMA_KV_CACHE_TYPE", "q9_9")
        .output()
        .unwrap();
    assert_fails_with(&o, &["OLLAMA_KV_CACHE_TYPE=q9_9"]);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    for (flag, want) in [(None, "q8_0"), (Some("f16"), "f16")] {
        let mut cmd = Command::new(bin());
        cmd.args(["serve", "-m", out.to_str().unwrap(), "--port", "0"]);
        if let Some(f) = flag {
            cmd.args(["--cache-type", f]);
        }
        let mut child = cmd
            .env("OLLAMA_KV_CACHE_TYPE", "q8_0")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = Vec::new();
        for line in BufReader::new(child.stderr.take().unwrap()).lines() {
            let line = line.unwrap();
            let done = line.contains("listening on");
            lines.push(line);
            if done {
                break;
            }
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let log = lines.join("\n");
        assert_eq!(
            log.contains("from OLLAMA_KV_CACHE_TYPE"),
            flag.is_none(),
            "{log}"
        );
        let kv = log
            .lines()
            .find(|l| l.starts_with("KV cache:"))
            .unwrap_or("");
        assert!(kv.to_lowercase().contains(want), "{want}: {log}");
    }
}
