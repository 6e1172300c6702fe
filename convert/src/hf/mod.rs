//! Reading a Hugging Face checkpoint folder: config, weights and tokenizer.

pub mod config;
pub mod tokenizer;
pub mod weights;

use std::path::Path;

use memmap2::{Mmap, UncheckedAdvice};

use crate::error::{Error, Result};

/// Drops the pages of `mmap[start..start+len]` from this process, so that streaming through a
/// file larger than memory keeps the resident set near one tensor. Best effort.
pub fn release_pages(mmap: &Mmap, start: usize, len: usize) {
    if len == 0 || start >= mmap.len() {
        return;
    }
    let len = len.min(mmap.len() - start);
    // SAFETY: the map is a read-only, file-backed mapping: after MADV_DONTNEED the next access
    // reads the same bytes back from the file, so no reference observes a change.
    let _ = unsafe { mmap.unchecked_advise_range(UncheckedAdvice::DontNeed, start, len) };
}

/// Reads and parses a JSON file, naming the file in any error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = crate::files::read_to_string_regular(path)?;
    serde_json::from_str(&text).map_err(|e| Error::bad(path, format!("invalid JSON: {e}")))
}
