//! Q4_K and Q6_K matrix products read straight from the GGUF's blocks (AVX-512).
//!
//! candle's fast x86 kernels multiply a repacked copy of each weight (Q4_K 1.33x, Q6_K 1.52x
//! the file's bytes), built single-threaded at load, and Q6_K keeps the original as well for
//! one-token products. These kernels use the file's own block layout, as ggml does, so the
//! weights stay in the memory map: nothing is packed at load and nothing is copied, and a
//! one-token product streams fewer bytes. Activations are quantized once per product to
//! 8-bit blocks of 256 ([`Q8K`], ggml's Q8_K), in an order that lines up with Q4_K's nibbles.
//!
//! Each weight row is dotted with up to [`MT`] activation rows at once, so a block's unpacked
//! quants and scales serve several tokens; rows are spread over candle's worker pool.
//! Without AVX-512 (F + BW) [`available`] is false and the model uses candle's kernels.

use refusion_convert::gguf::GgmlType;

/// Values per super-block.
const QK: usize = 256;
/// Activation rows dotted with one weight row at a time.
const MT: usize = 4;
/// Weight rows per unit of work handed to a worker.
const ROWS_PER_UNIT: usize = 16;

/// One block of 256 activations quantized to i8 with one f32 scale, and sums of each 16
/// (for the weights' minimum/offset terms). `qs` is stored in Q4_K's nibble order: per 128
/// values, `[0..32, 64..96, 32..64, 96..128]`, so a 64-byte load pairs with a 64-byte run
/// of Q4_K quants' low (or high) nibbles. `bsums` keep the natural order.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct Q8K {
    qs: [i8; QK],
    bsums: [i16; QK / 16],
    /// `bsums` as f32, and summed in pairs (per 32 values), for the tiled kernels.
    fsum16: [f32; QK / 16],
    fsum32: [f32; QK / 32],
    d: f32,
}

impl Q8K {
    const ZERO: Q8K = Q8K {
        qs: [0; QK],
        bsums: [0; QK / 16],
        fsum16: [0.0; QK / 16],
        fsum32: [0.0; QK / 32],
        d: 0.0,
    };
}

/// Where value `i` (natural order) of a block is stored in [`Q8K::qs`].
#[inline(always)]
const fn stored_at(i: usize) -> usize {
    let half = i / 128 * 128;
    let j = i % 128;
    // [0..32) -> [0..32), [32..64) -> [64..96), [64..96) -> [32..64), [96..128) stay.
    half + match j / 32 {
        1 => j + 32,
        2 => j - 32,
        _ => j,
    }
}

/// Quantizes one block as ggml's Q8_K does (round to nearest, scale from the signed maximum).
fn quantize_block(x: &[f32], out: &mut Q8K) {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        *out = Q8K::ZERO;
        return;
    }
    let iscale = -127.0 / max;
    let mut q = [0i8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = ((iscale * v).round() as i32).min(127) as i8;
    }
    for (s, chunk) in out.bsums.iter_mut().zip(q.chunks_exact(16)) {
        *s = chunk.iter().map(|&v| v as i16).sum();
    }
    for (i, &v) in q.iter().enumerate() {
        out.qs[stored_at(i)] = v;
    }
    for (f, &b) in out.fsum16.iter_mut().zip(&out.bsums) {
        *f = b as f32;
    }
    for (f, b) in out.fsum32.iter_mut().zip(out.bsums.chunks_exact(2)) {
        *f = (b[0] + b[1]) as f32;
    }
    out.d = 1.0 / iscale;
}

/// Quantizes `m` rows of `k` activations (`k` a multiple of 256) into `out`.
fn quantize_rows(x: &[f32], k: usize, out: &mut Vec<Q8K>) {
    let kb = k / QK;
    out.clear();
    out.resize(x.len() / k * kb, Q8K::ZERO);
    for (x, q) in x.chunks_exact(QK).zip(out.iter_mut()) {
        quantize_block(x, q);
    }
}

/// Whether this CPU runs these kernels.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            std::env::var_os("REFUSION_NO_NATIVE_KQUANTS").is_none()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether a `rows x k` weight of type `ty` runs here.
pub fn supports(ty: GgmlType, k: usize) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) && k > 0 && k.is_multiple_of(QK) && available()
}

/// A quantized weight matrix of `rows` rows of `k` values, its blocks in row-major order.
pub struct KQuantWeight<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub k: usize,
    pub data: &'a [u8],
}

thread_local! {
    /// Quantized activations of the calling thread's last product (reused, not reallocated).
    static ACTS: std::cell::RefCell<Vec<Q8K>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out[t][r] = sum_i x[t][i] * w[r][i]` for every weight in `ws` (all `k` wide), sharing one
/// quantization of `x` (`m` rows of `k`). `outs[j]` holds `m x ws[j].rows` values.
/// The caller has checked [`supports`] for each weight and the buffer sizes.
pub fn matmul_many(ws: &[KQuantWeight<'_>], x: &[f32], m: usize, outs: &mut [&mut [f32]]) {
    let Some(k) = ws.first().map(|w| w.k) else {
        return;
    };
    assert!(x.len() == m * k && ws.len() == outs.len());
    for (w, o) in ws.iter().zip(outs.iter()) {
        assert!(w.k == k && o.len() == m * w.rows);
        assert!(w.data.len() == w.rows * (k / QK) * block_bytes(w.ty));
    }
    ACTS.with_borrow_mut(|acts| {
        quantize_rows(x, k, acts);
        #[cfg(target_arch = "x86_64")]
        {
            let acts: &[Q8K] = acts;
            // Units: runs of weight rows, over all weights, each with every activation row.
            let mut starts = Vec::with_capacity(ws.len() + 1);
            let mut units = 0;
            for w in ws {
                starts.push(units);
                units += w.rows.div_ceil(ROWS_PER_UNIT);
            }
            starts.push(units);
            let outs: Vec<(usize, usize)> = outs
                .iter_mut()
                .map(|o| (o.as_mut_ptr() as usize, o.len()))
                .collect();
            candle_core::utils::barrier_pool().execute_chunked(units, |range| {
                for unit in range {
                    let j = starts.partition_point(|&s| s <= unit) - 1;
                    let w = &ws[j];
                    let r0 = (unit - starts[j]) * ROWS_PER_UNIT;
                    let r1 = (r0 + ROWS_PER_UNIT).min(w.rows);
                    // SAFETY: units write disjoint rows `r0..r1` of each token's output of
                    // weight `j`, which the caller's `&mut` lends for this call.
                    let out =
                        unsafe { std::slice::from_raw_parts_mut(outs[j].0 as *mut f32, outs[j].1) };
                    // SAFETY: `available()` checked the CPU features (via `supports`).
                    unsafe { x86::rows(w, acts, m, r0..r1, out) };
                }
            });
        }
    });
}

fn block_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_K => 144,
        GgmlType::Q6_K => 210,
        _ => 0,
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{block_bytes, KQuantWeight, MT, Q8K, QK, ROWS_PER_UNIT};
    use refusion_convert::gguf::GgmlType;
    use std::arch::x86_64::*;

    /// From this many activation rows on, a unit's blocks are first interleaved into
    /// [`Tile`]s (in cache) so that one `vpdpbusd` serves 16 weight rows.
    const TILE_MIN_M: usize = 4;
    /// Activation rows per pass over a unit's tiles.
    const TILE_MT: usize = 8;

    /// One block (256 values) of 16 weight rows, interleaved for `vpdpbusd` with a broadcast
    /// activation: `q[g]` holds values `4g..4g+4` (in [`Q8K`]'s stored order) of each row.
    /// `sc[c]` scales the integer sums of stored chunk `c` (32 values for Q4_K, 16 for
    /// Q6_K); `corr[s]` multiplies the activation sum of natural sub-block `s`, subtracted.
    #[repr(C, align(64))]
    struct Tile {
        q: [[u8; 64]; 64],
        sc: [[f32; 16]; 16],
        corr: [[f32; 16]; 16],
    }

    thread_local! {
        /// A worker's interleaved blocks of its current unit (reused between products).
        static TILES: std::cell::RefCell<Vec<Tile>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    fn vnni() -> bool {
        use std::sync::OnceLock;
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| is_x86_feature_detected!("avx512vnni"))
    }

    /// Rows `rows` of `w` against every activation row, into `out` (`m x w.rows`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn rows(
        w: &KQuantWeight<'_>,
        acts: &[Q8K],
        m: usize,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let kb = w.k / QK;
        if m >= TILE_MIN_M && rows.len() == ROWS_PER_UNIT && vnni() {
            TILES.with_borrow_mut(|tiles| tiled(w, acts, m, rows.start, kb, tiles, out));
            return;
        }
        let row_bytes = kb * block_bytes(w.ty);
        let mut t0 = 0;
        while t0 < m {
            let mt = (m - t0).min(MT);
            for r in rows.clone() {
                let row = &w.data[r * row_bytes..(r + 1) * row_bytes];
                let a = &acts[t0 * kb..(t0 + mt) * kb];
                let mut res = [0f32; MT];
                match (w.ty, mt) {
                    (GgmlType::Q4_K, 1) => q4k::<1>(row, a, kb, &mut res),
                    (GgmlType::Q4_K, 2) => q4k::<2>(row, a, kb, &mut res),
                    (GgmlType::Q4_K, 3) => q4k::<3>(row, a, kb, &mut res),
                    (GgmlType::Q4_K, _) => q4k::<4>(row, a, kb, &mut res),
                    (_, 1) => q6k::<1>(row, a, kb, &mut res),
                    (_, 2) => q6k::<2>(row, a, kb, &mut res),
                    (_, 3) => q6k::<3>(row, a, kb, &mut res),
                    (_, _) => q6k::<4>(row, a, kb, &mut res),
                }
                for (t, &v) in res[..mt].iter().enumerate() {
                    out[(t0 + t) * w.rows + r] = v;
                }
            }
            t0 += mt;
        }
    }

    /// Byte shuffles (per 128-bit lane) that spread Q4_K's scales, widened to i16, over a
    /// product's i16 lanes: the first 256 bits take sub-block `a`, the rest `b`.
    const fn q4k_pick(a: u8, b: u8) -> [u8; 64] {
        let mut out = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            let s = if i < 32 { a } else { b };
            out[i] = 2 * s + (i % 2) as u8;
            i += 1;
        }
        out
    }
    static Q4K_PICKS: [[u8; 64]; 4] = [
        q4k_pick(0, 2),
        q4k_pick(1, 3),
        q4k_pick(4, 6),
        q4k_pick(5, 7),
    ];

    /// i16 permutations that give each 128-bit lane of a Q6_K product its sub-block's scale.
    const fn q6k_pick(s: [u16; 4]) -> [u16; 32] {
        let mut out = [0u16; 32];
        let mut i = 0;
        while i < 32 {
            out[i] = s[i / 8];
            i += 1;
        }
        out
    }
    static Q6K_PICKS: [[u16; 32]; 4] = [
        q6k_pick([0, 1, 4, 5]),
        q6k_pick([2, 3, 6, 7]),
        q6k_pick([8, 9, 12, 13]),
        q6k_pick([10, 11, 14, 15]),
    ];

    #[inline(always)]
    fn f16_at(b: &[u8], at: usize) -> f32 {
        half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
    }

    /// A Q4_K block's 8 six-bit scales and 8 minimums (ggml's packing), as bytes in two
    /// u64s: `(scales, mins)`.
    #[inline(always)]
    fn q4k_scales(blk: &[u8]) -> (u64, u64) {
        const KMASK1: u32 = 0x3f3f_3f3f;
        const KMASK2: u32 = 0x0f0f_0f0f;
        const KMASK3: u32 = 0x0303_0303;
        let at = |i: usize| u32::from_le_bytes([blk[i], blk[i + 1], blk[i + 2], blk[i + 3]]);
        let (u0, u1, u2) = (at(4), at(8), at(12));
        let m_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
        let m_lo = u1 & KMASK1;
        let s_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
        let s_lo = u0 & KMASK1;
        (
            s_lo as u64 | (s_hi as u64) << 32,
            m_lo as u64 | (m_hi as u64) << 32,
        )
    }

    /// A Q4_K block's quants as four 64-byte runs in [`Q8K`]'s stored order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn q4k_quants(blk: &[u8]) -> [__m512i; 4] {
        let nib = _mm512_set1_epi8(0x0f);
        let qp = blk.as_ptr().add(16);
        let q01 = _mm512_loadu_si512(qp as *const _);
        let q23 = _mm512_loadu_si512(qp.add(64) as *const _);
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
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn q6k_quants(blk: &[u8]) -> [__m512i; 4] {
        let nib = _mm512_set1_epi8(0x0f);
        let two = _mm512_set1_epi8(0x03);
        let p = blk.as_ptr();
        let mut w = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const _);
            let qh =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), _mm256_srli_epi16::<4>(qh));
            for s in 0..2 {
                let ql = _mm256_loadu_si256(p.add(64 * h + 32 * s) as *const _);
                let ql =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ql), _mm256_srli_epi16::<4>(ql));
                let hi = match s {
                    0 => _mm512_and_si512(qh, two),
                    _ => _mm512_and_si512(_mm512_srli_epi16::<2>(qh), two),
                };
                w[2 * h + s] =
                    _mm512_or_si512(_mm512_and_si512(ql, nib), _mm512_slli_epi16::<4>(hi));
            }
        }
        w
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn hsum(v: __m512) -> f32 {
        _mm512_reduce_add_ps(v)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// One Q4_K row (`kb` blocks) dotted with `N` activation rows (`kb` blocks each).
    ///
    /// Products go through `maddubs` (u4 x i8 pairs) and `madd` with each sub-block's 6-bit
    /// scale, so a block's integer sum is exact; the minimum terms use the activations' sums.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn q4k<const N: usize>(row: &[u8], acts: &[Q8K], kb: usize, res: &mut [f32; MT]) {
        let picks = [
            _mm512_loadu_si512(Q4K_PICKS[0].as_ptr() as *const _),
            _mm512_loadu_si512(Q4K_PICKS[1].as_ptr() as *const _),
            _mm512_loadu_si512(Q4K_PICKS[2].as_ptr() as *const _),
            _mm512_loadu_si512(Q4K_PICKS[3].as_ptr() as *const _),
        ];
        let mut accf = [_mm512_setzero_ps(); N];
        let mut accm = [_mm256_setzero_ps(); N];
        for b in 0..kb {
            let blk = &row[b * 144..(b + 1) * 144];
            let d = f16_at(blk, 0);
            let dmin = f16_at(blk, 2);
            let (sc8, mn8) = q4k_scales(blk);
            let sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_set_epi64x(0, sc8 as i64)));
            let scales = [
                _mm512_shuffle_epi8(sc16, picks[0]),
                _mm512_shuffle_epi8(sc16, picks[1]),
                _mm512_shuffle_epi8(sc16, picks[2]),
                _mm512_shuffle_epi8(sc16, picks[3]),
            ];
            let mn8 = _mm_set_epi64x(0, mn8 as i64);
            // Each minimum twice: sub-block s covers bsums 2s and 2s+1.
            let mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
            let w = q4k_quants(blk);
            for t in 0..N {
                let a = &acts[t * kb + b];
                let ap = a.qs.as_ptr();
                let mut isum = _mm512_setzero_si512();
                for (j, (w, s)) in w.iter().zip(&scales).enumerate() {
                    let av = _mm512_loadu_si512(ap.add(64 * j) as *const _);
                    let p = _mm512_maddubs_epi16(*w, av);
                    isum = _mm512_add_epi32(isum, _mm512_madd_epi16(p, *s));
                }
                accf[t] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d * a.d), accf[t]);
                let bs = _mm256_loadu_si256(a.bsums.as_ptr() as *const _);
                let msum = _mm256_madd_epi16(mins, bs);
                accm[t] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(msum),
                    _mm256_set1_ps(dmin * a.d),
                    accm[t],
                );
            }
        }
        for t in 0..N {
            res[t] = hsum(accf[t]) - hsum256(accm[t]);
        }
    }

    /// One Q6_K row dotted with `N` activation rows. Quants are stored +32: the offset is
    /// taken off through the activations' sums, scaled per 16-value sub-block.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn q6k<const N: usize>(row: &[u8], acts: &[Q8K], kb: usize, res: &mut [f32; MT]) {
        let picks = [
            _mm512_loadu_si512(Q6K_PICKS[0].as_ptr() as *const _),
            _mm512_loadu_si512(Q6K_PICKS[1].as_ptr() as *const _),
            _mm512_loadu_si512(Q6K_PICKS[2].as_ptr() as *const _),
            _mm512_loadu_si512(Q6K_PICKS[3].as_ptr() as *const _),
        ];
        let mut accf = [_mm512_setzero_ps(); N];
        let mut acco = [_mm256_setzero_ps(); N];
        for b in 0..kb {
            let blk = &row[b * 210..(b + 1) * 210];
            let d = f16_at(blk, 208);
            let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.as_ptr().add(192) as *const _));
            let sc512 = _mm512_castsi256_si512(sc);
            let scales = [
                _mm512_permutexvar_epi16(picks[0], sc512),
                _mm512_permutexvar_epi16(picks[1], sc512),
                _mm512_permutexvar_epi16(picks[2], sc512),
                _mm512_permutexvar_epi16(picks[3], sc512),
            ];
            let w = q6k_quants(blk);
            for t in 0..N {
                let a = &acts[t * kb + b];
                let ap = a.qs.as_ptr();
                let mut isum = _mm512_setzero_si512();
                for (j, (w, s)) in w.iter().zip(&scales).enumerate() {
                    let av = _mm512_loadu_si512(ap.add(64 * j) as *const _);
                    let p = _mm512_maddubs_epi16(*w, av);
                    isum = _mm512_add_epi32(isum, _mm512_madd_epi16(p, *s));
                }
                let da = d * a.d;
                accf[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(da), accf[t]);
                let bs = _mm256_loadu_si256(a.bsums.as_ptr() as *const _);
                let off = _mm256_madd_epi16(sc, bs);
                acco[t] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(32.0 * da), acco[t]);
            }
        }
        for t in 0..N {
            res[t] = hsum(accf[t]) - hsum256(acco[t]);
        }
    }

    /// Transposes 16 rows of 16 dwords in place (row `i` becomes column `i`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose16(r: &mut [__m512i; 16]) {
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

    /// Interleaves block `b` of rows `r0..r0+16` into `tile`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn build_tile(w: &KQuantWeight<'_>, r0: usize, b: usize, kb: usize, tile: &mut Tile) {
        let bb = block_bytes(w.ty);
        let blk = |r: usize| &w.data[((r0 + r) * kb + b) * bb..][..bb];
        let mut quants = [[_mm512_setzero_si512(); 4]; 16];
        // Per row, its chunk scales and correction factors as one vector each; transposed
        // below into per-chunk vectors over the 16 rows.
        let mut sc = [_mm512_setzero_si512(); 16];
        let mut corr = [_mm512_setzero_si512(); 16];
        for (r, q) in quants.iter_mut().enumerate() {
            let blk = blk(r);
            if w.ty == GgmlType::Q4_K {
                *q = q4k_quants(blk);
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                let (s8, m8) = q4k_scales(blk);
                // Stored chunk c holds natural sub-block [0, 2, 1, 3][c % 4] + c / 4 * 4.
                let s8 = _mm_shuffle_epi8(
                    _mm_set_epi64x(0, s8 as i64),
                    _mm_set_epi8(15, 14, 13, 12, 11, 10, 9, 8, 7, 5, 6, 4, 3, 1, 2, 0),
                );
                let s32 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s8));
                let m32 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x(0, m8 as i64)));
                sc[r] = _mm512_castps_si512(_mm512_mul_ps(s32, _mm512_set1_ps(d)));
                corr[r] = _mm512_castps_si512(_mm512_mul_ps(m32, _mm512_set1_ps(dmin)));
            } else {
                *q = q6k_quants(blk);
                let d = f16_at(blk, 208);
                let s32 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    blk.as_ptr().add(192) as *const _,
                )));
                // Stored chunk c holds natural sub-block stored_at(16 c) / 16.
                let order = _mm512_set_epi32(15, 14, 11, 10, 13, 12, 9, 8, 7, 6, 3, 2, 5, 4, 1, 0);
                let stored = _mm512_permutexvar_ps(order, s32);
                sc[r] = _mm512_castps_si512(_mm512_mul_ps(stored, _mm512_set1_ps(d)));
                corr[r] = _mm512_castps_si512(_mm512_mul_ps(s32, _mm512_set1_ps(32.0 * d)));
            }
        }
        transpose16(&mut sc);
        transpose16(&mut corr);
        for c in 0..16 {
            _mm512_store_si512(tile.sc[c].as_mut_ptr() as *mut _, sc[c]);
            _mm512_store_si512(tile.corr[c].as_mut_ptr() as *mut _, corr[c]);
        }
        for (j, groups) in tile.q.chunks_exact_mut(16).enumerate() {
            let mut rows: [__m512i; 16] = std::array::from_fn(|r| quants[r][j]);
            transpose16(&mut rows);
            for (g, v) in groups.iter_mut().zip(&rows) {
                _mm512_store_si512(g.as_mut_ptr() as *mut _, *v);
            }
        }
    }

    /// Rows `r0..r0+16` against all `m` activation rows through interleaved tiles.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tiled(
        w: &KQuantWeight<'_>,
        acts: &[Q8K],
        m: usize,
        r0: usize,
        kb: usize,
        tiles: &mut Vec<Tile>,
        out: &mut [f32],
    ) {
        if tiles.len() < kb {
            tiles.resize_with(kb, || Tile {
                q: [[0; 64]; 64],
                sc: [[0.0; 16]; 16],
                corr: [[0.0; 16]; 16],
            });
        }
        for (b, tile) in tiles[..kb].iter_mut().enumerate() {
            build_tile(w, r0, b, kb, tile);
        }
        let tiles = &tiles[..kb];
        let mut t0 = 0;
        while t0 < m {
            let mt = (m - t0).min(TILE_MT);
            let a = &acts[t0 * kb..(t0 + mt) * kb];
            let mut res = [_mm512_setzero_ps(); TILE_MT];
            macro_rules! dot {
                ($($n:literal)*) => {
                    match (w.ty == GgmlType::Q4_K, mt) {
                        $((true, $n) => tiled_dot::<$n, 8, 8>(tiles, a, kb, &mut res),
                          (false, $n) => tiled_dot::<$n, 16, 4>(tiles, a, kb, &mut res),)*
                        _ => unreachable!("mt is 1..=TILE_MT"),
                    }
                };
            }
            dot!(1 2 3 4 5 6 7 8);
            for (t, v) in res[..mt].iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add((t0 + t) * w.rows + r0), *v);
            }
            t0 += mt;
        }
    }

    /// 16 interleaved rows dotted with `N` activation rows: `NS` scale chunks of `CH`
    /// four-value groups per block.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tiled_dot<const N: usize, const NS: usize, const CH: usize>(
        tiles: &[Tile],
        acts: &[Q8K],
        kb: usize,
        res: &mut [__m512; TILE_MT],
    ) {
        for (b, tile) in tiles.iter().enumerate() {
            let mut acc = [_mm512_setzero_ps(); N];
            for c in 0..NS {
                let mut isum = [_mm512_setzero_si512(); N];
                for g in c * CH..(c + 1) * CH {
                    let wq = _mm512_load_si512(tile.q[g].as_ptr() as *const _);
                    for t in 0..N {
                        let ap = acts[t * kb + b].qs.as_ptr().add(4 * g);
                        let av = _mm512_set1_epi32(std::ptr::read_unaligned(ap as *const i32));
                        isum[t] = _mm512_dpbusd_epi32(isum[t], wq, av);
                    }
                }
                let sc = _mm512_load_ps(tile.sc[c].as_ptr());
                for t in 0..N {
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), sc, acc[t]);
                }
            }
            for s in 0..NS {
                let corr = _mm512_load_ps(tile.corr[s].as_ptr());
                for t in 0..N {
                    let a = &acts[t * kb + b];
                    let sums = if NS == 8 {
                        &a.fsum32[..]
                    } else {
                        &a.fsum16[..]
                    };
                    acc[t] = _mm512_fnmadd_ps(corr, _mm512_set1_ps(sums[s]), acc[t]);
                }
            }
            for t in 0..N {
                res[t] = _mm512_fmadd_ps(acc[t], _mm512_set1_ps(acts[t * kb + b].d), res[t]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use refusion_convert::quant;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn dequantized_acts(acts: &[Q8K]) -> Vec<f32> {
        let mut out = Vec::new();
        for a in acts {
            for i in 0..QK {
                out.push(a.qs[stored_at(i)] as f32 * a.d);
            }
        }
        out
    }

    /// The kernels against dequantized weights times dequantized activations (f64).
    fn check(ty: GgmlType, rows: usize, k: usize, m: usize) {
        let mut seed = 7u64 + rows as u64 * 31 + m as u64;
        let wf: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed) * 3.0).collect();
        let mut data = vec![0u8; rows * k / QK * block_bytes(ty)];
        quant::quantize(ty, &wf, k, &mut data);
        let mut wd = vec![0f32; rows * k];
        assert!(quant::dequantize(ty, &data, &mut wd));
        let mut acts = Vec::new();
        quantize_rows(&x, k, &mut acts);
        let xd = dequantized_acts(&acts);
        let w = KQuantWeight {
            ty,
            rows,
            k,
            data: &data,
        };
        let mut out = vec![0f32; m * rows];
        matmul_many(&[w], &x, m, &mut [&mut out]);
        for t in 0..m {
            for r in 0..rows {
                let want: f64 = (0..k)
                    .map(|i| wd[r * k + i] as f64 * xd[t * k + i] as f64)
                    .sum();
                let got = out[t * rows + r] as f64;
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "{ty} rows {rows} k {k} m {m}: [{t}][{r}] {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn stored_order_is_a_permutation() {
        let mut seen = [false; QK];
        for i in 0..QK {
            assert!(!seen[stored_at(i)]);
            seen[stored_at(i)] = true;
        }
    }

    #[test]
    fn quantized_activations_round_trip() {
        let mut seed = 3;
        let x: Vec<f32> = (0..2 * QK).map(|_| lcg(&mut seed)).collect();
        let mut acts = Vec::new();
        quantize_rows(&x, QK, &mut acts);
        let back = dequantized_acts(&acts);
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= acts[0].d.abs().max(acts[1].d.abs()) * 0.51);
        }
        for a in &acts {
            for (s, c) in a.bsums.iter().enumerate() {
                let want: i16 = (0..16).map(|i| a.qs[stored_at(16 * s + i)] as i16).sum();
                assert_eq!(*c, want);
            }
        }
    }

    #[test]
    fn q4k_matches_dequantized_product() {
        if !available() {
            return;
        }
        for m in [1, 2, 3, 4, 5, 9] {
            check(GgmlType::Q4_K, 37, 512, m);
        }
        check(GgmlType::Q4_K, 16, 2048, 4);
    }

    #[test]
    fn q6k_matches_dequantized_product() {
        if !available() {
            return;
        }
        for m in [1, 2, 3, 4, 5, 9] {
            check(GgmlType::Q6_K, 37, 512, m);
        }
        check(GgmlType::Q6_K, 16, 2048, 4);
    }

    #[test]
    fn several_weights_share_one_quantization() {
        if !available() {
            return;
        }
        let k = 256;
        let mut seed = 11;
        let x: Vec<f32> = (0..3 * k).map(|_| lcg(&mut seed)).collect();
        let mk = |ty: GgmlType, rows: usize, seed: &mut u64| {
            let wf: Vec<f32> = (0..rows * k).map(|_| lcg(seed)).collect();
            let mut data = vec![0u8; rows * k / QK * block_bytes(ty)];
            quant::quantize(ty, &wf, k, &mut data);
            data
        };
        let a = mk(GgmlType::Q4_K, 20, &mut seed);
        let b = mk(GgmlType::Q6_K, 33, &mut seed);
        let wa = || KQuantWeight {
            ty: GgmlType::Q4_K,
            rows: 20,
            k,
            data: &a,
        };
        let wb = || KQuantWeight {
            ty: GgmlType::Q6_K,
            rows: 33,
            k,
            data: &b,
        };
        let (mut oa, mut ob) = (vec![0f32; 3 * 20], vec![0f32; 3 * 33]);
        matmul_many(&[wa(), wb()], &x, 3, &mut [&mut oa, &mut ob]);
        let (mut sa, mut sb) = (vec![0f32; 3 * 20], vec![0f32; 3 * 33]);
        matmul_many(&[wa()], &x, 3, &mut [&mut sa]);
        matmul_many(&[wb()], &x, 3, &mut [&mut sb]);
        assert_eq!(oa, sa);
        assert_eq!(ob, sb);
    }
}
