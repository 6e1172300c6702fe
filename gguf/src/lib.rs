//! The GGUF file format as refusion uses it, shared by the converter and the runtime: types,
//! metadata values, a validating reader and a streaming writer, tensor data checks, ReFusion's
//! `refusion.*` decoding keys, and opening the files a user names without blocking on them.
//!
//! Writing is done by hand rather than through a general GGUF crate because the converter
//! streams tensor data that is quantized while it is written, and keeps metadata in a fixed,
//! documented order so that the same checkpoint always converts to the same bytes.

pub mod atomic;
pub mod check;
pub mod decoding;
pub mod error;
pub mod files;
mod read;
mod types;
mod value;
mod write;

pub use read::{fnv1a, Fnv1a, GgufFile, GgufHeader, TensorInfo};
pub use types::{FileType, GgmlType};
pub use value::{Value, ValueType};
pub use write::{GgufWriter, TensorSpec};

pub use decoding::DecodingDefaults;
pub use error::{Error, Result};

pub const MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Rounds `n` up to a multiple of `align` (a power of two), or `None` on overflow.
pub fn align_up(n: u64, align: u64) -> Option<u64> {
    let mask = align.checked_sub(1)?;
    n.checked_add(mask).map(|v| v & !mask)
}
