//! Hugging Face Qwen3/ReFusion checkpoints to llama.cpp-compatible GGUF files: reading the
//! checkpoint, choosing per-tensor types, quantizing, and writing the file atomically.

pub mod convert;
pub mod decoding;
pub mod error;
pub mod files;
pub mod gguf;
pub mod hf;
pub mod info;
pub mod mix;
pub mod names;
pub mod output;
pub mod pipeline;
pub mod quant;
pub mod requantize;
pub mod synthetic;

pub use convert::{convert, Checkpoint, ConvertOptions};
pub use decoding::DecodingDefaults;
pub use error::{Error, Result};
pub use mix::MixOptions;
pub use pipeline::{Summary, Verbosity};
pub use requantize::requantize;
