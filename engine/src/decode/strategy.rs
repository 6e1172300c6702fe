//! The seam between a way of decoding and whoever drives it. A [`Strategy`] is a state machine
//! over one sequence of the KV cache: [`Strategy::poll`] gives the batch it needs forwarded
//! next (or says it is done), [`Strategy::feed`] takes that batch's logits back, and
//! [`Strategy::result`] gives the answer. The single-request loop
//! ([`super::generate_cancellable`]) and the scheduler ([`crate::sched`]) drive every strategy
//! the same way. What the rest of the program needs to know about a strategy (its name, the
//! cache it needs, the parameters it accepts, how it starts) is its [`Method`], in the
//! strategy's own file; a new strategy is that file plus its line in [`Kind`].

use refusion_gguf::DecodingDefaults;

use super::{DecodeParams, DecodeResult, Event};
use crate::error::{RequestError, Result};
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

    /// Whether the whole prompt's entries are committed (asked after each feed, to cache the
    /// prompt for later requests): after the first forward, unless the strategy feeds the
    /// prompt over several.
    fn prompt_cached(&self) -> bool {
        true
    }

    /// The result, once done.
    fn result(&mut self) -> DecodeResult;
}

/// One way of decoding as the rest of the program sees it, implemented in the strategy's file.
pub trait Method: Sync {
    /// Its name (`--strategy`, the API's `strategy`).
    fn name(&self) -> &'static str;
    /// Other names it answers to.
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }
    /// Whether it decodes in slots (slot size and serial blocks mean something to it; a
    /// template's gaps can be filled by it).
    fn uses_slots(&self) -> bool {
        true
    }
    /// Whether it fills an answer template's gaps (the answer is the template's fills, each
    /// bounded by its gap rather than by the gen length).
    fn fills_gaps(&self) -> bool {
        false
    }
    /// The most prompt tokens a decode may find already cached.
    fn max_reuse(&self, prompt_len: usize) -> usize {
        prompt_len
    }
    /// Cache entries a decode needs beyond its prompt and answer, for its speculative rows.
    fn scratch(&self, params: &DecodeParams) -> usize;
    /// The decoding settings as this strategy checks them: `d` as given, with what it does
    /// not use set to what always passes; a mistake of its own is the caller's.
    fn checked(
        &self,
        d: DecodingDefaults,
        _params: &DecodeParams,
    ) -> std::result::Result<DecodingDefaults, RequestError> {
        Ok(d)
    }
    /// Its decoder over `prompt`, whose first `cached` tokens are the sequence's already.
    fn start(&self, prompt: &[u32], cached: usize, params: &DecodeParams) -> Box<dyn Strategy>;
}

/// The strategies there are (`--strategy`, the API's `strategy`); each is its [`Method`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kind {
    /// ReFusion's slot decoding, as the reference's `generate_refusion` (`slots.rs`).
    #[default]
    Slots,
    /// Plain left-to-right decoding, one token per forward (`autoregressive.rs`).
    Autoregressive,
    /// Any-order generation: an answer template's gaps filled (`infill.rs`).
    Infill,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Slots, Kind::Autoregressive, Kind::Infill];

    /// The strategy itself (the one place a kind is matched).
    pub fn method(self) -> &'static dyn Method {
        match self {
            Kind::Slots => &super::slots::Slots,
            Kind::Autoregressive => &super::autoregressive::LeftToRight,
            Kind::Infill => &super::infill::AnyOrder,
        }
    }

    pub fn name(self) -> &'static str {
        self.method().name()
    }

    /// The most prompt tokens a decode may find already cached ([`Method::max_reuse`]).
    pub fn max_reuse(self, prompt_len: usize) -> usize {
        self.method().max_reuse(prompt_len)
    }

    /// Cache entries a decode needs beyond its prompt and answer ([`Method::scratch`]).
    pub fn scratch(self, params: &DecodeParams) -> usize {
        self.method().scratch(params)
    }
}

impl std::str::FromStr for Kind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Kind, String> {
        let s = s.to_ascii_lowercase();
        Kind::ALL
            .into_iter()
            .find(|k| k.name() == s || k.method().aliases().contains(&s.as_str()))
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

/// The strategy `params` ask for (after scoring the prompt, when asked), over `prompt` whose
/// first `cached` tokens (at most [`DecodeParams::max_reuse`]) are already the sequence's
/// shared entries. The caller has checked the
/// prompt and the cache's room ([`super::check`]).
pub fn start(prompt: &[u32], cached: usize, params: &DecodeParams) -> Box<dyn Strategy> {
    if params.score_prompt {
        return Box::new(super::score::Scored::new(prompt, params));
    }
    params.strategy.method().start(prompt, cached, params)
}
