//! Decoding parameters and their checks.

use refusion_gguf::DecodingDefaults;

use std::borrow::Cow;
use std::sync::Arc;

use super::template::Template;
use crate::error::RequestError;

#[derive(Debug, Clone, PartialEq)]
pub struct DecodeParams {
    pub gen_length: u32,
    pub slot_size: u32,
    pub serial_blocks: u32,
    pub slot_threshold: f32,
    pub token_threshold: f32,
    /// 0: greedy planning; above 0, the reference's noise on the planning drafts.
    pub temperature: f64,
    pub seed: u64,
    pub eos_id: u32,
    pub mask_id: u32,
    /// Reproduce the reference's EOS-index bug (for comparison with its raw output only).
    pub reference_eos_bug: bool,
    /// How to decode ([`super::Kind`]): ReFusion's slot decoding unless asked otherwise.
    pub strategy: super::Kind,
    /// The answer's known spans and gaps, for [`super::Kind::Infill`] (none: one gap of the
    /// gen length).
    pub template: Option<Arc<Template>>,
    /// The grammar the answer must follow (JSON, a schema, a tool call...): decoded at the
    /// answer's frontier, each token masked by it ([`DecodeParams::with_guide`]).
    pub guide: Option<Arc<crate::constrain::Guide>>,
    /// Log-probabilities of the answer's tokens (and of the prompt's, with `score_prompt`),
    /// each with this many most likely alternatives (OpenAI's `logprobs`/`top_logprobs`,
    /// llama-server's `n_probs`); `None`: none are computed. Which forward's distribution a
    /// token's is: docs/logprobs.md.
    pub logprobs: Option<u32>,
    /// Score the prompt's own tokens first (OpenAI's `echo` with `logprobs`): each under the
    /// next-token logits of the prompt before it, the prompt fed whole ([`super::score`]).
    pub score_prompt: bool,
    /// Whether an answer follows (false: OpenAI's `max_tokens: 0` with `echo`, the prompt
    /// scored and nothing decoded).
    pub answer: bool,
    /// The slot size from which a planning forward leaves the last slot's tail (all but its
    /// first token) for a second forward, fed only when that slot is chosen; 0: never. The
    /// tokens are the same either way ([`super::slots`]); [`SPLIT_PLAN_FROM`] by default.
    pub split_plan_from: u32,
}

/// Slot sizes from which a planning forward is split ([`DecodeParams::split_plan_from`]).
/// With long slots the last one is seldom chosen (GSM8K's setting, slots of 32: not chosen in
/// 23 plans of 25), and its tail is a quarter of a 4-slot block; with short ones a second
/// forward, one more pass over the weights, costs more than the few tokens it can spare
/// (benches/README.md).
pub const SPLIT_PLAN_FROM: u32 = 16;

/// An f32 setting as the f64 its shortest decimal reads (0.6, not 0.6000000238418579): how the
/// thresholds go into JSON, so that what a front end shows is what the user typed.
pub fn shortest_f64(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

impl DecodeParams {
    pub fn new(d: DecodingDefaults, eos_id: u32, mask_id: u32) -> DecodeParams {
        DecodeParams {
            gen_length: d.gen_length,
            slot_size: d.slot_size,
            serial_blocks: d.serial_blocks,
            slot_threshold: d.slot_threshold,
            token_threshold: d.token_threshold,
            temperature: 0.0,
            seed: 0,
            eos_id,
            mask_id,
            reference_eos_bug: false,
            strategy: super::Kind::Slots,
            template: None,
            guide: None,
            logprobs: None,
            score_prompt: false,
            answer: true,
            split_plan_from: SPLIT_PLAN_FROM,
        }
    }

    /// Cache entries a decode takes beyond its prompt: the answer's positions and the
    /// strategy's scratch (none when no answer follows).
    pub fn answer_room(&self) -> (usize, usize) {
        if self.answer {
            (self.answer_len() as usize, self.strategy.scratch(self))
        } else {
            (0, 0)
        }
    }

    /// The most prompt tokens a decode may find already cached: the strategy's
    /// ([`super::Kind::max_reuse`]), none when the prompt is scored (each of its tokens needs
    /// the logits of the one before).
    pub fn max_reuse(&self, prompt_len: usize) -> usize {
        if self.score_prompt {
            0
        } else {
            self.strategy.max_reuse(prompt_len)
        }
    }

    /// Decodes `template` with the infill strategy (a strategy that cannot fill gaps is left
    /// for [`Self::validate`] to refuse).
    pub fn with_template(mut self, template: Template) -> DecodeParams {
        if self.strategy == super::Kind::Slots {
            self.strategy = super::Kind::Infill;
        }
        self.template = Some(Arc::new(template));
        self
    }

    /// Constrains the answer to `guide`'s grammar, which reads it left to right: slot
    /// decoding then decodes the slot at the answer's frontier each step (`guided.rs`), `ar`
    /// one token a forward; a template's gaps cannot be constrained ([`Self::validate`]
    /// refuses).
    pub fn with_guide(mut self, guide: Arc<crate::constrain::Guide>) -> DecodeParams {
        self.guide = Some(guide);
        self
    }

    /// The template the infill strategy decodes: the one given, or one gap of the gen length.
    pub fn answer_template(&self) -> Cow<'_, Template> {
        match &self.template {
            Some(t) => Cow::Borrowed(t.as_ref()),
            None => Cow::Owned(Template::single_gap(self.gen_length)),
        }
    }

    /// The most answer tokens a front end shows: the gen length (a template's fills are
    /// bounded by their gaps instead).
    pub fn answer_limit(&self) -> usize {
        if self.strategy.method().fills_gaps() {
            usize::MAX
        } else {
            self.gen_length as usize
        }
    }

    /// Positions the answer takes after the prompt: the padded gen length, or a template's
    /// spans and padded gaps (saturating at u32::MAX for what [`Self::validate`] refuses).
    pub fn answer_len(&self) -> u32 {
        match &self.template {
            Some(t) if self.strategy.method().fills_gaps() => {
                u32::try_from(t.positions(self.slot_size)).unwrap_or(u32::MAX)
            }
            _ => self.padded_gen_length(),
        }
    }

    fn defaults(&self) -> DecodingDefaults {
        DecodingDefaults {
            gen_length: self.gen_length,
            slot_size: self.slot_size,
            serial_blocks: self.serial_blocks,
            slot_threshold: self.slot_threshold,
            token_threshold: self.token_threshold,
        }
    }

    /// The gen length rounded up to whole slots.
    /// Saturates at u32::MAX for values [`Self::validate`] refuses (it never overflows).
    pub fn padded_gen_length(&self) -> u32 {
        let k = self.slot_size.max(1) as u64;
        let padded = (self.gen_length as u64).div_ceil(k) * k;
        u32::try_from(padded).unwrap_or(u32::MAX)
    }

    /// Tokens per serial block (the padded length over the serial blocks).
    pub fn block_len(&self) -> u32 {
        self.padded_gen_length() / self.serial_blocks.max(1)
    }

    /// Positions after the last serial block that the reference never generates (when the
    /// padded length does not split evenly into serial blocks).
    pub fn dropped_tail(&self) -> u32 {
        let padded = self.padded_gen_length();
        padded - padded / self.serial_blocks.max(1) * self.serial_blocks
    }

    /// Picks the number of serial blocks for the current gen length so that blocks stay close
    /// to `block_len` tokens and split the padded length exactly into whole slots. Used when a
    /// gen length is asked for without a number of serial blocks (e.g. `-n 64` with the model
    /// card's 16-token blocks gives 4 blocks, where 32 would not split).
    pub fn fit_serial_blocks(&mut self, block_len: u32) {
        let (k, padded) = (self.slot_size.max(1), self.padded_gen_length());
        // Out of range: left for `validate` to refuse (and not worth a search).
        if padded == 0 || padded > 2 * refusion_gguf::decoding::MAX_TOKENS {
            return;
        }
        let target = block_len.max(k);
        let best = (1..=padded / k)
            .filter(|&nb| padded % nb == 0 && (padded / nb) % k == 0)
            .min_by_key(|&nb| ((padded / nb) as i64 - target as i64).abs());
        if let Some(nb) = best {
            self.serial_blocks = nb;
        }
    }

    /// Whether these parameters can be decoded with: a caller's mistake when not.
    pub fn validate(&self) -> std::result::Result<(), RequestError> {
        let method = self.strategy.method();
        let d = method.checked(self.defaults(), self)?;
        d.validate().map_err(RequestError::Params)?;
        if self.template.is_some() && !method.fills_gaps() {
            return Err(RequestError::Template(format!(
                "gaps are filled by slot decoding; strategy '{}' cannot fill them",
                self.strategy
            )));
        }
        if let Some(g) = &self.guide {
            if method.fills_gaps() || self.template.is_some() {
                return Err(RequestError::Grammar(format!(
                    "an answer constrained to a {} is read left to right (strategy 'slots' or 'ar'), without a template's gaps",
                    g.format.describe()
                )));
            }
        }
        self.validate_scoring()?;
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(RequestError::Params(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            )));
        }
        if self.eos_id == self.mask_id {
            return Err(RequestError::Params(
                "the EOS and mask tokens are the same id".into(),
            ));
        }
        Ok(())
    }
}

impl DecodeParams {
    /// Log-probabilities are kept by slot decoding without a grammar and by `ar` (each token's
    /// distribution is one forward's row); a template's gaps and slot decoding under a grammar
    /// are refused by name.
    fn validate_scoring(&self) -> std::result::Result<(), RequestError> {
        let field = |field: &'static str, message: String| RequestError::Field { field, message };
        if let Some(n) = self.logprobs.filter(|&n| n > super::MAX_TOP_LOGPROBS) {
            return Err(field(
                "top_logprobs",
                format!(
                    "at most {} alternatives per token, got {n}",
                    super::MAX_TOP_LOGPROBS
                ),
            ));
        }
        if self.logprobs.is_none() && (self.score_prompt || !self.answer) {
            return Err(field(
                "echo",
                "the prompt is scored with logprobs: give logprobs too".into(),
            ));
        }
        if !self.answer && !self.score_prompt {
            return Err(field(
                "max_tokens",
                "max_tokens must be at least 1 (0 only scores the prompt, with echo and logprobs)"
                    .into(),
            ));
        }
        let slots_guided = self.guide.is_some() && self.strategy == super::Kind::Slots;
        if self.logprobs.is_some() && (self.strategy.method().fills_gaps() || slots_guided) {
            let what = if slots_guided {
                "an answer constrained to a grammar under slot decoding (use strategy 'ar')"
            } else {
                "a template's gaps"
            };
            return Err(field(
                "logprobs",
                format!("logprobs are not supported for {what}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serial_blocks_follow_the_gen_length() {
        let mut p = DecodeParams::new(DecodingDefaults::default(), 1, 2);
        p.gen_length = 64;
        p.fit_serial_blocks(16);
        assert_eq!(p.serial_blocks, 4);
        p.gen_length = 6;
        p.fit_serial_blocks(16);
        assert_eq!((p.padded_gen_length(), p.serial_blocks), (8, 1));
        p.gen_length = 512;
        p.fit_serial_blocks(16);
        assert_eq!(p.serial_blocks, 32);
        assert!(p.validate().is_ok());
    }

    #[test]
    fn any_u32_is_refused_or_works_without_overflow() {
        let edge = [
            0,
            1,
            2,
            3,
            4,
            7,
            64,
            1 << 20,
            (1 << 20) + 1,
            u32::MAX / 2,
            u32::MAX - 1,
            u32::MAX,
        ];
        for &l in &edge {
            for &k in &edge {
                for &b in &edge {
                    let mut p = DecodeParams::new(DecodingDefaults::default(), 1, 2);
                    (p.gen_length, p.slot_size, p.serial_blocks) = (l, k, b);
                    let _ = (p.padded_gen_length(), p.block_len(), p.dropped_tail());
                    p.fit_serial_blocks(b);
                    if p.validate().is_ok() {
                        assert!(p.padded_gen_length() <= 2 << 20);
                    }
                }
            }
        }
    }
}
