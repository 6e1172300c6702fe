//! llama-server's native endpoints as its scripts call them: `/completion` (whole and
//! streamed, with its fields), `/apply-template`, `/slots`; the embedding endpoints refused by
//! name; sampler fields accepted where they change nothing and refused where they would.

mod common;

use common::server::Server;
use common::*;
use serde_json::{json, Value};

#[test]
fn completion_apply_template_slots_and_refusals() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &["-np", "3"]);
    let v = server.post_json(
        "/completion",
        &json!({"prompt": "Once upon a time", "n_predict": 8, "cache_prompt": true, "id_slot": -1,
                "n_probs": 0, "top_k": 40, "top_p": 0.9}),
    );
    assert_eq!(v["stop"], true, "{v}");
    assert!(
        v["content"].is_string() && v["tokens_predicted"].as_u64().unwrap() <= 8,
        "{v}"
    );
    assert!(
        ["eos", "limit"].contains(&v["stop_type"].as_str().unwrap()),
        "{v}"
    );
    assert!(v["tokens_evaluated"].as_u64().unwrap() > 0 && v["timings"]["predicted_n"].is_number());
    // n_probs: each answer token's log-probability with its alternatives, in llama-server's
    // shape; the same answer.
    let p = server.post_json(
        "/completion",
        &json!({"prompt": "Once upon a time", "n_predict": 8, "n_probs": 3}),
    );
    assert_eq!(p["content"], v["content"], "{p}");
    let probs = p["completion_probabilities"].as_array().unwrap();
    assert_eq!(
        probs.len() as u64,
        p["tokens_predicted"].as_u64().unwrap(),
        "{p}"
    );
    for t in probs {
        let top = t["top_logprobs"].as_array().unwrap();
        assert!(!top.is_empty() && top.len() <= 3, "{t}");
        assert!(
            t["id"].is_u64() && t["logprob"].as_f64().unwrap() <= 0.0,
            "{t}"
        );
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
    }
    // Token ids as the prompt; only the fields asked for.
    let ids =
        server.post_json("/tokenize", &json!({"content": "Once upon a time"}))["tokens"].clone();
    let w = server.post_json(
        "/completion",
        &json!({"prompt": ids, "n_predict": 8, "response_fields": ["content", "timings/predicted_n"]}),
    );
    assert_eq!(w["content"], v["content"], "{w}");
    assert_eq!(w.as_object().unwrap().len(), 2, "{w}");
    // Constrained, and streamed as `data: {"content", "stop"}` events.
    let v = server.post_json(
        "/completion",
        &json!({"prompt": "Answer:", "n_predict": 8, "grammar": "root ::= \"yes\" | \"no\""}),
    );
    assert!(v["content"] == "yes" || v["content"] == "no", "{v}");
    let (status, text) = server.post(
        "/completion",
        json!({"prompt": "Answer:", "n_predict": 48, "stream": true,
               "json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                               "required": ["ok"], "additionalProperties": false}}),
    );
    assert_eq!(status, 200, "{text}");
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let last = events.last().unwrap();
    assert_eq!(last["stop"], true, "{text}");
    let content: String = events
        .iter()
        .filter_map(|e| e["content"].as_str())
        .collect();
    let parsed: Value = serde_json::from_str(&content).unwrap();
    assert!(parsed["ok"].is_boolean(), "{content}");
    // /apply-template: the chat template's prompt, the assistant's turn opened.
    let v = server.post_json(
        "/apply-template",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    let prompt = v["prompt"].as_str().unwrap();
    assert!(
        prompt.contains("<|im_start|>user\nhi<|im_end|>")
            && prompt.ends_with("<|im_start|>assistant\n"),
        "{prompt}"
    );
    // /slots: one per -np.
    let (status, text) = get(&server, "/slots");
    assert_eq!(status, 200, "{text}");
    let slots: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(slots.as_array().unwrap().len(), 3, "{slots}");
    // Whether a slot is busy is the scheduler's count as of its last step (a finished
    // stream's request may still be counted): only its shape is checked.
    assert!(slots[0]["is_processing"].is_boolean(), "{slots}");
    for path in [
        "/embedding",
        "/v1/embeddings",
        "/api/embed",
        "/api/embeddings",
    ] {
        let (status, text) = server.post(path, json!({"input": "hi", "content": "hi"}));
        assert_eq!(status, 501, "{path}: {text}");
        assert!(text.contains("embeddings are not served"), "{text}");
    }
    for (body, param) in [
        (json!({"prompt": "a", "id_slot": 2}), "id_slot"),
        (json!({"prompt": "a", "n_probs": 21}), "n_probs"),
        (
            json!({"prompt": "a", "n_probs": 2, "stream": true}),
            "n_probs",
        ),
        (
            json!({"prompt": "a", "return_tokens": true}),
            "return_tokens",
        ),
        (json!({"prompt": "a", "n_predict": -5}), "n_predict"),
        (
            json!({"prompt": "a", "temperature": 0.8, "top_p": 0.5}),
            "top_p",
        ),
        (
            json!({"prompt": "a", "temperature": 0.8, "min_p": 0.1}),
            "min_p",
        ),
        (json!({"prompt": "a", "top_k": "many"}), "top_k"),
        (json!({"prompt": "a", "id_slot": "first"}), "id_slot"),
    ] {
        let (status, text) = server.post("/completion", &body);
        assert_eq!(status, 400, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{text}");
    }
    // OpenAI's sampler fields follow the same rule.
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let (status, _) = server.post(
        "/v1/chat/completions",
        chat(json!({"top_p": 0.5, "top_k": 40, "presence_penalty": 0.0, "logit_bias": {},
                    "reasoning_effort": "none", "user": "u1", "store": false, "metadata": {"a": "b"}})),
    );
    assert_eq!(status, 200);
    // A penalty or a bias changes greedy answers too: refused at any temperature.
    for (extra, param) in [
        (json!({"presence_penalty": 0.3}), "presence_penalty"),
        (json!({"frequency_penalty": 0.5}), "frequency_penalty"),
        (json!({"logit_bias": {"15": -100}}), "logit_bias"),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"modalities": ["text", "audio"]}), "modalities"),
        (json!({"top_p": "x"}), "top_p"),
        (json!({"ignore_eos": true}), "ignore_eos"),
        (json!({"reasoning_effort": "high"}), "reasoning_effort"),
        (json!({"verbosity": "low"}), "verbosity"),
        (
            json!({"web_search_options": {"search_context_size": "low"}}),
            "web_search_options",
        ),
    ] {
        let (status, text) = server.post("/v1/chat/completions", chat(extra));
        assert_eq!(status, 400, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{text}");
    }
    let (status, text) = server.post(
        "/v1/chat/completions",
        chat(json!({"temperature": 0.7, "top_p": 0.3})),
    );
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains("top_p is not supported: ReFusion samples its planning drafts"),
        "{text}"
    );
    let (status, _) = server.post(
        "/v1/chat/completions",
        chat(json!({"temperature": 0.7, "top_p": 1.0})),
    );
    assert_eq!(status, 200);
    // /infill reads them as well: the editors' greedy requests pass (their sampler chain and
    // filters act on nothing at temperature 0), a sampled one with a filter is refused.
    let infill = |extra: Value| {
        let mut b = json!({"input_prefix": "def f(x):\n", "input_suffix": "\n", "n_predict": 4,
                           "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"],
                           "cache_prompt": true, "t_max_prompt_ms": 500, "id_slot": -1});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let (status, text) = server.post("/infill", infill(json!({})));
    assert_eq!(status, 200, "{text}");
    for (extra, param) in [
        (
            json!({"temperature": 0.5, "top_k": 0, "top_p": 1.0}),
            "samplers",
        ),
        (json!({"temperature": 0.5, "samplers": []}), "top_p"),
        (json!({"samplers": ["top_k", "mystery"]}), "samplers"),
        (json!({"repeat_penalty": 1.3}), "repeat_penalty"),
        (json!({"n_probs": 3}), "n_probs"),
        (json!({"id_slot": 1}), "id_slot"),
        (json!({"seed": -7}), "seed"),
        (json!({"min_p": "low"}), "min_p"),
    ] {
        let (status, text) = server.post("/infill", infill(extra.clone()));
        assert_eq!(status, 400, "{extra}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{extra}: {text}");
    }
}

/// vLLM's tokenizer endpoints, which lm-evaluation-harness's remote tokenizer calls:
/// `GET /tokenizer_info`, `/tokenize` with `prompt`, `/detokenize` answering `prompt`.
#[test]
fn vllms_tokenizer_endpoints_answer_as_llama_servers_do() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &[]);
    let (status, body) = get(&server, "/tokenizer_info");
    assert_eq!(status, 200, "{body}");
    let info: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(info["eos_token"], "<|im_end|>", "{info}");
    assert!(
        info["chat_template"].as_str().unwrap().contains("im_start"),
        "{info}"
    );
    let text = "Once upon a time <|im_end|>";
    let llama = server.post_json("/tokenize", &json!({"content": text}));
    let vllm = server.post_json(
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    );
    assert_eq!(llama["tokens"], vllm["tokens"]);
    let back = server.post_json("/detokenize", &json!({"tokens": vllm["tokens"]}));
    assert_eq!(back["prompt"], text, "{back}");
    assert_eq!(back["content"], text, "{back}");
}

/// A GET over a raw socket: the status and the body.
fn get(server: &Server, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(server.addr()).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

/// ollama's `/api/show` tells the template, the parameters and the file's metadata; `images`
/// and `think: true` are refused by name (their "off" values pass).
#[test]
fn ollama_show_and_what_it_refuses() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &[]);
    let v = server.post_json("/api/show", &json!({"model": "m"}));
    assert!(
        v["template"].as_str().unwrap().contains("<|im_start|>"),
        "{v}"
    );
    let params = v["parameters"].as_str().unwrap();
    assert!(
        params.contains("num_predict") && params.contains("slot_size"),
        "{params}"
    );
    assert!(
        v["modelfile"]
            .as_str()
            .unwrap()
            .contains("PARAMETER num_ctx"),
        "{v}"
    );
    assert_eq!(v["model_info"]["general.architecture"], "qwen3");
    assert!(v["model_info"]["qwen3.block_count"].is_number(), "{v}");
    assert!(v["model_info"].get("tokenizer.ggml.tokens").is_none());
    let caps = v["capabilities"].as_array().unwrap();
    assert!(
        caps.contains(&json!("tools")) && caps.contains(&json!("insert")),
        "{v}"
    );
    for (path, body, needle) in [
        (
            "/api/generate",
            json!({"model": "m", "prompt": "hi", "images": ["aGk="]}),
            "images is not supported",
        ),
        (
            "/api/generate",
            json!({"model": "m", "prompt": "hi", "think": true}),
            "think is not supported",
        ),
        (
            "/api/chat",
            json!({"model": "m", "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}),
            "images is not supported",
        ),
        (
            "/api/chat",
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "think": true}),
            "think is not supported",
        ),
        // ollama's sampler options follow the OpenAI endpoints' rule.
        (
            "/api/generate",
            json!({"model": "m", "prompt": "hi", "options": {"temperature": 0.7, "top_p": 0.5}}),
            "top_p is not supported",
        ),
        (
            "/api/chat",
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                   "options": {"repeat_penalty": 1.2}}),
            "repeat_penalty is not supported",
        ),
    ] {
        let (status, text) = server.post(path, &body);
        assert_eq!(status, 400, "{body}: {text}");
        assert!(text.contains(needle), "{text}");
    }
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi", "images": []}],
                      "think": false, "stream": false,
                      "options": {"num_predict": 2, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.0}});
    server.post_json("/api/chat", &body);
}
