//! Any-order generation ("fill the gaps", `Kind::Infill`): every case of train/infill.py's
//! reference (the model card's decoder with a template's known spans committed at their
//! positions) gives exactly its tokens, TPF, forward calls and fills at f32, alone on the CPU
//! path, with small chunks and attention tiles, and through the scheduler beside other
//! requests (batch invariance).

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::*;
use refusion_engine::decode::{generate, DecodeParams, DecodeResult, Piece, Template};
use refusion_engine::kv::CacheType;
use refusion_engine::model::Qwen3;
use refusion_engine::sched::Scheduler;
use refusion_gguf::GgufFile;
use serde_json::Value;

fn goldens() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join("goldens_infill.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

fn models(dir: &std::path::Path, cases: &[Value], small_chunks: bool) -> HashMap<String, Qwen3> {
    let mut names: Vec<&str> = cases.iter().map(|c| c["model"].as_str().unwrap()).collect();
    names.sort();
    names.dedup();
    let mut out = HashMap::new();
    for name in names {
        let path = dir.join(format!("{name}.gguf"));
        if !path.exists() {
            convert_quiet(&model_dir(name), &path, "f32");
        }
        let mut m = Qwen3::load_offloaded(Arc::new(GgufFile::open(&path).unwrap()), None).unwrap();
        if small_chunks {
            m.set_ubatch(3);
            m.set_attn_tile(5);
        }
        out.insert(name.to_string(), m);
    }
    out
}

fn template(case: &Value) -> Template {
    let pieces = case["template"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| match p.get("gap") {
            Some(n) => Piece::Gap(n.as_u64().unwrap() as u32),
            None => Piece::Known(golden_ids(&p["known"])),
        })
        .collect();
    Template { pieces }
}

fn params(case: &Value) -> DecodeParams {
    // The gen length sets `{{gap}}`'s size and the serial blocks' length.
    let mut p = golden_params(case);
    p.seed = case["seed"].as_u64().unwrap();
    p.with_template(template(case))
}

/// What differs from the case, if anything.
fn differs(case: &Value, r: &DecodeResult) -> Option<String> {
    let want = golden_ids(&case["tokens"]);
    let tpf = case["tpf"].as_f64().unwrap();
    let f = r.filled.as_ref().unwrap();
    let fills: Vec<(Vec<u32>, bool)> = f.gaps.iter().map(|g| (g.tokens.clone(), g.eos)).collect();
    let want_fills: Vec<(Vec<u32>, bool)> = case["fills"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (golden_ids(&g["tokens"]), g["eos"].as_bool().unwrap()))
        .collect();
    let same = r.tokens == want
        && r.positions == golden_ids(&case["positions"])
        && (r.tpf - tpf).abs() < 1e-9
        && r.forward_calls as u64 == case["n_forward"].as_u64().unwrap()
        && f.answer == golden_ids(&case["answer"])
        && fills == want_fills;
    (!same).then(|| {
        format!(
            "{}: tokens {:?} tpf {} calls {} (want {want:?} tpf {tpf} calls {})",
            case["id"], r.tokens, r.tpf, r.forward_calls, case["n_forward"]
        )
    })
}

/// `split_plan_from`: the slot size from which plans are split (`None`: the default's).
fn check_alone(small_chunks: bool, split_plan_from: Option<u32>) {
    let cases = goldens();
    assert!(cases.len() >= 100, "{} cases", cases.len());
    let tmp = tempfile::tempdir().unwrap();
    let models = models(tmp.path(), &cases, small_chunks);
    let mut failures = Vec::new();
    for case in &cases {
        let m = &models[case["model"].as_str().unwrap()];
        let prompt = golden_ids(&case["prompt_ids"]);
        let mut p = params(case);
        if let Some(from) = split_plan_from {
            p.split_plan_from = from;
        }
        let mut cache = m
            .new_cache(prompt.len() + 1024, CacheType::F32, None)
            .unwrap();
        let r = generate(m, &mut cache, &prompt, &p, &mut |_| {}).unwrap();
        failures.extend(differs(case, &r));
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn every_infill_golden_case_matches_exactly() {
    check_alone(false, None);
}

/// With every plan of two slots or more split after its last slot's first token, too (the
/// sampled cases' noise skips the tails not drafted: the same draws after them).
#[test]
fn every_infill_golden_case_matches_with_small_chunks_and_tiles_and_every_plan_split() {
    check_alone(true, Some(2));
}

#[test]
fn the_goldens_cover_what_the_issue_asks_for() {
    let cases = goldens();
    let has = |f: &dyn Fn(&Value) -> bool| cases.iter().filter(|c| f(c)).count();
    let pieces = |c: &Value| c["template"].as_array().unwrap().clone();
    let gaps = |c: &Value| pieces(c).iter().filter(|p| p.get("gap").is_some()).count();
    assert!(has(&|c| gaps(c) == 1) > 20, "one gap");
    assert!(has(&|c| gaps(c) == 2) > 20, "two gaps");
    assert!(
        has(&|c| pieces(c)[0].get("gap").is_some()) > 20,
        "a gap first"
    );
    assert!(has(&|c| pieces(c).last().unwrap().get("gap").is_some()) > 20);
    assert!(
        has(&|c| c["temperature"].as_f64().unwrap() > 0.0) >= 3,
        "sampled"
    );
    // A gap longer than its fill: ended by an EOS, the rest dropped.
    assert!(
        has(&|c| c["fills"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["eos"] == true))
            > 10
    );
    // A middle gap on the trained model: known text on both sides.
    assert!(has(&|c| c["model"] == "refusion-tiny" && pieces(c).len() == 3) >= 8);
}

type Results = SchedResults;

use common::sched_request as request;

/// Batch invariance: infill requests of one model beside each other and beside plain slot
/// decoding of the same prompts, 1, 3 and 8 at a time, each gives what it gives alone.
#[test]
fn infill_requests_through_the_scheduler_stay_exact() {
    let cases: Vec<Value> = goldens()
        .into_iter()
        .filter(|c| c["model"] == "refusion-tiny")
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let models = models(tmp.path(), &cases, false);
    let m = &models["refusion-tiny"];
    for parallel in [1, 3, 8] {
        let results = Results::default();
        let cache = m.new_cache(16384, CacheType::F32, None).unwrap();
        let mut sched = Scheduler::new(m, cache, parallel);
        for (i, c) in cases.iter().enumerate() {
            let prompt = golden_ids(&c["prompt_ids"]);
            sched.submit(request(i, prompt.clone(), params(c), &results));
            if i % 4 == 0 {
                let mut plain = params(c);
                (plain.strategy, plain.template) = (Default::default(), None);
                plain.gen_length = 32;
                sched.submit(request(1000 + i, prompt, plain, &results));
            }
        }
        while !sched.is_idle() {
            sched.step();
        }
        drop(sched);
        let results = results.into_inner();
        let failures: Vec<String> = cases
            .iter()
            .enumerate()
            .filter_map(|(i, c)| differs(c, &results[&i]))
            .collect();
        assert!(
            failures.is_empty(),
            "-np {parallel}:\n{}",
            failures.join("\n")
        );
        assert!(results.keys().any(|&k| k >= 1000));
    }
}

/// Fitted gaps (train/fit.py's goldens: the probe, then the final decode of each gap at the
/// length found) through the scheduler, 1 and 4 at a time beside plain requests: each gives the
/// reference's tokens, forwards and fills (the probe's entries dropped, the prompt's kept).
#[test]
fn fitted_gaps_through_the_scheduler_stay_exact() {
    let text = std::fs::read_to_string(fixtures().join("goldens_fit.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let cases: Vec<Value> = doc["cases"].as_array().unwrap().clone();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("refusion-tiny.gguf");
    convert_quiet(&trained_tiny(), &path, "f32");
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let tok = refusion_engine::chat::Tokenizer::from_gguf(&file.header).unwrap();
    let m = Qwen3::load_offloaded(file, None).unwrap();
    let fitted = |c: &Value| {
        let pieces = refusion_engine::decode::template::parse(
            c["template_text"].as_str().unwrap(),
            c["gen_length"].as_u64().unwrap() as u32,
        )
        .unwrap();
        let t = Template::from_text(&pieces, |s| tok.encode_text(s), Some(&tok)).unwrap();
        let mut p = golden_params(c);
        p.seed = c["seed"].as_u64().unwrap();
        p.with_template(t)
    };
    for parallel in [1, 4] {
        let results = Results::default();
        let cache = m.new_cache(16384, CacheType::F32, None).unwrap();
        let mut sched = Scheduler::new(&m, cache, parallel);
        for (i, c) in cases.iter().enumerate() {
            let prompt = golden_ids(&c["prompt_ids"]);
            sched.submit(request(i, prompt.clone(), fitted(c), &results));
            if i % 5 == 0 {
                let mut plain = golden_params(c);
                (plain.gen_length, plain.serial_blocks) = (32, 1);
                sched.submit(request(1000 + i, prompt, plain, &results));
            }
        }
        while !sched.is_idle() {
            sched.step();
        }
        drop(sched);
        let results = results.into_inner();
        let mut failures = Vec::new();
        for (i, c) in cases.iter().enumerate() {
            let r = &results[&i];
            let fills: Vec<Vec<u32>> = r
                .filled
                .as_ref()
                .unwrap()
                .gaps
                .iter()
                .map(|g| g.tokens.clone())
                .collect();
            let want: Vec<Vec<u32>> = c["fills"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| golden_ids(&f["tokens"]))
                .collect();
            let same = r.tokens == golden_ids(&c["tokens"])
                && r.positions == golden_ids(&c["positions"])
                && r.forward_calls as u64 == c["n_forward"].as_u64().unwrap()
                && (r.tpf - c["tpf"].as_f64().unwrap()).abs() < 1e-9
                && r.filled.as_ref().unwrap().answer == golden_ids(&c["answer"])
                && fills == want;
            if !same {
                failures.push(format!("{} {}", c["id"], c["template_name"]));
            }
        }
        assert!(
            failures.is_empty(),
            "-np {parallel}: {} of {} differ: {}",
            failures.len(),
            cases.len(),
            failures.join(", ")
        );
    }
}
