//! A request's decoding fields over a front end's defaults: the one mapping from what a caller
//! asks for (`max_tokens`, `slot_size`, `strategy`, ...) to [`DecodeParams`], shared by the
//! server's endpoints and `generate --batch`. Mistakes are [`RequestError::Field`], naming the
//! field; the server turns them into HTTP 400 with `param` set.

use refusion_gguf::decoding::MAX_TOKENS;

use super::DecodeParams;
use crate::error::RequestError;

/// The decoding fields a request may set; `None` keeps the default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub seed: Option<u64>,
    pub slot_size: Option<u32>,
    pub serial_blocks: Option<u32>,
    pub slot_threshold: Option<f32>,
    pub token_threshold: Option<f32>,
    /// A [`super::Kind`]'s name.
    pub strategy: Option<String>,
    /// Log-probabilities with this many alternatives each ([`DecodeParams::logprobs`]).
    pub logprobs: Option<u32>,
    /// The prompt scored too ([`DecodeParams::score_prompt`]); then `max_tokens` 0 asks for
    /// no answer ([`DecodeParams::answer`]).
    pub score_prompt: bool,
}

fn field(field: &'static str, message: impl Into<String>) -> RequestError {
    RequestError::Field {
        field,
        message: message.into(),
    }
}

impl Overrides {
    /// These fields over `base`, checked; `max_tokens` may be at most `max_gen_length`. When
    /// the answer's length or slot size changes but not the serial blocks, the number of
    /// blocks is chosen to keep `base`'s block length.
    pub fn apply(
        &self,
        base: &DecodeParams,
        max_gen_length: u32,
    ) -> Result<DecodeParams, RequestError> {
        let mut p = base.clone();
        if let Some(n) = self.max_tokens {
            if n == 0 && self.score_prompt {
                p.answer = false;
            } else if n == 0 || n > max_gen_length {
                let m = format!("max_tokens must be between 1 and {max_gen_length}, got {n}");
                return Err(field("max_tokens", m));
            } else {
                p.gen_length = n;
            }
        }
        for (name, v) in [
            ("slot_size", self.slot_size),
            ("serial_blocks", self.serial_blocks),
        ] {
            if let Some(v) = v.filter(|v| !(1..=MAX_TOKENS).contains(v)) {
                let m = format!("{name} must be between 1 and {MAX_TOKENS}, got {v}");
                return Err(field(name, m));
            }
        }
        p.temperature = self.temperature.unwrap_or(p.temperature);
        p.seed = self.seed.unwrap_or(p.seed);
        p.slot_size = self.slot_size.unwrap_or(p.slot_size);
        match self.serial_blocks {
            Some(v) => p.serial_blocks = v,
            None if p.gen_length != base.gen_length || p.slot_size != base.slot_size => {
                p.fit_serial_blocks(base.block_len())
            }
            None => {}
        }
        if let Some(s) = &self.strategy {
            p.strategy = s.parse().map_err(|e: String| field("strategy", e))?;
        }
        p.slot_threshold = self.slot_threshold.unwrap_or(p.slot_threshold);
        p.token_threshold = self.token_threshold.unwrap_or(p.token_threshold);
        p.logprobs = self.logprobs;
        p.score_prompt = self.score_prompt;
        p.validate()?;
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Kind;

    fn base() -> DecodeParams {
        DecodeParams::new(Default::default(), 1, 2)
    }

    #[test]
    fn any_number_gives_parameters_or_a_mistake_naming_its_field() {
        let edges = [
            0,
            1,
            2,
            3,
            4,
            7,
            64,
            2048,
            2049,
            1 << 20,
            (1 << 20) + 1,
            u32::MAX,
        ];
        for &a in &edges {
            for &b in &edges {
                for &c in &edges {
                    let o = Overrides {
                        max_tokens: Some(a),
                        slot_size: Some(b),
                        serial_blocks: Some(c),
                        seed: Some(u64::MAX),
                        ..Default::default()
                    };
                    match o.apply(&base(), 2048) {
                        Ok(p) => assert!(p.padded_gen_length() <= 2 << 20),
                        Err(RequestError::Field { field, .. }) => {
                            assert!(["max_tokens", "slot_size", "serial_blocks"].contains(&field))
                        }
                        Err(RequestError::Params(m)) => assert!(m.contains("gen length"), "{m}"),
                        Err(e) => panic!("{e}"),
                    }
                }
            }
        }
    }

    #[test]
    fn the_strategy_field_picks_a_strategy_by_name() {
        let with = |s: &str| Overrides {
            strategy: Some(s.into()),
            max_tokens: Some(10),
            ..Default::default()
        };
        let p = with("ar").apply(&base(), 2048).unwrap();
        assert_eq!((p.strategy, p.gen_length), (Kind::Autoregressive, 10));
        assert_eq!(
            with("slots").apply(&base(), 2048).unwrap().strategy,
            Kind::Slots
        );
        match with("beam").apply(&base(), 2048) {
            Err(RequestError::Field { field, message }) => {
                assert_eq!(field, "strategy");
                assert!(message.contains("expected slots, ar, infill"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn no_answer_only_scores_the_prompt() {
        let o = |max_tokens, logprobs, score_prompt| Overrides {
            max_tokens,
            logprobs,
            score_prompt,
            ..Default::default()
        };
        let p = o(Some(0), Some(1), true).apply(&base(), 2048).unwrap();
        assert!(!p.answer && p.score_prompt && p.logprobs == Some(1));
        let field_of = |r: Result<DecodeParams, RequestError>| match r {
            Err(RequestError::Field { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            field_of(o(Some(0), Some(1), false).apply(&base(), 2048)),
            "max_tokens"
        );
        assert_eq!(
            field_of(o(Some(3), None, true).apply(&base(), 2048)),
            "echo"
        );
        assert_eq!(
            field_of(o(None, Some(21), false).apply(&base(), 2048)),
            "top_logprobs"
        );
        let mut infill = base();
        infill.strategy = Kind::Infill;
        assert_eq!(
            field_of(o(None, Some(2), false).apply(&infill, 2048)),
            "logprobs"
        );
        assert!(
            o(Some(5), Some(0), false)
                .apply(&base(), 2048)
                .unwrap()
                .answer
        );
    }

    #[test]
    fn a_new_length_keeps_the_block_length() {
        let o = Overrides {
            max_tokens: Some(64),
            ..Default::default()
        };
        let p = o.apply(&base(), 2048).unwrap();
        assert_eq!((p.serial_blocks, p.block_len()), (4, 16));
    }
}
