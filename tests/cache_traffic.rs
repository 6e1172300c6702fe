//! What a decode costs the KV cache: the bytes it writes and copies grow with the entries the
//! forwards add and the decoder commits, never with the shared prefix that every row reads in
//! place (no re-concatenation, no copy of the prefix per row or per forward).

mod common;

use std::sync::Arc;

use common::*;
use refusion_engine::decode::{generate, DecodeParams};
use refusion_engine::kv::CacheType;
use refusion_engine::model::{Forward, Offload, Qwen3};
use refusion_gguf::GgufFile;

fn params() -> DecodeParams {
    DecodeParams {
        gen_length: 32,
        slot_size: 4,
        serial_blocks: 2,
        slot_threshold: 0.6,
        token_threshold: 0.3,
        temperature: 0.0,
        seed: 0,
        eos_id: 511,
        mask_id: 510,
        ..DecodeParams::new(Default::default(), 511, 510)
    }
}

#[test]
fn cache_traffic_follows_new_and_committed_entries_not_the_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &gguf, "f32");
    for offload in [
        None,
        Some(Offload {
            device: candle_core::Device::Cpu,
            layers: 1,
            output: false,
        }),
    ] {
        let model =
            Qwen3::load_offloaded(Arc::new(GgufFile::open(&gguf).unwrap()), offload.clone())
                .unwrap();
        let per_entry = model.cache_shape(1).bytes_per_token(CacheType::F32) as u64;
        for prompt_len in [8u32, 600] {
            let prompt: Vec<u32> = (0..prompt_len).map(|i| (i * 37 + 11) % 500).collect();
            let p = params();
            let mut cache = model
                .new_cache(prompt.len() + 2 * 32 + 8, CacheType::F32, None)
                .unwrap();
            let r = generate(&model, &mut cache, &prompt, &p, &mut |_| {}).unwrap();
            // Every forward token is written once; every committed entry is staged and written
            // once; a commit of the prompt itself (fed with the first forward) counts too.
            let bound = (r.forward_tokens as u64
                + 2 * (prompt.len() as u64 + p.padded_gen_length() as u64))
                * per_entry;
            let moved = cache.bytes_moved();
            assert!(
                moved <= bound,
                "prompt {prompt_len}, offload {:?}: {moved} bytes moved, bound {bound}",
                offload.as_ref().map(|o| o.layers)
            );
            // And at least what the forwards wrote: the counter is real.
            assert!(moved >= r.forward_tokens as u64 * per_entry);
            assert_eq!(model.config().n_layers, 2);
        }
    }
}
