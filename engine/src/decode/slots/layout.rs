//! Where a slot decode's slots lie: runs of masked positions, each cut into slots from its
//! first position and spread over the serial blocks; a run ends at its first committed EOS.
//! Plain slot decoding has one run after the prompt, split as the reference splits it;
//! infilling has one run per gap of the template ([`super::super::template`]), each cut into
//! blocks of the plain decode's block length, every gap's b-th block in serial block b.

use crate::decode::template::Template;
use crate::decode::DecodeParams;

struct Run {
    start: u32,
    slots: u32,
    /// The position of the run's first committed EOS: its slots after it are never decoded.
    eos: Option<u32>,
}

pub(super) struct Layout {
    k: u32,
    /// Slots per serial block (of each run).
    per_block: u32,
    blocks: u32,
    runs: Vec<Run>,
}

impl Layout {
    /// The reference's layout: one run of the padded gen length after a prompt of
    /// `prompt_len` tokens, in `serial_blocks` blocks of `gen_length / serial_blocks` tokens
    /// (a remainder is never generated).
    pub(super) fn contiguous(prompt_len: u32, p: &DecodeParams) -> Layout {
        let k = p.slot_size.max(1);
        Layout {
            k,
            per_block: p.block_len() / k,
            blocks: p.serial_blocks.max(1),
            runs: vec![Run {
                start: prompt_len,
                slots: p.padded_gen_length() / k,
                eos: None,
            }],
        }
    }

    /// One run per gap of `t`, the answer after a prompt of `prompt_len` tokens. Each gap is
    /// cut into serial blocks of the plain decode's length (`gen_length / serial_blocks`, at
    /// least one slot) from its start; serial block b holds every gap's b-th block.
    pub(super) fn template(prompt_len: u32, t: &Template, p: &DecodeParams) -> Layout {
        let k = p.slot_size.max(1);
        let per_block = (p.block_len() / k).max(1);
        let runs: Vec<Run> = t
            .gaps(prompt_len, k)
            .into_iter()
            .map(|(start, slots)| Run {
                start,
                slots,
                eos: None,
            })
            .collect();
        let blocks = runs
            .iter()
            .map(|r| r.slots.div_ceil(per_block))
            .max()
            .unwrap_or(0);
        Layout {
            k,
            per_block,
            blocks,
            runs,
        }
    }

    pub(super) fn blocks(&self) -> usize {
        self.blocks as usize
    }

    /// A run's slot indices in serial block `b`.
    fn share(&self, run: &Run, b: u32) -> std::ops::Range<u32> {
        let at = |b: u32| (b as u64 * self.per_block as u64).min(run.slots as u64) as u32;
        at(b)..at(b + 1)
    }

    /// Serial block `b`'s slots (first positions), in position order, without those past
    /// their run's EOS.
    pub(super) fn block(&self, b: usize) -> Vec<u32> {
        let mut out = Vec::new();
        for run in &self.runs {
            for s in self.share(run, b as u32) {
                let start = run.start + s * self.k;
                if run.eos.is_none_or(|e| start <= e) {
                    out.push(start);
                }
            }
        }
        out
    }

    /// The most masked tokens one planning forward may hold (its serial block's slots).
    pub(super) fn max_block_tokens(&self) -> usize {
        // Block 0 is the fullest: every run's first block.
        let slots: u64 = self
            .runs
            .iter()
            .map(|r| self.share(r, 0).len() as u64)
            .sum();
        slots as usize * self.k as usize
    }
    fn run_of(&self, pos: u32) -> Option<usize> {
        let i = self.runs.partition_point(|r| r.start <= pos);
        let r = self.runs.get(i.checked_sub(1)?)?;
        (pos < r.start + r.slots * self.k).then_some(i - 1)
    }

    /// Whether two positions lie in the same run.
    pub(super) fn same_run(&self, a: u32, b: u32) -> bool {
        self.run_of(a).is_some() && self.run_of(a) == self.run_of(b)
    }

    /// An EOS committed at `pos`: its run ends there.
    pub(super) fn end_at(&mut self, pos: u32) {
        if let Some(r) = self.run_of(pos) {
            let e = &mut self.runs[r].eos;
            *e = Some(e.map_or(pos, |x| x.min(pos)));
        }
    }

    /// Whether the slot starting at `start` lies past its run's EOS.
    pub(super) fn past_eos(&self, start: u32) -> bool {
        self.run_of(start)
            .and_then(|r| self.runs[r].eos)
            .is_some_and(|e| start > e)
    }

    /// Whether every run has ended at an EOS (nothing is left to decode).
    pub(super) fn all_ended(&self) -> bool {
        self.runs.iter().all(|r| r.eos.is_some())
    }
}
