//! The AVX-512 parts of attention's fast path (where the kernel path is AVX-512): the same
//! floats as the AVX2 loops and the portable ones, to the bit, with sixteen lanes.

use std::arch::x86_64::*;

/// Largest head size [`dots`] takes (its transposed queries live on the stack).
pub(super) const MAX_HEAD_DIM: usize = 256;

/// `scores[at[i] + t] = dot(qs[i], keys[slots[t]]) * scale` for up to 16 queries and every
/// key, each the AVX2 loop's value to the bit: its eight lanes are eight chains of fused
/// multiply-adds over the head's chunks of eight, summed lane 0 to 7, then the tail's
/// products added one by one, then scaled. Here the sixteen *queries* sit side by side in a
/// vector (transposed once per call), so those eight chains are eight vectors per key, fed
/// straight from the key's values by broadcast: half the AVX2 loop's multiply-adds and no
/// horizontal sums. Each 16 keys' scores are transposed back in registers and stored a
/// query's run at a time.
///
/// # Safety
///
/// The CPU has AVX-512F; `qs.len() <= 16` and `at.len() == qs.len()`; `hd <= MAX_HEAD_DIM`;
/// each query has at least `hd` values; every slot satisfies `(slot + 1) * hd <= keys.len()`;
/// and `at[i] + slots.len() <= scores.len()` for every `i` (all read and written unchecked).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn dots(
    qs: &[&[f32]],
    at: &[usize],
    keys: &[f32],
    hd: usize,
    slots: &[usize],
    scale: f32,
    scores: &mut [f32],
) {
    let nq = qs.len();
    debug_assert!(nq <= 16 && at.len() == nq && hd <= MAX_HEAD_DIM);
    debug_assert!(at.iter().all(|&a| a + slots.len() <= scores.len()));
    // Only the first `hd` are written and read (zeroing all of it cost as much as a key).
    let mut qt = [const { std::mem::MaybeUninit::<__m512>::uninit() }; MAX_HEAD_DIM];
    // SAFETY: AVX-512F by the attribute; at most 16 queries of at least `hd` values, and
    // `hd <= MAX_HEAD_DIM`, by the caller.
    unsafe { transpose_queries(qs, hd, &mut qt) };
    // SAFETY: `transpose_queries` wrote `qt[..hd]`.
    let qt = unsafe { std::slice::from_raw_parts(qt.as_ptr() as *const __m512, hd) };
    let sc = _mm512_set1_ps(scale);
    let out = scores.as_mut_ptr();
    // SAFETY: called with `slots`' entries only, whose keys lie in `keys` (the caller).
    let key = |slot: usize| unsafe { keys.as_ptr().add(slot.wrapping_mul(hd)) };
    for (c, chunk) in slots.chunks(16).enumerate() {
        let mut tile = [_mm512_setzero_si512(); 16];
        // Two keys at a time: each query vector loaded once for both.
        let mut u = 0;
        while u + 2 <= chunk.len() {
            // SAFETY: AVX-512F by the attribute; each key is `hd` values (`qt.len()`) in `keys`.
            let [a, b] = unsafe { key_scores::<2>(qt, [key(chunk[u]), key(chunk[u + 1])], sc) };
            (tile[u], tile[u + 1]) = (a, b);
            u += 2;
        }
        if u < chunk.len() {
            // SAFETY: as just above.
            tile[u] = unsafe { key_scores::<1>(qt, [key(chunk[u])], sc) }[0];
        }
        let t0 = 16 * c;
        if chunk.len() == 16 {
            crate::model::kquants::transpose16(&mut tile);
            for (i, &a) in at.iter().enumerate() {
                // SAFETY: `a + t0 + 16 <= a + slots.len() <= scores.len()` (a whole chunk; the
                // caller).
                unsafe { _mm512_storeu_ps(out.add(a + t0), _mm512_castsi512_ps(tile[i])) };
            }
        } else {
            let mut buf = [[0f32; 16]; 16];
            for (b, v) in buf.iter_mut().zip(&tile).take(chunk.len()) {
                // SAFETY: `b` holds the 16 values stored.
                unsafe { _mm512_storeu_ps(b.as_mut_ptr(), _mm512_castsi512_ps(*v)) };
            }
            for (i, &a) in at.iter().enumerate() {
                for (u, b) in buf.iter().enumerate().take(chunk.len()) {
                    // SAFETY: `a + t0 + u < a + slots.len() <= scores.len()` (the caller).
                    unsafe { *out.add(a + t0 + u) = b[i] };
                }
            }
        }
    }
}

/// `qt[d]` = dimension `d` of each query (lane `i`: query `i`, zero past the last), for `d`
/// below `hd`: sixteen dimensions at a time by a transpose in registers, the tail one by one.
///
/// # Safety
///
/// The CPU has AVX-512F (this is inlined into [`dots`], which enables it);
/// `hd <= MAX_HEAD_DIM`; each of `qs` (the first 16; [`dots`] passes at most 16) has at least
/// `hd` values, read unchecked.
#[inline(always)]
unsafe fn transpose_queries(
    qs: &[&[f32]],
    hd: usize,
    qt: &mut [std::mem::MaybeUninit<__m512>; MAX_HEAD_DIM],
) {
    // SAFETY: AVX-512F and the queries' lengths by the caller: the loads read `q[d..d + 16]`
    // with `d + 16 <= hd`, and the tail `q[d]` with `d < hd` (`qt[d + i]` is indexed, checked).
    unsafe {
        let n16 = hd / 16 * 16;
        let mut d = 0;
        while d < n16 {
            let mut r = [_mm512_setzero_si512(); 16];
            for (r, q) in r.iter_mut().zip(qs) {
                *r = _mm512_loadu_si512(q.as_ptr().add(d) as *const _);
            }
            crate::model::kquants::transpose16(&mut r);
            for (i, r) in r.iter().enumerate() {
                qt[d + i].write(_mm512_castsi512_ps(*r));
            }
            d += 16;
        }
        let mut lanes = [0f32; 16];
        for (d, v) in qt.iter_mut().enumerate().take(hd).skip(n16) {
            for (l, q) in lanes.iter_mut().zip(qs) {
                *l = *q.get_unchecked(d);
            }
            v.write(_mm512_loadu_ps(lanes.as_ptr()));
        }
    }
}

/// The scores of the transposed queries `qt` against `K` keys, scaled, as [`dots`] says.
///
/// # Safety
///
/// The CPU has AVX-512F (this is inlined into [`dots`], which enables it), and each pointer
/// in `k` is valid for reading `qt.len()` f32s.
#[inline(always)]
unsafe fn key_scores<const K: usize>(
    qt: &[__m512],
    k: [*const f32; K],
    sc: __m512,
) -> [__m512i; K] {
    // SAFETY: AVX-512F by the caller; `d + l < n8 <= hd` and `d < hd` index `qt` (of `hd` vectors)
    // and each key (valid for `hd` values, by the caller).
    unsafe {
        let hd = qt.len();
        let n8 = hd / 8 * 8;
        let mut acc = [[_mm512_setzero_ps(); 8]; K];
        let mut d = 0;
        while d < n8 {
            for l in 0..8 {
                let q = *qt.get_unchecked(d + l);
                for (a, k) in acc.iter_mut().zip(&k) {
                    a[l] = _mm512_fmadd_ps(q, _mm512_set1_ps(*k.add(d + l)), a[l]);
                }
            }
            d += 8;
        }
        std::array::from_fn(|i| {
            // Lane 0 first: the AVX2 loop's sum starts at -0.0, which adds nothing.
            let mut s = acc[i][0];
            for a in &acc[i][1..] {
                s = _mm512_add_ps(s, *a);
            }
            for (d, q) in qt.iter().enumerate().skip(n8) {
                s = _mm512_add_ps(s, _mm512_mul_ps(*q, _mm512_set1_ps(*k[i].add(d))));
            }
            _mm512_castps_si512(_mm512_mul_ps(s, sc))
        })
    }
}

/// [`super::weighted_sum_avx2`] for `G` heads of one token over the same entries at once, with
/// 512-bit vectors: each output element is the same chain of fused multiply-adds over `t` in
/// order from 0, so the same floats to the bit, in half the instructions, and each value
/// entry is loaded once for the `G` heads. 128 elements of each head at a time (masked past
/// `hd`).
///
/// # Safety
///
/// The CPU has AVX-512F; each `out[h]` is valid for writing `hd` f32s, which no one else reads
/// or writes meanwhile; each `ps[h]` has at least `slots.len()` values; every slot satisfies
/// `(slot + 1) * hd <= values.len()` (all read and written unchecked).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn weighted_sum_avx512<const G: usize>(
    ps: [&[f32]; G],
    slots: &[usize],
    values: &[f32],
    hd: usize,
    out: [*mut f32; G],
) {
    // SAFETY: our caller's guarantees, which are this one's.
    unsafe { weighted_sum_avx512_from(ps, slots, values, hd, out, false) }
}

/// [`weighted_sum_avx512`], each chain starting from `out`'s values when `from_out` (a sum
/// continued over the next slots: the same floats as one sum over all of them, in order).
///
/// # Safety
///
/// As [`weighted_sum_avx512`]'s (each `out[h]` valid for reading `hd` f32s too).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn weighted_sum_avx512_from<const G: usize>(
    ps: [&[f32]; G],
    slots: &[usize],
    values: &[f32],
    hd: usize,
    out: [*mut f32; G],
    from_out: bool,
) {
    const W: usize = 8;
    debug_assert!(slots.iter().all(|&s| (s + 1) * hd <= values.len()));
    let base = values.as_ptr();
    let mut d0 = 0;
    while d0 < hd {
        let mask = |i: usize| -> __mmask16 {
            let left = hd.saturating_sub(d0 + 16 * i).min(16);
            ((1u32 << left) - 1) as __mmask16
        };
        let masks: [__mmask16; W] = std::array::from_fn(mask);
        let acc0 = |h: usize, i: usize| match from_out {
            // SAFETY: as the stores below: only lanes below `hd`, inside `out[h]` (the caller).
            true => unsafe { _mm512_maskz_loadu_ps(masks[i], out[h].wrapping_add(d0 + 16 * i)) },
            false => _mm512_setzero_ps(),
        };
        let mut acc: [[__m512; W]; G] =
            std::array::from_fn(|h| std::array::from_fn(|i| acc0(h, i)));
        for (t, &slot) in slots.iter().enumerate() {
            // SAFETY: `d0 < hd`: inside `slot`'s entry of `values` (the caller).
            let v = unsafe { base.add(slot.wrapping_mul(hd).wrapping_add(d0)) };
            // SAFETY: `t < slots.len() <= ps[h].len()` (the caller).
            let p: [__m512; G] =
                std::array::from_fn(|h| _mm512_set1_ps(unsafe { *ps[h].get_unchecked(t) }));
            for i in 0..W {
                // SAFETY: the mask's lanes are the entry's values `d0 + 16 * i..hd`, at most
                // 16 of them: only those are read (masked-off lanes never fault); the address
                // is computed with wrapping arithmetic, as it may pass the end of `values`
                // when no lane is read.
                let x = unsafe { _mm512_maskz_loadu_ps(masks[i], v.wrapping_add(16 * i)) };
                for h in 0..G {
                    acc[h][i] = _mm512_fmadd_ps(p[h], x, acc[h][i]);
                }
            }
        }
        for h in 0..G {
            for i in 0..W {
                // SAFETY: as the loads: only lanes below `hd` are written, inside `out[h]`'s
                // `hd` values (the caller).
                unsafe {
                    _mm512_mask_storeu_ps(out[h].wrapping_add(d0 + 16 * i), masks[i], acc[h][i])
                };
            }
        }
        d0 += 16 * W;
    }
}
