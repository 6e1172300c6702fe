//! Unquantized element types.

use half::{bf16, f16};

pub fn encode_f32(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(4)) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

pub fn encode_f16(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
    }
}

/// Round to nearest even, as ggml and PyTorch do.
pub fn encode_bf16(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
    }
}

pub fn decode_f32(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(4).zip(out.iter_mut()) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

pub fn decode_f16(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(2).zip(out.iter_mut()) {
        *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

pub fn decode_bf16(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(2).zip(out.iter_mut()) {
        *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}
