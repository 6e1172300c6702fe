//! The seam between a way of decoding and whoever drives it. A [`Strategy`] is a state machine
//! over one sequence of the KV cache: [`Strategy::poll`] gives the batch it needs forwarded
//! next (or says it is done), [`Strategy::feed`] takes that batch's logits back, and
//! [`Strategy::result`] gives the answer. The single-request loop
//! ([`super::generate_cancellable`]) and the scheduler ([`crate::sched`]) drive every strategy
//! the same way, so a new one is a file implementing the trait, a [`Kind`] variant and its
//! line in [`start`].

use super::{DecodeParams, DecodeResult, Event};
use crate::error::Result;
use crate::kv::SeqCache;
use crate::model::{Batch, LogitsRef};

/// What a strategy needs next.
pub enum Poll<'a> {
    /// Forward this batch (its rows are the strategy's own) and feed the logits back.
    Forward(&'a Batch),
    Done,
}

/// A way of decoding one request.
pub trait Strategy: Send {
    /// The next forward, or done.
    fn poll(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<Poll<'_>>;

    /// The logits of the batch [`Strategy::poll`] asked for; `cache` is the request's
    /// sequence, holding that batch's entries as private rows.
    fn feed(
        &mut self,
        logits: &LogitsRef<'_>,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()>;

    /// Between two steps, where the decode may be left (cancellation): no forward's logits
    /// are awaited and the cache holds only committed entries.
    fn at_step_boundary(&self) -> bool;

    fn is_done(&self) -> bool;

    /// The result, once done.
    fn result(&mut self) -> DecodeResult;
}

/// The strategies there are (`--strategy`, the API's `strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kind {
    /// ReFusion's slot decoding, as the reference's `generate_refusion` (`slots.rs`).
    #[default]
    Slots,
    /// Plain left-to-right decoding, one token per forward, greedy (or with the planning
    /// noise at a temperature): the baseline to compare slot decoding with on one file
    /// (`autoregressive.rs`).
    Autoregressive,
    /// Any-order generation: a template's known spans committed at their positions, its
    /// gaps decoded by slot decoding's plan, verify and infill (`template.rs`,
    /// `slots/layout.rs`). Without a template, one gap of the gen length.
    Infill,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Slots, Kind::Autoregressive, Kind::Infill];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Slots => "slots",
            Kind::Autoregressive => "ar",
            Kind::Infill => "infill",
        }
    }

    /// The most prompt tokens a decode may find already cached: slot decoding's planning
    /// forward needs none of the prompt, left-to-right decoding needs its last token's logits,
    /// so feeds at least that token.
    pub fn max_reuse(self, prompt_len: usize) -> usize {
        match self {
            Kind::Slots | Kind::Infill => prompt_len,
            Kind::Autoregressive => prompt_len.saturating_sub(1),
        }
    }

    /// Cache entries a decode needs beyond its prompt and answer, for its speculative rows.
    pub fn scratch(self, params: &DecodeParams) -> usize {
        match self {
            // One serial block: the planning forward's masks.
            Kind::Slots => params.block_len() as usize,
            // The token being fed.
            Kind::Autoregressive => 1,
            // The largest serial block: every gap's share of slots in it.
            Kind::Infill => super::slots::infill_scratch(params),
        }
    }
}

impl std::str::FromStr for Kind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Kind, String> {
        let s = s.to_ascii_lowercase();
        match s.as_str() {
            "autoregressive" => return Ok(Kind::Autoregressive),
            "slot" => return Ok(Kind::Slots),
            _ => {}
        }
        Kind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown strategy '{s}' (expected {})", names.join(", "))
            })
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The strategy `params` ask for, over `prompt` whose first `cached` tokens (at most
/// [`Kind::max_reuse`]) are already the sequence's shared entries. The caller has checked the
/// prompt and the cache's room ([`super::check`]).
pub fn start(prompt: &[u32], cached: usize, params: &DecodeParams) -> Box<dyn Strategy> {
    match params.strategy {
        Kind::Slots => Box::new(super::slots::SlotDecoder::new(prompt, cached, params)),
        Kind::Autoregressive => Box::new(super::autoregressive::Autoregressive::new(
            prompt, cached, params,
        )),
        Kind::Infill if params.answer_template().fits() => {
            Box::new(super::fit::Fit::new(prompt, cached, params))
        }
        Kind::Infill => Box::new(super::slots::SlotDecoder::infill(prompt, cached, params)),
    }
}
