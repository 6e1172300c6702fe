//! Scale searches shared by the k-quants.
//!
//! These follow the searches of ggml's reference quantizers (the ones llama-quantize uses
//! without an importance matrix), so that our k-quants start from the same scales; the
//! k-quant encoders then refine the *quantized* scales, which the reference does not.

/// Round half to even, as ggml's `nearest_int` does, for |x| < 2^22 (larger inputs saturate
/// there; every caller clamps the level to a few bits anyway).
///
/// Adding 1.5 * 2^23 leaves the rounded integer in the low mantissa bits. This is what ggml
/// does, and unlike `round_ties_even` it needs no libm call on baseline x86-64 (no SSE4.1), so
/// the scale-search loops vectorize.
#[inline(always)]
pub fn nearest(x: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0;
    let v = x.clamp(-4_194_303.0, 4_194_303.0) + MAGIC;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Below this a group is treated as all zeros.
pub const GROUP_EPS: f32 = 1e-15;

/// Best affine fit `x ≈ scale * l - min_neg` with `l` in `0..=nmax`, by weighted least squares
/// over a sweep of candidate inverse scales `(nmax + rmin + rdelta * i) / (max - min)`.
/// Returns `(scale, -min)`; the offset is never positive (the group minimum is clamped to 0),
/// as the k-quant formats store it as an unsigned subtrahend.
pub fn affine_fit(
    x: &[f32],
    weights: &[f32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: usize,
    use_abs_error: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut lo = x[0];
    let mut hi = x[0];
    let mut sum_w = 0f32;
    let mut sum_x = 0f32;
    for (&v, &w) in x.iter().zip(weights) {
        lo = lo.min(v);
        hi = hi.max(v);
        sum_w += w;
        sum_x += w * v;
    }
    if lo > 0.0 {
        lo = 0.0;
    }
    if hi == lo {
        return (0.0, -lo);
    }
    let err_of = |d: f32| if use_abs_error { d.abs() } else { d * d };

    let mut iscale = nmax as f32 / (hi - lo);
    let mut scale = 1.0 / iscale;
    let mut min = lo;
    let mut best = 0f32;
    for (&v, &w) in x.iter().zip(weights) {
        let l = nearest(iscale * (v - lo)).clamp(0, nmax);
        best += w * err_of(scale * l as f32 + lo - v);
    }
    let mut levels = [0f32; 32];
    let mut previous = [-1f32; 32];
    debug_assert!(n <= levels.len());
    let (levels, previous) = (&mut levels[..n], &mut previous[..n]);
    // Each candidate is anchored at the best offset found so far (not the group minimum):
    // the sweep walks from the current best fit, as ggml's search does.
    for step in 0..=nstep {
        iscale = (rmin + rdelta * step as f32 + nmax as f32) / (hi - min);
        for (l, &v) in levels.iter_mut().zip(x) {
            *l = nearest(iscale * (v - min)).clamp(0, nmax) as f32;
        }
        // Neighbouring candidates often round to the same levels, which give the same fit
        // and error as last time: skip the (latency-bound) sums. The result is unchanged.
        if levels == previous {
            continue;
        }
        previous.copy_from_slice(levels);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((&lf, &v), &w) in levels.iter().zip(x).zip(weights) {
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det <= 0.0 {
            continue;
        }
        let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if this_min > 0.0 {
            this_min = 0.0;
            this_scale = sum_xl / sum_l2;
        }
        let mut err = 0f32;
        for ((&lf, &v), &w) in levels.iter().zip(x).zip(weights) {
            err += w * err_of(this_scale * lf + this_min - v);
        }
        if err < best {
            best = err;
            scale = this_scale;
            min = this_min;
        }
    }
    (scale, -min)
}

/// Best symmetric scale for levels in `-nmax..nmax` weighted by `x²`, trying inverse scales
/// around `nmax / max|x|` (the search of ggml's `make_qx_quants` with rmse_type 1).
pub fn symmetric_fit(x: &[f32], nmax: i32) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_EPS {
        return 0.0;
    }
    let fit = |iscale: f32| {
        let (mut sum_lx, mut sum_l2) = (0f32, 0f32);
        for &v in x {
            let l = nearest(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sum_lx += w * v * l;
            sum_l2 += w * l * l;
        }
        (sum_lx, sum_l2)
    };
    let (sum_lx, sum_l2) = fit(-(nmax as f32) / max);
    let mut scale = if sum_l2 > 0.0 { sum_lx / sum_l2 } else { 0.0 };
    let mut best = scale * sum_lx;
    for step in -9i32..=9 {
        if step == 0 {
            continue;
        }
        let (sum_lx, sum_l2) = fit(-(nmax as f32 + 0.1 * step as f32) / max);
        if sum_l2 > 0.0 && sum_lx * sum_lx > best * sum_l2 {
            scale = sum_lx / sum_l2;
            best = scale * sum_lx;
        }
    }
    scale
}

/// Symmetric scale for levels in `-nmax..nmax`, refined by moving single levels while the
/// weighted fit improves (the search of ggml's `make_q3_quants` with rmse).
pub fn symmetric_fit_iterative(x: &[f32], nmax: i32) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_EPS {
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut levels = [0i32; 16];
    let (mut sum_lx, mut sum_l2) = (0f32, 0f32);
    for (i, &v) in x.iter().enumerate() {
        let l = nearest(iscale * v).clamp(-nmax, nmax - 1);
        levels[i] = l;
        let w = v * v;
        sum_lx += w * v * l as f32;
        sum_l2 += w * (l * l) as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let old = levels[i] as f32;
            let mut slx = sum_lx - w * v * old;
            if slx <= 0.0 {
                continue;
            }
            let mut sl2 = sum_l2 - w * old * old;
            let new = nearest(v * sl2 / slx).clamp(-nmax, nmax - 1);
            if new == levels[i] {
                continue;
            }
            slx += w * v * new as f32;
            sl2 += w * (new * new) as f32;
            if sl2 > 0.0 && slx * slx * sum_l2 > sum_lx * sum_lx * sl2 {
                levels[i] = new;
                sum_lx = slx;
                sum_l2 = sl2;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    sum_lx / sum_l2
}

/// Squared error of `x` quantized as `d * l - m` with `l = clamp(round((x + m) / d), 0, nmax)`.
#[inline]
pub fn affine_error(x: &[f32], d: f32, m: f32, nmax: i32) -> f32 {
    if d == 0.0 {
        return x.iter().map(|&v| (v + m) * (v + m)).sum();
    }
    let id = 1.0 / d;
    let mut err = 0f32;
    for &v in x {
        let l = nearest((v + m) * id).clamp(0, nmax) as f32;
        let e = d * l - m - v;
        err += e * e;
    }
    err
}

/// Squared error of `x` quantized as `d * l` with `l = clamp(round(x / d), lo, hi)`.
#[inline]
pub fn symmetric_error(x: &[f32], d: f32, lo: i32, hi: i32) -> f32 {
    if d == 0.0 {
        return x.iter().map(|&v| v * v).sum();
    }
    let id = 1.0 / d;
    let mut err = 0f32;
    for &v in x {
        let l = nearest(v * id).clamp(lo, hi) as f32;
        let e = d * l - v;
        err += e * e;
    }
    err
}

/// Picks the code pair near `(sc, m)` (each moved by at most `radius` inside `0..=max_code`)
/// that minimises the affine error of `x` with scale `d * sc` and offset `dmin * m`. The
/// starting pair is a candidate, so the result is never worse than the reference's choice.
pub fn refine_affine_codes(
    x: &[f32],
    (d, dmin): (f32, f32),
    (sc, m): (u8, u8),
    max_code: u8,
    nmax: i32,
    radius: i32,
) -> (u8, u8) {
    let mut best = (sc, m);
    let mut best_err = affine_error(x, d * sc as f32, dmin * m as f32, nmax);
    for ds in -radius..=radius {
        for dm in -radius..=radius {
            let (s2, m2) = (sc as i32 + ds, m as i32 + dm);
            if (ds, dm) == (0, 0)
                || !(0..=max_code as i32).contains(&s2)
                || !(0..=max_code as i32).contains(&m2)
            {
                continue;
            }
            let err = affine_error(x, d * s2 as f32, dmin * m2 as f32, nmax);
            if err < best_err {
                best_err = err;
                best = (s2 as u8, m2 as u8);
            }
        }
    }
    best
}

/// Like [`refine_affine_codes`] for a signed scale code in `lo_code..=hi_code`, the values
/// quantized to `lo..=hi`.
pub fn refine_symmetric_code(
    x: &[f32],
    d: f32,
    sc: i32,
    (lo_code, hi_code): (i32, i32),
    (lo, hi): (i32, i32),
    radius: i32,
) -> i32 {
    let mut best = sc;
    let mut best_err = symmetric_error(x, d * sc as f32, lo, hi);
    for ds in -radius..=radius {
        let s2 = sc + ds;
        if ds == 0 || !(lo_code..=hi_code).contains(&s2) {
            continue;
        }
        let err = symmetric_error(x, d * s2 as f32, lo, hi);
        if err < best_err {
            best_err = err;
            best = s2;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::nearest;

    #[test]
    fn nearest_rounds_half_to_even_and_saturates() {
        for (x, want) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (3.49, 3),
            (-7.6, -8),
            (1e9, 4_194_303),
            (-1e9, -4_194_303),
        ] {
            assert_eq!(nearest(x), want, "{x}");
        }
        for i in -1000..1000 {
            let x = i as f32 * 0.37;
            assert_eq!(nearest(x), x.round_ties_even() as i32);
        }
    }
}
