//! The portable tile packer: the same bytes as the AVX-512 packer (tested), for CPUs without
//! AVX-512.

use refusion_convert::gguf::GgmlType;

use super::{block_bytes, q4k_scales, stored_at, QK};

/// A block's quants in [`Q8K`]'s stored order: Q4_K's 0..16, Q6_K's 0..64 (stored +32).
fn stored_quants(ty: GgmlType, blk: &[u8]) -> [u8; QK] {
    let mut natural = [0u8; QK];
    if ty == GgmlType::Q4_K {
        // Per 64 values: 32 bytes, low nibbles the first 32 values, high nibbles the next.
        for (chunk, qs) in blk[16..144].chunks_exact(32).enumerate() {
            for (l, &q) in qs.iter().enumerate() {
                natural[64 * chunk + l] = q & 0x0f;
                natural[64 * chunk + 32 + l] = q >> 4;
            }
        }
    } else {
        // Per 128 values: 64 bytes of low four bits and 32 of top two bits (ggml's layout).
        for h in 0..2 {
            let (ql, qh) = (
                &blk[64 * h..64 * h + 64],
                &blk[128 + 32 * h..128 + 32 * h + 32],
            );
            for l in 0..32 {
                let top = |shift: u32| ((qh[l] >> shift) & 3) << 4;
                natural[128 * h + l] = (ql[l] & 0x0f) | top(0);
                natural[128 * h + l + 32] = (ql[l + 32] & 0x0f) | top(2);
                natural[128 * h + l + 64] = (ql[l] >> 4) | top(4);
                natural[128 * h + l + 96] = (ql[l + 32] >> 4) | top(6);
            }
        }
    }
    let mut stored = [0u8; QK];
    for (n, &q) in natural.iter().enumerate() {
        stored[stored_at(n)] = q;
    }
    stored
}

/// The tile of rows `r0..r0 + 16`, block `b`, as `x86::pack_tile` lays it out (see there).
pub fn pack_tile(ty: GgmlType, data: &[u8], r0: usize, b: usize, kb: usize, tile: &mut [u8]) {
    let bb = block_bytes(ty);
    let mut quants = [[0u8; QK]; 16];
    for (r, q) in quants.iter_mut().enumerate() {
        let blk = &data[((r0 + r) * kb + b) * bb..][..bb];
        *q = stored_quants(ty, blk);
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
    // Line p: byte 4r + j holds row r's value 8p + j (low nibble) and 8p + 4 + j (high).
    for p in 0..32 {
        for (r, q) in quants.iter().enumerate() {
            for j in 0..4 {
                tile[64 * p + 4 * r + j] = (q[8 * p + j] & 0x0f) | (q[8 * p + 4 + j] & 0x0f) << 4;
            }
        }
    }
    if ty == GgmlType::Q6_K {
        // Line 32 + c: byte 4r + j holds the top two bits of values 16c + 4i + j, i = 0..4,
        // in bits 2i, 2i + 1.
        for c in 0..16 {
            for (r, q) in quants.iter().enumerate() {
                for j in 0..4 {
                    let mut h = 0u8;
                    for i in 0..4 {
                        h |= (q[16 * c + 4 * i + j] >> 4 & 3) << (2 * i);
                    }
                    tile[2048 + 64 * c + 4 * r + j] = h;
                }
            }
        }
    }
}
