//! llama-server's request conventions that its native endpoints share (`/completion`,
//! `/infill`): `n_predict` and `seed` with -1 for "the default", `n_probs` (each answer
//! token's log-probability with that many alternatives, docs/logprobs.md), and the slot field,
//! accepted at the value that changes nothing and refused by name otherwise.

use serde::Deserialize;

use super::api::{ApiError, Knobs, Sampling, Scoring, Stop};

/// The fields `/completion` and `/infill` share, flattened into each request
/// ([`crate::api::parse_llama`] names a mistyped one).
#[derive(Debug, Deserialize)]
pub(crate) struct LlamaFields {
    /// Most new tokens; -1: the server's default.
    pub n_predict: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub temperature: Option<f64>,
    /// -1: a random seed.
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    /// Prompts are cached anyway (shared prefixes).
    #[serde(rename = "cache_prompt")]
    _cache_prompt: Option<bool>,
    /// -1: any slot; a given slot cannot be pinned.
    id_slot: Option<i64>,
    /// Each answer token's log-probability with this many alternatives (0: none).
    n_probs: Option<u32>,
    /// The fields to answer with (`timings/predicted_n`: a nested one, keyed by its path).
    pub response_fields: Option<Vec<String>>,
    // ReFusion's own knobs, as on the OpenAI endpoints.
    slot_size: Option<u32>,
    serial_blocks: Option<u32>,
    slot_threshold: Option<f32>,
    token_threshold: Option<f32>,
    strategy: Option<String>,
    #[serde(flatten)]
    sampling: Sampling,
}

impl LlamaFields {
    /// As the OpenAI endpoints' knobs, checked the same way; a pinned slot is refused here.
    pub fn knobs(&self) -> Result<Knobs, ApiError> {
        refuse_pinned_slot(self.id_slot)?;
        let mut k = Knobs {
            max_tokens: n_predict(self.n_predict)?,
            temperature: self.temperature,
            seed: seed(self.seed)?,
            stop: self.stop.clone(),
            stream: self.stream,
            slot_size: self.slot_size,
            serial_blocks: self.serial_blocks,
            slot_threshold: self.slot_threshold,
            token_threshold: self.token_threshold,
            strategy: self.strategy.clone(),
            sampling: self.sampling.clone(),
            ..Knobs::default()
        };
        let n = self.n_probs.unwrap_or(0);
        let max = refusion_engine::decode::MAX_TOP_LOGPROBS;
        if n > max {
            return Err(
                ApiError::bad_request(format!("n_probs must be at most {max}, got {n}"))
                    .param("n_probs"),
            );
        }
        let logprobs = (n > 0).then_some(n);
        k.set_scoring(
            Scoring {
                logprobs,
                echo: false,
            },
            "n_probs",
        )?;
        Ok(k)
    }
}

/// `n_predict` as a token limit: -1 (or none) is the server's default.
fn n_predict(n: Option<i64>) -> Result<Option<u32>, ApiError> {
    match n {
        None | Some(-1) => Ok(None),
        Some(n) => u32::try_from(n).map(Some).map_err(|_| {
            ApiError::bad_request(format!(
                "n_predict must be a number of tokens (0 or more) or -1, not {n}"
            ))
            .param("n_predict")
        }),
    }
}

/// `seed`: -1 (or none) is a random one.
fn seed(s: Option<i64>) -> Result<Option<u64>, ApiError> {
    match s {
        None | Some(-1) => Ok(None),
        Some(s) => u64::try_from(s).map(Some).map_err(|_| {
            ApiError::bad_request(format!("seed must be -1 or 0 or more, not {s}")).param("seed")
        }),
    }
}

/// `id_slot` (-1: any): a pinned slot is refused by name.
fn refuse_pinned_slot(id_slot: Option<i64>) -> Result<(), ApiError> {
    let bad = |m: &str, p: &str| Err(ApiError::bad_request(m.to_string()).param(p));
    if id_slot.is_some_and(|s| s != -1) {
        return bad(
            "id_slot is not supported: requests share the slots as the scheduler places them (send -1)",
            "id_slot",
        );
    }
    Ok(())
}
