//! Many requests at once through the scheduler: every golden case exact whatever runs beside
//! it (interleavings and batch limits 1, 2, 4, 8), a request's tokens independent of its
//! neighbours and of what was cached before it on quantized files, prompts shared and held
//! once, cancellation leaving the others exact.

mod common;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use refusion_engine::decode::{generate, DecodeParams, DecodeResult};
use refusion_engine::error::Error;
use refusion_engine::kv::CacheType;
use refusion_engine::model::{Offload, Qwen3};
use refusion_engine::sched::{Request, Scheduler, Update};
use refusion_gguf::GgufFile;
use serde_json::Value;

fn load(dir: &std::path::Path, out: &std::path::Path, outtype: &str) -> Qwen3 {
    load_on(dir, out, outtype, None)
}

fn load_on(
    dir: &std::path::Path,
    out: &std::path::Path,
    outtype: &str,
    offload: Option<Offload>,
) -> Qwen3 {
    convert_quiet(dir, out, outtype);
    Qwen3::load_offloaded(Arc::new(GgufFile::open(out).unwrap()), offload).unwrap()
}

/// A deterministic shuffle (xorshift).
fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
}

type Results = RefCell<HashMap<usize, Result<DecodeResult, String>>>;

fn request<'a>(
    i: usize,
    prompt: Vec<u32>,
    params: DecodeParams,
    results: &'a Results,
    cancel: Arc<AtomicBool>,
) -> Request<'a> {
    Request {
        prompt,
        params,
        cancel,
        sink: Box::new(move |u| {
            if let Update::Finished(r) = u {
                results
                    .borrow_mut()
                    .insert(i, r.map_err(|e: Error| e.to_string()));
            }
        }),
    }
}

/// Unsplit, then with every plan of two slots or more split after its last slot's first
/// token: the same tokens, alone or four at a time, and one at a time the same prompts cached
/// for later requests (a first plan whose tail follows has not committed its prompt yet). Four
/// at a time, the tails' extra forwards move when requests start, and what they find cached.
#[test]
fn every_golden_case_is_exact_through_the_scheduler_split_or_not() {
    let models = ["pub-a", "pub-b", "pub-c"];
    let whole = check_goldens_scheduled(None, &models, &[1, 2, 4, 8], None);
    let split = check_goldens_scheduled(None, &models, &[1, 4], Some(2));
    // One reuse count per model and limit: the one-at-a-time rounds, 4 and 2 apart.
    let alone = |r: &[u64], every: usize| r.iter().step_by(every).copied().collect::<Vec<_>>();
    assert!(whole.iter().all(|&n| n > 0), "prompts reused: {whole:?}");
    assert_eq!(
        alone(&split, 2),
        alone(&whole, 4),
        "prompt tokens reused, split against whole"
    );
}

/// Several sequences over device-resident layers (candle's CPU device stands in for a GPU: the
/// same tensor code), every layer and one layer offloaded.
#[test]
fn golden_cases_are_exact_through_the_scheduler_with_offloaded_layers() {
    for layers in [usize::MAX, 1] {
        let offload = Offload {
            device: candle_core::Device::Cpu,
            layers,
            output: layers == usize::MAX,
        };
        check_goldens_scheduled(Some(offload), &["pub-c"], &[4], None);
    }
}

/// Every public case of `models` through a scheduler of each parallel limit, with plans split
/// from `split_plan_from` (`None`: the default): the prompt tokens reused in each round.
fn check_goldens_scheduled(
    offload: Option<Offload>,
    models: &[&str],
    limits: &[usize],
    split_plan_from: Option<u32>,
) -> Vec<u64> {
    let params = |c: &Value| {
        let mut p = golden_params(c);
        if let Some(from) = split_plan_from {
            p.split_plan_from = from;
        }
        p
    };
    let mut reused = Vec::new();
    let text = std::fs::read_to_string(fixtures().join("goldens_public.json")).unwrap();
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let cases = goldens["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 111);
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for &name in models {
        let model = load_on(
            &fixture_model(name),
            &tmp.path().join(format!("{name}.gguf")),
            "f32",
            offload.clone(),
        );
        let mine: Vec<&Value> = cases.iter().filter(|c| c["model"] == name).collect();
        let need = mine
            .iter()
            .map(|c| {
                let p = golden_params(c);
                let gen = p.padded_gen_length() as usize;
                c["prompt_ids"].as_array().unwrap().len() + gen + gen / p.serial_blocks as usize
            })
            .max()
            .unwrap();
        for (round, &parallel) in limits.iter().enumerate() {
            let results: Results = RefCell::new(HashMap::new());
            let cache = model
                .new_cache(parallel * need, CacheType::F32, None)
                .unwrap();
            let mut s = Scheduler::new(&model, cache, parallel);
            let mut order: Vec<usize> = (0..mine.len()).collect();
            shuffle(&mut order, round as u64 + 7);
            for &i in &order {
                let c = mine[i];
                s.submit(request(
                    i,
                    golden_ids(&c["prompt_ids"]),
                    params(c),
                    &results,
                    Arc::new(AtomicBool::new(false)),
                ));
            }
            s.run_to_end();
            let stats = s.stats();
            reused.push(stats.prompt_tokens_reused);
            if parallel > 1 {
                assert!(
                    stats.forwards < mine.iter().map(|c| c["n_forward"].as_u64().unwrap()).sum(),
                    "{name} -np {parallel}: forwards were merged"
                );
            }
            for (i, c) in mine.iter().enumerate() {
                let id = c["id"].as_str().unwrap();
                let r = results.borrow_mut().remove(&i).expect("answered").unwrap();
                let (want, tpf) = (golden_ids(&c["tokens"]), c["tpf"].as_f64().unwrap());
                let calls = c["n_forward"].as_u64().unwrap();
                if r.tokens != want || (r.tpf - tpf).abs() > 1e-6 || r.forward_calls as u64 != calls
                {
                    failures.push(format!(
                        "-np {parallel} {id}: tokens {:?} tpf {} calls {} (want {want:?} {tpf} {calls})",
                        r.tokens, r.tpf, r.forward_calls
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    reused
}

/// Prompts from the trained tiny model's chat template: a shared system prompt, several
/// questions, some asked twice (prefix reuse of a whole prompt).
fn chat_prompts(model: &Qwen3, dir: &std::path::Path, n: usize) -> Vec<Vec<u32>> {
    let file = GgufFile::open(dir).unwrap();
    let tok = refusion_engine::chat::Tokenizer::from_gguf(&file.header).unwrap();
    let questions = [
        "What is 47 + 38?",
        "What is 12 + 9?",
        "Reverse the list [3, 1, 2].",
        "What is the largest number in [4, 9, 2]?",
        "Write a Python function `total` that returns the sum of a list.",
        "Tom has 5 apples and buys 7 more. How many apples does he have?",
        "What is 66 + 27?",
    ];
    let _ = model;
    (0..n)
        .map(|i| {
            let q = questions[i % questions.len()];
            let text = if i % 3 == 0 {
                format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
            } else {
                format!(
                    "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                )
            };
            tok.encode(&text).unwrap()
        })
        .collect()
}

fn tiny_params(file: &GgufFile) -> DecodeParams {
    let tok = refusion_engine::chat::Tokenizer::from_gguf(&file.header).unwrap();
    let mut p = DecodeParams::new(
        refusion_convert::DecodingDefaults::default(),
        tok.eos_id.unwrap(),
        tok.mask_id.unwrap(),
    );
    p.gen_length = 64;
    p.serial_blocks = 4;
    p
}

#[test]
fn a_requests_tokens_do_not_depend_on_its_neighbours_or_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = trained_tiny();
    for outtype in ["q4_k_m", "q8_0"] {
        let path = tmp.path().join(format!("tiny-{outtype}.gguf"));
        let model = load(&tiny, &path, outtype);
        let file = GgufFile::open(&path).unwrap();
        let p = tiny_params(&file);
        let prompts = chat_prompts(&model, &path, 50);
        // Alone, each on a fresh cache.
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|prompt| {
                let mut cache = model.new_cache(512, CacheType::F32, None).unwrap();
                generate(&model, &mut cache, prompt, &p, &mut |_| {})
                    .unwrap()
                    .tokens
            })
            .collect();
        // Together, in shuffled orders, batch limits, and warm or cold prefix caches.
        let mut diffs = Vec::new();
        for (round, parallel) in [8usize, 3].into_iter().enumerate() {
            let results: Results = RefCell::new(HashMap::new());
            let cache = model.new_cache(8 * 256, CacheType::F32, None).unwrap();
            let mut s = Scheduler::new(&model, cache, parallel);
            for pass in 0..2 {
                let mut order: Vec<usize> = (0..prompts.len()).collect();
                shuffle(&mut order, (round * 2 + pass) as u64 + 1);
                for &i in &order {
                    s.submit(request(
                        i,
                        prompts[i].clone(),
                        p.clone(),
                        &results,
                        Arc::new(AtomicBool::new(false)),
                    ));
                }
                s.run_to_end();
                let st = s.stats();
                assert!(st.prompt_tokens_reused > 0, "prompts were shared");
                for (i, want) in alone.iter().enumerate() {
                    let r = results.borrow_mut().remove(&i).unwrap().unwrap();
                    if &r.tokens != want {
                        diffs.push(format!("{outtype} -np {parallel} pass {pass}: request {i}"));
                    }
                }
                if pass == 0 && round == 0 {
                    // The second pass from a cold prefix cache.
                    s.clear_prefixes();
                }
            }
        }
        assert!(
            diffs.is_empty(),
            "{} differ:\n{}",
            diffs.len(),
            diffs.join("\n")
        );
    }
}

#[test]
fn a_common_prompt_is_held_once_and_a_cancelled_neighbour_leaves_the_other_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = trained_tiny();
    let path = tmp.path().join("tiny-q8_0.gguf");
    let model = load(&tiny, &path, "q8_0");
    let file = GgufFile::open(&path).unwrap();
    let mut p = tiny_params(&file);
    p.gen_length = 128;
    p.serial_blocks = 32;
    let prompt = chat_prompts(&model, &path, 2)[1].clone();
    let alone = {
        let mut cache = model.new_cache(1024, CacheType::F32, None).unwrap();
        generate(&model, &mut cache, &prompt, &p, &mut |_| {}).unwrap()
    };
    let results: Results = RefCell::new(HashMap::new());
    let cache = model.new_cache(2048, CacheType::F32, None).unwrap();
    let mut s = Scheduler::new(&model, cache, 2);
    let cancel = Arc::new(AtomicBool::new(false));
    s.submit(request(
        0,
        prompt.clone(),
        p.clone(),
        &results,
        Arc::new(AtomicBool::new(false)),
    ));
    // The first step runs request 0's prompt; request 1, the same prompt, arrives after it.
    s.step();
    s.submit(request(
        1,
        prompt.clone(),
        p.clone(),
        &results,
        cancel.clone(),
    ));
    s.step();
    let gen = p.padded_gen_length() as usize;
    let block = gen / p.serial_blocks as usize;
    // Request 0 holds its prompt and answer room; request 1 only its answer room.
    assert_eq!(
        s.cache().cells().used_slots(),
        prompt.len() + 2 * (gen + block)
    );
    assert_eq!(s.stats().prompt_tokens_reused, prompt.len() as u64);
    for _ in 0..3 {
        s.step();
    }
    cancel.store(true, Ordering::SeqCst);
    s.run_to_end();
    let r0 = results.borrow_mut().remove(&0).unwrap().unwrap();
    assert_eq!(r0.tokens, alone.tokens);
    assert_eq!(r0.forward_calls, alone.forward_calls);
    assert_eq!(
        results.borrow_mut().remove(&1).unwrap().unwrap_err(),
        "cancelled"
    );
    // Everything is freed but the cached prompt.
    assert_eq!(s.cache().cells().used_slots(), prompt.len());
    s.clear_prefixes();
    assert_eq!(s.cache().cells().used_slots(), 0);
}

/// A POST over loopback (one request per connection); the JSON answer.
fn post(base: &str, path: &str, body: &Value) -> Value {
    let addr = base.trim_start_matches("http://");
    let (status, json) = common::server::try_post(addr, path, body.to_string().as_bytes())
        .unwrap_or_else(|| panic!("POST {path}: no answer"));
    assert_eq!(status, 200, "{json}");
    serde_json::from_str(&json).unwrap()
}

#[test]
fn golden_cases_through_the_server_at_once_with_token_id_prompts() {
    let text = std::fs::read_to_string(fixtures().join("goldens_public.json")).unwrap();
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("pub-b.gguf");
    convert_quiet(&fixture_model("pub-b"), &gguf, "f32");
    let tok = refusion_engine::chat::Tokenizer::from_gguf(&GgufFile::open(&gguf).unwrap().header)
        .unwrap();
    let cases: Vec<&Value> = goldens["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["model"] == "pub-b" && c["temperature"].as_f64() == Some(0.0))
        .collect();
    assert!(cases.len() >= 20, "{}", cases.len());
    let server = common::server::Server::start(&gguf, &["--parallel", "4", "--queue", "64"]);
    let base = server.base.clone();
    let answers: Vec<(String, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = cases
            .iter()
            .map(|c| {
                let base = base.clone();
                let tok = &tok;
                scope.spawn(move || {
                    let body = serde_json::json!({
                        "prompt": c["prompt_ids"],
                        "max_tokens": c["gen_length"],
                        "slot_size": c["slot_size"],
                        "serial_blocks": c["serial_num_blocks"],
                        "slot_threshold": c["slot_threshold"],
                        "token_threshold": c["token_threshold"],
                        "temperature": 0,
                    });
                    let r = post(&base, "/v1/completions", &body);
                    let tokens = golden_ids(&c["tokens"]);
                    let eos = c["eos_id"].as_u64().unwrap() as u32;
                    // Up to the first EOS, and at most max_tokens (the gen length, which
                    // slot decoding rounds up to whole slots).
                    let end = tokens
                        .iter()
                        .position(|&t| t == eos)
                        .unwrap_or(tokens.len())
                        .min(c["gen_length"].as_u64().unwrap() as usize);
                    let want = tok.decode(&tokens[..end], true).unwrap();
                    (r["choices"][0]["text"].as_str().unwrap().to_string(), want)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let wrong: Vec<usize> = answers
        .iter()
        .enumerate()
        .filter(|(_, (got, want))| got != want)
        .map(|(i, _)| i)
        .collect();
    let shown: Vec<String> = wrong
        .iter()
        .map(|&i| {
            format!(
                "{}: {:?} vs {:?}",
                cases[i]["id"], answers[i].0, answers[i].1
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} differ:\n{}",
        wrong.len(),
        answers.len(),
        shown.join("\n")
    );
}
