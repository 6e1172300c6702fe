//! The GGUF file format as refusion uses it, shared by the converter and the runtime: types,
//! metadata values, a validating reader and a streaming writer, tensor data checks, ReFusion's
//! `refusion.*` decoding keys, the tensor types' block codecs (`quant`: quantizing for the
//! converter, dequantizing for the runtime), and opening the files a user names without
//! blocking on them.
//!
//! Writing is done by hand rather than through a general GGUF crate because the converter
//! streams tensor data that is quantized while it is written, and keeps metadata in a fixed,
//! documented order so that the same checkpoint always converts to the same bytes.

pub mod atomic;
pub mod check;
pub mod decoding;
pub mod error;
pub mod files;
pub mod quant;
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

/// The layer a llama.cpp tensor name belongs to (`blk.N.…`), if any.
pub fn layer_of(gguf_name: &str) -> Option<usize> {
    gguf_name
        .strip_prefix("blk.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// A byte count as the reports print it: `512 B`, `1.50 KiB`, `4.68 GiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
