//! Log-probabilities (docs/logprobs.md): the prompt's scores against transformers' f32 logits
//! (tests/fixtures/forward.json), directly and through `/v1/completions` with `echo`; `ar`'s
//! answer scores equal to the same answer scored as a prompt; slot decoding's each from the
//! forward that committed its token, with the tokens unchanged; the servers' shapes.

mod common;

use std::sync::Arc;

use common::server::Server;
use common::*;
use refusion_engine::decode::{generate, DecodeParams, Kind, TokenLogprob};
use refusion_engine::kv::CacheType;
use refusion_engine::model::Qwen3;
use refusion_gguf::GgufFile;
use serde_json::{json, Value};

fn forward_json() -> Value {
    let text = std::fs::read_to_string(fixtures().join("forward.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// log_softmax of one reference row, in f64.
fn log_softmax(row: &Value) -> Vec<f64> {
    let v: Vec<f64> = row
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let max = v.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
    let norm = max + v.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    v.iter().map(|x| x - norm).collect()
}

fn load(out: &std::path::Path) -> (Qwen3, DecodeParams) {
    let file = Arc::new(GgufFile::open(out).unwrap());
    let tok = refusion_engine::chat::Tokenizer::from_gguf(&file.header).unwrap();
    let p = DecodeParams::new(
        refusion_convert::DecodingDefaults::default(),
        tok.eos_id.unwrap(),
        tok.mask_id.unwrap(),
    );
    (Qwen3::load(file, &candle_core::Device::Cpu).unwrap(), p)
}

/// Each scored token against the reference's row: the log-probability within 1e-4 and the
/// alternatives in the reference's order (where their values are not tied within 1e-4).
fn assert_scores(want_rows: &[Vec<f64>], tokens: &[u32], got: &[TokenLogprob], what: &str) {
    assert_eq!(got.len(), want_rows.len(), "{what}");
    for (i, (lp, want)) in got.iter().zip(want_rows).enumerate() {
        assert_eq!(lp.token, tokens[i], "{what} #{i}");
        let w = want[lp.token as usize];
        assert!(
            (lp.logprob as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "{what} #{i}: {} vs {w}",
            lp.logprob
        );
        let mut order: Vec<usize> = (0..want.len()).collect();
        order.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
        for (r, &(id, p)) in lp.top.iter().enumerate() {
            let w = want[id as usize];
            assert!(
                (p as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{what} #{i}"
            );
            let tied = (want[order[r]] - w).abs() < 1e-4;
            assert!(
                id as usize == order[r] || tied,
                "{what} #{i}: alternative {r}"
            );
        }
    }
}

#[test]
fn prompt_scores_match_transformers_log_softmax_at_f32() {
    let fw = forward_json();
    let tmp = tempfile::tempdir().unwrap();
    for name in ["pub-a", "pub-b", "pub-c"] {
        let out = tmp.path().join(format!("{name}.gguf"));
        convert_quiet(&fixture_model(name), &out, "f32");
        let (model, mut p) = load(&out);
        let call = &fw["models"][name]["prefill"];
        let prompt = golden_ids(&call["tokens"][0]);
        (p.logprobs, p.score_prompt, p.answer) = (Some(4), true, false);
        let mut cache = model.new_cache(64, CacheType::F32, None).unwrap();
        let r = generate(&model, &mut cache, &prompt, &p, &mut |_| {}).unwrap();
        assert!(
            r.tokens.is_empty() && r.logprobs.is_empty(),
            "{name}: no answer"
        );
        let rows = call["logits"][0].as_array().unwrap();
        let want: Vec<Vec<f64>> = rows[..prompt.len() - 1].iter().map(log_softmax).collect();
        assert_scores(&want, &prompt[1..], &r.prompt_logprobs, name);
        assert!(r.prompt_logprobs.iter().all(|l| l.top.len() == 4));
    }
}

/// Left to right, an answer token's distribution is the next-token one: scoring prompt and
/// answer as one prompt gives the same figures. The answer itself is the one decoded without
/// logprobs, and with the prompt scored first.
#[test]
fn ar_answer_scores_are_the_answer_scored_as_a_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    let out = trained_tiny_gguf(tmp.path(), "f32");
    let (model, base) = load(&out);
    let goldens: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("goldens_tiny.json")).unwrap(),
    )
    .unwrap();
    for case in goldens["cases"].as_array().unwrap().iter().take(4) {
        let prompt = golden_ids(&case["prompt_ids"]);
        let mut p = base.clone();
        (p.strategy, p.gen_length, p.slot_size, p.serial_blocks) = (Kind::Autoregressive, 24, 1, 1);
        let run = |p: &DecodeParams, prompt: &[u32]| {
            let mut cache = model.new_cache(512, CacheType::F32, None).unwrap();
            generate(&model, &mut cache, prompt, p, &mut |_| {}).unwrap()
        };
        let plain = run(&p, &prompt);
        p.logprobs = Some(3);
        let scored = run(&p, &prompt);
        assert_eq!(scored.tokens, plain.tokens, "logprobs change no token");
        assert_eq!(scored.logprobs.len(), scored.tokens.len());
        p.score_prompt = true;
        let echoed = run(&p, &prompt);
        assert_eq!(
            echoed.tokens, plain.tokens,
            "scoring the prompt first changes no token"
        );
        assert_eq!(echoed.prompt_logprobs.len(), prompt.len() - 1);
        let whole: Vec<u32> = prompt.iter().chain(&plain.tokens).copied().collect();
        p.answer = false;
        let rescored = run(&p, &whole);
        let tail = &rescored.prompt_logprobs[prompt.len() - 1..];
        for (i, (a, b)) in scored.logprobs.iter().zip(tail).enumerate() {
            assert_eq!(a.token, b.token);
            assert!(
                (a.logprob - b.logprob).abs() <= 1e-4,
                "#{i}: {a:?} vs {b:?}"
            );
            let ids = |l: &TokenLogprob| l.top.iter().map(|t| t.0).collect::<Vec<_>>();
            assert_eq!(ids(a), ids(b), "#{i}");
        }
        let before = &rescored.prompt_logprobs[..prompt.len() - 1];
        for (a, b) in before.iter().zip(&echoed.prompt_logprobs) {
            // The prompt's scores do not depend on what follows it.
            assert_eq!((a.token, a.top.len()), (b.token, b.top.len()));
            assert!((a.logprob - b.logprob).abs() <= 1e-5, "{a:?} vs {b:?}");
        }
    }
}

/// Slot decoding gives each committed token the distribution it was committed from: a
/// drafted one (a slot's first token, one accepted after a verified one) is that row's
/// arg-max at temperature 0; a verified one passed the token threshold. Verified tokens that
/// are not their row's arg-max show the verification's row is the one given.
#[test]
fn slot_decoding_scores_each_token_from_the_forward_that_committed_it() {
    let text = std::fs::read_to_string(fixtures().join("goldens_public.json")).unwrap();
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut models = std::collections::HashMap::new();
    let (mut tokens, mut not_argmax) = (0, 0);
    for case in goldens["cases"].as_array().unwrap().iter().step_by(3) {
        if case["temperature"].as_f64().unwrap() != 0.0 {
            continue;
        }
        let name = case["model"].as_str().unwrap().to_string();
        let model = models.entry(name.clone()).or_insert_with(|| {
            let out = tmp.path().join(format!("{name}.gguf"));
            convert_quiet(&model_dir(&name), &out, "f32");
            load(&out).0
        });
        let prompt = golden_ids(&case["prompt_ids"]);
        let mut p = golden_params(case);
        p.logprobs = Some(2);
        let capacity = prompt.len() + 2 * p.padded_gen_length() as usize + 8;
        let mut cache = model.new_cache(capacity, CacheType::F32, None).unwrap();
        let r = generate(&*model, &mut cache, &prompt, &p, &mut |_| {}).unwrap();
        let id = case["id"].as_str().unwrap();
        assert_eq!(
            r.tokens,
            golden_ids(&case["tokens"]),
            "{id}: logprobs change no token"
        );
        assert_eq!(r.logprobs.len(), r.tokens.len(), "{id}");
        let floor = (p.token_threshold as f64).ln() - 1e-5;
        for (i, (lp, &t)) in r.logprobs.iter().zip(&r.tokens).enumerate() {
            assert_eq!(lp.token, t, "{id} #{i}");
            assert!(
                lp.logprob.is_finite() && lp.logprob <= 0.0,
                "{id} #{i}: {lp:?}"
            );
            let argmax = lp.top[0].0 == t || lp.top[0].1 == lp.logprob;
            assert!(argmax || lp.logprob as f64 > floor, "{id} #{i}: {lp:?}");
            tokens += 1;
            not_argmax += !argmax as usize;
        }
    }
    assert!(tokens > 200, "{tokens}");
    assert!(
        not_argmax > 0,
        "every token was its row's arg-max: no verification's row was given"
    );
}

/// `/v1/completions` as lm-evaluation-harness asks for a loglikelihood (token ids, `echo`,
/// `logprobs`, `max_tokens` 0 or 1) and `/v1/chat/completions` with `top_logprobs`.
#[test]
fn the_servers_logprobs_have_openais_shapes_and_the_references_figures() {
    let fw = forward_json();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    let server = Server::start(&out, &[]);
    let call = &fw["models"]["pub-a"]["prefill"];
    let ids = golden_ids(&call["tokens"][0]);
    let rows = call["logits"][0].as_array().unwrap();
    for max_tokens in [0, 1] {
        let body = json!({"prompt": [ids], "echo": true, "logprobs": 2, "max_tokens": max_tokens,
                          "temperature": 0});
        let v = server.post_json("/v1/completions", &body);
        let lp = &v["choices"][0]["logprobs"];
        // With max_tokens 1, one token after the prompt: the answer's, or the end-of-sequence
        // token that ended it (what lm-evaluation-harness counts on).
        let n = ids.len() + max_tokens;
        assert_eq!(lp["tokens"].as_array().unwrap().len(), n, "{v}");
        assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
        for i in 1..ids.len() {
            let want = log_softmax(&rows[i - 1])[ids[i] as usize];
            let got = lp["token_logprobs"][i].as_f64().unwrap();
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "#{i}: {got} vs {want}"
            );
            let top = lp["top_logprobs"][i].as_object().unwrap();
            assert!(!top.is_empty() && top.len() <= 2, "{top:?}");
        }
        let tokens: Vec<&str> = lp["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        let joined: String = tokens.concat();
        // The prompt alone is its tokens' text (a token holding part of a character has no
        // text of its own; an answer's control token none in the text).
        if max_tokens == 0 && !joined.contains('\u{FFFD}') {
            assert_eq!(
                v["choices"][0]["text"], joined,
                "echoed text and the tokens' text"
            );
        }
        let offsets = lp["text_offset"].as_array().unwrap();
        let mut at = 0;
        for (t, o) in tokens.iter().zip(offsets) {
            assert_eq!(o.as_u64().unwrap(), at, "{lp}");
            at += t.chars().count() as u64;
        }
    }
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                      "logprobs": true, "top_logprobs": 3, "strategy": "ar"});
    let v = server.post_json("/v1/chat/completions", &body);
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        "{v}"
    );
    for t in content {
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{t}");
        let lp = t["logprob"].as_f64().unwrap();
        assert!(
            lp <= 0.0 && lp >= top[0]["logprob"].as_f64().unwrap() - 1e-6,
            "greedy: {t}"
        );
        assert!(t["bytes"].is_array());
    }
    let plain = server.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8, "strategy": "ar"}),
    );
    assert_eq!(
        plain["choices"][0]["message"], v["choices"][0]["message"],
        "logprobs change no token"
    );
    assert!(plain["choices"][0]["logprobs"].is_null());
    // echo alone repeats the prompt, streamed or whole.
    let v = server.post_json(
        "/v1/completions",
        &json!({"prompt": "abc", "echo": true, "max_tokens": 2}),
    );
    assert!(
        v["choices"][0]["text"].as_str().unwrap().starts_with("abc"),
        "{v}"
    );
    let (status, body) = server.post(
        "/v1/completions",
        json!({"prompt": "abc", "echo": true, "max_tokens": 0}),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("max_tokens"), "{body}");
}
