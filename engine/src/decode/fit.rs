//! Gaps that take the length their text needs ([`Piece::Fit`]): a gap is a maximum, as
//! `max_tokens` is. The infill strategy for a template with such gaps.
//!
//! The signal is the model's own: a gap longer than its text is filled with the text, then with
//! the span after the gap written again (the model continues the answer, and the span is what
//! comes next). So the gaps are first drafted at their maximum (the *probe*: each serial
//! block's planning draft taken as it is, one forward a block, nothing verified), watched after
//! every block: once each gap's draft has met the span after it ([`junction`]: two of the
//! span's tokens written again right after a token that ends with the healed text; or
//! [`rewritten_at`]: three of them anywhere), ended at an EOS, or filled its whole size, the
//! probe stops. Every gap is then decoded for real at the length found (rounded up to whole
//! slots: the *final* decode), so that the span lies right after its text, as in training (a
//! fill decoded with a hole after it reads worse: to the model it is the answer's end). A
//! template whose fitted gaps have no span after them needs no probe.
//!
//! The answer is stitched from the last decode ([`Filled::stitch`]): each fitted gap cut where
//! its span begins again, healed tokens put back where the fill does not stand for them.
//! Committed tokens are reported once, at the end (a probe's are provisional); the drafts as
//! they come.

use std::sync::Arc;

use super::slots::{FirstPlan, SlotDecoder};
use super::strategy::{Poll, Strategy};
use super::template::{junction, loosely_at, rewritten_at, Piece, Template};
use super::{DecodeParams, DecodeResult, Earlier, Event};
use crate::error::Result;
use crate::kv::SeqCache;
use crate::model::LogitsRef;

/// Tokens of the span a probe's fill must write again for its length to be taken (fewer
/// when the span is shorter).
const ANCHOR: usize = 2;

/// How many of the decode's serial blocks one probe block spans.
const PROBE_BLOCKS: u32 = 4;

enum Stage {
    Probe,
    Final,
}

pub struct Fit {
    prompt: Vec<u32>,
    params: DecodeParams,
    stage: Stage,
    inner: SlotDecoder,
    /// Figures of the decodes before the current one.
    earlier: Earlier,
    tpf: (f64, usize),
}

/// What a probe found of one fitted gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// Not yet: decode on.
    Open,
    /// Its text takes this many tokens.
    Length(u32),
    /// It keeps the size it was decoded at (an EOS, or filled without meeting its span).
    Keep,
}

impl Fit {
    pub fn new(prompt: &[u32], cached: usize, params: &DecodeParams) -> Fit {
        let t = params.answer_template();
        let met = t
            .pieces
            .windows(2)
            .any(|w| matches!(w, [Piece::Fit(_), Piece::Known(_)]));
        let (stage, inner) = if met {
            let probe = probing(params);
            (Stage::Probe, SlotDecoder::drafting(prompt, cached, &probe))
        } else {
            (Stage::Final, SlotDecoder::infill(prompt, cached, params))
        };
        Fit {
            prompt: prompt.to_vec(),
            params: params.clone(),
            stage,
            inner,
            earlier: Earlier::default(),
            tpf: (0.0, 0),
        }
    }

    /// Each fitted gap's state in the probe, from the committed tokens.
    fn found(&self, t: &Template) -> Vec<Found> {
        let k = self.params.slot_size;
        let start = self.prompt.len() as u32;
        let (tokens, positions) = self.inner.written();
        let (tokens, positions) = (tokens.as_slice(), positions.as_slice());
        let gaps = t.gaps(start, k);
        let mut out = Vec::new();
        let mut g = 0;
        for (i, p) in t.pieces.iter().enumerate() {
            let f = match p {
                Piece::Known(_) => continue,
                Piece::Gap(_) => {
                    g += 1;
                    continue;
                }
                Piece::Fit(f) => f,
            };
            let (at, slots) = gaps[g];
            g += 1;
            let fill = contiguous(tokens, positions, at, at + slots * k);
            let eos = fill.iter().position(|&t| t == self.params.eos_id);
            let fill = &fill[..eos.unwrap_or(fill.len())];
            let span = match t.pieces.get(i + 1) {
                Some(Piece::Known(ids)) => ids.as_slice(),
                _ => &[],
            };
            let anchor = ANCHOR.min(span.len());
            let met = (anchor > 0)
                .then(|| junction(fill, span, f.last.as_ref(), anchor))
                .flatten()
                .or_else(|| rewritten_at(fill, span))
                .or_else(|| loosely_at(fill, span, f.last.as_ref()));
            out.push(match (met, eos) {
                (Some(n), _) => Found::Length(n as u32),
                (None, Some(_)) => Found::Keep,
                (None, None) if fill.len() as u32 >= slots * k => Found::Keep,
                (None, None) => Found::Open,
            });
        }
        out
    }

    /// After a probe's step: once every fitted gap is found, the final decode at the lengths
    /// found starts (the probe's entries after the prompt are dropped).
    fn after_probe_step(
        &mut self,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        let t = self.params.answer_template().into_owned();
        let found = self.found(&t);
        if found.contains(&Found::Open) && !self.inner.is_done() {
            return Ok(());
        }
        let k = self.params.slot_size;
        let mut sized = t.clone();
        let fits = sized.pieces.iter_mut().filter_map(|p| match p {
            Piece::Fit(f) => Some(f),
            _ => None,
        });
        for (f, found) in fits.zip(&found) {
            if let Found::Length(n) = *found {
                f.found = Some(n);
                let size = n.max(1).div_ceil(k) * k;
                if size < f.size.div_ceil(k) * k {
                    f.size = size;
                }
            }
        }
        on_event(Event::Resized { template: &sized });
        self.restart(sized, cache, on_event)
    }

    /// Starts the final decode of `sized` over the prompt's entries. Its first step takes the
    /// probe's first draft as its plan where that draft covers the step's slots
    /// ([`SlotDecoder::reuse_plan`]): a gap's draft at its maximum is the same masked text up
    /// to the length found, so the final decode saves its first planning forward.
    fn restart(
        &mut self,
        sized: Template,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        self.earlier.add(self.inner.result());
        let (sum, steps) = self.inner.tpf_parts();
        self.tpf = (self.tpf.0 + sum, self.tpf.1 + steps);
        let (start, k) = (self.prompt.len() as u32, self.params.slot_size);
        let probe_gaps = self.params.answer_template().gaps(start, k);
        let plan = self.inner.first_plan().cloned();
        cache.crop(self.prompt.len())?;
        let final_gaps = sized.gaps(start, k);
        self.params.template = Some(Arc::new(sized));
        let n = self.prompt.len();
        self.inner = SlotDecoder::infill(&self.prompt, n, &self.params);
        self.stage = Stage::Final;
        let reused = plan.and_then(|p| {
            let at = |s: u32| probe_start(s, &final_gaps, &probe_gaps, k);
            planned_for(&p, self.inner.block_slots(), at, k as usize)
        });
        if let Some((tokens, conf)) = reused {
            self.inner.reuse_plan(tokens, &conf, on_event);
        }
        Ok(())
    }
}

/// Where the final decode's slot at `slot` (a position in one of `final_gaps`) was in the
/// probe: the same offset in the same gap of `probe_gaps`.
fn probe_start(
    slot: u32,
    final_gaps: &[(u32, u32)],
    probe_gaps: &[(u32, u32)],
    k: u32,
) -> Option<u32> {
    final_gaps
        .iter()
        .zip(probe_gaps)
        .find(|((at, n), _)| slot >= *at && slot < at + n * k)
        .map(|((at, _), (was, _))| was + (slot - at))
}

/// The draft and first-token confidence of each of `slots` from the probe's first plan, if
/// it drafted them all (`at`: a slot's start in the probe).
fn planned_for(
    plan: &FirstPlan,
    slots: &[u32],
    at: impl Fn(u32) -> Option<u32>,
    k: usize,
) -> Option<(Vec<u32>, Vec<f32>)> {
    let mut tokens = Vec::with_capacity(slots.len() * k);
    let mut conf = Vec::with_capacity(slots.len());
    for &s in slots {
        let was = at(s)?;
        let i = plan.slots.iter().position(|&p| p == was)?;
        tokens.extend_from_slice(&plan.tokens[i * k..(i + 1) * k]);
        conf.push(plan.conf[i]);
    }
    (!slots.is_empty()).then_some((tokens, conf))
}

/// The probe's parameters: blocks [`PROBE_BLOCKS`] times as long (fewer serial blocks), so
/// that one drafting forward usually reaches past a gap's text.
fn probing(params: &DecodeParams) -> DecodeParams {
    let mut p = params.clone();
    p.serial_blocks = (p.serial_blocks / PROBE_BLOCKS).max(1);
    p
}

/// The committed tokens at `start..end`, from `start` up to the first position not committed.
fn contiguous(tokens: &[u32], positions: &[u32], start: u32, end: u32) -> Vec<u32> {
    let mut inside: Vec<(u32, u32)> = positions
        .iter()
        .zip(tokens)
        .filter(|(&p, _)| p >= start && p < end)
        .map(|(&p, &t)| (p, t))
        .collect();
    inside.sort_unstable();
    inside
        .iter()
        .enumerate()
        .take_while(|(i, (p, _))| *p == start + *i as u32)
        .map(|(_, &(_, t))| t)
        .collect()
}

impl Strategy for Fit {
    fn poll(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<Poll<'_>> {
        self.inner.poll(on_event)
    }

    fn feed(
        &mut self,
        logits: &LogitsRef<'_>,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        // Commits are reported once the answer is known (see the module's notes).
        let mut drafts = |ev: Event<'_>| {
            if !matches!(ev, Event::Committed { .. }) {
                on_event(ev)
            }
        };
        self.inner.feed(logits, cache, &mut drafts)?;
        if matches!(self.stage, Stage::Probe) && self.inner.at_step_boundary() {
            self.after_probe_step(cache, on_event)?;
        }
        if self.inner.is_done() {
            let k = self.params.slot_size;
            let gaps = self
                .params
                .answer_template()
                .gaps(self.prompt.len() as u32, k);
            let in_gap = |p: u32| gaps.iter().any(|&(at, n)| p >= at && p < at + n * k);
            let (tokens, positions) = self.inner.committed();
            let (positions, tokens): (Vec<u32>, Vec<u32>) = positions
                .iter()
                .zip(tokens)
                .filter(|(&p, _)| in_gap(p))
                .map(|(&p, &t)| (p, t))
                .unzip();
            on_event(Event::Committed {
                positions: &positions,
                tokens: &tokens,
            });
        }
        Ok(())
    }

    fn at_step_boundary(&self) -> bool {
        self.inner.at_step_boundary()
    }

    fn is_done(&self) -> bool {
        self.inner.is_done()
    }

    fn result(&mut self) -> DecodeResult {
        let mut r = self.inner.result();
        let (sum, steps) = self.inner.tpf_parts();
        let (sum, steps) = (self.tpf.0 + sum, self.tpf.1 + steps);
        r.tpf = if steps > 0 { sum / steps as f64 } else { 0.0 };
        self.earlier.put_before(&mut r);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fill_is_read_from_its_start_to_the_first_hole() {
        let tokens = [9, 7, 5, 6, 8];
        let positions = [0, 12, 10, 11, 14];
        assert_eq!(contiguous(&tokens, &positions, 10, 16), vec![5, 6, 7]);
        assert_eq!(contiguous(&tokens, &positions, 13, 16), Vec::<u32>::new());
    }

    #[test]
    fn the_final_decode_takes_the_probes_draft_slot_for_slot() {
        // The probe's gaps: 3 slots of 2 at 10, 2 at 20; the final's: 1 at 10, 2 at 14.
        let (probe, fin) = ([(10, 3), (20, 2)], [(10, 1), (14, 2)]);
        assert_eq!(probe_start(10, &fin, &probe, 2), Some(10));
        assert_eq!(probe_start(16, &fin, &probe, 2), Some(22));
        assert_eq!(probe_start(12, &fin, &probe, 2), None, "in no gap");
        let plan = FirstPlan {
            slots: vec![10, 12, 20],
            tokens: vec![1, 2, 3, 4, 5, 6],
            conf: vec![0.5, 0.25, 0.75],
        };
        let at = |s| probe_start(s, &fin, &probe, 2);
        assert_eq!(
            planned_for(&plan, &[10, 14], at, 2),
            Some((vec![1, 2, 5, 6], vec![0.5, 0.75]))
        );
        // A slot the probe's first forward did not draft: no plan to take.
        assert_eq!(planned_for(&plan, &[10, 16], at, 2), None);
    }
}
