//! Memory-mapped safetensors weights: one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Nothing is read until a tensor's rows are asked for.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors};
use serde::Deserialize;

use crate::error::{Error, Result};

/// Element types we convert from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceDtype {
    F32,
    F16,
    BF16,
}

impl SourceDtype {
    pub fn size(self) -> usize {
        match self {
            SourceDtype::F32 => 4,
            SourceDtype::F16 | SourceDtype::BF16 => 2,
        }
    }

    /// Decodes little-endian elements into f32 (exactly: every source type widens losslessly).
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            SourceDtype::F32 => {
                for (b, o) in bytes.chunks_exact(4).zip(out) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            SourceDtype::F16 => {
                for (b, o) in bytes.chunks_exact(2).zip(out) {
                    *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            SourceDtype::BF16 => {
                for (b, o) in bytes.chunks_exact(2).zip(out) {
                    *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }
}

/// Where one checkpoint tensor lives.
#[derive(Debug, Clone)]
pub struct SourceTensor {
    pub name: String,
    pub shard: usize,
    pub dtype: SourceDtype,
    /// Shape as in PyTorch (row-major, last dimension contiguous).
    pub shape: Vec<u64>,
    /// Absolute byte range in the shard file.
    pub start: usize,
    pub len: usize,
}

pub struct Shard {
    pub path: PathBuf,
    pub mmap: Mmap,
}

pub struct Weights {
    pub shards: Vec<Shard>,
    /// Tensors by name, sorted.
    pub tensors: BTreeMap<String, SourceTensor>,
}

#[derive(Deserialize)]
struct Index {
    weight_map: HashMap<String, String>,
}

/// Parses and checks a safetensors file held in `bytes` (header, offsets, dtypes) and returns
/// its tensors, sorted by name. Nothing is allocated in proportion to a count the file claims.
pub fn parse_shard(bytes: &[u8], shard: usize) -> std::result::Result<Vec<SourceTensor>, String> {
    let (header_len, meta) = SafeTensors::read_metadata(bytes).map_err(describe)?;
    let data_start = 8 + header_len;
    // `read_metadata` checked that offsets tile the data section and match the file length.
    SafeTensors::deserialize(bytes).map_err(describe)?;
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let dtype = match info.dtype {
            Dtype::F32 => SourceDtype::F32,
            Dtype::F16 => SourceDtype::F16,
            Dtype::BF16 => SourceDtype::BF16,
            other => {
                return Err(format!(
                    "tensor '{name}' has dtype {other:?}; only F32, F16 and BF16 are supported"
                ))
            }
        };
        let (begin, end) = info.data_offsets;
        out.push(SourceTensor {
            name: name.clone(),
            shard,
            dtype,
            shape: info.shape.iter().map(|&d| d as u64).collect(),
            start: data_start + begin,
            len: end - begin,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Parses `model.safetensors.index.json`: tensor name to shard file name. Shard names must be
/// plain file names (no path separators, not hidden), so an index cannot point outside its folder.
pub fn parse_index(json: &[u8]) -> std::result::Result<HashMap<String, String>, String> {
    let idx: Index = serde_json::from_slice(json).map_err(|e| format!("invalid JSON: {e}"))?;
    for file in idx.weight_map.values() {
        if file.is_empty() || file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(format!("shard name '{file}' is not a plain file name"));
        }
    }
    Ok(idx.weight_map)
}

fn describe(e: SafeTensorError) -> String {
    match e {
        SafeTensorError::HeaderTooSmall => {
            "file too short to hold a safetensors header (truncated?)".into()
        }
        SafeTensorError::InvalidHeaderLength => {
            "header length points past the end of the file (truncated or not safetensors)".into()
        }
        SafeTensorError::HeaderTooLarge => "header is larger than 100 MB (corrupt?)".into(),
        SafeTensorError::InvalidHeader(_) => "header is not valid UTF-8 (corrupt?)".into(),
        SafeTensorError::InvalidHeaderStart => {
            "header does not start with '{' (not safetensors?)".into()
        }
        SafeTensorError::InvalidHeaderDeserialization(e) => {
            format!("header is not valid JSON: {e}")
        }
        SafeTensorError::MetadataIncompleteBuffer => {
            "tensor data does not cover the file (truncated or corrupt)".into()
        }
        SafeTensorError::InvalidOffset(name) => format!("tensor '{name}' has invalid data offsets"),
        SafeTensorError::TensorInvalidInfo => "a tensor's shape, dtype and offsets disagree".into(),
        SafeTensorError::ValidationOverflow => "a tensor's size overflows".into(),
        other => format!("invalid safetensors file: {other:?}"),
    }
}

impl Weights {
    /// Opens the weights of the checkpoint in `dir`.
    pub fn open(dir: &Path) -> Result<Weights> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let mut weights = Weights {
            shards: Vec::new(),
            tensors: BTreeMap::new(),
        };
        if index.is_file() {
            let text = crate::files::read_to_string_regular(&index)?.into_bytes();
            let weight_map = parse_index(&text).map_err(|m| Error::bad(&index, m))?;
            let mut files: Vec<&String> = weight_map.values().collect();
            files.sort();
            files.dedup();
            for file in files {
                let path = dir.join(file);
                if !path.is_file() {
                    return Err(Error::bad(
                        &index,
                        format!("shard '{file}' is named in the index but does not exist"),
                    ));
                }
                weights.add_shard(&path)?;
            }
            for (name, file) in &weight_map {
                let t = weights.tensors.get(name).ok_or_else(|| {
                    Error::bad(
                        &index,
                        format!("tensor '{name}' is listed for '{file}' but that shard lacks it"),
                    )
                })?;
                let actual = &weights.shards[t.shard].path;
                if actual.file_name().and_then(|f| f.to_str()) != Some(file.as_str()) {
                    return Err(Error::bad(
                        &index,
                        format!(
                            "tensor '{name}' is listed for '{file}' but found in '{}'",
                            actual.display()
                        ),
                    ));
                }
            }
        } else if single.is_file() {
            weights.add_shard(&single)?;
        } else {
            return Err(Error::bad(
                dir,
                "no weights found: expected model.safetensors or model.safetensors.index.json",
            ));
        }
        Ok(weights)
    }

    fn add_shard(&mut self, path: &Path) -> Result<()> {
        let file = crate::files::open_regular(path)?;
        // SAFETY: read-only map; the header is validated before any offset is used, and a file
        // changed underneath us can only produce wrong values, which the converter then writes.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let shard = self.shards.len();
        for t in parse_shard(&mmap, shard).map_err(|m| Error::bad(path, m))? {
            let name = t.name.clone();
            if self.tensors.insert(name.clone(), t).is_some() {
                return Err(Error::bad(
                    path,
                    format!("tensor '{name}' also appears in another shard"),
                ));
            }
        }
        self.shards.push(Shard {
            path: path.to_path_buf(),
            mmap,
        });
        Ok(())
    }

    pub fn bytes(&self, t: &SourceTensor) -> &[u8] {
        &self.shards[t.shard].mmap[t.start..t.start + t.len]
    }

    pub fn path_of(&self, t: &SourceTensor) -> &Path {
        &self.shards[t.shard].path
    }

    /// Decodes rows `first..first+count` of a tensor seen as `[rows, row_len]` into `out`.
    pub fn read_rows(
        &self,
        t: &SourceTensor,
        row_len: usize,
        first: usize,
        count: usize,
        out: &mut [f32],
    ) {
        let es = t.dtype.size();
        let bytes = self.bytes(t);
        let start = first * row_len * es;
        t.dtype.decode(
            &bytes[start..start + count * row_len * es],
            &mut out[..count * row_len],
        );
    }

    /// Drops the resident pages of rows that have been converted.
    pub fn release_rows(&self, t: &SourceTensor, row_len: usize, first: usize, count: usize) {
        let es = t.dtype.size();
        let start = t.start + first * row_len * es;
        super::release_pages(&self.shards[t.shard].mmap, start, count * row_len * es);
    }
}
