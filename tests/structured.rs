//! Structured output and tool calls, on every front end: the answer always follows the grammar,
//! the schema or the required call, whatever the weights (a random model here, so nothing but
//! the constraint can make the answers right), and mistakes in them are the caller's 400 or
//! the command's one line before the model loads.

mod common;

use common::server::Server;
use common::*;
use serde_json::{json, Value};

/// A schema whose every valid answer is short: the decode must close it.
fn closed_schema() -> Value {
    json!({"type": "object",
           "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
           "required": ["ok", "color"], "additionalProperties": false})
}

fn valid(answer: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(answer) else {
        return false;
    };
    let keys: Vec<&String> = v
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    keys == ["ok", "color"]
        && v["ok"].is_boolean()
        && (v["color"] == "red" || v["color"] == "green")
}

fn weather() -> Value {
    json!([{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                           "required": ["unit"], "additionalProperties": false}}},
           {"type": "function", "function": {"name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "boolean"}},
                           "required": ["a"], "additionalProperties": false}}}])
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
                          "max_tokens": 96});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[test]
fn answers_follow_schemas_and_grammars_on_every_api() {
    let tmp = tempfile::tempdir().unwrap();
    let model = pub_a_f32(tmp.path());
    let server = Server::start(&model, &[]);
    let schema = closed_schema();
    for extra in [
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}),
        json!({"response_format": {"type": "json_object", "schema": schema}}),
        json!({"json_schema": schema}),
    ] {
        let v = server.post_json("/v1/chat/completions", &chat(extra.clone()));
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(valid(text), "{extra}: {text}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    }
    // Any JSON object; llama-server's GBNF on the completions endpoint.
    let v = server.post_json(
        "/v1/chat/completions",
        &chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 8})),
    );
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.starts_with('{'), "{text}");
    let v = server.post_json(
        "/v1/completions",
        &json!({"prompt": "Is it?", "max_tokens": 16, "grammar": "root ::= (\"yes\" | \"no\") \".\""}),
    );
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(text == "yes." || text == "no.", "{text}");
    // ollama's format: a schema, and "json".
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": false,
                      "format": schema, "options": {"num_predict": 96}});
    let v = server.post_json("/api/chat", &body);
    assert!(valid(v["message"]["content"].as_str().unwrap()), "{v}");
    let body = json!({"model": "m", "prompt": "hi", "stream": false, "format": "json",
                      "options": {"num_predict": 4}});
    let v = server.post_json("/api/generate", &body);
    assert!(v["response"].as_str().unwrap().starts_with('{'), "{v}");
    // Mistakes name their field.
    for (body, param, needle) in [
        (
            chat(json!({"grammar": "root ::= x"})),
            "grammar",
            "rule 'x' is used but not defined",
        ),
        (
            chat(json!({"json_schema": {"type": "nonsense"}})),
            "json_schema",
            "JSON Schema",
        ),
        (
            chat(json!({"response_format": {"type": "xml"}})),
            "response_format",
            "must be text",
        ),
        (
            chat(json!({"response_format": {"type": "json_schema"}})),
            "response_format",
            "schema is required",
        ),
        (
            chat(json!({"grammar": "root ::= \"a\"", "json_schema": {}})),
            "grammar",
            "give one",
        ),
        (
            chat(json!({"json_schema": {}, "strategy": "infill"})),
            "json_schema",
            "left to right",
        ),
    ] {
        let (status, text) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{text}");
        assert!(text.contains(needle), "{text}");
    }
    let (status, text) = server.post(
        "/api/chat",
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "format": 3}),
    );
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("\"error\":\"format must be"), "{text}");
}

#[test]
fn required_tool_calls_are_written_and_read_on_both_apis() {
    let tmp = tempfile::tempdir().unwrap();
    // ReFusion's vocabulary and chat template (which writes the tools into the system turn).
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &[]);
    // The tools reach the template: the prompt grows by their description.
    let plain = server.post_json("/v1/chat/completions", &chat(json!({"max_tokens": 1})));
    let with = server.post_json(
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 1, "tools": weather(), "tool_choice": "none"})),
    );
    let with_auto = server.post_json(
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 1, "tools": weather()})),
    );
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        tokens(&plain),
        tokens(&with),
        "tool_choice none: no tools in the prompt"
    );
    assert!(tokens(&with_auto) > tokens(&plain) + 40, "{with_auto}");
    for (choice, name) in [
        (json!("required"), None),
        (
            json!({"type": "function", "function": {"name": "weather"}}),
            Some("weather"),
        ),
        (
            json!({"type": "function", "function": {"name": "add"}}),
            Some("add"),
        ),
    ] {
        let v = server.post_json(
            "/v1/chat/completions",
            &chat(json!({"tools": weather(), "tool_choice": choice, "parallel_tool_calls": false})),
        );
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        let call = &c["message"]["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
        let f = call["function"]["name"].as_str().unwrap();
        if let Some(n) = name {
            assert_eq!(f, n);
        }
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        match f {
            "weather" => assert!(args["unit"] == "c" || args["unit"] == "f", "{args}"),
            _ => assert!(args["a"].is_boolean(), "{args}"),
        }
    }
    // Streamed: text deltas hold nothing of the call; the call goes out as OpenAI streams one
    // (its name, then its arguments in pieces), and the finish says tool_calls.
    let body = chat(
        json!({"tools": weather(), "tool_choice": "required", "parallel_tool_calls": false,
                           "stream": true}),
    );
    let (status, text) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("<tool_call>"), "{text}");
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .collect();
    let finish = chunks
        .iter()
        .filter(|v| v["choices"][0]["finish_reason"] == "tool_calls")
        .count();
    assert_eq!(finish, 1, "{text}");
    let (mut name, mut arguments) = (String::new(), String::new());
    for d in chunks.iter().flat_map(|v| {
        v["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }) {
        assert_eq!(d["index"], 0, "{text}");
        name += d["function"]["name"].as_str().unwrap_or("");
        arguments += d["function"]["arguments"].as_str().unwrap_or("");
    }
    // The call the same request gets whole (the random model picks its function).
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let v = server.post_json("/v1/chat/completions", &whole);
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(name, call["name"].as_str().unwrap(), "{text}");
    let args: Value = serde_json::from_str(&arguments).unwrap();
    let want: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, want, "{text}");
    match name.as_str() {
        "weather" => assert!(args["unit"] == "c" || args["unit"] == "f", "{args}"),
        _ => assert!(args["a"].is_boolean(), "{args}"),
    }
    // The call and the tool's answer go back in (rendered by the template).
    let body = json!({"messages": [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": "{\"unit\": \"c\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}],
        "tools": weather(), "max_tokens": 1});
    let v = server.post_json("/v1/chat/completions", &body);
    assert!(tokens(&v) > tokens(&with_auto) + 10, "{v}");
    // ollama's chat with tools: required calls come back as objects (auto here: a random model
    // may or may not call; either way the answer is well-formed or an error).
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": false,
                      "tools": weather(), "options": {"num_predict": 4}});
    let (status, text) = server.post("/api/chat", &body);
    assert!(
        status == 200 || text.contains("malformed tool call"),
        "{text}"
    );
    for (body, needle) in [
        (
            chat(
                json!({"tools": weather(), "tool_choice": {"type": "function", "function": {"name": "mul"}}}),
            ),
            "not in tools",
        ),
        (chat(json!({"tool_choice": "required"})), "tools is empty"),
        (
            chat(json!({"tools": [{"type": "function", "function": {}}]})),
            "name is required",
        ),
    ] {
        let (status, text) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{text}");
        assert!(text.contains(needle), "{text}");
    }
}

#[test]
fn generate_takes_llama_cpp_grammar_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let model = pub_a_f32(tmp.path());
    let m = model.to_str().unwrap();
    let schema = closed_schema().to_string();
    let o = run(&["generate", "-m", m, "-p", "hi", "-n", "64", "-j", &schema]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(valid(stdout(&o).trim()), "{}", stdout(&o));
    let file = tmp.path().join("yn.gbnf");
    std::fs::write(&file, "root ::= yn \"!\"\nyn ::= \"yes\" | \"no\"\n").unwrap();
    let o = run(&[
        "generate",
        "-m",
        m,
        "-p",
        "hi",
        "-n",
        "8",
        "--grammar-file",
        file.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(v["text"] == "yes!" || v["text"] == "no!", "{v}");
    // Checked before the model is read: a missing file is not what is reported.
    for (args, needle) in [
        (
            vec!["--grammar", "root ::= x"],
            "--grammar: rule 'x' is used but not defined",
        ),
        (vec!["-j", "{nope"], "--json-schema is not JSON"),
        (
            vec!["--json-schema-file", "/nonexistent/s.json"],
            "--json-schema-file '/nonexistent/s.json'",
        ),
    ] {
        let mut all = vec!["generate", "-m", "/nonexistent/model.gguf", "-p", "hi"];
        all.extend(args);
        assert_fails_with(&run(&all), &[needle]);
    }
    let o = run(&["generate", "-m", m, "-p", "hi", "-j", "{\"type\": \"wat\"}"]);
    assert_fails_with(&o, &["JSON Schema"]);
}

/// `chat --grammar`: every answer of the conversation follows the grammar.
#[test]
fn chat_answers_follow_the_grammar() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let tmp = tempfile::tempdir().unwrap();
    let model = pub_a_f32(tmp.path());
    let mut child = Command::new(bin())
        .args(["chat", "-m", model.to_str().unwrap(), "-n", "8"])
        .args(["--grammar", "root ::= (\"yes\" | \"no\") \"!\""])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Is it?\nReally?\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    let answers: Vec<&str> = out
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(answers.len(), 2, "{out}");
    for a in answers {
        assert!(a.ends_with("yes!") || a.ends_with("no!"), "{out}");
    }
    let o = run(&["chat", "-m", "/nonexistent.gguf", "--grammar", "root ::= x"]);
    assert_fails_with(&o, &["--grammar: rule 'x' is used but not defined"]);
}

/// Slot decoding under a schema (the default strategy) against left-to-right decoding under
/// it, on the trained tiny model's held-out JSON questions at f32: every answer valid, the
/// schema's forced first text (`{"answer": `) fed with the prompt without a forward of its
/// own, and fewer forwards in all than one a token (`tests/guided.rs` checks the steps).
#[test]
fn slots_under_a_schema_answer_in_fewer_forwards_than_ar() {
    let tmp = tempfile::tempdir().unwrap();
    let model = trained_tiny_gguf(tmp.path(), "f32");
    let questions = heldout_json_questions(12);
    let (mut slots_forwards, mut ar_forwards, mut right) = (0, 0, 0);
    for h in questions {
        let want: Value = serde_json::from_str(h["response"].as_str().unwrap()).unwrap();
        let schema = answer_schema(&want).to_string();
        let question = h["messages"][0]["content"].as_str().unwrap();
        let decode = |strategy: &str| -> Value {
            let o = run(&[
                "generate",
                "-m",
                model.to_str().unwrap(),
                "-p",
                question,
                "-j",
                &schema,
                "--strategy",
                strategy,
                "--json",
            ]);
            assert!(o.status.success(), "{}", stderr(&o));
            serde_json::from_str(&stdout(&o)).unwrap()
        };
        for (strategy, forwards) in [("slots", &mut slots_forwards), ("ar", &mut ar_forwards)] {
            let v = decode(strategy);
            let text = v["text"].as_str().unwrap();
            let got: Value = serde_json::from_str(text).unwrap_or_else(|_| panic!("{text}"));
            assert_eq!(got.as_object().unwrap().len(), 1, "{text}");
            assert_eq!(
                got["answer"].is_array(),
                want["answer"].is_array(),
                "{text}"
            );
            right += (got == want) as usize;
            // The forced `{"answer": ` went in with the prompt: no forward of its own.
            let prompt = v["prompt_tokens"].as_u64().unwrap();
            let masks = match strategy {
                "slots" => v["params"]["slot_size"].as_u64().unwrap(),
                _ => 0,
            };
            assert_eq!(v["forward_sizes"][0], prompt + 1 + masks, "{v}");
            *forwards += v["forward_calls"].as_u64().unwrap();
        }
    }
    assert!(
        slots_forwards * 4 < ar_forwards * 3,
        "{slots_forwards} against {ar_forwards}"
    );
    // The tiny model knows its sums: both ways are right more often than not.
    assert!(right > 12, "{right} of 24 right");
}
