//! ollama's API beside the OpenAI one, so that ollama clients (Open WebUI, editor plugins,
//! the `ollama` Python and JS libraries) connect unchanged: `/api/tags`, `/api/ps`,
//! `/api/version`, `/api/show`, `/api/generate` and `/api/chat`, streamed as NDJSON (one JSON
//! object per line, ollama's default) or answered in one object with `"stream": false`.
//!
//! The same worker serves both APIs; only the shapes differ. ollama's errors are
//! `{"error": "message"}` with the status code; sampling options slot decoding has no use for
//! (`top_k`, `top_p`, ...) are ignored, as ollama ignores options a model does not take.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use super::api::{parse, ApiError, ChatMessage, Knobs, Stop};
use super::fill::{FillSource, FillSpec};
use super::jobs::{collect, submit};
use crate::jobs::Msg;
use crate::prepare::JobInput;
use crate::AppState;
use refusion_engine::chat::Message;

/// What `/api/tags` and `/api/show` tell about the one model served.
#[derive(Debug, Clone)]
pub struct ModelCard {
    /// The file's size in bytes.
    pub size: u64,
    /// llama.cpp's name for the file type (`Q4_K_M`).
    pub quantization: String,
    /// Weights, in ollama's style (`8.2B`).
    pub parameter_size: String,
    /// The file's modification time.
    pub modified: SystemTime,
}

/// ollama's `options`: the ones slot decoding honours; others are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
struct Options {
    temperature: Option<f64>,
    seed: Option<u64>,
    /// Most new tokens; -1 (and -2) mean no limit but the context.
    num_predict: Option<i64>,
    stop: Option<Stop>,
}

#[derive(Debug, Clone, Deserialize)]
struct GenerateRequest {
    #[serde(default)]
    prompt: String,
    system: Option<String>,
    /// The prompt as it is, without the chat template.
    #[serde(default)]
    raw: bool,
    stream: Option<bool>,
    /// The text after the response: the response fills the gap between the prompt and it.
    suffix: Option<String>,
    #[serde(default)]
    options: Options,
    /// Structured output: refused ([`refuse_format`]).
    format: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
struct ChatRequest {
    #[serde(default)]
    messages: Vec<ChatMessage>,
    stream: Option<bool>,
    #[serde(default)]
    options: Options,
    format: Option<serde_json::Value>,
}

/// ollama's `format` (`"json"` or a JSON schema) asks for constrained output, which this
/// server does not do: a 400 naming it (an empty `""` or `null` is no format).
fn refuse_format(format: &Option<serde_json::Value>) -> Result<(), ApiError> {
    match format {
        None | Some(serde_json::Value::Null) => Ok(()),
        Some(serde_json::Value::String(s)) if s.is_empty() => Ok(()),
        Some(_) => Err(ApiError::bad_request(
            "format is not supported: answers are not constrained to JSON or a schema",
        )
        .param("format")),
    }
}

/// ollama's error object.
fn error(e: ApiError) -> Response {
    (e.status, Json(json!({"error": e.message}))).into_response()
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_nanos(SystemTime::now()).to_string()
}

impl ModelCard {
    /// The card of the file `loaded` was loaded from.
    pub fn of(file: &refusion_gguf::GgufFile) -> ModelCard {
        let h = &file.header;
        let quantization = h
            .get("general.file_type")
            .and_then(|v| v.as_u64())
            .and_then(|c| refusion_gguf::FileType::from_code(c as u32))
            .map(|f| f.display_name())
            .unwrap_or_else(|| "unknown".into());
        let params: u64 = h.tensors.iter().map(|t| t.n_elements()).sum();
        let parameter_size = if params >= 1_000_000_000 {
            format!("{:.1}B", params as f64 / 1e9)
        } else {
            format!("{:.0}M", params as f64 / 1e6)
        };
        // Within what RFC 3339 can write (humantime panics outside 1970..=9999).
        let latest = SystemTime::UNIX_EPOCH + Duration::from_secs(253_402_300_799);
        let modified = std::fs::metadata(&file.path)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH)
            .clamp(SystemTime::UNIX_EPOCH, latest);
        ModelCard {
            size: file.file_len(),
            quantization,
            parameter_size,
            modified,
        }
    }
}

impl Options {
    /// As the OpenAI endpoints' knobs, checked by the worker the same way.
    fn knobs(&self, stream: bool) -> Result<Knobs, ApiError> {
        let max_tokens = match self.num_predict {
            None | Some(-1) | Some(-2) => None,
            Some(n) => Some(u32::try_from(n).map_err(|_| {
                ApiError::bad_request(format!(
                    "options.num_predict must be a positive number of tokens or -1, not {n}"
                ))
                .param("options.num_predict")
            })?),
        };
        Ok(Knobs {
            max_tokens,
            temperature: self.temperature,
            seed: self.seed,
            stop: self.stop.clone(),
            stream,
            ..Knobs::default()
        })
    }
}

pub async fn tags(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({"models": [model_entry(&state)]})).into_response()
}

/// Running models: the one loaded, for as long as the server runs.
pub async fn ps(State(state): State<Arc<AppState>>) -> Response {
    let mut m = model_entry(&state);
    m["size_vram"] = json!(0);
    m["expires_at"] = json!("0001-01-01T00:00:00Z");
    Json(json!({"models": [m]})).into_response()
}

pub async fn version() -> Response {
    Json(json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

pub async fn show(State(state): State<Arc<AppState>>) -> Response {
    let m = model_entry(&state);
    Json(json!({
        "modelfile": "", "parameters": "", "template": "",
        "details": m["details"], "model_info": {"general.architecture": "qwen3"},
        "capabilities": ["completion"], "modified_at": m["modified_at"],
    }))
    .into_response()
}

fn model_entry(state: &AppState) -> Value {
    let card = &state.card;
    json!({
        "name": state.model, "model": state.model,
        "modified_at": humantime::format_rfc3339_seconds(card.modified).to_string(),
        "size": card.size, "digest": "",
        "details": {
            "parent_model": "", "format": "gguf", "family": "qwen3", "families": ["qwen3"],
            "parameter_size": card.parameter_size, "quantization_level": card.quantization,
        },
    })
}

pub async fn generate(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: GenerateRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    if let Err(e) = refuse_format(&req.format) {
        return error(e);
    }
    let stream = req.stream.unwrap_or(true);
    if req.prompt.is_empty() {
        // ollama's way to load a model: nothing to generate.
        return Json(
            json!({"model": state.model, "created_at": now_rfc3339(), "response": "",
                           "done": true, "done_reason": "load"}),
        )
        .into_response();
    }
    let input = if req.raw {
        JobInput::Text(req.prompt)
    } else {
        let mut messages = Vec::new();
        if let Some(s) = req.system.as_deref().filter(|s| !s.is_empty()) {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", &req.prompt));
        JobInput::Chat(messages)
    };
    // An empty suffix is none, as in ollama.
    let template = req
        .suffix
        .filter(|s| !s.is_empty())
        .map(|s| FillSpec::new(FillSource::Suffix(s), "suffix"));
    let job = Job { input, template };
    answer(
        state,
        job,
        &req.options,
        stream,
        |text| json!({"response": text}),
    )
    .await
}

pub async fn chat(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: ChatRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    if let Err(e) = refuse_format(&req.format) {
        return error(e);
    }
    let stream = req.stream.unwrap_or(true);
    if req.messages.is_empty() {
        return Json(json!({"model": state.model, "created_at": now_rfc3339(),
                           "message": {"role": "assistant", "content": ""},
                           "done": true, "done_reason": "load"}))
        .into_response();
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
            return error(ApiError::bad_request(format!("unknown role '{}'", m.role)));
        }
        match m.content.text() {
            Ok(t) => messages.push(Message::new(&m.role, &t)),
            Err(e) => return error(e),
        }
    }
    let piece = |text: &str| json!({"message": {"role": "assistant", "content": text}});
    let job = Job {
        input: JobInput::Chat(messages),
        template: None,
    };
    answer(state, job, &req.options, stream, piece).await
}

/// What to answer: the prompt, and gaps to fill after it.
struct Job {
    input: JobInput,
    template: Option<FillSpec>,
}

/// Runs the job and answers in ollama's shapes: `piece(text)` holds the text of one object.
async fn answer(
    state: Arc<AppState>,
    job: Job,
    options: &Options,
    stream: bool,
    piece: fn(&str) -> Value,
) -> Response {
    let knobs = match options.knobs(stream) {
        Ok(k) => k,
        Err(e) => return error(e),
    };
    let start = Instant::now();
    let (rx, guard, _) = match submit(&state, job.input, knobs, job.template).await {
        Ok(s) => s,
        Err(e) => return error(e),
    };
    let model = state.model.clone();
    let object = move |mut v: Value, done: bool| {
        v["model"] = json!(model);
        v["created_at"] = json!(now_rfc3339());
        v["done"] = json!(done);
        v
    };
    let finish = move |mut v: Value, reason: &str, p: usize, c: usize, took: Duration| {
        let ns = took.as_nanos() as u64;
        v["done_reason"] = json!(reason);
        v["total_duration"] = json!(ns);
        v["load_duration"] = json!(0);
        v["prompt_eval_count"] = json!(p);
        v["eval_count"] = json!(c);
        v["eval_duration"] = json!(ns);
        v
    };
    if !stream {
        return match collect(rx).await {
            Ok(got) => {
                drop(guard);
                let (p, c) = (got.prompt_tokens, got.completion_tokens);
                let v = finish(
                    object(piece(&got.text), true),
                    got.finish_reason,
                    p,
                    c,
                    start.elapsed(),
                );
                Json(v).into_response()
            }
            Err(e) => error(e),
        };
    }
    let lines = UnboundedReceiverStream::new(rx).filter_map(move |msg| {
        let _keep = &guard;
        let v = match msg {
            // With a suffix, the gap's fill is the response.
            Msg::Delta(d) | Msg::Fill { text: d, .. } => object(piece(&d), false),
            Msg::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                ..
            } => finish(
                object(piece(""), true),
                finish_reason,
                prompt_tokens,
                completion_tokens,
                start.elapsed(),
            ),
            Msg::Error(e) => json!({"error": e.message}),
            Msg::Started { .. } | Msg::Step(_) | Msg::End => return None,
        };
        Some(Ok::<_, std::convert::Infallible>(Bytes::from(format!(
            "{v}\n"
        ))))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(lines))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
