//! llama-server's native endpoints beside its utilities (`llama.rs`): `POST /completion` (its
//! own completion API: `prompt`, `n_predict`, `stream`, `json_schema`, `grammar`, ...; the
//! answer as `content`, `stop`, `stop_type`, `tokens_predicted`, `timings`),
//! `POST /apply-template` (the chat template's prompt for `messages`), `GET /slots`, and the
//! embedding endpoints, which this server refuses by name.
//!
//! What llama-server takes that has nothing to act on here is accepted when it changes
//! nothing (`cache_prompt`: prompts are cached anyway; `id_slot: -1`) and refused by name when
//! it would (`id_slot` pinning, `return_tokens`); `n_probs` gives `completion_probabilities`
//! (docs/logprobs.md).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use super::api::{parse, parse_llama, ApiError, ChatMessage, Knobs, PromptField};
use super::jobs::{collect, submit};
use super::llama_fields::LlamaFields;
use crate::jobs::Msg;
use crate::prepare::JobInput;
use crate::AppState;

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: PromptField,
    json_schema: Option<Value>,
    grammar: Option<String>,
    /// The answer's token ids: refused (the answer is text).
    return_tokens: Option<bool>,
    #[serde(flatten)]
    llama: LlamaFields,
}

impl CompletionRequest {
    fn knobs(&self) -> Result<Knobs, ApiError> {
        if self.return_tokens == Some(true) {
            return Err(ApiError::bad_request(
                "return_tokens is not supported: the answer is its text (POST /tokenize gives its ids)",
            )
            .param("return_tokens"));
        }
        Ok(Knobs {
            json_schema: self.json_schema.clone(),
            grammar: self.grammar.clone(),
            ..self.llama.knobs()?
        })
    }
}

pub async fn completion(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match completion_inner(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completion_inner(state: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_llama(&body)?;
    let knobs = req.knobs()?;
    let input = match &req.prompt {
        PromptField::One(s) => JobInput::Text(s.clone()),
        PromptField::Many(v) if v.len() == 1 => JobInput::Text(v[0].clone()),
        PromptField::Tokens(t) => JobInput::Tokens(t.clone()),
        PromptField::TokenLists(v) if v.len() == 1 => JobInput::Tokens(v[0].clone()),
        _ => {
            return Err(ApiError::bad_request(
                "prompt must be one prompt: several are served by several requests",
            )
            .param("prompt"))
        }
    };
    let fields = req.llama.response_fields.clone();
    let (rx, guard, prompt_tokens) = submit(&state, input, knobs, None).await?;
    let model = state.model.clone();
    let last = move |reason: &str, predicted: usize, evaluated: usize| -> Value {
        json!({
            "index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": true, "model": model,
            "stop_type": if reason == "stop" { "eos" } else { "limit" }, "stopping_word": "",
            "tokens_predicted": predicted, "tokens_evaluated": evaluated, "tokens_cached": 0,
            "truncated": false,
        })
    };
    if !req.llama.stream {
        let got = collect(rx).await?;
        drop(guard);
        let mut v = last(got.finish_reason, got.completion_tokens, got.prompt_tokens);
        v["content"] = json!(got.text);
        if let Some(s) = &got.scores {
            v["completion_probabilities"] = s.llama();
        }
        v["timings"] = got
            .figures
            .timings(got.prompt_tokens, got.completion_tokens);
        return Ok(Json(super::infill::only(v, fields.as_deref())).into_response());
    }
    let events = UnboundedReceiverStream::new(rx).filter_map(move |msg| {
        let _keep = &guard;
        let v = match msg {
            Msg::Delta(text) | Msg::Fill { text, .. } => {
                json!({"index": 0, "content": text, "tokens": [], "stop": false, "id_slot": 0})
            }
            Msg::Done {
                finish_reason,
                completion_tokens,
                figures,
                ..
            } => {
                let mut v = last(finish_reason, completion_tokens, prompt_tokens);
                v["timings"] = figures.timings(prompt_tokens, completion_tokens);
                v
            }
            Msg::Error(e) => e.body(),
            Msg::Started { .. } | Msg::Step(_) | Msg::Scores(_) | Msg::End => return None,
        };
        Some(Ok::<_, std::convert::Infallible>(
            SseEvent::default().data(v.to_string()),
        ))
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

#[derive(Debug, Deserialize)]
struct ApplyTemplate {
    messages: Vec<ChatMessage>,
    /// Functions for the template to describe (OpenAI's list).
    tools: Option<Value>,
}

/// `POST /apply-template`: the prompt the chat template makes of `messages` (with the
/// assistant's turn opened), as `{"prompt": ...}`.
pub async fn apply_template(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        let req: ApplyTemplate = parse(&body)?;
        let messages = req
            .messages
            .iter()
            .map(|m| m.message())
            .collect::<Result<Vec<_>, _>>()?;
        let tools = crate::tools::plan(req.tools.as_ref(), None, None)?.tools;
        let prompt = state.prepare.render(&messages, tools.as_ref())?;
        Ok(json!({ "prompt": prompt }))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /slots`: each decoding slot (`-np`) and whether it is decoding now.
pub async fn slots(State(state): State<Arc<AppState>>) -> Response {
    let busy = state.load.stats().running;
    let n_ctx = state.props["default_generation_settings"]["n_ctx"].clone();
    let list: Vec<Value> = (0..state.parallel)
        .map(|id| json!({"id": id, "n_ctx": n_ctx, "is_processing": id < busy}))
        .collect();
    Json(Value::Array(list)).into_response()
}

/// The embedding endpoints (llama-server's `/embedding`, `/embeddings`, `/v1/embeddings`,
/// ollama's `/api/embed`, `/api/embeddings`): refused by name. ReFusion's hidden states are
/// trained for masked diffusion, not as sentence embeddings; an embedding model serves that.
pub async fn embeddings() -> Response {
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        "not_implemented_error",
        "embeddings are not served: ReFusion is a generative model whose hidden states were never trained as embeddings; use an embedding model (llama-server --embeddings, ollama's embedding models)",
    )
    .into_response()
}
