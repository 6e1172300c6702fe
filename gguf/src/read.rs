//! A validating GGUF reader over a memory map.
//!
//! Every count, length and offset read from the file is checked against the bytes that are
//! actually there before anything is allocated, so a corrupt or hostile file is a clear error,
//! never a huge allocation or a panic.

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::{align_up, GgmlType, Value, ValueType, DEFAULT_ALIGNMENT, MAGIC};

/// Arrays nested deeper than this are refused (llama.cpp writes none).
const MAX_ARRAY_DEPTH: usize = 4;
const MAX_DIMS: u32 = 4;

#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGML order: `ne[0]` is the contiguous (row) dimension.
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Number of rows (all dimensions but the first).
    pub fn n_rows(&self) -> u64 {
        self.ne.iter().skip(1).product()
    }
}

/// Everything before the tensor data: version, metadata in file order, tensor infos.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

/// The magic and the version (2 and 3 share a layout; 1 and big-endian files are refused).
fn read_version(r: &mut Cursor<'_>) -> std::result::Result<u32, String> {
    let magic = r
        .take(4)
        .map_err(|_| "file too short to be GGUF".to_string())?;
    if magic != MAGIC {
        return Err(format!(
            "not a GGUF file (magic {:02x?}, expected \"GGUF\")",
            magic
        ));
    }
    match r.u32()? {
        v @ (2 | 3) => Ok(v),
        1 => Err(
            "GGUF version 1 is not supported (convert it again with a current llama.cpp)".into(),
        ),
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            Err("big-endian GGUF files are not supported".into())
        }
        v => Err(format!("unsupported GGUF version {v}")),
    }
}

/// `n_kv` metadata entries, each key once.
fn read_metadata(
    r: &mut Cursor<'_>,
    n_kv: u64,
) -> std::result::Result<Vec<(String, Value)>, String> {
    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut keys = HashSet::new();
    for i in 0..n_kv {
        let key = r.string().map_err(|e| format!("metadata entry {i}: {e}"))?;
        let ty = r.u32()?;
        let ty = ValueType::from_id(ty)
            .ok_or_else(|| format!("metadata key '{key}': unknown value type {ty}"))?;
        let value = r
            .value(ty, 0)
            .map_err(|e| format!("metadata key '{key}': {e}"))?;
        if !keys.insert(key.clone()) {
            return Err(format!("metadata key '{key}' appears twice"));
        }
        metadata.push((key, value));
    }
    Ok(metadata)
}

/// Tensor info `i`: its shape (1 to `MAX_DIMS` dimensions, none zero, the element and byte
/// counts without overflow, rows of whole blocks), type and aligned offset.
fn read_tensor_info(
    r: &mut Cursor<'_>,
    i: u64,
    alignment: u64,
) -> std::result::Result<TensorInfo, String> {
    let name = r.string().map_err(|e| format!("tensor info {i}: {e}"))?;
    let n_dims = r.u32()?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(format!(
            "tensor '{name}': {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
        ));
    }
    let mut ne = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        ne.push(r.u64()?);
    }
    let ty_id = r.u32()?;
    let ty = GgmlType::from_id(ty_id)
        .ok_or_else(|| format!("tensor '{name}': unsupported tensor type id {ty_id}"))?;
    let offset = r.u64()?;
    if ne.contains(&0) {
        return Err(format!("tensor '{name}': a dimension is zero ({ne:?})"));
    }
    let n_elements = ne
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("tensor '{name}': element count overflows ({ne:?})"))?;
    let row_bytes = ty.row_bytes(ne[0]).ok_or_else(|| {
        format!(
            "tensor '{name}': row length {} is not a multiple of the {} block size {}",
            ne[0],
            ty,
            ty.block_size()
        )
    })?;
    let n_bytes = row_bytes
        .checked_mul(n_elements / ne[0])
        .ok_or_else(|| format!("tensor '{name}': byte size overflows"))?;
    if offset % alignment != 0 {
        return Err(format!(
            "tensor '{name}': offset {offset} is not aligned to {alignment}"
        ));
    }
    Ok(TensorInfo {
        name,
        ne,
        ty,
        offset,
        n_bytes,
    })
}

/// Every tensor's data inside the data section (`data_len` bytes) and none overlapping.
fn check_placement(tensors: &[TensorInfo], data_len: u64) -> std::result::Result<(), String> {
    for t in tensors {
        let end = t
            .offset
            .checked_add(t.n_bytes)
            .ok_or("tensor end overflows")?;
        if end > data_len {
            return Err(format!(
                "tensor '{}' ({} bytes at data offset {}) extends past the end of the file (truncated?)",
                t.name, t.n_bytes, t.offset
            ));
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    for w in by_offset.windows(2) {
        if w[0].offset + w[0].n_bytes > w[1].offset {
            return Err(format!(
                "tensors '{}' and '{}' overlap",
                w[0].name, w[1].name
            ));
        }
    }
    Ok(())
}

impl GgufHeader {
    /// Parses and validates the header of a GGUF file held entirely in `bytes`.
    pub fn parse(bytes: &[u8]) -> std::result::Result<GgufHeader, String> {
        let mut r = Cursor { bytes, pos: 0 };
        let version = read_version(&mut r)?;
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        // Each metadata entry takes at least 8 (key length) + 4 (type) + 1 bytes, each tensor
        // info at least 8 + 4 + 8 + 4 + 8: bound the counts by the bytes left.
        if n_kv > (r.remaining() / 13) as u64 {
            return Err(format!(
                "metadata count {n_kv} is larger than the file can hold"
            ));
        }
        if n_tensors > (r.remaining() / 32) as u64 {
            return Err(format!(
                "tensor count {n_tensors} is larger than the file can hold"
            ));
        }
        let metadata = read_metadata(&mut r, n_kv)?;
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(a))) if *a > 0 && a.is_power_of_two() => *a as u64,
            Some((_, other)) => {
                return Err(format!(
                    "general.alignment must be a power-of-two u32, got {other}"
                ))
            }
        };
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names = HashSet::new();
        for i in 0..n_tensors {
            let t = read_tensor_info(&mut r, i, alignment)?;
            if !names.insert(t.name.clone()) {
                return Err(format!("tensor '{}' appears twice", t.name));
            }
            tensors.push(t);
        }
        let data_offset = align_up(r.pos as u64, alignment).ok_or("data offset overflows")?;
        if data_offset > bytes.len() as u64 && !tensors.is_empty() {
            return Err("file ends before its tensor data section".into());
        }
        check_placement(&tensors, (bytes.len() as u64).saturating_sub(data_offset))?;
        Ok(GgufHeader {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// A memory-mapped GGUF file with a validated header.
pub struct GgufFile {
    pub path: PathBuf,
    pub header: GgufHeader,
    mmap: Mmap,
    /// The open file, for reads that should not map pages ([`GgufFile::read_tensor_bytes`]).
    file: File,
    /// [`GgufFile::layout_hash`], computed at open (before the header's pages are released).
    layout_hash: u64,
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        if path.is_dir() {
            return Err(Error::bad(
                path,
                "is a directory, not a GGUF file: a Hugging Face folder? convert it first \
                 (refusion convert DIR)",
            ));
        }
        let file = crate::files::open_regular(path)?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len == 0 {
            return Err(Error::bad(path, "file is empty"));
        }
        // SAFETY: the map is read-only; a file changed underneath us while mapped can only
        // give wrong numbers (every offset was bounds-checked against the mapped length).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let header = GgufHeader::parse(&mmap).map_err(|msg| Error::bad(path, msg))?;
        let layout_hash = fnv1a(&mmap[..(header.data_offset as usize).min(mmap.len())]);
        // The header is parsed into owned values and hashed: its pages (megabytes of
        // vocabulary) need not stay resident.
        crate::files::release_pages(&mmap, 0, header.data_offset as usize);
        Ok(GgufFile {
            path: path.to_path_buf(),
            header,
            mmap,
            file,
            layout_hash,
        })
    }

    /// `--check-tensors`: every tensor's data (float values, quantized blocks' scales) must be
    /// finite. Reads the whole file, the tensors in parallel; the first bad one in file order
    /// is named ("blk.3.ffn_up.weight holds NaN").
    pub fn check_tensors(&self) -> Result<()> {
        use rayon::prelude::*;
        let bad = self
            .header
            .tensors
            .par_iter()
            .map(|t| {
                let r = super::check::check_data(t.ty, self.tensor_data(t));
                self.release(t, 0, t.n_bytes);
                r.err().map(|e| format!("{} {e}", t.name))
            })
            .collect::<Vec<_>>();
        match bad.into_iter().flatten().next() {
            Some(msg) => Err(Error::bad(&self.path, msg)),
            None => Ok(()),
        }
    }

    /// The raw bytes of a tensor (bounds were checked when the header was parsed).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.header.data_offset + t.offset) as usize;
        &self.mmap[start..start + t.n_bytes as usize]
    }

    /// A 64-bit FNV-1a hash of everything before the tensor data: the metadata and the tensor
    /// layout (names, types, shapes, offsets). Identifies the model for saved KV caches.
    pub fn layout_hash(&self) -> u64 {
        self.layout_hash
    }

    /// Copies `buf.len()` bytes of a tensor's data from `offset` with a read from the file,
    /// not through the map: a few scattered rows (embedding lookups) would otherwise map
    /// whole large folios (2 MiB each on ext4 with Linux 6.x) into this process's resident
    /// memory. Bounds are checked.
    pub fn read_tensor_bytes(&self, t: &TensorInfo, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > t.n_bytes) {
            return Err(Error::bad(
                &self.path,
                format!("a read past the end of tensor {}", t.name),
            ));
        }
        let start = self.header.data_offset + t.offset + offset;
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            self.file
                .read_exact_at(buf, start)
                .map_err(|e| Error::io(&self.path, e))
        }
        #[cfg(not(unix))]
        {
            let start = start as usize;
            buf.copy_from_slice(&self.mmap[start..start + buf.len()]);
            Ok(())
        }
    }

    pub fn file_len(&self) -> u64 {
        self.mmap.len() as u64
    }

    /// Tells the kernel that `len` bytes of a tensor's data from `offset` are no longer
    /// needed, so that a streaming pass over a large file does not keep it all resident.
    pub fn release(&self, t: &TensorInfo, offset: u64, len: u64) {
        let start = self.header.data_offset + t.offset + offset;
        crate::files::release_pages(&self.mmap, start as usize, len.min(t.n_bytes) as usize);
    }
}

/// 64-bit FNV-1a, fed in pieces.
#[derive(Debug, Clone, Copy)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    pub fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub fn finish(self) -> u64 {
        self.0
    }
}

/// 64-bit FNV-1a of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = Fnv1a::default();
    h.update(bytes);
    h.finish()
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "unexpected end of file at byte {} (needed {n} more bytes, {} left)",
                self.pos,
                self.remaining()
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        let len = self.u64()?;
        if len > self.remaining() as u64 {
            return Err(format!(
                "string length {len} exceeds the {} bytes left",
                self.remaining()
            ));
        }
        let raw = self.take(len as usize)?;
        String::from_utf8(raw.to_vec()).map_err(|_| "string is not valid UTF-8".to_string())
    }

    fn value(&mut self, ty: ValueType, depth: usize) -> std::result::Result<Value, String> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>()?[0]),
            ValueType::I8 => Value::I8(self.array::<1>()?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array()?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array()?)),
            ValueType::U32 => Value::U32(self.u32()?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array()?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array()?)),
            ValueType::Bool => match self.array::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("bool value {b} is neither 0 nor 1")),
            },
            ValueType::String => Value::String(self.string()?),
            ValueType::U64 => Value::U64(self.u64()?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array()?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array()?)),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err("arrays nested too deeply".into());
                }
                let elem = self.u32()?;
                let elem = ValueType::from_id(elem)
                    .ok_or_else(|| format!("unknown array element type {elem}"))?;
                let n = self.u64()?;
                let min = elem.min_encoded_size() as u64;
                if n.checked_mul(min)
                    .is_none_or(|b| b > self.remaining() as u64)
                {
                    return Err(format!(
                        "array of {n} elements is larger than the file can hold"
                    ));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}
