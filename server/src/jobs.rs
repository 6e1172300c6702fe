//! The job protocol between the handlers and the worker, and what every API's handlers share:
//! a request is checked ([`crate::prepare`]) and becomes a [`Job`] on the worker's bounded
//! queue ([`enqueue`], [`submit`]), its answer comes back as [`Msg`]s ([`started`],
//! [`collect`]), and a response that goes away cancels its generation ([`CancelOnDrop`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use serde_json::json;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use tokio::sync::mpsc::UnboundedSender;

use crate::api::{ApiError, Knobs};
use crate::fill::FillSpec;
use crate::prepare::{JobInput, Prepared};
use crate::queue::{JobQueue, Phase, PushError, Ticket};
use crate::AppState;

/// A checked request on its way to the worker.
pub struct Job {
    pub request: Prepared,
    /// Set when the client goes away (or a stop string is reached): generation stops.
    pub cancel: Arc<AtomicBool>,
    pub tx: UnboundedSender<Msg>,
}

#[derive(Debug)]
pub enum Msg {
    Started {
        prompt_tokens: usize,
    },
    Delta(String),
    /// Text a template's gap gained (its index in the template's gaps).
    Fill {
        gap: usize,
        text: String,
    },
    Done {
        finish_reason: &'static str,
        prompt_tokens: usize,
        completion_tokens: usize,
        figures: Figures,
    },
    /// One step of the decode drawn (`decode_events`): a `refusion.step` event's JSON.
    Step(String),
    /// The tokens' log-probabilities (`logprobs`), just before `Done`.
    Scores(Box<crate::logprobs::Scores>),
    /// The stream is over (after `Done`).
    End,
    Error(ApiError),
}

/// How the answer was decoded, for llama-server's `timings` and the web page.
#[derive(Debug, Clone, Copy, Default)]
pub struct Figures {
    /// From admission to the end.
    pub decode_ms: f64,
    pub forward_calls: usize,
    /// The reference's tokens per forward (none when the decode was cut short).
    pub tpf: Option<f64>,
}

impl Figures {
    /// llama-server's `timings` object, with ReFusion's figures beside.
    pub fn timings(&self, prompt_tokens: usize, completion_tokens: usize) -> serde_json::Value {
        let per_s = completion_tokens as f64 / (self.decode_ms / 1e3).max(1e-9);
        serde_json::json!({
            "prompt_n": prompt_tokens,
            "predicted_n": completion_tokens,
            "predicted_ms": self.decode_ms,
            "predicted_per_second": per_s,
            "forward_calls": self.forward_calls,
            "tpf": self.tpf,
        })
    }
}

/// When dropped (the response, or its stream, went away): sets the job's cancel flag, and
/// takes the job out of the queue if it still waits there, so that its place is free at once.
pub(super) struct CancelOnDrop {
    cancel: Arc<AtomicBool>,
    queued: Option<(Arc<JobQueue>, Ticket)>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
        if let Some((queue, ticket)) = self.queued.take() {
            queue.withdraw(ticket);
        }
    }
}

pub(super) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Checks a request and queues it as a job (a mistake is a 400 before it takes a place; a full
/// queue is a 503); `template`: gaps to fill in its answer.
pub(super) fn enqueue(
    state: &AppState,
    input: JobInput,
    knobs: Knobs,
    template: Option<FillSpec>,
) -> Result<(UnboundedReceiver<Msg>, CancelOnDrop), ApiError> {
    match state.worker.get() {
        Phase::Ready | Phase::Loading => {}
        Phase::Failed(reason) => return Err(worker_failed(&reason)),
        Phase::Stopped => return Err(worker_failed("it has stopped")),
    }
    // Rendering and tokenizing a long prompt takes a while: other tasks move off this thread.
    let request =
        tokio::task::block_in_place(|| state.prepare.prepare(&input, &knobs, template.as_ref()))?;
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let sent = state.jobs.push(Job {
        request,
        cancel: cancel.clone(),
        tx,
    });
    match sent {
        Ok(ticket) => Ok((
            rx,
            CancelOnDrop {
                cancel,
                queued: Some((state.jobs.clone(), ticket)),
            },
        )),
        Err(PushError::Full) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_busy",
            format!(
                "the server is busy ({} requests queued); retry later",
                state.queue
            ),
        )),
        Err(PushError::Closed) => Err(match state.worker.get() {
            Phase::Failed(reason) => worker_failed(&reason),
            _ => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                "the server is shutting down",
            ),
        }),
    }
}

/// The answer while the model worker cannot take requests (the server is shutting down).
pub(super) fn worker_failed(reason: &str) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable_error",
        format!("the model worker failed: {reason}"),
    )
}

/// Waits until a queued job starts (or fails before producing anything).
pub(super) async fn started(rx: &mut UnboundedReceiver<Msg>) -> Result<usize, ApiError> {
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
pub(super) async fn submit(
    state: &AppState,
    input: JobInput,
    knobs: Knobs,
    template: Option<FillSpec>,
) -> Result<(UnboundedReceiver<Msg>, CancelOnDrop, usize), ApiError> {
    let (mut rx, guard) = enqueue(state, input, knobs, template)?;
    let prompt_tokens = started(&mut rx).await?;
    Ok((rx, guard, prompt_tokens))
}

/// A non-streamed answer.
pub(super) struct Collected {
    /// The answer's text; a template's fills, one after the other (one gap: its fill).
    pub(super) text: String,
    /// A template's fills, by gap.
    pub(super) fills: Vec<String>,
    pub(super) finish_reason: &'static str,
    pub(super) prompt_tokens: usize,
    pub(super) completion_tokens: usize,
    pub(super) figures: Figures,
    /// The log-probabilities asked for.
    pub(super) scores: Option<crate::logprobs::Scores>,
}

/// Collects a non-streamed answer.
pub(super) async fn collect(mut rx: UnboundedReceiver<Msg>) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut fills: Vec<String> = Vec::new();
    let mut scores = None;
    while let Some(msg) = rx.recv().await {
        match msg {
            Msg::Delta(d) => text.push_str(&d),
            Msg::Fill { gap, text: t } => {
                if fills.len() <= gap {
                    fills.resize(gap + 1, String::new());
                }
                fills[gap].push_str(&t);
                text.push_str(&t);
            }
            Msg::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                figures,
            } => {
                return Ok(Collected {
                    text,
                    fills,
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                    figures,
                    scores,
                })
            }
            Msg::Scores(s) => scores = Some(*s),
            Msg::Error(e) => return Err(e),
            Msg::Started { .. } | Msg::Step(_) | Msg::End => {}
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "generation ended early",
    ))
}

pub(super) fn usage(p: usize, c: usize) -> serde_json::Value {
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
}

/// The end of a stream. Without `stream_options.include_usage`: `[DONE]`. With it (OpenAI's
/// convention): one more chunk, with no choices and the usage, then `[DONE]` (chained after
/// the stream by [`UsageTail::last`], as one message cannot make two events).
pub(super) struct UsageTail {
    include: bool,
    chunk: Option<serde_json::Value>,
}

impl UsageTail {
    pub(super) fn new(include: bool) -> UsageTail {
        UsageTail {
            include,
            chunk: None,
        }
    }

    /// The finishing chunk `last` went out: the usage chunk copies its id, object and model.
    pub(super) fn done(&mut self, last: &serde_json::Value, prompt: usize, completion: usize) {
        if self.include {
            let mut v = last.clone();
            v["choices"] = json!([]);
            v["usage"] = usage(prompt, completion);
            self.chunk = Some(v);
        }
    }

    /// The event for the worker's `End`.
    pub(super) fn end(&mut self) -> Option<SseEvent> {
        match (self.include, self.chunk.take()) {
            (false, _) => Some(SseEvent::default().data("[DONE]")),
            (true, chunk) => chunk.map(|v| SseEvent::default().data(v.to_string())),
        }
    }

    /// What follows the stream: `[DONE]` when the usage chunk took `End`'s place.
    pub(super) fn last(include: bool) -> Option<SseEvent> {
        include.then(|| SseEvent::default().data("[DONE]"))
    }
}
