//! A sequence's shared prefix in a file (`--prompt-cache`, chat's `/save` and `/load`): its
//! entries at positions `0..n`, their K/V (device layers first, then the mapped ones),
//! positions and tokens, the caller's extra bytes, a checksum, and the model's layout hash.

use std::path::Path;

use super::{CacheType, KvCache, SeqId};
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
const SAVE_VERSION: u32 = 1;
const SAVE_HEADER: usize = 4 + 4 + 8 + 4 * 4 + 8 * 3;

impl KvCache {
    /// Writes the default sequence's shared entries at positions `0..tokens.len()` (their K/V,
    /// positions and tokens) and `extra` to `path`, atomically (a temporary file, then a
    /// rename). The path must be absent, empty or a saved prefix already
    /// ([`super::claim::claim`]): any other file is left as it is. `model_hash` ties the file to
    /// the model
    /// ([`refusion_gguf::GgufFile::layout_hash`]).
    pub fn save_prefix(
        &self,
        path: &Path,
        model_hash: u64,
        tokens: &[u32],
        extra: &[u8],
    ) -> Result<()> {
        super::claim::claim(path, super::claim::CacheFile::Prefix, None)?;
        let n = tokens.len();
        let slots: Vec<usize> = self
            .cells
            .segments(SeqId::DEFAULT)?
            .iter()
            .flat_map(|g| g.start..g.start + g.len)
            .filter(|&s| (self.cells.slot_position(s) as usize) < n)
            .collect();
        if slots.len() != n {
            return Err(Error::msg(format!(
                "the cache holds {} of the {n} positions to save",
                slots.len()
            )));
        }
        // Device layers come first in the file (layer order): copy their entries back once.
        let device_payload = self.device.entries_le(&slots)?;
        let tokens_le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let positions_le: Vec<u8> = slots
            .iter()
            .flat_map(|&s| self.cells.slot_position(s).to_le_bytes())
            .collect();
        // The K/V entries are read straight from the cache, once for the checksum and once for
        // the file: no copy of the payload is built.
        let heads = self.host.heads();
        let mut sum = refusion_gguf::Fnv1a::default();
        for part in [
            &tokens_le[..],
            &positions_le[..],
            extra,
            &device_payload[..],
        ] {
            sum.update(part);
        }
        for head in 0..heads {
            for &s in &slots {
                sum.update(self.host.entry_raw(head, s));
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

        let io = |e: std::io::Error| Error::File(refusion_gguf::Error::io(path, e));
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
            for head in 0..heads {
                for &s in &slots {
                    w.write_all(self.host.entry_raw(head, s)).map_err(io)?;
                }
            }
            w.flush().map_err(io)?;
        }
        out.commit()?;
        Ok(())
    }

    /// Replaces the default sequence's contents with a saved prefix. Any mismatch (another
    /// model, cache type or shape, a truncated or corrupt file) is an error naming the problem,
    /// and leaves the sequence empty.
    pub fn load_prefix(&mut self, path: &Path, model_hash: u64) -> Result<SavedPrefix> {
        self.crop(0);
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
        if refusion_gguf::fnv1a(body) != checksum {
            return Err(bad("the file is corrupt (checksum mismatch)"));
        }
        let n = n as usize;
        if n > self.available() {
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
        let dst = self.cells.set_shared(SeqId::DEFAULT, &positions)?;
        // Device layers first (layer order), each as K then V, `[n_kv_heads, n, head_dim]`.
        let device_bytes = self.device.load_le(payload, n, dst)?;
        let payload = &payload[device_bytes..];
        let entry_bytes = hd * es as usize;
        for head in 0..self.host.heads() {
            for e in 0..n {
                let src = (head * n + e) * entry_bytes;
                self.host
                    .set_entry_raw(head, dst + e, &payload[src..src + entry_bytes]);
            }
        }
        self.moved += (n * self.shape.bytes_per_token(self.ty)) as u64;
        Ok(SavedPrefix { tokens, extra })
    }
}
