//! Which slot holds what, apart from the K/V bytes (llama.cpp's split of `llama-kv-cells` from
//! `llama-kv-cache`): the cache's slots are cut into contiguous *regions*, one per sequence,
//! reference-counted; each sequence has a shared prefix (segments borrowed read-only from other
//! regions, then its own committed entries at the start of its region) and private rows (slots
//! after them in its region). Operations that move entries return a [`Move`] for the storage
//! to carry out; nothing here touches K/V.

use crate::error::{Error, Result};

/// A sequence in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

impl SeqId {
    /// The one sequence of a cache made with [`super::KvCache::new`] and its siblings: it spans
    /// the whole capacity.
    pub const DEFAULT: SeqId = SeqId(0);
}

/// A run of consecutive slots of a shared prefix, read in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub start: usize,
    pub len: usize,
}

/// Entries to copy: `src[i]` goes to slot `dst + i` (the sources are all read first, so they
/// may overlap the destination).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Move {
    pub src: Vec<usize>,
    pub dst: usize,
}

impl Move {
    /// The copies that actually move something.
    pub fn is_noop(&self) -> bool {
        self.src.iter().enumerate().all(|(i, &s)| s == self.dst + i)
    }
}

#[derive(Debug)]
struct Region {
    start: usize,
    len: usize,
    /// Sequences and cached prefixes that use it.
    refs: u32,
}

#[derive(Debug)]
struct Seq {
    region: usize,
    /// Read-only prefix from other regions (a cached prompt), before the own entries.
    borrowed: Vec<Segment>,
    /// The regions `borrowed` lies in (one reference each held).
    borrowed_regions: Vec<usize>,
    /// Own shared entries: the region's first `shared` slots.
    shared: usize,
    /// Private slots of each row, in order.
    rows: Vec<Vec<usize>>,
    /// Private slot allocation: a bump pointer over the region after `shared`, plus freed slots.
    next_free: usize,
    free: Vec<usize>,
}

impl Seq {
    fn borrowed_len(&self) -> usize {
        self.borrowed.iter().map(|s| s.len).sum()
    }
}

pub struct Cells {
    capacity: usize,
    /// Position id of every slot.
    slot_pos: Vec<u32>,
    /// Free ranges `(start, len)`, sorted by start, coalesced.
    free_ranges: Vec<(usize, usize)>,
    regions: Vec<Option<Region>>,
    seqs: Vec<Option<Seq>>,
}

impl Cells {
    /// Empty cells over `capacity` slots, with no sequence.
    pub fn new(capacity: usize) -> Cells {
        Cells {
            capacity,
            slot_pos: vec![0; capacity],
            free_ranges: if capacity > 0 {
                vec![(0, capacity)]
            } else {
                Vec::new()
            },
            regions: Vec::new(),
            seqs: Vec::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn seq(&self, id: SeqId) -> Result<&Seq> {
        self.seqs
            .get(id.0 as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::internal(format!("no sequence {}", id.0)))
    }

    fn seq_mut(&mut self, id: SeqId) -> Result<&mut Seq> {
        self.seqs
            .get_mut(id.0 as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::internal(format!("no sequence {}", id.0)))
    }

    fn region(&self, r: usize) -> &Region {
        self.regions[r].as_ref().expect("live region")
    }

    /// Slots in no region.
    pub fn free_slots(&self) -> usize {
        self.free_ranges.iter().map(|&(_, l)| l).sum()
    }

    /// The largest region that could be made now.
    pub fn largest_free(&self) -> usize {
        self.free_ranges.iter().map(|&(_, l)| l).max().unwrap_or(0)
    }

    /// Slots in regions (used by sequences or kept for cached prefixes).
    pub fn used_slots(&self) -> usize {
        self.capacity - self.free_slots()
    }

    pub fn seq_ids(&self) -> Vec<SeqId> {
        (0..self.seqs.len())
            .filter(|&i| self.seqs[i].is_some())
            .map(|i| SeqId(i as u32))
            .collect()
    }

    fn take_range(&mut self, len: usize) -> Option<usize> {
        let i = self.free_ranges.iter().position(|&(_, l)| l >= len)?;
        let (start, l) = self.free_ranges[i];
        if l == len {
            self.free_ranges.remove(i);
        } else {
            self.free_ranges[i] = (start + len, l - len);
        }
        Some(start)
    }

    fn give_range(&mut self, start: usize, len: usize) {
        if len == 0 {
            return;
        }
        let i = self.free_ranges.partition_point(|&(s, _)| s < start);
        self.free_ranges.insert(i, (start, len));
        // Coalesce with the neighbours.
        if i + 1 < self.free_ranges.len() {
            let (s, l) = self.free_ranges[i];
            let (ns, nl) = self.free_ranges[i + 1];
            if s + l == ns {
                self.free_ranges[i] = (s, l + nl);
                self.free_ranges.remove(i + 1);
            }
        }
        if i > 0 {
            let (ps, pl) = self.free_ranges[i - 1];
            let (s, l) = self.free_ranges[i];
            if ps + pl == s {
                self.free_ranges[i - 1] = (ps, pl + l);
                self.free_ranges.remove(i);
            }
        }
    }

    pub(crate) fn hold(&mut self, region: usize) {
        if let Some(Some(r)) = self.regions.get_mut(region) {
            r.refs += 1;
        }
    }

    pub(crate) fn release(&mut self, region: usize) {
        let Some(Some(r)) = self.regions.get_mut(region) else {
            return;
        };
        r.refs -= 1;
        if r.refs == 0 {
            let (start, len) = (r.start, r.len);
            self.regions[region] = None;
            self.give_range(start, len);
        }
    }

    /// A new sequence with a region of `reserve` slots, its prefix starting with `borrow`
    /// (segments of other regions, which are held). `None` when no free range is that long.
    pub fn add_seq(&mut self, reserve: usize, borrow: &[(Segment, usize)]) -> Option<SeqId> {
        let start = self.take_range(reserve)?;
        let region = match self.regions.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.regions.push(None);
                self.regions.len() - 1
            }
        };
        self.regions[region] = Some(Region {
            start,
            len: reserve,
            refs: 1,
        });
        let mut borrowed_regions = Vec::new();
        for &(_, r) in borrow {
            self.hold(r);
            borrowed_regions.push(r);
        }
        let seq = Seq {
            region,
            borrowed: borrow.iter().map(|&(s, _)| s).collect(),
            borrowed_regions,
            shared: 0,
            rows: Vec::new(),
            next_free: start,
            free: Vec::new(),
        };
        let id = match self.seqs.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.seqs.push(None);
                self.seqs.len() - 1
            }
        };
        self.seqs[id] = Some(seq);
        Some(SeqId(id as u32))
    }

    /// Ends a sequence: its rows and its own entries after the first `keep` are freed at once;
    /// the first `keep` stay only while something else holds the region (a cached prefix).
    pub fn remove_seq(&mut self, id: SeqId, keep: usize) -> Result<()> {
        let s = self
            .seqs
            .get_mut(id.0 as usize)
            .and_then(Option::take)
            .ok_or_else(|| Error::internal(format!("no sequence {}", id.0)))?;
        let keep = keep.min(s.shared);
        if let Some(Some(r)) = self.regions.get_mut(s.region) {
            if keep < r.len && r.refs > 1 {
                let (tail, tail_len) = (r.start + keep, r.len - keep);
                r.len = keep;
                self.give_range(tail, tail_len);
            }
        }
        self.release(s.region);
        for r in s.borrowed_regions {
            self.release(r);
        }
        Ok(())
    }

    /// The segments of the first `n` prefix entries of a sequence, with the region of each,
    /// for another sequence to borrow.
    pub fn prefix_segments(&self, id: SeqId, n: usize) -> Result<Vec<(Segment, usize)>> {
        let s = self.seq(id)?;
        let mut out = Vec::new();
        let mut left = n;
        for (seg, &r) in s.borrowed.iter().zip(&s.borrowed_regions) {
            if left == 0 {
                break;
            }
            let len = seg.len.min(left);
            out.push((
                Segment {
                    start: seg.start,
                    len,
                },
                r,
            ));
            left -= len;
        }
        if left > 0 {
            if left > s.shared {
                return Err(Error::internal("a prefix longer than the sequence's"));
            }
            out.push((
                Segment {
                    start: self.region(s.region).start,
                    len: left,
                },
                s.region,
            ));
        }
        Ok(out)
    }

    /// The region a sequence's own entries live in.
    pub fn region_of(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.region)
    }

    /// The shared prefix of a sequence, in cache order.
    pub fn segments(&self, id: SeqId) -> Result<Vec<Segment>> {
        let s = self.seq(id)?;
        let mut out = s.borrowed.clone();
        if s.shared > 0 {
            out.push(Segment {
                start: self.region(s.region).start,
                len: s.shared,
            });
        }
        Ok(out)
    }

    pub fn shared_len(&self, id: SeqId) -> usize {
        self.seq(id).map_or(0, |s| s.borrowed_len() + s.shared)
    }

    pub fn shared_positions(&self, id: SeqId) -> Vec<u32> {
        let Ok(segs) = self.segments(id) else {
            return Vec::new();
        };
        segs.iter()
            .flat_map(|g| g.start..g.start + g.len)
            .map(|slot| self.slot_pos[slot])
            .collect()
    }

    pub fn slot_position(&self, slot: usize) -> u32 {
        self.slot_pos[slot]
    }

    pub fn n_rows(&self, id: SeqId) -> usize {
        self.seq(id).map_or(0, |s| s.rows.len())
    }

    pub fn row_slots(&self, id: SeqId, r: usize) -> &[usize] {
        self.seq(id)
            .ok()
            .and_then(|s| s.rows.get(r))
            .map_or(&[], Vec::as_slice)
    }

    /// Free entries of a sequence's region: what a forward may still add.
    /// Entries the sequence could hold once emptied (its region's length).
    pub fn room(&self, id: SeqId) -> usize {
        self.seq(id).map_or(0, |s| self.region(s.region).len)
    }

    pub fn available(&self, id: SeqId) -> usize {
        self.seq(id).map_or(0, |s| {
            let used: usize = s.rows.iter().map(Vec::len).sum();
            self.region(s.region).len - s.shared - used
        })
    }

    /// One new private entry of row `row` at `position`; fails when the region is full.
    pub fn allocate(&mut self, id: SeqId, row: usize, position: u32) -> Result<usize> {
        let available = self.available(id);
        let (start, len) = {
            let r = self.region(self.seq(id)?.region);
            (r.start, r.len)
        };
        let s = self.seq_mut(id)?;
        if available == 0 {
            let used: usize = s.rows.iter().map(Vec::len).sum();
            return Err(Error::ContextFull {
                needed: s.borrowed_len() + s.shared + used + 1,
                capacity: s.borrowed_len() + len,
            });
        }
        let slot = match s.free.pop() {
            Some(slot) => slot,
            None => {
                s.next_free += 1;
                s.next_free - 1
            }
        };
        debug_assert!(slot < start + len);
        if s.rows.len() <= row {
            s.rows.resize_with(row + 1, Vec::new);
        }
        s.rows[row].push(slot);
        self.slot_pos[slot] = position;
        Ok(slot)
    }

    pub fn truncate_rows(&mut self, id: SeqId, n: usize) -> Result<()> {
        let s = self.seq_mut(id)?;
        for row in &mut s.rows {
            if row.len() > n {
                s.free.extend(row.drain(n..));
            }
        }
        Ok(())
    }

    pub fn retain_rows(&mut self, id: SeqId, n: usize) -> Result<()> {
        let s = self.seq_mut(id)?;
        if s.rows.len() > n {
            for row in s.rows.drain(n..) {
                s.free.extend(row);
            }
        }
        Ok(())
    }

    /// Keeps the rows whose `keep` is set, renumbered in order.
    pub fn select_rows(&mut self, id: SeqId, keep: &[bool]) -> Result<()> {
        let s = self.seq_mut(id)?;
        let rows = std::mem::take(&mut s.rows);
        for (r, row) in rows.into_iter().enumerate() {
            if keep.get(r).copied().unwrap_or(true) {
                s.rows.push(row);
            } else {
                s.free.extend(row);
            }
        }
        Ok(())
    }

    pub fn clear_rows(&mut self, id: SeqId) -> Result<()> {
        let start = self.region(self.seq(id)?.region).start;
        let s = self.seq_mut(id)?;
        s.rows.clear();
        s.free.clear();
        s.next_free = start + s.shared;
        Ok(())
    }

    /// Truncates the shared prefix to `n` entries and drops every private entry.
    pub fn crop(&mut self, id: SeqId, n: usize) -> Result<()> {
        let s = self.seq_mut(id)?;
        let borrowed = s.borrowed_len();
        let mut released = Vec::new();
        if n < borrowed {
            s.shared = 0;
            let mut left = n;
            let mut keep = 0;
            for seg in s.borrowed.iter_mut() {
                if left == 0 {
                    break;
                }
                seg.len = seg.len.min(left);
                left -= seg.len;
                keep += 1;
            }
            s.borrowed.truncate(keep);
            released = s.borrowed_regions.split_off(keep);
        } else {
            s.shared = s.shared.min(n - borrowed);
        }
        for r in released {
            self.release(r);
        }
        self.clear_rows(id)
    }

    /// Appends the given private entries, `(row, index in row)`, to the shared prefix in that
    /// order and drops every private entry. Returns the copies that do it.
    pub fn commit(&mut self, id: SeqId, entries: &[(usize, usize)]) -> Result<Move> {
        let s = self.seq(id)?;
        let mut src = Vec::with_capacity(entries.len());
        for &(r, i) in entries {
            let slot = *s.rows.get(r).and_then(|row| row.get(i)).ok_or_else(|| {
                Error::internal(format!(
                    "commit of entry {i} of row {r}, which does not exist"
                ))
            })?;
            src.push(slot);
        }
        let dst = self.region(s.region).start + s.shared;
        let positions: Vec<u32> = src.iter().map(|&slot| self.slot_pos[slot]).collect();
        for (k, &p) in positions.iter().enumerate() {
            self.slot_pos[dst + k] = p;
        }
        self.seq_mut(id)?.shared += src.len();
        self.clear_rows(id)?;
        Ok(Move { src, dst })
    }

    /// Keeps the own shared entries for which `keep(index in the prefix, position)` holds,
    /// compacted in order; drops every private entry. Borrowed entries must all be kept.
    pub fn retain_shared(
        &mut self,
        id: SeqId,
        mut keep: impl FnMut(usize, u32) -> bool,
    ) -> Result<Move> {
        let s = self.seq(id)?;
        let start = self.region(s.region).start;
        let borrowed = s.borrowed_len();
        for (i, slot) in s
            .borrowed
            .iter()
            .flat_map(|g| g.start..g.start + g.len)
            .enumerate()
        {
            if !keep(i, self.slot_pos[slot]) {
                return Err(Error::internal("dropping entries of a borrowed prefix"));
            }
        }
        let kept: Vec<usize> = (start..start + s.shared)
            .enumerate()
            .filter(|&(i, slot)| keep(borrowed + i, self.slot_pos[slot]))
            .map(|(_, slot)| slot)
            .collect();
        let positions: Vec<u32> = kept.iter().map(|&slot| self.slot_pos[slot]).collect();
        for (k, &p) in positions.iter().enumerate() {
            self.slot_pos[start + k] = p;
        }
        self.seq_mut(id)?.shared = kept.len();
        self.clear_rows(id)?;
        Ok(Move {
            src: kept,
            dst: start,
        })
    }

    /// Makes the sequence's own shared prefix `positions.len()` entries at the start of its
    /// region with these positions (a saved prefix being loaded); returns where they go.
    pub fn set_shared(&mut self, id: SeqId, positions: &[u32]) -> Result<usize> {
        self.crop(id, 0)?;
        let s = self.seq(id)?;
        let r = self.region(s.region);
        if !s.borrowed.is_empty() || positions.len() > r.len {
            return Err(Error::internal(format!(
                "{} entries do not fit the sequence's {} slots",
                positions.len(),
                r.len
            )));
        }
        let start = r.start;
        self.slot_pos[start..start + positions.len()].copy_from_slice(positions);
        self.seq_mut(id)?.shared = positions.len();
        self.clear_rows(id)?;
        Ok(start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_taken_and_given_back_coalesced() {
        let mut c = Cells::new(100);
        let a = c.add_seq(30, &[]).unwrap();
        let b = c.add_seq(30, &[]).unwrap();
        let d = c.add_seq(30, &[]).unwrap();
        assert!(c.add_seq(30, &[]).is_none());
        assert_eq!(c.free_slots(), 10);
        c.remove_seq(b, 0).unwrap();
        assert_eq!(c.largest_free(), 30);
        c.remove_seq(a, 0).unwrap();
        assert_eq!(c.largest_free(), 60, "neighbours coalesce");
        c.remove_seq(d, 0).unwrap();
        assert_eq!((c.free_slots(), c.largest_free()), (100, 100));
    }

    #[test]
    fn a_borrowed_prefix_is_held_once_and_outlives_its_owner() {
        let mut c = Cells::new(64);
        let a = c.add_seq(20, &[]).unwrap();
        for i in 0..6 {
            c.allocate(a, 0, i).unwrap();
        }
        let m = c
            .commit(a, &(0..6).map(|i| (0, i)).collect::<Vec<_>>())
            .unwrap();
        assert_eq!(m.dst, 0);
        // b borrows a's first 4 entries: no copy, a's region held.
        let borrow = c.prefix_segments(a, 4).unwrap();
        let b = c.add_seq(10, &borrow).unwrap();
        assert_eq!(c.shared_len(b), 4);
        assert_eq!(c.shared_positions(b), vec![0, 1, 2, 3]);
        assert_eq!(c.used_slots(), 30);
        // a ends keeping 4 entries: its tail is freed at once, its head lives on for b.
        c.remove_seq(a, 4).unwrap();
        assert_eq!(c.used_slots(), 14);
        assert_eq!(c.segments(b).unwrap()[0], Segment { start: 0, len: 4 });
        c.remove_seq(b, 0).unwrap();
        assert_eq!(c.used_slots(), 0);
    }

    #[test]
    fn rows_commit_and_compaction_plan_copies() {
        let mut c = Cells::new(32);
        let s = c.add_seq(16, &[]).unwrap();
        let slots: Vec<usize> = (0..4)
            .map(|i| c.allocate(s, (i % 2) as usize, 10 + i).unwrap())
            .collect();
        assert_eq!(slots, vec![0, 1, 2, 3]);
        // Commit row 1's entries then row 0's first.
        let m = c.commit(s, &[(1, 0), (1, 1), (0, 0)]).unwrap();
        assert_eq!(
            m,
            Move {
                src: vec![1, 3, 0],
                dst: 0
            }
        );
        assert_eq!(c.shared_positions(s), vec![11, 13, 10]);
        let m = c.retain_shared(s, |_, p| p != 13).unwrap();
        assert_eq!(m.src, vec![0, 2]);
        assert_eq!(c.shared_positions(s), vec![11, 10]);
        assert_eq!(c.available(s), 14);
        c.crop(s, 1).unwrap();
        assert_eq!(c.shared_len(s), 1);
    }
}
