//! Activations quantized for the kernels: blocks of 256 values to i8 with one scale
//! ([`Q8K`], ggml's Q8_K), stored in the order the packed weights read them.
//!
//! Quantizing runs once per product over every activation row, so for a batch of tokens it is
//! as much work per token as a small matrix: on x86 it is vectorized (AVX2, which every x86
//! kernel path has), giving exactly the scalar code's bytes and floats (tested).

use super::QK;

/// One block of 256 activations quantized to i8 with one f32 scale, and sums of each 16
/// (for the weights' minimum/offset terms). `qs` is stored in Q4_K's nibble order: per 128
/// values, `[0..32, 64..96, 32..64, 96..128]`, so a 64-byte load pairs with a 64-byte run
/// of Q4_K quants' low (or high) nibbles. `bsums` keep the natural order.
#[repr(C, align(64))]
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct Q8K {
    pub(super) qs: [i8; QK],
    pub(super) bsums: [i16; QK / 16],
    /// `bsums` summed in pairs (per 32 values) as f32, for Q4_K's and Q8_0's offsets.
    pub(super) fsum32: [f32; QK / 32],
    /// Minus 32 times the sum of each stored 16-value chunk: where Q6_K's integer sums start,
    /// which takes its values' offset of 32 off exactly.
    pub(super) q6k_start: [i32; QK / 16],
    /// The same per i16 lane, for the AVX2 Q6_K kernel's sums (two i16 in each i32, as
    /// `vpmaddubsw` pairs them): minus 32 times the chunk's values 0, 1 of each four (low
    /// half) and 2, 3 (high half). Each is at most 32 x 8 x 127 = 32512 in magnitude. Zero
    /// off x86, where no kernel reads them.
    pub(super) q6k_lanes: [i32; QK / 16],
    /// Minus 128 times the sum of each stored 32-value chunk: where the AVX-512 Q8_0 kernel's
    /// integer sums start, which takes the weights' offset of 128 off exactly.
    pub(super) q8_0_start: [i32; QK / 32],
    pub(super) d: f32,
}

impl Q8K {
    pub(super) const ZERO: Q8K = Q8K {
        qs: [0; QK],
        bsums: [0; QK / 16],
        fsum32: [0.0; QK / 32],
        q6k_start: [0; QK / 16],
        q6k_lanes: [0; QK / 16],
        q8_0_start: [0; QK / 32],
        d: 0.0,
    };
}

/// Where value `i` (natural order) of a block is stored in [`Q8K::qs`].
#[inline(always)]
pub(super) const fn stored_at(i: usize) -> usize {
    let half = i / 128 * 128;
    let j = i % 128;
    // [0..32) -> [0..32), [32..64) -> [64..96), [64..96) -> [32..64), [96..128) stay.
    half + match j / 32 {
        1 => j + 32,
        2 => j - 32,
        _ => j,
    }
}

/// Rounds to the nearest integer (ties to even) for |f| < 2^22, without a libm call, so
/// the loop vectorizes (ggml's trick).
#[inline(always)]
fn nearest_int(f: f32) -> i32 {
    let v = f + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Quantizes one block as ggml's Q8_K does (round to nearest, scale from the signed maximum:
/// the first value of the largest magnitude).
fn quantize_block_scalar(x: &[f32], out: &mut Q8K) {
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
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (s, chunk) in out.bsums.iter_mut().zip(q.chunks_exact(16)) {
        *s = chunk.iter().map(|&v| v as i16).sum();
    }
    for (i, &v) in q.iter().enumerate() {
        out.qs[stored_at(i)] = v;
    }
    finish(out, iscale);
}

/// The float sums and the scale, from `bsums` and `iscale`.
#[inline(always)]
fn finish(out: &mut Q8K, iscale: f32) {
    for (f, b) in out.fsum32.iter_mut().zip(out.bsums.chunks_exact(2)) {
        *f = (b[0] + b[1]) as f32;
    }
    for (s, &b) in out.bsums.iter().enumerate() {
        out.q6k_start[stored_at(16 * s) / 16] = -32 * b as i32;
    }
    // Only the x86 AVX2 kernels read them.
    #[cfg(target_arch = "x86_64")]
    for (lanes, q) in out.q6k_lanes.iter_mut().zip(out.qs.chunks_exact(16)) {
        let pair = |j: usize| -> i32 { (0..4).map(|i| q[4 * i + j] as i32).sum() };
        let lo = (-32 * (pair(0) + pair(1))) as i16 as u16 as u32;
        let hi = (-32 * (pair(2) + pair(3))) as i16 as u16 as u32;
        *lanes = (lo | hi << 16) as i32;
    }
    for c in 0..QK / 32 {
        out.q8_0_start[c] = -128 * out.fsum32[stored_at(32 * c) / 32] as i32;
    }
    out.d = 1.0 / iscale;
}

/// Quantizes one block, vectorized where the CPU allows.
#[inline]
fn quantize_block(x: &[f32], out: &mut Q8K) {
    #[cfg(target_arch = "x86_64")]
    if super::path() != super::CpuPath::Generic {
        // SAFETY: every x86 kernel path needs AVX2 (checked when the path was chosen).
        unsafe { x86::quantize_block(x, out) };
        return;
    }
    quantize_block_scalar(x, out)
}

/// Quantizes `m` rows of `k` activations (`k` a multiple of 256) into `out`.
pub(super) fn quantize_rows(x: &[f32], k: usize, out: &mut Vec<Q8K>) {
    let kb = k / QK;
    // Every block is written whole below: only blocks beyond the last call's are zeroed (a
    // clear first was a memset of every block, 2% of a card-setting decode's time).
    out.resize(x.len() / k * kb, Q8K::ZERO);
    let n = out.len();
    // Many rows (a batch of requests) are quantized on every core: each block on its own, so
    // a row's blocks are the same however the rows are split.
    if n >= PARALLEL_QUANTIZE_BLOCKS {
        struct Out(*mut Q8K);
        // SAFETY: each task writes only the blocks of its own range.
        unsafe impl Sync for Out {}
        let dst = Out(out.as_mut_ptr());
        crate::model::pool::WorkerPool::global().execute_chunked(n, |range| {
            let dst = &dst;
            for b in range {
                // SAFETY: `b < n`, and no other task writes block `b`.
                let q = unsafe { &mut *dst.0.add(b) };
                quantize_block(&x[b * QK..(b + 1) * QK], q);
            }
        });
        return;
    }
    for (x, q) in x.chunks_exact(QK).zip(out.iter_mut()) {
        quantize_block(x, q);
    }
}

/// Activation blocks from which quantizing them is spread over the cores.
const PARALLEL_QUANTIZE_BLOCKS: usize = 256;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{finish, Q8K, QK};
    use std::arch::x86_64::*;

    /// [`super::quantize_block_scalar`] with AVX2: the same float operations on each value
    /// (a product, then the rounding add; no fused multiply-add), so the same bytes.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 (`x.len() == 256` is asserted).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_block(x: &[f32], out: &mut Q8K) {
        assert!(x.len() == QK);
        let p = x.as_ptr();
        let sign = _mm256_set1_ps(-0.0);
        // The largest magnitude (NaNs skipped, as the scalar `>` does).
        let mut amax = _mm256_setzero_ps();
        for i in (0..QK).step_by(8) {
            // SAFETY: `i + 8 <= 256 == x.len()`.
            let a = _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(p.add(i)) });
            amax = _mm256_max_ps(a, amax);
        }
        // SAFETY: AVX2, as here.
        let amax = unsafe { hmax(amax) };
        if amax == 0.0 {
            *out = Q8K::ZERO;
            return;
        }
        // The first value of that magnitude, with its sign.
        let target = _mm256_set1_ps(amax);
        let mut max = 0.0;
        for i in (0..QK).step_by(8) {
            // SAFETY: `i + 8 <= 256 == x.len()`.
            let a = _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(p.add(i)) });
            let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(a, target));
            if hit != 0 {
                max = x[i + hit.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0 / max;
        let vscale = _mm256_set1_ps(iscale);
        let magic = _mm256_set1_ps(12_582_912.0);
        let mant = _mm256_set1_epi32(0x007f_ffff);
        let bias = _mm256_set1_epi32(0x0040_0000);
        let top = _mm256_set1_epi32(127);
        let round = |v: __m256| {
            let r = _mm256_add_ps(_mm256_mul_ps(v, vscale), magic);
            let i = _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(r), mant), bias);
            _mm256_min_epi32(i, top)
        };
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let flip = _mm256_set1_epi8(-128);
        let zero = _mm256_setzero_si256();
        let qs = out.qs.as_mut_ptr();
        // 32 values at a time: natural chunk `c` of each 128 goes to `stored_at`'s place.
        for c in 0..QK / 32 {
            // SAFETY: `j < 4`, so `32 * c + 8 * j + 8 <= 256 == x.len()`.
            let at = |j: usize| round(unsafe { _mm256_loadu_ps(p.add(32 * c + 8 * j)) });
            let ab = _mm256_packs_epi32(at(0), at(1));
            let cd = _mm256_packs_epi32(at(2), at(3));
            let q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
            let dst = super::stored_at(32 * c);
            // SAFETY: `dst + 32 <= 256`, the length of `out.qs`.
            unsafe { _mm256_storeu_si256(qs.add(dst) as *mut __m256i, q) };
            // Sums of each 8 (offset by 128 to be unsigned), then of each 16.
            let s = _mm256_sad_epu8(_mm256_xor_si256(q, flip), zero);
            let mut l = [0i64; 4];
            // SAFETY: `l` is 32 bytes.
            unsafe { _mm256_storeu_si256(l.as_mut_ptr() as *mut __m256i, s) };
            out.bsums[2 * c] = (l[0] + l[1] - 16 * 128) as i16;
            out.bsums[2 * c + 1] = (l[2] + l[3] - 16 * 128) as i16;
        }
        finish(out, iscale);
    }

    /// The largest of `v`'s eight lanes.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
        _mm_cvtss_f32(m)
    }

    #[cfg(test)]
    mod tests {
        use super::super::{quantize_block_scalar, Q8K, QK};

        fn check(x: &[f32]) {
            if !is_x86_feature_detected!("avx2") {
                return;
            }
            let (mut a, mut b) = (Q8K::ZERO, Q8K::ZERO);
            quantize_block_scalar(x, &mut a);
            // SAFETY: AVX2 checked above.
            unsafe { super::quantize_block(x, &mut b) };
            assert_eq!(a.qs, b.qs);
            assert_eq!(a.bsums, b.bsums);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.fsum32), bits(&b.fsum32));
            assert_eq!(a.q6k_start, b.q6k_start);
            assert_eq!(a.q6k_lanes, b.q6k_lanes);
            assert_eq!(a.q8_0_start, b.q8_0_start);
            assert_eq!(a.d.to_bits(), b.d.to_bits());
        }

        #[test]
        fn the_vector_quantizer_gives_the_scalar_bytes() {
            let mut seed = 11u64;
            let mut rand = || {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            };
            for scale in [1e-30f32, 1e-3, 1.0, 7.5, 3e4] {
                for _ in 0..200 {
                    let x: Vec<f32> = (0..QK).map(|_| rand() * scale).collect();
                    check(&x);
                }
            }
            // Zeros; a tie in magnitude with opposite signs (the first wins); values that
            // round to exact halves; a NaN among them (skipped by the maximum).
            check(&[0.0; QK]);
            let mut x: Vec<f32> = (0..QK).map(|i| (i as f32 - 128.0) / 10.0).collect();
            x[3] = 13.0;
            x[200] = -13.0;
            check(&x);
            x[3] = -13.0;
            x[200] = 13.0;
            check(&x);
            let halves: Vec<f32> = (0..QK).map(|i| (i as f32 - 127.0) * 0.5).collect();
            check(&halves);
            let mut nan = halves.clone();
            nan[17] = f32::NAN;
            check(&nan);
        }
    }
}
