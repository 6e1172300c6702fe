//! The AVX-512 VNNI kernels (512-bit `vpdpbusd`: one line of a tile, 16 rows, per
//! instruction) and the AVX-512 packer of Q4_K and Q6_K tiles (the portable packer,
//! `scalar::pack_tile`, writes the same bytes).

use super::tiles::{
    Packed, Q4K_D, Q4K_DMIN, Q4K_MINS, Q4K_SCALES, Q5K_FIFTH_BITS, Q6K_D, Q6K_HIGH, Q6K_SCALES,
    Q8_0_D,
};
use super::{prefetch_part, PackedMatrix, Q8K, QK, ROWS_PER_UNIT};
use std::arch::x86_64::*;

/// Activation rows per pass over a run's tiles.
const TILE_MT: usize = 8;

/// Passes of fewer activation rows than this split each row's integer sums into two
/// chains of `vpdpbusd`, added at the end. One chain per row would wait on the
/// instruction's latency (4-5 cycles) at one or two rows, where the multiply pipe takes one
/// each cycle: a one-token product computed at a third of its rate, a pass of two (an
/// 18-token forward's last) at half. Integer sums are exact in any order, so the floats are
/// the same to the bit.
const SPLIT: usize = 4;

/// Run `run` of `w` (16 rows, the last one padded) against activation rows `from..m`, into
/// `out` (`m x w.rows`).
///
/// # Safety
///
/// The CPU has AVX-512F, BW, VL and VNNI; `out` has at least `m * w.rows` values (stored
/// unchecked). `acts` must hold `m` rows of `w.k / 256` blocks and `run` be one of `w`'s runs;
/// these are checked (a panic).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn run(
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    from: usize,
    run: usize,
    out: &mut [f32],
) {
    let kb = w.k / QK;
    let r0 = run * ROWS_PER_UNIT;
    let valid = (w.rows - r0).min(ROWS_PER_UNIT);
    let tiles = w.run_tiles(run);
    let tile_bytes = w.kind.tile_bytes();
    let mut t0 = from;
    while t0 < m {
        let mt = (m - t0).min(TILE_MT);
        let a = &acts[t0 * kb..(t0 + mt) * kb];
        let mut res = [_mm512_setzero_ps(); TILE_MT];
        macro_rules! dot {
            ($($n:literal)*) => {
                match (w.kind, mt) {
                    $((Packed::Q4K, $n) =>
                        packed_q4k::<$n, false>(tiles, tile_bytes, a, kb, &mut res),
                      (Packed::Q5K, $n) =>
                        packed_q4k::<$n, true>(tiles, tile_bytes, a, kb, &mut res),
                      (Packed::Q6K, $n) =>
                        packed_q6k::<$n>(tiles, tile_bytes, a, kb, &mut res),
                      (Packed::Q8_0, $n) => packed_q8_0::<$n>(tiles, tile_bytes, a, kb, &mut res),)*
                    _ => unreachable!("mt is 1..=TILE_MT"),
                }
            };
        }
        // SAFETY: the features by the attribute; the kernels get the run's `kb` whole tiles
        // of `w.kind`'s layout (`run_tiles`: 64-byte lines, so aligned), `tile_bytes` apart,
        // `mt * kb` blocks of activations (`a`, sliced, checked), and `mt <= TILE_MT`.
        unsafe { dot!(1 2 3 4 5 6 7 8) };
        for (t, v) in res[..mt].iter().enumerate() {
            // SAFETY: row `t0 + t`'s values `r0..r0 + valid` (`valid <= 16`; only those are
            // stored) lie inside `out`'s `m * w.rows` (the caller).
            unsafe {
                let o = out.as_mut_ptr().add((t0 + t) * w.rows + r0);
                if valid == ROWS_PER_UNIT {
                    _mm512_storeu_ps(o, *v);
                } else {
                    _mm512_mask_storeu_ps(o, (1u16 << valid) - 1, *v);
                }
            }
        }
        t0 += mt;
    }
}

/// A Q4_K block's quants as four 64-byte runs in [`Q8K`]'s stored order.
///
/// # Safety
///
/// The CPU has AVX-512F, BW and VL, and `blk.len() >= 144` (a Q4_K block; read unchecked).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn q4k_quants(blk: &[u8]) -> [__m512i; 4] {
    let nib = _mm512_set1_epi8(0x0f);
    // SAFETY: bytes `16..144` of the block (the caller).
    let (q01, q23) = unsafe {
        let qp = blk.as_ptr().add(16);
        (
            _mm512_loadu_si512(qp as *const _),
            _mm512_loadu_si512(qp.add(64) as *const _),
        )
    };
    [
        _mm512_and_si512(q01, nib),
        _mm512_and_si512(_mm512_srli_epi16::<4>(q01), nib),
        _mm512_and_si512(q23, nib),
        _mm512_and_si512(_mm512_srli_epi16::<4>(q23), nib),
    ]
}

/// A Q6_K block's quants (0..64, stored +32) as four 64-byte runs in [`Q8K`]'s order.
///
/// Per half-block of 128 values, `ql[0..32]` holds values 0..32 (low nibbles) and 64..96
/// (high), `ql[32..64]` values 32..64 and 96..128, and `qh[j]` their top two bits.
///
/// # Safety
///
/// The CPU has AVX-512F, BW and VL, and `blk.len() >= 192` (a Q6_K block is 210 bytes; its
/// first 192 are read unchecked).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn q6k_quants(blk: &[u8]) -> [__m512i; 4] {
    let nib = _mm512_set1_epi8(0x0f);
    let two = _mm512_set1_epi8(0x03);
    let p = blk.as_ptr();
    let mut w = [_mm512_setzero_si512(); 4];
    for h in 0..2 {
        // SAFETY: bytes `128 + 32 * h..160 + 32 * h`, below 192 (the caller).
        let qh = unsafe { _mm256_loadu_si256(p.add(128 + 32 * h) as *const _) };
        let qh = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), _mm256_srli_epi16::<4>(qh));
        for s in 0..2 {
            // SAFETY: bytes `64 * h + 32 * s..`, 32 of them below 128 (the caller).
            let ql = unsafe { _mm256_loadu_si256(p.add(64 * h + 32 * s) as *const _) };
            let ql =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ql), _mm256_srli_epi16::<4>(ql));
            let hi = match s {
                0 => _mm512_and_si512(qh, two),
                _ => _mm512_and_si512(_mm512_srli_epi16::<2>(qh), two),
            };
            w[2 * h + s] = _mm512_or_si512(_mm512_and_si512(ql, nib), _mm512_slli_epi16::<4>(hi));
        }
    }
    w
}

/// Transposes 16 rows of 16 dwords in place (row `i` becomes column `i`).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn transpose16(r: &mut [__m512i; 16]) {
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    let mut u = [_mm512_setzero_si512(); 16];
    for i in 0..4 {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // u[4i + k], 128-bit lane L: rows 4i..4i+4 of column 4L + k.
    for k in 0..4 {
        let v1 = _mm512_shuffle_i32x4::<0x44>(u[k], u[4 + k]);
        let v2 = _mm512_shuffle_i32x4::<0xee>(u[k], u[4 + k]);
        let v3 = _mm512_shuffle_i32x4::<0x44>(u[8 + k], u[12 + k]);
        let v4 = _mm512_shuffle_i32x4::<0xee>(u[8 + k], u[12 + k]);
        r[k] = _mm512_shuffle_i32x4::<0x88>(v1, v3);
        r[4 + k] = _mm512_shuffle_i32x4::<0xdd>(v1, v3);
        r[8 + k] = _mm512_shuffle_i32x4::<0x88>(v2, v4);
        r[12 + k] = _mm512_shuffle_i32x4::<0xdd>(v2, v4);
    }
}

/// Packs block `b` of rows `r0..r0+16` of the file's blocks `data` into `tile`.
///
/// Q4_K: `[0, 2048)` quants, 64 bytes per pair of four-value groups `(2p, 2p+1)` (in
/// [`Q8K`]'s stored order): byte `4r + j` is row `r`'s value `8p + j` in its low nibble and
/// `8p + 4 + j` in its high one; `[2048, 2176)` the 6-bit scale of each stored 32-value
/// chunk, `[c][row]`; `[2176, 2304)` the minimums per natural sub-block, `[s][row]`;
/// then `d` and `dmin` as 16 f16 each (as in the file).
/// Q6_K: `[0, 2048)` the low four bits as Q4_K's quants; `[2048, 3072)` the top two bits,
/// 64 bytes per four groups `4q..4q+4` (group `4q + i` in bits `2i, 2i+1`); `[3072, 3328)`
/// the i8 scale of each stored 16-value chunk, `[c][row]`; then `d` as 16 f16.
///
/// # Safety
///
/// The CPU has AVX-512F, BW and VL, and `tile.len() >= kind.tile_bytes()` (the quants are
/// stored unchecked). `kind` must be Q4_K or Q6_K and `data` hold block `b` of rows
/// `r0..r0 + 16` (`kb` blocks a row); these are checked (a panic).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn pack_tile(
    kind: Packed,
    data: &[u8],
    r0: usize,
    b: usize,
    kb: usize,
    tile: &mut [u8],
) {
    let bb = kind.block_bytes();
    let mut quants = [[_mm512_setzero_si512(); 4]; 16];
    for (r, q) in quants.iter_mut().enumerate() {
        let blk = &data[((r0 + r) * kb + b) * bb..][..bb];
        // SAFETY: the features by the attribute; `blk` is a whole block of `kind` (144 or 210
        // bytes, sliced, checked).
        *q = match kind {
            Packed::Q4K => unsafe { q4k_quants(blk) },
            Packed::Q6K => unsafe { q6k_quants(blk) },
            Packed::Q5K | Packed::Q8_0 => unreachable!("packed by the portable packer"),
        };
        super::scalar::pack_row_scales(kind, blk, r, tile);
    }
    let nib = _mm512_set1_epi8(0x0f);
    let two = _mm512_set1_epi8(0x03);
    let out = tile.as_mut_ptr();
    for j in 0..4 {
        // Groups 16j .. 16j + 16, each 16 rows x 4 values.
        let mut g = [_mm512_setzero_si512(); 16];
        for (r, q) in quants.iter().enumerate() {
            g[r] = q[j];
        }
        transpose16(&mut g);
        for i in 0..8 {
            let lo = _mm512_and_si512(g[2 * i], nib);
            let hi = _mm512_and_si512(g[2 * i + 1], nib);
            let v = _mm512_or_si512(lo, _mm512_slli_epi16::<4>(hi));
            // SAFETY: line `8 * j + i < 32`, inside the quants (the caller: `tile` is a whole
            // tile).
            unsafe { _mm512_storeu_si512(out.add(64 * (8 * j + i)) as *mut _, v) };
        }
        if kind == Packed::Q6K {
            for q in 0..4 {
                let top = |i: usize| _mm512_and_si512(_mm512_srli_epi16::<4>(g[4 * q + i]), two);
                let h = _mm512_or_si512(
                    _mm512_or_si512(top(0), _mm512_slli_epi16::<2>(top(1))),
                    _mm512_or_si512(
                        _mm512_slli_epi16::<4>(top(2)),
                        _mm512_slli_epi16::<6>(top(3)),
                    ),
                );
                // SAFETY: line `4 * j + q < 16` of the top bits, inside a Q6_K tile (the
                // caller).
                unsafe { _mm512_storeu_si512(out.add(Q6K_HIGH + 64 * (4 * j + q)) as *mut _, h) };
            }
        }
    }
}

/// Activations `at..at + 4` of a block (stored order), in every i32 lane.
///
/// # Safety
///
/// The CPU has AVX-512F, and `at + 4 <= 256` (read unchecked).
#[inline(always)]
unsafe fn bcast(a: &Q8K, at: usize) -> __m512i {
    // SAFETY: AVX-512F and `at + 4 <= 256 == a.qs.len()` by the caller.
    unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(a.qs.as_ptr().add(at) as *const i32)) }
}

/// 16 f16 scales at `at` in a tile, as f32.
///
/// # Safety
///
/// The CPU has AVX-512F, and `tile + at` is valid for reading 32 bytes.
#[inline(always)]
unsafe fn f16x16(tile: *const u8, at: usize) -> __m512 {
    // SAFETY: AVX-512F and the 32 bytes by the caller.
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(tile.add(at) as *const _)) }
}

/// Bit `e` of each byte of `hb` moved to bit 4 (a Q5_K value's fifth bit), the others
/// cleared (16-bit shifts: the bit never crosses a byte).
///
/// # Safety
///
/// The CPU has AVX-512F and BW.
#[inline(always)]
unsafe fn fifth_bit(hb: __m512i, e: usize) -> __m512i {
    // SAFETY: the caller guarantees AVX-512F and BW.
    unsafe {
        let v = match e {
            0 => _mm512_slli_epi16::<4>(hb),
            1 => _mm512_slli_epi16::<3>(hb),
            2 => _mm512_slli_epi16::<2>(hb),
            3 => _mm512_slli_epi16::<1>(hb),
            4 => hb,
            5 => _mm512_srli_epi16::<1>(hb),
            6 => _mm512_srli_epi16::<2>(hb),
            _ => _mm512_srli_epi16::<3>(hb),
        };
        _mm512_and_si512(v, _mm512_set1_epi8(0x10))
    }
}

/// 16 packed Q4_K rows (Q5_K when `FIVE`: the fifth bits from lines 37..45) dotted with
/// `N` activation rows, accumulated into `res`.
///
/// # Safety
///
/// The CPU has AVX-512F, BW, VL and VNNI; `tiles` holds `kb` whole Q4_K (Q5_K when `FIVE`)
/// tiles, `tile_bytes` apart, from a 64-byte aligned start (the loads are aligned ones);
/// `acts` holds at least `N * kb` blocks (indexed, checked); `N <= TILE_MT`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn packed_q4k<const N: usize, const FIVE: bool>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut [__m512; TILE_MT],
) {
    // SAFETY: the features by the attribute; tile `b` is `tile_bytes` bytes inside `tiles`,
    // 64-byte aligned, and every offset read is inside it (the layout's fields, `tiles.rs`); every
    // `bcast` reads 4 activations at an offset of at most 252.
    unsafe {
        let nib = _mm512_set1_epi8(0x0f);
        for b in 0..kb {
            let tile = tiles.as_ptr().add(b * tile_bytes);
            let d = f16x16(tile, Q4K_D);
            let dmin = f16x16(tile, Q4K_DMIN);
            let mut acc = [_mm512_setzero_ps(); N];
            for c in 0..8 {
                prefetch_part(tile, tile_bytes, c, 8);
                let hb = if FIVE {
                    _mm512_load_si512(tile.add(Q5K_FIFTH_BITS + 64 * c) as *const _)
                } else {
                    _mm512_setzero_si512()
                };
                let mut isum = [_mm512_setzero_si512(); N];
                // Below SPLIT tokens the high nibbles sum in a chain of their own (see SPLIT).
                let mut isum_hi = [_mm512_setzero_si512(); N];
                for i in 0..4 {
                    let p = 4 * c + i;
                    let q = _mm512_load_si512(tile.add(64 * p) as *const _);
                    let mut lo = _mm512_and_si512(q, nib);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), nib);
                    if FIVE {
                        lo = _mm512_or_si512(lo, fifth_bit(hb, 2 * i));
                        hi = _mm512_or_si512(hi, fifth_bit(hb, 2 * i + 1));
                    }
                    for t in 0..N {
                        let a = &acts[t * kb + b];
                        isum[t] = _mm512_dpbusd_epi32(isum[t], lo, bcast(a, 8 * p));
                        if N < SPLIT {
                            isum_hi[t] = _mm512_dpbusd_epi32(isum_hi[t], hi, bcast(a, 8 * p + 4));
                        } else {
                            isum[t] = _mm512_dpbusd_epi32(isum[t], hi, bcast(a, 8 * p + 4));
                        }
                    }
                }
                if N < SPLIT {
                    for t in 0..N {
                        isum[t] = _mm512_add_epi32(isum[t], isum_hi[t]);
                    }
                }
                let sc = _mm_loadu_si128(tile.add(Q4K_SCALES + 16 * c) as *const _);
                let sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)), d);
                for t in 0..N {
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), sc, acc[t]);
                }
            }
            for s in 0..8 {
                let mn = _mm_loadu_si128(tile.add(Q4K_MINS + 16 * s) as *const _);
                let mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)), dmin);
                for t in 0..N {
                    let a = &acts[t * kb + b];
                    acc[t] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a.fsum32[s]), acc[t]);
                }
            }
            for t in 0..N {
                res[t] = _mm512_fmadd_ps(acc[t], _mm512_set1_ps(acts[t * kb + b].d), res[t]);
            }
        }
    }
}

/// 16 packed Q8_0 rows dotted with `N` activation rows, accumulated into `res`.
/// `vpdpbusd` takes unsigned weights: each is offset by 128 (`xor 0x80`), and each chunk's
/// integer sum starts at minus 128 times its activations' sum, which takes the offset off
/// exactly (the other paths subtract it as a float, also exactly: integers below 2^24).
///
/// # Safety
///
/// The CPU has AVX-512F, BW, VL and VNNI; `tiles` holds `kb` whole Q8_0 tiles,
/// `tile_bytes` apart, from a 64-byte aligned start (the loads are aligned ones); `acts`
/// holds at least `N * kb` blocks (indexed, checked); `N <= TILE_MT`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn packed_q8_0<const N: usize>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut [__m512; TILE_MT],
) {
    // SAFETY: the features by the attribute; tile `b` is `tile_bytes` bytes inside `tiles`,
    // 64-byte aligned, and every offset read is inside it (the layout's fields, `tiles.rs`); every
    // `bcast` reads 4 activations at an offset of at most 252.
    unsafe {
        let flip = _mm512_set1_epi8(-128);
        for b in 0..kb {
            let tile = tiles.as_ptr().add(b * tile_bytes);
            let mut acc = [_mm512_setzero_ps(); N];
            for c in 0..8 {
                prefetch_part(tile, tile_bytes, c, 8);
                let mut isum = [_mm512_setzero_si512(); N];
                for (t, s) in isum.iter_mut().enumerate() {
                    *s = _mm512_set1_epi32(acts[t * kb + b].q8_0_start[c]);
                }
                let mut isum_odd = [_mm512_setzero_si512(); N];
                for p in 8 * c..8 * c + 8 {
                    let q = _mm512_xor_si512(_mm512_load_si512(tile.add(64 * p) as *const _), flip);
                    for t in 0..N {
                        let a = &acts[t * kb + b];
                        if N < SPLIT && p % 2 == 1 {
                            isum_odd[t] = _mm512_dpbusd_epi32(isum_odd[t], q, bcast(a, 4 * p));
                        } else {
                            isum[t] = _mm512_dpbusd_epi32(isum[t], q, bcast(a, 4 * p));
                        }
                    }
                }
                if N < SPLIT {
                    for t in 0..N {
                        isum[t] = _mm512_add_epi32(isum[t], isum_odd[t]);
                    }
                }
                let d = f16x16(tile, Q8_0_D + 32 * c);
                for t in 0..N {
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), d, acc[t]);
                }
            }
            for t in 0..N {
                res[t] = _mm512_fmadd_ps(acc[t], _mm512_set1_ps(acts[t * kb + b].d), res[t]);
            }
        }
    }
}

/// 16 packed Q6_K rows dotted with `N` activation rows, accumulated into `res`.
///
/// # Safety
///
/// The CPU has AVX-512F, BW, VL and VNNI; `tiles` holds `kb` whole Q6_K tiles,
/// `tile_bytes` apart, from a 64-byte aligned start (the loads are aligned ones); `acts`
/// holds at least `N * kb` blocks (indexed, checked); `N <= TILE_MT`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn packed_q6k<const N: usize>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut [__m512; TILE_MT],
) {
    // SAFETY: the features by the attribute; tile `b` is `tile_bytes` bytes inside `tiles`,
    // 64-byte aligned, and every offset read is inside it (the layout's fields, `tiles.rs`); every
    // `bcast` reads 4 activations at an offset of at most 252.
    unsafe {
        let nib = _mm512_set1_epi8(0x0f);
        let two = _mm512_set1_epi8(0x03);
        for b in 0..kb {
            let tile = tiles.as_ptr().add(b * tile_bytes);
            let d = f16x16(tile, Q6K_D);
            let mut acc = [_mm512_setzero_ps(); N];
            for c in 0..16 {
                prefetch_part(tile, tile_bytes, c, 16);
                let l0 = _mm512_load_si512(tile.add(64 * (2 * c)) as *const _);
                let l1 = _mm512_load_si512(tile.add(64 * (2 * c + 1)) as *const _);
                let h = _mm512_load_si512(tile.add(Q6K_HIGH + 64 * c) as *const _);
                let h1 = _mm512_srli_epi16::<2>(h);
                let h2 = _mm512_srli_epi16::<4>(h);
                let h3 = _mm512_srli_epi16::<6>(h);
                let w = [
                    _mm512_or_si512(
                        _mm512_and_si512(l0, nib),
                        _mm512_slli_epi16::<4>(_mm512_and_si512(h, two)),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(l0), nib),
                        _mm512_slli_epi16::<4>(_mm512_and_si512(h1, two)),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(l1, nib),
                        _mm512_slli_epi16::<4>(_mm512_and_si512(h2, two)),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(l1), nib),
                        _mm512_slli_epi16::<4>(_mm512_and_si512(h3, two)),
                    ),
                ];
                let sc = _mm_loadu_si128(tile.add(Q6K_SCALES + 16 * c) as *const _);
                let sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), d);
                for t in 0..N {
                    let a = &acts[t * kb + b];
                    // The sum starts at the stored values' offset of 32, taken off exactly.
                    let mut isum = _mm512_set1_epi32(a.q6k_start[c]);
                    if N < SPLIT {
                        let mut odd =
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast(a, 16 * c + 4));
                        odd = _mm512_dpbusd_epi32(odd, w[3], bcast(a, 16 * c + 12));
                        isum = _mm512_dpbusd_epi32(isum, w[0], bcast(a, 16 * c));
                        isum = _mm512_dpbusd_epi32(isum, w[2], bcast(a, 16 * c + 8));
                        isum = _mm512_add_epi32(isum, odd);
                    } else {
                        for (i, w) in w.iter().enumerate() {
                            isum = _mm512_dpbusd_epi32(isum, *w, bcast(a, 16 * c + 4 * i));
                        }
                    }
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, acc[t]);
                }
            }
            for t in 0..N {
                res[t] = _mm512_fmadd_ps(acc[t], _mm512_set1_ps(acts[t * kb + b].d), res[t]);
            }
        }
    }
}
