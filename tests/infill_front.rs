//! Gap filling through the front ends, on the trained tiny ReFusion at f32: `generate
//! --template` gives train/infill.py's tokens for every templated golden case with exact gaps
//! (`{{gap:=N}}`: the spans tokenized by the runtime as by transformers), and train/fit.py's for
//! every fitted one (`{{gap}}`, `{{gap:N}}`: token healing, the probe, the final decode, the
//! stitched text); `--suffix`, `/v1/completions`' `suffix`, llama-server's `/infill`, ollama's
//! `suffix` and `/v1/chat/completions` with `"infill": true` answer the golden fills, streamed
//! and whole; mistakes are one clear line (CLI) or a 400 naming the field (server).

mod common;

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

/// The fitted-gap golden cases (train/fit.py).
fn fit_cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join("goldens_fit.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

/// A golden template with exact gaps: `{{gap:N}}` as `{{gap:=N}}`, `{{gap}}` as the gen length.
fn exact(c: &Value) -> String {
    let t = c["template_text"].as_str().unwrap();
    t.replace("{{gap}}", &format!("{{{{gap:={}}}}}", c["gen_length"]))
        .replace("{{gap:", "{{gap:=")
        .replace("{{gap:==", "{{gap:=")
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
            exact(c),
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

/// `generate --template` on every fitted golden case: the same tokens at the same positions,
/// forwards (the probe's and the final decode's), TPF, stitched text and fills.
#[test]
fn generate_fits_gaps_as_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let cases = fit_cases();
    assert!(cases.len() >= 60, "{} fitted cases", cases.len());
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
            "--temp".into(),
            c["temperature"].to_string(),
            "--seed".into(),
            c["seed"].to_string(),
        ];
        args.extend(knob_flags(c));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = run(&args);
        assert!(o.status.success(), "{}: {}", c["id"], stderr(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let gaps: Vec<(Value, Value, Value)> = v["gaps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                (
                    g["tokens"].clone(),
                    g["text"].clone(),
                    g["truncated"].clone(),
                )
            })
            .collect();
        let want: Vec<(Value, Value, Value)> = c["fills"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                (
                    f["tokens"].clone(),
                    f["text"].clone(),
                    f["truncated"].clone(),
                )
            })
            .collect();
        let same = v["tokens"] == c["tokens"]
            && v["positions"] == c["positions"]
            && v["forward_calls"] == c["n_forward"]
            && (v["tpf"].as_f64().unwrap() - c["tpf"].as_f64().unwrap()).abs() < 1e-9
            && v["text"] == c["text"]
            && gaps == want;
        if !same {
            failures.push(format!(
                "{} {}: {} in {} forwards (want {:?} in {})",
                c["id"],
                c["template_name"],
                v["text"],
                v["forward_calls"],
                c["text"],
                c["n_forward"]
            ));
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
        (
            &["--template", "a <|mask|> {{gap}}", "--parse-special"][..],
            "mask token",
        ),
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

/// The `data:` objects of a server-sent event stream (chunked bodies: data lines only).
fn sse(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn detok(server: &Server, ids: &Value) -> String {
    let v = server.post_json("/detokenize", &json!({"tokens": ids}));
    v["content"].as_str().unwrap().to_string()
}

/// Whether `text` tokenizes to `ids`.
fn retokenizes(server: &Server, text: &str, ids: &Value) -> bool {
    server.post_json("/tokenize", &json!({"content": text}))["tokens"] == *ids
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
    let cases = fit_cases();
    // One gap then text: the suffix shape of OpenAI, llama-server and ollama (a fitted gap).
    let suffixed: Vec<&Value> = cases
        .iter()
        .filter(|c| {
            c["temperature"] == 0.0
                && (c["template_name"] == "suffix_first" || c["template_name"] == "suffix_last")
        })
        .collect();
    assert!(suffixed.len() >= 8);
    for c in suffixed {
        let t = c["template_text"].as_str().unwrap();
        let suffix = t.strip_prefix("{{gap}}").unwrap();
        let n = c["gen_length"].as_u64().unwrap();
        let fill = c["fills"][0]["text"].as_str().unwrap().to_string();
        let truncated = c["fills"][0]["truncated"].as_bool().unwrap();
        let prompt_text = detok(&server, &c["prompt_ids"]);
        let k = knobs(c);
        let v = server.post_json(
            "/v1/completions",
            &merged(
                json!({"prompt": c["prompt_ids"], "suffix": suffix, "max_tokens": n}),
                &k,
            ),
        );
        assert_eq!(v["choices"][0]["text"], fill, "{} completions", c["id"]);
        let reason = if truncated { "length" } else { "stop" };
        assert_eq!(v["choices"][0]["finish_reason"], reason, "{}", c["id"]);
        let streamed = server.post(
            "/v1/completions",
            merged(
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
        let v = server.post_json(
            "/infill",
            &merged(
                json!({"input_prefix": prompt_text, "input_suffix": suffix, "n_predict": n}),
                &k,
            ),
        );
        let fill = if retokenizes(&server, &prompt_text, &c["prompt_ids"]) {
            fill
        } else {
            let by_text = server.post_json(
                "/v1/completions",
                &merged(
                    json!({"prompt": prompt_text, "suffix": suffix, "max_tokens": n}),
                    &k,
                ),
            );
            by_text["choices"][0]["text"].as_str().unwrap().to_string()
        };
        assert_eq!(v["content"], fill, "{} /infill", c["id"]);
        assert_eq!(v["stop_type"], if truncated { "limit" } else { "eos" });
        let streamed = server.post(
            "/infill",
            merged(
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
        .find(|c| c["template_name"] == "suffix_last" && c["set"] == "card")
        .unwrap();
    let suffix = c["template_text"]
        .as_str()
        .unwrap()
        .strip_prefix("{{gap}}")
        .unwrap();
    let prompt_text = detok(&server, &c["prompt_ids"]);
    assert!(retokenizes(&server, &prompt_text, &c["prompt_ids"]));
    let v = server.post_json(
        "/api/generate",
        &json!({"prompt": prompt_text, "raw": true, "suffix": suffix,
                "stream": false, "options": {"num_predict": 512}}),
    );
    assert_eq!(v["response"], c["fills"][0]["text"]);
    let (_, body) = server.post(
        "/api/generate",
        json!({"prompt": prompt_text, "raw": true, "suffix": suffix,
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
                                {"role": "assistant", "content": exact(c)}],
                   "infill": true}),
            &knobs(c),
        );
        let v = server.post_json("/v1/chat/completions", &body);
        let fills: Vec<String> = c["fills"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| detok(&server, &f["tokens"]))
            .collect();
        assert_eq!(v["choices"][0]["fills"], json!(fills), "{}", c["id"]);
        let mut stitched = exact(c);
        for f in &fills {
            let at = stitched.find("{{gap:").unwrap();
            let end = at + stitched[at..].find("}}").unwrap() + 2;
            stitched.replace_range(at..end, f);
        }
        assert_eq!(v["choices"][0]["message"]["content"], stitched.as_str());
        // Streamed: each delta names its gap; per gap they add up to its fill.
        let (_, text) = server.post(
            "/v1/chat/completions",
            merged(body, &json!({"stream": true})),
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
    let v = server.post_json(
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
            {
                let mut b = chat("a <|mask|>{{gap}}");
                b["parse_special"] = json!(true);
                b
            },
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
            json!({"input_prefix": "a", "n_predict": -5}),
            "n_predict",
            "0 or more",
        ),
    ] {
        let (status, text) = server.post(path, &body);
        assert_eq!(status, 400, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], field, "{path} {body}: {text}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(says),
            "{text}"
        );
    }
    // A special token's text in a suffix or a known span is text (llama.cpp's
    // `parse_special: false`): answered, and kept as written.
    let (status, text) = server.post(
        "/v1/completions",
        json!({"prompt": "hi", "suffix": "<|mask|>", "max_tokens": 8}),
    );
    assert_eq!(status, 200, "{text}");
    let v = server.post_json(
        "/v1/chat/completions",
        &merged(chat("a <|im_end|> b{{gap:8}}"), &json!({"max_tokens": 8})),
    );
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.starts_with("a <|im_end|> b"), "{answer:?}");
}

/// llama-server's `n_indent` rule: `text` up to its first later line that is not blank and is
/// indented less than `n` spaces.
fn within_indent(text: &str, n: usize) -> String {
    let mut out = String::new();
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let indent = line.len() - line.trim_start_matches([' ', '\t']).len();
        if i > 0 && n > 0 && !line.trim().is_empty() && indent < n {
            break;
        }
        out.push_str(line);
    }
    out
}

/// The answer `generate --template` gives for `before{{gap:N}}after` (the prompt's ids given):
/// what every front end must stitch too.
fn cli_answer(m: &std::path::Path, prompt_ids: &Value, template: &str, temp: &str) -> String {
    let o = run(&[
        "generate",
        "-m",
        m.to_str().unwrap(),
        "--prompt-ids",
        &ids_arg(prompt_ids),
        "--template",
        template,
        "--temp",
        temp,
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["text"].as_str().unwrap().to_string()
}

/// The requests editor plugins send, in their exact shapes, with the cursor inside a line of a
/// code answer: llama.vim and llama.vscode (`/infill`: `input_extra` chunks, `input_prefix`,
/// the cursor line's start as `prompt`, `input_suffix`, `n_predict`, `n_indent`, their sampler
/// fields, `t_max_*_ms`, llama.vim's `response_fields`, and its context-only `n_predict: 0`),
/// Continue (OpenAI `suffix` streamed with its stop strings; ollama `suffix` with `raw`). Each
/// fill, put between the text before and after the cursor, is the answer the command line
/// stitches for that template: the suffix never repeated.
#[test]
fn editor_plugins_fill_in_the_middle_requests() {
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let server = Server::start(&m, &[]);
    // A code answer of the tiny model's, and its question through the chat template (the
    // editor's extra context here: the model answers in that form).
    let cases = fit_cases();
    let c = cases.iter().find(|c| c["kind"] == "code").unwrap();
    let answer = c["truth"].as_str().unwrap();
    let prompt_ids = c["prompt_ids"].clone();
    let prompt_text = detok(&server, &prompt_ids);
    assert!(retokenizes(&server, &prompt_text, &prompt_ids));
    // The cursor inside the function's last line, halfway, and the line's middle quarter
    // missing after it (with nothing missing, the right fill is empty).
    let lines: Vec<&str> = answer.split('\n').collect();
    let row = lines.len() - 2;
    let (col, resume) = (lines[row].len() / 2, lines[row].len() * 3 / 4);
    let prefix: String = lines[..row].iter().map(|l| format!("{l}\n")).collect();
    let cursor_line = &lines[row][..col];
    let after = format!("{}\n{}", &lines[row][resume..], lines[row + 1..].join("\n"));
    let n = 64;
    let want = cli_answer(
        &m,
        &prompt_ids,
        &format!("{prefix}{cursor_line}{{{{gap:{n}}}}}{after}"),
        "0",
    );
    let before = format!("{prefix}{cursor_line}");
    let fill_of = |content: &str| format!("{before}{content}{after}");
    // llama.vim.
    let v = server.post_json(
        "/infill",
        &json!({
            "input_prefix": prefix, "input_suffix": after,
            "input_extra": [{"text": prompt_text, "time": [1733, 1], "filename": ""}],
            "prompt": cursor_line, "n_predict": n, "n_indent": 0, "top_k": 40, "top_p": 0.99,
            "stream": false, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": true,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 60_000,
            "response_fields": ["content", "timings/prompt_n", "timings/predicted_n",
                                "timings/predicted_ms", "truncated", "tokens_cached"],
        }),
    );
    let content = v["content"].as_str().unwrap();
    assert_eq!(fill_of(content), want, "llama.vim: {v}");
    assert!(v.get("timings/predicted_n").is_some(), "{v}");
    assert!(v.get("stop").is_none(), "only the fields asked for: {v}");
    assert!(!content.is_empty());
    let first_after = after.lines().next().unwrap();
    assert!(
        first_after.is_empty() || !content.ends_with(first_after),
        "the suffix repeated: {content:?}"
    );
    // llama.vim's context-only request.
    let v = server.post_json(
        "/infill",
        &json!({"input_prefix": "", "input_suffix": "", "prompt": "",
                "input_extra": [{"text": prompt_text, "time": [1, 2], "filename": "a.py"}],
                "n_predict": 0, "temperature": 0.0, "stream": false, "samplers": [],
                "cache_prompt": true, "t_max_prompt_ms": 1, "t_max_predict_ms": 1,
                "response_fields": [""]}),
    );
    assert_eq!(v, json!({}));
    // llama.vscode.
    let v = server.post_json(
        "/infill",
        &json!({
            "input_prefix": prefix, "input_suffix": after,
            "input_extra": [{"text": prompt_text, "time": 0, "filename": ""}],
            "prompt": cursor_line, "n_predict": n, "top_k": 40, "top_p": 0.99, "stream": false,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": true,
            "n_indent": cursor_line.len() - cursor_line.trim_start().len(),
            "t_max_prompt_ms": 500, "t_max_predict_ms": 60_000,
        }),
    );
    // n_indent (the cursor line's indentation): the middle ends before a shallower line.
    let fill = &want[before.len()..want.len() - after.len()];
    let indent = cursor_line.len() - cursor_line.trim_start().len();
    assert_eq!(
        v["content"].as_str().unwrap(),
        within_indent(fill, indent),
        "llama.vscode: {v}"
    );
    assert_eq!(v["stop_type"], "eos");
    assert!(v["timings"]["predicted_n"].as_u64().unwrap() > 0);
    // Continue, OpenAI: the prompt as text (the chat header written out), streamed, its stops.
    let (status, body) = server.post(
        "/v1/completions",
        json!({"model": "refusion", "prompt": format!("{prompt_text}{before}"), "suffix": after,
                "max_tokens": n, "temperature": 0, "stream": true,
                "stop": ["\n\n\n", "```", "/src/", "#- coding: utf-8"]}),
    );
    assert_eq!(status, 200);
    let streamed: String = sse(&body)
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str().map(String::from))
        .collect();
    // "```" is a stop string here: the fill is cut before any.
    let cut = want[before.len()..want.len() - after.len()].to_string();
    let cut = cut.split("```").next().unwrap();
    assert_eq!(streamed, cut, "Continue (OpenAI)");
    // Continue, ollama.
    let v = server.post_json(
        "/api/generate",
        &json!({"model": "refusion", "prompt": format!("{prompt_text}{before}"), "suffix": after,
                "raw": true, "stream": false,
                "options": {"num_predict": n, "temperature": 0,
                            "stop": ["\n\n\n", "/src/", "#- coding: utf-8"]}}),
    );
    assert_eq!(
        fill_of(v["response"].as_str().unwrap()),
        want,
        "Continue (ollama): {v}"
    );
}
