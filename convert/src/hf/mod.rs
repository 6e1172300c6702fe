//! Reading a Hugging Face checkpoint folder: config, weights and tokenizer.

pub mod config;
pub mod tokenizer;
pub mod weights;

use std::path::Path;

use crate::error::{Error, Result};

pub use refusion_gguf::files::release_pages;

/// Reads and parses a JSON file, naming the file in any error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = crate::files::read_to_string_regular(path)?;
    serde_json::from_str(&text).map_err(|e| Error::bad(path, format!("invalid JSON: {e}")))
}
