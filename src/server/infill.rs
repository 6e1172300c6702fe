//! llama-server's `POST /infill`, in its shapes: the text between `input_prefix` and
//! `input_suffix`. llama-server builds `[input_extra] <FIM_PRE> prefix <FIM_SUF> suffix <FIM_MID>
//! prompt` for models trained on fill-in-the-middle tokens; ReFusion needs none: the prompt is
//! the extra context, the prefix and `prompt` (the middle's start, already written), and the
//! suffix is the known text after one gap of at most `n_predict` tokens (docs/infill.md).
//! Answered whole (`content`, `stop`, `tokens_predicted`, ...) or streamed as server-sent
//! events of `{"content", "stop"}`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use super::api::{parse, ApiError, Knobs, Stop};
use super::fill::{FillSource, FillSpec};
use super::jobs::{collect, submit};
use super::worker::{JobInput, Msg};
use super::AppState;

/// One file of `input_extra`: context before the prefix.
#[derive(Debug, Deserialize)]
struct Extra {
    #[serde(default)]
    filename: String,
    #[serde(default)]
    text: String,
}

#[derive(Debug, Deserialize)]
struct InfillRequest {
    #[serde(default)]
    input_prefix: String,
    #[serde(default)]
    input_suffix: String,
    #[serde(default)]
    input_extra: Vec<Extra>,
    /// The middle's beginning, already written (llama-server: after `<FIM_MID>`).
    #[serde(default)]
    prompt: String,
    /// Most tokens in the middle; -1: the server's default.
    n_predict: Option<i64>,
    #[serde(default)]
    stream: bool,
    temperature: Option<f64>,
    seed: Option<u64>,
    stop: Option<Stop>,
    // ReFusion's own knobs, as on the OpenAI endpoints.
    slot_size: Option<u32>,
    serial_blocks: Option<u32>,
    slot_threshold: Option<f32>,
    token_threshold: Option<f32>,
    strategy: Option<String>,
}

impl InfillRequest {
    /// The text before the gap: each extra file (its name on a line, then its text), the
    /// prefix, and the middle's start.
    fn before(&self) -> String {
        let mut s = String::new();
        for e in &self.input_extra {
            if !e.filename.is_empty() {
                s.push_str(&e.filename);
                s.push('\n');
            }
            s.push_str(&e.text);
            if !e.text.ends_with('\n') {
                s.push('\n');
            }
        }
        s.push_str(&self.input_prefix);
        s.push_str(&self.prompt);
        s
    }

    fn knobs(&self) -> Result<Knobs, ApiError> {
        let max_tokens = match self.n_predict {
            None | Some(-1) => None,
            Some(n) => Some(u32::try_from(n).ok().filter(|&n| n > 0).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "n_predict must be a positive number of tokens or -1, not {n}"
                ))
                .param("n_predict")
            })?),
        };
        Ok(Knobs {
            max_tokens,
            temperature: self.temperature,
            seed: self.seed,
            stop: self.stop.clone(),
            stream: self.stream,
            slot_size: self.slot_size,
            serial_blocks: self.serial_blocks,
            slot_threshold: self.slot_threshold,
            token_threshold: self.token_threshold,
            strategy: self.strategy.clone(),
            ..Knobs::default()
        })
    }
}

pub async fn infill(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match infill_inner(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn infill_inner(state: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: InfillRequest = parse(&body)?;
    let before = req.before();
    if before.is_empty() {
        return Err(ApiError::bad_request(
            "input_prefix (or input_extra, or prompt) must not be empty: the middle needs text before it",
        )
        .param("input_prefix"));
    }
    let knobs = req.knobs()?;
    let template = FillSpec::new(FillSource::Suffix(req.input_suffix.clone()), "input_suffix");
    let (rx, guard, prompt_tokens) =
        submit(&state, JobInput::Text(before), knobs, Some(template)).await?;
    let model = state.model.clone();
    let last = move |reason: &str, predicted: usize, evaluated: usize| -> Value {
        json!({
            "content": "", "stop": true, "model": model,
            "stop_type": if reason == "stop" { "eos" } else { "limit" },
            "tokens_predicted": predicted, "tokens_evaluated": evaluated, "truncated": false,
        })
    };
    if !req.stream {
        let got = collect(rx).await?;
        drop(guard);
        let mut v = last(got.finish_reason, got.completion_tokens, got.prompt_tokens);
        v["content"] = json!(got.text);
        return Ok(Json(v).into_response());
    }
    let events = UnboundedReceiverStream::new(rx).filter_map(move |msg| {
        let _keep = &guard;
        let v = match msg {
            Msg::Delta(text) | Msg::Fill { text, .. } => json!({"content": text, "stop": false}),
            Msg::Done {
                finish_reason,
                completion_tokens,
                ..
            } => last(finish_reason, completion_tokens, prompt_tokens),
            Msg::Error(e) => e.body(),
            Msg::Started { .. } | Msg::Step(_) | Msg::End => return None,
        };
        Some(Ok::<_, std::convert::Infallible>(
            SseEvent::default().data(v.to_string()),
        ))
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}
