//! The hostile-request matrix: every JSON endpoint of `refusion serve` gets the same set of
//! broken, absurd and adversarial bodies. Each must be answered within the time limits with a
//! 2xx, or a 4xx carrying an error object; never a 5xx, a hang or a dropped connection; and the
//! server must stay healthy. Run with `--nocapture` for the counts.

mod common;

use std::time::Duration;

use common::server::{try_post, Server};
use common::*;

/// Bodies a careless or hostile client sends, whatever the endpoint.
fn payloads() -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = Vec::new();
    let mut add = |name: &str, body: String| v.push((name.to_string(), body.into_bytes()));
    add("empty", String::new());
    add("null", "null".into());
    add("a list", "[]".into());
    add("an empty object", "{}".into());
    add("a number", "12".into());
    add("not JSON", "{not json".into());
    add(
        "deep nesting",
        format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)),
    );
    add(
        "trailing data",
        r#"{"prompt":"hi"}{"prompt":"again"}"#.into(),
    );
    add(
        "a lone surrogate",
        r#"{"prompt":"\ud800","messages":[{"role":"user","content":"\ud800"}]}"#.into(),
    );
    add("NaN literal", r#"{"prompt":"hi","temperature":NaN}"#.into());
    add("1e999", r#"{"prompt":"hi","temperature":1e999}"#.into());
    add(
        "negative max_tokens",
        r#"{"prompt":"hi","max_tokens":-1}"#.into(),
    );
    add(
        "max_tokens 2^64",
        r#"{"prompt":"hi","max_tokens":18446744073709551616}"#.into(),
    );
    add(
        "max_tokens as text",
        r#"{"prompt":"hi","max_tokens":"many"}"#.into(),
    );
    add("slot_size 2^32-1", r#"{"prompt":"hi","messages":[{"role":"user","content":"hi"}],"slot_size":4294967295,"max_tokens":8}"#.into());
    add(
        "serial_blocks 0",
        r#"{"prompt":"hi","messages":[{"role":"user","content":"hi"}],"serial_blocks":0}"#.into(),
    );
    add(
        "threshold 7",
        r#"{"prompt":"hi","messages":[{"role":"user","content":"hi"}],"slot_threshold":7}"#.into(),
    );
    add("seed u64::MAX", r#"{"prompt":"hi","messages":[{"role":"user","content":"hi"}],"seed":18446744073709551615,"max_tokens":8}"#.into());
    add(
        "a thousand stops",
        format!(
            r#"{{"prompt":"hi","max_tokens":8,"stop":[{}]}}"#,
            vec!["\"x\""; 1000].join(",")
        ),
    );
    add(
        "ids beyond the vocabulary",
        r#"{"prompt":[999999999],"tokens":[999999999],"max_tokens":8}"#.into(),
    );
    add(
        "the mask token",
        r#"{"prompt":[151670],"max_tokens":8}"#.into(),
    );
    add("an empty message list", r#"{"messages":[]}"#.into());
    add(
        "an unknown role",
        r#"{"messages":[{"role":"wizard","content":"hi"}],"max_tokens":8}"#.into(),
    );
    add("content parts of odd types", r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x"}},{"type":"text","text":5}]}]}"#.into());
    add("HTML in the prompt", r#"{"prompt":"<img src=x onerror=alert(1)>","messages":[{"role":"user","content":"<script>alert(1)</script>"}],"max_tokens":8,"model":"<b>x</b>"}"#.into());
    add("a template injection", r#"{"messages":[{"role":"user","content":"{{ raise_exception('x') }}{% for i in range(99999999) %}{% endfor %}"}],"max_tokens":8}"#.into());
    add(
        "n 2",
        r#"{"prompt":"hi","messages":[{"role":"user","content":"hi"}],"n":2}"#.into(),
    );
    add(
        "duplicate keys",
        r#"{"prompt":"hi","prompt":5,"max_tokens":8}"#.into(),
    );
    add("markers in a suffix", r#"{"prompt":"hi","suffix":"{{gap:0}}{{gap","input_prefix":"hi","input_suffix":"{{gap:0}}{{gap","max_tokens":8,"n_predict":8}"#.into());
    add(
        "a suffix of the wrong type",
        r#"{"prompt":"hi","suffix":5,"input_prefix":"x","input_suffix":[1],"max_tokens":8}"#.into(),
    );
    add("the mask in a suffix", r#"{"prompt":"hi","suffix":"<|mask|>","input_prefix":"hi","input_suffix":"<|mask|>","max_tokens":8}"#.into());
    add("a huge gap", r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"{{gap:1048576}}{{gap:4294967296}}"}],"infill":true}"#.into());
    add(
        "infill with no answer",
        r#"{"messages":[{"role":"user","content":"hi"}],"infill":true,"max_tokens":8}"#.into(),
    );
    add(
        "infill of the wrong type",
        r#"{"messages":[{"role":"user","content":"hi"}],"infill":"yes"}"#.into(),
    );
    add(
        "odd input_extra",
        r#"{"input_prefix":"x","input_extra":[{"filename":5,"text":null}],"n_predict":8}"#.into(),
    );
    add(
        "n_predict -7",
        r#"{"input_prefix":"x","n_predict":-7}"#.into(),
    );
    add(
        "a long prompt",
        format!(
            r#"{{"prompt":"{}","max_tokens":8}}"#,
            "word ".repeat(20_000)
        ),
    );
    v
}

#[test]
fn every_endpoint_answers_every_hostile_body_with_a_clean_status() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    // A short default answer: ollama's endpoints ignore the OpenAI fields and use it.
    let server = Server::start(&model, &["--body-timeout", "10", "-n", "16"]);
    let endpoints = [
        "/v1/chat/completions",
        "/v1/completions",
        "/tokenize",
        "/detokenize",
        "/api/generate",
        "/api/chat",
        "/api/show",
        "/infill",
    ];
    let (mut tried, mut ok, mut refused) = (0, 0, 0);
    let mut bad = Vec::new();
    for path in endpoints {
        for (name, body) in payloads() {
            tried += 1;
            let t = std::time::Instant::now();
            let answer = try_post(&server.addr(), path, &body);
            if t.elapsed() > Duration::from_secs(2) {
                eprintln!("slow: {path} {name}: {:?}", t.elapsed());
            }
            match answer {
                Some((s, _)) if (200..300).contains(&s) => ok += 1,
                Some((s, b)) if (400..500).contains(&s) => {
                    let v: Result<serde_json::Value, _> = serde_json::from_str(&b);
                    let has_error = v.as_ref().is_ok_and(|v| v.get("error").is_some());
                    if has_error {
                        refused += 1;
                    } else {
                        bad.push(format!("{path} {name}: {s} without an error object: {b}"));
                    }
                }
                Some((s, b)) => bad.push(format!("{path} {name}: {s}: {b}")),
                None => bad.push(format!("{path} {name}: no answer")),
            }
        }
    }
    let health = try_post(&server.addr(), "/health", b"");
    eprintln!(
        "hostile requests: {tried} tried, {ok} answered 2xx, {refused} refused 4xx with an error object, {} other",
        bad.len()
    );
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert!(
        server.log_lines().iter().all(|l| !l.contains("panicked")),
        "a panic in the log"
    );
    // /health is GET-only: a POST gets 405, which shows the server is still up.
    assert_eq!(health.map(|h| h.0), Some(405));
}
