//! The portable tile packer: the same bytes as the AVX-512 packer (tested), for CPUs without
//! AVX-512.

use refusion_convert::gguf::GgmlType;

use super::{block_bytes, q4k_scales, stored_at, QK};

/// A block's quants in [`Q8K`]'s stored order: Q4_K's 0..16, Q6_K's 0..64 (stored +32).
///
/// Stored order puts, per 128 values, natural `[0..32, 64..96, 32..64, 96..128]`: for Q4_K
/// the low nibbles of the half's 64 bytes, then their high nibbles; for Q6_K the low then high
/// nibbles of `ql[0..32]`, then of `ql[32..64]`, each with its top two bits from `qh`.
fn stored_quants(ty: GgmlType, blk: &[u8]) -> [u8; QK] {
    let mut stored = [0u8; QK];
    for (h, half) in stored.chunks_exact_mut(128).enumerate() {
        if ty == GgmlType::Q4_K {
            let qs = &blk[16 + 64 * h..16 + 64 * h + 64];
            let (lo, hi) = half.split_at_mut(64);
            for ((l, u), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(qs) {
                (*l, *u) = (q & 0x0f, q >> 4);
            }
        } else {
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
    stored
}

/// Row `r`'s scales, minimums and `d` of block `blk` into their places in a tile (both packers).
pub fn pack_row_scales(ty: GgmlType, blk: &[u8], r: usize, tile: &mut [u8]) {
    if ty == GgmlType::Q4_K {
        let (sc, mn) = q4k_scales(blk);
        for c in 0..8 {
            tile[2048 + 16 * c + r] = (sc >> (8 * (stored_at(32 * c) / 32))) as u8;
            tile[2176 + 16 * c + r] = (mn >> (8 * c)) as u8;
        }
        tile[2304 + 2 * r..2306 + 2 * r].copy_from_slice(&blk[0..2]);
        tile[2336 + 2 * r..2338 + 2 * r].copy_from_slice(&blk[2..4]);
    } else {
        for c in 0..16 {
            tile[3072 + 16 * c + r] = blk[192 + stored_at(16 * c) / 16];
        }
        tile[3328 + 2 * r..3330 + 2 * r].copy_from_slice(&blk[208..210]);
        tile[3360 + 2 * r..3362 + 2 * r].fill(0);
    }
}

/// The tile of rows `r0..r0 + 16`, block `b`, as `x86::pack_tile` lays it out (see there).
pub fn pack_tile(ty: GgmlType, data: &[u8], r0: usize, b: usize, kb: usize, tile: &mut [u8]) {
    let bb = block_bytes(ty);
    let mut quants = [[0u8; QK]; 16];
    for (r, q) in quants.iter_mut().enumerate() {
        let blk = &data[((r0 + r) * kb + b) * bb..][..bb];
        *q = stored_quants(ty, blk);
        pack_row_scales(ty, blk, r, tile);
    }
    // Line p: byte 4r + j holds row r's value 8p + j (low nibble) and 8p + 4 + j (high).
    for (p, line) in tile[..2048].chunks_exact_mut(64).enumerate() {
        for (out, q) in line.chunks_exact_mut(4).zip(&quants) {
            let v = &q[8 * p..8 * p + 8];
            for j in 0..4 {
                out[j] = (v[j] & 0x0f) | (v[4 + j] & 0x0f) << 4;
            }
        }
    }
    if ty == GgmlType::Q6_K {
        // Line 32 + c: byte 4r + j holds the top two bits of values 16c + 4i + j, i = 0..4,
        // in bits 2i, 2i + 1.
        for (c, line) in tile[2048..3072].chunks_exact_mut(64).enumerate() {
            for (out, q) in line.chunks_exact_mut(4).zip(&quants) {
                let v = &q[16 * c..16 * c + 16];
                for j in 0..4 {
                    let top = |i: usize| (v[4 * i + j] >> 4 & 3) << (2 * i);
                    out[j] = top(0) | top(1) | top(2) | top(3);
                }
            }
        }
    }
}
