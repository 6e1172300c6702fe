//! The model's thread: it loads the file, owns the KV cache and the engine's scheduler, and
//! decodes the jobs Python threads send it together (continuous batching, as `serve`'s worker).
//! Each job hears back over its own channel: text as it becomes final (when streamed), the
//! decode's steps (when traced), and the result.

use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc};

use refusion_engine::chat::{TextStream, Tokenizer};
use refusion_engine::decode::{DecodeParams, DecodeResult, Event, Trace};
use refusion_engine::error::Error;
use refusion_engine::kv::KvCache;
use refusion_engine::load::runtime::{load, LoadOptions, Loaded};
use refusion_engine::model::Forward;
use refusion_engine::sched::{Request, Scheduler, Update};

/// One decode asked for.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: DecodeParams,
    pub cancel: Arc<AtomicBool>,
    /// Send the text as it becomes final.
    pub stream: bool,
    /// Send each step's changed cells.
    pub trace: bool,
    pub reply: mpsc::Sender<Reply>,
}

/// What a job hears.
pub enum Reply {
    /// Text of the answer that became final (streamed jobs).
    Text(String),
    /// One step's changed cells: (answer index, state, token).
    Step(Vec<(u32, &'static str, Option<u32>)>),
    Done(Result<DecodeResult, Error>),
}

/// What the caller learns once the model is loaded.
pub struct Ready {
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<String>,
    pub base: DecodeParams,
    pub context: usize,
    pub vocab: usize,
    pub description: String,
}

/// Loads the model, answers `ready`, then serves `jobs` until every sender is gone.
pub fn run(
    opts: LoadOptions,
    parallel: usize,
    max_gen: u32,
    jobs: mpsc::Receiver<Job>,
    ready: mpsc::Sender<Result<Ready, String>>,
) {
    let (loaded, cache) = match setup(&opts, max_gen) {
        Ok((loaded, cache, r)) => {
            let _ = ready.send(Ok(r));
            (loaded, cache)
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let tokenizer = loaded.tokenizer.clone();
    let mut sched = Scheduler::new(&loaded.model, cache, parallel.max(1));
    sched.limit_requests(loaded.context);
    loop {
        // Block for a job only when nothing is decoding; else take what has come and step.
        let first = if sched.is_idle() {
            match jobs.recv() {
                Ok(j) => Some(j),
                Err(_) => return,
            }
        } else {
            jobs.try_recv().ok()
        };
        for job in first
            .into_iter()
            .chain(std::iter::from_fn(|| jobs.try_recv().ok()))
        {
            sched.submit(request(job, &tokenizer));
        }
        sched.step();
    }
}

/// The model loaded and its cache (the context and room for an answer beyond it, as `serve`
/// plans it).
fn setup(opts: &LoadOptions, max_gen: u32) -> Result<(Loaded, KvCache, Ready), String> {
    let loaded = load(opts).map_err(|e| e.to_string())?;
    let ready = describe(&loaded)?;
    let cache = loaded
        .new_cache(loaded.context + max_gen as usize)
        .map_err(|e| e.to_string())?;
    Ok((loaded, cache, ready))
}

/// The file's decoding defaults and what a caller needs before any decode.
fn describe(l: &Loaded) -> Result<Ready, String> {
    let h = &l.file.header;
    let d = refusion_gguf::DecodingDefaults::from_metadata(h)?;
    let tok = &l.tokenizer;
    let eos = tok
        .eos_id
        .ok_or("the model file has no EOS token (tokenizer.ggml.eos_token_id)")?;
    let mask = tok.mask_id.ok_or(
        "the model file has no mask token (neither tokenizer.ggml.mask_token_id nor <|mask|> in its vocabulary): not a ReFusion model",
    )?;
    let name = h
        .get("general.name")
        .and_then(|v| v.as_str())
        .unwrap_or("model");
    Ok(Ready {
        tokenizer: l.tokenizer.clone(),
        chat_template: h
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        base: DecodeParams::new(d, eos, mask),
        context: l.context,
        vocab: l.model.config().vocab,
        description: format!(
            "{name}, context {}, {} KV cache",
            l.context,
            l.cache_types()
        ),
    })
}

/// The scheduler's request for `job`: its sink sends the job's replies.
fn request<'t>(job: Job, tokenizer: &'t Tokenizer) -> Request<'t> {
    let Job {
        prompt,
        params,
        cancel,
        stream,
        trace,
        reply,
    } = job;
    let mut text = stream.then(|| {
        TextStream::new(tokenizer, prompt.len(), params.eos_id).limit(params.answer_limit())
    });
    let mut steps = trace.then(|| Trace::new(&params, prompt.len() as u32));
    let sink = Box::new(move |u: Update<'_>| match u {
        Update::Event(ev) => {
            if let Some(t) = &mut steps {
                t.apply(&ev);
            }
            if let (Some(s), Event::Committed { positions, tokens }) = (&mut text, &ev) {
                if let Some(new) = s.push(positions, tokens) {
                    let _ = reply.send(Reply::Text(new));
                }
            }
        }
        Update::Stepped => {
            if let Some(t) = &mut steps {
                let cells = t.take_changes();
                let cells = cells
                    .into_iter()
                    .map(|(i, c)| (i, c.state.name(), c.token))
                    .collect();
                let _ = reply.send(Reply::Step(cells));
            }
        }
        Update::Finished(r) => {
            if let Some(tail) = text.as_mut().and_then(|s| s.finish()) {
                let _ = reply.send(Reply::Text(tail));
            }
            let _ = reply.send(Reply::Done(r));
        }
        Update::Started { .. } => {}
    });
    Request {
        prompt,
        params,
        cancel,
        sink,
    }
}
