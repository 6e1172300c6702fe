//! `config.json` of a Qwen3 (or ReFusion) checkpoint.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value as Json;

use crate::error::{Error, Result};

/// The hyper-parameters the converter needs, validated.
#[derive(Debug, Clone)]
pub struct Qwen3Config {
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub num_hidden_layers: u64,
    pub num_attention_heads: u64,
    pub num_key_value_heads: u64,
    pub head_dim: u64,
    pub vocab_size: u64,
    pub tie_word_embeddings: bool,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: u64,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    pub mask_token_id: Option<u64>,
}

#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    hidden_size: Option<u64>,
    intermediate_size: Option<u64>,
    num_hidden_layers: Option<u64>,
    num_attention_heads: Option<u64>,
    num_key_value_heads: Option<u64>,
    head_dim: Option<u64>,
    vocab_size: Option<u64>,
    #[serde(default)]
    tie_word_embeddings: bool,
    rope_theta: Option<f64>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<u64>,
    bos_token_id: Option<Json>,
    eos_token_id: Option<Json>,
    mask_token_id: Option<Json>,
    rope_scaling: Option<Json>,
    #[serde(default)]
    use_sliding_window: bool,
    #[serde(default)]
    attention_bias: bool,
}

/// A token id given as a number, or as a list whose first entry counts (as for eos).
fn token_id(path: &Path, key: &str, v: &Option<Json>) -> Result<Option<u64>> {
    match v {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Number(n)) => n.as_u64().map(Some).ok_or_else(|| {
            Error::bad(
                path,
                format!("{key} must be a non-negative integer, got {n}"),
            )
        }),
        Some(Json::Array(items)) => match items.first() {
            None => Ok(None),
            Some(Json::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
            Some(other) => Err(Error::bad(
                path,
                format!("{key} must hold token ids, got {other}"),
            )),
        },
        Some(other) => Err(Error::bad(
            path,
            format!("{key} must be a token id, got {other}"),
        )),
    }
}

impl Qwen3Config {
    pub fn load(dir: &Path) -> Result<Qwen3Config> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(Error::bad(
                &path,
                "not found (is this a Hugging Face checkpoint folder?)",
            ));
        }
        let raw: Raw = super::read_json(&path)?;
        Self::from_raw(&path, raw)
    }

    fn from_raw(path: &Path, raw: Raw) -> Result<Qwen3Config> {
        check_supported(path, &raw)?;
        let need = |key: &str, v: Option<u64>| need(path, key, v);
        let hidden_size = need("hidden_size", raw.hidden_size)?;
        let (num_attention_heads, num_key_value_heads, head_dim) = heads(path, &raw, hidden_size)?;
        let rope_theta = raw.rope_theta.unwrap_or(1_000_000.0);
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6);
        for (key, v) in [("rope_theta", rope_theta), ("rms_norm_eps", rms_norm_eps)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::bad(path, format!("{key} must be positive, got {v}")));
            }
        }
        let cfg = Qwen3Config {
            hidden_size,
            intermediate_size: need("intermediate_size", raw.intermediate_size)?,
            num_hidden_layers: need("num_hidden_layers", raw.num_hidden_layers)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: need("vocab_size", raw.vocab_size)?,
            tie_word_embeddings: raw.tie_word_embeddings,
            rope_theta,
            rms_norm_eps,
            max_position_embeddings: need(
                "max_position_embeddings",
                Some(raw.max_position_embeddings.unwrap_or(40960)),
            )?,
            bos_token_id: token_id(path, "bos_token_id", &raw.bos_token_id)?,
            eos_token_id: token_id(path, "eos_token_id", &raw.eos_token_id)?,
            mask_token_id: token_id(path, "mask_token_id", &raw.mask_token_id)?,
        };
        for (key, id) in [
            ("bos_token_id", cfg.bos_token_id),
            ("eos_token_id", cfg.eos_token_id),
            ("mask_token_id", cfg.mask_token_id),
        ] {
            if let Some(id) = id.filter(|&id| id >= cfg.vocab_size) {
                return Err(Error::bad(
                    path,
                    format!(
                        "{key} {id} is outside the vocabulary (vocab_size {})",
                        cfg.vocab_size
                    ),
                ));
            }
        }
        Ok(cfg)
    }
}

/// Refuses what the qwen3 layout cannot hold: another model type or architecture, RoPE
/// scaling, a sliding window, attention biases.
fn check_supported(path: &Path, raw: &Raw) -> Result<()> {
    let model_type = raw.model_type.clone().unwrap_or_default();
    if model_type != "qwen3" {
        let archs = raw.architectures.clone().unwrap_or_default().join(", ");
        return Err(Error::bad(
            path,
            format!(
                "unsupported model_type '{model_type}' (architectures: [{archs}]); only qwen3 (Qwen3ForCausalLM, ReFusion) is supported"
            ),
        ));
    }
    if let Some(archs) = &raw.architectures {
        if !archs.iter().any(|a| a == "Qwen3ForCausalLM") {
            return Err(Error::bad(
                path,
                format!(
                    "unsupported architectures [{}]; expected Qwen3ForCausalLM",
                    archs.join(", ")
                ),
            ));
        }
    }
    if let Some(scaling) = raw.rope_scaling.as_ref().filter(|s| !s.is_null()) {
        return Err(Error::bad(
            path,
            format!("rope_scaling {scaling} is not supported"),
        ));
    }
    if raw.use_sliding_window {
        return Err(Error::bad(
            path,
            "use_sliding_window = true is not supported",
        ));
    }
    if raw.attention_bias {
        return Err(Error::bad(
            path,
            "attention_bias = true is not supported by the qwen3 layout",
        ));
    }
    Ok(())
}

/// A count that must be there and positive.
fn need(path: &Path, key: &str, v: Option<u64>) -> Result<u64> {
    match v {
        Some(0) => Err(Error::bad(path, format!("{key} must be positive"))),
        Some(v) => Ok(v),
        None => Err(Error::bad(path, format!("missing {key}"))),
    }
}

/// Attention heads, KV heads (a divisor of the heads) and an even head size.
fn heads(path: &Path, raw: &Raw, hidden_size: u64) -> Result<(u64, u64, u64)> {
    let n = need(path, "num_attention_heads", raw.num_attention_heads)?;
    let kv = need(
        path,
        "num_key_value_heads",
        Some(raw.num_key_value_heads.unwrap_or(n)),
    )?;
    if !n.is_multiple_of(kv) {
        return Err(Error::bad(
            path,
            format!("num_attention_heads ({n}) is not a multiple of num_key_value_heads ({kv})"),
        ));
    }
    let head_dim = match raw.head_dim {
        Some(h) => need(path, "head_dim", Some(h))?,
        None if hidden_size.is_multiple_of(n) => hidden_size / n,
        None => return Err(Error::bad(path, "missing head_dim")),
    };
    if head_dim % 2 != 0 {
        return Err(Error::bad(
            path,
            format!("head_dim {head_dim} must be even for RoPE"),
        ));
    }
    Ok((n, kv, head_dim))
}
