//! Where a slot decode's slots lie: runs of masked positions, each cut into slots from its
//! first position and spread over the serial blocks; a run ends at its first committed EOS.
//! Plain slot decoding has one run after the prompt, split as the reference splits it;
//! infilling has one run per gap of the template ([`super::super::template`]), each gap's
//! b-th share of slots in serial block b.

use crate::decode::template::Template;
use crate::decode::DecodeParams;

struct Run {
    start: u32,
    slots: u32,
    /// Slots per serial block as the reference counts them (`gen_length / blocks / k`, the
    /// remainder never generated); `None`: an even split (`b * slots / blocks ..`), nothing
    /// left out.
    per_block: Option<u32>,
    /// The position of the run's first committed EOS: its slots after it are never decoded.
    eos: Option<u32>,
}

pub(super) struct Layout {
    k: u32,
    blocks: u32,
    runs: Vec<Run>,
}

impl Layout {
    /// The reference's layout: one run of the padded gen length after a prompt of
    /// `prompt_len` tokens.
    pub(super) fn contiguous(prompt_len: u32, p: &DecodeParams) -> Layout {
        let k = p.slot_size.max(1);
        Layout {
            k,
            blocks: p.serial_blocks.max(1),
            runs: vec![Run {
                start: prompt_len,
                slots: p.padded_gen_length() / k,
                per_block: Some(p.block_len() / k),
                eos: None,
            }],
        }
    }

    /// One run per gap of `t`, the answer after a prompt of `prompt_len` tokens.
    pub(super) fn template(prompt_len: u32, t: &Template, p: &DecodeParams) -> Layout {
        let k = p.slot_size.max(1);
        Layout {
            k,
            blocks: p.serial_blocks.max(1),
            runs: t
                .gaps(prompt_len, k)
                .into_iter()
                .map(|(start, slots)| Run {
                    start,
                    slots,
                    per_block: None,
                    eos: None,
                })
                .collect(),
        }
    }

    pub(super) fn blocks(&self) -> usize {
        self.blocks as usize
    }

    /// Run `r`'s slot indices in serial block `b`.
    fn share(&self, run: &Run, b: u32) -> std::ops::Range<u32> {
        match run.per_block {
            Some(per) => b * per..(b + 1) * per,
            None => {
                let (n, nb) = (run.slots as u64, self.blocks as u64);
                let at = |b: u64| (b * n / nb) as u32;
                at(b as u64)..at(b as u64 + 1)
            }
        }
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
        (0..self.blocks)
            .map(|b| {
                self.runs
                    .iter()
                    .map(|r| self.share(r, b).len() as u64)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0) as usize
            * self.k as usize
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
