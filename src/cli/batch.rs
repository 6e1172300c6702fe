//! `refusion generate --batch FILE.jsonl`: many requests through the scheduler at once (what an
//! evaluation set such as GSM8K or HumanEval needs), one JSON result per line in input order.
//!
//! Each input line is one request object, as the server's completions take it: `prompt` (text,
//! through the chat template unless `--no-chat-template`, or token ids) or `messages`, an
//! optional `system`, an `id` echoed back, and the server's decoding fields (`max_tokens`,
//! `temperature`, `seed`, `stop`, `slot_size`, `serial_blocks`, `slot_threshold`,
//! `token_threshold`). Other fields are ignored, so an evaluation file can carry its answers.

use std::cell::RefCell;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use refusion_gguf::atomic::AtomicFile;
use serde::Deserialize;
use serde_json::{json, Value};

use super::bounded;
use refusion_engine::chat::{ChatTemplate, Message, TextStream};
use refusion_engine::decode::{DecodeParams, DecodeResult, Event};
use refusion_engine::load::runtime::Loaded;
use refusion_engine::sched::{Request, Scheduler, Update};
use refusion_server::api::{self, ChatMessage, Knobs};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum LinePrompt {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(Debug, Deserialize)]
pub struct Line {
    prompt: Option<LinePrompt>,
    messages: Option<Vec<ChatMessage>>,
    system: Option<String>,
    id: Option<Value>,
    /// Gap filling is not run in a batch: refused by name rather than ignored.
    suffix: Option<Value>,
    infill: Option<Value>,
    #[serde(flatten)]
    knobs: Knobs,
}

/// The requests of a batch file, checked before the model loads: each line parses, has a
/// `prompt` or `messages` (not both) and asks for one choice.
///
/// The file is streamed a line at a time ([`bounded::Lines`]): a line is at most
/// [`bounded::LINE_BYTES`], a batch at most [`bounded::BATCH_REQUESTS`] requests and
/// [`bounded::BATCH_BYTES`] in all, each refused by name when passed.
pub fn read(path: &Path) -> Result<Vec<(usize, Value, Line)>> {
    let name = if path.as_os_str() == "-" {
        "standard input".to_string()
    } else {
        path.display().to_string()
    };
    let mut lines = bounded::Lines::new(
        bounded::open_text(path, "a batch file")?,
        bounded::LINE_BYTES,
    );
    let mut out = Vec::new();
    for i in 0.. {
        let at = |m: &str| anyhow::anyhow!("{name}:{}: {m}", i + 1);
        let raw = match lines.next_line() {
            Ok(Some(raw)) => raw,
            Ok(None) => break,
            Err(e) => return Err(at(&e.to_string())),
        };
        if lines.bytes > bounded::BATCH_BYTES {
            bail!(
                "{name}: more than {} of requests; split the batch",
                bounded::size(bounded::BATCH_BYTES)
            );
        }
        if raw.trim().is_empty() {
            continue;
        }
        if out.len() == bounded::BATCH_REQUESTS {
            return Err(at(&format!(
                "more than {} requests in one batch; split the batch",
                bounded::BATCH_REQUESTS
            )));
        }
        let line: Line = api::parse_with_knobs(raw.as_bytes()).map_err(|e| at(e.message()))?;
        match (&line.prompt, &line.messages) {
            (None, None) => return Err(at("needs a prompt or messages")),
            (Some(_), Some(_)) => return Err(at("has both a prompt and messages; give one")),
            _ => {}
        }
        if line.knobs.n.is_some_and(|n| n != 1) {
            return Err(at("n must be 1 (one choice per line)"));
        }
        if line.suffix.is_some() || line.infill.is_some() {
            return Err(at(
                "suffix / infill (gap filling) is not run in a batch: use generate --template or serve's APIs",
            ));
        }
        if line.knobs.stream {
            return Err(at("stream is not used in a batch; drop it"));
        }
        let id = line.id.clone().unwrap_or(Value::Null);
        out.push((i + 1, id, line));
    }
    if out.is_empty() {
        bail!("{name}: no requests (one JSON object per line)");
    }
    Ok(out)
}

/// Options of a batch run from the command line.
pub struct BatchRun<'a> {
    pub base: DecodeParams,
    pub use_template: bool,
    pub parallel: usize,
    pub output: Option<&'a Path>,
    pub quiet: bool,
}

struct Answer<'t> {
    stream: TextStream<'t>,
    text: String,
    stops: Vec<String>,
    stopped: bool,
}

impl Answer<'_> {
    /// Adds committed tokens; true when a stop string was met (the text cut before it).
    fn push(&mut self, positions: &[u32], tokens: &[u32]) -> bool {
        if let Some(t) = self.stream.push(positions, tokens) {
            self.text.push_str(&t);
            let cut = self.stops.iter().filter_map(|s| self.text.find(s)).min();
            if let Some(cut) = cut {
                self.text.truncate(cut);
                self.stopped = true;
            }
        }
        self.stopped
    }

    fn finish(&mut self) {
        if !self.stopped {
            if let Some(t) = self.stream.finish() {
                self.text.push_str(&t);
            }
        }
    }
}

/// What every line's sink shares: each line's result in input order, the answer tokens so
/// far, the progress bar.
struct Tally {
    results: RefCell<Vec<Option<Value>>>,
    generated: RefCell<usize>,
    bar: indicatif::ProgressBar,
}

/// Where a line is in the input: its index, its line number and its `id`.
struct LineRef {
    index: usize,
    line_no: usize,
    id: Value,
}

impl Tally {
    fn fail(&self, at: &LineRef, msg: String) {
        let v = json!({"index": at.index, "line": at.line_no, "id": at.id, "error": msg});
        self.results.borrow_mut()[at.index] = Some(v);
    }

    /// The scheduler request of one line: its answer gathered, cut at a stop string (which
    /// cancels the rest), and its result recorded when it ends.
    fn request<'a>(
        &'a self,
        at: LineRef,
        prompt: Vec<u32>,
        params: DecodeParams,
        mut answer: Answer<'a>,
    ) -> Request<'a> {
        let cancel = Arc::new(AtomicBool::new(false));
        let flag = cancel.clone();
        let prompt_tokens = prompt.len();
        let sink = Box::new(move |u: Update<'_>| match u {
            Update::Event(Event::Committed { positions, tokens }) => {
                let stopped = answer.push(positions, tokens);
                flag.fetch_or(stopped, std::sync::atomic::Ordering::SeqCst);
            }
            Update::Finished(r) => {
                answer.finish();
                let v = finished(at.index, at.line_no, &at.id, prompt_tokens, &answer, r);
                if let Some(c) = v.get("answer_tokens").and_then(Value::as_u64) {
                    *self.generated.borrow_mut() += c as usize;
                }
                self.results.borrow_mut()[at.index] = Some(v);
                self.bar.inc(1);
            }
            _ => {}
        });
        Request {
            prompt,
            params,
            cancel,
            sink,
        }
    }
}

/// Runs every line and writes the results in input order (atomically into `output`).
pub fn run(loaded: &Loaded, lines: Vec<(usize, Value, Line)>, opts: &BatchRun<'_>) -> Result<()> {
    let tok = &*loaded.tokenizer;
    let template = loaded
        .file
        .header
        .get("tokenizer.chat_template")
        .and_then(|v| v.as_str())
        .map(ChatTemplate::new)
        .transpose()?;
    let n = lines.len();
    let tally = Tally {
        results: RefCell::new(vec![None; n]),
        generated: RefCell::new(0),
        bar: progress(n, opts.quiet),
    };
    let cache = loaded.new_cache(loaded.context)?;
    let mut sched = Scheduler::new(&loaded.model, cache, opts.parallel);
    let mut out = Output::open(opts.output)?;
    let start = Instant::now();
    for (index, (line_no, id, line)) in lines.into_iter().enumerate() {
        let at = LineRef { index, line_no, id };
        let params = match line.knobs.params(&opts.base, loaded.context as u32) {
            Ok(p) => p,
            Err(e) => {
                tally.fail(&at, e.message().to_string());
                continue;
            }
        };
        let prompt = match line_prompt(&line, tok, template.as_ref(), opts.use_template) {
            Ok(p) => p,
            Err(e) => {
                tally.fail(&at, e.to_string());
                continue;
            }
        };
        let answer = Answer {
            stream: TextStream::new(tok, prompt.len(), params.eos_id).limit(params.answer_limit()),
            text: String::new(),
            stops: line
                .knobs
                .stop
                .as_ref()
                .map(|s| s.list())
                .unwrap_or_default(),
            stopped: false,
        };
        sched.submit(tally.request(at, prompt, params, answer));
    }
    let mut written = 0;
    loop {
        let more = sched.step();
        written = out.write_ready(&tally.results, written)?;
        if !more {
            break;
        }
    }
    written = out.write_ready(&tally.results, written)?;
    debug_assert_eq!(written, n);
    out.finish()?;
    tally.bar.finish_and_clear();
    if !opts.quiet {
        let tokens = *tally.generated.borrow();
        report(
            n,
            tokens,
            start.elapsed().as_secs_f64(),
            &sched.stats(),
            opts.parallel,
        );
    }
    Ok(())
}

/// The batch's figures on stderr.
fn report(n: usize, tokens: usize, secs: f64, st: &refusion_engine::sched::Stats, parallel: usize) {
    eprintln!(
        "batch: {n} requests, {tokens} answer tokens in {secs:.2} s ({:.1} tokens/s), {} forwards of {:.1} tokens on average, {} prompt tokens of {} from cached prompts, -np {parallel}",
        tokens as f64 / secs.max(1e-9),
        st.forwards,
        st.forward_tokens as f64 / st.forwards.max(1) as f64,
        st.prompt_tokens_reused,
        st.prompt_tokens,
    );
}

/// A line's prompt tokens.
fn line_prompt(
    line: &Line,
    tok: &refusion_engine::chat::Tokenizer,
    template: Option<&ChatTemplate>,
    use_template: bool,
) -> Result<Vec<u32>> {
    let render = |messages: &[Message]| -> Result<Vec<u32>> {
        let t = template.context("the model file has no chat template; pass --no-chat-template")?;
        Ok(tok.encode(&t.render(messages, true)?)?)
    };
    let mut messages = Vec::new();
    if let Some(s) = &line.system {
        messages.push(Message::new("system", s));
    }
    match (&line.prompt, &line.messages) {
        (Some(LinePrompt::Ids(ids)), _) => Ok(ids.clone()),
        (Some(LinePrompt::Text(text)), _) if !use_template => Ok(tok.encode(text)?),
        (Some(LinePrompt::Text(text)), _) => {
            messages.push(Message::new("user", text));
            render(&messages)
        }
        (None, Some(ms)) => {
            for m in ms {
                messages.push(Message::new(
                    &m.role,
                    &m.content
                        .text()
                        .map_err(|e| anyhow::anyhow!("{}", e.message()))?,
                ));
            }
            render(&messages)
        }
        (None, None) => bail!("needs a prompt or messages"),
    }
}

fn finished(
    index: usize,
    line: usize,
    id: &Value,
    prompt_tokens: usize,
    answer: &Answer<'_>,
    r: refusion_engine::error::Result<DecodeResult>,
) -> Value {
    match r {
        Ok(r) => json!({
            "index": index, "line": line, "id": id,
            "text": answer.text,
            "finish_reason": if r.eos_index.is_some() { "stop" } else { "length" },
            "tokens": r.answer(),
            "prompt_tokens": prompt_tokens,
            "answer_tokens": r.answer().len(),
            "tpf": r.tpf,
            "forward_calls": r.forward_calls,
        }),
        Err(refusion_engine::error::Error::Cancelled) if answer.stopped => json!({
            "index": index, "line": line, "id": id,
            "text": answer.text,
            "finish_reason": "stop",
            "prompt_tokens": prompt_tokens,
        }),
        Err(e) => json!({"index": index, "line": line, "id": id, "error": e.to_string()}),
    }
}

fn progress(n: usize, quiet: bool) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    // Drawn only on a terminal (indicatif hides itself otherwise).
    let bar = indicatif::ProgressBar::new(n as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{bar:30} {pos}/{len} requests [{elapsed_precise}, ETA {eta}]",
    ) {
        bar.set_style(style);
    }
    bar
}

/// Results in input order, to stdout or atomically to a file (`FILE.partial`, renamed when
/// every line is written; removed on an error).
struct Output {
    file: Option<(AtomicFile, PathBuf)>,
    buf: Vec<u8>,
}

impl Output {
    fn open(path: Option<&Path>) -> Result<Output> {
        let file = match path {
            Some(p) => Some((AtomicFile::create(p)?, p.to_path_buf())),
            None => None,
        };
        Ok(Output {
            file,
            buf: Vec::new(),
        })
    }

    /// Writes the results from `from` on that are ready and contiguous; returns how many are
    /// written in all.
    fn write_ready(&mut self, results: &RefCell<Vec<Option<Value>>>, from: usize) -> Result<usize> {
        let mut done = from;
        let results = results.borrow();
        self.buf.clear();
        while let Some(Some(v)) = results.get(done) {
            self.buf.extend_from_slice(v.to_string().as_bytes());
            self.buf.push(b'\n');
            done += 1;
        }
        if !self.buf.is_empty() {
            match &mut self.file {
                Some((f, p)) => f
                    .file()
                    .write_all(&self.buf)
                    .with_context(|| format!("{}", p.display()))?,
                None => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&self.buf)?;
                    out.flush()?;
                }
            }
        }
        Ok(done)
    }

    fn finish(self) -> Result<()> {
        if let Some((f, _)) = self.file {
            f.commit()?;
        }
        Ok(())
    }
}
