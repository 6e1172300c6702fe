//! ReFusion's slot decoding as a [`Strategy`]: [`SlotDecoder::poll`] says which tokens it needs
//! forwarded next (or that it is done), [`SlotDecoder::feed`] takes their logits back. A
//! scheduler can thus merge the batches of several decoders into one forward and split the
//! logits back; driven alone ([`super::generate_cancellable`]) it makes exactly the forwards of
//! the reference's loop, but for a planning forward over long slots, made in two parts.
//!
//! One iteration of the reference's `while` loop over a serial block's remaining slots is one
//! *step*, in phases: plan (draft every remaining slot), verify (the confident slots
//! autoregressively), and when no slot prefix is accepted, infill (draft and re-verify the
//! chosen slots as parallel rows, up to `slot_size` rounds).
//!
//! With long slots ([`DecodeParams::split_plan_from`]) the plan stops after the last slot's
//! first token: the slots are chosen from their first tokens alone, and the last slot's other
//! masks (causal, after every other mask) change no earlier draft. They are forwarded next, on
//! top of the plan's entries, only when that slot is chosen; the tokens are the reference's
//! either way, and a tail not chosen (the usual case) spares its `slot_size - 1` masks.

use super::strategy::{Poll, Strategy};
use super::template::Filled;
use super::{argmax, logprob, prob, DecodeParams, DecodeResult, Event, Noise, TokenLogprob};
use crate::error::{Error, Result};
use crate::kv::SeqCache;
use crate::model::{Batch, LogitsFor, LogitsRef};

mod infill;
mod layout;
use infill::{build_rows, Infill};
use layout::Layout;

/// The most masked tokens one planning forward of the infill strategy holds.
pub fn infill_scratch(params: &DecodeParams) -> usize {
    Layout::template(0, &params.answer_template(), params).max_block_tokens()
}

/// The planning forward's drafts of the remaining slots and the slots chosen to verify.
struct Planned {
    x0: Vec<u32>,
    chosen: Vec<usize>,
    /// Slots counted in this step's TPF (the confident ones, at least one).
    counts_block: usize,
    /// Pending tokens (known spans) fed in front of the verification: a plan taken from a
    /// probe's draft ([`SlotDecoder::reuse_plan`]) had no planning forward to feed them.
    fed: usize,
    /// With logprobs: each slot's first token's, from the planning forward (a slot's first
    /// token is committed as drafted: verification never scores it).
    first_lp: Vec<Option<TokenLogprob>>,
}

/// A drafting decoder's first planning forward, kept for the decode after it
/// ([`SlotDecoder::reuse_plan`]): each slot's start, its drafted tokens and its confidence.
#[derive(Debug, Clone, Default)]
pub(super) struct FirstPlan {
    pub slots: Vec<u32>,
    pub tokens: Vec<u32>,
    pub conf: Vec<f32>,
}

enum Phase {
    /// Next: the planning forward over the remaining slots (and any prompt not yet cached).
    Plan,
    /// Next: a split plan's second forward, the last slot's tail (that slot was chosen).
    PlanTail(Planned),
    /// Next: the verification forward of the chosen slots.
    Verify(Planned),
    /// Next: round `it`'s draft forward (unverified tokens masked).
    Draft(Infill),
    /// Next: round `it`'s re-verification of the rows with their new tokens.
    Recheck(Infill),
    Done,
}

pub struct SlotDecoder {
    p: DecodeParams,
    k: usize,
    prompt_len: usize,
    /// Where the slots are, and which runs of them an EOS has ended.
    layout: Layout,
    /// The serial block being decoded.
    block: usize,
    /// Remaining slots of the block, by start position, in position order.
    slots: Vec<u32>,
    /// The tokens not in the cache yet, at their positions: the rest of the prompt and any
    /// known spans of a template (fed with the first planning forward).
    pending: Vec<u32>,
    pending_pos: Vec<u32>,
    noise: Noise,
    /// Committed tokens and positions, in cache order (prompt first).
    cur_x: Vec<u32>,
    cur_pos: Vec<u32>,
    sum_tpf: f64,
    tpf_steps: usize,
    forward_calls: usize,
    forward_tokens: usize,
    forward_sizes: Vec<u32>,
    phase: Phase,
    /// Token healing: a fitted gap's first position and the tokens it admits (the planning
    /// forward's draft of that position is taken among them: [`restrict`]).
    first_tokens: Vec<(u32, std::sync::Arc<[u32]>)>,
    /// Drafting only (a fitted gap's probe, [`super::fit`]): each serial block's planning
    /// draft is taken as it is, fed with the next block's planning forward, and nothing is
    /// verified: one forward a block.
    drafting: bool,
    /// A drafting decoder's first planning draft (see [`FirstPlan`]).
    first_plan: Option<FirstPlan>,
    /// The batch of the forward asked for (reused between forwards).
    batch: Batch,
    /// For each token of the batch, the row of its logits (`usize::MAX`: not asked for). Only
    /// the logits a phase reads are asked for: each is a product with the whole output layer.
    logit_row: Vec<usize>,
    /// With logprobs ([`DecodeParams::logprobs`]): each committed token's, by position.
    committed_lp: std::collections::HashMap<u32, TokenLogprob>,
}

impl SlotDecoder {
    /// A decoder of `prompt`, whose first `cached` tokens are already the sequence's shared
    /// entries. The caller has checked the prompt and the cache's room ([`super::check`]).
    pub fn new(prompt: &[u32], cached: usize, params: &DecodeParams) -> SlotDecoder {
        let layout = Layout::contiguous(prompt.len() as u32, params);
        SlotDecoder::with_layout(prompt, cached, params, layout, (Vec::new(), Vec::new()))
    }

    /// The infill strategy's decoder ([`super::Kind::Infill`]): the template's known spans
    /// committed at their positions with the prompt's first forward, its gaps decoded as runs
    /// of slots (without a template: one gap of the gen length).
    pub fn infill(prompt: &[u32], cached: usize, params: &DecodeParams) -> SlotDecoder {
        let t = params.answer_template();
        let start = prompt.len() as u32;
        let layout = Layout::template(start, &t, params);
        let known = t.known(start, params.slot_size);
        let mut d = SlotDecoder::with_layout(prompt, cached, params, layout, known);
        d.first_tokens = t.first_tokens(start, params.slot_size);
        d
    }

    /// The drafting-only decoder of a fitted gap's probe (see [`Self::drafting`]).
    pub(super) fn drafting(prompt: &[u32], cached: usize, params: &DecodeParams) -> SlotDecoder {
        let mut d = SlotDecoder::infill(prompt, cached, params);
        d.drafting = true;
        d
    }

    /// Committed tokens and their positions, in cache order (the prompt's first).
    pub(super) fn committed(&self) -> (&[u32], &[u32]) {
        (&self.cur_x, &self.cur_pos)
    }

    /// Committed and drafted tokens (a drafting decoder's drafts wait to be fed), and their
    /// positions.
    pub(super) fn written(&self) -> (Vec<u32>, Vec<u32>) {
        let mut x = self.cur_x.clone();
        let mut p = self.cur_pos.clone();
        x.extend_from_slice(&self.pending);
        p.extend_from_slice(&self.pending_pos);
        (x, p)
    }

    /// A drafting decoder's first planning draft, once made.
    pub(super) fn first_plan(&self) -> Option<&FirstPlan> {
        self.first_plan.as_ref()
    }

    /// The slots of the serial block being decoded, by start position.
    pub(super) fn block_slots(&self) -> &[u32] {
        &self.slots
    }

    /// Takes the first step's plan from a draft made before (`tokens` and `conf` for each of
    /// [`Self::block_slots`], from a fitted gap's probe) instead of a planning forward: the
    /// step's verification comes next, with the pending tokens (the known spans) fed in front
    /// of it. The slots are chosen from `conf` as after a planning forward.
    pub(super) fn reuse_plan(
        &mut self,
        tokens: Vec<u32>,
        conf: &[f32],
        on_event: &mut dyn FnMut(Event<'_>),
    ) {
        debug_assert!(matches!(self.phase, Phase::Plan) && self.cur_x.len() == self.prompt_len);
        on_event(Event::Planned {
            slot_starts: &self.slots,
            slot_size: self.k,
            tokens: &tokens,
        });
        let (chosen, counts_block) = self.choose(conf);
        self.phase = Phase::Verify(Planned {
            x0: tokens,
            chosen,
            counts_block,
            fed: self.pending.len(),
            first_lp: Vec::new(),
        });
    }

    /// The slots a step verifies: those whose first token's confidence is above the
    /// threshold, else the most confident one; and how many count in its TPF.
    fn choose(&self, conf: &[f32]) -> (Vec<usize>, usize) {
        let mut chosen: Vec<usize> = (0..conf.len())
            .filter(|&s| conf[s] > self.p.slot_threshold)
            .collect();
        let counts_block = chosen.len().max(1);
        if chosen.is_empty() {
            chosen.push(argmax(conf));
        }
        (chosen, counts_block)
    }

    /// The tokens-per-forward figures so far: their sum and how many steps they are of.
    pub(super) fn tpf_parts(&self) -> (f64, usize) {
        (self.sum_tpf, self.tpf_steps)
    }

    fn with_layout(
        prompt: &[u32],
        cached: usize,
        params: &DecodeParams,
        layout: Layout,
        (known, known_pos): (Vec<u32>, Vec<u32>),
    ) -> SlotDecoder {
        let mut pending = prompt[cached..].to_vec();
        let mut pending_pos: Vec<u32> = (cached as u32..prompt.len() as u32).collect();
        pending.extend(known);
        pending_pos.extend(known_pos);
        let mut d = SlotDecoder {
            p: params.clone(),
            k: params.slot_size as usize,
            prompt_len: prompt.len(),
            layout,
            block: 0,
            slots: Vec::new(),
            pending,
            pending_pos,
            noise: Noise::new(params.seed),
            cur_x: prompt[..cached].to_vec(),
            cur_pos: (0..cached as u32).collect(),
            sum_tpf: 0.0,
            tpf_steps: 0,
            forward_calls: 0,
            forward_tokens: 0,
            forward_sizes: Vec::new(),
            phase: Phase::Plan,
            first_tokens: Vec::new(),
            drafting: false,
            first_plan: None,
            batch: Batch::default(),
            logit_row: Vec::new(),
            committed_lp: std::collections::HashMap::new(),
        };
        d.start_block();
        d.skip_empty_blocks();
        d
    }

    fn start_block(&mut self) {
        self.slots = self.layout.block(self.block);
    }

    /// Removes the step's finished slots and moves to the next step, block or the end.
    fn end_step(&mut self, mut removed: Vec<usize>) {
        removed.sort_unstable();
        removed.dedup();
        let mut keep = vec![true; self.slots.len()];
        for i in removed {
            if let Some(k) = keep.get_mut(i) {
                *k = false;
            }
        }
        let mut it = keep.iter();
        self.slots.retain(|_| *it.next().unwrap_or(&true));
        // Slots past their run's EOS are never decoded (the reference: those after its EOS).
        let layout = &self.layout;
        self.slots.retain(|&s| !layout.past_eos(s));
        self.phase = Phase::Plan;
        self.skip_empty_blocks();
    }

    /// Moves on to the next serial block with slots to decode, or to the end. (A gap shorter
    /// than its serial blocks leaves some of them empty, the first one too.)
    fn skip_empty_blocks(&mut self) {
        while self.slots.is_empty() {
            self.block += 1;
            if self.layout.all_ended() || self.block >= self.layout.blocks() {
                self.phase = Phase::Done;
                return;
            }
            self.start_block();
        }
    }

    /// Whether this step's planning forward leaves the last slot's tail for a second one
    /// ([`DecodeParams::split_plan_from`]). The masks are causal in slot order, so the tail
    /// changes no earlier draft or confidence, and the choice needs none of it: drafted only
    /// when its slot is chosen. Not for a lone slot (always chosen), nor while drafting (every
    /// draft is taken).
    fn splits_plan(&self) -> bool {
        let from = self.p.split_plan_from as usize;
        from > 0 && self.k >= from && self.slots.len() >= 2 && !self.drafting
    }

    /// 1. Planning forward over the remaining masks (with the rest of the prompt, first time).
    fn build_plan(&mut self) {
        let tail = if self.splits_plan() { self.k - 1 } else { 0 };
        let masks = self.slots.len() * self.k - tail;
        let b = &mut self.batch;
        b.clear();
        for (&t, &pos) in self.pending.iter().zip(&self.pending_pos) {
            b.push(t, pos, 0);
        }
        for i in 0..masks {
            let (s, j) = (i / self.k, i % self.k);
            b.push(self.p.mask_id, self.slots[s] + j as u32, 0);
        }
        b.logits_for = LogitsFor::Indices((self.pending.len()..b.len()).collect());
    }

    /// A split plan's second forward: the last slot's tail, after the first one's entries.
    fn build_plan_tail(&mut self) {
        let start = self.slots[self.slots.len() - 1];
        let b = &mut self.batch;
        b.clear();
        for j in 1..self.k as u32 {
            b.push(self.p.mask_id, start + j, 0);
        }
    }

    fn after_plan(
        &mut self,
        logits: &LogitsRef<'_>,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        let (k, n_slots) = (self.k, self.slots.len());
        let masks = self.batch.len() - self.pending.len();
        let mut x0 = Vec::with_capacity(n_slots * k);
        // Slot confidence: the probability of each slot's first token (the others' is never
        // used, so never computed: a softmax over the vocabulary each).
        let mut conf = Vec::with_capacity(n_slots);
        let mut first_lp = Vec::new();
        self.draft(logits, 0, masks, &mut x0, &mut conf, &mut first_lp);
        if self.drafting {
            self.drop_plan_entries(cache)?;
            on_event(Event::Planned {
                slot_starts: &self.slots,
                slot_size: k,
                tokens: &x0,
            });
            if self.first_plan.is_none() {
                self.first_plan = Some(FirstPlan {
                    slots: self.slots.clone(),
                    tokens: x0.clone(),
                    conf,
                });
            }
            self.take_draft(&x0);
            return Ok(());
        }
        let (chosen, counts_block) = self.choose(&conf);
        let pl = Planned {
            x0,
            chosen,
            counts_block,
            fed: 0,
            first_lp,
        };
        if masks < n_slots * k {
            if pl.chosen.last() == Some(&(n_slots - 1)) {
                // The masks' entries stay for the tail's forward to see.
                self.phase = Phase::PlanTail(pl);
                return Ok(());
            }
            if self.p.temperature > 0.0 {
                // The tail's draws, never made: every later one stays where it was.
                self.noise.skip((k - 1) * logits.row(0).len());
            }
        }
        self.end_plan(pl, cache, on_event)
    }

    /// A split plan's tail drafted: the plan is whole.
    fn after_plan_tail(
        &mut self,
        mut pl: Planned,
        logits: &LogitsRef<'_>,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        let (from, n) = (pl.x0.len(), self.k - 1);
        let (mut no_conf, mut no_lp) = (Vec::new(), Vec::new());
        self.draft(logits, from, n, &mut pl.x0, &mut no_conf, &mut no_lp);
        self.end_plan(pl, cache, on_event)
    }

    /// The plan's masks leave the cache, its drafts are shown, and the chosen slots'
    /// verification comes next.
    fn end_plan(
        &mut self,
        mut pl: Planned,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        self.drop_plan_entries(cache)?;
        // Without a tail not drafted: the canvas does not redraw its cells.
        on_event(Event::Planned {
            slot_starts: &self.slots,
            slot_size: self.k,
            tokens: &pl.x0,
        });
        // That tail as masks: its slot is not chosen, so nothing reads it.
        pl.x0.resize(self.slots.len() * self.k, self.p.mask_id);
        self.phase = Phase::Verify(pl);
        Ok(())
    }

    /// The prompt's (and known spans') entries of a planning forward stay; the masks' go.
    fn drop_plan_entries(&mut self, cache: &mut SeqCache<'_>) -> Result<()> {
        let n_pending = self.pending.len();
        if n_pending > 0 {
            cache.truncate_rows(n_pending)?;
            cache.commit_row(0)?;
            self.cur_x.append(&mut self.pending);
            self.cur_pos.append(&mut self.pending_pos);
        } else {
            cache.clear_rows()?;
        }
        Ok(())
    }

    /// Drafts plan masks `from..from + n` (in slot order) from logits rows `0..n`: greedy, or
    /// the reference's noise at a temperature; each slot's first token also gives the slot's
    /// confidence (and with logprobs, its log-probability).
    fn draft(
        &mut self,
        logits: &LogitsRef<'_>,
        from: usize,
        n: usize,
        x0: &mut Vec<u32>,
        conf: &mut Vec<f32>,
        first_lp: &mut Vec<Option<TokenLogprob>>,
    ) {
        let k = self.k;
        let mut restricted = Vec::new();
        for i in 0..n {
            let j = from + i;
            let mut row = logits.row(i);
            if j.is_multiple_of(k) {
                let pos = self.slots[j / k];
                if let Some((_, admits)) = self.first_tokens.iter().find(|(p, _)| *p == pos) {
                    row = restrict(row, admits, &mut restricted);
                }
            }
            let tok = if self.p.temperature > 0.0 {
                self.noise.sample(row, self.p.temperature)
            } else {
                argmax(row)
            };
            x0.push(tok as u32);
            if j.is_multiple_of(k) {
                conf.push(prob(row, tok));
                if let Some(top) = self.p.logprobs {
                    first_lp.push(Some(logprob(row, tok, top as usize)));
                }
            }
        }
    }

    /// A drafting decoder's step: the block's draft, up to each run's first EOS, waits to be
    /// fed with the next planning forward; the block is done.
    fn take_draft(&mut self, x0: &[u32]) {
        let k = self.k;
        for (s, &start) in self.slots.clone().iter().enumerate() {
            if self.layout.past_eos(start) {
                continue;
            }
            for j in 0..k {
                let (tok, pos) = (x0[s * k + j], start + j as u32);
                self.pending.push(tok);
                self.pending_pos.push(pos);
                if tok == self.p.eos_id {
                    self.layout.end_at(pos);
                    break;
                }
            }
        }
        let all: Vec<usize> = (0..self.slots.len()).collect();
        self.end_step(all);
    }

    fn after_verify(
        &mut self,
        pl: Planned,
        ver: &LogitsRef<'_>,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        let (tags, prefix_len, ver_lp) = self.verify_tags(&pl, ver);
        let (remain, to_remove) = self.accepted(&pl.chosen, pl.fed, prefix_len);
        if pl.fed > 0 {
            // The known spans fed with the verification join the committed entries.
            self.cur_x.append(&mut self.pending);
            self.cur_pos.append(&mut self.pending_pos);
        }
        if !remain.is_empty() {
            // A slot's first token as drafted, the others as verified.
            let lp = |i: usize, s: usize, j: usize| match j {
                0 => pl.first_lp.get(s).cloned().flatten(),
                _ => ver_lp.get(i * self.k + j).cloned().flatten(),
            };
            let lps: Vec<Option<TokenLogprob>> = remain
                .iter()
                .enumerate()
                .flat_map(|(i, &(s, len))| (0..len).map(move |j| (i, s, j)))
                .map(|(i, s, j)| lp(i, s, j))
                .collect();
            return self.commit_accepted(&pl.x0, &remain, lps, to_remove, pl.fed, cache, on_event);
        }
        if pl.fed > 0 {
            cache.truncate_rows(pl.fed)?;
            cache.commit_row(0)?;
        } else {
            cache.clear_rows()?;
        }
        // 3. Parallel infilling: one row per chosen slot over the shared cache.
        let k = self.k;
        let Planned {
            x0,
            chosen,
            counts_block,
            first_lp,
            ..
        } = pl;
        // Each row's tokens' logprobs as far as known: its first as drafted, the verified ones.
        let lp = chosen
            .iter()
            .enumerate()
            .map(|(c, &s)| {
                (0..k)
                    .map(|j| match j {
                        0 => first_lp.get(s).cloned().flatten(),
                        _ => ver_lp.get(c * k + j).cloned().flatten(),
                    })
                    .collect()
            })
            .collect();
        let inf = Infill {
            lp,
            spec: chosen
                .iter()
                .map(|&s| x0[s * k..(s + 1) * k].to_vec())
                .collect(),
            row_pos: chosen
                .iter()
                .map(|&s| (0..k as u32).map(|j| self.slots[s] + j).collect())
                .collect(),
            row_slot_starts: chosen.iter().map(|&s| self.slots[s]).collect(),
            to_remove: chosen.clone(),
            chosen,
            counts_block,
            tags,
            a: 0,
            it: 0,
        };
        self.next_round(inf, cache, on_event)
    }

    /// Each chosen slot's tokens that pass verification, as running tags (a token passes when
    /// it and every one before it in its slot do: token i >= 1 on its autoregressive
    /// probability from the shifted logits, token 0 always), and the length of the passing
    /// prefix of the slots concatenated; with logprobs, each passing token's (by `c * k + j`,
    /// none for a slot's first token).
    fn verify_tags(&self, pl: &Planned, ver: &LogitsRef<'_>) -> VerifyTags {
        let k = self.k;
        let mut tags: Vec<Vec<bool>> = Vec::with_capacity(pl.chosen.len());
        let mut lps = Vec::new();
        let mut prefix_len = 0;
        let mut all_so_far = true;
        for (c, &s) in pl.chosen.iter().enumerate() {
            let mut row = Vec::with_capacity(k);
            let mut ok = true;
            for j in 0..k {
                let flat = c * k + j;
                let tok = pl.x0[s * k + j] as usize;
                let logits = (j > 0).then(|| logits_of(ver, &self.logit_row, pl.fed + flat - 1));
                let pass = logits.is_none_or(|l| prob(l, tok) > self.p.token_threshold);
                all_so_far &= pass;
                prefix_len += all_so_far as usize;
                ok &= pass;
                row.push(ok);
                if let Some(top) = self.p.logprobs {
                    lps.push(logits.filter(|_| ok).map(|l| logprob(l, tok, top as usize)));
                }
            }
            tags.push(row);
        }
        (tags, prefix_len, lps)
    }

    /// The slots the verification accepts, `(slot, tokens kept)`, and the slots the step
    /// removes: the whole slots in the passing prefix, or up to its first EOS (which ends its
    /// run: the run's slots after it are removed, see [`Self::end_step`]).
    fn accepted(
        &mut self,
        chosen: &[usize],
        fed: usize,
        prefix_len: usize,
    ) -> (Vec<(usize, usize)>, Vec<usize>) {
        let k = self.k;
        let flat_tokens = &self.batch.tokens[fed..];
        let mut remain = Vec::new();
        let mut to_remove = Vec::new();
        let eos = self.p.eos_id;
        if let Some(first_eos) = flat_tokens[..prefix_len].iter().position(|&t| t == eos) {
            let eos_slot_pos = first_eos / k + 1;
            let eos_token_pos = first_eos % k;
            for (i, &s) in chosen[..eos_slot_pos].iter().enumerate() {
                let len = if i + 1 == eos_slot_pos {
                    eos_token_pos + 1
                } else {
                    k
                };
                remain.push((s, len));
            }
            self.layout
                .end_at(self.slots[chosen[eos_slot_pos - 1]] + eos_token_pos as u32);
        } else {
            let m = prefix_len / k;
            remain.extend(chosen[..m].iter().map(|&s| (s, k)));
        }
        to_remove.extend(remain.iter().map(|&(s, _)| s));
        (remain, to_remove)
    }

    /// Commits the accepted tokens (their entries: the leading ones of the verification's
    /// row) and ends the step.
    #[allow(clippy::too_many_arguments)]
    fn commit_accepted(
        &mut self,
        x0: &[u32],
        remain: &[(usize, usize)],
        lps: Vec<Option<TokenLogprob>>,
        to_remove: Vec<usize>,
        fed: usize,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        let k = self.k;
        let mut positions = Vec::new();
        let mut tokens = Vec::new();
        for &(s, len) in remain {
            for j in 0..len {
                tokens.push(x0[s * k + j]);
                positions.push(self.slots[s] + j as u32);
            }
        }
        cache.truncate_rows(fed + tokens.len())?;
        cache.commit_row(0)?;
        self.keep_logprobs(&positions, lps);
        self.cur_x.extend_from_slice(&tokens);
        self.cur_pos.extend_from_slice(&positions);
        on_event(Event::Committed {
            positions: &positions,
            tokens: &tokens,
        });
        self.sum_tpf += (k * remain.len()) as f64 / 2.0;
        self.tpf_steps += 1;
        self.end_step(to_remove);
        Ok(())
    }
}

/// A verification's tags and passing prefix (see [`SlotDecoder::verify_tags`]), and the
/// passing tokens' logprobs.
type VerifyTags = (Vec<Vec<bool>>, usize, Vec<Option<TokenLogprob>>);

impl SlotDecoder {
    /// Keeps committed tokens' logprobs by position (when asked for).
    pub(super) fn keep_logprobs(&mut self, positions: &[u32], lps: Vec<Option<TokenLogprob>>) {
        if self.p.logprobs.is_none() {
            return;
        }
        for (&pos, lp) in positions.iter().zip(lps) {
            if let Some(lp) = lp {
                self.committed_lp.insert(pos, lp);
            }
        }
    }

    /// The answer's logprobs in `positions`' order (each committed token has one; a token
    /// without would be a decoder's slip, given as impossible rather than as a number).
    fn logprobs_at(&mut self, positions: &[u32], tokens: &[u32]) -> Vec<TokenLogprob> {
        if self.p.logprobs.is_none() {
            return Vec::new();
        }
        let lps = &mut self.committed_lp;
        positions
            .iter()
            .zip(tokens)
            .map(|(p, &token)| {
                lps.remove(p).unwrap_or(TokenLogprob {
                    token,
                    logprob: f32::NEG_INFINITY,
                    top: Vec::new(),
                })
            })
            .collect()
    }
}

impl Strategy for SlotDecoder {
    /// Between two steps (where the reference's loop may be left: cancellation).
    fn at_step_boundary(&self) -> bool {
        matches!(self.phase, Phase::Plan | Phase::Done)
    }

    fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// After the first forward, but for a split first plan: its prompt entries stay private
    /// until the tail's forward.
    fn prompt_cached(&self) -> bool {
        !matches!(self.phase, Phase::PlanTail(_))
    }

    /// The next forward, or done.
    fn poll(&mut self, _on_event: &mut dyn FnMut(Event<'_>)) -> Result<Poll<'_>> {
        match &self.phase {
            Phase::Done => return Ok(Poll::Done),
            Phase::Plan => self.build_plan(),
            Phase::PlanTail(_) => self.build_plan_tail(),
            Phase::Verify(pl) => {
                let fed = (&self.pending[..pl.fed], &self.pending_pos[..pl.fed]);
                build_verify(&mut self.batch, pl, &self.slots, self.k, fed);
                // Token j of a slot is scored by token j-1's logits: not the slot's last (nor
                // a fed span's token).
                let (k, fed) = (self.k, pl.fed);
                want(&mut self.batch, &mut self.logit_row, |b| {
                    b >= fed && (b - fed) % k != k - 1
                });
            }
            Phase::Draft(inf) => {
                build_rows(&mut self.batch, inf, self.k, Some(self.p.mask_id));
                // Only the masked tokens' predictions are read.
                let width = self.k - inf.a;
                want(&mut self.batch, &mut self.logit_row, |b| {
                    !inf.tags[b / width][inf.a + b % width]
                });
            }
            Phase::Recheck(inf) => {
                build_rows(&mut self.batch, inf, self.k, None);
                // Token j is scored by token j-1's logits, and only when j-1 was not verified
                // (a row's first token, and one after a verified token, pass regardless).
                let (width, a) = (self.k - inf.a, inf.a);
                want(&mut self.batch, &mut self.logit_row, |b| {
                    let (r, local) = (b / width, b % width);
                    local + 1 < width && !inf.tags[r][a + local]
                });
            }
        }
        Ok(Poll::Forward(&self.batch))
    }

    /// The logits of the batch [`Decoder::poll`] asked for.
    fn feed(
        &mut self,
        logits: &LogitsRef<'_>,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        self.forward_tokens += self.batch.len();
        self.forward_sizes.push(self.batch.len() as u32);
        if !matches!(self.phase, Phase::PlanTail(_)) {
            // A split plan's second part is one forward of the reference's with its first.
            self.forward_calls += 1;
        }
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Plan => self.after_plan(logits, cache, on_event),
            Phase::PlanTail(pl) => self.after_plan_tail(pl, logits, cache, on_event),
            Phase::Verify(pl) => self.after_verify(pl, logits, cache, on_event),
            Phase::Draft(inf) => self.after_draft(inf, logits, cache, on_event),
            Phase::Recheck(inf) => self.after_recheck(inf, logits, cache, on_event),
            Phase::Done => Err(Error::internal("logits fed to a finished decoder")),
        }
    }

    /// The result, once done: committed tokens sorted by position, the prompt removed.
    fn result(&mut self) -> DecodeResult {
        let mut order: Vec<usize> = (0..self.cur_x.len()).collect();
        order.sort_by_key(|&i| self.cur_pos[i]);
        let tokens: Vec<u32> = order
            .iter()
            .skip(self.prompt_len)
            .map(|&i| self.cur_x[i])
            .collect();
        let positions: Vec<u32> = order
            .iter()
            .skip(self.prompt_len)
            .map(|&i| self.cur_pos[i])
            .collect();
        let filled = (self.p.strategy == super::Kind::Infill).then(|| {
            let t = self.p.answer_template();
            let start = self.prompt_len as u32;
            Filled::stitch(
                &t,
                start,
                self.p.slot_size,
                &tokens,
                &positions,
                self.p.eos_id,
            )
        });
        // A template's fills each end at their own EOS ([`DecodeResult::answer`]).
        let eos_index = match filled {
            Some(_) => None,
            None => tokens.iter().position(|&t| t == self.p.eos_id),
        };
        let tpf = if self.tpf_steps > 0 {
            self.sum_tpf / self.tpf_steps as f64
        } else {
            0.0
        };
        let logprobs = self.logprobs_at(&positions, &tokens);
        DecodeResult {
            tokens,
            positions,
            tpf,
            forward_calls: self.forward_calls,
            forward_tokens: self.forward_tokens,
            forward_sizes: std::mem::take(&mut self.forward_sizes),
            eos_index,
            filled,
            limit: self.p.answer_limit(),
            logprobs,
            prompt_logprobs: Vec::new(),
        }
    }
}

/// `row` with every token but `admits` at minus infinity (token healing: the softmax, the
/// arg-max and the planning noise then see only the admitted tokens), in `buf`.
fn restrict<'b>(row: &[f32], admits: &[u32], buf: &'b mut Vec<f32>) -> &'b [f32] {
    buf.clear();
    buf.resize(row.len(), f32::NEG_INFINITY);
    for &t in admits {
        if let Some(&l) = row.get(t as usize) {
            buf[t as usize] = l;
        }
    }
    buf
}

/// Global verification: the chosen slots concatenated, in position order, after the `fed`
/// pending tokens (none but for a reused plan).
fn build_verify(b: &mut Batch, pl: &Planned, slots: &[u32], k: usize, fed: (&[u32], &[u32])) {
    b.clear();
    for (&t, &pos) in fed.0.iter().zip(fed.1) {
        b.push(t, pos, 0);
    }
    for &s in &pl.chosen {
        for j in 0..k {
            b.push(pl.x0[s * k + j], slots[s] + j as u32, 0);
        }
    }
}

/// Asks for the logits of the batch's tokens `wanted` says, and records which row each gets.
fn want(b: &mut Batch, logit_row: &mut Vec<usize>, wanted: impl Fn(usize) -> bool) {
    logit_row.clear();
    let mut indices = Vec::new();
    for i in 0..b.len() {
        if wanted(i) {
            logit_row.push(indices.len());
            indices.push(i);
        } else {
            logit_row.push(usize::MAX);
        }
    }
    b.logits_for = LogitsFor::Indices(indices);
}

/// The logits of batch token `b` (one [`want`] asked for).
fn logits_of<'l>(logits: &LogitsRef<'l>, logit_row: &[usize], b: usize) -> &'l [f32] {
    logits.row(logit_row[b])
}

/// ReFusion's slot decoding as a strategy (`--strategy slots`, the default).
pub struct Slots;

impl super::strategy::Method for Slots {
    fn name(&self) -> &'static str {
        "slots"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &["slot"]
    }
    /// One serial block: the planning forward's masks (under a grammar, one slot's).
    fn scratch(&self, params: &DecodeParams) -> usize {
        match params.guide {
            Some(_) => params.slot_size as usize,
            None => params.block_len() as usize,
        }
    }
    /// Under a grammar, the slot at the answer's frontier each step ([`super::guided`]).
    fn start(
        &self,
        prompt: &[u32],
        cached: usize,
        params: &DecodeParams,
    ) -> Box<dyn super::Strategy> {
        match &params.guide {
            Some(g) => Box::new(super::guided::Guided::new(
                prompt,
                cached,
                params,
                g.start(),
            )),
            None => Box::new(SlotDecoder::new(prompt, cached, params)),
        }
    }
}
