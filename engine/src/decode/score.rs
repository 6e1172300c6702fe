//! The prompt scored before the answer (OpenAI's `echo` with `logprobs`, lm-evaluation-harness's
//! loglikelihood): the prompt is fed in chunks, every token's logits asked for, and each
//! prompt token after the first gets its log-probability under the logits of the token before
//! it, the model's plain next-token distribution (the one ReFusion verifies with). Then the
//! request's own strategy decodes the answer over the cached prompt, or, with no answer asked
//! for (`max_tokens: 0`), the request ends.
//!
//! The last prompt token is left to the strategy's first forward (slot decoding plans with it,
//! `ar` reads its logits), so the answer's forwards are exactly those of a decode that found
//! all but the last prompt token cached.

use super::strategy::{Poll, Strategy};
use super::{logprob, DecodeParams, DecodeResult, Earlier, Event, TokenLogprob};
use crate::error::{Error, Result};
use crate::kv::SeqCache;
use crate::model::{Batch, LogitsFor, LogitsRef};

/// Prompt tokens scored per forward: each asks for its logits row (the vocabulary's width),
/// so a long prompt goes in chunks whose logits stay within the memory plan's scratch.
const CHUNK: usize = 64;

pub struct Scored {
    prompt: Vec<u32>,
    params: DecodeParams,
    /// Prompt tokens fed so far (their entries committed).
    fed: usize,
    /// The prompt's scores so far (tokens 1..=fed).
    scored: Vec<TokenLogprob>,
    /// The answer's decoder, once the prompt is scored (none when no answer follows).
    inner: Option<Box<dyn Strategy>>,
    /// Whether the inner decoder has been fed once (its first forward feeds the last prompt
    /// token: the prompt is then wholly cached).
    inner_fed: bool,
    awaiting: bool,
    /// The scoring forwards, put before the answer's.
    earlier: Earlier,
    batch: Batch,
}

impl Scored {
    /// Over `prompt`, none of it cached ([`DecodeParams::max_reuse`]); `params` ask for
    /// logprobs (checked by [`DecodeParams::validate`]).
    pub fn new(prompt: &[u32], params: &DecodeParams) -> Scored {
        Scored {
            prompt: prompt.to_vec(),
            params: params.clone(),
            fed: 0,
            scored: Vec::with_capacity(prompt.len().saturating_sub(1)),
            inner: None,
            inner_fed: false,
            awaiting: false,
            earlier: Earlier::default(),
            batch: Batch::default(),
        }
    }

    /// Prompt tokens this phase feeds: all but the last (the answer's first forward feeds it;
    /// without an answer it has nothing to predict and is not fed).
    fn to_score(&self) -> usize {
        self.prompt.len().saturating_sub(1)
    }

    /// After the prompt's chunks: the answer's decoder, or the end.
    fn start_answer(&mut self) {
        if self.params.answer && self.inner.is_none() {
            let mut p = self.params.clone();
            p.score_prompt = false;
            self.inner = Some(p.strategy.method().start(&self.prompt, self.fed, &p));
        }
    }

    fn scoring(&self) -> bool {
        self.fed < self.to_score()
    }
}

impl Strategy for Scored {
    fn poll(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<Poll<'_>> {
        if !self.scoring() {
            self.start_answer();
            return match self.inner.as_mut() {
                Some(inner) => inner.poll(on_event),
                None => Ok(Poll::Done),
            };
        }
        let end = (self.fed + CHUNK).min(self.to_score());
        let b = &mut self.batch;
        b.clear();
        for pos in self.fed..end {
            b.push(self.prompt[pos], pos as u32, 0);
        }
        b.logits_for = LogitsFor::All;
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
            return match self.inner.as_mut() {
                Some(inner) => {
                    self.inner_fed = true;
                    inner.feed(logits, cache, on_event)
                }
                None => Err(Error::internal("logits fed to a finished prompt score")),
            };
        }
        self.awaiting = false;
        let n = self.batch.len();
        self.earlier.record(n);
        cache.commit_row(0)?;
        let top = self.params.logprobs.unwrap_or(0) as usize;
        for i in 0..n {
            let next = self.prompt[self.fed + i + 1] as usize;
            self.scored.push(logprob(logits.row(i), next, top));
        }
        self.fed += n;
        Ok(())
    }

    fn at_step_boundary(&self) -> bool {
        match &self.inner {
            Some(inner) => inner.at_step_boundary(),
            None => !self.awaiting,
        }
    }

    fn is_done(&self) -> bool {
        if self.scoring() {
            return false;
        }
        match &self.inner {
            Some(inner) => inner.is_done(),
            None => !self.params.answer,
        }
    }

    fn prompt_cached(&self) -> bool {
        self.inner_fed
    }

    fn result(&mut self) -> DecodeResult {
        let mut r = match self.inner.as_mut() {
            Some(inner) => inner.result(),
            None => DecodeResult {
                tokens: Vec::new(),
                positions: Vec::new(),
                tpf: 0.0,
                forward_calls: 0,
                forward_tokens: 0,
                forward_sizes: Vec::new(),
                eos_index: None,
                filled: None,
                limit: 0,
                logprobs: Vec::new(),
                prompt_logprobs: Vec::new(),
            },
        };
        self.earlier.put_before(&mut r);
        r.prompt_logprobs = std::mem::take(&mut self.scored);
        r
    }
}
