//! Cached prompts (vLLM's prefix caching, at token granularity): the prompt entries of live
//! and recently finished sequences, by their tokens, so that a new request that starts with
//! the same tokens (a system prompt, a chat history) borrows them instead of computing them
//! again. Only prompt entries are cached: they were computed in prompt order, by the same
//! batch-invariant kernels, so they are exactly what a fresh computation would give (entries
//! committed while decoding are not: they saw other rows). Each cached prompt holds a reference
//! on the regions it lies in; the least recently used goes first when room is needed.

use crate::kv::{cells::Cells, Segment};

struct Cached {
    tokens: Vec<u32>,
    /// Where its entries lie, in order, with the region of each segment.
    segments: Vec<(Segment, usize)>,
    last_used: u64,
}

#[derive(Default)]
pub struct Prefixes {
    entries: Vec<Cached>,
    clock: u64,
    /// Most cached prompts kept (each holds its regions).
    pub max_entries: usize,
}

/// A hit: the first `len` tokens of a cached prompt, and where they lie.
pub struct Hit {
    pub len: usize,
    pub segments: Vec<(Segment, usize)>,
}

impl Prefixes {
    pub fn new(max_entries: usize) -> Prefixes {
        Prefixes {
            entries: Vec::new(),
            clock: 0,
            max_entries,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest cached run of `prompt`'s first tokens, at most `max` of them.
    pub fn lookup(&mut self, prompt: &[u32], max: usize) -> Option<Hit> {
        let (best, len) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let n = e
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                (i, n.min(max))
            })
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))?;
        if len == 0 {
            return None;
        }
        self.clock += 1;
        let e = &mut self.entries[best];
        e.last_used = self.clock;
        let mut left = len;
        let mut segments = Vec::new();
        for &(seg, r) in &e.segments {
            if left == 0 {
                break;
            }
            let n = seg.len.min(left);
            segments.push((
                Segment {
                    start: seg.start,
                    len: n,
                },
                r,
            ));
            left -= n;
        }
        Some(Hit { len, segments })
    }

    /// Caches a prompt whose entries lie in `segments` (taking a reference on their regions).
    /// A prompt already cached, or a prefix of one, adds nothing.
    pub fn insert(&mut self, cells: &mut Cells, tokens: &[u32], segments: Vec<(Segment, usize)>) {
        if tokens.is_empty()
            || self
                .entries
                .iter()
                .any(|e| e.tokens.len() >= tokens.len() && e.tokens[..tokens.len()] == *tokens)
        {
            return;
        }
        for &(_, r) in &segments {
            cells.hold(r);
        }
        self.clock += 1;
        self.entries.push(Cached {
            tokens: tokens.to_vec(),
            segments,
            last_used: self.clock,
        });
        while self.entries.len() > self.max_entries.max(1) {
            self.evict_lru(cells);
        }
    }

    /// Drops the least recently used cached prompt; false when none is left.
    pub fn evict_lru(&mut self, cells: &mut Cells) -> bool {
        let Some(i) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used) else {
            return false;
        };
        let e = self.entries.remove(i);
        for (_, r) in e.segments {
            cells.release(r);
        }
        true
    }

    /// Drops every cached prompt.
    pub fn clear(&mut self, cells: &mut Cells) {
        while self.evict_lru(cells) {}
    }

    /// Tokens held by cached prompts (counting a shared part once per prompt).
    pub fn tokens(&self) -> usize {
        self.entries.iter().map(|e| e.tokens.len()).sum()
    }
}
