//! The K/V of the layers that run on the CPU: one preallocated memory map (anonymous, or a
//! file with `--kv-file`), laid out `[layer, K|V, kv head, slot, head_dim]`, so that every
//! (layer, kind, head) is one contiguous array over the slots that attention reads in place.
//! Keys and values may be of different types, so their rows (and arrays) may differ in size.

use std::fs::{File, OpenOptions};
use std::path::Path;

use memmap2::{MmapMut, MmapOptions};

use super::cells::Move;
use super::claim::{claim, CacheFile, Claim, LIVE_MAGIC};
use super::{CacheShape, HeadView, Kv, KvTypes};
use crate::error::{Error, Result};

pub struct HostStore {
    /// Layers held here (the last ones; the first `first_layer` live on the device).
    n_layers: usize,
    first_layer: usize,
    n_kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    types: KvTypes,
    /// Bytes of one key row and of one value row.
    k_row: usize,
    v_row: usize,
    mmap: MmapMut,
    /// The `--kv-file`, held open for its lock while the map lives.
    _file: Option<File>,
    /// Reused staging buffer for moves.
    staging: Vec<u8>,
}

/// Bytes before the entries in a `--kv-file`: the header, padded to a page on every system we
/// build for (4, 16 or 64 KiB), so that the entries are mapped at a page-aligned offset.
pub const FILE_HEADER_BYTES: u64 = 64 << 10;
/// 2: the type code is a pair ([`KvTypes::code`]).
const FILE_VERSION: u32 = 2;

/// Opens (or creates) a `--kv-file` for a cache of `bytes` entry bytes. The path must be
/// absent, empty, or a cache of ours ([`claim`]): a new file is created exclusively, an
/// existing one is checked again through the open descriptor (so a file swapped in after the
/// claim is not taken), locked against a second refusion, then cleared and given this cache's
/// header. Returns the file (its lock lasts as long as it is open) and the map of the entries.
fn open_cache_file(
    p: &Path,
    shape: &CacheShape,
    first_layer: usize,
    types: KvTypes,
    bytes: usize,
) -> Result<(File, MmapMut)> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let io = |e: std::io::Error| Error::resource(format!("{}: {e}", p.display()));
    let file = match claim(p, CacheFile::Live, None)? {
        Claim::Absent => OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(p)
            .map_err(io)?,
        Claim::Empty | Claim::Ours => {
            let mut opts = OpenOptions::new();
            opts.read(true).write(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                // A link swapped in after the claim fails here (ELOOP), never followed.
                opts.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
            }
            let mut f = opts.open(p).map_err(io)?;
            let meta = f.metadata().map_err(io)?;
            let mut head = [0u8; 4];
            let ours = meta.is_file()
                && super::claim::links(&meta) == 1
                && (meta.len() == 0 || (f.read_exact(&mut head).is_ok() && &head == LIVE_MAGIC));
            if !ours {
                return Err(Error::resource(format!(
                    "{}: changed while being opened; refusing to overwrite it",
                    p.display()
                )));
            }
            f
        }
    };
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(Error::resource(format!(
                "{}: in use by another refusion (each run needs its own --kv-file)",
                p.display()
            )))
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
    }
    let len = bytes.max(1);
    let total = (len as u64)
        .checked_add(FILE_HEADER_BYTES)
        .ok_or_else(|| Error::resource("KV cache size overflows"))?;
    // Cleared first: the old entries are another run's and must not be read as ours.
    file.set_len(0).map_err(io)?;
    file.set_len(total).map_err(io)?;
    let mut header = Vec::with_capacity(48);
    header.extend_from_slice(LIVE_MAGIC);
    for v in [
        FILE_VERSION,
        types.code(),
        shape.n_layers as u32,
        first_layer as u32,
        shape.n_kv_heads as u32,
        shape.head_dim as u32,
    ] {
        header.extend_from_slice(&v.to_le_bytes());
    }
    header.extend_from_slice(&(shape.capacity as u64).to_le_bytes());
    header.extend_from_slice(&FILE_HEADER_BYTES.to_le_bytes());
    let mut w = &file;
    w.seek(SeekFrom::Start(0)).map_err(io)?;
    w.write_all(&header).map_err(io)?;
    // SAFETY: the file is ours (checked through this descriptor) and locked against another
    // refusion; the map covers the entries after the header, within the length just set.
    let map = unsafe {
        MmapOptions::new()
            .offset(FILE_HEADER_BYTES)
            .len(len)
            .map_mut(&file)
    }
    .map_err(io)?;
    Ok((file, map))
}

impl HostStore {
    /// The map for layers `first_layer..shape.n_layers`, backed by `path` when given (see
    /// `open_cache_file`; its pages are written as entries are). Anonymous memory is made
    /// resident now (`MAP_POPULATE`), as llama.cpp clears its cache buffer: the memory plan
    /// printed at load is then what the process holds, not a bound it grows into later.
    pub fn new(
        shape: &CacheShape,
        first_layer: usize,
        types: KvTypes,
        path: Option<&Path>,
    ) -> Result<HostStore> {
        let n_layers = shape.n_layers - first_layer;
        let bytes = (n_layers * shape.layer_bytes_per_token(types))
            .checked_mul(shape.capacity)
            .ok_or_else(|| Error::resource("KV cache size overflows"))?;
        let mut _file = None;
        let mmap = match path {
            None => MmapOptions::new()
                .len(bytes.max(1))
                .populate()
                .map_anon()
                .map_err(|e| {
                    Error::resource(format!(
                        "cannot reserve {bytes} bytes for the KV cache: {e}"
                    ))
                })?,
            Some(p) => {
                let (file, map) = open_cache_file(p, shape, first_layer, types, bytes)?;
                _file = Some(file);
                map
            }
        };
        Ok(HostStore {
            n_layers,
            first_layer,
            n_kv_heads: shape.n_kv_heads,
            head_dim: shape.head_dim,
            capacity: shape.capacity,
            types,
            k_row: types.k.kind().row_bytes(shape.head_dim),
            v_row: types.v.kind().row_bytes(shape.head_dim),
            mmap,
            _file,
            staging: Vec::new(),
        })
    }

    /// (layer, kind, kv head) arrays held here.
    pub fn heads(&self) -> usize {
        self.n_layers * 2 * self.n_kv_heads
    }

    fn head_index(&self, layer: usize, kind: Kv, kv_head: usize) -> usize {
        debug_assert!(
            layer >= self.first_layer,
            "layer {layer} lives on the device"
        );
        ((layer - self.first_layer) * 2 + kind as usize) * self.n_kv_heads + kv_head
    }

    /// Byte offset of (head array, slot): a layer's key arrays, then its value arrays.
    #[inline]
    fn offset(&self, head: usize, slot: usize) -> usize {
        let nkv = self.n_kv_heads;
        let (layer, kind, kv_head) = (head / (2 * nkv), head / nkv % 2, head % nkv);
        let layer_start = layer * nkv * self.capacity * (self.k_row + self.v_row);
        let (array_start, row) = match kind {
            0 => (layer_start, self.k_row),
            _ => (layer_start + nkv * self.capacity * self.k_row, self.v_row),
        };
        array_start + (kv_head * self.capacity + slot) * row
    }

    /// Bytes of one entry of head array `head` (its kind's row).
    #[inline]
    pub fn entry_bytes(&self, head: usize) -> usize {
        match head / self.n_kv_heads % 2 {
            0 => self.k_row,
            _ => self.v_row,
        }
    }

    /// All slots of one layer's K (or V) for one KV head.
    pub fn head(&self, layer: usize, kind: Kv, kv_head: usize) -> HeadView<'_> {
        let h = self.head_index(layer, kind, kv_head);
        let start = self.offset(h, 0);
        let len = self.capacity * self.entry_bytes(h);
        HeadView::new(
            self.types.of(kind).kind(),
            &self.mmap[start..start + len],
            self.head_dim,
        )
    }

    /// Writes one layer's new entries: `k` and `v` hold, for each slot in `slots`,
    /// `n_kv_heads * head_dim` values.
    pub fn write(&mut self, layer: usize, slots: &[usize], k: &[f32], v: &[f32]) {
        let (nkv, hd) = (self.n_kv_heads, self.head_dim);
        for (kind, src) in [(Kv::K, k), (Kv::V, v)] {
            let ty = self.types.of(kind).kind();
            for kvh in 0..nkv {
                let h = self.head_index(layer, kind, kvh);
                let eb = self.entry_bytes(h);
                for (i, &slot) in slots.iter().enumerate() {
                    let from = &src[(i * nkv + kvh) * hd..(i * nkv + kvh + 1) * hd];
                    let off = self.offset(h, slot);
                    ty.write_row(from, &mut self.mmap[off..off + eb]);
                }
            }
        }
    }

    /// Carries out a move: every source is staged first (a destination may hold another
    /// source), then written. Returns the entries that changed place.
    pub fn apply(&mut self, m: &Move) -> usize {
        let moved = m
            .src
            .iter()
            .enumerate()
            .filter(|&(i, &s)| s != m.dst + i)
            .count();
        if moved == 0 {
            return 0;
        }
        self.staging.clear();
        self.staging
            .reserve(m.src.len() * self.n_layers * self.n_kv_heads * (self.k_row + self.v_row));
        for head in 0..self.heads() {
            let eb = self.entry_bytes(head);
            for &s in &m.src {
                let off = self.offset(head, s);
                self.staging.extend_from_slice(&self.mmap[off..off + eb]);
            }
        }
        let mut staged = 0;
        for head in 0..self.heads() {
            let eb = self.entry_bytes(head);
            for k in 0..m.src.len() {
                let off = self.offset(head, m.dst + k);
                self.mmap[off..off + eb].copy_from_slice(&self.staging[staged..staged + eb]);
                staged += eb;
            }
        }
        moved
    }

    /// The bytes of entry `slot` of head array `head` (file order for saved prefixes).
    pub fn entry_raw(&self, head: usize, slot: usize) -> &[u8] {
        let off = self.offset(head, slot);
        &self.mmap[off..off + self.entry_bytes(head)]
    }

    /// Writes the bytes of entry `slot` of head array `head`.
    pub fn set_entry_raw(&mut self, head: usize, slot: usize, bytes: &[u8]) {
        let off = self.offset(head, slot);
        let eb = self.entry_bytes(head);
        self.mmap[off..off + eb].copy_from_slice(bytes);
    }

    pub fn flush(&self) -> Result<()> {
        self.mmap
            .flush()
            .map_err(|e| Error::resource(format!("flushing the KV cache: {e}")))
    }
}
