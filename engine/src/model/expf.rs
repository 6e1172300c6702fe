//! `exp` for softmaxes: the decoder's probabilities over the vocabulary and attention's
//! weights over the cache both take `exp(x - max)`, so only `x <= 0` matters. Our own (a
//! Cody-Waite reduction and a degree-6 polynomial in plain multiplies and adds, within 2 ulp
//! of the true value, no fused multiply-add): libm's `expf` is a call per value that the
//! compiler cannot vectorize; this one vectorizes wherever it is inlined and gives the same
//! floats on every CPU.

/// Lanes of the partial sums (a fixed count, so the order does not depend on the CPU).
pub const LANES: usize = 16;

/// `exp(x)` for `x <= 0` (a logit or a score minus its row's maximum); 0 below -87 (where `exp` leaves
/// the normal floats; the maximum's own term is 1, so these never count) and for NaN.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n * LN2_HI is exact for |n| < 2^15.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer.
                                     // The test is written so that NaN fails it too.
    let ok = x >= -87.0;
    let x = if ok { x } else { -87.0 };
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let e = (p * (r * r) + r) + 1.0;
    // 2^n for n in -126..=0, from its bits: n + 127 lands in the low mantissa bits of
    // 2^23 + n + 127 (exact), which then become the exponent field.
    let biased = (n + 8_388_735.0).to_bits().wrapping_sub(0x4b00_0000);
    let scale = f32::from_bits(biased << 23);
    if ok {
        e * scale
    } else {
        0.0
    }
}

/// Folds `lanes` in halves (`lanes[i] += lanes[i + width]`, width 8, 4, 2, 1): a fixed tree,
/// so the sum does not depend on the CPU.
#[inline(always)]
pub fn fold_lanes(lanes: &mut [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// Each `v[i]` becomes `exp(v[i] - max)` (`max` at least every value); returns their sum, in
/// [`LANES`] lanes (the tail into the first lanes), folded by [`fold_lanes`].
#[inline(always)]
pub fn exp_in_place(v: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut chunks = v.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (s, x) in lanes.iter_mut().zip(c) {
            *x = exp_nonpositive(*x - max);
            *s += *x;
        }
    }
    for (s, x) in lanes.iter_mut().zip(chunks.into_remainder()) {
        *x = exp_nonpositive(*x - max);
        *s += *x;
    }
    fold_lanes(&mut lanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_the_true_value() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let got = exp_nonpositive(x) as f64;
            let want = (x as f64).exp();
            let ulp = (want as f32).to_bits();
            let ulp = (f32::from_bits(ulp + 1) - f32::from_bits(ulp)) as f64;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.000_731;
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-88.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(f32::NAN), 0.0);
    }

    #[test]
    fn exp_in_place_sums_what_it_writes() {
        for n in [1usize, 5, 16, 17, 40] {
            let mut v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
            let max = v.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let want: Vec<f64> = v.iter().map(|&x| (x as f64 - max as f64).exp()).collect();
            let sum = exp_in_place(&mut v, max);
            for (got, want) in v.iter().zip(&want) {
                assert!(
                    (*got as f64 - want).abs() <= 1.5e-6 * want,
                    "{got} vs {want}"
                );
            }
            let total: f64 = want.iter().sum();
            assert!(
                (sum as f64 - total).abs() <= 1e-6 * total,
                "n {n}: {sum} vs {total}"
            );
        }
    }
}
