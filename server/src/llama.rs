//! llama-server's utility endpoints: `POST /tokenize`, `POST /detokenize` and `GET /props`,
//! in its shapes, for clients and scripts written against llama-server; `/tokenize` and
//! `/detokenize` also take and give vLLM's (`prompt`), and `GET /tokenizer_info` is vLLM's, so
//! that lm-evaluation-harness tokenizes with this server's own tokenizer.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{parse, ApiError};
use crate::AppState;

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    /// vLLM's name for it: `prompt`.
    #[serde(alias = "prompt")]
    content: String,
    /// vLLM's `add_special_tokens`, as `add_special`.
    #[serde(default)]
    add_special_tokens: bool,
    /// Whether to add the tokenizer's own special tokens (Qwen3's add none).
    #[serde(default)]
    add_special: bool,
    /// Each id with its text, as `{"id", "piece"}`.
    #[serde(default)]
    with_pieces: bool,
    /// Special tokens written in the text are always read as such: `false` is refused.
    parse_special: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
}

/// Runs `f` off the async threads (tokenizing a long text takes a while).
async fn blocking(f: impl FnOnce() -> Result<Value, ApiError> + Send + 'static) -> Response {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the tokenizer failed",
        )
        .into_response(),
    }
}

pub async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let answer = move || -> Result<Value, ApiError> {
        let req: TokenizeRequest = parse(&body)?;
        if req.parse_special == Some(false) {
            return Err(ApiError::bad_request(
                "parse_special false is not supported: special tokens written in the text (<|im_start|>) are always read as special tokens",
            )
            .param("parse_special"));
        }
        let mut ids = state
            .tokenizer
            .encode(&req.content)
            .map_err(|e| ApiError::bad_request(e.to_string()).param("content"))?;
        if req.add_special || req.add_special_tokens {
            if let Some(bos) = state.tokenizer.bos_id {
                ids.insert(0, bos);
            }
        }
        if !req.with_pieces {
            return Ok(json!({ "tokens": ids }));
        }
        let mut pieces = Vec::with_capacity(ids.len());
        for &id in &ids {
            let piece = state
                .tokenizer
                .decode(&[id], false)
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            pieces.push(json!({"id": id, "piece": piece}));
        }
        Ok(json!({ "tokens": pieces }))
    };
    blocking(answer).await
}

pub async fn detokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let answer = move || -> Result<Value, ApiError> {
        let req: DetokenizeRequest = parse(&body)?;
        let vocab = state.vocab;
        if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_request(format!(
                "token id {bad} is outside the vocabulary ({vocab} tokens)"
            ))
            .param("tokens"));
        }
        let content = state
            .tokenizer
            .decode(&req.tokens, false)
            .map_err(|e| ApiError::bad_request(e.to_string()).param("tokens"))?;
        // llama-server's `content`, vLLM's `prompt`.
        Ok(json!({ "content": content, "prompt": content }))
    };
    blocking(answer).await
}

/// vLLM's `GET /tokenizer_info`: the special tokens' text and the chat template.
pub async fn tokenizer_info(State(state): State<Arc<AppState>>) -> Response {
    let tok = &state.tokenizer;
    let text = |id: Option<u32>| id.and_then(|i| tok.decode(&[i], false).ok());
    Json(json!({
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": text(tok.eos_id),
        "bos_token": text(tok.bos_id),
        "pad_token": Value::Null,
        "chat_template": Some(&state.props["chat_template"]).filter(|t| *t != "").cloned(),
        "model_max_length": state.props["default_generation_settings"]["n_ctx"],
    }))
    .into_response()
}

pub async fn props(State(state): State<Arc<AppState>>) -> Response {
    Json(state.props.clone()).into_response()
}
