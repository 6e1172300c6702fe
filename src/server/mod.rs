//! `refusion serve`: an OpenAI-compatible HTTP server (axum on tokio).
//!
//! Requests are parsed and checked here, then queued (bounded: a full queue is a 503) for the
//! worker thread, which streams back the contiguous committed prefix of the answer as it grows.
//! A client that disconnects cancels its generation. Connections (timeouts, the cap, the drain
//! at shutdown) are [`conn`]'s job.

pub mod api;
mod body;
mod conn;
mod llama;
mod ollama;
mod signals;
pub mod worker;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use self::api::{parse_with_knobs, ApiError, ChatRequest, CompletionRequest, PromptField};
use self::body::{discard_body, read_body, BodyLimits};
pub use self::conn::ConnLimits;
use self::signals::Signals;
use self::worker::{Job, JobInput, Limits, Load, Msg, Shutdown};
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
    pub conn: ConnLimits,
}

struct AppState {
    jobs: SyncSender<Job>,
    model: String,
    api_key: Option<String>,
    queue: usize,
    next_id: AtomicU64,
    body: BodyLimits,
    /// What ollama's `/api/tags` tells about the model.
    card: ollama::ModelCard,
    /// For `/tokenize` and `/detokenize` (shared with the worker).
    tokenizer: Arc<crate::chat::Tokenizer>,
    /// The model's embedding rows.
    vocab: usize,
    /// llama-server's `/props`.
    props: serde_json::Value,
    /// The scheduler's counters, as of its last step.
    load: Load,
    parallel: usize,
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

/// Middleware, outermost: every route but `/health` needs the key when one is set, checked
/// before the body is read.
async fn require_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if req.uri().path() != "/health" {
        if let Err(e) = check_key(state.api_key.as_deref(), req.headers()) {
            // The body is read and dropped (bounded), not kept: the client gets its 401
            // instead of a reset from a close with its upload unread.
            discard_body(req, state.body).await;
            return e.into_response();
        }
    }
    next.run(req).await
}

/// `Authorization: Bearer KEY` against the server's key (if it has one): 401 when missing or
/// wrong.
fn check_key(key: Option<&str>, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = key else {
        return Ok(());
    };
    let unauthorized = |why: &str| {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            format!("{why}: send the header 'Authorization: Bearer <API key>'"),
        ))
    };
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return unauthorized("missing API key");
    };
    // The scheme is case-insensitive (RFC 9110); a missing header is never an empty key.
    let given = value.as_bytes();
    let token = match given.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => &given[7..],
        _ => return unauthorized("wrong API key"),
    };
    if !key.is_empty() && constant_time_eq(token, key.as_bytes()) {
        Ok(())
    } else {
        unauthorized("wrong API key")
    }
}

/// Compares without an early exit, so the time taken does not tell how much of a guess matched.
/// (The length may show; the content does not.)
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// 405 in the API's error format, with the `Allow` header.
fn method_not_allowed(
    allow: &'static str,
) -> impl Fn(Method) -> std::future::Ready<Response> + Clone {
    move |method: Method| {
        let mut r = ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("method {method} is not allowed here; use {allow}"),
        )
        .into_response();
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allow));
        std::future::ready(r)
    }
}

/// Queues a job (a full queue is a 503).
fn enqueue(
    state: &AppState,
    input: JobInput,
    knobs: api::Knobs,
) -> Result<(UnboundedReceiver<Msg>, CancelOnDrop), ApiError> {
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let guard = CancelOnDrop(cancel.clone());
    // Counted before it is sent: the worker counts it down when it takes it.
    state.load.queued.fetch_add(1, Ordering::SeqCst);
    let sent = state.jobs.try_send(Job {
        input,
        knobs,
        cancel,
        tx,
    });
    if sent.is_err() {
        state.load.queued.fetch_sub(1, Ordering::SeqCst);
    }
    match sent {
        Ok(()) => Ok((rx, guard)),
        Err(TrySendError::Full(_)) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_busy",
            format!(
                "the server is busy ({} requests queued); retry later",
                state.queue
            ),
        )),
        Err(TrySendError::Disconnected(_)) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the model worker stopped",
        )),
    }
}

/// Waits until a queued job starts (or fails before producing anything).
async fn started(rx: &mut UnboundedReceiver<Msg>) -> Result<usize, ApiError> {
    match rx.recv().await {
        Some(Msg::Started { prompt_tokens }) => Ok(prompt_tokens),
        Some(Msg::Error(e)) => Err(e),
        _ => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "generation ended early",
        )),
    }
}

/// Queues a job and waits until it starts (or fails before producing anything).
async fn submit(
    state: &AppState,
    input: JobInput,
    knobs: api::Knobs,
) -> Result<(UnboundedReceiver<Msg>, CancelOnDrop, usize), ApiError> {
    let (mut rx, guard) = enqueue(state, input, knobs)?;
    let prompt_tokens = started(&mut rx).await?;
    Ok((rx, guard, prompt_tokens))
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

/// The end of a stream. Without `stream_options.include_usage`: `[DONE]`. With it (OpenAI's
/// convention): one more chunk, with no choices and the usage, then `[DONE]` (chained after
/// the stream by [`UsageTail::last`], as one message cannot make two events).
struct UsageTail {
    include: bool,
    chunk: Option<serde_json::Value>,
}

impl UsageTail {
    fn new(include: bool) -> UsageTail {
        UsageTail {
            include,
            chunk: None,
        }
    }

    /// The finishing chunk `last` went out: the usage chunk copies its id, object and model.
    fn done(&mut self, last: &serde_json::Value, prompt: usize, completion: usize) {
        if self.include {
            let mut v = last.clone();
            v["choices"] = json!([]);
            v["usage"] = usage(prompt, completion);
            self.chunk = Some(v);
        }
    }

    /// The event for the worker's `End`.
    fn end(&mut self) -> Option<SseEvent> {
        match (self.include, self.chunk.take()) {
            (false, _) => Some(SseEvent::default().data("[DONE]")),
            (true, chunk) => chunk.map(|v| SseEvent::default().data(v.to_string())),
        }
    }

    /// What follows the stream: `[DONE]` when the usage chunk took `End`'s place.
    fn last(include: bool) -> Option<SseEvent> {
        include.then(|| SseEvent::default().data("[DONE]"))
    }
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match chat_inner(&state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(state: &Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_with_knobs(&body)?;
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
    let include_usage = req
        .knobs
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
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
    let mut tail = UsageTail::new(include_usage);
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
                tail.done(&v, prompt_tokens, completion_tokens);
                Some(SseEvent::default().data(v.to_string()))
            }
            Msg::End => tail.end(),
            Msg::Error(e) => Some(SseEvent::default().data(e.body().to_string())),
            Msg::Started { .. } => None,
        }
    });
    let all = tokio_stream::once(first)
        .chain(events)
        .chain(tokio_stream::iter(UsageTail::last(include_usage)))
        .map(Ok::<_, std::convert::Infallible>);
    Ok(Sse::new(all)
        .keep_alive(KeepAlive::default())
        .into_response())
}

async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match completions_inner(&state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(state: &Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_with_knobs(&body)?;
    // OpenAI's prompt: a string, token ids, or a list of either (one choice each, in order).
    let inputs: Vec<JobInput> = match req.prompt {
        PromptField::One(s) => vec![JobInput::Text(s)],
        PromptField::Many(v) => v.into_iter().map(JobInput::Text).collect(),
        PromptField::Tokens(ids) => vec![JobInput::Tokens(ids)],
        PromptField::TokenLists(v) => v.into_iter().map(JobInput::Tokens).collect(),
    };
    if inputs.is_empty() {
        return Err(ApiError::bad_request("prompt must not be an empty list").param("prompt"));
    }
    if inputs.len() > state.queue {
        return Err(ApiError::bad_request(format!(
            "at most {} prompts per request (the queue's size), got {}",
            state.queue,
            inputs.len()
        ))
        .param("prompt"));
    }
    let stream = req.knobs.stream;
    let include_usage = req
        .knobs
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    // All queued first (they decode together), then each waited for.
    let mut queued = Vec::with_capacity(inputs.len());
    for input in inputs {
        queued.push(enqueue(state, input, req.knobs.clone())?);
    }
    let mut streams = Vec::with_capacity(queued.len());
    for (mut rx, guard) in queued {
        started(&mut rx).await?;
        streams.push((rx, guard));
    }
    let id = format!("cmpl-{}", state.next_id.fetch_add(1, Ordering::Relaxed));
    let created = now();
    let model = state.model.clone();
    if !stream {
        let (mut choices, mut p, mut c) = (Vec::new(), 0, 0);
        for (index, (rx, guard)) in streams.into_iter().enumerate() {
            let (text, finish_reason, pt, ct) = collect(rx).await?;
            drop(guard);
            choices.push(json!({"index": index, "text": text, "finish_reason": finish_reason, "logprobs": null}));
            (p, c) = (p + pt, c + ct);
        }
        return Ok(Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": choices,
            "usage": usage(p, c),
        }))
        .into_response());
    }
    let n = streams.len();
    let chunk = move |index: usize, text: &str, finish: Option<&str>| {
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": null}]})
    };
    let mut merged = tokio_stream::StreamMap::new();
    let mut guards = Vec::with_capacity(n);
    for (index, (rx, guard)) in streams.into_iter().enumerate() {
        merged.insert(index, UnboundedReceiverStream::new(rx));
        guards.push(guard);
    }
    let mut tail = UsageTail::new(include_usage);
    let (mut ended, mut p, mut c) = (0, 0, 0);
    let events = merged.filter_map(move |(index, msg)| {
        let _keep = &guards;
        match msg {
            Msg::Delta(d) => Some(SseEvent::default().data(chunk(index, &d, None).to_string())),
            Msg::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let v = chunk(index, "", Some(finish_reason));
                (p, c) = (p + prompt_tokens, c + completion_tokens);
                tail.done(&v, p, c);
                Some(SseEvent::default().data(v.to_string()))
            }
            // The stream's end (the usage chunk or [DONE]) once every prompt's has ended.
            Msg::End => {
                ended += 1;
                (ended == n).then(|| tail.end()).flatten()
            }
            Msg::Error(e) => Some(SseEvent::default().data(e.body().to_string())),
            Msg::Started { .. } => None,
        }
    });
    let events = events.chain(tokio_stream::iter(UsageTail::last(include_usage)));
    Ok(Sse::new(events.map(Ok::<_, std::convert::Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response())
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [{"id": state.model, "object": "model", "created": 0, "owned_by": "refusion"}]}))
        .into_response()
}

/// llama-server's `/health`, with the load: requests decoding, waiting, and the slots free.
async fn health(State(state): State<Arc<AppState>>) -> Response {
    let st = state.load.stats();
    let queued = state.load.queued.load(Ordering::SeqCst);
    Json(json!({
        "status": "ok",
        "slots_processing": st.running,
        "slots_idle": state.parallel.saturating_sub(st.running),
        "requests_waiting": st.waiting + queued,
    }))
    .into_response()
}

/// Prometheus' text format: requests, tokens, the queue, the batch, the KV cache.
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let st = state.load.stats();
    let queued = state.load.queued.load(Ordering::SeqCst);
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: String| {
        out.push_str(&format!(
            "# HELP refusion_{name} {help}\n# TYPE refusion_{name} {kind}\nrefusion_{name} {value}\n"
        ));
    };
    metric(
        "requests_finished_total",
        "counter",
        "Requests answered in full.",
        st.requests_finished.to_string(),
    );
    metric(
        "requests_cancelled_total",
        "counter",
        "Requests cancelled (client gone, stop string, shutdown).",
        st.requests_cancelled.to_string(),
    );
    metric(
        "requests_failed_total",
        "counter",
        "Requests that failed after being queued.",
        st.requests_failed.to_string(),
    );
    metric(
        "tokens_generated_total",
        "counter",
        "Answer tokens generated.",
        st.tokens_generated.to_string(),
    );
    metric(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens of admitted requests.",
        st.prompt_tokens.to_string(),
    );
    metric(
        "prompt_tokens_cached_total",
        "counter",
        "Prompt tokens taken from cached prompts.",
        st.prompt_tokens_reused.to_string(),
    );
    metric(
        "forwards_total",
        "counter",
        "Forward calls (each serving every running request).",
        st.forwards.to_string(),
    );
    metric(
        "forward_tokens_total",
        "counter",
        "Tokens fed through the model.",
        st.forward_tokens.to_string(),
    );
    metric(
        "forward_logit_rows_total",
        "counter",
        "Rows of logits computed (each a product with the whole output layer).",
        st.forward_logit_rows.to_string(),
    );
    metric(
        "forward_seconds_total",
        "counter",
        "Seconds spent in forwards.",
        format!("{:.6}", st.forward_seconds),
    );
    metric(
        "feed_seconds_total",
        "counter",
        "Seconds spent handing the forwards' logits to the decoders (argmax, probabilities).",
        format!("{:.6}", st.feed_seconds),
    );
    metric(
        "requests_running",
        "gauge",
        "Requests decoding now.",
        st.running.to_string(),
    );
    metric(
        "requests_waiting",
        "gauge",
        "Requests waiting for room in the scheduler or the queue.",
        (st.waiting + queued).to_string(),
    );
    metric(
        "batch_tokens",
        "gauge",
        "Tokens in the last forward.",
        st.last_batch_tokens.to_string(),
    );
    metric(
        "batch_requests",
        "gauge",
        "Requests served by the last forward.",
        st.last_batch_requests.to_string(),
    );
    metric(
        "kv_entries_used",
        "gauge",
        "KV cache entries in use (sequences and cached prompts).",
        st.kv_used.to_string(),
    );
    metric(
        "kv_entries",
        "gauge",
        "KV cache entries in all.",
        st.kv_capacity.to_string(),
    );
    metric(
        "cached_prompts",
        "gauge",
        "Prompts kept for reuse.",
        st.cached_prompts.to_string(),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

async fn not_found() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "unknown endpoint",
    )
    .into_response()
}

/// Refuses an empty API key (it would match nothing sent, or look like protection while being
/// none) and an address beyond loopback without a key. Called before the model loads.
pub fn check_access(host: IpAddr, api_key: Option<&str>) -> Result<()> {
    if api_key.is_some_and(|k| k.is_empty()) {
        return Err(Error::msg(
            "--api-key must not be empty: pass a secret, or leave the flag out on loopback",
        ));
    }
    // HTTP trims spaces around header values and carries only visible ASCII in a bearer token:
    // such a key could never be matched.
    if api_key.is_some_and(|k| !k.bytes().all(|b| b.is_ascii_graphic())) {
        return Err(Error::msg(
            "--api-key must be visible ASCII characters only (no spaces or control characters)",
        ));
    }
    if !host.is_loopback() && api_key.is_none() {
        return Err(Error::msg(format!(
            "binding to {host} exposes the server beyond this machine: pass --api-key (or bind 127.0.0.1)"
        )));
    }
    Ok(())
}

/// Runs the server until Ctrl-C or SIGTERM. The first signal stops accepting, cancels the
/// generation in progress and the queued requests (they get 503), closes connections with
/// nothing in flight and gives responses in flight until `--shutdown-timeout` after it, by
/// which time the worker must have stopped too; then it returns. A second signal exits the
/// process at once (code 130).
pub fn serve(loaded: Loaded, limits: Limits, cfg: ServerConfig) -> Result<()> {
    check_access(cfg.host, cfg.api_key.as_deref())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::msg(format!("cannot start the async runtime: {e}")))?;
    let addr = SocketAddr::new(cfg.host, cfg.port);
    let (listener, signals) = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Error::msg(format!("cannot listen on {addr}: {e}")))?;
        Ok::<_, Error>((listener, Signals::new()?))
    })?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::msg(e.to_string()))?;

    let card = ollama::ModelCard::of(&loaded.file);
    let tokenizer = loaded.tokenizer.clone();
    let vocab = crate::model::Forward::config(&loaded.model).vocab;
    let props = props(&loaded, &limits);
    let shutdown = Arc::new(Shutdown::default());
    let (jobs_tx, jobs_rx) = sync_channel::<Job>(cfg.queue);
    let worker_shutdown = shutdown.clone();
    let load = Load::default();
    let worker_load = load.clone();
    let parallel = limits.parallel;
    let worker = std::thread::Builder::new()
        .name("refusion-worker".into())
        .spawn(move || worker::run(loaded, limits, jobs_rx, &worker_shutdown, &worker_load))
        .map_err(|e| Error::msg(format!("cannot start the worker: {e}")))?;
    let body = BodyLimits {
        max_bytes: cfg.max_body_bytes,
        timeout: cfg.conn.body,
    };
    let app = router(AppState {
        jobs: jobs_tx,
        model: cfg.model_name.clone(),
        api_key: cfg.api_key.clone(),
        queue: cfg.queue,
        next_id: AtomicU64::new(1),
        body,
        card,
        tokenizer,
        vocab,
        props,
        load,
        parallel,
    });
    eprintln!(
        "refusion serve: listening on http://{local} (model '{}')",
        cfg.model_name
    );
    rt.block_on(async move {
        let stop = first_signal(signals, shutdown, cfg.conn.grace);
        let (deadline, left) = conn::run(listener, app, cfg.conn, stop).await;
        if left > 0 {
            eprintln!("refusion serve: closed {left} connection(s) still open at the deadline");
        }
        // The router, and with it the job queue's sender, is gone: the worker ends after its
        // current job, which was cancelled. Waited for here, on the runtime, so that the
        // second-signal task still runs.
        while !worker.is_finished() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        if !worker.is_finished() {
            eprintln!(
                "refusion serve: the generation did not stop by the deadline; exiting anyway"
            );
        }
    });
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    eprintln!("refusion serve: stopped");
    Ok(())
}

/// llama-server's `/props`: the defaults a request starts from, the context, the template.
fn props(loaded: &Loaded, limits: &Limits) -> serde_json::Value {
    let b = &limits.base;
    let template = loaded
        .file
        .header
        .get("tokenizer.chat_template")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    json!({
        "default_generation_settings": {
            "n_ctx": loaded.context,
            "params": {
                "n_predict": b.gen_length, "temperature": b.temperature, "seed": b.seed,
                "slot_size": b.slot_size, "serial_blocks": b.serial_blocks,
                "slot_threshold": b.slot_threshold, "token_threshold": b.token_threshold,
            },
        },
        "total_slots": limits.parallel,
        "model_path": loaded.file.path.display().to_string(),
        "chat_template": template,
        "modalities": {"vision": false, "audio": false},
        "build_info": format!("refusion {}", env!("CARGO_PKG_VERSION")),
    })
}

/// Resolves at the first SIGINT/SIGTERM, after cancelling the generation in progress (and, via
/// `shutdown`, every queued job) and arming the second signal to exit at once.
async fn first_signal(mut signals: Signals, shutdown: Arc<Shutdown>, grace: std::time::Duration) {
    let name = signals.next().await;
    let busy = shutdown.request();
    eprintln!(
        "refusion serve: {name}: shutting down ({}; responses in flight get {} s; a second signal exits at once)",
        if busy { "cancelling the generation in progress" } else { "no generation in progress" },
        grace.as_secs_f64()
    );
    // The second signal is handled where it is delivered (`signals::Signals::new`); on other
    // systems, here.
    #[cfg(not(unix))]
    tokio::spawn(async move {
        let name = signals.next().await;
        eprintln!("refusion serve: second {name}: exiting now");
        std::process::exit(130);
    });
    #[cfg(unix)]
    drop(signals);
}

/// One log line per request (`tracing`, on stderr): method, path, status and the time to the
/// answer's head (a streamed answer's tokens are logged by the worker when it ends); `-v` adds
/// the client's user agent and the body's size.
async fn log_request(req: Request, next: Next) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    if tracing::enabled!(tracing::Level::DEBUG) {
        let value = |name: header::HeaderName| -> String {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_string()
        };
        let (agent, length) = (value(header::USER_AGENT), value(header::CONTENT_LENGTH));
        tracing::debug!("{method} {path}: user agent {agent}, body {length} bytes");
    }
    let start = std::time::Instant::now();
    let res = next.run(req).await;
    tracing::info!(
        "{method} {path} {} {:.1} ms",
        res.status().as_u16(),
        start.elapsed().as_secs_f64() * 1e3
    );
    res
}

/// The routes, each answering 405 with the error object to other methods, behind the API key
/// check (outermost, before the body is read) and the body reader.
fn router(state: AppState) -> Router {
    let state = Arc::new(state);
    Router::new()
        .route(
            "/health",
            get(health).fallback(method_not_allowed("GET, HEAD")),
        )
        .route(
            "/metrics",
            get(metrics).fallback(method_not_allowed("GET, HEAD")),
        )
        .route(
            "/v1/models",
            get(models).fallback(method_not_allowed("GET, HEAD")),
        )
        .route(
            "/v1/chat/completions",
            post(chat_completions).fallback(method_not_allowed("POST")),
        )
        .route(
            "/v1/completions",
            post(completions).fallback(method_not_allowed("POST")),
        )
        // llama-server's utilities.
        .route(
            "/tokenize",
            post(llama::tokenize).fallback(method_not_allowed("POST")),
        )
        .route(
            "/detokenize",
            post(llama::detokenize).fallback(method_not_allowed("POST")),
        )
        .route(
            "/props",
            get(llama::props).fallback(method_not_allowed("GET, HEAD")),
        )
        // ollama's API.
        .route(
            "/api/tags",
            get(ollama::tags).fallback(method_not_allowed("GET, HEAD")),
        )
        .route(
            "/api/ps",
            get(ollama::ps).fallback(method_not_allowed("GET, HEAD")),
        )
        .route(
            "/api/version",
            get(ollama::version).fallback(method_not_allowed("GET, HEAD")),
        )
        .route(
            "/api/show",
            post(ollama::show).fallback(method_not_allowed("POST")),
        )
        .route(
            "/api/generate",
            post(ollama::generate).fallback(method_not_allowed("POST")),
        )
        .route(
            "/api/chat",
            post(ollama::chat).fallback(method_not_allowed("POST")),
        )
        .fallback(not_found)
        // `read_body` enforces the limit; this lifts axum's own 2 MB default for the handlers.
        .layer(DefaultBodyLimit::max(state.body.max_bytes))
        .layer(middleware::from_fn_with_state(state.body, read_body))
        .layer(middleware::from_fn_with_state(state.clone(), require_key))
        .layer(middleware::from_fn(log_request))
        .with_state(state)
}
