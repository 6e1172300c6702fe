//! The packed Q4_K/Q6_K kernels with 256-bit vectors: AVX2 + FMA + F16C, and AVX-VNNI where
//! the CPU has it (Intel client CPUs since 12th gen, Zen 5). The tiles are the AVX-512
//! kernels' (see `x86::pack_tile`): a 64-byte line holds four values of 16 rows, read here as
//! two halves of 8 rows. `vpdpbusd` (VNNI) multiplies u8 weights by i8 activations and adds
//! each 4 into an i32; plain AVX2 does the same with `vpmaddubsw` + `vpmaddwd` (the i16 pair
//! sums cannot saturate: weights are at most 63).

// The kernels index several register arrays (sums, accumulators, halves) by the same counters.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use refusion_convert::gguf::GgmlType;

use super::{stored_at, tile_lines, PackedMatrix, Q8K, QK, ROWS_PER_UNIT};

/// Activation rows per pass over a run's tiles (16 registers: 4 rows x 2 halves of sums).
const TILE_MT: usize = 4;

// The helpers and kernels below are `inline(always)` without target features of their own:
// they are compiled into `run_avx2` or `run_vnni`, with those entry points' features.

/// `acc + sum of each 4 products w[i] * a[i]` per i32 lane (u8 x i8).
#[inline(always)]
unsafe fn dot<const VNNI: bool>(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
    if VNNI {
        _mm256_dpbusd_avx_epi32(acc, w, a)
    } else {
        let pairs = _mm256_maddubs_epi16(w, a);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }
}

/// Activations `at..at + 4` of a block (stored order), in every i32 lane.
#[inline(always)]
unsafe fn bcast(a: &Q8K, at: usize) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(a.qs.as_ptr().add(at) as *const i32))
}

/// 8 f16 at `at` as f32.
#[inline(always)]
unsafe fn f16x8(tile: *const u8, at: usize) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(tile.add(at) as *const _))
}

/// 8 bytes at `at` (u8, or i8 when `SIGNED`) as f32.
#[inline(always)]
unsafe fn bytes8<const SIGNED: bool>(tile: *const u8, at: usize) -> __m256 {
    let v = _mm_loadl_epi64(tile.add(at) as *const _);
    _mm256_cvtepi32_ps(if SIGNED {
        _mm256_cvtepi8_epi32(v)
    } else {
        _mm256_cvtepu8_epi32(v)
    })
}

/// Run `run` of `w` against every activation row, into `out` (`m x w.rows`), with AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_avx2(
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    run: usize,
    out: &mut [f32],
) {
    run_body::<false>(w, acts, m, run, out)
}

/// As [`run_avx2`], with AVX-VNNI's `vpdpbusd`.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn run_vnni(
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    run: usize,
    out: &mut [f32],
) {
    run_body::<true>(w, acts, m, run, out)
}

/// The kernels' driver: passes of up to [`TILE_MT`] activation rows over the run's tiles.
#[inline(always)]
unsafe fn run_body<const VNNI: bool>(
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    run: usize,
    out: &mut [f32],
) {
    let kb = w.k / QK;
    let r0 = run * ROWS_PER_UNIT;
    let valid = (w.rows - r0).min(ROWS_PER_UNIT);
    let tiles = w.run_tiles(run);
    let tile_bytes = tile_lines(w.ty) * 64;
    let mut t0 = 0;
    while t0 < m {
        let mt = (m - t0).min(TILE_MT);
        let a = &acts[t0 * kb..(t0 + mt) * kb];
        let mut res = [[_mm256_setzero_ps(); 2]; TILE_MT];
        macro_rules! kernel {
            ($($n:literal)*) => {
                match (w.ty == GgmlType::Q4_K, mt) {
                    $((true, $n) => packed_q4k::<$n, VNNI>(tiles, tile_bytes, a, kb, &mut res),
                      (false, $n) => packed_q6k::<$n, VNNI>(tiles, tile_bytes, a, kb, &mut res),)*
                    _ => unreachable!("mt is 1..=TILE_MT"),
                }
            };
        }
        kernel!(1 2 3 4);
        for (t, v) in res[..mt].iter().enumerate() {
            let o = out.as_mut_ptr().add((t0 + t) * w.rows + r0);
            if valid == ROWS_PER_UNIT {
                _mm256_storeu_ps(o, v[0]);
                _mm256_storeu_ps(o.add(8), v[1]);
            } else {
                // The padded run: only its real rows.
                let mut all = [0f32; ROWS_PER_UNIT];
                _mm256_storeu_ps(all.as_mut_ptr(), v[0]);
                _mm256_storeu_ps(all.as_mut_ptr().add(8), v[1]);
                std::ptr::copy_nonoverlapping(all.as_ptr(), o, valid);
            }
        }
        t0 += mt;
    }
}

/// 16 packed Q4_K rows (two halves of 8) dotted with `N` activation rows into `res`.
#[inline(always)]
unsafe fn packed_q4k<const N: usize, const VNNI: bool>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut [[__m256; 2]; TILE_MT],
) {
    let nib = _mm256_set1_epi8(0x0f);
    for b in 0..kb {
        let tile = tiles.as_ptr().add(b * tile_bytes);
        let d = [f16x8(tile, 2304), f16x8(tile, 2320)];
        let dmin = [f16x8(tile, 2336), f16x8(tile, 2352)];
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for c in 0..8 {
            let mut isum = [[_mm256_setzero_si256(); 2]; N];
            for p in 4 * c..4 * c + 4 {
                for h in 0..2 {
                    let q = _mm256_load_si256(tile.add(64 * p + 32 * h) as *const _);
                    let lo = _mm256_and_si256(q, nib);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib);
                    for t in 0..N {
                        let a = &acts[t * kb + b];
                        isum[t][h] = dot::<VNNI>(isum[t][h], lo, bcast(a, 8 * p));
                        isum[t][h] = dot::<VNNI>(isum[t][h], hi, bcast(a, 8 * p + 4));
                    }
                }
            }
            for h in 0..2 {
                let sc = _mm256_mul_ps(bytes8::<false>(tile, 2048 + 16 * c + 8 * h), d[h]);
                for t in 0..N {
                    acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t][h]), sc, acc[t][h]);
                }
            }
        }
        for s in 0..8 {
            for h in 0..2 {
                let mn = _mm256_mul_ps(bytes8::<false>(tile, 2176 + 16 * s + 8 * h), dmin[h]);
                for t in 0..N {
                    let a = &acts[t * kb + b];
                    acc[t][h] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(a.fsum32[s]), acc[t][h]);
                }
            }
        }
        for t in 0..N {
            let ad = _mm256_set1_ps(acts[t * kb + b].d);
            for h in 0..2 {
                res[t][h] = _mm256_fmadd_ps(acc[t][h], ad, res[t][h]);
            }
        }
    }
}

/// 16 packed Q6_K rows (two halves of 8) dotted with `N` activation rows into `res`.
#[inline(always)]
unsafe fn packed_q6k<const N: usize, const VNNI: bool>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut [[__m256; 2]; TILE_MT],
) {
    let nib = _mm256_set1_epi8(0x0f);
    let two = _mm256_set1_epi8(0x03);
    for b in 0..kb {
        let tile = tiles.as_ptr().add(b * tile_bytes);
        let d = [f16x8(tile, 3328), f16x8(tile, 3344)];
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for c in 0..16 {
            for h in 0..2 {
                let line = |l: usize| _mm256_load_si256(tile.add(64 * l + 32 * h) as *const _);
                let (l0, l1, hb) = (line(2 * c), line(2 * c + 1), line(32 + c));
                let top = |shift: i32| {
                    let v = match shift {
                        0 => hb,
                        2 => _mm256_srli_epi16::<2>(hb),
                        4 => _mm256_srli_epi16::<4>(hb),
                        _ => _mm256_srli_epi16::<6>(hb),
                    };
                    _mm256_slli_epi16::<4>(_mm256_and_si256(v, two))
                };
                let w = [
                    _mm256_or_si256(_mm256_and_si256(l0, nib), top(0)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l0), nib), top(2)),
                    _mm256_or_si256(_mm256_and_si256(l1, nib), top(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l1), nib), top(6)),
                ];
                let sc = _mm256_mul_ps(bytes8::<true>(tile, 3072 + 16 * c + 8 * h), d[h]);
                for t in 0..N {
                    let a = &acts[t * kb + b];
                    let mut isum = _mm256_setzero_si256();
                    for (i, w) in w.iter().enumerate() {
                        isum = dot::<VNNI>(isum, *w, bcast(a, 16 * c + 4 * i));
                    }
                    acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[t][h]);
                }
            }
        }
        // The +32 offset, per natural 16-value sub-block s (stored chunk stored_at(16 s) / 16).
        for h in 0..2 {
            let d32 = _mm256_mul_ps(d[h], _mm256_set1_ps(32.0));
            for s in 0..16 {
                let c = stored_at(16 * s) / 16;
                let sc = _mm256_mul_ps(bytes8::<true>(tile, 3072 + 16 * c + 8 * h), d32);
                for t in 0..N {
                    let a = &acts[t * kb + b];
                    acc[t][h] = _mm256_fnmadd_ps(sc, _mm256_set1_ps(a.fsum16[s]), acc[t][h]);
                }
            }
        }
        for t in 0..N {
            let ad = _mm256_set1_ps(acts[t * kb + b].d);
            for h in 0..2 {
                res[t][h] = _mm256_fmadd_ps(acc[t][h], ad, res[t][h]);
            }
        }
    }
}
