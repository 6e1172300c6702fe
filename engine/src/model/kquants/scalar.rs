//! The portable tile packer: for Q4_K and Q6_K the same bytes as the AVX-512 packer (tested),
//! for CPUs without AVX-512; Q5_K and Q8_0 are packed here on every CPU.

use super::tiles::{
    Packed, Q4K_D, Q4K_DMIN, Q4K_MINS, Q4K_QUANTS_END, Q4K_SCALES, Q5K_FIFTH_BITS, Q6K_D, Q6K_HIGH,
    Q6K_SCALES, Q8_0_D,
};
use super::{q4k_scales, stored_at, QK};
use std::mem::offset_of;

/// A block's quants in [`Q8K`]'s stored order: Q4_K's 0..16, Q5_K's 0..32, Q6_K's 0..64
/// (stored +32), Q8_0's as the bytes of its i8 values.
///
/// Stored order puts, per 128 values, natural `[0..32, 64..96, 32..64, 96..128]`: for Q4_K
/// the low nibbles of the half's 64 bytes, then their high nibbles (Q5_K: each with its fifth
/// bit from `qh`); for Q6_K the low then high nibbles of `ql[0..32]`, then of `ql[32..64]`,
/// each with its top two bits from `qh`.
fn stored_quants(kind: Packed, blk: &[u8]) -> [u8; QK] {
    let mut stored = [0u8; QK];
    match kind {
        Packed::Q4K | Packed::Q5K => {
            let (qh, qs0) = match kind {
                Packed::Q5K => (Some(&blk[16..48]), 48),
                _ => (None, 16),
            };
            for (h, half) in stored.chunks_exact_mut(128).enumerate() {
                let qs = &blk[qs0 + 64 * h..qs0 + 64 * h + 64];
                let (lo, hi) = half.split_at_mut(64);
                for ((l, u), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(qs) {
                    (*l, *u) = (q & 0x0f, q >> 4);
                }
            }
            if let Some(qh) = qh {
                // Natural value v's fifth bit is bit v / 32 of qh[v % 32].
                for v in 0..QK {
                    stored[stored_at(v)] |= (qh[v % 32] >> (v / 32) & 1) << 4;
                }
            }
        }
        Packed::Q8_0 => {
            for v in 0..QK {
                stored[stored_at(v)] = blk[34 * (v / 32) + 2 + v % 32];
            }
        }
        Packed::Q6K => {
            for (h, half) in stored.chunks_exact_mut(128).enumerate() {
                let (ql, qh) = (
                    &blk[64 * h..64 * h + 64],
                    &blk[128 + 32 * h..128 + 32 * h + 32],
                );
                for l in 0..32 {
                    let (a, b, t) = (ql[l], ql[32 + l], qh[l]);
                    half[l] = (a & 0x0f) | (t & 3) << 4;
                    half[32 + l] = (a >> 4) | (t >> 4 & 3) << 4;
                    half[64 + l] = (b & 0x0f) | (t >> 2 & 3) << 4;
                    half[96 + l] = (b >> 4) | (t >> 6 & 3) << 4;
                }
            }
        }
    }
    stored
}

/// Row `r`'s scales, minimums and `d` of block `blk` into their places in a tile (both packers).
pub fn pack_row_scales(kind: Packed, blk: &[u8], r: usize, tile: &mut [u8]) {
    let f16_at = |tile: &mut [u8], at: usize, v: &[u8]| tile[at..at + 2].copy_from_slice(v);
    match kind {
        Packed::Q4K | Packed::Q5K => {
            let (sc, mn) = q4k_scales(blk);
            for c in 0..8 {
                tile[Q4K_SCALES + 16 * c + r] = (sc >> (8 * (stored_at(32 * c) / 32))) as u8;
                tile[Q4K_MINS + 16 * c + r] = (mn >> (8 * c)) as u8;
            }
            f16_at(tile, Q4K_D + 2 * r, &blk[0..2]);
            f16_at(tile, Q4K_DMIN + 2 * r, &blk[2..4]);
        }
        Packed::Q8_0 => {
            // Stored chunk c's scale: its natural 32-value block's d.
            for c in 0..8 {
                let n = stored_at(32 * c) / 32;
                f16_at(tile, Q8_0_D + 32 * c + 2 * r, &blk[34 * n..34 * n + 2]);
            }
        }
        Packed::Q6K => {
            for c in 0..16 {
                tile[Q6K_SCALES + 16 * c + r] = blk[192 + stored_at(16 * c) / 16];
            }
            f16_at(tile, Q6K_D + 2 * r, &blk[208..210]);
            let unused = offset_of!(super::tiles::Q6KTile, unused);
            tile[unused + 2 * r..unused + 2 * r + 2].fill(0);
        }
    }
}

/// The tile of rows `r0..r0 + 16`, block `b`, as `super::tiles` lays it out (see there).
pub fn pack_tile(kind: Packed, data: &[u8], r0: usize, b: usize, kb: usize, tile: &mut [u8]) {
    let bb = kind.block_bytes();
    let mut quants = [[0u8; QK]; 16];
    for (r, q) in quants.iter_mut().enumerate() {
        let blk = &data[((r0 + r) * kb + b) * bb..][..bb];
        *q = stored_quants(kind, blk);
        pack_row_scales(kind, blk, r, tile);
    }
    if kind == Packed::Q8_0 {
        // Line p: byte 4r + j holds row r's value 4p + j.
        for (p, line) in tile[..Q8_0_D].chunks_exact_mut(64).enumerate() {
            for (out, q) in line.chunks_exact_mut(4).zip(&quants) {
                out.copy_from_slice(&q[4 * p..4 * p + 4]);
            }
        }
        return;
    }
    // Line p: byte 4r + j holds row r's value 8p + j (low nibble) and 8p + 4 + j (high).
    for (p, line) in tile[..Q4K_QUANTS_END].chunks_exact_mut(64).enumerate() {
        for (out, q) in line.chunks_exact_mut(4).zip(&quants) {
            let v = &q[8 * p..8 * p + 8];
            for j in 0..4 {
                out[j] = (v[j] & 0x0f) | (v[4 + j] & 0x0f) << 4;
            }
        }
    }
    match kind {
        Packed::Q5K => {
            // Line 37 + h: byte 4r + j holds the fifth bits of values 32h + 4e + j, e = 0..8,
            // in bit e.
            let bits = &mut tile[Q5K_FIFTH_BITS..Q5K_FIFTH_BITS + 512];
            for (h, line) in bits.chunks_exact_mut(64).enumerate() {
                for (out, q) in line.chunks_exact_mut(4).zip(&quants) {
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = (0..8).map(|e| (q[32 * h + 4 * e + j] >> 4 & 1) << e).sum();
                    }
                }
            }
        }
        Packed::Q6K => {
            // Line 32 + c: byte 4r + j holds the top two bits of values 16c + 4i + j, i = 0..4,
            // in bits 2i, 2i + 1.
            for (c, line) in tile[Q6K_HIGH..Q6K_SCALES].chunks_exact_mut(64).enumerate() {
                for (out, q) in line.chunks_exact_mut(4).zip(&quants) {
                    let v = &q[16 * c..16 * c + 16];
                    for j in 0..4 {
                        let top = |i: usize| (v[4 * i + j] >> 4 & 3) << (2 * i);
                        out[j] = top(0) | top(1) | top(2) | top(3);
                    }
                }
            }
        }
        Packed::Q4K | Packed::Q8_0 => {}
    }
}
