//! The generation worker: one thread owns the model and a chat session (so consecutive requests
//! reuse the cached prefix) and runs queued jobs one at a time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use tokio::sync::mpsc::UnboundedSender;

use super::api::{ApiError, Knobs};
use crate::chat::{ChatTemplate, Message, TextStream};
use crate::decode::{DecodeParams, Event};
use crate::error::Error;
use crate::runtime::Loaded;
use crate::session::Session;

pub enum JobInput {
    Chat(Vec<Message>),
    Text(String),
    Tokens(Vec<u32>),
}

pub struct Job {
    pub input: JobInput,
    pub knobs: Knobs,
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
    Done {
        finish_reason: &'static str,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// The stream is over (after `Done`).
    End,
    Error(ApiError),
}

/// Shutdown as the worker sees it: once requested, the generation in progress is cancelled and
/// every job still queued is answered 503.
#[derive(Default)]
pub struct Shutdown {
    requested: AtomicBool,
    /// The cancel flag of the job being generated.
    current: Mutex<Option<Arc<AtomicBool>>>,
}

impl Shutdown {
    /// Starts shutting down; true when a generation was in progress (it is cancelled).
    pub fn request(&self) -> bool {
        self.requested.store(true, Ordering::SeqCst);
        let current = self.slot().take();
        if let Some(cancel) = &current {
            cancel.store(true, Ordering::SeqCst);
        }
        current.is_some()
    }

    /// Whether shutdown has begun.
    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Arc<AtomicBool>>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a job about to run; false when shutdown was requested (it must not run). The
    /// job is registered before the flag is read and `request` sets the flag before it looks, so
    /// one of the two always sees the other.
    fn begin(&self, cancel: &Arc<AtomicBool>) -> bool {
        *self.slot() = Some(cancel.clone());
        !self.requested()
    }

    /// The registered job has finished.
    fn end(&self) {
        *self.slot() = None;
    }
}

/// The answer to a job cancelled, or never started, because of shutdown.
fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_shutting_down",
        "the server is shutting down; the request was cancelled",
    )
}

/// Server-side limits and defaults.
pub struct Limits {
    pub base: DecodeParams,
    pub max_gen_length: u32,
}

/// Releases text only when it cannot be the start of a stop string, and cuts at the first stop.
struct StopFilter {
    stops: Vec<String>,
    text: String,
    emitted: usize,
    hit: bool,
}

impl StopFilter {
    fn push(&mut self, delta: &str) -> String {
        if self.hit {
            return String::new();
        }
        self.text.push_str(delta);
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min();
        let mut end = match found {
            Some(i) => {
                self.hit = true;
                i
            }
            None => {
                let hold = self
                    .stops
                    .iter()
                    .map(|s| s.len().saturating_sub(1))
                    .max()
                    .unwrap_or(0);
                self.text.len().saturating_sub(hold)
            }
        };
        while end > self.emitted && !self.text.is_char_boundary(end) {
            end -= 1;
        }
        if end <= self.emitted {
            return String::new();
        }
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }

    fn finish(&mut self) -> String {
        if self.hit || self.emitted >= self.text.len() {
            return String::new();
        }
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

/// The decoding parameters of a request: its fields over the server's defaults, checked.
pub fn params_for(knobs: &Knobs, limits: &Limits) -> Result<DecodeParams, ApiError> {
    if knobs.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request(
            "n must be 1: one choice per request is supported (send several requests)",
        )
        .param("n"));
    }
    let mut p = limits.base.clone();
    if let Some(n) = knobs.max_completion_tokens.or(knobs.max_tokens) {
        if n == 0 || n > limits.max_gen_length {
            return Err(ApiError::bad_request(format!(
                "max_tokens must be between 1 and {}, got {n}",
                limits.max_gen_length
            ))
            .param("max_tokens"));
        }
        p.gen_length = n;
    }
    if let Some(t) = knobs.temperature {
        p.temperature = t;
    }
    if let Some(s) = knobs.seed {
        p.seed = s;
    }
    if let Some(v) = knobs.slot_size {
        p.slot_size = v;
    }
    match knobs.serial_blocks {
        Some(v) => p.serial_blocks = v,
        // Keep the server's block length when only max_tokens (or the slot size) changed.
        None if p.gen_length != limits.base.gen_length || p.slot_size != limits.base.slot_size => {
            p.fit_serial_blocks(limits.base.padded_gen_length() / limits.base.serial_blocks.max(1))
        }
        None => {}
    }
    if let Some(v) = knobs.slot_threshold {
        p.slot_threshold = v;
    }
    if let Some(v) = knobs.token_threshold {
        p.token_threshold = v;
    }
    p.validate()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(p)
}

pub fn run(loaded: Loaded, limits: Limits, jobs: Receiver<Job>, shutdown: &Shutdown) {
    let template = loaded
        .file
        .header
        .get("tokenizer.chat_template")
        .and_then(|v| v.as_str())
        .and_then(|s| ChatTemplate::new(s).ok());
    let block = limits.max_gen_length as usize;
    let cache = match loaded.new_cache(loaded.context + block) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return;
        }
    };
    let context = loaded.context;
    let mut session = Session::new(&loaded.model, &loaded.tokenizer, template, cache);
    for job in jobs {
        if job.cancel.load(Ordering::SeqCst) {
            continue;
        }
        let result = if shutdown.begin(&job.cancel) {
            run_job(&mut session, &loaded, context, &limits, &job, shutdown)
        } else {
            Err(shutting_down())
        };
        shutdown.end();
        if let Err(e) = result {
            let _ = job.tx.send(Msg::Error(e));
        }
        let _ = job.tx.send(Msg::End);
    }
}

fn run_job(
    session: &mut Session<'_, crate::model::Qwen3>,
    loaded: &Loaded,
    context: usize,
    limits: &Limits,
    job: &Job,
    shutdown: &Shutdown,
) -> Result<(), ApiError> {
    let params = params_for(&job.knobs, limits)?;
    let prompt = match &job.input {
        JobInput::Chat(messages) => session
            .render(messages)
            .map_err(|e| ApiError::bad_request(e.to_string()))?,
        JobInput::Tokens(ids) => {
            let vocab = loaded.tokenizer.vocab_size();
            if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::bad_request(format!(
                    "token id {bad} is beyond the vocabulary ({vocab} tokens)"
                ))
                .param("prompt"));
            }
            ids.clone()
        }
        JobInput::Text(text) => loaded
            .tokenizer
            .encode(text)
            .map_err(|e| ApiError::bad_request(e.to_string()))?,
    };
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    let gen = params.padded_gen_length() as usize;
    if prompt.len() + gen > context {
        return Err(ApiError::bad_request(format!(
            "the prompt ({} tokens) plus max_tokens ({gen}) is {} tokens, more than the context of {context}",
            prompt.len(),
            prompt.len() + gen
        )));
    }
    if let Some(i) = prompt.iter().position(|&t| t == params.mask_id) {
        return Err(ApiError::bad_request(format!(
            "the prompt contains the mask token at index {i}"
        )));
    }
    let _ = job.tx.send(Msg::Started {
        prompt_tokens: prompt.len(),
    });
    let mut stream = TextStream::new(&loaded.tokenizer, prompt.len(), params.eos_id);
    let mut filter = StopFilter {
        stops: job
            .knobs
            .stop
            .as_ref()
            .map(|s| s.list())
            .unwrap_or_default(),
        text: String::new(),
        emitted: 0,
        hit: false,
    };
    let cancel = &job.cancel;
    let tx = &job.tx;
    let result = session.generate(&prompt, &params, cancel, &mut |ev| {
        if let Event::Committed { positions, tokens } = ev {
            if let Some(text) = stream.push(positions, tokens) {
                let out = filter.push(&text);
                if !out.is_empty() {
                    let _ = tx.send(Msg::Delta(out));
                }
                if filter.hit {
                    cancel.store(true, Ordering::SeqCst);
                }
            }
        }
    });
    match result {
        Ok(r) => {
            let rest = filter.finish();
            if !rest.is_empty() {
                let _ = tx.send(Msg::Delta(rest));
            }
            let finish_reason = if filter.hit || r.eos_index.is_some() {
                "stop"
            } else {
                "length"
            };
            tracing::info!(
                "generated {} tokens for a {}-token prompt ({} from the cache), TPF {:.2}, {finish_reason}",
                r.answer().len(),
                prompt.len(),
                session.last_reused,
                r.tpf
            );
            let _ = tx.send(Msg::Done {
                finish_reason,
                prompt_tokens: prompt.len(),
                completion_tokens: r.answer().len(),
            });
            Ok(())
        }
        Err(Error::Cancelled) if filter.hit => {
            let completion = loaded
                .tokenizer
                .encode(&filter.text[..filter.emitted])
                .map(|t| t.len())
                .unwrap_or(0);
            let _ = tx.send(Msg::Done {
                finish_reason: "stop",
                prompt_tokens: prompt.len(),
                completion_tokens: completion,
            });
            Ok(())
        }
        Err(Error::Cancelled) if shutdown.requested() => {
            tracing::warn!("shutting down: the generation in progress was cancelled");
            Err(shutting_down())
        }
        Err(Error::Cancelled) => {
            tracing::info!("the client went away; its generation was cancelled");
            Ok(())
        }
        Err(e) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            e.to_string(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    #[test]
    fn stop_strings_cut_and_hold_back() {
        let mut f = StopFilter {
            stops: vec!["END".into()],
            text: String::new(),
            emitted: 0,
            hit: false,
        };
        let mut out = String::new();
        for d in ["Hello E", "N", "D and more"] {
            out.push_str(&f.push(d));
        }
        out.push_str(&f.finish());
        assert_eq!(out, "Hello ");
        let mut f = StopFilter {
            stops: vec!["xyz".into()],
            text: String::new(),
            emitted: 0,
            hit: false,
        };
        let mut out = f.push("abc x");
        out.push_str(&f.push("y!"));
        out.push_str(&f.finish());
        assert_eq!(out, "abc xy!");
    }
}
