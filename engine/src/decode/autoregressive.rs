//! Plain left-to-right decoding as a [`Strategy`]: the prompt (what the cache lacks of it) in
//! one forward, then one token per forward, each the arg-max of the last token's logits (or,
//! at a temperature, the same noise as slot decoding's planning drafts), until EOS or the gen
//! length. It is what llama.cpp does with the same file, and the baseline slot decoding is
//! compared with (`--strategy ar`): its TPF is 1 by definition.
//!
//! ReFusion was not trained for it: inside a slot a token learns to predict the next one, but
//! the prompt's last token and every slot's last token get no next-token label, so expect
//! worse answers than slot decoding from a ReFusion file (a plain Qwen3 file decodes as usual).

use super::strategy::{Poll, Strategy};
use super::{argmax, logprob, DecodeParams, DecodeResult, Event, Noise, TokenLogprob};
use crate::constrain::Constraint;
use crate::error::{Error, Result};
use crate::kv::SeqCache;
use crate::model::{Batch, LogitsFor, LogitsRef};

pub struct Autoregressive {
    p: DecodeParams,
    noise: Noise,
    /// Tokens to feed next (the uncached prompt first, then each new token), at `next_pos`.
    feed: Vec<u32>,
    next_pos: u32,
    /// Generated tokens and their positions.
    tokens: Vec<u32>,
    positions: Vec<u32>,
    done: bool,
    awaiting: bool,
    forward_calls: usize,
    forward_tokens: usize,
    forward_sizes: Vec<u32>,
    batch: Batch,
    /// The grammar the answer follows, if any ([`DecodeParams::guide`]).
    constraint: Option<Constraint>,
    /// The logits with what the grammar forbids at minus infinity.
    masked: Vec<f32>,
    /// Whether the first poll has committed what the grammar forces first.
    started: bool,
    /// With logprobs: each generated token's.
    logprobs: Vec<TokenLogprob>,
}

impl Autoregressive {
    /// Over `prompt`, whose first `cached` tokens are already the sequence's shared entries
    /// (never all of them: [`super::Kind::max_reuse`]).
    pub fn new(prompt: &[u32], cached: usize, params: &DecodeParams) -> Autoregressive {
        let from = cached.min(prompt.len().saturating_sub(1));
        Autoregressive {
            p: params.clone(),
            noise: Noise::new(params.seed),
            feed: prompt[from..].to_vec(),
            next_pos: from as u32,
            tokens: Vec::new(),
            positions: Vec::new(),
            done: params.gen_length == 0,
            awaiting: false,
            forward_calls: 0,
            forward_tokens: 0,
            forward_sizes: Vec::new(),
            batch: Batch::default(),
            constraint: params.guide.as_ref().map(|g| g.start()),
            masked: Vec::new(),
            started: false,
            logprobs: Vec::new(),
        }
    }
}

impl Autoregressive {
    /// The next token from the last position's logits: the arg-max (or a sample at a
    /// temperature) among the tokens the grammar allows, if there is one; with logprobs, its
    /// log-probability under the distribution it was chosen from (the grammar's masked one).
    fn pick(&mut self, row: &[f32]) -> Result<(u32, Option<TokenLogprob>)> {
        let top = self.p.logprobs.map(|n| n as usize);
        let Some(c) = self.constraint.as_mut() else {
            let tok = if self.p.temperature > 0.0 {
                self.noise.sample(row, self.p.temperature)
            } else {
                argmax(row)
            };
            return Ok((tok as u32, top.map(|n| logprob(row, tok, n))));
        };
        let masked = c.masked(row, self.p.eos_id, &mut self.masked)?;
        let tok = super::guided::choose(masked, self.p.temperature, &mut self.noise);
        let lp = top.map(|n| logprob(masked, tok as usize, n));
        if tok != self.p.eos_id {
            c.accept(tok)?;
        }
        Ok((tok, lp))
    }

    /// Commits `tok` after what is to be fed, and queues it to be fed; with logprobs, keeps
    /// its own (a token the grammar forces is certain: log-probability 0, no alternative).
    fn commit(&mut self, tok: u32, lp: Option<TokenLogprob>, on_event: &mut dyn FnMut(Event<'_>)) {
        if self.p.logprobs.is_some() {
            let certain = self.p.logprobs.is_some_and(|n| n > 0);
            self.logprobs.push(lp.unwrap_or(TokenLogprob {
                token: tok,
                logprob: 0.0,
                top: if certain {
                    vec![(tok, 0.0)]
                } else {
                    Vec::new()
                },
            }));
        }
        let pos = self.next_pos + self.feed.len() as u32;
        self.tokens.push(tok);
        self.positions.push(pos);
        on_event(Event::Committed {
            positions: &[pos],
            tokens: &[tok],
        });
        self.feed.push(tok);
        self.done = tok == self.p.eos_id || self.tokens.len() >= self.p.gen_length as usize;
    }

    /// Commits the text the grammar forces from here (fed with the next forward), and the end
    /// of the answer when the grammar is complete and allows nothing more.
    fn force(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<()> {
        let Some(c) = self.constraint.as_mut() else {
            return Ok(());
        };
        let forced = c.forced()?;
        let finished = c.finished();
        for tok in forced {
            if self.done {
                return Ok(());
            }
            self.commit(tok, None, on_event);
        }
        if finished && !self.done {
            self.commit(self.p.eos_id, None, on_event);
        }
        Ok(())
    }
}

impl Strategy for Autoregressive {
    fn poll(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<Poll<'_>> {
        if !self.started {
            // What the grammar forces first goes in with the prompt.
            self.started = true;
            self.force(on_event)?;
        }
        if self.done {
            return Ok(Poll::Done);
        }
        let b = &mut self.batch;
        b.clear();
        for (i, &t) in self.feed.iter().enumerate() {
            b.push(t, self.next_pos + i as u32, 0);
        }
        b.logits_for = LogitsFor::Indices(vec![b.len() - 1]);
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
        let n = self.batch.len();
        self.forward_calls += 1;
        self.forward_tokens += n;
        self.forward_sizes.push(n as u32);
        cache.commit_row(0)?;
        self.next_pos += n as u32;
        self.feed.clear();
        let (tok, lp) = self.pick(logits.row(0))?;
        self.commit(tok, lp, on_event);
        if !self.done {
            self.force(on_event)?;
        }
        Ok(())
    }

    fn at_step_boundary(&self) -> bool {
        !self.awaiting
    }

    fn is_done(&self) -> bool {
        self.done
    }

    fn result(&mut self) -> DecodeResult {
        let eos_index = self.tokens.iter().position(|&t| t == self.p.eos_id);
        DecodeResult {
            tokens: std::mem::take(&mut self.tokens),
            positions: std::mem::take(&mut self.positions),
            tpf: if self.forward_calls > 0 { 1.0 } else { 0.0 },
            forward_calls: self.forward_calls,
            forward_tokens: self.forward_tokens,
            forward_sizes: std::mem::take(&mut self.forward_sizes),
            eos_index,
            filled: None,
            limit: self.p.answer_limit(),
            logprobs: std::mem::take(&mut self.logprobs),
            prompt_logprobs: Vec::new(),
        }
    }
}

/// Left-to-right decoding as a strategy (`--strategy ar`): the baseline to compare slot
/// decoding with on one file.
pub struct LeftToRight;

impl super::strategy::Method for LeftToRight {
    fn name(&self) -> &'static str {
        "ar"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &["autoregressive"]
    }
    fn uses_slots(&self) -> bool {
        false
    }
    /// Its first forward needs the prompt's last token's logits, so feeds at least that token.
    fn max_reuse(&self, prompt_len: usize) -> usize {
        prompt_len.saturating_sub(1)
    }
    /// The token being fed.
    fn scratch(&self, _params: &DecodeParams) -> usize {
        1
    }
    /// Slots and serial blocks are slot decoding's: any gen length works without them.
    fn checked(
        &self,
        mut d: refusion_gguf::DecodingDefaults,
        _params: &DecodeParams,
    ) -> Result<refusion_gguf::DecodingDefaults, crate::error::RequestError> {
        (d.slot_size, d.serial_blocks) = (1, 1);
        Ok(d)
    }
    fn start(
        &self,
        prompt: &[u32],
        cached: usize,
        params: &DecodeParams,
    ) -> Box<dyn super::Strategy> {
        Box::new(Autoregressive::new(prompt, cached, params))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::constrain::{Format, Guides};
    use std::sync::Arc;

    /// A decoder over a byte vocabulary (256 bytes, then the end token 256 and a mask 257)
    /// constrained to `gbnf`.
    fn constrained(gbnf: &str, temperature: f64) -> Autoregressive {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(b"\xff<|im_end|>".to_vec());
        words.push(b"\xff<|mask|>".to_vec());
        let guides = Guides::new(&words, 256, None).unwrap();
        let guide = guides.compile(&Format::Gbnf(gbnf.into())).unwrap();
        let mut p = DecodeParams::new(refusion_gguf::DecodingDefaults::default(), 256, 257)
            .with_guide(Arc::new(guide));
        p.temperature = temperature;
        p.validate().unwrap();
        Autoregressive::new(&[1, 2, 3], 0, &p)
    }

    #[test]
    fn the_grammar_chooses_among_what_it_allows() {
        for temperature in [0.0, 0.8] {
            let mut d = constrained("root ::= \"a\" [bc]", temperature);
            let mut row = vec![0.0f32; 258];
            row[b'z' as usize] = 50.0;
            row[b'c' as usize] = 5.0;
            assert_eq!(d.pick(&row).unwrap().0, b'a' as u32);
            assert_eq!(d.pick(&row).unwrap().0, b'c' as u32);
            assert!(d.constraint.as_ref().unwrap().finished());
        }
        // Every allowed weight underflowing to 0 still gives an allowed token.
        let mut d = constrained("root ::= \"q\"", 0.8);
        let mut row = vec![-1000.0f32; 258];
        row[0] = f32::NEG_INFINITY;
        assert_eq!(d.pick(&row).unwrap().0, b'q' as u32);
    }
}
