//! Decoding strategies behind one seam: plain left-to-right decoding (`--strategy ar`) gives
//! exactly the greedy tokens of recomputing the whole sequence at every step, alone and
//! through the scheduler beside slot decoding, whose golden cases stay exact beside it; the
//! flag and the API field name the strategies there are.

mod common;

use std::sync::Arc;

use common::*;
use refusion_engine::decode::{argmax, generate, DecodeParams, Kind};
use refusion_engine::kv::{CacheType, KvCache};
use refusion_engine::model::{Batch, Forward, LogitsFor, Qwen3};
use refusion_engine::sched::Scheduler;
use refusion_gguf::GgufFile;

fn model(dir: &std::path::Path, name: &str) -> Qwen3 {
    let out = dir.join(format!("{name}.gguf"));
    convert_quiet(&fixture_model(name), &out, "f32");
    Qwen3::load_offloaded(Arc::new(GgufFile::open(&out).unwrap()), None).unwrap()
}

fn ar_params(gen: u32, eos: u32, mask: u32) -> DecodeParams {
    DecodeParams {
        gen_length: gen,
        strategy: Kind::Autoregressive,
        ..DecodeParams::new(Default::default(), eos, mask)
    }
}

/// Greedy decoding the slow way: the whole sequence forwarded into a fresh cache each step.
fn greedy_by_recomputing(m: &Qwen3, prompt: &[u32], gen: usize, eos: u32) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..gen {
        let mut cache = KvCache::new(m.cache_shape(seq.len() + 1), CacheType::F32).unwrap();
        let mut b = Batch::default();
        for (i, &t) in seq.iter().enumerate() {
            b.push(t, i as u32, 0);
        }
        b.logits_for = LogitsFor::Indices(vec![seq.len() - 1]);
        let logits = m.forward(&b, &mut cache).unwrap();
        let tok = argmax(logits.row(0)) as u32;
        out.push(tok);
        seq.push(tok);
        if tok == eos {
            break;
        }
    }
    out
}

#[test]
fn left_to_right_decoding_is_greedy_decoding_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["pub-a", "pub-b"] {
        let m = model(tmp.path(), name);
        let (eos, mask) = (m.config().vocab as u32 - 4, m.config().vocab as u32 - 1);
        for prompt in [vec![5u32, 9, 13], vec![100, 7, 7, 7, 42, 8, 1, 2, 3]] {
            let want = greedy_by_recomputing(&m, &prompt, 24, eos);
            let mut cache = KvCache::new(m.cache_shape(64), CacheType::F32).unwrap();
            let mut committed = Vec::new();
            let r = generate(
                &m,
                &mut cache,
                &prompt,
                &ar_params(24, eos, mask),
                &mut |ev| {
                    if let refusion_engine::decode::Event::Committed { tokens, .. } = ev {
                        committed.extend_from_slice(tokens);
                    }
                },
            )
            .unwrap();
            assert_eq!(r.tokens, want, "{name} {prompt:?}");
            assert_eq!(committed, want, "streamed in order");
            assert_eq!(r.forward_calls, want.len());
            assert_eq!(r.tpf, 1.0);
            let first = prompt.len() as u32;
            let positions: Vec<u32> = (first..first + want.len() as u32).collect();
            assert_eq!(r.positions, positions);
        }
    }
}

type Results = SchedResults;

use common::sched_request as request;

/// Left-to-right requests beside slot-decoding golden cases in one scheduler: each gives what
/// it gives alone, and a shared prompt (fully cached for the second request) changes nothing.
#[test]
fn both_strategies_share_the_scheduler_and_stay_exact() {
    let text = std::fs::read_to_string(fixtures().join("goldens_public.json")).unwrap();
    let goldens: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases: Vec<&serde_json::Value> = goldens["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["model"] == "pub-a" && c["temperature"].as_f64() == Some(0.0))
        .take(6)
        .collect();
    assert!(cases.len() >= 4);
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path(), "pub-a");
    let (eos, mask) = (cases[0]["eos_id"].as_u64().unwrap() as u32, 511);
    let ar_prompts = [vec![5u32, 9, 13, 21], vec![5u32, 9, 13, 21], vec![77u32, 3]];
    let ar_alone: Vec<Vec<u32>> = ar_prompts
        .iter()
        .map(|p| greedy_by_recomputing(&m, p, 16, eos))
        .collect();
    for parallel in [1, 3, 8] {
        let results = Results::default();
        let cache = KvCache::new(m.cache_shape(4096), CacheType::F32).unwrap();
        let mut sched = Scheduler::new(&m, cache, parallel);
        for (i, c) in cases.iter().enumerate() {
            sched.submit(request(
                i,
                golden_ids(&c["prompt_ids"]),
                golden_params(c),
                &results,
            ));
            if let Some(p) = ar_prompts.get(i) {
                sched.submit(request(
                    100 + i,
                    p.clone(),
                    ar_params(16, eos, mask),
                    &results,
                ));
            }
        }
        while !sched.is_idle() {
            sched.step();
        }
        drop(sched);
        let results = results.into_inner();
        for (i, c) in cases.iter().enumerate() {
            let r = &results[&i];
            assert_eq!(
                r.tokens,
                golden_ids(&c["tokens"]),
                "-np {parallel}: case {i}"
            );
            let tpf = c["tpf"].as_f64().unwrap();
            assert!((r.tpf - tpf).abs() < 1e-9, "-np {parallel}: case {i}");
        }
        for (i, want) in ar_alone.iter().enumerate() {
            assert_eq!(&results[&(100 + i)].tokens, want, "-np {parallel}: ar {i}");
        }
    }
}

#[test]
fn the_strategy_is_chosen_by_name_on_the_command_line() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    let m = out.to_str().unwrap();
    let run_json = |s: &str| {
        let o = run(&[
            "generate",
            "-m",
            m,
            "--prompt-ids",
            "5,9,13",
            "-n",
            "8",
            "--json",
            "--strategy",
            s,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let ar = run_json("ar");
    assert_eq!(ar["tpf"], 1.0);
    assert_eq!(ar["forward_calls"], ar["tokens"].as_array().unwrap().len());
    let slots = run_json("slots");
    assert!(slots["tpf"].as_f64().unwrap() >= 1.0);
    let o = run(&[
        "generate",
        "-m",
        m,
        "--prompt-ids",
        "5",
        "--strategy",
        "beam",
    ]);
    assert_fails_with(
        &o,
        &["unknown strategy 'beam' (expected slots, ar, infill)"],
    );
}
