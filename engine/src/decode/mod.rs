//! ReFusion's "plan and infill" slot decoding, step for step as the reference
//! `generate_refusion` (model card), with its two known bugs fixed (see the README):
//! - when an EOS is verified during parallel infilling, pending slots are removed from the EOS
//!   slot's own index onward (the reference removes from the *row* index, dropping un-generated
//!   slots between them);
//! - the answer stops at the first EOS by position ([`DecodeResult::answer`]); the raw tokens,
//!   as the reference returns them, are kept in [`DecodeResult::tokens`].
//!
//! The decoder sees the model only through [`Forward`] and the [`KvCache`] operations. Slot
//! decoding is one [`Strategy`]; plain left-to-right decoding ([`Kind::Autoregressive`]) is
//! another, for comparison on the same file.

mod autoregressive;
mod fit;
mod guided;
mod infill;
mod noise;
mod overrides;
mod params;
mod probs;
mod score;
mod slots;
pub mod strategy;
pub mod template;
pub mod trace;

use std::sync::atomic::{AtomicBool, Ordering};

pub use noise::Noise;
pub use overrides::Overrides;
pub use params::{shortest_f64, DecodeParams, SPLIT_PLAN_FROM};
pub use probs::{argmax, logprob, prob, TokenLogprob, MAX_TOP_LOGPROBS};
pub use slots::SlotDecoder;
pub use strategy::{start, Kind, Poll, Strategy};
pub use template::{Filled, FitGap, GapFill, GapSize, Healed, Piece, Template, TextPiece};
pub use trace::{Cell, CellState, Trace};

use crate::error::{Error, RequestError, Result};
use crate::kv::{KvCache, SeqId};
use crate::model::Forward;

/// What happened, for streaming and `--visual`.
#[derive(Debug, Clone)]
pub enum Event<'a> {
    /// The planning forward drafted these slots (start positions) with these tokens, slot
    /// after slot; they may stop after the last slot's first token (its tail not drafted:
    /// [`DecodeParams::split_plan_from`]).
    Planned {
        slot_starts: &'a [u32],
        slot_size: usize,
        tokens: &'a [u32],
    },
    /// Rows being infilled: slot start positions and their current tokens and tags.
    Infill {
        slot_starts: &'a [u32],
        tokens: &'a [Vec<u32>],
        tags: &'a [Vec<bool>],
    },
    /// Tokens committed at these positions (appended to the output in this order).
    Committed {
        positions: &'a [u32],
        tokens: &'a [u32],
    },
    /// The answer is laid out anew (a fitted gap decoded again at the length found: its
    /// known text after it moved); what was drawn of the old layout is void.
    Resized { template: &'a Template },
}

#[derive(Debug, Clone)]
pub struct DecodeResult {
    /// Generated ids after the prompt in position order, as the reference returns them: before
    /// EOS truncation, so they may hold the EOS and tokens at positions after it.
    pub tokens: Vec<u32>,
    /// Their positions.
    pub positions: Vec<u32>,
    /// The reference's tokens-per-forward (mean of per-iteration ratios).
    pub tpf: f64,
    /// The reference's forwards (plan, verify, draft, ...): a plan split in two calls
    /// ([`DecodeParams::split_plan_from`]) counts as one.
    pub forward_calls: usize,
    /// Tokens fed through the model over all calls.
    pub forward_tokens: usize,
    /// Tokens fed by each call made, in order (all rows together; a split plan's two calls
    /// apart): what a cost curve t(n) turns into a time for another model size.
    pub forward_sizes: Vec<u32>,
    /// Index into `tokens` of the first EOS, if any (none for a template: see `filled`).
    pub eos_index: Option<usize>,
    /// A template's answer and gap fills ([`Kind::Infill`]).
    pub filled: Option<Filled>,
    /// The most answer tokens (the gen length: slot decoding rounds it up to whole slots and
    /// may write past it; the answer stops there, as `max_tokens` promises).
    pub limit: usize,
    /// With [`DecodeParams::logprobs`]: each of `tokens`' log-probability and alternatives,
    /// in the same order (empty otherwise).
    pub logprobs: Vec<TokenLogprob>,
    /// With [`DecodeParams::score_prompt`]: the prompt's tokens after its first, each scored
    /// by the prompt before it.
    pub prompt_logprobs: Vec<TokenLogprob>,
}

/// The forwards a wrapping strategy makes before its inner one decodes (a fitted gap's probes,
/// a scored prompt): counted here, then put in front of the inner result's own.
#[derive(Debug, Default)]
pub(super) struct Earlier {
    calls: usize,
    tokens: usize,
    sizes: Vec<u32>,
}

impl Earlier {
    /// One forward of `n` tokens.
    fn record(&mut self, n: usize) {
        self.calls += 1;
        self.tokens += n;
        self.sizes.push(n as u32);
    }

    /// Every forward of a finished decode's result.
    fn add(&mut self, r: DecodeResult) {
        self.calls += r.forward_calls;
        self.tokens += r.forward_tokens;
        self.sizes.extend(r.forward_sizes);
    }

    /// Puts these forwards before `r`'s.
    fn put_before(&mut self, r: &mut DecodeResult) {
        r.forward_calls += self.calls;
        r.forward_tokens += self.tokens;
        let mut sizes = std::mem::take(&mut self.sizes);
        sizes.append(&mut r.forward_sizes);
        r.forward_sizes = sizes;
    }
}

impl DecodeResult {
    /// The answer: generated tokens up to (not including) the first EOS by position; for a
    /// template, its spans and fills stitched in order.
    pub fn answer(&self) -> &[u32] {
        match &self.filled {
            Some(f) => &f.answer,
            None => {
                let end = self.eos_index.unwrap_or(self.tokens.len());
                &self.tokens[..end.min(self.limit)]
            }
        }
    }

    /// The tokens the model wrote, as every front end counts them (generate's and chat's
    /// figures, the server's `usage`): the answer before its EOS, or a template's fills (its
    /// spans are the caller's).
    pub fn completion_tokens(&self) -> usize {
        match &self.filled {
            Some(f) => f.gaps.iter().map(|g| g.tokens.len()).sum(),
            None => self.answer().len(),
        }
    }

    /// Whether the answer ended at an EOS (OpenAI's finish reason "stop", not "length"); for
    /// a template, whether no gap was too small for its text (an exact gap: ended at an EOS;
    /// a fitted one: that, or met the span after it).
    pub fn stopped(&self) -> bool {
        match &self.filled {
            Some(f) => f.gaps.iter().all(|g| !g.truncated),
            None => self.eos_index.is_some_and(|i| i <= self.limit),
        }
    }
}

/// Generates after `prompt`. The cache must be empty, or hold a prefix of `prompt` as its
/// shared entries (the rest of the prompt is fed with the first planning forward).
pub fn generate<M: Forward + ?Sized>(
    model: &M,
    cache: &mut KvCache,
    prompt: &[u32],
    params: &DecodeParams,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<DecodeResult> {
    generate_cancellable(
        model,
        cache,
        prompt,
        params,
        &AtomicBool::new(false),
        on_event,
    )
}

/// What a caller must get right before a decode: the prompt (not empty, no mask token, every
/// id in the vocabulary), the parameters, and room in a context of `capacity` entries for the
/// prompt, the answer and one serial block of scratch. Front ends call it before any work, and
/// answer its errors as the caller's (HTTP 400).
pub fn check(prompt: &[u32], params: &DecodeParams, vocab: usize, capacity: usize) -> Result<()> {
    params.validate()?;
    if prompt.is_empty() {
        return Err(RequestError::EmptyPrompt.into());
    }
    if let Some(index) = prompt.iter().position(|&t| t == params.mask_id) {
        return Err(RequestError::MaskInPrompt {
            index,
            id: params.mask_id,
        }
        .into());
    }
    if let Some(&token) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(RequestError::OutsideVocabulary { token, vocab }.into());
    }
    if params.strategy.method().fills_gaps() {
        let t = params.answer_template();
        t.validate_for(params.mask_id, vocab, params.slot_size)?;
    }
    let (gen, block) = params.answer_room();
    let needed = prompt.len() + gen + block;
    if needed > capacity {
        return Err(RequestError::TooLong {
            prompt: prompt.len(),
            gen,
            block,
            capacity,
        }
        .into());
    }
    Ok(())
}

/// [`generate`], stopping with [`Error::Cancelled`] between steps once `cancel` is set (a
/// client went away, Ctrl-C). The cache then holds the prompt and whatever was committed.
pub fn generate_cancellable<M: Forward + ?Sized>(
    model: &M,
    cache: &mut KvCache,
    prompt: &[u32],
    params: &DecodeParams,
    cancel: &AtomicBool,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<DecodeResult> {
    check(prompt, params, model.config().vocab, cache.shape().capacity)?;
    let cached = cache.shared_len();
    if cached > prompt.len() {
        return Err(Error::internal(
            "the KV cache holds more entries than the prompt",
        ));
    }
    let cached = cached.min(params.max_reuse(prompt.len()));
    cache.crop(cached);
    cache.clear_rows();
    let mut dec = start(prompt, cached, params);
    let mut logits = crate::model::Logits {
        vocab: model.config().vocab,
        data: Vec::new(),
    };
    loop {
        if dec.at_step_boundary() && cancel.load(Ordering::Relaxed) {
            cache.clear_rows();
            return Err(Error::Cancelled);
        }
        match dec.poll(on_event)? {
            Poll::Done => break,
            Poll::Forward(batch) => model.forward_into(batch, cache, &mut logits)?,
        }
        dec.feed(&logits.view(), &mut cache.seq(SeqId::DEFAULT), on_event)?;
    }
    Ok(dec.result())
}
