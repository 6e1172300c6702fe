//! A sequence's shared prefix in a file (`--prompt-cache`, chat's `/save` and `/load`): its
//! entries at positions `0..n`, their K/V (device layers first, then the mapped ones),
//! positions and tokens, the caller's extra bytes, a checksum, and the model's layout hash.

use std::path::Path;

use super::{KvCache, KvTypes, SeqId};
use crate::error::{Error, Result};

/// A saved prefix read back by [`KvCache::load_prefix`].
#[derive(Debug, Clone, PartialEq)]
pub struct SavedPrefix {
    /// The token at each position `0..n`.
    pub tokens: Vec<u32>,
    /// Caller data stored alongside (e.g. a chat's messages).
    pub extra: Vec<u8>,
}

const SAVE_MAGIC: &[u8; 4] = super::claim::PREFIX_MAGIC;
/// 2: the type code is a pair ([`KvTypes::code`]); version 1's names one type for both.
const SAVE_VERSION: u32 = 2;
const SAVE_HEADER: usize = 4 + 4 + 8 + 4 * 4 + 8 * 3;

/// The file's fixed header, after its magic.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Header {
    version: u32,
    model_hash: u64,
    /// The key and value types' code ([`KvTypes::code`]).
    ty: u32,
    /// Layers, KV heads and head size of the cache it was saved from.
    shape: (usize, usize, usize),
    entries: u64,
    extra_len: u64,
    checksum: u64,
}

impl Header {
    fn to_bytes(self) -> Vec<u8> {
        let mut h = Vec::with_capacity(SAVE_HEADER);
        h.extend_from_slice(SAVE_MAGIC);
        h.extend_from_slice(&self.version.to_le_bytes());
        h.extend_from_slice(&self.model_hash.to_le_bytes());
        let (nl, nkv, hd) = self.shape;
        for v in [self.ty as usize, nl, nkv, hd] {
            h.extend_from_slice(&(v as u32).to_le_bytes());
        }
        for v in [self.entries, self.extra_len, self.checksum] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        h
    }

    /// The header of `bytes` (at least [`SAVE_HEADER`] long, the magic checked).
    fn parse(bytes: &[u8]) -> Header {
        let u32_at =
            |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&bytes[o..o + 8]);
            u64::from_le_bytes(a)
        };
        Header {
            version: u32_at(4),
            model_hash: u64_at(8),
            ty: u32_at(16),
            shape: (
                u32_at(20) as usize,
                u32_at(24) as usize,
                u32_at(28) as usize,
            ),
            entries: u64_at(32),
            extra_len: u64_at(40),
            checksum: u64_at(48),
        }
    }

    /// The key and value types it holds (`None` for an unknown code).
    fn types(&self) -> Option<KvTypes> {
        match self.version {
            1 => super::CacheType::from_code(self.ty).map(KvTypes::same),
            _ => KvTypes::from_code(self.ty),
        }
    }

    /// The file's size as the header describes it, `pair_bytes` a key and a value row
    /// (`None` on overflow).
    fn file_len(&self, pair_bytes: u64) -> Option<u64> {
        let (nl, nkv, _) = self.shape;
        let n_heads = (nl * nkv) as u64;
        let payload = self.entries.checked_mul(n_heads.checked_mul(pair_bytes)?)?;
        self.entries
            .checked_mul(8)?
            .checked_add(self.extra_len)?
            .checked_add(payload)?
            .checked_add(SAVE_HEADER as u64)
    }
}

/// How many entries the saved prefix at `path` holds, from its header alone (`None` when it is
/// absent or not one): the room a cache needs to load it.
pub fn saved_entries(path: &Path) -> Option<usize> {
    use std::io::Read;
    let mut file = refusion_gguf::files::open_regular(path).ok()?;
    let mut bytes = [0u8; SAVE_HEADER];
    file.read_exact(&mut bytes).ok()?;
    (&bytes[..4] == SAVE_MAGIC).then(|| Header::parse(&bytes).entries as usize)
}

impl KvCache {
    /// Writes the default sequence's shared entries at positions `0..tokens.len()` (their K/V,
    /// positions and tokens) and `extra` to `path`, atomically (a temporary file, then a
    /// rename). The path must be absent, empty or a saved prefix already
    /// ([`super::claim::claim`]): any other file is left as it is. `model_hash` ties the file to
    /// the model ([`refusion_gguf::GgufFile::layout_hash`]).
    pub fn save_prefix(
        &self,
        path: &Path,
        model_hash: u64,
        tokens: &[u32],
        extra: &[u8],
    ) -> Result<()> {
        super::claim::claim(path, super::claim::CacheFile::Prefix, None)?;
        let slots = self.prefix_slots(tokens.len())?;
        // Device layers come first in the file (layer order): copy their entries back once.
        let device_payload = self.device.entries_le(&slots)?;
        let tokens_le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let positions_le: Vec<u8> = slots
            .iter()
            .flat_map(|&s| self.cells.slot_position(s).to_le_bytes())
            .collect();
        let parts = [
            &tokens_le[..],
            &positions_le[..],
            extra,
            &device_payload[..],
        ];
        // The K/V entries are read straight from the cache, once for the checksum and once for
        // the file: no copy of the payload is built.
        let mut sum = refusion_gguf::Fnv1a::default();
        for part in parts {
            sum.update(part);
        }
        self.for_each_host_entry(&slots, |e| {
            sum.update(e);
            Ok(())
        })?;
        let header = Header {
            version: SAVE_VERSION,
            model_hash,
            ty: self.types.code(),
            shape: (
                self.shape.n_layers,
                self.shape.n_kv_heads,
                self.shape.head_dim,
            ),
            entries: tokens.len() as u64,
            extra_len: extra.len() as u64,
            checksum: sum.finish(),
        };
        let io = |e: std::io::Error| Error::File(refusion_gguf::Error::io(path, e));
        let mut out = refusion_gguf::atomic::AtomicFile::create(path)?;
        {
            use std::io::Write;
            let mut w = std::io::BufWriter::new(out.file());
            w.write_all(&header.to_bytes()).map_err(io)?;
            for part in parts {
                w.write_all(part).map_err(io)?;
            }
            self.for_each_host_entry(&slots, |e| w.write_all(e).map_err(io))?;
            w.flush().map_err(io)?;
        }
        out.commit()?;
        Ok(())
    }

    /// The slots of the default sequence's shared entries at positions `0..n` (all of them
    /// must be there).
    fn prefix_slots(&self, n: usize) -> Result<Vec<usize>> {
        let slots: Vec<usize> = self
            .cells
            .segments(SeqId::DEFAULT)?
            .iter()
            .flat_map(|g| g.start..g.start + g.len)
            .filter(|&s| (self.cells.slot_position(s) as usize) < n)
            .collect();
        if slots.len() != n {
            return Err(Error::internal(format!(
                "the cache holds {} of the {n} positions to save",
                slots.len()
            )));
        }
        Ok(slots)
    }

    /// The mapped layers' entries of `slots`, head after head, as the file holds them.
    fn for_each_host_entry(
        &self,
        slots: &[usize],
        mut f: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        for head in 0..self.host.heads() {
            for &s in slots {
                f(self.host.entry_raw(head, s))?;
            }
        }
        Ok(())
    }

    /// Replaces the default sequence's contents with a saved prefix. Any mismatch (another
    /// model, cache type or shape, a truncated or corrupt file) is an error naming the problem.
    pub fn load_prefix(&mut self, path: &Path, model_hash: u64) -> Result<SavedPrefix> {
        self.load_prefix_checked(path, model_hash, |_| Ok(()))
    }

    /// [`Self::load_prefix`], the caller's data first checked by `check_extra`. Everything is
    /// checked before the sequence is touched: a file refused leaves it as it was (only a
    /// failure while copying the entries in, after every check, leaves it empty).
    pub fn load_prefix_checked(
        &mut self,
        path: &Path,
        model_hash: u64,
        check_extra: impl FnOnce(&[u8]) -> std::result::Result<(), String>,
    ) -> Result<SavedPrefix> {
        let bad = |m: &str| Error::File(refusion_gguf::Error::bad(path, m));
        let io = |e: std::io::Error| Error::File(refusion_gguf::Error::io(path, e));
        let file = refusion_gguf::files::open_regular(path)?;
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
        let h = Header::parse(bytes);
        self.check_header(&h, model_hash).map_err(|m| bad(&m))?;
        let pair_bytes = self.types.row_bytes(self.shape.head_dim) as u64;
        if h.file_len(pair_bytes) != Some(bytes.len() as u64) {
            return Err(bad(
                "the file is truncated or corrupt (its size does not match its header)",
            ));
        }
        let body = &bytes[SAVE_HEADER..];
        if refusion_gguf::fnv1a(body) != h.checksum {
            return Err(bad("the file is corrupt (checksum mismatch)"));
        }
        let n = h.entries as usize;
        if n > self.cells.room(SeqId::DEFAULT) {
            return Err(bad(&format!(
                "it holds {n} entries, more than the context ({})",
                self.shape.capacity
            )));
        }
        let extra_len = h.extra_len as usize;
        check_positions(body, n).map_err(|m| bad(&m))?;
        check_extra(&body[8 * n..8 * n + extra_len]).map_err(|m| bad(&m))?;
        self.crop(0);
        self.restore(body, n, extra_len).map_err(|e| match e {
            Error::Internal(m) => bad(&m),
            e => e,
        })
    }

    /// Whether a file's header fits this model and cache: the mismatch in words if not.
    fn check_header(&self, h: &Header, model_hash: u64) -> std::result::Result<(), String> {
        if !(1..=SAVE_VERSION).contains(&h.version) {
            return Err(format!("unsupported version {}", h.version));
        }
        if h.model_hash != model_hash {
            return Err("it was saved for another model".into());
        }
        match h.types() {
            Some(t) if t == self.types => {}
            Some(t) => {
                return Err(format!(
                    "it holds a KV cache of {t}, this run's is {} (give -ctk {} -ctv {})",
                    self.types,
                    t.k.name(),
                    t.v.name()
                ))
            }
            None => return Err(format!("it holds a cache of unknown type {:#x}", h.ty)),
        }
        let s = &self.shape;
        if h.shape != (s.n_layers, s.n_kv_heads, s.head_dim) {
            return Err("its cache shape differs from the model's".into());
        }
        Ok(())
    }

    /// The body of a checked file (`n` entries, `extra_len` bytes of caller data) into the
    /// default sequence.
    fn restore(&mut self, body: &[u8], n: usize, extra_len: usize) -> Result<SavedPrefix> {
        let rd = |o: usize| u32::from_le_bytes([body[o], body[o + 1], body[o + 2], body[o + 3]]);
        let tokens: Vec<u32> = (0..n).map(|i| rd(4 * i)).collect();
        let positions: Vec<u32> = (0..n).map(|i| rd(4 * (n + i))).collect();
        let extra = body[8 * n..8 * n + extra_len].to_vec();
        let payload = &body[8 * n + extra_len..];
        let dst = self.cells.set_shared(SeqId::DEFAULT, &positions)?;
        // Device layers first (layer order), each as K then V, `[n_kv_heads, n, head_dim]`.
        let device_bytes = self.device.load_le(payload, n, dst)?;
        let payload = &payload[device_bytes..];
        let mut src = 0;
        for head in 0..self.host.heads() {
            let entry_bytes = self.host.entry_bytes(head);
            for e in 0..n {
                self.host
                    .set_entry_raw(head, dst + e, &payload[src..src + entry_bytes]);
                src += entry_bytes;
            }
        }
        self.moved += (n * self.shape.bytes_per_token(self.types)) as u64;
        Ok(SavedPrefix { tokens, extra })
    }
}

/// The saved positions (after the `n` tokens) are each of 0..n once.
fn check_positions(body: &[u8], n: usize) -> std::result::Result<(), String> {
    let mut seen = vec![false; n];
    for i in 0..n {
        let o = 4 * (n + i);
        let p = u32::from_le_bytes([body[o], body[o + 1], body[o + 2], body[o + 3]]);
        match seen.get_mut(p as usize) {
            Some(s) if !*s => *s = true,
            _ => return Err("its positions are not 0..n".into()),
        }
    }
    Ok(())
}
