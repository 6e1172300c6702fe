//! The KV cache: one preallocated buffer for the whole context holding K (after RoPE) and V of
//! every layer, memory-mapped (anonymous by default, file-backed with `--kv-file`), plus
//! device tensors for the layers offloaded with `-ngl`. Three rooms:
//! - [`cells`]: which slot holds what (sequences, their shared prefixes and private rows, the
//!   regions they live in, reference counts);
//! - [`host`] and [`device`]: the K/V bytes of the mapped and the device-resident layers;
//! - [`saved`]: a sequence's prefix in a file (`--prompt-cache`, chat's `/save`);
//! - [`placement`]: where a batch's tokens go and what each may see ([`KvCache::place`]);
//! - [`claim`]: whether a path may be written as one of those files (never a file of the
//!   user's that is not ours).
//!
//! A *sequence* (one request) has a shared prefix, which each of its rows attends to and which
//! is read in place, never copied per row: segments borrowed from other sequences (a common
//! prompt, held once) and then its own committed entries. Each forward appends the K/V of its
//! new tokens to their rows' *private* entries (HF's `use_cache=True`); the decoder then
//! truncates the rows, commits chosen entries into the shared prefix in a given order (the
//! reference's `full_update`), or drops them. Cropping is O(1); committing copies only the
//! committed entries.
//!
//! A cache made with [`KvCache::new`] (or its siblings) has one sequence,
//! [`SeqId::DEFAULT`], over the whole capacity, and its methods without a sequence act on it.

pub mod cells;
pub mod claim;
pub mod device;
pub mod host;
pub mod kinds;
pub mod placement;
pub mod saved;

use std::path::Path;

use candle_core::{Device, Tensor};

pub use cells::{Move, Segment, SeqId};
pub use device::DeviceLayer;
pub use kinds::{CacheType, KvKind, KvTypes};
pub use placement::{Placement, Sight, Visible};
pub use saved::SavedPrefix;

use cells::Cells;
use device::DeviceStore;
use host::HostStore;

use crate::error::{Error, Result};

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kv {
    K = 0,
    V = 1,
}

/// The cache's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Entries (tokens) the buffer holds: shared prefixes plus private slots.
    pub capacity: usize,
}

impl CacheShape {
    pub fn bytes_per_token(&self, types: impl Into<KvTypes>) -> usize {
        self.n_layers * self.layer_bytes_per_token(types)
    }

    /// K and V of one layer for one token.
    pub fn layer_bytes_per_token(&self, types: impl Into<KvTypes>) -> usize {
        self.n_kv_heads * types.into().row_bytes(self.head_dim)
    }
}

/// Read access to one layer's K or V for one KV head: a row of `head_dim` values per slot,
/// stored as its [`KvKind`] says.
pub struct HeadView<'a> {
    kind: &'static dyn KvKind,
    bytes: &'a [u8],
    row_bytes: usize,
    /// The rows in place, when the type stores f32.
    f32: Option<&'a [f32]>,
}

impl<'a> HeadView<'a> {
    pub fn new(kind: &'static dyn KvKind, bytes: &'a [u8], head_dim: usize) -> HeadView<'a> {
        HeadView {
            kind,
            bytes,
            row_bytes: kind.row_bytes(head_dim),
            f32: kind.as_f32(bytes),
        }
    }

    /// Every row in place as f32 (`[slot, head_dim]`), when the type stores f32.
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        self.f32
    }

    /// Rows `slots` read into `buf` as f32, one after the other (`slots.len() * head_dim`
    /// values).
    pub fn read_rows(&self, slots: &[usize], buf: &mut [f32]) {
        match self.f32 {
            Some(all) => {
                let n = buf.len() / slots.len().max(1);
                if n == 0 {
                    return;
                }
                for (&slot, out) in slots.iter().zip(buf.chunks_exact_mut(n)) {
                    out.copy_from_slice(&all[slot * n..(slot + 1) * n]);
                }
            }
            None => self.kind.read_rows(self.bytes, self.row_bytes, slots, buf),
        }
    }

    /// Slot `slot`'s row as f32: borrowed in place from an f32 cache, else read into `buf`
    /// (`head_dim` long).
    #[inline]
    pub fn row<'b>(&'b self, slot: usize, buf: &'b mut [f32]) -> &'b [f32] {
        match self.f32 {
            Some(all) => &all[slot * buf.len()..(slot + 1) * buf.len()],
            None => {
                let rb = self.row_bytes;
                self.kind
                    .read_row(&self.bytes[slot * rb..(slot + 1) * rb], buf);
                buf
            }
        }
    }
}

pub struct KvCache {
    shape: CacheShape,
    types: KvTypes,
    cells: Cells,
    host: HostStore,
    device: DeviceStore,
    /// Bytes of K/V written into the cache or copied within it, over its life (see
    /// [`KvCache::bytes_moved`]).
    moved: u64,
}

impl KvCache {
    /// An anonymous (RAM/swap-backed) cache, resident from the start (see `HostStore::new`).
    pub fn new(shape: CacheShape, types: impl Into<KvTypes>) -> Result<KvCache> {
        Self::placed(shape, types, None, None)
    }

    /// A cache backed by the file at `path` (created or truncated to the cache's size).
    pub fn with_file(shape: CacheShape, types: impl Into<KvTypes>, path: &Path) -> Result<KvCache> {
        Self::placed(shape, types, Some(path), None)
    }

    /// A cache whose first `n` layers live on `device` (zeroed there); the others in a map,
    /// anonymous or backed by the file at `path`. It holds one sequence over the whole
    /// capacity, [`SeqId::DEFAULT`].
    pub fn placed(
        shape: CacheShape,
        types: impl Into<KvTypes>,
        path: Option<&Path>,
        device_layers: Option<(&Device, usize)>,
    ) -> Result<KvCache> {
        let mut cache = Self::pool(shape, types, path, device_layers)?;
        let id = cache.cells.add_seq(shape.capacity, &[]);
        debug_assert_eq!(id, Some(SeqId::DEFAULT));
        Ok(cache)
    }

    /// A cache with no sequence yet: [`KvCache::add_seq`] makes them (many requests at once).
    pub fn pool(
        shape: CacheShape,
        types: impl Into<KvTypes>,
        path: Option<&Path>,
        device_layers: Option<(&Device, usize)>,
    ) -> Result<KvCache> {
        let types = types.into();
        types.check_head_dim(shape.head_dim).map_err(Error::setup)?;
        let device = DeviceStore::new(&shape, types, device_layers)?;
        let host = HostStore::new(&shape, device.len(), types, path)?;
        Ok(KvCache {
            shape,
            types,
            cells: Cells::new(shape.capacity),
            host,
            device,
            moved: 0,
        })
    }

    pub fn shape(&self) -> CacheShape {
        self.shape
    }

    /// The element types of its keys and values.
    pub fn types(&self) -> KvTypes {
        self.types
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
        &self.device.layers[layer]
    }

    /// The slot bookkeeping (read-only).
    pub fn cells(&self) -> &Cells {
        &self.cells
    }

    /// The slot bookkeeping, for what holds regions besides sequences (cached prompts).
    pub(crate) fn cells_mut(&mut self) -> &mut Cells {
        &mut self.cells
    }

    /// A new sequence with `reserve` slots of its own, its prefix starting with `borrow`
    /// ([`Cells::prefix_segments`] of another). `None` when no free range is that long.
    pub fn add_seq(&mut self, reserve: usize, borrow: &[(Segment, usize)]) -> Option<SeqId> {
        self.cells.add_seq(reserve, borrow)
    }

    /// Ends a sequence, freeing its entries at once except the first `keep` of its own while a
    /// cached prefix holds them.
    pub fn remove_seq(&mut self, id: SeqId, keep: usize) -> Result<()> {
        self.cells.remove_seq(id, keep)
    }

    /// The operations on one sequence.
    pub fn seq(&mut self, id: SeqId) -> SeqCache<'_> {
        SeqCache { cache: self, id }
    }

    /// Appends one new entry per token to its row of its sequence (`seqs` empty: the default
    /// sequence) and returns the slots, in batch order. Fails, changing nothing, when a
    /// sequence's room is short.
    fn allocate_for(
        &mut self,
        seqs: &[u32],
        rows: &[u32],
        positions: &[u32],
    ) -> Result<Vec<usize>> {
        let seq_of = |i: usize| SeqId(seqs.get(i).copied().unwrap_or(0));
        let mut wanted: Vec<(SeqId, usize)> = Vec::new();
        for i in 0..rows.len() {
            match wanted.iter_mut().find(|(s, _)| *s == seq_of(i)) {
                Some((_, n)) => *n += 1,
                None => wanted.push((seq_of(i), 1)),
            }
        }
        for &(s, n) in &wanted {
            let available = self.cells.available(s);
            if n > available {
                let cap = self.cells.shared_len(s) + available + self.private_len(s);
                return Err(Error::ContextFull {
                    needed: cap - available + n,
                    capacity: cap,
                });
            }
        }
        rows.iter()
            .zip(positions)
            .enumerate()
            .map(|(i, (&r, &p))| self.cells.allocate(seq_of(i), r as usize, p))
            .collect()
    }

    fn private_len(&self, id: SeqId) -> usize {
        (0..self.cells.n_rows(id))
            .map(|r| self.cells.row_slots(id, r).len())
            .sum()
    }

    /// [`KvCache::allocate_for`] in the default sequence.
    pub fn allocate(&mut self, rows: &[u32], positions: &[u32]) -> Result<Vec<usize>> {
        self.allocate_for(&[], rows, positions)
    }

    fn apply(&mut self, m: &Move) -> Result<()> {
        self.device.apply(m)?;
        let moved = self.host.apply(m);
        // Each entry that changes place is staged (read) and written.
        self.moved += (2 * moved * self.shape.bytes_per_token(self.types)) as u64;
        Ok(())
    }

    /// All slots of one host-resident layer's K (or V) for one KV head.
    pub fn head(&self, layer: usize, kind: Kv, kv_head: usize) -> HeadView<'_> {
        self.host.head(layer, kind, kv_head)
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
        self.moved += (k.dim(0)? * self.shape.layer_bytes_per_token(self.types)) as u64;
        self.device.write(layer, index, k, v)
    }

    /// The scatter index for [`KvCache::write_device`] (built once per forward).
    pub fn device_index(&self, slots: &[usize], device: &Device) -> Result<Tensor> {
        self.device.index(slots, device)
    }

    /// Writes the K and V of new entries of one host-resident layer: `k` and `v` hold, for
    /// each slot in `slots`, `n_kv_heads * head_dim` values.
    pub fn write(&mut self, layer: usize, slots: &[usize], k: &[f32], v: &[f32]) {
        self.moved += (slots.len() * self.shape.layer_bytes_per_token(self.types)) as u64;
        self.host.write(layer, slots, k, v);
    }

    /// One entry (`head_dim` values as f32) of any layer, wherever it lives. For tests and
    /// tools, not the forward.
    pub fn entry(&self, layer: usize, kind: Kv, kv_head: usize, slot: usize) -> Result<Vec<f32>> {
        let hd = self.shape.head_dim;
        if layer < self.device.len() {
            return self.device.entry(layer, kind, kv_head, slot);
        }
        let mut row = vec![0f32; hd];
        let view = self.host.head(layer, kind, kv_head);
        let read = view.row(slot, &mut row).to_vec();
        Ok(read)
    }

    /// Position id of a slot.
    pub fn slot_position(&self, slot: usize) -> u32 {
        self.cells.slot_position(slot)
    }

    /// Flushes a file-backed cache to disk.
    pub fn flush(&self) -> Result<()> {
        self.host.flush()
    }

    // The default sequence's operations, for the single-sequence front ends.

    /// Entries in the default sequence's shared prefix.
    pub fn shared_len(&self) -> usize {
        self.cells.shared_len(SeqId::DEFAULT)
    }

    /// Position ids of the default sequence's shared prefix, in cache order.
    pub fn shared_positions(&self) -> Vec<u32> {
        self.cells.shared_positions(SeqId::DEFAULT)
    }

    pub fn n_rows(&self) -> usize {
        self.cells.n_rows(SeqId::DEFAULT)
    }

    /// Private entries of row `r` (0 for a row that does not exist).
    pub fn row_len(&self, r: usize) -> usize {
        self.cells.row_slots(SeqId::DEFAULT, r).len()
    }

    /// Private slots of row `r`, in order.
    pub fn row_slots(&self, r: usize) -> &[usize] {
        self.cells.row_slots(SeqId::DEFAULT, r)
    }

    /// Free entries: what a forward may still add.
    pub fn available(&self) -> usize {
        self.cells.available(SeqId::DEFAULT)
    }

    // The default sequence's row operations fail only when it does not exist: in a
    // scheduler's pool, which drives its sequences through `seq`, never through these.

    pub fn truncate_rows(&mut self, n: usize) {
        let _ = self.seq(SeqId::DEFAULT).truncate_rows(n);
    }

    pub fn retain_rows(&mut self, n: usize) {
        let _ = self.seq(SeqId::DEFAULT).retain_rows(n);
    }

    pub fn clear_rows(&mut self) {
        let _ = self.seq(SeqId::DEFAULT).clear_rows();
    }

    pub fn crop(&mut self, n: usize) {
        let _ = self.seq(SeqId::DEFAULT).crop(n);
    }

    pub fn commit(&mut self, entries: &[(usize, usize)]) -> Result<()> {
        self.seq(SeqId::DEFAULT).commit(entries)
    }

    pub fn commit_row(&mut self, r: usize) -> Result<()> {
        self.seq(SeqId::DEFAULT).commit_row(r)
    }

    pub fn retain_shared(&mut self, keep: impl FnMut(usize, u32) -> bool) -> Result<()> {
        self.seq(SeqId::DEFAULT).retain_shared(keep)
    }
}

/// One sequence's operations: what the decoder drives between forwards.
pub struct SeqCache<'a> {
    cache: &'a mut KvCache,
    id: SeqId,
}

impl SeqCache<'_> {
    pub fn id(&self) -> SeqId {
        self.id
    }

    /// Entries in the shared prefix (borrowed and own).
    pub fn shared_len(&self) -> usize {
        self.cache.cells.shared_len(self.id)
    }

    /// Position ids of the shared prefix, in cache order.
    pub fn shared_positions(&self) -> Vec<u32> {
        self.cache.cells.shared_positions(self.id)
    }

    pub fn n_rows(&self) -> usize {
        self.cache.cells.n_rows(self.id)
    }

    /// Private entries of row `r` (0 for a row that does not exist).
    pub fn row_len(&self, r: usize) -> usize {
        self.cache.cells.row_slots(self.id, r).len()
    }

    /// Free entries: what a forward may still add.
    pub fn available(&self) -> usize {
        self.cache.cells.available(self.id)
    }

    /// Keeps the first `n` private entries of every row (HF's `crop(shared + n)`).
    pub fn truncate_rows(&mut self, n: usize) -> Result<()> {
        self.cache.cells.truncate_rows(self.id, n)
    }

    /// Keeps rows `0..n` and drops the others (HF's `batch_select_minibatch(n)`).
    pub fn retain_rows(&mut self, n: usize) -> Result<()> {
        self.cache.cells.retain_rows(self.id, n)
    }

    /// Keeps the rows whose `keep` is set (rows past its end too), renumbered in order.
    pub fn select_rows(&mut self, keep: &[bool]) -> Result<()> {
        self.cache.cells.select_rows(self.id, keep)
    }

    /// Drops every private entry.
    pub fn clear_rows(&mut self) -> Result<()> {
        self.cache.cells.clear_rows(self.id)
    }

    /// Truncates the shared prefix to `n` entries (O(1)) and drops every private entry.
    pub fn crop(&mut self, n: usize) -> Result<()> {
        self.cache.cells.crop(self.id, n)
    }

    /// Appends the given private entries, `(row, index in row)`, to the shared prefix in the
    /// given order, then drops every private entry. Only the committed entries are copied.
    pub fn commit(&mut self, entries: &[(usize, usize)]) -> Result<()> {
        let m = self.cache.cells.commit(self.id, entries)?;
        self.cache.apply(&m)
    }

    /// Commits every private entry of row `r` (in order) and drops the rest.
    pub fn commit_row(&mut self, r: usize) -> Result<()> {
        let entries: Vec<(usize, usize)> = (0..self.row_len(r)).map(|i| (r, i)).collect();
        self.commit(&entries)
    }

    /// Removes own shared entries for which `keep(index, position)` is false, compacting the
    /// rest in order (e.g. positions after an EOS before the next chat turn). Drops private
    /// entries.
    pub fn retain_shared(&mut self, keep: impl FnMut(usize, u32) -> bool) -> Result<()> {
        let m = self.cache.cells.retain_shared(self.id, keep)?;
        self.cache.apply(&m)
    }
}

#[cfg(test)]
mod tests;
