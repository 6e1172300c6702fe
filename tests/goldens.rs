//! Every public golden case: our decoder at f32 gives exactly the reference's tokens and TPF.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Device;
use common::*;
use refusion_engine::decode::{generate, Kind};
use refusion_engine::kv::CacheType;
use refusion_engine::model::{Offload, Qwen3};
use refusion_gguf::GgufFile;
use serde_json::Value;

/// The device that stands in for a GPU in the offload tests: candle's CPU device (the same
/// tensor code path), or the GPU when `REFUSION_TEST_DEVICE=cuda` (scripts/gpu-check.sh).
fn offload_device() -> Device {
    match std::env::var("REFUSION_TEST_DEVICE").as_deref() {
        Ok("cuda") => Device::new_cuda(0).expect("REFUSION_TEST_DEVICE=cuda but no CUDA device"),
        _ => Device::Cpu,
    }
}

/// The public goldens: three tiny random checkpoints, 111 cases.
const PUBLIC: Goldens = Goldens {
    file: "goldens_public.json",
    cases: 111,
};

/// The trained tiny ReFusion shipped as the demo's model (train/goldens.py): real answers, the
/// model card's and the paper's per-benchmark settings.
const TINY: Goldens = Goldens {
    file: "goldens_tiny.json",
    cases: 0,
};

struct Goldens {
    file: &'static str,
    /// The expected number of cases (0: at least one).
    cases: usize,
}

#[test]
fn every_public_golden_case_matches_exactly() {
    check_every_case(&PUBLIC, None, None);
}

/// Every plan of two slots or more split after its last slot's first token (by default only
/// slots of 16 and more are: the tiny model's cases above), on the host and the tensor path:
/// the same tokens, TPF and forward count as the reference's unsplit plans.
#[test]
fn every_public_golden_case_matches_with_every_plan_split_alone_and_offloaded() {
    for offload in [
        None,
        Some(Offload {
            device: offload_device(),
            layers: usize::MAX,
            output: true,
        }),
    ] {
        check_every_case_as(&PUBLIC, offload, None, Kind::Slots, Some(2));
    }
}

#[test]
fn every_tiny_golden_case_matches_exactly() {
    check_every_case(&TINY, None, None);
}

#[test]
fn every_tiny_golden_case_matches_with_all_layers_offloaded() {
    check_every_case(
        &TINY,
        Some(Offload {
            device: offload_device(),
            layers: usize::MAX,
            output: true,
        }),
        None,
    );
}

#[test]
fn every_public_golden_case_matches_with_all_layers_offloaded() {
    check_every_case(
        &PUBLIC,
        Some(Offload {
            device: offload_device(),
            layers: usize::MAX,
            output: true,
        }),
        None,
    );
}

#[test]
fn every_public_golden_case_matches_with_one_layer_offloaded_and_small_chunks() {
    check_every_case(
        &PUBLIC,
        Some(Offload {
            device: offload_device(),
            layers: 1,
            output: false,
        }),
        Some(3),
    );
}

/// Sampled plans split or not give the same tokens: a tail not drafted takes its draws from
/// the noise all the same, so every later one is where the reference's would be. Every public
/// case at temperature 0.8, seeded by its index, against itself unsplit (the reference's
/// forwards, whose sampled decodes the infill goldens pin).
#[test]
fn sampled_plans_split_or_not_give_the_same_tokens() {
    let text = std::fs::read_to_string(fixtures().join(PUBLIC.file)).unwrap();
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut models = HashMap::new();
    let (mut split_steps, mut failures) = (0, Vec::new());
    for (i, case) in goldens["cases"].as_array().unwrap().iter().enumerate() {
        let name = case["model"].as_str().unwrap();
        let model = models.entry(name.to_string()).or_insert_with(|| {
            let out = tmp.path().join(format!("{name}.gguf"));
            convert_quiet(&model_dir(name), &out, "f32");
            Qwen3::load_offloaded(Arc::new(GgufFile::open(&out).unwrap()), None).unwrap()
        });
        let prompt = golden_ids(&case["prompt_ids"]);
        let mut p = golden_params(case);
        (p.temperature, p.seed) = (0.8, i as u64);
        let capacity = prompt.len() + 2 * p.padded_gen_length() as usize + 8;
        let mut run = |from: u32| {
            p.split_plan_from = from;
            let mut cache = model.new_cache(capacity, CacheType::F32, None).unwrap();
            generate(model, &mut cache, &prompt, &p, &mut |_| {}).unwrap()
        };
        let (whole, split) = (run(0), run(2));
        split_steps += usize::from(split.forward_tokens < whole.forward_tokens);
        if (&whole.tokens, whole.tpf, whole.forward_calls)
            != (&split.tokens, split.tpf, split.forward_calls)
        {
            failures.push(case["id"].as_str().unwrap_or("?").to_string());
        }
    }
    assert!(failures.is_empty(), "split plans differ: {failures:?}");
    // Some decodes skipped a tail (fewer tokens fed): the noise's skip was exercised.
    assert!(split_steps > 10, "{split_steps} decodes skipped a tail");
}

/// The infill strategy without a template is one gap of the gen length: slot decoding over
/// the same slots, the same forwards (the cases whose gen length splits evenly into its
/// serial blocks: infilling never leaves the reference's unsplit tail out).
#[test]
fn every_golden_case_is_also_the_infill_strategy_with_one_gap() {
    check_every_case_as(&PUBLIC, None, None, Kind::Infill, None);
    check_every_case_as(&TINY, None, None, Kind::Infill, None);
}

/// Small chunks and attention tiles of 5 shared entries: many tile edges on every case.
fn check_every_case(set: &Goldens, offload: Option<Offload>, ubatch: Option<usize>) {
    check_every_case_as(set, offload, ubatch, Kind::Slots, None)
}

/// `split_plan_from`: the slot size from which plans are split (`None`: the default's).
fn check_every_case_as(
    set: &Goldens,
    offload: Option<Offload>,
    ubatch: Option<usize>,
    strategy: Kind,
    split_plan_from: Option<u32>,
) {
    let text = std::fs::read_to_string(fixtures().join(set.file)).unwrap();
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let cases = goldens["cases"].as_array().unwrap();
    if set.cases > 0 {
        assert_eq!(cases.len(), set.cases, "{}", set.file);
    } else {
        assert!(!cases.is_empty(), "{}", set.file);
    }
    let mut names: Vec<&str> = cases.iter().map(|c| c["model"].as_str().unwrap()).collect();
    names.sort();
    names.dedup();
    let tmp = tempfile::tempdir().unwrap();
    let mut models = HashMap::new();
    for name in names {
        let out = tmp.path().join(format!("{name}.gguf"));
        convert_quiet(&model_dir(name), &out, "f32");
        let file = Arc::new(GgufFile::open(&out).unwrap());
        let mut model = Qwen3::load_offloaded(file, offload.clone()).unwrap();
        if let Some(n) = ubatch {
            model.set_ubatch(n);
            model.set_attn_tile(5);
        }
        models.insert(name.to_string(), model);
    }
    let mut failures = Vec::new();
    for case in cases {
        let id = case["id"].as_str().unwrap();
        let model = &models[case["model"].as_str().unwrap()];
        let prompt = golden_ids(&case["prompt_ids"]);
        let mut p = golden_params(case);
        p.strategy = strategy;
        if let Some(from) = split_plan_from {
            p.split_plan_from = from;
        }
        if strategy == Kind::Infill && p.dropped_tail() != 0 {
            continue;
        }
        let capacity = prompt.len() + 2 * p.padded_gen_length() as usize + 8;
        let mut cache = model.new_cache(capacity, CacheType::F32, None).unwrap();
        let r = generate(model, &mut cache, &prompt, &p, &mut |_| {}).unwrap();
        let want = golden_ids(&case["tokens"]);
        let want_tpf = case["tpf"].as_f64().unwrap();
        if r.tokens != want || (r.tpf - want_tpf).abs() > 1e-6 {
            failures.push(format!(
                "{id}: tokens {:?} tpf {} (want {:?} tpf {})",
                r.tokens, r.tpf, want, want_tpf
            ));
            continue;
        }
        assert_eq!(
            r.forward_calls as u64,
            case["n_forward"].as_u64().unwrap(),
            "{id}: forward calls"
        );
        // The seed's EOS-index bug, reproduced on request, gives the seed's output.
        if let Some(bug) = case.get("seed_bug_tokens") {
            let mut p = p.clone();
            p.reference_eos_bug = true;
            let mut cache = model.new_cache(capacity, CacheType::F32, None).unwrap();
            let r = generate(model, &mut cache, &prompt, &p, &mut |_| {}).unwrap();
            assert_eq!(r.tokens, golden_ids(bug), "{id}: seed bug tokens");
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Each KV cache type against the goldens (f32's tokens): the share of cases whose every token
/// is f32's, and of tokens equal at their position, over the cases whose head size the type
/// takes (the block types need multiples of 32). Each test prints its row of the table in
/// benches/README.md ("KV cache types: accuracy"), with floors that a broken type (rows written
/// or read wrong) falls far below: random tiny models put near-equal logits side by side, so
/// rounding flips some choices, and each flip changes the rest of its answer. One test per type,
/// so that the harness runs them side by side (six decodes of every case took CI a minute).
fn check_kv_types(k: CacheType, v: CacheType, floor: f64) {
    use refusion_engine::model::Forward;
    let types = refusion_engine::kv::KvTypes { k, v };
    let text = std::fs::read_to_string(fixtures().join(PUBLIC.file)).unwrap();
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let tiny: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join(TINY.file)).unwrap())
            .unwrap();
    let cases: Vec<&Value> = goldens["cases"]
        .as_array()
        .unwrap()
        .iter()
        .chain(tiny["cases"].as_array().unwrap())
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let mut models = HashMap::new();
    for case in &cases {
        let name = case["model"].as_str().unwrap();
        if !models.contains_key(name) {
            let out = tmp.path().join(format!("{name}.gguf"));
            convert_quiet(&model_dir(name), &out, "f32");
            let file = Arc::new(GgufFile::open(&out).unwrap());
            models.insert(name.to_string(), Qwen3::load_offloaded(file, None).unwrap());
        }
    }
    let (mut n, mut whole, mut tokens, mut total) = (0, 0, 0, 0);
    for case in &cases {
        let model = &models[case["model"].as_str().unwrap()];
        if types.check_head_dim(model.config().head_dim).is_err() {
            continue;
        }
        let prompt = golden_ids(&case["prompt_ids"]);
        let p = golden_params(case);
        let capacity = prompt.len() + 2 * p.padded_gen_length() as usize + 8;
        let mut cache = model.new_cache(capacity, types, None).unwrap();
        let r = generate(model, &mut cache, &prompt, &p, &mut |_| {}).unwrap();
        let want = golden_ids(&case["tokens"]);
        n += 1;
        whole += usize::from(r.tokens == want);
        tokens += r.tokens.iter().zip(&want).filter(|(a, b)| a == b).count();
        total += want.len().max(r.tokens.len());
    }
    let share = tokens as f64 / total.max(1) as f64;
    // | -ctk / -ctv | cases | same answer | same tokens |
    println!(
        "| {} / {} | {n} | {:.1}% | {:.1}% |",
        types.k.name(),
        types.v.name(),
        100.0 * whole as f64 / n as f64,
        100.0 * share
    );
    assert!(n > 0, "{types}: no case takes it");
    assert!(
        share >= floor,
        "{types}: {share:.3} of the tokens are f32's"
    );
}

#[test]
fn kv_types_f16_keep_the_goldens_tokens() {
    check_kv_types(CacheType::F16, CacheType::F16, 0.98);
}

#[test]
fn kv_types_bf16_keep_the_goldens_tokens() {
    check_kv_types(CacheType::Bf16, CacheType::Bf16, 0.9);
}

#[test]
fn kv_types_q8_0_keep_the_goldens_tokens() {
    check_kv_types(CacheType::Q8_0, CacheType::Q8_0, 0.9);
}

#[test]
fn kv_types_q8_0_keys_f16_values_keep_the_goldens_tokens() {
    check_kv_types(CacheType::Q8_0, CacheType::F16, 0.9);
}

#[test]
fn kv_types_q5_0_keep_the_goldens_tokens() {
    check_kv_types(CacheType::Q5_0, CacheType::Q5_0, 0.8);
}

#[test]
fn kv_types_q4_0_keep_the_goldens_tokens() {
    check_kv_types(CacheType::Q4_0, CacheType::Q4_0, 0.7);
}
