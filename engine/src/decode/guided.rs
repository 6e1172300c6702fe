//! Slot decoding under a grammar: what `--strategy slots` (the default) does with a JSON
//! Schema, `response_format`, a GBNF grammar or a required tool call.
//!
//! A grammar reads an answer left to right, and ReFusion's planning drafts slots anywhere: a
//! slot drafted after a gap cannot be checked until the gap is written. So the slot decoded
//! is always the one at the answer's frontier, and each forward both verifies the last draft
//! and plans the next one (a step of ReFusion's plan and verify, in one forward):
//!
//! - **fed**: the committed tokens not yet cached (the prompt, the forced text, the frontier
//!   token), then the draft of the positions after them, then a slot of masks after that;
//! - **verify**: draft token j passes when its probability from the token before it, over the
//!   tokens the grammar allows there, is above the token threshold (as the reference verifies
//!   a slot's tokens); the passing prefix is committed;
//! - **the frontier token**: the next position's token, the arg-max among what the grammar
//!   allows (at a temperature, the planning noise's pick): where the whole draft passed, from
//!   the first mask's logits, which saw every committed token (a slot's first token, taken on
//!   its plan as the reference takes it); after a rejected token, from the last passing
//!   token's logits (its correction, from the distribution the verification read);
//! - **plan**: when the whole draft passed, the masks after it saw the committed text, and
//!   draft the positions after the frontier token, left to right under the grammar; otherwise
//!   they saw a rejected token, and the next forward drafts anew;
//! - **forced text**: what the grammar then allows alone (a schema's keys and brackets, a
//!   tool call's tags and name) is committed without the model
//!   ([`crate::constrain::Constraint::forced`]) and fed with the next forward.
//!
//! Every forward commits at least one token, so it never takes more forwards than the answer
//! has tokens the grammar does not force (what `ar` takes). The slot threshold has no part:
//! one slot is decoded.

use super::strategy::{Poll, Strategy};
use super::{argmax, prob, DecodeParams, DecodeResult, Event, Noise};
use crate::constrain::Constraint;
use crate::error::{Error, Result};
use crate::kv::SeqCache;
use crate::model::{Batch, LogitsFor, LogitsRef};

pub struct Guided {
    p: DecodeParams,
    noise: Noise,
    constraint: Constraint,
    /// Committed tokens not in the cache (the uncached prompt, forced text, the frontier
    /// token), fed next from `next_pos` on.
    pending: Vec<u32>,
    next_pos: u32,
    /// Drafted tokens of the positions after the pending ones, fed next to be verified.
    draft: Vec<u32>,
    /// The answer's tokens and positions.
    tokens: Vec<u32>,
    positions: Vec<u32>,
    done: bool,
    started: bool,
    awaiting: bool,
    forward_calls: usize,
    forward_tokens: usize,
    forward_sizes: Vec<u32>,
    batch: Batch,
    masked: Vec<f32>,
}

impl Guided {
    /// Over `prompt`, whose first `cached` tokens are already the sequence's shared entries,
    /// held to `constraint` (`params`' grammar, started).
    pub fn new(
        prompt: &[u32],
        cached: usize,
        params: &DecodeParams,
        constraint: Constraint,
    ) -> Guided {
        let from = cached;
        Guided {
            p: params.clone(),
            noise: Noise::new(params.seed),
            constraint,
            pending: prompt[from..].to_vec(),
            next_pos: from as u32,
            draft: Vec::new(),
            tokens: Vec::new(),
            positions: Vec::new(),
            done: params.gen_length == 0,
            started: false,
            awaiting: false,
            forward_calls: 0,
            forward_tokens: 0,
            forward_sizes: Vec::new(),
            batch: Batch::default(),
            masked: Vec::new(),
        }
    }

    /// Answer tokens still allowed (the gen length less what is committed).
    fn room(&self) -> usize {
        (self.p.gen_length as usize).saturating_sub(self.tokens.len())
    }

    /// Records `toks` as committed at positions from `from`, and says so.
    fn commit(&mut self, from: u32, toks: &[u32], on_event: &mut dyn FnMut(Event<'_>)) {
        let toks = &toks[..toks.len().min(self.room())];
        let positions: Vec<u32> = (from..from + toks.len() as u32).collect();
        self.tokens.extend_from_slice(toks);
        self.positions.extend_from_slice(&positions);
        on_event(Event::Committed {
            positions: &positions,
            tokens: toks,
        });
        self.done |= toks.contains(&self.p.eos_id) || self.room() == 0;
    }

    /// Commits `tok` at the frontier (after what is pending) and queues it to be fed; then the
    /// forced text after it, and the end of the answer when the grammar allows nothing more.
    fn push(&mut self, tok: u32, on_event: &mut dyn FnMut(Event<'_>)) -> Result<()> {
        let at = self.next_pos + self.pending.len() as u32;
        self.commit(at, &[tok], on_event);
        self.pending.push(tok);
        self.force(on_event)
    }

    /// Commits the forced text (to be fed next), and the end of the answer when the grammar
    /// allows nothing more.
    fn force(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<()> {
        if self.done {
            return Ok(());
        }
        let forced = self.constraint.forced()?;
        if !forced.is_empty() {
            let at = self.next_pos + self.pending.len() as u32;
            self.commit(at, &forced, on_event);
            self.pending.extend_from_slice(&forced);
        }
        if self.constraint.finished() && !self.done {
            let at = self.next_pos + self.pending.len() as u32;
            self.commit(at, &[self.p.eos_id], on_event);
        }
        Ok(())
    }

    /// `row` under the grammar's current state: the token to take from it (`tok` when given,
    /// else [`choose`]'s) and its probability over what the grammar allows.
    fn masked_pick(&mut self, row: &[f32], tok: Option<u32>) -> Result<(u32, f32)> {
        let masked = self
            .constraint
            .masked(row, self.p.eos_id, &mut self.masked)?;
        let tok = match tok {
            Some(t) => t,
            None => choose(masked, self.p.temperature, &mut self.noise),
        };
        Ok((tok, prob(masked, tok as usize)))
    }

    /// Accepts `tok` into the grammar (the end of the answer is not a token of it).
    fn accept(&mut self, tok: u32) -> Result<()> {
        if tok != self.p.eos_id {
            self.constraint.accept(tok)?;
        }
        Ok(())
    }

    /// The draft from the masks' logits (`rows`), left to right under the grammar, up to an
    /// end of the answer; the grammar is left where it was.
    fn plan(&mut self, logits: &LogitsRef<'_>, rows: std::ops::Range<usize>) -> Result<()> {
        let mut accepted = 0;
        self.draft.clear();
        for r in rows.take(self.room()) {
            if self.constraint.finished() {
                break;
            }
            let (tok, _) = self.masked_pick(logits.row(r), None)?;
            self.draft.push(tok);
            if tok == self.p.eos_id {
                break;
            }
            self.constraint.accept(tok)?;
            accepted += 1;
        }
        self.constraint.rollback(accepted)
    }

    fn build(&mut self) {
        let b = &mut self.batch;
        b.clear();
        let mut pos = self.next_pos;
        for &t in self.pending.iter().chain(&self.draft) {
            b.push(t, pos, 0);
            pos += 1;
        }
        for _ in 0..self.p.slot_size.max(1) {
            b.push(self.p.mask_id, pos, 0);
            pos += 1;
        }
        // The last pending token's logits (none when the cache holds the whole prompt), every
        // draft token's, and the masks'.
        let first = self.pending.len().saturating_sub(1);
        b.logits_for = LogitsFor::Indices((first..b.len()).collect());
    }

    fn after_forward(
        &mut self,
        logits: &LogitsRef<'_>,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        let n_pending = self.pending.len();
        let draft = std::mem::take(&mut self.draft);
        let drafted_at = self.next_pos + n_pending as u32;
        // Logits rows: the last pending token's (`lead` of them), each draft token's, the
        // masks'. Draft token j is scored by the row of the token before it.
        let lead = n_pending.min(1);
        let mut passed = 0;
        for (j, &t) in draft.iter().enumerate() {
            let (_, p) = self.masked_pick(logits.row(lead + j - 1), Some(t))?;
            if p <= self.p.token_threshold {
                break;
            }
            self.accept(t)?;
            passed += 1;
        }
        let eos = self.p.eos_id;
        let cached = n_pending + draft[..passed].iter().filter(|&&t| t != eos).count();
        cache.truncate_rows(cached)?;
        cache.commit_row(0)?;
        self.next_pos += cached as u32;
        self.pending.clear();
        self.commit(drafted_at, &draft[..passed], on_event);
        // Text the grammar forces after the passing drafts (or its end) is fed next, the
        // frontier token then read from its last token.
        self.force(on_event)?;
        if self.done || !self.pending.is_empty() {
            return Ok(());
        }
        // The frontier token: where the whole draft passed (or nothing was drafted), the first
        // mask's pick, which saw every committed token (a slot's first token, taken on its
        // plan as the reference takes it); after a rejected token, its correction from the
        // last passing token's logits (the masks saw the rejected token).
        let first_mask = lead + draft.len();
        let row = if passed == draft.len() {
            first_mask
        } else {
            lead + passed - 1
        };
        let (tok, _) = self.masked_pick(logits.row(row), None)?;
        self.accept(tok)?;
        self.push(tok, on_event)?;
        // The masks after the first drafted the positions after the frontier token, if they
        // saw the committed text (not a rejected token) and no forced text took them.
        let seen = passed == draft.len();
        if !self.done && seen && self.pending.len() == 1 {
            let masks = first_mask + 1..first_mask + self.p.slot_size.max(1) as usize;
            self.plan(logits, masks)?;
            if !self.draft.is_empty() {
                on_event(Event::Planned {
                    slot_starts: &[self.next_pos + 1],
                    slot_size: self.draft.len(),
                    tokens: &self.draft,
                });
            }
        }
        Ok(())
    }
}

impl Strategy for Guided {
    fn poll(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<Poll<'_>> {
        if !self.started {
            // What the grammar forces first goes in with the prompt.
            self.started = true;
            self.force(on_event)?;
        }
        if self.done {
            return Ok(Poll::Done);
        }
        self.build();
        self.awaiting = true;
        Ok(Poll::Forward(&self.batch))
    }

    fn feed(
        &mut self,
        logits: &LogitsRef<'_>,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        if !self.awaiting {
            return Err(Error::internal(
                "logits fed to a decoder that asked for none",
            ));
        }
        self.awaiting = false;
        self.forward_calls += 1;
        self.forward_tokens += self.batch.len();
        self.forward_sizes.push(self.batch.len() as u32);
        self.after_forward(logits, cache, on_event)
    }

    fn at_step_boundary(&self) -> bool {
        !self.awaiting
    }

    fn is_done(&self) -> bool {
        self.done
    }

    /// The answer, forced text included; the tokens per forward are the answer's tokens (the
    /// end of it not counted) over the forwards made.
    fn result(&mut self) -> DecodeResult {
        let eos_index = self.tokens.iter().position(|&t| t == self.p.eos_id);
        let written = eos_index.unwrap_or(self.tokens.len());
        DecodeResult {
            tokens: std::mem::take(&mut self.tokens),
            positions: std::mem::take(&mut self.positions),
            tpf: if self.forward_calls > 0 {
                written as f64 / self.forward_calls as f64
            } else {
                0.0
            },
            forward_calls: self.forward_calls,
            forward_tokens: self.forward_tokens,
            forward_sizes: std::mem::take(&mut self.forward_sizes),
            eos_index,
            filled: None,
            limit: self.p.answer_limit(),
            // Refused with a grammar under slot decoding (`DecodeParams::validate`).
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
        }
    }
}

/// The token to take from `masked` (logits with what the grammar forbids at minus infinity):
/// the arg-max, or at a temperature the planning noise's pick. Every allowed weight can
/// underflow to 0 (logits far below the rest), when the first index wins the tie, allowed or
/// not: then the arg-max is taken.
pub(super) fn choose(masked: &[f32], temperature: f64, noise: &mut Noise) -> u32 {
    if temperature > 0.0 {
        let t = noise.sample(masked, temperature);
        if masked[t] > f32::NEG_INFINITY {
            return t as u32;
        }
    }
    argmax(masked) as u32
}
