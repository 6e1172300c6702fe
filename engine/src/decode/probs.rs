//! A row of logits read as the reference reads it: the arg-max token, and a token's softmax
//! probability (torch's `softmax(logits.float())[i]`); and, for `logprobs`, a token's
//! log-probability with the row's most likely alternatives ([`logprob`]).
//!
//! Each is a pass over the whole vocabulary (151 671 values for ReFusion), and a decode reads
//! dozens of rows per forward: the scalar loop (libm's `expf` per value, one sum in order)
//! cost more than a tenth of a many-request forward. Here `exp` is our own
//! ([`crate::model::expf`], within 2 ulp, plain multiplies and adds) and the sum runs in 16
//! lanes folded in a fixed tree, so the compiler vectorizes both and every CPU gives the same
//! floats. torch's own CPU softmax also takes a vectorized `exp` and a lane-wise sum: these are
//! as close to the reference as a libm `expf` summed in order (the goldens pass either way;
//! where the two could disagree, a probability would sit within 1e-6 of a threshold).

use crate::model::expf::{exp_nonpositive, fold_lanes, LANES};

/// The largest value (NaNs skipped), in lanes.
#[inline(always)]
fn max_of(v: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = v.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    let mut m = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for &l in &lanes {
        m = m.max(l);
    }
    m
}

/// `sum_i exp(v[i] - max)`: 16 lanes, the tail into the first lanes, then folded in halves.
#[inline(always)]
fn exp_sum(v: &[f32], max: f32) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut chunks = v.chunks_exact(LANES);
    for c in &mut chunks {
        for (s, &x) in lanes.iter_mut().zip(c) {
            *s += exp_nonpositive(x - max);
        }
    }
    for (s, &x) in lanes.iter_mut().zip(chunks.remainder()) {
        *s += exp_nonpositive(x - max);
    }
    fold_lanes(&mut lanes)
}

/// The row's maximum and its softmax denominator.
fn max_and_sum(v: &[f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        /// # Safety
        ///
        /// The CPU has AVX2 (any `v` is fine).
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(v: &[f32]) -> (f32, f32) {
            let max = max_of(v);
            (max, exp_sum(v, max))
        }
        // SAFETY: AVX2 checked just above. Only wider vectors: the same operations on each
        // value, so the same floats as below.
        return unsafe { avx2(v) };
    }
    let max = max_of(v);
    (max, exp_sum(v, max))
}

/// Index of the largest value (the first one on ties, as torch.argmax); 0 for an empty row
/// or one of NaNs.
pub fn argmax(v: &[f32]) -> usize {
    let max = row_max(v);
    v.iter().position(|&x| x == max).unwrap_or(0)
}

/// [`max_of`], vectorized where the CPU allows.
fn row_max(v: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        /// # Safety
        ///
        /// The CPU has AVX2 (any `v` is fine).
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(v: &[f32]) -> f32 {
            max_of(v)
        }
        // SAFETY: AVX2 checked just above.
        return unsafe { avx2(v) };
    }
    max_of(v)
}

/// softmax(v)[i] in f32.
pub fn prob(v: &[f32], i: usize) -> f32 {
    let (max, sum) = max_and_sum(v);
    exp_nonpositive(v[i] - max) / sum
}

/// The most alternatives a token's [`TokenLogprob`] lists (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// A committed token's log-probability under the distribution it was committed from, and that
/// distribution's most likely tokens (most likely first, the lower id first on ties).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// `log softmax(v)[token]` (torch's `log_softmax(logits.float())`: `v - max - ln(sum)`, the
/// sum as [`prob`] takes it) and the `top` most likely tokens of `v` with theirs.
pub fn logprob(v: &[f32], token: usize, top: usize) -> TokenLogprob {
    let (max, sum) = max_and_sum(v);
    let norm = max + sum.ln();
    let lp = |i: usize| v[i] - norm;
    TokenLogprob {
        token: token as u32,
        logprob: lp(token),
        top: top_indices(v, top)
            .into_iter()
            .map(|i| (i as u32, lp(i)))
            .collect(),
    }
}

/// The indices of the `n` largest values, largest first (the lower index first on ties; never
/// a NaN, nor minus infinity: a token a grammar forbids is no alternative). One pass, the few
/// best kept sorted: `n` is at most [`MAX_TOP_LOGPROBS`].
fn top_indices(v: &[f32], n: usize) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
    for (i, &x) in v.iter().enumerate() {
        if x.is_nan() || x == f32::NEG_INFINITY || (best.len() == n && x <= v[best[n - 1]]) {
            continue;
        }
        // After every kept value at least as large: ties keep the earlier index first.
        let at = best.partition_point(|&b| v[b] >= x);
        best.insert(at, i);
        best.truncate(n);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_match_a_softmax_in_f64() {
        let mut s = 5u64;
        for n in [1usize, 7, 16, 17, 1000, 151_671] {
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((s >> 40) as f32 / (1u64 << 24) as f32) * 30.0 - 15.0
                })
                .collect();
            let max = v.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let sum: f64 = v.iter().map(|&x| (x as f64 - max).exp()).sum();
            for i in [0, n / 2, n - 1, argmax(&v)] {
                let want = (v[i] as f64 - max).exp() / sum;
                let got = prob(&v, i) as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * want + 1e-30,
                    "n {n} i {i}: {got} vs {want}"
                );
            }
            let first = v
                .iter()
                .enumerate()
                .fold(0, |b, (j, &x)| if x > v[b] { j } else { b });
            assert_eq!(argmax(&v), first);
        }
    }

    #[test]
    fn argmax_takes_the_first_of_equal_values() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, 2.0, 5.0, f32::NAN]), 2);
    }

    #[test]
    fn log_probabilities_match_a_log_softmax_in_f64_with_the_best_alternatives() {
        let v = [1.0f32, 3.0, -2.0, 3.0, 0.5, -9.0, 2.5];
        let max = 3.0f64;
        let norm = max + v.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        let got = logprob(&v, 4, 3);
        assert_eq!(got.token, 4);
        assert!((got.logprob as f64 - (0.5 - norm)).abs() < 1e-5, "{got:?}");
        let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 6], "largest first, the lower id first on ties");
        assert!((got.top[2].1 as f64 - (2.5 - norm)).abs() < 1e-5);
        assert!(logprob(&v, 0, 0).top.is_empty());
        assert_eq!(logprob(&v, 0, 20).top.len(), v.len());
        assert_eq!(top_indices(&[f32::NAN, 1.0, f32::NAN, 2.0], 3), [3, 1]);
        assert_eq!(
            top_indices(&[f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY], 3),
            [1]
        );
    }
}
