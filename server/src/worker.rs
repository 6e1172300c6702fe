//! The generation worker: one thread owns the model and the scheduler, which decodes up to
//! `--parallel` requests together (continuous batching) and shares their prompts' entries.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use tokio::sync::mpsc::UnboundedSender;

use super::api::{ApiError, Knobs};
use super::fill::{FillSpec, Fills};
use super::queue::{JobQueue, Phase, Pop, WorkerState};
use refusion_engine::chat::{ChatTemplate, Message, TextStream};
use refusion_engine::decode::{DecodeParams, Event, Trace};
use refusion_engine::error::{Error, RequestError};
use refusion_engine::load::runtime::Loaded;
use refusion_engine::sched::{Request, Scheduler, Stats, Update};

pub enum JobInput {
    Chat(Vec<Message>),
    Text(String),
    Tokens(Vec<u32>),
}

pub struct Job {
    pub input: JobInput,
    pub knobs: Knobs,
    /// Gaps to fill in the answer (any-order generation), if any.
    pub template: Option<FillSpec>,
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

/// Shutdown as the worker sees it: once requested, the generations in progress are cancelled
/// and every job still queued is answered 503.
#[derive(Default)]
pub struct Shutdown {
    requested: AtomicBool,
    /// The cancel flags of the jobs the scheduler holds.
    current: Mutex<Vec<Arc<AtomicBool>>>,
}

impl Shutdown {
    /// Starts shutting down; true when generations were in progress (they are cancelled).
    pub fn request(&self) -> bool {
        self.requested.store(true, Ordering::SeqCst);
        let current = std::mem::take(&mut *self.slot());
        for cancel in &current {
            cancel.store(true, Ordering::SeqCst);
        }
        !current.is_empty()
    }

    /// Whether shutdown has begun.
    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Vec<Arc<AtomicBool>>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a job handed to the scheduler; false when shutdown was requested (it must not
    /// run). The job is registered before the flag is read and `request` sets the flag before
    /// it looks, so one of the two always sees the other.
    fn begin(&self, cancel: &Arc<AtomicBool>) -> bool {
        self.slot().push(cancel.clone());
        !self.requested()
    }

    /// A registered job has finished.
    fn end(&self, cancel: &Arc<AtomicBool>) {
        self.slot().retain(|c| !Arc::ptr_eq(c, cancel));
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
    /// Requests decoded together (`--parallel`).
    pub parallel: usize,
}

/// Releases text only when it cannot be the start of a stop string, and cuts at the first stop.
pub(super) struct StopFilter {
    stops: Vec<String>,
    text: String,
    emitted: usize,
    pub(super) hit: bool,
}

impl StopFilter {
    pub(super) fn new(stops: Vec<String>) -> StopFilter {
        StopFilter {
            stops,
            text: String::new(),
            emitted: 0,
            hit: false,
        }
    }

    pub(super) fn push(&mut self, delta: &str) -> String {
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

    /// The text released so far.
    pub(super) fn sent(&self) -> &str {
        &self.text[..self.emitted]
    }

    pub(super) fn finish(&mut self) -> String {
        if self.hit || self.emitted >= self.text.len() {
            return String::new();
        }
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

/// What the worker shows of its load (`/metrics`, `/health`): the scheduler's counters as of
/// its last step, and the jobs in the queue not yet taken.
#[derive(Clone, Default)]
pub struct Load {
    pub stats: Arc<Mutex<Stats>>,
}

impl Load {
    pub fn stats(&self) -> Stats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The worker: owns the model and the scheduler, takes jobs from the queue as requests finish
/// (up to `parallel` in the scheduler; the rest wait in the bounded queue) and steps the
/// scheduler until the queue closes. `state` goes from loading to ready once the cache is set
/// up; an error there ends the worker (every queued job is answered 503 with it) and comes back
/// for the server to exit with.
pub fn run(
    loaded: Loaded,
    limits: Limits,
    jobs: &JobQueue,
    shutdown: &Shutdown,
    load: &Load,
    state: &WorkerState,
) -> Result<(), Error> {
    let parallel = limits.parallel.max(1);
    let template = loaded
        .file
        .header
        .get("tokenizer.chat_template")
        .and_then(|v| v.as_str())
        .and_then(|s| ChatTemplate::new(s).ok());
    let cache = match loaded.new_cache(loaded.context + limits.max_gen_length as usize) {
        Ok(c) => c,
        Err(e) => {
            let reason = e.to_string();
            state.set(Phase::Failed(reason.clone()));
            for job in jobs.close_and_drain() {
                let _ = job.tx.send(Msg::Error(super::jobs::worker_failed(&reason)));
                let _ = job.tx.send(Msg::End);
            }
            return Err(e);
        }
    };
    state.set(Phase::Ready);
    let mut sched = Scheduler::new(&loaded.model, cache, parallel);
    // Scratch beyond the context is the cache's; a request may use the context.
    sched.limit_requests(loaded.context);
    let ctx = Ctx {
        loaded: &loaded,
        template: template.as_ref(),
        limits: &limits,
        shutdown,
        jobs,
    };
    let mut open = true;
    loop {
        // Take jobs while the scheduler has room; wait for one only when it is idle.
        while open {
            let st = sched.stats();
            if st.running + st.waiting >= parallel {
                break;
            }
            match next_job(jobs, sched.is_idle(), shutdown) {
                Next::Job(job) => {
                    if let Some(req) = ctx.admit(*job) {
                        sched.submit(req);
                    }
                }
                Next::Later => continue,
                Next::None => break,
                Next::Closed => open = false,
            }
        }
        if sched.is_idle() && !open {
            break;
        }
        sched.step();
        *load.stats.lock().unwrap_or_else(|e| e.into_inner()) = sched.stats();
    }
    Ok(())
}

/// What the queue gave.
enum Next {
    Job(Box<Job>),
    /// Nothing yet (idle, waiting): ask again.
    Later,
    /// Nothing now (busy): get on with decoding.
    None,
    /// No more jobs will come (the server is shutting down).
    Closed,
}

/// The next job: waited for when the scheduler is idle (but the wait ends at shutdown even
/// while some other answer, a /tokenize say, still holds the queue's sender open), only taken
/// if there when it is busy.
fn next_job(jobs: &JobQueue, idle: bool, shutdown: &Shutdown) -> Next {
    let wait = idle.then_some(std::time::Duration::from_millis(50));
    match jobs.pop(wait) {
        Pop::Job(j) => Next::Job(j),
        Pop::Empty if idle && shutdown.requested() => Next::Closed,
        Pop::Empty if idle => Next::Later,
        Pop::Empty => Next::None,
        Pop::Closed => Next::Closed,
    }
}

/// What a job's request needs from the worker.
struct Ctx<'a> {
    loaded: &'a Loaded,
    template: Option<&'a ChatTemplate>,
    limits: &'a Limits,
    shutdown: &'a Shutdown,
    jobs: &'a JobQueue,
}

impl<'a> Ctx<'a> {
    /// A job taken from the queue, as a scheduler request; `None` when it is answered already
    /// (cancelled while queued, the server shutting down, or a mistake in it).
    fn admit(&self, job: Job) -> Option<Request<'a>> {
        if job.cancel.load(Ordering::SeqCst) {
            // Its client left between the take and now (else the job was withdrawn).
            self.jobs.note_cancelled();
            let _ = job.tx.send(Msg::End);
            return None;
        }
        let shutdown = self.shutdown;
        if !shutdown.begin(&job.cancel) {
            shutdown.end(&job.cancel);
            let _ = job.tx.send(Msg::Error(shutting_down()));
            let _ = job.tx.send(Msg::End);
            return None;
        }
        match self.request(job) {
            Ok(req) => Some(req),
            Err(failed) => {
                let (job, e) = *failed;
                shutdown.end(&job.cancel);
                let _ = job.tx.send(Msg::Error(e));
                let _ = job.tx.send(Msg::End);
                None
            }
        }
    }

    /// The job as a scheduler request: its parameters and prompt built (a mistake comes back
    /// with the job; the scheduler checks the rest), its answer streamed to the client through
    /// the sink.
    fn request(&self, job: Job) -> Result<Request<'a>, Box<(Job, ApiError)>> {
        // A template is decoded by the infill strategy (unless the request names another):
        // its parameters are checked as that strategy's.
        let mut base = self.limits.base.clone();
        if job.template.is_some() {
            base.strategy = refusion_engine::decode::Kind::Infill;
        }
        let params = job
            .knobs
            .params(&base, self.limits.max_gen_length)
            .and_then(|p| match &job.template {
                Some(spec) => spec.apply(
                    p,
                    &self.loaded.tokenizer,
                    self.vocab(),
                    self.limits.max_gen_length,
                ),
                None => Ok(p),
            });
        let params = match params {
            Ok(p) => p,
            Err(e) => return Err(Box::new((job, e))),
        };
        let prompt = match self.prompt(&job.input) {
            Ok(p) => p,
            Err(e) => return Err(Box::new((job, e))),
        };
        let tokenizer = &*self.loaded.tokenizer;
        let shutdown = self.shutdown;
        let Job {
            knobs, cancel, tx, ..
        } = job;
        let stops = knobs.stop.as_ref().map(|s| s.list()).unwrap_or_default();
        let mut answer = Answer {
            stream: TextStream::new(tokenizer, prompt.len(), params.eos_id)
                .limit(params.answer_limit()),
            fills: params
                .template
                .is_some()
                .then(|| Fills::new(tokenizer, &params, prompt.len(), &stops)),
            filter: StopFilter::new(stops),
            prompt_tokens: prompt.len(),
            reused: 0,
            started: None,
            forwards: 0,
        };
        let flag = cancel.clone();
        let mut steps = knobs
            .decode_events
            .then(|| Steps::new(Trace::new(&params, prompt.len() as u32), tokenizer));
        let sink = Box::new(move |u: Update<'_>| match u {
            Update::Started { reused } => {
                answer.reused = reused;
                answer.started = Some(std::time::Instant::now());
                let _ = tx.send(Msg::Started {
                    prompt_tokens: answer.prompt_tokens,
                });
                if let Some(s) = &mut steps {
                    let _ = tx.send(s.next());
                }
            }
            Update::Event(ev) => {
                if let Some(s) = &mut steps {
                    s.trace.apply(&ev);
                }
                if let Event::Committed { positions, tokens } = ev {
                    for m in answer.push(positions, tokens) {
                        let _ = tx.send(m);
                    }
                    if answer.stopped() {
                        flag.store(true, Ordering::SeqCst);
                    }
                }
            }
            Update::Stepped => {
                answer.forwards += 1;
                if let Some(s) = &mut steps {
                    let _ = tx.send(s.next());
                }
            }
            Update::Finished(result) => {
                if let Some(s) = &mut steps {
                    let _ = tx.send(s.last());
                }
                let outcome = answer.finish(result, tokenizer, shutdown);
                shutdown.end(&flag);
                match outcome {
                    Ok(msgs) => {
                        for m in msgs {
                            let _ = tx.send(m);
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Msg::Error(e));
                    }
                }
                let _ = tx.send(Msg::End);
            }
        });
        Ok(Request {
            prompt,
            params,
            cancel,
            sink,
        })
    }

    fn vocab(&self) -> usize {
        refusion_engine::model::Forward::config(&self.loaded.model).vocab
    }

    fn prompt(&self, input: &JobInput) -> Result<Vec<u32>, ApiError> {
        let tok = &self.loaded.tokenizer;
        match input {
            JobInput::Chat(messages) => {
                let t = self
                    .template
                    .ok_or_else(|| ApiError::bad_request("the model file has no chat template"))?;
                let text = t
                    .render(messages, true)
                    .map_err(|e| ApiError::bad_request(e.to_string()))?;
                tok.encode(&text)
                    .map_err(|e| ApiError::bad_request(e.to_string()))
            }
            JobInput::Tokens(ids) => {
                let vocab = tok.vocab_size();
                if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(ApiError::bad_request(format!(
                        "token id {bad} is beyond the vocabulary ({vocab} tokens)"
                    ))
                    .param("prompt"));
                }
                Ok(ids.clone())
            }
            JobInput::Text(text) => tok
                .encode(text)
                .map_err(|e| ApiError::bad_request(e.to_string())),
        }
    }
}

/// The decode drawn step by step for the client (`decode_events`): each step's changed cells
/// as a `refusion.step` event, the same [`Trace`] `--visual` draws.
struct Steps<'t> {
    trace: Trace,
    tokenizer: &'t refusion_engine::chat::Tokenizer,
    step: usize,
    /// Each token's text, decoded once (a planning step changes a whole block of cells).
    texts: std::collections::HashMap<u32, String>,
}

impl<'t> Steps<'t> {
    fn new(trace: Trace, tokenizer: &'t refusion_engine::chat::Tokenizer) -> Steps<'t> {
        Steps {
            trace,
            tokenizer,
            step: 0,
            texts: std::collections::HashMap::new(),
        }
    }

    /// `{"step": N, "length": POSITIONS, "cells": [[INDEX, STATE, TEXT], ...]}`: step 0 is
    /// the answer before any forward (a template's given text; with `slot_size` and
    /// `slot_runs`, `[[FIRST INDEX, SLOTS], ...]`, where the slots lie), then one per forward.
    fn next(&mut self) -> Msg {
        self.event(false)
    }

    /// The answer's end (`"final": true`, not a forward): cells never committed are masked.
    fn last(&mut self) -> Msg {
        self.trace.settle();
        self.event(true)
    }

    fn event(&mut self, last: bool) -> Msg {
        let changes = self.trace.take_changes();
        let mut cells = Vec::with_capacity(changes.len());
        for (i, c) in changes {
            let text = match c.token {
                Some(t) => self
                    .texts
                    .entry(t)
                    .or_insert_with(|| self.tokenizer.decode(&[t], false).unwrap_or_default())
                    .clone(),
                None => String::new(),
            };
            cells.push(serde_json::json!([i, c.state.name(), text]));
        }
        let mut v = serde_json::json!({
            "step": self.step,
            "length": self.trace.cells().len(),
            "cells": cells,
        });
        if last {
            v["final"] = serde_json::json!(true);
        }
        if self.step == 0 {
            let (k, runs) = self.trace.slots();
            v["slot_size"] = serde_json::json!(k);
            v["slot_runs"] = serde_json::json!(runs);
        }
        self.step += 1;
        Msg::Step(v.to_string())
    }
}

/// A caller's mistake is a 400, anything else a 500.
fn api_error(e: Error) -> ApiError {
    match e {
        Error::Request(r) => {
            let err = ApiError::bad_request(r.to_string());
            match r {
                RequestError::EmptyPrompt
                | RequestError::MaskInPrompt { .. }
                | RequestError::OutsideVocabulary { .. } => err.param("prompt"),
                RequestError::TooLong { .. } => err.param("max_tokens"),
                RequestError::Field { field, .. } => err.param(field),
                RequestError::Params(_) => err,
                // The front ends check their templates first and name their own field; this
                // is the completions' one.
                RequestError::Template(_) => err.param("suffix"),
            }
        }
        e => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            e.to_string(),
        ),
    }
}

/// One answer on its way to the client: the committed text, cut at a stop string (a
/// template's: each gap's).
struct Answer<'t> {
    stream: TextStream<'t>,
    fills: Option<Fills<'t>>,
    filter: StopFilter,
    prompt_tokens: usize,
    reused: usize,
    /// When it was admitted, and the forwards that served it since.
    started: Option<std::time::Instant>,
    forwards: usize,
}

impl Answer<'_> {
    fn push(&mut self, positions: &[u32], tokens: &[u32]) -> Vec<Msg> {
        if let Some(f) = &mut self.fills {
            return f.push(positions, tokens);
        }
        let Some(text) = self.stream.push(positions, tokens) else {
            return Vec::new();
        };
        let out = self.filter.push(&text);
        if out.is_empty() {
            Vec::new()
        } else {
            vec![Msg::Delta(out)]
        }
    }

    /// The figures as counted here (a decode cut short has no result to take them from).
    fn figures(&self) -> Figures {
        Figures {
            decode_ms: self
                .started
                .map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3),
            forward_calls: self.forwards,
            tpf: None,
        }
    }

    /// Whether stop strings have ended the answer (a template's: every gap).
    fn stopped(&self) -> bool {
        match &self.fills {
            Some(f) => f.all_stopped(),
            None => self.filter.hit,
        }
    }

    /// Whether a stop string cut the answer somewhere (finish reason "stop").
    fn cut(&self) -> bool {
        self.filter.hit || self.fills.as_ref().is_some_and(|f| f.any_stopped())
    }

    /// The last messages: the held-back text and `Done`, nothing (the client went away), or
    /// the error.
    fn finish(
        &mut self,
        result: refusion_engine::error::Result<refusion_engine::decode::DecodeResult>,
        tokenizer: &refusion_engine::chat::Tokenizer,
        shutdown: &Shutdown,
    ) -> Result<Vec<Msg>, ApiError> {
        let prompt_tokens = self.prompt_tokens;
        let mut msgs_before = Vec::new();
        match result {
            Ok(r) => {
                if let Some(f) = &mut self.fills {
                    msgs_before.extend(f.finish(Some(&r)));
                } else if let Some(tail) = self.stream.finish() {
                    let out = self.filter.push(&tail);
                    if !out.is_empty() {
                        msgs_before.push(Msg::Delta(out));
                    }
                }
                let finish_reason = if self.cut() || r.stopped() {
                    "stop"
                } else {
                    "length"
                };
                tracing::info!(
                    "generated {} tokens for a {prompt_tokens}-token prompt ({} from the cache), TPF {:.2}, {finish_reason}",
                    r.answer().len(),
                    self.reused,
                    r.tpf
                );
                let rest = self.filter.finish();
                let mut msgs = msgs_before;
                if !rest.is_empty() {
                    msgs.push(Msg::Delta(rest));
                }
                msgs.push(Msg::Done {
                    finish_reason,
                    prompt_tokens,
                    completion_tokens: r.completion_tokens(),
                    figures: Figures {
                        tpf: Some(r.tpf),
                        forward_calls: r.forward_calls,
                        ..self.figures()
                    },
                });
                Ok(msgs)
            }
            Err(Error::Cancelled) if self.stopped() && self.fills.is_some() => {
                let mut msgs = self
                    .fills
                    .as_mut()
                    .map(|f| f.finish(None))
                    .unwrap_or_default();
                let sent = self.fills.as_ref().map(|f| f.sent()).unwrap_or_default();
                msgs.push(Msg::Done {
                    finish_reason: "stop",
                    prompt_tokens,
                    completion_tokens: tokenizer.encode(&sent).map(|t| t.len()).unwrap_or(0),
                    figures: self.figures(),
                });
                Ok(msgs)
            }
            Err(Error::Cancelled) if self.filter.hit => {
                let completion = tokenizer
                    .encode(&self.filter.text[..self.filter.emitted])
                    .map(|t| t.len())
                    .unwrap_or(0);
                Ok(vec![Msg::Done {
                    finish_reason: "stop",
                    prompt_tokens,
                    completion_tokens: completion,
                    figures: self.figures(),
                }])
            }
            Err(Error::Cancelled) if shutdown.requested() => {
                tracing::warn!("shutting down: a generation in progress was cancelled");
                Err(shutting_down())
            }
            Err(Error::Cancelled) => {
                tracing::info!("the client went away; its generation was cancelled");
                Ok(Vec::new())
            }
            Err(e) => Err(api_error(e)),
        }
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
