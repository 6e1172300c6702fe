//! The repacked tiles, one per type: 16 weight rows x 256 values, as `#[repr(C)]` structs
//! whose sizes are asserted at compile time (llama.cpp's repacked blocks are declared the same
//! way). The kernels address a tile through raw pointers, at the byte offsets named here
//! (`offset_of!` of the fields), never at bare numbers; which types have tiles is the
//! [`Packed`] enum, matched exhaustively.
//!
//! The layouts (see `scalar::pack_tile` for the bytes):
//! - Q4_K: the quants, 64 bytes per pair of four-value groups, nibble-packed in [`super::Q8K`]'s
//!   stored order; the 6-bit scale of each stored 32-value chunk, `[chunk][row]`; the minimum
//!   of each natural sub-block, `[sub-block][row]`; `d` and `dmin` as 16 f16 each.
//! - Q5_K: Q4_K's tile, then the fifth bits of each value.
//! - Q6_K: the low four bits as Q4_K's quants; the top two bits, 64 bytes per four groups; the
//!   i8 scale of each stored 16-value chunk, `[chunk][row]`; `d` as 16 f16; 32 unused bytes
//!   (to a whole line).
//! - Q8_0: the quants, 64 bytes per group of four values; the f16 `d` of each 32-value chunk,
//!   `[chunk][row]`.

use std::mem::{offset_of, size_of};

use refusion_gguf::GgmlType;

#[repr(C)]
pub struct Q4KTile {
    pub quants: [u8; 2048],
    pub scales: [u8; 128],
    pub mins: [u8; 128],
    pub d: [u8; 32],
    pub dmin: [u8; 32],
}

#[repr(C)]
pub struct Q5KTile {
    pub q4: Q4KTile,
    pub fifth_bits: [u8; 512],
}

#[repr(C)]
pub struct Q6KTile {
    pub low: [u8; 2048],
    pub high: [u8; 1024],
    pub scales: [u8; 256],
    pub d: [u8; 32],
    pub unused: [u8; 32],
}

#[repr(C)]
pub struct Q8_0Tile {
    pub quants: [u8; 4096],
    pub d: [u8; 256],
}

const LINE: usize = 64;
const _: () = assert!(size_of::<Q4KTile>() == 37 * LINE);
const _: () = assert!(size_of::<Q5KTile>() == 45 * LINE);
const _: () = assert!(size_of::<Q6KTile>() == 53 * LINE);
const _: () = assert!(size_of::<Q8_0Tile>() == 68 * LINE);

/// Byte offsets of the fields, for the kernels' pointer arithmetic.
pub const Q4K_SCALES: usize = offset_of!(Q4KTile, scales);
pub const Q4K_MINS: usize = offset_of!(Q4KTile, mins);
pub const Q4K_D: usize = offset_of!(Q4KTile, d);
pub const Q4K_DMIN: usize = offset_of!(Q4KTile, dmin);
pub const Q5K_FIFTH_BITS: usize = offset_of!(Q5KTile, fifth_bits);
pub const Q6K_HIGH: usize = offset_of!(Q6KTile, high);
pub const Q6K_SCALES: usize = offset_of!(Q6KTile, scales);
pub const Q6K_D: usize = offset_of!(Q6KTile, d);
pub const Q8_0_D: usize = offset_of!(Q8_0Tile, d);
/// Where the four-bit quants end (Q4_K's and Q5_K's; Q6_K's low bits end at the same byte).
pub const Q4K_QUANTS_END: usize = Q4K_SCALES;
const _: () = assert!(Q4K_QUANTS_END == offset_of!(Q6KTile, high));

/// The types these kernels run, each with its tile.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Packed {
    Q4K,
    Q5K,
    Q6K,
    Q8_0,
}

impl Packed {
    pub fn of(ty: GgmlType) -> Option<Packed> {
        match ty {
            GgmlType::Q4_K => Some(Packed::Q4K),
            GgmlType::Q5_K => Some(Packed::Q5K),
            GgmlType::Q6_K => Some(Packed::Q6K),
            GgmlType::Q8_0 => Some(Packed::Q8_0),
            _ => None,
        }
    }

    /// Bytes of one tile.
    pub fn tile_bytes(self) -> usize {
        match self {
            Packed::Q4K => size_of::<Q4KTile>(),
            Packed::Q5K => size_of::<Q5KTile>(),
            Packed::Q6K => size_of::<Q6KTile>(),
            Packed::Q8_0 => size_of::<Q8_0Tile>(),
        }
    }

    /// 64-byte lines of one tile.
    pub fn tile_lines(self) -> usize {
        self.tile_bytes() / LINE
    }

    /// The file's bytes per row per 256 values (Q8_0: eight 34-byte blocks).
    pub fn block_bytes(self) -> usize {
        match self {
            Packed::Q4K => 144,
            Packed::Q5K => 176,
            Packed::Q6K => 210,
            Packed::Q8_0 => 8 * 34,
        }
    }
}
