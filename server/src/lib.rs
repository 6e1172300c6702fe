//! refusion-server: `refusion serve`, an OpenAI-compatible HTTP server (axum on tokio) over
//! refusion-engine's scheduler.
//!
//! Each API has its file: [`openai`] (`/v1/*`), [`ollama`] (`/api/*`), [`llama`] (llama-server's
//! `/tokenize`, `/detokenize`, `/props`); they parse and check a request ([`api`]), then queue
//! it as a job ([`jobs`]; bounded: a full queue is a 503) for the engine thread ([`worker`]),
//! which streams back the contiguous committed prefix of the answer as it grows. A client that
//! disconnects cancels its generation. Who may connect is [`access`]'s job; connections
//! (timeouts, the cap, the drain at shutdown) are [`conn`]'s. This file holds the router, the
//! health and metrics routes, and the server's start and shutdown.

mod access;
mod answer;
pub mod api;
mod body;
mod completion;
mod conn;
mod cors;
mod error;
mod fill;
mod infill;
mod jobs;
mod llama;
mod llama_fields;
mod logprobs;
mod ollama;
mod openai;
mod prepare;
mod queue;
mod shutdown;
mod signals;
mod stop;
mod tool_stream;
mod tools;
mod webui;
pub mod worker;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use serde_json::json;

pub use self::access::check_access;
use self::api::ApiError;
use self::body::{read_body, BodyLimits};
pub use self::conn::ConnLimits;
pub use self::cors::Cors;
pub use self::error::{Result, ServeError};
pub use self::ollama::ModelCard;
use self::prepare::Preparer;
use self::queue::{FailOnPanic, JobQueue, Phase, WorkerState};
use self::shutdown::Shutdown;
use self::signals::Signals;
use self::worker::{Limits, Load};
use refusion_engine::load::runtime::Loaded;

pub struct ServerConfig {
    pub host: IpAddr,
    pub port: u16,
    pub api_key: Option<String>,
    pub queue: usize,
    pub max_body_bytes: usize,
    pub model_name: String,
    pub conn: ConnLimits,
    /// `--cors-origin` values (checked at start).
    pub cors_origins: Vec<String>,
    /// The web page at `/` (`--no-webui` turns it off).
    pub webui: bool,
}

/// What the handlers share (every API's files use it).
pub(crate) struct AppState {
    jobs: Arc<JobQueue>,
    /// Checks a request and builds its prompt before it is queued.
    prepare: Preparer,
    /// Whether the worker can take requests (`/health`).
    worker: Arc<WorkerState>,
    model: String,
    api_key: Option<String>,
    queue: usize,
    next_id: AtomicU64,
    body: BodyLimits,
    /// What ollama's `/api/tags` tells about the model.
    card: ollama::ModelCard,
    /// For `/tokenize` and `/detokenize` (shared with the worker).
    tokenizer: Arc<refusion_engine::chat::Tokenizer>,
    /// The model's embedding rows.
    vocab: usize,
    /// llama-server's `/props`.
    props: serde_json::Value,
    /// The scheduler's counters, as of its last step.
    load: Load,
    parallel: usize,
    /// The page is served (its paths need no key).
    webui: bool,
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

/// llama-server's `/health`, with the load: requests decoding, waiting, and the slots free.
/// 200 only when a request can be answered: 503 while the worker sets up its cache, after it
/// failed, and once it has stopped.
async fn health(State(state): State<Arc<AppState>>) -> Response {
    let unavailable = |m: String| {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", m).into_response()
    };
    match state.worker.get() {
        Phase::Ready => {}
        Phase::Loading => return unavailable("loading model".into()),
        Phase::Failed(reason) => return unavailable(format!("the model worker failed: {reason}")),
        Phase::Stopped => return unavailable("the server is shutting down".into()),
    }
    let st = state.load.stats();
    let queued = state.jobs.len();
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
    let queued = state.jobs.len();
    let cancelled = st.requests_cancelled + state.jobs.cancelled();
    let n = |v: u64| v.to_string();
    let secs = |v: f64| format!("{v:.6}");
    let (counter, gauge) = ("counter", "gauge");
    // Prometheus's text format: name, type, help, value (one metric a line).
    #[rustfmt::skip]
    let rows = [
        ("requests_finished_total", counter, "Requests answered in full.", n(st.requests_finished)),
        ("requests_cancelled_total", counter, "Requests cancelled (client gone, while queued too; stop string; shutdown).", n(cancelled)),
        ("requests_failed_total", counter, "Requests that failed after being queued.", n(st.requests_failed)),
        ("tokens_generated_total", counter, "Answer tokens generated.", n(st.tokens_generated)),
        ("prompt_tokens_total", counter, "Prompt tokens of admitted requests.", n(st.prompt_tokens)),
        ("prompt_tokens_cached_total", counter, "Prompt tokens taken from cached prompts.", n(st.prompt_tokens_reused)),
        ("forwards_total", counter, "Forward calls (each serving every running request).", n(st.forwards)),
        ("forward_tokens_total", counter, "Tokens fed through the model.", n(st.forward_tokens)),
        ("forward_logit_rows_total", counter, "Rows of logits computed (each a product with the whole output layer).", n(st.forward_logit_rows)),
        ("forward_seconds_total", counter, "Seconds spent in forwards.", secs(st.forward_seconds)),
        ("feed_seconds_total", counter, "Seconds spent handing the forwards' logits to the decoders (argmax, probabilities).", secs(st.feed_seconds)),
        ("requests_running", gauge, "Requests decoding now.", n(st.running as u64)),
        ("requests_waiting", gauge, "Requests waiting for room in the scheduler or the queue.", n((st.waiting + queued) as u64)),
        ("batch_tokens", gauge, "Tokens in the last forward.", n(st.last_batch_tokens as u64)),
        ("batch_requests", gauge, "Requests served by the last forward.", n(st.last_batch_requests as u64)),
        ("kv_entries_used", gauge, "KV cache entries in use (sequences and cached prompts).", n(st.kv_used as u64)),
        ("kv_entries", gauge, "KV cache entries in all.", n(st.kv_capacity as u64)),
        ("cached_prompts", gauge, "Prompts kept for reuse.", n(st.cached_prompts as u64)),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in rows {
        out.push_str(&format!(
            "# HELP refusion_{name} {help}\n# TYPE refusion_{name} {kind}\nrefusion_{name} {value}\n"
        ));
    }
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

/// Runs the server until Ctrl-C or SIGTERM. The first signal stops accepting, cancels the
/// generation in progress and the queued requests (they get 503), closes connections with
/// nothing in flight and gives responses in flight until `--shutdown-timeout` after it, by
/// which time the worker must have stopped too; then it returns. A second signal exits the
/// process at once (code 130).
pub fn serve(loaded: Loaded, limits: Limits, cfg: ServerConfig) -> Result<()> {
    check_access(cfg.host, cfg.api_key.as_deref())?;
    let cors = Cors::new(&cfg.cors_origins, cfg.host, cfg.api_key.as_deref())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| ServeError::System(format!("cannot start the async runtime: {e}")))?;
    let addr = SocketAddr::new(cfg.host, cfg.port);
    let (listener, signals) = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| ServeError::System(format!("cannot listen on {addr}: {e}")))?;
        Ok::<_, ServeError>((listener, Signals::new()?))
    })?;
    let local = listener
        .local_addr()
        .map_err(|e| ServeError::System(e.to_string()))?;

    let card = ollama::ModelCard::of(&loaded.file);
    let tokenizer = loaded.tokenizer.clone();
    let vocab = refusion_engine::model::Forward::config(&loaded.model).vocab;
    let props = props(&loaded, &limits);
    let prepare = Preparer::new(&loaded, &limits);
    let shutdown = Arc::new(Shutdown::default());
    let jobs = Arc::new(JobQueue::new(cfg.queue));
    let worker_state = Arc::new(WorkerState::default());
    let load = Load::default();
    let parallel = limits.parallel;
    let worker = {
        let (shutdown, jobs, load, state) = (
            shutdown.clone(),
            jobs.clone(),
            load.clone(),
            worker_state.clone(),
        );
        std::thread::Builder::new()
            .name("refusion-worker".into())
            .spawn(move || {
                let _panic = FailOnPanic(&state);
                let outcome = worker::run(loaded, limits, &jobs, &shutdown, &load, &state);
                state.finish(outcome.map_err(|e| e.to_string()));
            })
            .map_err(|e| ServeError::System(format!("cannot start the worker: {e}")))?
    };
    let body = BodyLimits {
        max_bytes: cfg.max_body_bytes,
        timeout: cfg.conn.body,
    };
    let app = router(
        AppState {
            jobs: jobs.clone(),
            prepare,
            worker: worker_state.clone(),
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
            webui: cfg.webui,
        },
        cors,
    );
    let ready_line = format!(
        "refusion serve: listening on http://{local} (model '{}'){}",
        cfg.model_name,
        if cfg.webui {
            "; the web page is at /"
        } else {
            ""
        }
    );
    let outcome = worker_state.clone();
    rt.block_on(async move {
        // Connections are taken at once (`/health` says 503 while the worker sets up); the
        // line that says the server listens comes once requests can be answered.
        tokio::spawn(announce_when_ready(worker_state.clone(), ready_line));
        let stop = {
            let (shutdown, state) = (shutdown.clone(), worker_state.clone());
            async move {
                tokio::select! {
                    () = first_signal(signals, shutdown.clone(), cfg.conn.grace) => {}
                    reason = worker_failure(state) => {
                        eprintln!("refusion serve: the model worker failed ({reason}); shutting down");
                        shutdown.request();
                    }
                }
            }
        };
        let (deadline, left) = conn::run(listener, app, cfg.conn, stop).await;
        if left > 0 {
            eprintln!("refusion serve: closed {left} connection(s) still open at the deadline");
        }
        // No more jobs: the worker ends after its current one, which was cancelled. Waited
        // for here, on the runtime, so that the second-signal task still runs.
        jobs.close();
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
    if let Phase::Failed(reason) = outcome.get() {
        return Err(ServeError::Worker(reason));
    }
    eprintln!("refusion serve: stopped");
    Ok(())
}

/// Prints the listening line once the worker is ready (never, if it fails first).
async fn announce_when_ready(state: Arc<WorkerState>, line: String) {
    loop {
        match state.get() {
            Phase::Ready => {
                eprintln!("{line}");
                return;
            }
            Phase::Loading => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            Phase::Failed(_) | Phase::Stopped => return,
        }
    }
}

/// Resolves with the reason when the worker has failed (it ended with an error or panicked).
async fn worker_failure(state: Arc<WorkerState>) -> String {
    loop {
        if let Phase::Failed(reason) = state.get() {
            return reason;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
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
                "slot_threshold": refusion_engine::decode::shortest_f64(b.slot_threshold),
                "token_threshold": refusion_engine::decode::shortest_f64(b.token_threshold),
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
fn router(state: AppState, cors: Cors) -> Router {
    let state = Arc::new(state);
    let page = if state.webui {
        webui::routes()
    } else {
        Router::new()
    };
    page.route(
        "/health",
        get(health).fallback(method_not_allowed("GET, HEAD")),
    )
    .route(
        "/metrics",
        get(metrics).fallback(method_not_allowed("GET, HEAD")),
    )
    .route(
        "/v1/models",
        get(openai::models).fallback(method_not_allowed("GET, HEAD")),
    )
    .route(
        "/v1/chat/completions",
        post(openai::chat_completions).fallback(method_not_allowed("POST")),
    )
    .route(
        "/v1/completions",
        post(openai::completions).fallback(method_not_allowed("POST")),
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
        "/tokenizer_info",
        get(llama::tokenizer_info).fallback(method_not_allowed("GET, HEAD")),
    )
    .route(
        "/props",
        get(llama::props).fallback(method_not_allowed("GET, HEAD")),
    )
    .route(
        "/infill",
        post(infill::infill).fallback(method_not_allowed("POST")),
    )
    .route(
        "/completion",
        post(completion::completion).fallback(method_not_allowed("POST")),
    )
    .route(
        "/completions",
        post(completion::completion).fallback(method_not_allowed("POST")),
    )
    .route(
        "/apply-template",
        post(completion::apply_template).fallback(method_not_allowed("POST")),
    )
    .route(
        "/slots",
        get(completion::slots).fallback(method_not_allowed("GET, HEAD")),
    )
    .route("/embedding", any(completion::embeddings))
    .route("/embeddings", any(completion::embeddings))
    .route("/v1/embeddings", any(completion::embeddings))
    .route("/api/embed", any(completion::embeddings))
    .route("/api/embeddings", any(completion::embeddings))
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
    .layer(middleware::from_fn_with_state(
        state.clone(),
        access::require_key,
    ))
    .layer(middleware::from_fn_with_state(
        Arc::new(cors.with_body_limits(state.body)),
        cors::cors,
    ))
    .layer(middleware::from_fn(log_request))
    .layer(middleware::from_fn(harden_response))
    .with_state(state)
}

/// Outermost: `X-Content-Type-Options: nosniff` on every answer (a browser never runs a JSON
/// or text answer as something else), and an error without a body (axum's own 405 on the
/// page's routes, say) given the API's error object, as every other error has.
async fn harden_response(req: Request, next: Next) -> Response {
    use http_body::Body as _;
    let method = req.method().clone();
    let mut res = next.run(req).await;
    let status = res.status();
    if status.as_u16() >= 400 && method != Method::HEAD && res.body().size_hint().exact() == Some(0)
    {
        // (axum adds the `Allow` header after this layer.)
        let message = match status {
            StatusCode::METHOD_NOT_ALLOWED => format!(
                "method {method} is not allowed here (the Allow header lists those that are)"
            ),
            s => s.canonical_reason().unwrap_or("error").to_string(),
        };
        let kind = if status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        let (mut parts, _) = res.into_parts();
        let fresh = ApiError::new(status, kind, message).into_response();
        parts.headers.remove(header::CONTENT_LENGTH);
        for (name, value) in fresh.headers() {
            parts.headers.insert(name, value.clone());
        }
        res = Response::from_parts(parts, fresh.into_body());
    }
    res.headers_mut().insert(
        header::HeaderName::from_static("x-content-type-options"),
        HeaderValue::from_static("nosniff"),
    );
    res
}
