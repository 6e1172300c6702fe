//! `refusion serve`: an OpenAI-compatible HTTP server (axum on tokio).
//!
//! Requests are parsed and checked here, then queued (bounded: a full queue is a 503) for the
//! worker thread, which streams back the contiguous committed prefix of the answer as it grows.
//! A client that disconnects cancels its generation.

pub mod api;
pub mod worker;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use self::api::{parse, ApiError, ChatRequest, CompletionRequest, PromptField};
use self::worker::{Job, JobInput, Limits, Msg};
use crate::chat::Message;
use crate::error::{Error, Result};
use crate::runtime::Loaded;

pub struct ServerConfig {
    pub host: IpAddr,
    pub port: u16,
    pub api_key: Option<String>,
    pub queue: usize,
    pub max_body_bytes: usize,
    pub model_name: String,
}

struct AppState {
    jobs: SyncSender<Job>,
    model: String,
    api_key: Option<String>,
    queue: usize,
    next_id: AtomicU64,
}

/// Sets the job's cancel flag when dropped: the response (or its stream) went away.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn check_auth(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if given == key {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "missing or wrong API key",
        ))
    }
}

fn body_bytes(body: std::result::Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "the request body is too large",
            )
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"))
        }
    })
}

/// Queues a job and waits until it starts (or fails before producing anything).
async fn submit(
    state: &AppState,
    input: JobInput,
    knobs: api::Knobs,
) -> Result<(UnboundedReceiver<Msg>, CancelOnDrop, usize), ApiError> {
    let (tx, mut rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let guard = CancelOnDrop(cancel.clone());
    match state.jobs.try_send(Job {
        input,
        knobs,
        cancel,
        tx,
    }) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_busy",
                format!(
                    "the server is busy ({} requests queued); retry later",
                    state.queue
                ),
            ))
        }
        Err(TrySendError::Disconnected(_)) => {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "the model worker stopped",
            ))
        }
    }
    match rx.recv().await {
        Some(Msg::Started { prompt_tokens }) => Ok((rx, guard, prompt_tokens)),
        Some(Msg::Error(e)) => Err(e),
        _ => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "generation ended early",
        )),
    }
}

/// Collects a non-streamed answer.
async fn collect(
    mut rx: UnboundedReceiver<Msg>,
) -> Result<(String, &'static str, usize, usize), ApiError> {
    let mut text = String::new();
    while let Some(msg) = rx.recv().await {
        match msg {
            Msg::Delta(d) => text.push_str(&d),
            Msg::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => return Ok((text, finish_reason, prompt_tokens, completion_tokens)),
            Msg::Error(e) => return Err(e),
            Msg::Started { .. } | Msg::End => {}
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "generation ended early",
    ))
}

fn usage(p: usize, c: usize) -> serde_json::Value {
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    match chat_inner(&state, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    check_auth(state, headers)?;
    let req: ChatRequest = parse(&body_bytes(body)?)?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty").param("messages"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
            return Err(
                ApiError::bad_request(format!("unknown role '{}'", m.role)).param("messages")
            );
        }
        messages.push(Message::new(&m.role, &m.content.text()?));
    }
    let stream = req.knobs.stream;
    let (rx, guard, _) = submit(state, JobInput::Chat(messages), req.knobs).await?;
    let id = format!("chatcmpl-{}", state.next_id.fetch_add(1, Ordering::Relaxed));
    let created = now();
    let model = state.model.clone();
    if !stream {
        let (text, finish_reason, p, c) = collect(rx).await?;
        drop(guard);
        return Ok(Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
            "usage": usage(p, c),
        }))
        .into_response());
    }
    let chunk = move |delta: serde_json::Value, finish: Option<&str>| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        .to_string()
    };
    let first = SseEvent::default().data(chunk(json!({"role": "assistant", "content": ""}), None));
    let events = UnboundedReceiverStream::new(rx).filter_map(move |msg| {
        let _keep = &guard;
        match msg {
            Msg::Delta(d) => Some(SseEvent::default().data(chunk(json!({"content": d}), None))),
            Msg::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let mut v: serde_json::Value =
                    serde_json::from_str(&chunk(json!({}), Some(finish_reason))).ok()?;
                v["usage"] = usage(prompt_tokens, completion_tokens);
                Some(SseEvent::default().data(v.to_string()))
            }
            Msg::End => Some(SseEvent::default().data("[DONE]")),
            Msg::Error(e) => Some(SseEvent::default().data(e.body().to_string())),
            Msg::Started { .. } => None,
        }
    });
    let all = tokio_stream::once(first)
        .chain(events)
        .map(Ok::<_, std::convert::Infallible>);
    Ok(Sse::new(all)
        .keep_alive(KeepAlive::default())
        .into_response())
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    match completions_inner(&state, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    check_auth(state, headers)?;
    let req: CompletionRequest = parse(&body_bytes(body)?)?;
    let prompt = match req.prompt {
        PromptField::One(s) => s,
        PromptField::Many(v) if v.len() == 1 => v.into_iter().next().unwrap_or_default(),
        PromptField::Many(_) => {
            return Err(
                ApiError::bad_request("exactly one prompt per request is supported")
                    .param("prompt"),
            )
        }
    };
    let stream = req.knobs.stream;
    let (rx, guard, _) = submit(state, JobInput::Text(prompt), req.knobs).await?;
    let id = format!("cmpl-{}", state.next_id.fetch_add(1, Ordering::Relaxed));
    let created = now();
    let model = state.model.clone();
    if !stream {
        let (text, finish_reason, p, c) = collect(rx).await?;
        drop(guard);
        return Ok(Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": null}],
            "usage": usage(p, c),
        }))
        .into_response());
    }
    let chunk = move |text: &str, finish: Option<&str>| {
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": null}]})
        .to_string()
    };
    let events = UnboundedReceiverStream::new(rx).filter_map(move |msg| {
        let _keep = &guard;
        match msg {
            Msg::Delta(d) => Some(SseEvent::default().data(chunk(&d, None))),
            Msg::Done { finish_reason, .. } => {
                Some(SseEvent::default().data(chunk("", Some(finish_reason))))
            }
            Msg::End => Some(SseEvent::default().data("[DONE]")),
            Msg::Error(e) => Some(SseEvent::default().data(e.body().to_string())),
            Msg::Started { .. } => None,
        }
    });
    Ok(Sse::new(events.map(Ok::<_, std::convert::Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response())
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = check_auth(&state, &headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [{"id": state.model, "object": "model", "created": 0, "owned_by": "refusion"}]}))
        .into_response()
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn not_found() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "unknown endpoint",
    )
    .into_response()
}

/// Runs the server until Ctrl-C or SIGTERM.
pub fn serve(loaded: Loaded, limits: Limits, cfg: ServerConfig) -> Result<()> {
    if !cfg.host.is_loopback() && cfg.api_key.is_none() {
        return Err(Error::msg(format!(
            "binding to {} exposes the server beyond this machine: pass --api-key (or bind 127.0.0.1)",
            cfg.host
        )));
    }
    let (jobs_tx, jobs_rx) = sync_channel::<Job>(cfg.queue);
    let worker = std::thread::Builder::new()
        .name("refusion-worker".into())
        .spawn(move || worker::run(loaded, limits, jobs_rx))
        .map_err(|e| Error::msg(format!("cannot start the worker: {e}")))?;
    let state = Arc::new(AppState {
        jobs: jobs_tx,
        model: cfg.model_name.clone(),
        api_key: cfg.api_key.clone(),
        queue: cfg.queue,
        next_id: AtomicU64::new(1),
    });
    let app = Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(cfg.max_body_bytes))
        .with_state(state);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::msg(format!("cannot start the async runtime: {e}")))?;
    let addr = SocketAddr::new(cfg.host, cfg.port);
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Error::msg(format!("cannot listen on {addr}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::msg(e.to_string()))?;
        eprintln!(
            "refusion serve: listening on http://{local} (model '{}')",
            cfg.model_name
        );
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let ctrl_c = tokio::signal::ctrl_c();
                #[cfg(unix)]
                {
                    let mut term = match tokio::signal::unix::signal(
                        tokio::signal::unix::SignalKind::terminate(),
                    ) {
                        Ok(t) => t,
                        Err(_) => {
                            let _ = ctrl_c.await;
                            return;
                        }
                    };
                    tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
                }
                #[cfg(not(unix))]
                let _ = ctrl_c.await;
            })
            .await
            .map_err(|e| Error::msg(format!("server error: {e}")))
    })?;
    drop(worker);
    eprintln!("refusion serve: stopped");
    Ok(())
}
