//! The 256-element super-block formats: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
//!
//! Each encoder runs in four steps:
//! 1. fit a float scale (and offset) per sub-block with the same search as ggml's reference
//!    quantizer;
//! 2. quantize those scales to the super-block's codes, as the reference does;
//! 3. refine: for each sub-block, try the neighbouring codes and keep the pair with the least
//!    squared error of the sub-block's weights. The reference's codes are among the candidates,
//!    so no sub-block ends up worse than llama.cpp's, and many end up better;
//! 4. round every weight to the nearest level under its final codes and pack the bits.

use half::f16;

use super::search::{
    affine_fit, nearest, refine_affine_codes, refine_symmetric_code, symmetric_fit,
    symmetric_fit_iterative, GROUP_EPS,
};

pub const QK_K: usize = 256;

fn f16_bits(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Largest positive value in `v`, or 0.
fn max_positive(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, &s| m.max(s))
}

/// The element of largest magnitude, with its sign.
fn signed_absmax(v: &[f32]) -> f32 {
    let mut best = 0f32;
    for &s in v {
        if s.abs() > best.abs() {
            best = s;
        }
    }
    best
}

// ---------------------------------------------------------------------------------------------
// 6-bit scale/min packing shared by Q4_K and Q5_K: 8 sub-blocks, 12 bytes.

fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            out[j] = sc[j];
            out[j + 4] = m[j];
        } else {
            out[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4);
            out[j - 4] |= (sc[j] >> 4) << 6;
            out[j] |= (m[j] >> 4) << 6;
        }
    }
    out
}

fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Steps 1-3 for the two affine formats with 8 sub-blocks of 32 and 6-bit codes.
/// Returns (d, dmin, scale codes, min codes).
fn affine_k4_codes(x: &[f32], nmax: i32, rmin: f32, nstep: usize) -> (f32, f32, [u8; 8], [u8; 8]) {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut weights = [0f32; 32];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let av = (sub.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(sub) {
            *w = av + v.abs();
        }
        (scales[j], mins[j]) = affine_fit(sub, &weights, nmax, rmin, 0.1, nstep, false);
    }
    let (max_scale, max_min) = (max_positive(&scales), max_positive(&mins));
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        sc[j] = nearest(inv_scale * scales[j]).clamp(0, 63) as u8;
        m[j] = nearest(inv_min * mins[j]).clamp(0, 63) as u8;
    }
    // The codes are decoded against the f16-rounded super-block scales.
    let d = f16::from_f32(max_scale / 63.0).to_f32();
    let dmin = f16::from_f32(max_min / 63.0).to_f32();
    for (j, sub) in x.chunks_exact(32).enumerate() {
        (sc[j], m[j]) = refine_affine_codes(sub, (d, dmin), (sc[j], m[j]), 63, nmax, 1);
    }
    (max_scale / 63.0, max_min / 63.0, sc, m)
}

/// Final levels of an affine sub-block.
fn affine_levels(x: &[f32], d: f32, m: f32, nmax: i32, out: &mut [u8]) {
    if d == 0.0 {
        out.fill(0);
        return;
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = nearest((v + m) / d).clamp(0, nmax) as u8;
    }
}

pub fn q4_k(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(144)) {
        let (d, dmin, sc, m) = affine_k4_codes(xb, 15, -1.0, 20);
        ob[0..2].copy_from_slice(&f16_bits(d));
        ob[2..4].copy_from_slice(&f16_bits(dmin));
        ob[4..16].copy_from_slice(&pack_scale_min_k4(&sc, &m));
        let (d, dmin) = (f16_at(ob, 0), f16_at(ob, 2));
        let mut levels = [0u8; QK_K];
        for j in 0..8 {
            let sub = &xb[32 * j..32 * j + 32];
            affine_levels(
                sub,
                d * sc[j] as f32,
                dmin * m[j] as f32,
                15,
                &mut levels[32 * j..32 * j + 32],
            );
        }
        let qs = &mut ob[16..144];
        for (chunk, q) in levels.chunks_exact(64).zip(qs.chunks_exact_mut(32)) {
            for l in 0..32 {
                q[l] = chunk[l] | (chunk[l + 32] << 4);
            }
        }
    }
}

pub fn q5_k(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(176)) {
        let (d, dmin, sc, m) = affine_k4_codes(xb, 31, -0.5, 15);
        ob[0..2].copy_from_slice(&f16_bits(d));
        ob[2..4].copy_from_slice(&f16_bits(dmin));
        ob[4..16].copy_from_slice(&pack_scale_min_k4(&sc, &m));
        let (d, dmin) = (f16_at(ob, 0), f16_at(ob, 2));
        let mut levels = [0u8; QK_K];
        for j in 0..8 {
            let sub = &xb[32 * j..32 * j + 32];
            affine_levels(
                sub,
                d * sc[j] as f32,
                dmin * m[j] as f32,
                31,
                &mut levels[32 * j..32 * j + 32],
            );
        }
        let (qh, qs) = ob[16..176].split_at_mut(32);
        qh.fill(0);
        for (pair, (chunk, q)) in levels
            .chunks_exact(64)
            .zip(qs.chunks_exact_mut(32))
            .enumerate()
        {
            for l in 0..32 {
                let (a, b) = (chunk[l], chunk[l + 32]);
                q[l] = (a & 0xF) | ((b & 0xF) << 4);
                qh[l] |= ((a >> 4) << (2 * pair)) | ((b >> 4) << (2 * pair + 1));
            }
        }
    }
}

pub fn q2_k(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(84)) {
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        let mut weights = [0f32; 16];
        for (j, sub) in xb.chunks_exact(16).enumerate() {
            for (w, &v) in weights.iter_mut().zip(sub) {
                *w = v.abs();
            }
            (scales[j], mins[j]) = affine_fit(sub, &weights, 3, -0.5, 0.1, 15, true);
        }
        let (max_scale, max_min) = (max_positive(&scales), max_positive(&mins));
        let mut sc = [0u8; 16];
        let mut m = [0u8; 16];
        if max_scale > 0.0 {
            for j in 0..16 {
                sc[j] = nearest(15.0 / max_scale * scales[j]).clamp(0, 15) as u8;
            }
        }
        if max_min > 0.0 {
            for j in 0..16 {
                m[j] = nearest(15.0 / max_min * mins[j]).clamp(0, 15) as u8;
            }
        }
        ob[80..82].copy_from_slice(&f16_bits(max_scale / 15.0));
        ob[82..84].copy_from_slice(&f16_bits(max_min / 15.0));
        let (d, dmin) = (f16_at(ob, 80), f16_at(ob, 82));
        let mut levels = [0u8; QK_K];
        for (j, sub) in xb.chunks_exact(16).enumerate() {
            (sc[j], m[j]) = refine_affine_codes(sub, (d, dmin), (sc[j], m[j]), 15, 3, 1);
            ob[j] = sc[j] | (m[j] << 4);
            affine_levels(
                sub,
                d * sc[j] as f32,
                dmin * m[j] as f32,
                3,
                &mut levels[16 * j..16 * j + 16],
            );
        }
        let qs = &mut ob[16..80];
        for (chunk, q) in levels.chunks_exact(128).zip(qs.chunks_exact_mut(32)) {
            for l in 0..32 {
                q[l] =
                    chunk[l] | (chunk[l + 32] << 2) | (chunk[l + 64] << 4) | (chunk[l + 96] << 6);
            }
        }
    }
}

pub fn q3_k(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(110)) {
        let mut scales = [0f32; 16];
        for (j, sub) in xb.chunks_exact(16).enumerate() {
            scales[j] = symmetric_fit_iterative(sub, 4);
        }
        let max_scale = signed_absmax(&scales);
        let mut codes = [0i32; 16];
        let d = if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for j in 0..16 {
                codes[j] = nearest(iscale * scales[j]).clamp(-32, 31);
            }
            1.0 / iscale
        } else {
            0.0
        };
        ob[108..110].copy_from_slice(&f16_bits(d));
        let d = f16_at(ob, 108);
        let mut levels = [0u8; QK_K];
        for (j, sub) in xb.chunks_exact(16).enumerate() {
            codes[j] = refine_symmetric_code(sub, d, codes[j], (-32, 31), (-4, 3), 2);
            let dl = d * codes[j] as f32;
            for (o, &v) in levels[16 * j..16 * j + 16].iter_mut().zip(sub) {
                *o = if dl != 0.0 {
                    (nearest(v / dl).clamp(-4, 3) + 4) as u8
                } else {
                    4
                };
            }
        }
        let (hmask, rest) = ob.split_at_mut(32);
        let (qs, rest) = rest.split_at_mut(64);
        let sc = &mut rest[..12];
        sc.fill(0);
        for (j, &c) in codes.iter().enumerate() {
            let l = (c + 32) as u8;
            if j < 8 {
                sc[j] = l & 0xF;
            } else {
                sc[j - 8] |= (l & 0xF) << 4;
            }
            sc[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
        }
        hmask.fill(0);
        for (i, l) in levels.iter_mut().enumerate() {
            if *l > 3 {
                hmask[i % 32] |= 1 << (i / 32);
                *l -= 4;
            }
        }
        for (chunk, q) in levels.chunks_exact(128).zip(qs.chunks_exact_mut(32)) {
            for l in 0..32 {
                q[l] =
                    chunk[l] | (chunk[l + 32] << 2) | (chunk[l + 64] << 4) | (chunk[l + 96] << 6);
            }
        }
    }
}

pub fn q6_k(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(210)) {
        let mut scales = [0f32; 16];
        for (j, sub) in xb.chunks_exact(16).enumerate() {
            scales[j] = symmetric_fit(sub, 32);
        }
        let max_scale = signed_absmax(&scales);
        if max_scale.abs() < GROUP_EPS {
            ob.fill(0);
            continue;
        }
        let iscale = -128.0 / max_scale;
        ob[208..210].copy_from_slice(&f16_bits(1.0 / iscale));
        let d = f16_at(ob, 208);
        let mut levels = [0u8; QK_K];
        for (j, sub) in xb.chunks_exact(16).enumerate() {
            let code = nearest(iscale * scales[j]).clamp(-128, 127);
            let code = refine_symmetric_code(sub, d, code, (-128, 127), (-32, 31), 2);
            ob[192 + j] = code as i8 as u8;
            let dl = d * code as f32;
            for (o, &v) in levels[16 * j..16 * j + 16].iter_mut().zip(sub) {
                *o = if dl != 0.0 {
                    (nearest(v / dl).clamp(-32, 31) + 32) as u8
                } else {
                    32
                };
            }
        }
        let (ql, rest) = ob.split_at_mut(128);
        let qh = &mut rest[..64];
        for (half, chunk) in levels.chunks_exact(128).enumerate() {
            let ql = &mut ql[64 * half..64 * half + 64];
            let qh = &mut qh[32 * half..32 * half + 32];
            for l in 0..32 {
                let (a, b, c, e) = (chunk[l], chunk[l + 32], chunk[l + 64], chunk[l + 96]);
                ql[l] = (a & 0xF) | ((c & 0xF) << 4);
                ql[l + 32] = (b & 0xF) | ((e & 0xF) << 4);
                qh[l] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decoders (used by tests, by `quantize` statistics and by the error measurements).

pub fn dequant_q2_k(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(84).zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for (i, v) in o.iter_mut().enumerate() {
            let sc = b[i / 16];
            let q = (b[16 + 32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3;
            *v = d * (sc & 0xF) as f32 * q as f32 - dmin * (sc >> 4) as f32;
        }
    }
}

pub fn dequant_q3_k(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(110).zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 108);
        let sc = &b[96..108];
        for (i, v) in o.iter_mut().enumerate() {
            let j = i / 16;
            let low = if j < 8 { sc[j] & 0xF } else { sc[j - 8] >> 4 };
            let code = (low | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) as i32 - 32;
            let q = ((b[32 + 32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3) as i32;
            let high = (b[i % 32] >> (i / 32)) & 1;
            *v = d * code as f32 * (q - if high == 1 { 0 } else { 4 }) as f32;
        }
    }
}

pub fn dequant_q4_k(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(144).zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        for (i, v) in o.iter_mut().enumerate() {
            let (sc, m) = scale_min_k4(i / 32, &b[4..16]);
            let byte = b[16 + 32 * (i / 64) + i % 32];
            let q = if (i / 32) % 2 == 0 {
                byte & 0xF
            } else {
                byte >> 4
            };
            *v = d * sc as f32 * q as f32 - dmin * m as f32;
        }
    }
}

pub fn dequant_q5_k(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(176).zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        for (i, v) in o.iter_mut().enumerate() {
            let (sc, m) = scale_min_k4(i / 32, &b[4..16]);
            let byte = b[48 + 32 * (i / 64) + i % 32];
            let low = if (i / 32) % 2 == 0 {
                byte & 0xF
            } else {
                byte >> 4
            };
            let high = (b[16 + i % 32] >> (i / 32)) & 1;
            let q = low | (high << 4);
            *v = d * sc as f32 * q as f32 - dmin * m as f32;
        }
    }
}

pub fn dequant_q6_k(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(210).zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 208);
        for (i, v) in o.iter_mut().enumerate() {
            let (half, r) = (i / 128, i % 128);
            let (quarter, l) = (r / 32, r % 32);
            let ql = b[64 * half + l + 32 * (quarter % 2)];
            let low = if quarter < 2 { ql & 0xF } else { ql >> 4 };
            let high = (b[128 + 32 * half + l] >> (2 * quarter)) & 3;
            let q = (low | (high << 4)) as i32 - 32;
            let code = b[192 + i / 16] as i8;
            *v = d * code as f32 * q as f32;
        }
    }
}
