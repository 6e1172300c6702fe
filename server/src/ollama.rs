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

use super::api::{
    parse, refuse_images, refuse_think, ApiError, ChatMessage, Knobs, Sampling, Stop,
};
use super::fill::{FillSource, FillSpec};
use super::jobs::{collect, submit};
use crate::jobs::Msg;
use crate::prepare::JobInput;
use crate::AppState;
use refusion_engine::chat::Message;
use refusion_engine::constrain::Format;

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
    /// The file's metadata but its arrays (ollama's `model_info`).
    pub model_info: serde_json::Map<String, Value>,
    /// The chat template.
    pub template: String,
}

/// A GGUF metadata value as JSON (arrays are left out, as ollama leaves them out unasked).
fn info_value(v: &refusion_gguf::Value) -> Option<Value> {
    use refusion_gguf::Value as V;
    Some(match v {
        V::U8(x) => json!(x),
        V::I8(x) => json!(x),
        V::U16(x) => json!(x),
        V::I16(x) => json!(x),
        V::U32(x) => json!(x),
        V::I32(x) => json!(x),
        V::U64(x) => json!(x),
        V::I64(x) => json!(x),
        V::F32(x) => json!(refusion_engine::decode::shortest_f64(*x)),
        V::F64(x) => json!(x),
        V::Bool(x) => json!(x),
        V::String(x) => json!(x),
        V::Array(..) => return None,
    })
}

/// ollama's `options`: the ones slot decoding honours; others are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
struct Options {
    temperature: Option<f64>,
    seed: Option<u64>,
    /// Most new tokens; -1 (and -2) mean no limit but the context.
    num_predict: Option<i64>,
    stop: Option<Stop>,
    /// ollama's sampler options (`top_k`, `top_p`, `min_p`, `typical_p`, `repeat_penalty`,
    /// `presence_penalty`, `frequency_penalty`, `mirostat`) follow the OpenAI endpoints' rule
    /// ([`Sampling`]): a filter is accepted at temperature 0 (greedy), where it changes
    /// nothing, and refused by name above it; a penalty is refused at any value but its
    /// neutral one.
    #[serde(flatten)]
    sampling: Sampling,
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
    /// Structured output: `"json"` or a JSON Schema ([`format_of`]).
    format: Option<serde_json::Value>,
    /// Refused when given ([`refuse_images`], [`refuse_think`]).
    images: Option<Value>,
    think: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
struct ChatRequest {
    #[serde(default)]
    messages: Vec<ChatMessage>,
    stream: Option<bool>,
    #[serde(default)]
    options: Options,
    format: Option<serde_json::Value>,
    /// Functions the model may call (OpenAI's list); their calls come back in the message.
    tools: Option<Value>,
    think: Option<Value>,
}

/// ollama's `format`: `"json"` (any JSON object) or a JSON Schema; `""` or `null` is none.
fn format_of(format: &Option<serde_json::Value>) -> Result<Option<Format>, ApiError> {
    match format {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(Some(Format::Json)),
        Some(v @ Value::Object(_)) => Ok(Some(Format::JsonSchema(v.clone()))),
        Some(_) => Err(
            ApiError::bad_request("format must be \"json\" or a JSON Schema object")
                .param("format"),
        ),
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
        let template = h
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string();
        let mut model_info: serde_json::Map<String, Value> = h
            .metadata
            .iter()
            .filter(|(k, _)| k != "tokenizer.chat_template")
            .filter_map(|(k, v)| Some((k.clone(), info_value(v)?)))
            .collect();
        model_info.insert("general.parameter_count".into(), json!(params));
        ModelCard {
            size: file.file_len(),
            quantization,
            parameter_size,
            modified,
            model_info,
            template,
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
            sampling: self.sampling.clone(),
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
    let card = &state.card;
    // The defaults a request starts from, as a Modelfile's PARAMETER lines.
    let settings = &state.props["default_generation_settings"];
    let mut parameters = String::new();
    let mut line = |name: &str, v: &Value| {
        if !v.is_null() {
            parameters.push_str(&format!("{name:<16}{v}\n"));
        }
    };
    line("num_ctx", &settings["n_ctx"]);
    for (name, key) in [
        ("num_predict", "n_predict"),
        ("temperature", "temperature"),
        ("seed", "seed"),
        ("slot_size", "slot_size"),
        ("serial_blocks", "serial_blocks"),
        ("slot_threshold", "slot_threshold"),
        ("token_threshold", "token_threshold"),
    ] {
        line(name, &settings["params"][key]);
    }
    let mut capabilities = vec!["completion", "insert"];
    if card.template.contains("tools") {
        capabilities.push("tools");
    }
    let modelfile = format!(
        "FROM {}\nTEMPLATE {:?}\n{}",
        state.model,
        card.template,
        parameters
            .lines()
            .map(|l| format!("PARAMETER {l}\n"))
            .collect::<String>()
    );
    Json(json!({
        "modelfile": modelfile, "parameters": parameters, "template": card.template,
        "details": m["details"], "model_info": card.model_info,
        "capabilities": capabilities, "modified_at": m["modified_at"],
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
    let format = match format_of(&req.format)
        .and_then(|f| refuse_images(&req.images).map(|()| f))
        .and_then(|f| refuse_think(&req.think).map(|()| f))
    {
        Ok(f) => f,
        Err(e) => return error(e),
    };
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
        JobInput::Chat {
            messages,
            tools: None,
        }
    };
    // An empty suffix is none, as in ollama.
    let template = req
        .suffix
        .filter(|s| !s.is_empty())
        .map(|s| FillSpec::new(FillSource::Suffix(s), "suffix"));
    let job = Job {
        input,
        template,
        format,
        read_calls: false,
        calls: None,
    };
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
    let format = match format_of(&req.format).and_then(|f| refuse_think(&req.think).map(|()| f)) {
        Ok(f) => f,
        Err(e) => return error(e),
    };
    // ollama has no tool_choice: the model calls a tool or answers.
    let plan = match crate::tools::plan(req.tools.as_ref(), None, None) {
        Ok(p) => p,
        Err(e) => return error(e),
    };
    let stream = req.stream.unwrap_or(true);
    if req.messages.is_empty() {
        return Json(json!({"model": state.model, "created_at": now_rfc3339(),
                           "message": {"role": "assistant", "content": ""},
                           "done": true, "done_reason": "load"}))
        .into_response();
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        match m.message() {
            Ok(m) => messages.push(m),
            Err(e) => return error(e),
        }
    }
    let piece = |text: &str| json!({"message": {"role": "assistant", "content": text}});
    let job = Job {
        input: JobInput::Chat {
            messages,
            tools: plan.tools,
        },
        template: None,
        format,
        read_calls: plan.read_calls,
        calls: plan.calls,
    };
    answer(state, job, &req.options, stream, piece).await
}

/// What to answer: the prompt, and gaps to fill after it.
struct Job {
    input: JobInput,
    template: Option<FillSpec>,
    /// The format the answer must follow (`format`).
    format: Option<Format>,
    /// Read tool calls out of the answer into the message's `tool_calls`.
    read_calls: bool,
    /// The tools' grammar, held from where the model opens a call.
    calls: Option<Format>,
}

/// Runs the job and answers in ollama's shapes: `piece(text)` holds the text of one object.
async fn answer(
    state: Arc<AppState>,
    job: Job,
    options: &Options,
    stream: bool,
    piece: fn(&str) -> Value,
) -> Response {
    let mut knobs = match options.knobs(stream) {
        Ok(k) => k,
        Err(e) => return error(e),
    };
    knobs.forced = job.format.map(|f| (f, "format"));
    knobs.calls = job.calls;
    let read_calls = job.read_calls;
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
                let mut body = piece(&got.text);
                if read_calls {
                    match crate::tools::read(&got.text, got.finish_reason == "length") {
                        Ok(parsed) if !parsed.calls.is_empty() => {
                            body = piece(&parsed.content);
                            body["message"]["tool_calls"] =
                                crate::tools::ollama_calls(&parsed.calls);
                        }
                        Ok(_) => {}
                        Err(e) => return error(e),
                    }
                }
                let v = finish(object(body, true), got.finish_reason, p, c, start.elapsed());
                Json(v).into_response()
            }
            Err(e) => error(e),
        };
    }
    let mut watch = read_calls.then(crate::tools::CallWatch::default);
    let lines = UnboundedReceiverStream::new(rx).filter_map(move |msg| {
        let _keep = &guard;
        let v = match msg {
            // With a suffix, the gap's fill is the response.
            Msg::Delta(d) | Msg::Fill { text: d, .. } => {
                let d = match watch.as_mut() {
                    Some(w) => w.push(&d),
                    None => d,
                };
                if d.is_empty() {
                    return None;
                }
                object(piece(&d), false)
            }
            Msg::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                // The calls (or the text held back for nothing) come with the last object.
                let mut body = piece("");
                if let Some(w) = &watch {
                    match w.finish(finish_reason == "length") {
                        Ok((_, calls)) if !calls.is_empty() => {
                            body["message"]["tool_calls"] = crate::tools::ollama_calls(&calls);
                        }
                        Ok((rest, _)) => body = piece(&rest),
                        Err(e) => body = json!({"error": e.message}),
                    }
                }
                finish(
                    object(body, true),
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                    start.elapsed(),
                )
            }
            Msg::Error(e) => json!({"error": e.message}),
            Msg::Started { .. } | Msg::Step(_) | Msg::Scores(_) | Msg::End => return None,
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
