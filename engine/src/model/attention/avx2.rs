//! Tiles of attention's AVX2 fast path that share their loads between queries and keys: the
//! same floats as [`dots_avx2`](super::dots_avx2) and
//! [`weighted_sum_avx2_from`](super::weighted_sum_avx2_from), to the bit.
//!
//! Over a context of thousands of entries these two are nearly all of a forward's attention.
//! One query against one key at a time, each 8 values loaded were used for 8 multiply-adds
//! (the loads, and on long contexts the L2 cache behind them, set the pace), and each score
//! ended with a horizontal sum of its eight lanes, which cost as much again for a 128-value
//! head. Here a tile of `QN` queries by `KN` keys keeps `QN * KN = 8` accumulators, so `QN +
//! KN` loads feed 8 multiply-adds (6 for 4 x 2 or 2 x 4), and its eight scores are summed
//! together: the accumulators transposed in registers, then added lane 0 to 7 as vectors, the
//! very order of the scalar sum. The weighted sums take the values of 16 dimensions once for up
//! to [`SUM_QUERIES`] queries.

use std::arch::x86_64::*;

/// Queries whose weighted sums share one read of the values (12 accumulators in registers).
pub(super) const SUM_QUERIES: usize = 6;

/// `put(qi, t, dot(qs[qi], key t) * scale)` for every query and every key `t` (row `slots[t]`
/// of `keys`, `hd` values each), each [`dots_avx2`](super::dots_avx2)'s value to the bit:
/// eight chains of fused multiply-adds over the chunks of eight, lanes summed 0 to 7, the
/// tail's products added one by one, then scaled. Tiles of 4 queries by 2 keys, 2 by 4 where
/// fewer than four queries are left, 1 by 8 for the last one; keys left over by a tile's width
/// go one at a time.
///
/// # Safety
///
/// The CPU has AVX2 and FMA; each query has at least `hd` values; every slot satisfies
/// `(slot + 1) * hd <= keys.len()` (the vector loads are unchecked).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores(
    qs: &[&[f32]],
    keys: &[f32],
    slots: &[usize],
    hd: usize,
    scale: f32,
    mut put: impl FnMut(usize, usize, f32),
) {
    debug_assert!(qs.iter().all(|q| q.len() >= hd));
    debug_assert!(slots.iter().all(|&s| (s + 1) * hd <= keys.len()));
    let key = |t: usize| &keys[slots[t] * hd..][..hd];
    let mut q0 = 0;
    while q0 < qs.len() {
        let left = qs.len() - q0;
        let qn = if left >= 4 {
            4
        } else if left >= 2 {
            2
        } else {
            1
        };
        let kn = 8 / qn;
        let tile_qs = &qs[q0..q0 + qn];
        let mut t = 0;
        while t + kn <= slots.len() {
            let mut put_tile = |i: usize, v: f32| put(q0 + i / kn, t + i % kn, v);
            // SAFETY: AVX2 and FMA, the queries' lengths by our caller; `qn` queries and `kn`
            // keys of `hd` values, as each arm's `QN` and `KN` ask.
            unsafe {
                match qn {
                    4 => tile::<4, 2>(tile_qs, |j| key(t + j), scale, &mut put_tile),
                    2 => tile::<2, 4>(tile_qs, |j| key(t + j), scale, &mut put_tile),
                    _ => tile::<1, 8>(tile_qs, |j| key(t + j), scale, &mut put_tile),
                }
            }
            t += kn;
        }
        for t in t..slots.len() {
            // SAFETY: as above; one key.
            unsafe { super::dots_avx2(tile_qs, key(t), scale, |i, v| put(q0 + i, t, v)) };
        }
        q0 += qn;
    }
}

/// One tile of [`scores`]: `QN` queries by `KN` keys (`key(j)`, `QN * KN == 8`), `put(i,
/// score)` for query `i / KN` and key `i % KN`.
///
/// # Safety
///
/// The CPU has AVX2 and FMA; `qs.len() == QN`, and every query has at least `hd` values, the
/// length of each key (the first `hd / 8 * 8` are read unchecked).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<'k, const QN: usize, const KN: usize>(
    qs: &[&[f32]],
    key: impl Fn(usize) -> &'k [f32],
    scale: f32,
    put: &mut impl FnMut(usize, f32),
) {
    debug_assert!(QN * KN == 8 && qs.len() == QN);
    let ks: [&[f32]; KN] = std::array::from_fn(key);
    let hd = ks[0].len();
    let n8 = hd / 8 * 8;
    let q: [*const f32; QN] = std::array::from_fn(|i| qs[i].as_ptr());
    let k: [*const f32; KN] = std::array::from_fn(|j| ks[j].as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut d = 0;
    while d < n8 {
        // SAFETY: `d + 8 <= n8 <= hd`: inside every key and every query (our caller).
        unsafe {
            let kv: [__m256; KN] = std::array::from_fn(|j| _mm256_loadu_ps(k[j].add(d)));
            for i in 0..QN {
                let qv = _mm256_loadu_ps(q[i].add(d));
                for j in 0..KN {
                    acc[i * KN + j] = _mm256_fmadd_ps(qv, kv[j], acc[i * KN + j]);
                }
            }
        }
        d += 8;
    }
    let mut sums = [0f32; 8];
    // SAFETY: `sums` holds the 8 values stored.
    unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), lane_sums(acc)) };
    for (i, s) in sums.iter_mut().enumerate() {
        let (qi, kj) = (i / KN, i % KN);
        for (x, y) in qs[qi][n8..hd].iter().zip(&ks[kj][n8..hd]) {
            *s += x * y;
        }
        put(i, *s * scale);
    }
}

/// Lane `i` of the result: the sum of `acc[i]`'s eight lanes, added 0 to 7 (as
/// `lanes.iter().sum::<f32>()`), to the bit: the eight vectors transposed, then added in turn.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn lane_sums(acc: [__m256; 8]) -> __m256 {
    let [r0, r1, r2, r3, r4, r5, r6, r7] = acc;
    let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
    let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
    let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
    let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
    // Within each 128-bit half: (lane l of r0, r1, r2, r3) for l = 0..4 of that half.
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    // `lane[l]`: lane `l` of r0..r7.
    let lane = [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ];
    // (Rust's float sum starts from -0.0, which adds exactly: from lane 0 is the same.)
    lane[1..].iter().fold(lane[0], |s, &l| _mm256_add_ps(s, l))
}

/// `outs[i] (+)= sum over t of ps[i][t] * values[slots[t]]` for `Q` queries over the same
/// slots, each element's chain of fused multiply-adds in `t` order from 0 (or from `outs[i]`'s
/// values when `from_out`), as [`weighted_sum_avx2_from`](super::weighted_sum_avx2_from)
/// gives it, to the bit; 16 dimensions at a time, each value row's 16 loaded once for all `Q`.
///
/// # Safety
///
/// The CPU has AVX2 and FMA; `Q <= SUM_QUERIES`; each `outs[i]` points at `hd` values this
/// thread alone writes; each `ps[i]` has `slots.len()` values; every slot satisfies
/// `(slot + 1) * hd <= values.len()` (loads and stores are unchecked).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn weighted_sums<const Q: usize>(
    ps: [&[f32]; Q],
    slots: &[usize],
    values: &[f32],
    hd: usize,
    outs: [*mut f32; Q],
    from_out: bool,
) {
    debug_assert!(Q <= SUM_QUERIES && ps.iter().all(|p| p.len() == slots.len()));
    let n8 = hd / 8 * 8;
    // SAFETY (the loads of `outs` in `start`): `at + 8 <= n8 <= hd`, inside each output.
    let start = |i: usize, at: usize| match from_out {
        true => unsafe { _mm256_loadu_ps(outs[i].add(at)) },
        false => _mm256_setzero_ps(),
    };
    let mut d0 = 0;
    while d0 + 16 <= n8 {
        let mut acc: [[__m256; 2]; Q] = std::array::from_fn(|i| [start(i, d0), start(i, d0 + 8)]);
        for (t, &slot) in slots.iter().enumerate() {
            // SAFETY: `d0 + 16 <= n8 <= hd`: inside `slot`'s entry (our caller).
            let (v0, v1) = unsafe {
                let v = values.as_ptr().add(slot * hd + d0);
                (_mm256_loadu_ps(v), _mm256_loadu_ps(v.add(8)))
            };
            for (a, p) in acc.iter_mut().zip(&ps) {
                let pv = _mm256_set1_ps(p[t]);
                a[0] = _mm256_fmadd_ps(pv, v0, a[0]);
                a[1] = _mm256_fmadd_ps(pv, v1, a[1]);
            }
        }
        for (a, &o) in acc.iter().zip(&outs) {
            // SAFETY: `d0 + 16 <= hd`: inside the output (our caller).
            unsafe {
                _mm256_storeu_ps(o.add(d0), a[0]);
                _mm256_storeu_ps(o.add(d0 + 8), a[1]);
            }
        }
        d0 += 16;
    }
    if d0 < n8 {
        let mut acc: [__m256; Q] = std::array::from_fn(|i| start(i, d0));
        for (t, &slot) in slots.iter().enumerate() {
            // SAFETY: `d0 + 8 <= n8 <= hd`: inside `slot`'s entry (our caller).
            let v = unsafe { _mm256_loadu_ps(values.as_ptr().add(slot * hd + d0)) };
            for (a, p) in acc.iter_mut().zip(&ps) {
                *a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), v, *a);
            }
        }
        for (a, &o) in acc.iter().zip(&outs) {
            // SAFETY: `d0 + 8 <= hd`: inside the output (our caller).
            unsafe { _mm256_storeu_ps(o.add(d0), *a) };
        }
    }
    for d in n8..hd {
        for (p, &o) in ps.iter().zip(&outs) {
            // SAFETY: `d < hd`: inside the output (our caller).
            let o = unsafe { &mut *o.add(d) };
            let mut a = if from_out { *o } else { 0f32 };
            for (&pt, &slot) in p.iter().zip(slots) {
                a = pt.mul_add(values[slot * hd + d], a);
            }
            *o = a;
        }
    }
}

/// [`weighted_sums`] for any number of queries, [`SUM_QUERIES`] at a time: query `i`'s
/// probabilities `ps(i)` and output `out(i)`.
///
/// # Safety
///
/// As [`weighted_sums`]'s, for each of the `n` queries.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn weighted_sums_all<'p>(
    n: usize,
    ps: impl Fn(usize) -> &'p [f32],
    slots: &[usize],
    values: &[f32],
    hd: usize,
    out: impl Fn(usize) -> *mut f32,
    from_out: bool,
) {
    let mut i = 0;
    while i < n {
        let m = (n - i).min(SUM_QUERIES);
        macro_rules! run {
            ($q:literal) => {
                // SAFETY: our caller's guarantees, for queries `i..i + $q`.
                unsafe {
                    weighted_sums::<$q>(
                        std::array::from_fn(|j| ps(i + j)),
                        slots,
                        values,
                        hd,
                        std::array::from_fn(|j| out(i + j)),
                        from_out,
                    )
                }
            };
        }
        match m {
            6 => run!(6),
            5 => run!(5),
            4 => run!(4),
            3 => run!(3),
            2 => run!(2),
            _ => run!(1),
        }
        i += m;
    }
}
