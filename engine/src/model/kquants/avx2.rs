//! The packed Q4_K/Q5_K/Q6_K/Q8_0 kernels with 256-bit vectors: AVX2 + FMA + F16C, and AVX-VNNI where
//! the CPU has it (Intel client CPUs since 12th gen, Zen 5). The tiles are the AVX-512
//! kernels' (see `avx512::pack_tile`): a 64-byte line holds four values of 16 rows, read here as
//! two halves of 8 rows. `vpdpbusd` (VNNI) multiplies u8 weights by i8 activations and adds
//! each 4 into an i32; plain AVX2 adds pairs into i16 lanes with `vpmaddubsw` (no saturation:
//! weights are at most 63, activations at most 127 in magnitude), sums up to 8 of those (Q4_K)
//! or 2 (Q6_K; in a wide product all 4 of a chunk, from a start that takes the values' offset
//! off) before widening them with `vpmaddwd`. The integer sums are exact, so every path
//! gives the same results to the bit.

// The kernels index several register arrays (sums, accumulators, halves) by the same counters.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::caches::near_run_bytes;
use super::tiles::{
    Packed, Q4K_D, Q4K_DMIN, Q4K_MINS, Q4K_SCALES, Q5K_FIFTH_BITS, Q6K_D, Q6K_SCALES, Q8_0_D,
};
use super::{prefetch_part_at, prefetch_tiles, PackedMatrix, Q8K, QK, ROWS_PER_UNIT};

/// Activation rows per pass over a run's tiles (16 registers: 4 rows x 2 halves of sums).
const TILE_MT: usize = 4;

/// Activation rows per pass of the wide Q6_K kernel over one half of a run's tiles (8
/// registers of sums; 6 was slower on Zen 3, 8 rows of two halves would not fit).
const Q6K_HALF_MT: usize = 8;

// The helpers and kernels below are `inline(always)` without target features of their own:
// they are compiled into `run_avx2` or `run_vnni`, with those entry points' features.

/// `sum` plus the products `w[i] * a[i]` (u8 x i8): with VNNI, each 4 added into an i32 lane
/// (`vpdpbusd`); without, each pair into an i16 lane (`vpmaddubsw`, at most 2 x 63 x 127), so
/// that several can be added before [`widen`] (the callers keep the i16 sums below 32767).
///
/// # Safety
///
/// The CPU has AVX2, and AVX-VNNI when `VNNI`.
#[inline(always)]
unsafe fn add_dot<const VNNI: bool>(sum: __m256i, w: __m256i, a: __m256i) -> __m256i {
    // SAFETY: the caller guarantees the features.
    unsafe {
        if VNNI {
            _mm256_dpbusd_avx_epi32(sum, w, a)
        } else {
            _mm256_add_epi16(sum, _mm256_maddubs_epi16(w, a))
        }
    }
}

/// `w0 · a0 + w1 · a1` as i32 lanes (8 products each).
///
/// # Safety
///
/// The CPU has AVX2, and AVX-VNNI when `VNNI`.
#[inline(always)]
unsafe fn dot2<const VNNI: bool>(w0: __m256i, a0: __m256i, w1: __m256i, a1: __m256i) -> __m256i {
    // SAFETY: the caller guarantees the features [`add_dot`] and [`widen`] need.
    unsafe {
        let s = add_dot::<VNNI>(_mm256_setzero_si256(), w0, a0);
        widen::<VNNI>(add_dot::<VNNI>(s, w1, a1))
    }
}

/// The 6-bit values (0..64) of stored chunk `c` (16 values) of half `h` (8 rows) of a Q6_K
/// tile, as four groups of 4 values per row: low bits from lines `2c, 2c + 1`, top bits from
/// line `32 + c`.
///
/// # Safety
///
/// The CPU has AVX2; `tile` points at a whole Q6_K tile (at least its first 48 lines),
/// 32-byte aligned (the loads are aligned ones); `c < 16` and `h < 2`.
#[inline(always)]
unsafe fn q6k_values(tile: *const u8, c: usize, h: usize) -> [__m256i; 4] {
    // SAFETY: AVX2 by the caller; lines `2c + 1 < 32` and `32 + c < 48` of the tile, half
    // `h`: 32 bytes inside it, 32-byte aligned (the caller).
    unsafe {
        let nib = _mm256_set1_epi8(0x0f);
        let top_bits = _mm256_set1_epi8(0x30);
        let load = |l: usize| _mm256_load_si256(tile.add(64 * l + 32 * h) as *const _);
        let (l0, l1, hb) = (load(2 * c), load(2 * c + 1), load(32 + c));
        // Bits 2j, 2j + 1 of each byte moved to bits 4, 5 (16-bit shifts: what crosses a
        // byte boundary lands outside the mask).
        let top = [
            _mm256_slli_epi16::<4>(hb),
            _mm256_slli_epi16::<2>(hb),
            hb,
            _mm256_srli_epi16::<2>(hb),
        ]
        .map(|v| _mm256_and_si256(v, top_bits));
        [
            _mm256_or_si256(_mm256_and_si256(l0, nib), top[0]),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l0), nib), top[1]),
            _mm256_or_si256(_mm256_and_si256(l1, nib), top[2]),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l1), nib), top[3]),
        ]
    }
}

/// A sum built by [`add_dot`] as i32 lanes, each 4 products.
///
/// # Safety
///
/// The CPU has AVX2.
#[inline(always)]
unsafe fn widen<const VNNI: bool>(sum: __m256i) -> __m256i {
    // SAFETY: the caller guarantees AVX2.
    unsafe {
        if VNNI {
            sum
        } else {
            _mm256_madd_epi16(sum, _mm256_set1_epi16(1))
        }
    }
}

/// Activations `at..at + 4` of a block (stored order), in every i32 lane.
///
/// # Safety
///
/// The CPU has AVX, and `at + 4 <= 256` (read unchecked).
#[inline(always)]
unsafe fn bcast(a: &Q8K, at: usize) -> __m256i {
    // SAFETY: AVX and `at + 4 <= 256 == a.qs.len()` by the caller.
    unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(a.qs.as_ptr().add(at) as *const i32)) }
}

/// 8 f16 at `at` as f32.
///
/// # Safety
///
/// The CPU has F16C, and `tile + at` is valid for reading 16 bytes.
#[inline(always)]
unsafe fn f16x8(tile: *const u8, at: usize) -> __m256 {
    // SAFETY: F16C and the 16 bytes by the caller.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(tile.add(at) as *const _)) }
}

/// 8 bytes at `at` (u8, or i8 when `SIGNED`) as f32.
///
/// # Safety
///
/// The CPU has AVX2, and `tile + at` is valid for reading 8 bytes.
#[inline(always)]
unsafe fn bytes8<const SIGNED: bool>(tile: *const u8, at: usize) -> __m256 {
    // SAFETY: AVX2 and the 8 bytes by the caller.
    unsafe {
        let v = _mm_loadl_epi64(tile.add(at) as *const _);
        _mm256_cvtepi32_ps(if SIGNED {
            _mm256_cvtepi8_epi32(v)
        } else {
            _mm256_cvtepu8_epi32(v)
        })
    }
}

/// Run `run` of `w` against every activation row, into `out` (`m x w.rows`), with AVX2.
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C; `out` has at least `m * w.rows` values (stored
/// unchecked). `acts` must hold `m` rows of `w.k / 256` blocks and `run` be one of `w`'s runs;
/// these are checked (a panic).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_avx2(
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    run: usize,
    out: &mut [f32],
) {
    // SAFETY: the features by the attribute, `out`'s length by the caller.
    unsafe { run_body::<false>(w, acts, m, run, out) }
}

/// As [`run_avx2`], with AVX-VNNI's `vpdpbusd`.
///
/// # Safety
///
/// As [`run_avx2`], and the CPU has AVX-VNNI too.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn run_vnni(
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    run: usize,
    out: &mut [f32],
) {
    // SAFETY: the features by the attribute, `out`'s length by the caller.
    unsafe { run_body::<true>(w, acts, m, run, out) }
}

/// The kernels' driver: passes of up to [`TILE_MT`] activation rows over the run's tiles (a
/// wide Q6_K product: [`q6k_by_halves`]).
///
/// # Safety
///
/// As [`run_avx2`] (and [`run_vnni`] when `VNNI`): the CPU has AVX2, FMA and F16C (and
/// AVX-VNNI when `VNNI`), and `out` has at least `m * w.rows` values.
#[inline(always)]
unsafe fn run_body<const VNNI: bool>(
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    run: usize,
    out: &mut [f32],
) {
    // SAFETY: the features by the caller. The kernels get the run's `kb` whole tiles of
    // `w.kind`'s layout (`run_tiles`: 64-byte lines, so aligned), `tile_bytes` apart, and
    // `mt * kb` blocks of activations (`a`, sliced, checked). Each store writes row `t0 + t`'s
    // values `r0..r0 + valid` (`valid <= 16`), inside `out`'s `m * w.rows` (the caller).
    unsafe {
        let kb = w.k / QK;
        let r0 = run * ROWS_PER_UNIT;
        let valid = (w.rows - r0).min(ROWS_PER_UNIT);
        let tiles = w.run_tiles(run);
        let tile_bytes = w.kind.tile_bytes();
        // Only the first pass over a run's tiles fetches them when they fit half this CPU's
        // L2 (`near_run_bytes`: the later passes find them there, and the next run's first
        // tiles are asked for by that first pass, early); a longer run's every pass prefetches.
        let near = kb * tile_bytes <= near_run_bytes();
        // A wide Q6_K product goes one half of the tiles at a time, for more activation rows a
        // pass: its unpacking (three loads and 17 operations per chunk and half, against
        // Q4_K's 3 per two products) is shared by up to 8 rows instead of 4.
        if w.kind == Packed::Q6K && m > TILE_MT {
            q6k_by_halves::<VNNI>(w, acts, m, run, out, near);
            return;
        }
        let mut t0 = 0;
        while t0 < m {
            let mt = (m - t0).min(TILE_MT);
            let a = &acts[t0 * kb..(t0 + mt) * kb];
            let mut res = [[_mm256_setzero_ps(); 2]; TILE_MT];
            let pf = if t0 == 0 || !near {
                prefetch_tiles()
            } else {
                0
            };
            macro_rules! kernel {
            ($($n:literal)*) => {
                match (w.kind, mt) {
                    $((Packed::Q4K, $n) =>
                        packed_q4k::<$n, VNNI, false>(tiles, tile_bytes, a, kb, &mut res, pf),
                      (Packed::Q5K, $n) =>
                        packed_q4k::<$n, VNNI, true>(tiles, tile_bytes, a, kb, &mut res, pf),
                      (Packed::Q6K, $n) =>
                        packed_q6k::<$n, VNNI>(tiles, tile_bytes, a, kb, &mut res, pf),
                      (Packed::Q8_0, $n) =>
                        packed_q8_0::<$n, VNNI>(tiles, tile_bytes, a, kb, &mut res, pf),)*
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
}

/// Bit `e` of each byte of `hb` moved to bit 4 (a Q5_K value's fifth bit), the others
/// cleared (16-bit shifts: the bit never crosses a byte).
///
/// # Safety
///
/// The CPU has AVX2.
#[inline(always)]
unsafe fn fifth_bit(hb: __m256i, e: usize) -> __m256i {
    // SAFETY: the caller guarantees AVX2.
    unsafe {
        let v = match e {
            0 => _mm256_slli_epi16::<4>(hb),
            1 => _mm256_slli_epi16::<3>(hb),
            2 => _mm256_slli_epi16::<2>(hb),
            3 => _mm256_slli_epi16::<1>(hb),
            4 => hb,
            5 => _mm256_srli_epi16::<1>(hb),
            6 => _mm256_srli_epi16::<2>(hb),
            _ => _mm256_srli_epi16::<3>(hb),
        };
        _mm256_and_si256(v, _mm256_set1_epi8(0x10))
    }
}

/// A Q4_K (or Q5_K) block's end for `N` activation rows: the minimums taken off each half's
/// accumulator (`dmin` times each sub-block's minimum times the row's sum of it), then the
/// accumulator times the row's scale added into `res`.
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C; `tile` is a whole Q4_K or Q5_K tile; `acts` holds at least
/// `N * kb` blocks (indexed, checked).
#[inline(always)]
unsafe fn q4k_block_end<const N: usize>(
    tile: *const u8,
    acts: &[Q8K],
    kb: usize,
    b: usize,
    acc: &mut [[__m256; 2]; N],
    res: &mut [[__m256; 2]; TILE_MT],
) {
    // SAFETY: the features by the caller; the reads are the tile's fields (`tiles.rs`).
    unsafe {
        let dmin = [f16x8(tile, Q4K_DMIN), f16x8(tile, Q4K_DMIN + 16)];
        for s in 0..8 {
            for h in 0..2 {
                let mn = _mm256_mul_ps(bytes8::<false>(tile, Q4K_MINS + 16 * s + 8 * h), dmin[h]);
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

/// 16 packed Q4_K rows (Q5_K when `FIVE`: fifth bits from lines 37..45; two halves of 8)
/// dotted with `N` activation rows into `res`, prefetching `pf` tiles ahead (0: none).
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C (and AVX-VNNI when `VNNI`); `tiles` holds `kb` whole
/// Q4_K (Q5_K when `FIVE`) tiles, `tile_bytes` apart, from a 32-byte aligned start (the loads
/// are aligned ones); `acts` holds at least `N * kb` blocks (indexed, checked); `N <= TILE_MT`.
#[inline(always)]
unsafe fn packed_q4k<const N: usize, const VNNI: bool, const FIVE: bool>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut [[__m256; 2]; TILE_MT],
    pf: usize,
) {
    // SAFETY: the features by the caller; tile `b` is `tile_bytes` bytes inside `tiles`, 32-byte
    // aligned, and every offset read is inside it (the layout's fields, `tiles.rs`); every
    // `bcast` reads 4 activations at an offset of at most 252.
    unsafe {
        let nib = _mm256_set1_epi8(0x0f);
        // Without VNNI, i16 pair sums of at most 2 x 15 x 127 (Q4_K) add up 8 at a time below
        // 32767; Q5_K's (2 x 31 x 127) are widened each two.
        let widen_each = FIVE && !VNNI;
        for b in 0..kb {
            let tile = tiles.as_ptr().add(b * tile_bytes);
            let d = [f16x8(tile, Q4K_D), f16x8(tile, Q4K_D + 16)];
            let mut acc = [[_mm256_setzero_ps(); 2]; N];
            for c in 0..8 {
                prefetch_part_at(pf, tile, tile_bytes, c, 8);
                let mut isum = [[_mm256_setzero_si256(); 2]; N];
                for h in 0..2 {
                    let hb = if FIVE {
                        _mm256_load_si256(tile.add(Q5K_FIFTH_BITS + 64 * c + 32 * h) as *const _)
                    } else {
                        _mm256_setzero_si256()
                    };
                    for i in 0..4 {
                        let p = 4 * c + i;
                        let q = _mm256_load_si256(tile.add(64 * p + 32 * h) as *const _);
                        let mut lo = _mm256_and_si256(q, nib);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib);
                        if FIVE {
                            lo = _mm256_or_si256(lo, fifth_bit(hb, 2 * i));
                            hi = _mm256_or_si256(hi, fifth_bit(hb, 2 * i + 1));
                        }
                        for t in 0..N {
                            let a = &acts[t * kb + b];
                            let (a0, a1) = (bcast(a, 8 * p), bcast(a, 8 * p + 4));
                            isum[t][h] = if widen_each {
                                _mm256_add_epi32(isum[t][h], dot2::<VNNI>(lo, a0, hi, a1))
                            } else {
                                add_dot::<VNNI>(add_dot::<VNNI>(isum[t][h], lo, a0), hi, a1)
                            };
                        }
                    }
                }
                for h in 0..2 {
                    let sc =
                        _mm256_mul_ps(bytes8::<false>(tile, Q4K_SCALES + 16 * c + 8 * h), d[h]);
                    for t in 0..N {
                        let isum = if widen_each {
                            isum[t][h]
                        } else {
                            widen::<VNNI>(isum[t][h])
                        };
                        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[t][h]);
                    }
                }
            }
            q4k_block_end(tile, acts, kb, b, &mut acc, res);
        }
    }
}

/// 16 packed Q8_0 rows (two halves of 8) dotted with `N` activation rows into `res`,
/// prefetching `pf` tiles ahead (0: none). The weights are signed: `|w|` times the activation
/// with `w`'s sign (`vpsignb`), at most 2 x 128 x 127 per i16 pair without VNNI, widened each
/// time.
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C (and AVX-VNNI when `VNNI`); `tiles` holds `kb` whole
/// Q8_0 tiles, `tile_bytes` apart, from a 32-byte aligned start (the loads are aligned
/// ones); `acts` holds at least `N * kb` blocks (indexed, checked); `N <= TILE_MT`.
#[inline(always)]
unsafe fn packed_q8_0<const N: usize, const VNNI: bool>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut [[__m256; 2]; TILE_MT],
    pf: usize,
) {
    // SAFETY: the features by the caller; tile `b` is `tile_bytes` bytes inside `tiles`, 32-byte
    // aligned, and every offset read is inside it (the layout's fields, `tiles.rs`); every
    // `bcast` reads 4 activations at an offset of at most 252.
    unsafe {
        let zero = _mm256_setzero_si256();
        for b in 0..kb {
            let tile = tiles.as_ptr().add(b * tile_bytes);
            let mut acc = [[_mm256_setzero_ps(); 2]; N];
            for c in 0..8 {
                prefetch_part_at(pf, tile, tile_bytes, c, 8);
                for h in 0..2 {
                    let mut isum = [_mm256_setzero_si256(); N];
                    for p in 8 * c..8 * c + 8 {
                        let q = _mm256_load_si256(tile.add(64 * p + 32 * h) as *const _);
                        let wa = _mm256_abs_epi8(q);
                        for t in 0..N {
                            let sa = _mm256_sign_epi8(bcast(&acts[t * kb + b], 4 * p), q);
                            isum[t] = if VNNI {
                                add_dot::<true>(isum[t], wa, sa)
                            } else {
                                _mm256_add_epi32(
                                    isum[t],
                                    widen::<false>(add_dot::<false>(zero, wa, sa)),
                                )
                            };
                        }
                    }
                    let d = f16x8(tile, Q8_0_D + 32 * c + 16 * h);
                    for t in 0..N {
                        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), d, acc[t][h]);
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
}

/// 16 packed Q6_K rows (two halves of 8) dotted with `N` activation rows into `res`,
/// prefetching `pf` tiles ahead (0: none).
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C (and AVX-VNNI when `VNNI`); `tiles` holds `kb` whole
/// Q6_K tiles, `tile_bytes` apart, from a 32-byte aligned start (the loads are aligned
/// ones); `acts` holds at least `N * kb` blocks (indexed, checked); `N <= TILE_MT`.
#[inline(always)]
unsafe fn packed_q6k<const N: usize, const VNNI: bool>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut [[__m256; 2]; TILE_MT],
    pf: usize,
) {
    // SAFETY: the features by the caller; tile `b` is `tile_bytes` bytes inside `tiles`, 32-byte
    // aligned, and every offset read is inside it (the layout's fields, `tiles.rs`); every
    // `bcast` reads 4 activations at an offset of at most 252.
    unsafe {
        for b in 0..kb {
            let tile = tiles.as_ptr().add(b * tile_bytes);
            let d = [f16x8(tile, Q6K_D), f16x8(tile, Q6K_D + 16)];
            let mut acc = [[_mm256_setzero_ps(); 2]; N];
            for c in 0..16 {
                prefetch_part_at(pf, tile, tile_bytes, c, 16);
                for h in 0..2 {
                    let w = q6k_values(tile, c, h);
                    let sc = _mm256_mul_ps(bytes8::<true>(tile, Q6K_SCALES + 16 * c + 8 * h), d[h]);
                    for t in 0..N {
                        let a = &acts[t * kb + b];
                        // Two pair sums of at most 2 x 63 x 127 per i16 lane at a time.
                        let at = |i: usize| bcast(a, 16 * c + 4 * i);
                        let (a0, a1, a2, a3) = (at(0), at(1), at(2), at(3));
                        let isum = _mm256_add_epi32(
                            dot2::<VNNI>(w[0], a0, w[1], a1),
                            dot2::<VNNI>(w[2], a2, w[3], a3),
                        );
                        // The stored values' offset of 32, taken off exactly.
                        let isum = _mm256_add_epi32(isum, _mm256_set1_epi32(a.q6k_start[c]));
                        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[t][h]);
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
}

/// A Q6_K run against `m` activation rows in passes of up to [`Q6K_HALF_MT`] rows, each pass
/// over one half (8 weight rows) of the tiles at a time.
///
/// # Safety
///
/// As [`run_body`].
#[inline(always)]
unsafe fn q6k_by_halves<const VNNI: bool>(
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    run: usize,
    out: &mut [f32],
    near: bool,
) {
    // SAFETY: as in `run_body`: the run's whole tiles, `mt * kb` blocks of activations, and
    // stores of row `t0 + t`'s values `r0 + 8h..r0 + 8h + n`, `n >= 1` of the run's `valid`
    // real rows (only the halves that have any are run), inside `out`'s `m * w.rows`.
    unsafe {
        let kb = w.k / QK;
        let r0 = run * ROWS_PER_UNIT;
        let valid = (w.rows - r0).min(ROWS_PER_UNIT);
        let tiles = w.run_tiles(run);
        let tile_bytes = w.kind.tile_bytes();
        let mut t0 = 0;
        while t0 < m {
            let mt = (m - t0).min(Q6K_HALF_MT);
            let a = &acts[t0 * kb..(t0 + mt) * kb];
            // A padded run of at most 8 real rows skips its second half.
            for h in 0..valid.div_ceil(8) {
                // As in `run_body`: a long run's every pass prefetches, a near one's first.
                let pf = if (h == 0 && t0 == 0) || !near {
                    prefetch_tiles()
                } else {
                    0
                };
                let mut res = [_mm256_setzero_ps(); Q6K_HALF_MT];
                macro_rules! kernel {
                    ($($n:literal)*) => {
                        match mt {
                            $($n => packed_q6k_half::<$n, VNNI>(
                                tiles, tile_bytes, a, kb, h, &mut res, pf),)*
                            _ => unreachable!("mt is 1..=Q6K_HALF_MT"),
                        }
                    };
                }
                kernel!(1 2 3 4 5 6 7 8);
                let lo = 8 * h;
                let n = (valid - lo).min(8);
                for (t, v) in res[..mt].iter().enumerate() {
                    let o = out.as_mut_ptr().add((t0 + t) * w.rows + r0 + lo);
                    if n == 8 {
                        _mm256_storeu_ps(o, *v);
                    } else {
                        let mut all = [0f32; 8];
                        _mm256_storeu_ps(all.as_mut_ptr(), *v);
                        std::ptr::copy_nonoverlapping(all.as_ptr(), o, n);
                    }
                }
            }
            t0 += mt;
        }
    }
}

/// Half `h` (8 rows) of 16 packed Q6_K rows dotted with `N` activation rows into `res`: the
/// same integer sums and float steps, in the same order, as [`packed_q6k`].
///
/// # Safety
///
/// As [`packed_q6k`], except `N <= Q6K_HALF_MT` (not `TILE_MT`), and `h < 2`.
#[inline(always)]
unsafe fn packed_q6k_half<const N: usize, const VNNI: bool>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    h: usize,
    res: &mut [__m256; Q6K_HALF_MT],
    pf: usize,
) {
    // SAFETY: as in `packed_q6k`.
    unsafe {
        for b in 0..kb {
            let tile = tiles.as_ptr().add(b * tile_bytes);
            let d = f16x8(tile, Q6K_D + 16 * h);
            let mut acc = [_mm256_setzero_ps(); N];
            for c in 0..16 {
                prefetch_part_at(pf, tile, tile_bytes, c, 16);
                let w = q6k_values(tile, c, h);
                let sc = _mm256_mul_ps(bytes8::<true>(tile, Q6K_SCALES + 16 * c + 8 * h), d);
                for t in 0..N {
                    let a = &acts[t * kb + b];
                    // The sums start at minus 32 times the activations (the values' offset),
                    // per i32 lane with VNNI, else per i16 lane (`q6k_lanes`): the chunk's four
                    // `vpmaddubsw` then add up in i16 before one widening, since every partial
                    // sum is the products with `w - 32` of the pairs added so far minus 32
                    // times the rest: 8 terms of at most 32 x 127, within 32512 in magnitude.
                    let start = if VNNI { a.q6k_start[c] } else { a.q6k_lanes[c] };
                    let mut sum = _mm256_set1_epi32(start);
                    for i in 0..4 {
                        sum = add_dot::<VNNI>(sum, w[i], bcast(a, 16 * c + 4 * i));
                    }
                    let isum = widen::<VNNI>(sum);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[t]);
                }
            }
            for t in 0..N {
                let ad = _mm256_set1_ps(acts[t * kb + b].d);
                res[t] = _mm256_fmadd_ps(acc[t], ad, res[t]);
            }
        }
    }
}
