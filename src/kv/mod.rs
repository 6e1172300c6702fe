//! The KV cache: one preallocated, memory-mapped buffer for the whole context (anonymous by
//! default, file-backed with `--kv-file`), holding K (after RoPE) and V of every layer.
//!
//! It has two parts:
//! - the *shared* prefix, entries `0..shared_len()` in cache order, which every row attends to
//!   and which is read in place, never copied per row;
//! - *private* entries per row: each forward appends the K/V of its new tokens to their rows
//!   (HF's `use_cache=True`), and the decoder then truncates the rows, commits chosen entries
//!   into the shared prefix in a given order (the reference's `full_update`), or drops them.
//!
//! Private entries live in slots after the shared prefix; a row is a list of slot indices.
//! Cropping is O(1); committing copies only the committed entries.
//!
//! With `-ngl`, the first layers run on an accelerator and their K/V live there, as one
//! `[n_kv_heads, capacity, head_dim]` tensor per layer for K and one for V, with the same slot
//! numbering; the map then holds only the layers that run on the CPU. Every operation below
//! acts on both parts alike (on the device by gathers and in-place slice writes: the shared
//! prefix is never replicated per row there either).

use std::fs::OpenOptions;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use half::f16;
use memmap2::MmapMut;

use crate::error::{Error, Result};

/// Element type of the cache (`--cache-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheType {
    F32,
    F16,
}

impl CacheType {
    pub fn size(self) -> usize {
        match self {
            CacheType::F32 => 4,
            CacheType::F16 => 2,
        }
    }

    /// The element type of device-resident layers.
    pub fn dtype(self) -> DType {
        match self {
            CacheType::F32 => DType::F32,
            CacheType::F16 => DType::F16,
        }
    }
}

impl std::str::FromStr for CacheType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(CacheType::F32),
            "f16" => Ok(CacheType::F16),
            _ => Err(format!("unknown cache type '{s}' (expected f32 or f16)")),
        }
    }
}

/// The cache's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Entries (tokens) the buffer holds: shared prefix plus private slots.
    pub capacity: usize,
}

impl CacheShape {
    pub fn bytes_per_token(&self, ty: CacheType) -> usize {
        self.n_layers * self.layer_bytes_per_token(ty)
    }

    /// K and V of one layer for one token.
    pub fn layer_bytes_per_token(&self, ty: CacheType) -> usize {
        2 * self.n_kv_heads * self.head_dim * ty.size()
    }
}

/// The K and V tensors of one device-resident layer, `[n_kv_heads, capacity, head_dim]`.
pub struct DeviceLayer {
    pub k: Tensor,
    pub v: Tensor,
}

/// Read access to one layer's K or V for one KV head: `head_dim` elements per slot.
pub enum HeadView<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

pub struct KvCache {
    shape: CacheShape,
    ty: CacheType,
    /// Layers `0..device.len()` live on the device; the map holds the others.
    device: Vec<DeviceLayer>,
    mmap: MmapMut,
    shared: usize,
    shared_pos: Vec<u32>,
    /// Private slots of each row, in order.
    rows: Vec<Vec<usize>>,
    /// Position id of every slot (shared and private).
    slot_pos: Vec<u32>,
    /// Private slot allocation: bump pointer over `shared..capacity` plus freed slots.
    next_free: usize,
    free: Vec<usize>,
    /// Reused staging buffer for commits.
    staging: Vec<u8>,
    /// Bytes of K/V written into the cache or copied within it, over its life (see
    /// [`KvCache::bytes_moved`]).
    moved: u64,
}

impl KvCache {
    /// An anonymous (RAM/swap-backed) cache. Pages are only touched as entries are written.
    pub fn new(shape: CacheShape, ty: CacheType) -> Result<KvCache> {
        Self::placed(shape, ty, None, None)
    }

    /// A cache backed by the file at `path` (created or truncated to the cache's size).
    pub fn with_file(shape: CacheShape, ty: CacheType, path: &Path) -> Result<KvCache> {
        Self::placed(shape, ty, Some(path), None)
    }

    /// A cache whose first `n` layers live on `device` (zeroed there); the others in a map,
    /// anonymous or backed by the file at `path`.
    pub fn placed(
        shape: CacheShape,
        ty: CacheType,
        path: Option<&Path>,
        device_layers: Option<(&Device, usize)>,
    ) -> Result<KvCache> {
        let n_device = device_layers.map_or(0, |(_, n)| n.min(shape.n_layers));
        let host = CacheShape {
            n_layers: shape.n_layers - n_device,
            ..shape
        };
        let mut device = Vec::with_capacity(n_device);
        if let Some((dev, _)) = device_layers {
            let dims = (shape.n_kv_heads, shape.capacity, shape.head_dim);
            for l in 0..n_device {
                let zeros = || {
                    Tensor::zeros(dims, ty.dtype(), dev).map_err(|e| {
                        Error::msg(format!(
                            "cannot allocate the KV cache of layer {l} on {:?}: {e}",
                            dev.location()
                        ))
                    })
                };
                device.push(DeviceLayer {
                    k: zeros()?,
                    v: zeros()?,
                });
            }
        }
        let mut cache = match path {
            Some(p) => Self::map_file(host, ty, p)?,
            None => Self::map_anon(host, ty)?,
        };
        cache.shape = shape;
        cache.device = device;
        Ok(cache)
    }

    fn map_anon(shape: CacheShape, ty: CacheType) -> Result<KvCache> {
        let bytes = Self::total_bytes(&shape, ty)?;
        let mmap = MmapMut::map_anon(bytes.max(1)).map_err(|e| {
            Error::msg(format!(
                "cannot reserve {bytes} bytes for the KV cache: {e}"
            ))
        })?;
        Ok(Self::with_map(shape, ty, mmap))
    }

    fn map_file(shape: CacheShape, ty: CacheType, path: &Path) -> Result<KvCache> {
        let bytes = Self::total_bytes(&shape, ty)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| Error::msg(format!("{}: {e}", path.display())))?;
        file.set_len(bytes as u64)
            .map_err(|e| Error::msg(format!("{}: {e}", path.display())))?;
        // SAFETY: the file was just created for this cache; nothing else maps it.
        let mmap = unsafe { MmapMut::map_mut(&file) }
            .map_err(|e| Error::msg(format!("{}: {e}", path.display())))?;
        Ok(Self::with_map(shape, ty, mmap))
    }

    fn total_bytes(shape: &CacheShape, ty: CacheType) -> Result<usize> {
        shape
            .bytes_per_token(ty)
            .checked_mul(shape.capacity)
            .ok_or_else(|| Error::msg("KV cache size overflows"))
    }

    fn with_map(shape: CacheShape, ty: CacheType, mmap: MmapMut) -> KvCache {
        KvCache {
            shape,
            ty,
            device: Vec::new(),
            mmap,
            shared: 0,
            shared_pos: Vec::new(),
            rows: Vec::new(),
            slot_pos: vec![0; shape.capacity],
            next_free: 0,
            free: Vec::new(),
            staging: Vec::new(),
            moved: 0,
        }
    }

    pub fn shape(&self) -> CacheShape {
        self.shape
    }

    pub fn cache_type(&self) -> CacheType {
        self.ty
    }

    /// Bytes of K/V this cache has written or copied: new entries, and entries moved by commits
    /// (staged, then written), compaction and loads. What a forward costs the cache is thus
    /// visible: it grows with the entries written and committed, never with the shared prefix
    /// every row reads in place.
    pub fn bytes_moved(&self) -> u64 {
        self.moved
    }

    /// Layers whose K/V live on the device (`0..n`).
    pub fn device_layers(&self) -> usize {
        self.device.len()
    }

    /// The K/V tensors of device-resident layer `layer`.
    pub fn device_layer(&self, layer: usize) -> &DeviceLayer {
        &self.device[layer]
    }

    /// Key/value heads held in the map (layers after the device-resident ones).
    fn host_heads(&self) -> usize {
        (self.shape.n_layers - self.device.len()) * 2 * self.shape.n_kv_heads
    }

    /// Entries in the shared prefix.
    pub fn shared_len(&self) -> usize {
        self.shared
    }

    /// Position ids of the shared prefix, in cache order.
    pub fn shared_positions(&self) -> &[u32] {
        &self.shared_pos
    }

    pub fn n_rows(&self) -> usize {
        self.rows.len()
    }

    /// Private entries of row `r` (0 for a row that does not exist).
    pub fn row_len(&self, r: usize) -> usize {
        self.rows.get(r).map_or(0, Vec::len)
    }

    /// Private slots of row `r`, in order.
    pub fn row_slots(&self, r: usize) -> &[usize] {
        self.rows.get(r).map_or(&[], Vec::as_slice)
    }

    /// Position id of a slot.
    pub fn slot_position(&self, slot: usize) -> u32 {
        self.slot_pos[slot]
    }

    fn used_private(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }

    /// Free entries: what a forward may still add.
    pub fn available(&self) -> usize {
        self.shape.capacity - self.shared - self.used_private()
    }

    /// Appends one new entry per token to its row and returns the slots, in batch order.
    /// Rows are created as needed. Fails, changing nothing, when the context is full.
    pub fn allocate(&mut self, rows: &[u32], positions: &[u32]) -> Result<Vec<usize>> {
        if rows.len() > self.available() {
            return Err(Error::ContextFull {
                needed: self.shared + self.used_private() + rows.len(),
                capacity: self.shape.capacity,
            });
        }
        let mut slots = Vec::with_capacity(rows.len());
        for (&r, &p) in rows.iter().zip(positions) {
            let slot = match self.free.pop() {
                Some(s) => s,
                None => {
                    self.next_free += 1;
                    self.next_free - 1
                }
            };
            let r = r as usize;
            if self.rows.len() <= r {
                self.rows.resize_with(r + 1, Vec::new);
            }
            self.rows[r].push(slot);
            self.slot_pos[slot] = p;
            slots.push(slot);
        }
        Ok(slots)
    }

    /// Keeps the first `n` private entries of every row (HF's `crop(shared + n)`).
    pub fn truncate_rows(&mut self, n: usize) {
        for row in &mut self.rows {
            if row.len() > n {
                self.free.extend(row.drain(n..));
            }
        }
    }

    /// Keeps rows `0..n` and drops the others (HF's `batch_select_minibatch(n)`).
    pub fn retain_rows(&mut self, n: usize) {
        if self.rows.len() > n {
            for row in self.rows.drain(n..) {
                self.free.extend(row);
            }
        }
    }

    /// Drops every private entry.
    pub fn clear_rows(&mut self) {
        self.rows.clear();
        self.free.clear();
        self.next_free = self.shared;
    }

    /// Truncates the shared prefix to `n` entries (O(1)) and drops every private entry.
    pub fn crop(&mut self, n: usize) {
        let n = n.min(self.shared);
        self.shared = n;
        self.shared_pos.truncate(n);
        self.clear_rows();
    }

    /// Appends the given private entries, `(row, index in row)`, to the shared prefix in the
    /// given order, then drops every private entry. Only the committed entries are copied.
    pub fn commit(&mut self, entries: &[(usize, usize)]) -> Result<()> {
        let mut slots = Vec::with_capacity(entries.len());
        for &(r, i) in entries {
            let slot = *self.rows.get(r).and_then(|row| row.get(i)).ok_or_else(|| {
                Error::msg(format!(
                    "commit of entry {i} of row {r}, which does not exist"
                ))
            })?;
            slots.push(slot);
        }
        let es = self.ty.size();
        let hd = self.shape.head_dim;
        let n_heads = self.host_heads();
        let entry_bytes = hd * es;
        self.device_move(&slots, self.shared)?;
        // Stage the entries first: a destination slot may hold another committed entry.
        self.staging.clear();
        self.staging.reserve(slots.len() * n_heads * entry_bytes);
        for head in 0..n_heads {
            for &s in &slots {
                let off = self.offset(head, s) * es;
                self.staging
                    .extend_from_slice(&self.mmap[off..off + entry_bytes]);
            }
        }
        let positions: Vec<u32> = slots.iter().map(|&s| self.slot_pos[s]).collect();
        self.moved += 2 * (slots.len() * self.shape.bytes_per_token(self.ty)) as u64;
        self.clear_rows();
        let base = self.shared;
        for head in 0..n_heads {
            for k in 0..slots.len() {
                let off = self.offset(head, base + k) * es;
                let src = (head * slots.len() + k) * entry_bytes;
                self.mmap[off..off + entry_bytes]
                    .copy_from_slice(&self.staging[src..src + entry_bytes]);
            }
        }
        for (k, &p) in positions.iter().enumerate() {
            self.slot_pos[base + k] = p;
        }
        self.shared += slots.len();
        self.shared_pos.extend_from_slice(&positions);
        self.next_free = self.shared;
        Ok(())
    }

    /// Commits every private entry of row `r` (in order) and drops the rest.
    pub fn commit_row(&mut self, r: usize) -> Result<()> {
        let entries: Vec<(usize, usize)> = (0..self.row_len(r)).map(|i| (r, i)).collect();
        self.commit(&entries)
    }

    /// Removes shared entries for which `keep(index, position)` is false, compacting the rest
    /// in order (e.g. positions after an EOS before the next chat turn). Drops private entries.
    pub fn retain_shared(&mut self, mut keep: impl FnMut(usize, u32) -> bool) -> Result<()> {
        let es = self.ty.size();
        let entry_bytes = self.shape.head_dim * es;
        let n_heads = self.host_heads();
        let kept: Vec<usize> = (0..self.shared)
            .filter(|&i| keep(i, self.shared_pos[i]))
            .collect();
        let shifted = kept
            .iter()
            .enumerate()
            .filter(|&(dst, &src)| dst != src)
            .count();
        self.moved += (shifted * self.shape.bytes_per_token(self.ty)) as u64;
        if shifted > 0 {
            self.device_move(&kept, 0)?;
        }
        for head in 0..n_heads {
            for (dst, &src) in kept.iter().enumerate() {
                if dst != src {
                    let (from, to) = (self.offset(head, src) * es, self.offset(head, dst) * es);
                    self.mmap.copy_within(from..from + entry_bytes, to);
                }
            }
        }
        self.shared_pos = kept.iter().map(|&i| self.shared_pos[i]).collect();
        for (dst, &p) in self.shared_pos.iter().enumerate() {
            self.slot_pos[dst] = p;
        }
        self.shared = kept.len();
        self.clear_rows();
        Ok(())
    }

    /// Element offset of (head index over layer×{K,V}×kv-head, slot).
    #[inline]
    fn offset(&self, head: usize, slot: usize) -> usize {
        (head * self.shape.capacity + slot) * self.shape.head_dim
    }

    /// Index of a host-resident head in the map: layers count from the first host layer.
    #[inline]
    fn head_index(&self, layer: usize, is_v: bool, kv_head: usize) -> usize {
        debug_assert!(
            layer >= self.device.len(),
            "layer {layer} lives on the device"
        );
        ((layer - self.device.len()) * 2 + is_v as usize) * self.shape.n_kv_heads + kv_head
    }

    /// All slots of one host-resident layer's K (or V) for one KV head.
    pub fn head(&self, layer: usize, is_v: bool, kv_head: usize) -> HeadView<'_> {
        let h = self.head_index(layer, is_v, kv_head);
        let start = self.offset(h, 0);
        let len = self.shape.capacity * self.shape.head_dim;
        match self.ty {
            CacheType::F32 => {
                let all: &[f32] = bytemuck::cast_slice(&self.mmap[..]);
                HeadView::F32(&all[start..start + len])
            }
            CacheType::F16 => {
                let all: &[f16] = bytemuck::cast_slice(&self.mmap[..]);
                HeadView::F16(&all[start..start + len])
            }
        }
    }

    /// Writes the K and V of new entries of a device-resident layer. `k` and `v` are
    /// `[n, n_kv_heads, head_dim]` f32 on the device; `index` is [`KvCache::device_index`] of the
    /// slots the entries go to.
    pub fn write_device(
        &mut self,
        layer: usize,
        index: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        self.moved += (k.dim(0)? * self.shape.layer_bytes_per_token(self.ty)) as u64;
        let dl = &self.device[layer];
        for (dst, src) in [(&dl.k, k), (&dl.v, v)] {
            let src = src
                .transpose(0, 1)?
                .to_dtype(self.ty.dtype())?
                .contiguous()?;
            dst.scatter_set(index, &src, 1)?;
        }
        Ok(())
    }

    /// The scatter index for [`KvCache::write_device`]: `slots` broadcast to
    /// `[n_kv_heads, n, head_dim]` (built once per forward, used by every device layer).
    pub fn device_index(&self, slots: &[usize], device: &Device) -> Result<Tensor> {
        let (nkv, hd) = (self.shape.n_kv_heads, self.shape.head_dim);
        let ids: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
        Ok(Tensor::from_vec(ids, (1, slots.len(), 1), device)?
            .broadcast_as((nkv, slots.len(), hd))?
            .contiguous()?)
    }

    /// One entry (`head_dim` values as f32) of any layer, wherever it lives. For tests and
    /// tools, not the forward.
    pub fn entry(&self, layer: usize, is_v: bool, kv_head: usize, slot: usize) -> Result<Vec<f32>> {
        let hd = self.shape.head_dim;
        if layer < self.device.len() {
            let t = if is_v {
                &self.device[layer].v
            } else {
                &self.device[layer].k
            };
            return Ok(t
                .get(kv_head)?
                .get(slot)?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?);
        }
        Ok(match self.head(layer, is_v, kv_head) {
            HeadView::F32(h) => h[slot * hd..(slot + 1) * hd].to_vec(),
            HeadView::F16(h) => h[slot * hd..(slot + 1) * hd]
                .iter()
                .map(|x| x.to_f32())
                .collect(),
        })
    }

    /// Writes the K and V of new entries of one host-resident layer: `k` and `v` hold, for
    /// each slot in `slots`, `n_kv_heads * head_dim` values.
    pub fn write(&mut self, layer: usize, slots: &[usize], k: &[f32], v: &[f32]) {
        let (nkv, hd) = (self.shape.n_kv_heads, self.shape.head_dim);
        self.moved += (slots.len() * self.shape.layer_bytes_per_token(self.ty)) as u64;
        for (is_v, src) in [(false, k), (true, v)] {
            for kvh in 0..nkv {
                let h = self.head_index(layer, is_v, kvh);
                for (i, &slot) in slots.iter().enumerate() {
                    let from = &src[(i * nkv + kvh) * hd..(i * nkv + kvh + 1) * hd];
                    let off = self.offset(h, slot);
                    match self.ty {
                        CacheType::F32 => {
                            let all: &mut [f32] = bytemuck::cast_slice_mut(&mut self.mmap[..]);
                            all[off..off + hd].copy_from_slice(from);
                        }
                        CacheType::F16 => {
                            let all: &mut [f16] = bytemuck::cast_slice_mut(&mut self.mmap[..]);
                            for (d, &x) in all[off..off + hd].iter_mut().zip(from) {
                                *d = f16::from_f32(x);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Slot numbers as an index tensor on the cache's device.
    fn device_ids(&self, slots: &[usize]) -> Result<Tensor> {
        let ids: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
        Ok(Tensor::from_vec(
            ids,
            slots.len(),
            self.device[0].k.device(),
        )?)
    }

    /// Copies the entries in `slots`, in order, of every device layer to slots `dst..`: a
    /// gather (which is the staging copy, so sources and destinations may overlap) and an
    /// in-place write.
    fn device_move(&self, slots: &[usize], dst: usize) -> Result<()> {
        if slots.is_empty() || self.device.is_empty() {
            return Ok(());
        }
        let ids = self.device_ids(slots)?;
        for layer in &self.device {
            for t in [&layer.k, &layer.v] {
                t.slice_set(&t.index_select(&ids, 1)?, 1, dst)?;
            }
        }
        Ok(())
    }

    /// The K/V of the given slots of every device layer, as little-endian bytes in file order
    /// (layer, K then V, KV head, entry).
    fn device_entries(&self, slots: &[usize]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        if self.device.is_empty() || slots.is_empty() {
            return Ok(out);
        }
        let ids = self.device_ids(slots)?;
        for layer in &self.device {
            for t in [&layer.k, &layer.v] {
                let g = t.index_select(&ids, 1)?.flatten_all()?;
                match self.ty {
                    CacheType::F32 => {
                        for x in g.to_vec1::<f32>()? {
                            out.extend_from_slice(&x.to_le_bytes());
                        }
                    }
                    CacheType::F16 => {
                        for x in g.to_vec1::<f16>()? {
                            out.extend_from_slice(&x.to_le_bytes());
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Flushes a file-backed cache to disk.
    pub fn flush(&self) -> Result<()> {
        self.mmap
            .flush()
            .map_err(|e| Error::msg(format!("flushing the KV cache: {e}")))
    }
}

/// A saved prefix read back by [`KvCache::load_prefix`].
#[derive(Debug, Clone, PartialEq)]
pub struct SavedPrefix {
    /// The token at each position `0..n`.
    pub tokens: Vec<u32>,
    /// Caller data stored alongside (e.g. a chat's messages).
    pub extra: Vec<u8>,
}

const SAVE_MAGIC: &[u8; 4] = b"RFKV";
const SAVE_VERSION: u32 = 1;
const SAVE_HEADER: usize = 4 + 4 + 8 + 4 * 4 + 8 * 3;

impl KvCache {
    /// Writes the shared entries at positions `0..tokens.len()` (their K/V, positions and tokens)
    /// and `extra` to `path`, atomically (a temporary file, then a rename). `model_hash` ties
    /// the file to the model ([`refusion_convert::gguf::GgufFile::layout_hash`]).
    pub fn save_prefix(
        &self,
        path: &Path,
        model_hash: u64,
        tokens: &[u32],
        extra: &[u8],
    ) -> Result<()> {
        let n = tokens.len();
        let entries: Vec<usize> = (0..self.shared)
            .filter(|&i| (self.shared_pos[i] as usize) < n)
            .collect();
        if entries.len() != n {
            return Err(Error::msg(format!(
                "the cache holds {} of the {n} positions to save",
                entries.len()
            )));
        }
        let es = self.ty.size();
        let entry_bytes = self.shape.head_dim * es;
        let n_heads = self.host_heads();
        // Device layers come first in the file (layer order): copy their entries back once.
        let device_payload = self.device_entries(&entries)?;
        let tokens_le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let positions_le: Vec<u8> = entries
            .iter()
            .flat_map(|&i| self.shared_pos[i].to_le_bytes())
            .collect();
        // The K/V entries are read straight from the cache, once for the checksum and once for
        // the file: no copy of the payload is built.
        let entry = |head: usize, i: usize| {
            let off = self.offset(head, i) * es;
            &self.mmap[off..off + entry_bytes]
        };
        let mut sum = refusion_convert::gguf::Fnv1a::default();
        for part in [
            &tokens_le[..],
            &positions_le[..],
            extra,
            &device_payload[..],
        ] {
            sum.update(part);
        }
        for head in 0..n_heads {
            for &i in &entries {
                sum.update(entry(head, i));
            }
        }
        let mut header = Vec::with_capacity(SAVE_HEADER);
        header.extend_from_slice(SAVE_MAGIC);
        header.extend_from_slice(&SAVE_VERSION.to_le_bytes());
        header.extend_from_slice(&model_hash.to_le_bytes());
        for v in [
            matches!(self.ty, CacheType::F16) as u32,
            self.shape.n_layers as u32,
            self.shape.n_kv_heads as u32,
            self.shape.head_dim as u32,
        ] {
            header.extend_from_slice(&v.to_le_bytes());
        }
        header.extend_from_slice(&(n as u64).to_le_bytes());
        header.extend_from_slice(&(extra.len() as u64).to_le_bytes());
        header.extend_from_slice(&sum.finish().to_le_bytes());

        let io = |e: std::io::Error| Error::msg(format!("{}: {e}", path.display()));
        let mut out = refusion_convert::output::AtomicFile::create(path)?;
        {
            use std::io::Write;
            let mut w = std::io::BufWriter::new(out.file());
            for part in [
                &header[..],
                &tokens_le[..],
                &positions_le[..],
                extra,
                &device_payload[..],
            ] {
                w.write_all(part).map_err(io)?;
            }
            for head in 0..n_heads {
                for &i in &entries {
                    w.write_all(entry(head, i)).map_err(io)?;
                }
            }
            w.flush().map_err(io)?;
        }
        out.commit()?;
        Ok(())
    }

    /// Replaces the cache's contents with a saved prefix. Any mismatch (another model, cache
    /// type or shape, a truncated or corrupt file) is an error naming the problem, and leaves
    /// the cache empty.
    pub fn load_prefix(&mut self, path: &Path, model_hash: u64) -> Result<SavedPrefix> {
        self.crop(0);
        let bad = |m: &str| Error::msg(format!("{}: {m}", path.display()));
        let io = |e: std::io::Error| Error::msg(format!("{}: {e}", path.display()));
        let file = std::fs::File::open(path).map_err(io)?;
        if file.metadata().map_err(io)?.len() < SAVE_HEADER as u64 {
            return Err(bad("not a refusion KV cache file (too short)"));
        }
        // SAFETY: a read-only map of a file we only read; every offset is checked against its
        // length before use.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let bytes: &[u8] = &map;
        if bytes.len() < SAVE_HEADER || &bytes[..4] != SAVE_MAGIC {
            return Err(bad("not a refusion KV cache file"));
        }
        let u32_at =
            |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&bytes[o..o + 8]);
            u64::from_le_bytes(a)
        };
        if u32_at(4) != SAVE_VERSION {
            return Err(bad(&format!("unsupported version {}", u32_at(4))));
        }
        if u64_at(8) != model_hash {
            return Err(bad("it was saved for another model"));
        }
        let ty = if u32_at(16) == 1 {
            CacheType::F16
        } else {
            CacheType::F32
        };
        if ty != self.ty {
            return Err(bad(&format!(
                "it holds a {ty:?} cache, this run uses {:?}",
                self.ty
            )));
        }
        let (nl, nkv, hd) = (
            u32_at(20) as usize,
            u32_at(24) as usize,
            u32_at(28) as usize,
        );
        if (nl, nkv, hd)
            != (
                self.shape.n_layers,
                self.shape.n_kv_heads,
                self.shape.head_dim,
            )
        {
            return Err(bad("its cache shape differs from the model's"));
        }
        let n = u64_at(32);
        let extra_len = u64_at(40);
        let checksum = u64_at(48);
        let es = self.ty.size() as u64;
        let n_heads = (nl * 2 * nkv) as u64;
        let expected = (n.checked_mul(8))
            .and_then(|a| a.checked_add(extra_len))
            .and_then(|a| {
                n.checked_mul(n_heads * hd as u64 * es)
                    .and_then(|p| a.checked_add(p))
            })
            .and_then(|a| a.checked_add(SAVE_HEADER as u64));
        if expected != Some(bytes.len() as u64) {
            return Err(bad(
                "the file is truncated or corrupt (its size does not match its header)",
            ));
        }
        let body = &bytes[SAVE_HEADER..];
        if refusion_convert::gguf::fnv1a(body) != checksum {
            return Err(bad("the file is corrupt (checksum mismatch)"));
        }
        let n = n as usize;
        if n > self.shape.capacity {
            return Err(bad(&format!(
                "it holds {n} entries, more than the context ({})",
                self.shape.capacity
            )));
        }
        let rd = |o: usize| u32::from_le_bytes([body[o], body[o + 1], body[o + 2], body[o + 3]]);
        let tokens: Vec<u32> = (0..n).map(|i| rd(4 * i)).collect();
        let positions: Vec<u32> = (0..n).map(|i| rd(4 * (n + i))).collect();
        let mut seen = vec![false; n];
        for &p in &positions {
            match seen.get_mut(p as usize) {
                Some(s) if !*s => *s = true,
                _ => return Err(bad("its positions are not 0..n")),
            }
        }
        let extra_start = 8 * n;
        let extra = body[extra_start..extra_start + extra_len as usize].to_vec();
        let payload = &body[extra_start + extra_len as usize..];
        let entry_bytes = hd * es as usize;
        // Device layers first (layer order), each as K then V, `[n_kv_heads, n, head_dim]`.
        let device_bytes = self.device.len() * 2 * nkv * n * entry_bytes;
        if n > 0 {
            let part_bytes = nkv * n * entry_bytes;
            for (l, layer) in self.device.iter().enumerate() {
                for (j, t) in [&layer.k, &layer.v].into_iter().enumerate() {
                    let start = (l * 2 + j) * part_bytes;
                    let bytes = &payload[start..start + part_bytes];
                    let src = match self.ty {
                        CacheType::F32 => {
                            let v: Vec<f32> = bytes
                                .chunks_exact(4)
                                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                                .collect();
                            Tensor::from_vec(v, (nkv, n, hd), t.device())?
                        }
                        CacheType::F16 => {
                            let v: Vec<f16> = bytes
                                .chunks_exact(2)
                                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                                .collect();
                            Tensor::from_vec(v, (nkv, n, hd), t.device())?
                        }
                    };
                    t.slice_set(&src, 1, 0)?;
                }
            }
        }
        let payload = &payload[device_bytes..];
        for head in 0..self.host_heads() {
            for e in 0..n {
                let src = (head * n + e) * entry_bytes;
                let off = self.offset(head, e) * es as usize;
                self.mmap[off..off + entry_bytes].copy_from_slice(&payload[src..src + entry_bytes]);
            }
        }
        for (e, &p) in positions.iter().enumerate() {
            self.slot_pos[e] = p;
        }
        self.shared = n;
        self.shared_pos = positions;
        self.next_free = n;
        self.moved += (n * self.shape.bytes_per_token(self.ty)) as u64;
        Ok(SavedPrefix { tokens, extra })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> CacheShape {
        CacheShape {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 4,
            capacity: 16,
        }
    }

    /// K/V values that encode (layer, kv head, tag) so copies can be traced.
    fn kv_for(layer: usize, tags: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mut k = Vec::new();
        let mut v = Vec::new();
        for &t in tags {
            for h in 0..2 {
                for d in 0..4 {
                    k.push(t * 100.0 + (layer * 10 + h) as f32 + d as f32 * 0.01);
                    v.push(-(t * 100.0 + (layer * 10 + h) as f32 + d as f32 * 0.01));
                }
            }
        }
        (k, v)
    }

    fn tag_of(c: &KvCache, layer: usize, slot: usize) -> f32 {
        let k = c.entry(layer, false, 1, slot).unwrap();
        ((k[0] - (layer * 10 + 1) as f32) / 100.0).round()
    }

    fn fill(c: &mut KvCache, rows: &[u32], tags: &[f32]) -> Vec<usize> {
        let positions: Vec<u32> = tags.iter().map(|&t| t as u32).collect();
        let slots = c.allocate(rows, &positions).unwrap();
        for layer in 0..2 {
            let (k, v) = kv_for(layer, tags);
            if layer < c.device_layers() {
                let dev = c.device_layer(layer).k.device().clone();
                let index = c.device_index(&slots, &dev).unwrap();
                let k = Tensor::from_vec(k, (slots.len(), 2, 4), &dev).unwrap();
                let v = Tensor::from_vec(v, (slots.len(), 2, 4), &dev).unwrap();
                c.write_device(layer, &index, &k, &v).unwrap();
            } else {
                c.write(layer, &slots, &k, &v);
            }
        }
        slots
    }

    fn check_ops(mut c: KvCache) {
        // A prompt of 3 entries, committed.
        fill(&mut c, &[0, 0, 0], &[1.0, 2.0, 3.0]);
        c.commit_row(0).unwrap();
        assert_eq!(c.shared_len(), 3);
        assert_eq!(c.shared_positions(), &[1, 2, 3]);
        // Two rows of two entries each, interleaved in the batch.
        fill(&mut c, &[0, 1, 0, 1], &[10.0, 20.0, 11.0, 21.0]);
        assert_eq!(c.row_len(0), 2);
        assert_eq!(c.row_len(1), 2);
        assert_eq!(c.available(), 16 - 3 - 4);
        // Truncate rows to one entry each, then add one more to each row.
        c.truncate_rows(1);
        assert_eq!(c.row_len(0), 1);
        fill(&mut c, &[0, 1], &[12.0, 22.0]);
        let r0: Vec<f32> = c.row_slots(0).iter().map(|&s| tag_of(&c, 1, s)).collect();
        let r1: Vec<f32> = c.row_slots(1).iter().map(|&s| tag_of(&c, 1, s)).collect();
        assert_eq!(r0, vec![10.0, 12.0]);
        assert_eq!(r1, vec![20.0, 22.0]);
        // Commit row 1's entries then row 0's first, in that order.
        c.commit(&[(1, 0), (1, 1), (0, 0)]).unwrap();
        assert_eq!(c.shared_len(), 6);
        assert_eq!(c.n_rows(), 0);
        let shared: Vec<f32> = (0..6).map(|s| tag_of(&c, 0, s)).collect();
        assert_eq!(shared, vec![1.0, 2.0, 3.0, 20.0, 22.0, 10.0]);
        assert_eq!(c.shared_positions(), &[1, 2, 3, 20, 22, 10]);
        let v = c.entry(1, true, 0, 5).unwrap()[1];
        match c.cache_type() {
            CacheType::F32 => assert_eq!(v, -(10.0 * 100.0 + 10.0 + 0.01)),
            CacheType::F16 => assert!((v + 1010.01).abs() < 1.0),
        }
        // Drop rows beyond the first, crop the shared prefix, remove entries.
        fill(&mut c, &[0, 1, 2], &[30.0, 31.0, 32.0]);
        c.retain_rows(1);
        assert_eq!(c.n_rows(), 1);
        c.retain_shared(|_, p| p != 20).unwrap();
        assert_eq!(c.shared_positions(), &[1, 2, 3, 22, 10]);
        let shared: Vec<f32> = (0..5).map(|s| tag_of(&c, 0, s)).collect();
        assert_eq!(shared, vec![1.0, 2.0, 3.0, 22.0, 10.0]);
        c.crop(2);
        assert_eq!(c.shared_len(), 2);
        assert_eq!(c.available(), 14);
        // Filling the context is an error that changes nothing.
        let err = c.allocate(&[0; 15], &[0; 15]).unwrap_err();
        assert!(err.to_string().contains("context"), "{err}");
        assert_eq!(c.row_len(0), 0);
        assert!(c.commit(&[(3, 0)]).is_err());
    }

    #[test]
    fn cache_operations_f32_f16_and_file_backed() {
        check_ops(KvCache::new(shape(), CacheType::F32).unwrap());
        check_ops(KvCache::new(shape(), CacheType::F16).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv.bin");
        let c = KvCache::with_file(shape(), CacheType::F32, &path).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            (shape().bytes_per_token(CacheType::F32) * 16) as u64
        );
        check_ops(c);
    }

    #[test]
    fn device_resident_layers_behave_as_mapped_ones() {
        // candle's CPU device stands in for a GPU: the same tensor operations run on both.
        for n in [1, 2] {
            for ty in [CacheType::F32, CacheType::F16] {
                let c = KvCache::placed(shape(), ty, None, Some((&Device::Cpu, n))).unwrap();
                assert_eq!(c.device_layers(), n);
                check_ops(c);
            }
        }
    }

    #[test]
    fn saved_prefixes_move_between_device_and_mapped_layers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("prefix.kv");
        let mut c =
            KvCache::placed(shape(), CacheType::F16, None, Some((&Device::Cpu, 1))).unwrap();
        fill(&mut c, &[0, 0, 0], &[0.0, 2.0, 1.0]);
        c.commit_row(0).unwrap();
        c.save_prefix(&path, 42, &[7, 8, 9], b"x").unwrap();
        let mut host = KvCache::new(shape(), CacheType::F16).unwrap();
        host.load_prefix(&path, 42).unwrap();
        let path2 = dir.path().join("prefix2.kv");
        host.save_prefix(&path2, 42, &[7, 8, 9], b"x").unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            std::fs::read(&path2).unwrap()
        );
        let mut dev =
            KvCache::placed(shape(), CacheType::F16, None, Some((&Device::Cpu, 2))).unwrap();
        dev.load_prefix(&path2, 42).unwrap();
        for layer in 0..2 {
            for slot in 0..3 {
                for is_v in [false, true] {
                    assert_eq!(
                        dev.entry(layer, is_v, 1, slot).unwrap(),
                        c.entry(layer, is_v, 1, slot).unwrap()
                    );
                }
            }
        }
    }

    #[test]
    fn saved_prefixes_round_trip_and_mismatches_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("prefix.kv");
        let mut c = KvCache::new(shape(), CacheType::F32).unwrap();
        // Positions committed out of order, as ReFusion does.
        fill(&mut c, &[0, 0, 0], &[0.0, 2.0, 1.0]);
        c.commit_row(0).unwrap();
        c.save_prefix(&path, 42, &[7, 8, 9], b"extra").unwrap();
        let mut d = KvCache::new(shape(), CacheType::F32).unwrap();
        let saved = d.load_prefix(&path, 42).unwrap();
        assert_eq!(saved.tokens, vec![7, 8, 9]);
        assert_eq!(saved.extra, b"extra");
        assert_eq!(d.shared_positions(), &[0, 2, 1]);
        assert_eq!(
            (0..3).map(|s| tag_of(&d, 1, s)).collect::<Vec<_>>(),
            vec![0.0, 2.0, 1.0]
        );
        let e = d.load_prefix(&path, 43).unwrap_err().to_string();
        assert!(e.contains("another model"), "{e}");
        assert_eq!(d.shared_len(), 0);
        let mut h = KvCache::new(shape(), CacheType::F16).unwrap();
        assert!(h
            .load_prefix(&path, 42)
            .unwrap_err()
            .to_string()
            .contains("F32"));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        assert!(d
            .load_prefix(&path, 42)
            .unwrap_err()
            .to_string()
            .contains("truncated"));
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        assert!(d
            .load_prefix(&path, 42)
            .unwrap_err()
            .to_string()
            .contains("checksum"));
        assert!(
            c.save_prefix(&path, 42, &[1, 2, 3, 4], b"").is_err(),
            "position 3 is not cached"
        );
    }

    #[test]
    fn bytes_per_token_matches_refusion_8b() {
        let s = CacheShape {
            n_layers: 36,
            n_kv_heads: 8,
            head_dim: 128,
            capacity: 1,
        };
        assert_eq!(s.bytes_per_token(CacheType::F16), 147_456);
    }
}
