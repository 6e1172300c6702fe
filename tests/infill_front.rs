//! Gap filling through the front ends, on the trained tiny ReFusion at f32: `generate
//! --template` gives train/infill.py's tokens for every templated golden case (the spans
//! tokenized by the runtime as by transformers); `--suffix`, `/v1/completions`' `suffix`,
//! llama-server's `/infill`, ollama's `suffix` and `/v1/chat/completions` with `"infill": true`
//! answer the golden fills, streamed and whole; mistakes are one clear line (CLI) or a 400
//! naming the field (server).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::server::Server;
use common::*;
use serde_json::{json, Value};

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join("goldens_infill.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.get("template_text").is_some())
        .cloned()
        .collect()
}

fn knob_flags(c: &Value) -> Vec<String> {
    vec![
        "-n".into(),
        c["gen_length"].to_string(),
        "--slot-size".into(),
        c["slot_size"].to_string(),
        "--serial-blocks".into(),
        c["serial_num_blocks"].to_string(),
        "--slot-threshold".into(),
        c["slot_threshold"].to_string(),
        "--token-threshold".into(),
        c["token_threshold"].to_string(),
    ]
}

fn ids_arg(v: &Value) -> String {
    let ids: Vec<String> = golden_ids(v).iter().map(|t| t.to_string()).collect();
    ids.join(",")
}

#[test]
fn generate_with_a_template_gives_the_reference_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let cases = cases();
    assert!(cases.len() >= 30, "{} templated cases", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        let mut args: Vec<String> = vec![
            "generate".into(),
            "-m".into(),
            m.to_str().unwrap().into(),
            "--prompt-ids".into(),
            ids_arg(&c["prompt_ids"]),
            "--template".into(),
            c["template_text"].as_str().unwrap().into(),
            "--json".into(),
        ];
        args.extend(knob_flags(c));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = run(&args);
        assert!(o.status.success(), "{}: {}", c["id"], stderr(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let same = v["tokens"] == c["tokens"]
            && (v["tpf"].as_f64().unwrap() - c["tpf"].as_f64().unwrap()).abs() < 1e-9
            && v["forward_calls"] == c["n_forward"]
            && v["gaps"].as_array().unwrap().len() == c["fills"].as_array().unwrap().len();
        if !same {
            failures.push(format!(
                "{}: {} (want {})",
                c["id"], v["tokens"], c["tokens"]
            ));
        }
        for (g, f) in v["gaps"]
            .as_array()
            .unwrap()
            .iter()
            .zip(c["fills"].as_array().unwrap())
        {
            assert_eq!(g["tokens"], f["tokens"], "{}", c["id"]);
            assert_eq!(g["eos"], f["eos"], "{}", c["id"]);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_suffix_is_one_gap_before_its_text() {
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let base = [
        "generate",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "What is 23 + 16?",
        "-n",
        "24",
        "--json",
    ];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        let o = run(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<Value>(&o.stdout).unwrap()
    };
    let s = with(&["--suffix", "The answer is 39."]);
    let t = with(&["--template", "{{gap}}The answer is 39."]);
    assert_eq!(s["tokens"], t["tokens"]);
    assert_eq!(s["params"]["strategy"], "infill");
    assert!(s["text"].as_str().unwrap().ends_with("The answer is 39."));
    // Printed as text: the stitched answer.
    let o = run(&[
        "generate",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "What is 23 + 16?",
        "--template",
        "We add 23 and 16 column by column.\n{{gap:16}}Tens: 2 + 1 = 3, write 3.",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.starts_with("We add 23 and 16 column by column.\nOnes: 3 + 6 = 9, write 9."));
    assert!(
        text.trim_end().ends_with("Tens: 2 + 1 = 3, write 3."),
        "{text}"
    );
}

#[test]
fn bad_templates_are_refused_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let m = m.to_str().unwrap();
    let gen = |extra: &[&str]| {
        let mut a = vec!["generate", "-m", m, "-p", "What is 2 + 2?"];
        a.extend_from_slice(extra);
        run(&a)
    };
    for (extra, says) in [
        (&["--template", "no gap here"][..], "has no gap"),
        (&["--template", "a {{gap:x}} b"][..], "malformed gap marker"),
        (&["--template", "a {{gap"][..], "malformed gap marker"),
        (&["--template", "a {{gap:0}}"][..], "a gap of 0 tokens"),
        (
            &["--template", "a {{gap:2000000}}"][..],
            "beyond any context",
        ),
        (&["--template", "a <|mask|> {{gap}}"][..], "mask token"),
        (&["--template", "{{gap:4000}}", "-c", "512"][..], "context"),
        (
            &["--suffix", "x", "--strategy", "ar"][..],
            "cannot fill them",
        ),
        (
            &["--suffix", "x", "--template", "{{gap}}"][..],
            "cannot be used with",
        ),
    ] {
        let o = gen(extra);
        assert!(!o.status.success(), "{extra:?} succeeded");
        let err = stderr(&o);
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
    }
    // A batch line asking for gap filling is refused by name, not run without its gaps.
    let batch = tmp.path().join("b.jsonl");
    std::fs::write(&batch, "{\"prompt\":\"hi\",\"suffix\":\"x\"}\n").unwrap();
    let o = run(&["generate", "-m", m, "--batch", batch.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("b.jsonl:1: suffix"), "{}", stderr(&o));
    // Marker mistakes are found before the model loads: even with no model file.
    let o = run(&[
        "generate",
        "-m",
        "/nonexistent.gguf",
        "-p",
        "x",
        "--template",
        "{{gap:y}}",
    ]);
    assert!(
        stderr(&o).contains("malformed gap marker"),
        "{}",
        stderr(&o)
    );
}

/// Status and body of one request.
fn post(server: &Server, path: &str, body: &Value) -> (u16, String) {
    let body = body.to_string();
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (
        head.split_whitespace().nth(1).unwrap().parse().unwrap(),
        body.to_string(),
    )
}

fn post_json(server: &Server, path: &str, body: &Value) -> Value {
    let (status, text) = post(server, path, body);
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap()
}

/// The `data:` objects of a server-sent event stream (chunked bodies: data lines only).
fn sse(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn detok(server: &Server, ids: &Value) -> String {
    let v = post_json(server, "/detokenize", &json!({"tokens": ids}));
    v["content"].as_str().unwrap().to_string()
}

/// Whether `text` tokenizes to `ids`.
fn retokenizes(server: &Server, text: &str, ids: &Value) -> bool {
    post_json(server, "/tokenize", &json!({"content": text}))["tokens"] == *ids
}

fn knobs(c: &Value) -> Value {
    json!({
        "max_tokens": c["gen_length"],
        "slot_size": c["slot_size"], "serial_blocks": c["serial_num_blocks"],
        "slot_threshold": c["slot_threshold"], "token_threshold": c["token_threshold"],
    })
}

fn merged(mut a: Value, b: &Value) -> Value {
    for (k, v) in b.as_object().unwrap() {
        a[k] = v.clone();
    }
    a
}

#[test]
fn every_api_fills_the_gaps_as_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let server = Server::start(&m, &["--parallel", "4"]);
    let cases = cases();
    // One gap then text: the suffix shape of OpenAI, llama-server and ollama.
    let suffixed: Vec<&Value> = cases
        .iter()
        .filter(|c| c["template_name"] == "start" || c["template_name"] == "last_line")
        .collect();
    assert!(suffixed.len() >= 8);
    for c in suffixed {
        let t = c["template_text"].as_str().unwrap();
        let suffix = t.strip_prefix("{{gap}}").unwrap();
        let n = c["gen_length"].as_u64().unwrap();
        let fill = detok(&server, &c["fills"][0]["tokens"]);
        let prompt_text = detok(&server, &c["prompt_ids"]);
        let k = knobs(c);
        let v = post_json(
            &server,
            "/v1/completions",
            &merged(
                json!({"prompt": c["prompt_ids"], "suffix": suffix, "max_tokens": n}),
                &k,
            ),
        );
        assert_eq!(v["choices"][0]["text"], fill, "{} completions", c["id"]);
        let streamed = post(
            &server,
            "/v1/completions",
            &merged(
                json!({"prompt": c["prompt_ids"], "suffix": suffix, "max_tokens": n, "stream": true}),
                &k,
            ),
        );
        let text: String = sse(&streamed.1)
            .iter()
            .filter_map(|e| e["choices"][0]["text"].as_str().map(String::from))
            .collect();
        assert_eq!(text, fill, "{} completions streamed", c["id"]);
        // /infill takes text: the same answer as completions given that text (and the
        // golden fill where the text tokenizes back to the golden's prompt ids).
        let v = post_json(
            &server,
            "/infill",
            &merged(
                json!({"input_prefix": prompt_text, "input_suffix": suffix, "n_predict": n}),
                &k,
            ),
        );
        let fill = if retokenizes(&server, &prompt_text, &c["prompt_ids"]) {
            fill
        } else {
            let by_text = post_json(
                &server,
                "/v1/completions",
                &merged(
                    json!({"prompt": prompt_text, "suffix": suffix, "max_tokens": n}),
                    &k,
                ),
            );
            by_text["choices"][0]["text"].as_str().unwrap().to_string()
        };
        assert_eq!(v["content"], fill, "{} /infill", c["id"]);
        let eos = c["fills"][0]["eos"].as_bool().unwrap();
        assert_eq!(v["stop_type"], if eos { "eos" } else { "limit" });
        let streamed = post(
            &server,
            "/infill",
            &merged(
                json!({"input_prefix": prompt_text, "input_suffix": suffix, "n_predict": n, "stream": true}),
                &k,
            ),
        );
        let events = sse(&streamed.1);
        let text: String = events
            .iter()
            .filter_map(|e| e["content"].as_str().map(String::from))
            .collect();
        assert_eq!(text, fill, "{} /infill streamed", c["id"]);
        assert_eq!(events.last().unwrap()["stop"], true);
    }
    // ollama: the server's (the file's: the card's) settings, a gap of num_predict.
    let c = cases
        .iter()
        .find(|c| c["template_name"] == "last_line" && c["set"] == "card")
        .unwrap();
    let suffix = c["template_text"]
        .as_str()
        .unwrap()
        .strip_prefix("{{gap}}")
        .unwrap();
    let v = post_json(
        &server,
        "/api/generate",
        &json!({"prompt": detok(&server, &c["prompt_ids"]), "raw": true, "suffix": suffix,
                "stream": false, "options": {"num_predict": 512}}),
    );
    let prompt_text = detok(&server, &c["prompt_ids"]);
    assert!(retokenizes(&server, &prompt_text, &c["prompt_ids"]));
    assert_eq!(v["response"], detok(&server, &c["fills"][0]["tokens"]));
    let (_, body) = post(
        &server,
        "/api/generate",
        &json!({"prompt": detok(&server, &c["prompt_ids"]), "raw": true, "suffix": suffix,
                "options": {"num_predict": 512}}),
    );
    let streamed: String = body
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["response"].as_str().map(String::from))
        .collect();
    assert_eq!(streamed, v["response"].as_str().unwrap());
}

#[test]
fn chat_completions_fill_an_answers_markers_when_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let server = Server::start(&m, &[]);
    let held: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("../../models/refusion-tiny/heldout.json"))
            .unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for c in cases()
        .iter()
        .filter(|c| c["template_name"] == "two_gaps" || c["template_name"] == "middle")
    {
        // The golden's prompt is the chat template over its question.
        let prompt = detok(&server, &c["prompt_ids"]);
        let q = held
            .as_array()
            .unwrap()
            .iter()
            .find(|h| prompt.contains(h["question"].as_str().unwrap()))
            .unwrap();
        let body = merged(
            json!({"messages": [{"role": "user", "content": q["question"]},
                                {"role": "assistant", "content": c["template_text"]}],
                   "infill": true}),
            &knobs(c),
        );
        let v = post_json(&server, "/v1/chat/completions", &body);
        let fills: Vec<String> = c["fills"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| detok(&server, &f["tokens"]))
            .collect();
        assert_eq!(v["choices"][0]["fills"], json!(fills), "{}", c["id"]);
        let mut stitched = c["template_text"].as_str().unwrap().to_string();
        for f in &fills {
            let at = stitched.find("{{gap:").unwrap();
            let end = at + stitched[at..].find("}}").unwrap() + 2;
            stitched.replace_range(at..end, f);
        }
        assert_eq!(v["choices"][0]["message"]["content"], stitched.as_str());
        // Streamed: each delta names its gap; per gap they add up to its fill.
        let (_, text) = post(
            &server,
            "/v1/chat/completions",
            &merged(body, &json!({"stream": true})),
        );
        let mut per_gap = vec![String::new(); fills.len()];
        for e in sse(&text) {
            let d = &e["choices"][0]["delta"];
            if let (Some(g), Some(t)) = (d["gap"].as_u64(), d["content"].as_str()) {
                per_gap[g as usize].push_str(t);
            }
        }
        assert_eq!(per_gap, fills, "{} streamed", c["id"]);
        checked += 1;
    }
    assert!(checked >= 4);
    // Without "infill", markers are text: the answer continues after them as usual.
    let v = post_json(
        &server,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "What is 2 + 3?"},
                             {"role": "assistant", "content": "{{gap}}"}], "max_tokens": 8}),
    );
    assert!(v["choices"][0].get("fills").is_none());
}

#[test]
fn template_mistakes_are_400s_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let server = Server::start(&m, &["-c", "256"]);
    let chat = |answer: &str| {
        json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}],
               "infill": true})
    };
    for (path, body, field, says) in [
        ("/v1/chat/completions", chat("no gap"), "messages", "no gap"),
        (
            "/v1/chat/completions",
            chat("a {{gap:"),
            "messages",
            "malformed",
        ),
        (
            "/v1/chat/completions",
            chat("a {{gap:0}}"),
            "messages",
            "0 tokens",
        ),
        (
            "/v1/chat/completions",
            chat("a <|mask|>{{gap}}"),
            "messages",
            "mask token",
        ),
        (
            "/v1/chat/completions",
            // Gaps within the server's limit, a known span that overflows the context.
            chat(&format!("{}{{{{gap:100}}}}", "word ".repeat(200))),
            "max_tokens",
            "context",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "infill": true}),
            "messages",
            "last message",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "suffix": "<|mask|>"}),
            "suffix",
            "mask token",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "suffix": "x", "strategy": "ar"}),
            "strategy",
            "cannot fill",
        ),
        // Positions beyond any context (they would overflow u32 together): refused, and the
        // server goes on.
        (
            "/v1/chat/completions",
            chat(&"{{gap:1048576}}".repeat(4100)),
            "messages",
            "more than any context",
        ),
        (
            "/v1/chat/completions",
            chat("a{{gap:3000}}"),
            "messages",
            "max_tokens limit (236)",
        ),
        (
            "/infill",
            json!({"input_suffix": "x"}),
            "input_prefix",
            "must not be empty",
        ),
        (
            "/infill",
            json!({"input_prefix": "a", "n_predict": 0}),
            "n_predict",
            "positive",
        ),
        (
            "/infill",
            json!({"input_prefix": "a", "input_suffix": "<|mask|>"}),
            "input_suffix",
            "mask",
        ),
    ] {
        let (status, text) = post(&server, path, &body);
        assert_eq!(status, 400, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], field, "{path} {body}: {text}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(says),
            "{text}"
        );
    }
}
