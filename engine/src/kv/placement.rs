//! Where a batch's tokens go and what each may see: the cache's answer to a forward, before
//! the model computes anything (llama.cpp's KV cache prepares a micro-batch's slots and mask
//! the same way). [`super::KvCache::place`] allocates one new private entry per token on its
//! row of its sequence; each token then sees its sequence's shared prefix and its row's
//! private entries up to and including its own, and nothing of other rows or sequences.

use std::ops::Range;

use super::{KvCache, Segment, SeqId};
use crate::error::Result;

/// What one token sees: its sequence, and how many of its row's private entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sight {
    pub seq: u32,
    pub row: usize,
    /// The first `count` private entries of the row (its own included).
    pub count: usize,
}

/// What one new token attends to, as attention reads it: its sequence's shared prefix
/// (segments of slots, in cache order) and the first `count` private slots of its row.
#[derive(Debug, Clone, Copy)]
pub struct Visible<'a> {
    /// The token's sequence (tokens of one sequence see the same prefix).
    pub seq: u32,
    pub prefix: &'a [Segment],
    pub row_slots: &'a [usize],
    pub count: usize,
}

impl Visible<'_> {
    pub fn prefix_len(&self) -> usize {
        self.prefix.iter().map(|s| s.len).sum()
    }
}

/// A batch placed in the cache.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    /// The slot each token's entry is written to, in batch order.
    pub slots: Vec<usize>,
    /// What each token sees, in batch order.
    pub sights: Vec<Sight>,
    /// The shared prefix of each sequence in the batch.
    prefixes: Vec<(u32, Vec<Segment>)>,
}

impl Placement {
    /// What the tokens `range` see, against `cache` (whose rows hold their entries).
    pub fn visible<'c>(&'c self, range: Range<usize>, cache: &'c KvCache) -> Vec<Visible<'c>> {
        self.sights[range]
            .iter()
            .map(|s| Visible {
                seq: s.seq,
                prefix: self.prefix_of(s.seq),
                row_slots: cache.cells().row_slots(SeqId(s.seq), s.row),
                count: s.count,
            })
            .collect()
    }

    fn prefix_of(&self, seq: u32) -> &[Segment] {
        self.prefixes
            .iter()
            .find(|(s, _)| *s == seq)
            .map_or(&[][..], |(_, p)| p.as_slice())
    }
}

impl KvCache {
    /// Places a batch: token `i` (on row `rows[i]` of sequence `seqs[i]`, or of the default
    /// sequence when `seqs` is empty, at `positions[i]`) gets a new private entry. Fails,
    /// changing nothing, when a sequence's room is short ([`crate::error::Error::ContextFull`]).
    pub fn place(&mut self, seqs: &[u32], rows: &[u32], positions: &[u32]) -> Result<Placement> {
        let seq_of = |i: usize| seqs.get(i).copied().unwrap_or(0);
        // Each row's private entries before this batch's land, and each sequence's prefix.
        let mut before: Vec<((u32, usize), usize)> = Vec::new();
        let mut prefixes: Vec<(u32, Vec<Segment>)> = Vec::new();
        for (i, &r) in rows.iter().enumerate() {
            let (seq, r) = (seq_of(i), r as usize);
            if !before.iter().any(|(k, _)| *k == (seq, r)) {
                let n = self.cells().row_slots(SeqId(seq), r).len();
                before.push(((seq, r), n));
            }
            if !prefixes.iter().any(|(s, _)| *s == seq) {
                prefixes.push((seq, self.cells().segments(SeqId(seq))?));
            }
        }
        let slots = self.allocate_for(seqs, rows, positions)?;
        let sights = rows
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                let key = (seq_of(i), r as usize);
                let count = before
                    .iter_mut()
                    .find(|(k, _)| *k == key)
                    .map(|(_, c)| {
                        *c += 1;
                        *c
                    })
                    .unwrap_or(1);
                Sight {
                    seq: key.0,
                    row: key.1,
                    count,
                }
            })
            .collect();
        Ok(Placement {
            slots,
            sights,
            prefixes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{CacheShape, CacheType};

    #[test]
    fn each_token_sees_the_prefix_and_its_rows_entries_up_to_its_own() {
        let shape = CacheShape {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 2,
            capacity: 16,
        };
        let mut c = KvCache::new(shape, CacheType::F32).unwrap();
        // A prompt of 3, committed: the shared prefix.
        c.place(&[], &[0, 0, 0], &[0, 1, 2]).unwrap();
        c.seq(SeqId::DEFAULT).commit_row(0).unwrap();
        // Two rows; row 1 already holds one private entry.
        c.place(&[], &[1], &[3]).unwrap();
        let p = c.place(&[], &[0, 1, 0, 1], &[3, 4, 4, 5]).unwrap();
        let counts: Vec<(usize, usize)> = p.sights.iter().map(|s| (s.row, s.count)).collect();
        assert_eq!(counts, [(0, 1), (1, 2), (0, 2), (1, 3)]);
        let v = p.visible(0..4, &c);
        assert!(v.iter().all(|v| v.prefix_len() == 3));
        assert_eq!(v[3].row_slots.len(), 3);
        assert_eq!(v[3].row_slots[2], p.slots[3]);
        // No room: refused, nothing placed.
        let before = c.cells().row_slots(SeqId::DEFAULT, 0).len();
        assert!(c.place(&[], &[0; 20], &[6; 20]).is_err());
        assert_eq!(c.cells().row_slots(SeqId::DEFAULT, 0).len(), before);
    }
}
