//! Tests of the module above (x86: the fast path against the portable loops).

use super::*;
use crate::kv::{CacheShape, CacheType, KvCache, KvTypes, SeqId};

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// The fast paths (AVX-512 where the CPU has it, AVX2) give the portable loop's floats to the
/// bit, for head sizes with and without a tail, one and several tokens, prefixes, tokens of
/// several rows interleaved and of one row (a planning forward's masks), GQA groups of 1 to 9
/// heads; over an f32 cache and over the other types (decoded for the fast path).
#[test]
#[cfg(target_arch = "x86_64")]
fn the_fast_path_gives_the_portable_loops_floats() {
    if !has_avx2() {
        return;
    }
    for case in [
        (128, 2, 8, 40, 5, 3),
        (24, 2, 6, 9, 11, 3),
        (64, 1, 3, 0, 3, 3),
        (20, 1, 9, 7, 4, 3),
        (128, 8, 16, 30, 37, 1),
        (136, 2, 4, 12, 19, 2),
        (40, 4, 4, 5, 10, 1),
        // Longer than a decoded tile (64 rows): the prefix, and one row's own entries.
        (64, 2, 4, 150, 70, 1),
    ]
    .into_iter()
    .flat_map(|c| {
        [
            CacheType::F32,
            CacheType::F16,
            CacheType::Bf16,
            CacheType::Q8_0,
            CacheType::Q4_0,
        ]
        .map(KvTypes::same)
        .into_iter()
        // Keys and values of different types (-ctk/-ctv), f32 beside a decoded type too.
        .chain([
            KvTypes {
                k: CacheType::Q8_0,
                v: CacheType::F16,
            },
            KvTypes {
                k: CacheType::F32,
                v: CacheType::Q4_0,
            },
            KvTypes {
                k: CacheType::Bf16,
                v: CacheType::F32,
            },
        ])
        .filter(move |t| t.check_head_dim(c.0).is_ok())
        .map(move |t| (c, t))
    }) {
        let ((hd, nkv, nh, prefix, n, n_rows), ty) = case;
        let shape = CacheShape {
            n_layers: 1,
            n_kv_heads: nkv,
            head_dim: hd,
            capacity: 256,
        };
        let mut cache = KvCache::new(shape, ty).unwrap();
        let mut seed = 9u64;
        let mut fill = |cache: &mut KvCache, rows: &[u32]| {
            let pos: Vec<u32> = (0..rows.len() as u32).collect();
            let slots = cache.allocate(rows, &pos).unwrap();
            let k: Vec<f32> = (0..rows.len() * nkv * hd).map(|_| lcg(&mut seed)).collect();
            let v: Vec<f32> = (0..rows.len() * nkv * hd).map(|_| lcg(&mut seed)).collect();
            cache.write(0, &slots, &k, &v);
        };
        if prefix > 0 {
            fill(&mut cache, &vec![0; prefix]);
            cache.commit_row(0).unwrap();
        }
        let rows: Vec<u32> = (0..n as u32).map(|i| i % n_rows).collect();
        fill(&mut cache, &rows);
        let segments = cache.cells().segments(SeqId::DEFAULT).unwrap();
        let mut counts = [0usize; 3];
        let visible: Vec<Visible> = rows
            .iter()
            .map(|&r| {
                counts[r as usize] += 1;
                Visible {
                    seq: 0,
                    prefix: &segments,
                    row_slots: cache.row_slots(r as usize),
                    count: counts[r as usize],
                }
            })
            .collect();
        let q: Vec<f32> = (0..n * nh * hd).map(|_| lcg(&mut seed)).collect();
        let heads = Heads {
            n: nh,
            kv: nkv,
            dim: hd,
        };
        let run = |held: u8| {
            HOLD_BACK.store(held, std::sync::atomic::Ordering::SeqCst);
            let mut out = vec![0f32; n * nh * hd];
            attend(&q, &cache, 0, &visible, heads, &mut out);
            HOLD_BACK.store(0, std::sync::atomic::Ordering::SeqCst);
            out
        };
        let portable = run(2);
        let same = |a: &[f32]| {
            a.iter()
                .zip(&portable)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        };
        assert!(
            same(&run(1)),
            "head_dim {hd}, {ty}: the AVX2 path differs from the portable loop"
        );
        assert!(
            same(&run(0)),
            "head_dim {hd}, {ty}: the AVX-512 path differs from the portable loop"
        );
    }
}
