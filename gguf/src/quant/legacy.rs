//! The 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
//!
//! These have one obvious encoding (a scale from the block's extreme values, then rounding),
//! which is what ggml writes; we produce the same bytes.

use half::f16;

const QK: usize = 32;

fn put_f16(out: &mut [u8], v: f32) {
    out.copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

fn get_f16(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// The element of largest magnitude, with its sign.
fn signed_absmax(x: &[f32]) -> f32 {
    let mut max = 0f32;
    for &v in x {
        if v.abs() > max.abs() {
            max = v;
        }
    }
    max
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

pub fn q8_0(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(34)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[..2], d);
        for (q, &v) in ob[2..].iter_mut().zip(xb) {
            *q = (v * id).round() as i8 as u8;
        }
    }
}

pub fn q4_0(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(18)) {
        let d = signed_absmax(xb) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[..2], d);
        for j in 0..QK / 2 {
            let lo = ((xb[j] * id + 8.5) as i8).min(15) as u8;
            let hi = ((xb[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
            ob[2 + j] = lo | (hi << 4);
        }
    }
}

pub fn q4_1(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(20)) {
        let (lo, hi) = min_max(xb);
        let d = (hi - lo) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[..2], d);
        put_f16(&mut ob[2..4], lo);
        for j in 0..QK / 2 {
            let a = (((xb[j] - lo) * id + 0.5) as i8).min(15) as u8;
            let b = (((xb[j + QK / 2] - lo) * id + 0.5) as i8).min(15) as u8;
            ob[4 + j] = a | (b << 4);
        }
    }
}

pub fn q5_0(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(22)) {
        let d = signed_absmax(xb) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[..2], d);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let a = ((xb[j] * id + 16.5) as i8).min(31) as u8;
            let b = ((xb[j + QK / 2] * id + 16.5) as i8).min(31) as u8;
            ob[6 + j] = (a & 0xF) | ((b & 0xF) << 4);
            qh |= (((a >> 4) & 1) as u32) << j;
            qh |= (((b >> 4) & 1) as u32) << (j + QK / 2);
        }
        ob[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

pub fn q5_1(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(24)) {
        let (lo, hi) = min_max(xb);
        let d = (hi - lo) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[..2], d);
        put_f16(&mut ob[2..4], lo);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let a = ((xb[j] - lo) * id + 0.5) as u8;
            let b = ((xb[j + QK / 2] - lo) * id + 0.5) as u8;
            ob[8 + j] = (a & 0xF) | ((b & 0xF) << 4);
            qh |= (((a >> 4) & 1) as u32) << j;
            qh |= (((b >> 4) & 1) as u32) << (j + QK / 2);
        }
        ob[4..8].copy_from_slice(&qh.to_le_bytes());
    }
}

pub fn dequant_q8_0(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
        let d = get_f16(b);
        for (v, &q) in o.iter_mut().zip(&b[2..]) {
            *v = q as i8 as f32 * d;
        }
    }
}

pub fn dequant_q4_0(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(18).zip(out.chunks_exact_mut(QK)) {
        let d = get_f16(b);
        for j in 0..QK / 2 {
            o[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
            o[j + QK / 2] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub fn dequant_q4_1(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(20).zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (get_f16(b), get_f16(&b[2..]));
        for j in 0..QK / 2 {
            o[j] = (b[4 + j] & 0xF) as f32 * d + m;
            o[j + QK / 2] = (b[4 + j] >> 4) as f32 * d + m;
        }
    }
}

pub fn dequant_q5_0(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(22).zip(out.chunks_exact_mut(QK)) {
        let d = get_f16(b);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        for j in 0..QK / 2 {
            let a = (b[6 + j] & 0xF) as u32 | (((qh >> j) & 1) << 4);
            let c = (b[6 + j] >> 4) as u32 | (((qh >> (j + QK / 2)) & 1) << 4);
            o[j] = (a as i32 - 16) as f32 * d;
            o[j + QK / 2] = (c as i32 - 16) as f32 * d;
        }
    }
}

pub fn dequant_q5_1(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(24).zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (get_f16(b), get_f16(&b[2..]));
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        for j in 0..QK / 2 {
            let a = (b[8 + j] & 0xF) as u32 | (((qh >> j) & 1) << 4);
            let c = (b[8 + j] >> 4) as u32 | (((qh >> (j + QK / 2)) & 1) << 4);
            o[j] = a as f32 * d + m;
            o[j + QK / 2] = c as f32 * d + m;
        }
    }
}
