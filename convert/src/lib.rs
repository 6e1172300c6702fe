//! Hugging Face Qwen3/ReFusion checkpoints to llama.cpp-compatible GGUF files: reading the
//! checkpoint, choosing per-tensor types, quantizing, and writing the file atomically.

pub mod convert;
pub mod grow;
pub mod hf;
pub mod info;
pub mod mix;
pub mod names;
pub mod output;
pub mod pipeline;
pub mod requantize;
pub mod synthetic;

pub use convert::{convert, Checkpoint, ConvertOptions};
// The format lives in its own crate, shared with the runtime; the converter uses it under
// these names.
pub use mix::MixOptions;
pub use pipeline::{Summary, Verbosity};
pub use refusion_gguf::{self as gguf, decoding, error, files, quant};
pub use refusion_gguf::{DecodingDefaults, Error, Result};
pub use requantize::requantize;
