//! `refusion._native`: the runtime for Python. The `refusion` package
//! (python/python/refusion/__init__.py) wraps it in llama-cpp-python's shapes; docs/python.md.
//!
//! A [`Model`] loads one GGUF file on its own thread ([`worker`]), which runs the engine's
//! scheduler: decodes asked from any Python thread are decoded together, each caller waiting
//! with the GIL released and Ctrl-C honoured between steps.

mod convert;
mod worker;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use refusion_engine::chat::{ChatTemplate, Message, Tokenizer};
use refusion_engine::decode::template::{parse, GapSize, TextPiece, TokenBytes};
use refusion_engine::decode::{DecodeParams, DecodeResult, Kind, Overrides, Template};
use refusion_engine::error::{Error, RequestError};
use refusion_engine::kv::{CacheType, KvTypes};
use refusion_engine::load::plan::GpuLayers;
use refusion_engine::load::runtime::{set_threads, DeviceChoice, LoadOptions};
use refusion_engine::load::Notes;
use worker::{Job, Ready, Reply};

/// How often a waiting caller takes the GIL back to look for Ctrl-C.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// A request's mistake as Python's `ValueError`.
fn bad_request(e: RequestError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// An engine error as Python's: the caller's mistakes `ValueError`, the rest `RuntimeError`,
/// each with the engine's one-line message.
fn py_err(e: Error) -> PyErr {
    match e {
        Error::Request(r) => PyValueError::new_err(r.to_string()),
        e => PyRuntimeError::new_err(e.to_string()),
    }
}

/// A loaded model and its decoding thread.
#[pyclass(frozen, module = "refusion._native")]
struct Model {
    ready: Ready,
    template: Option<ChatTemplate>,
    max_gen: u32,
    /// To the model's thread (dropped by `close`: the thread then ends).
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
}

#[pymethods]
impl Model {
    /// Loads `model_path` (a GGUF file) and starts its thread. The arguments are the CLI's
    /// flags: `-c`, `-t`, `-ngl`, `-ctk`, `-ctv`, `-np`, `--device`.
    #[new]
    #[pyo3(signature = (model_path, n_ctx=None, n_threads=None, n_gpu_layers=None,
                        cache_type_k=None, cache_type_v=None, n_parallel=4, max_tokens=4096,
                        device=None, verbose=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model_path: std::path::PathBuf,
        n_ctx: Option<usize>,
        n_threads: Option<usize>,
        n_gpu_layers: Option<i64>,
        cache_type_k: Option<&str>,
        cache_type_v: Option<&str>,
        n_parallel: usize,
        max_tokens: u32,
        device: Option<&str>,
        verbose: bool,
    ) -> PyResult<Model> {
        let notes = if verbose {
            Notes::to(|line| eprintln!("{line}"))
        } else {
            Notes::silent()
        };
        set_threads(n_threads, &notes).map_err(PyValueError::new_err)?;
        if !(1..=256).contains(&n_parallel) {
            return Err(PyValueError::new_err(format!(
                "n_parallel must be between 1 and 256, got {n_parallel}"
            )));
        }
        let opts = load_options(
            model_path,
            n_ctx,
            n_gpu_layers,
            (cache_type_k, cache_type_v),
            device,
            (verbose, notes, max_tokens),
        )?;
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("refusion-model".into())
            .spawn(move || worker::run(opts, n_parallel, max_tokens, rx, ready_tx))
            .map_err(|e| PyOSError::new_err(format!("cannot start the model's thread: {e}")))?;
        let ready = py
            .detach(move || ready_rx.recv())
            .map_err(|_| PyRuntimeError::new_err("the model's thread ended while loading"))?
            .map_err(PyOSError::new_err)?;
        let template = match &ready.chat_template {
            Some(src) => Some(ChatTemplate::new(src).map_err(py_err)?),
            None => None,
        };
        Ok(Model {
            ready,
            template,
            max_gen: max_tokens,
            jobs: Mutex::new(Some(tx)),
        })
    }

    /// Token ids of `text` (special tokens' text read as the tokens).
    fn tokenize(&self, py: Python<'_>, text: &str) -> PyResult<Vec<u32>> {
        let tok = self.ready.tokenizer.clone();
        let text = text.to_string();
        py.detach(move || tok.encode(&text)).map_err(py_err)
    }

    /// The text of `ids` (`skip_special`: without control tokens' names).
    #[pyo3(signature = (ids, skip_special=false))]
    fn detokenize(&self, ids: Vec<u32>, skip_special: bool) -> PyResult<String> {
        self.check_ids(&ids)?;
        self.ready
            .tokenizer
            .decode(&ids, skip_special)
            .map_err(py_err)
    }

    /// Each token's text and bytes, as `logprobs` show them.
    fn pieces(&self, ids: Vec<u32>) -> PyResult<Vec<(String, Vec<u8>)>> {
        self.check_ids(&ids)?;
        Ok(ids.iter().map(|&i| self.ready.tokenizer.piece(i)).collect())
    }

    /// The chat template's prompt for `messages` (`[(role, content)]`), the answer's turn open.
    fn apply_chat_template(&self, messages: Vec<(String, String)>) -> PyResult<String> {
        let t = self
            .template
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the model file has no chat template"))?;
        let messages: Vec<Message> = messages
            .iter()
            .map(|(role, content)| Message::new(role, content))
            .collect();
        t.render(&messages, true).map_err(py_err)
    }

    /// The file's decoding defaults, the context and the vocabulary.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let b = &self.ready.base;
        d.set_item("context", self.ready.context)?;
        d.set_item("vocab", self.ready.vocab)?;
        d.set_item("gen_length", b.gen_length)?;
        d.set_item("slot_size", b.slot_size)?;
        d.set_item("serial_blocks", b.serial_blocks)?;
        d.set_item("slot_threshold", b.slot_threshold)?;
        d.set_item("token_threshold", b.token_threshold)?;
        d.set_item("eos_id", b.eos_id)?;
        d.set_item("mask_id", b.mask_id)?;
        d.set_item("max_tokens", self.max_gen)?;
        d.set_item("description", &self.ready.description)?;
        Ok(d)
    }

    /// Decodes each prompt (token ids), all together; the results in order. The keyword
    /// arguments are the server's request fields; `template`: an answer whose `{{gap}}`
    /// markers are filled (docs/infill.md); `suffix`: the text after one gap (the prompt's end
    /// healed, as `/v1/completions`' `suffix`).
    #[pyo3(signature = (prompts, *, max_tokens=None, temperature=None, seed=None, slot_size=None,
                        serial_blocks=None, slot_threshold=None, token_threshold=None,
                        strategy=None, logprobs=None, echo=false, trace=false, template=None,
                        suffix=None))]
    #[allow(clippy::too_many_arguments)]
    fn decode<'py>(
        &self,
        py: Python<'py>,
        prompts: Vec<Vec<u32>>,
        max_tokens: Option<u32>,
        temperature: Option<f64>,
        seed: Option<u64>,
        slot_size: Option<u32>,
        serial_blocks: Option<u32>,
        slot_threshold: Option<f32>,
        token_threshold: Option<f32>,
        strategy: Option<String>,
        logprobs: Option<u32>,
        echo: bool,
        trace: bool,
        template: Option<String>,
        suffix: Option<String>,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let suffix = suffix.filter(|s| !s.is_empty());
        if template.is_some() && suffix.is_some() {
            return Err(PyValueError::new_err(
                "give a template or a suffix, not both",
            ));
        }
        let gaps = template.is_some() || suffix.is_some();
        let mut params = self.params(
            Overrides {
                max_tokens,
                temperature,
                seed,
                slot_size,
                serial_blocks,
                slot_threshold,
                token_threshold,
                strategy,
                logprobs,
                score_prompt: echo && logprobs.is_some(),
            },
            gaps,
        )?;
        if let Some(text) = template {
            let pieces = parse(&text, params.gen_length).map_err(bad_request)?;
            params = self.with_pieces(params, &pieces, None)?;
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let mut waiting: Vec<(Vec<u32>, mpsc::Receiver<Reply>)> = Vec::with_capacity(prompts.len());
        for mut prompt in prompts {
            let (tx, rx) = mpsc::channel();
            let mut params = params.clone();
            if let Some(s) = &suffix {
                let gap = TextPiece::Gap(GapSize::most(params.gen_length));
                let pieces = [gap, TextPiece::Text(s.clone())];
                params = self.with_pieces(params, &pieces, Some(&mut prompt))?;
            }
            self.send(Job {
                prompt: prompt.clone(),
                params,
                cancel: cancel.clone(),
                stream: false,
                trace,
                reply: tx,
            })?;
            waiting.push((prompt, rx));
        }
        let mut out = Vec::with_capacity(waiting.len());
        for (prompt, rx) in waiting {
            let (result, steps) = wait(py, rx, &cancel)?;
            out.push(convert::result(
                py,
                &self.ready.tokenizer,
                &prompt,
                &result,
                steps,
            )?);
        }
        Ok(out)
    }

    /// One decode whose text comes as it becomes final: an iterator of strings, then
    /// `Stream.result()`.
    #[pyo3(signature = (prompt, *, max_tokens=None, temperature=None, seed=None, slot_size=None,
                        serial_blocks=None, slot_threshold=None, token_threshold=None,
                        strategy=None))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        prompt: Vec<u32>,
        max_tokens: Option<u32>,
        temperature: Option<f64>,
        seed: Option<u64>,
        slot_size: Option<u32>,
        serial_blocks: Option<u32>,
        slot_threshold: Option<f32>,
        token_threshold: Option<f32>,
        strategy: Option<String>,
    ) -> PyResult<Stream> {
        let params = self.params(
            Overrides {
                max_tokens,
                temperature,
                seed,
                slot_size,
                serial_blocks,
                slot_threshold,
                token_threshold,
                strategy,
                ..Default::default()
            },
            false,
        )?;
        let cancel = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        self.send(Job {
            prompt: prompt.clone(),
            params,
            cancel: cancel.clone(),
            stream: true,
            trace: false,
            reply: tx,
        })?;
        Ok(Stream {
            prompt,
            tokenizer: self.ready.tokenizer.clone(),
            rx: Mutex::new(rx),
            cancel,
            result: Mutex::new(None),
        })
    }

    /// Ends the model's thread once its decodes are done (the object is unusable after).
    fn close(&self) {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    fn __repr__(&self) -> String {
        format!("<refusion Model: {}>", self.ready.description)
    }
}

impl Model {
    /// The request's fields over the file's defaults, checked (a mistake: `ValueError`); with
    /// `gaps` to fill, as the infill strategy's unless the request names another (as the
    /// server and the CLI check them).
    fn params(&self, o: Overrides, gaps: bool) -> PyResult<DecodeParams> {
        let mut base = self.ready.base.clone();
        if gaps {
            base.strategy = Kind::Infill;
        }
        o.apply(&base, self.max_gen).map_err(bad_request)
    }

    /// `params` decoding `pieces`' gaps (the infill strategy unless another is named), its
    /// spans tokenized as the CLI's `--template` and the server's do, the gaps within
    /// `max_tokens` together; with `prompt`, the prompt's end healed (a `suffix`: the text
    /// before the cursor is the prompt).
    fn with_pieces(
        &self,
        params: DecodeParams,
        pieces: &[TextPiece],
        prompt: Option<&mut Vec<u32>>,
    ) -> PyResult<DecodeParams> {
        let tok: &Tokenizer = &self.ready.tokenizer;
        let vocab: &dyn TokenBytes = tok;
        let mut t =
            Template::from_text(pieces, |s| tok.encode_text(s), Some(vocab)).map_err(py_err)?;
        t.validate_for(params.mask_id, self.ready.vocab, params.slot_size)
            .map_err(bad_request)?;
        let gaps = t.gap_positions(params.slot_size);
        if gaps > self.max_gen as u64 {
            return Err(PyValueError::new_err(format!(
                "template: its gaps hold {gaps} tokens together, more than this model's limit ({}: the max_tokens it was loaded with)",
                self.max_gen
            )));
        }
        if let Some(prompt) = prompt {
            t.heal_prompt_end(prompt, vocab);
        }
        let params = params.with_template(t);
        params.validate().map_err(bad_request)?;
        Ok(params)
    }

    fn check_ids(&self, ids: &[u32]) -> PyResult<()> {
        let vocab = self.ready.tokenizer.vocab_size();
        match ids.iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(PyValueError::new_err(format!(
                "token id {bad} is beyond the vocabulary ({vocab} tokens)"
            ))),
            None => Ok(()),
        }
    }

    fn send(&self, job: Job) -> PyResult<()> {
        let guard = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let tx = guard
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the model is closed"))?;
        tx.send(job)
            .map_err(|_| PyRuntimeError::new_err("the model's thread has ended"))
    }
}

/// The result of a job, the GIL released while it decodes; Ctrl-C (or any signal handler's
/// exception) cancels it between steps and is raised once it has stopped. (The receiver goes
/// into each wait and comes back: it may be moved to another thread, not shared with one.)
fn wait(
    py: Python<'_>,
    mut rx: mpsc::Receiver<Reply>,
    cancel: &AtomicBool,
) -> PyResult<(DecodeResult, Vec<convert::Step>)> {
    let mut steps = Vec::new();
    let mut interrupted: Option<PyErr> = None;
    loop {
        let (got, back) = py.detach(move || (rx.recv_timeout(SIGNAL_POLL), rx));
        rx = back;
        match got {
            Ok(Reply::Done(r)) => {
                return match (interrupted, r) {
                    (Some(e), _) => Err(e),
                    (None, r) => r.map(|r| (r, steps)).map_err(py_err),
                }
            }
            Ok(Reply::Step(s)) => steps.push(s),
            Ok(Reply::Text(_)) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(PyRuntimeError::new_err("the model's thread has ended"))
            }
        }
        if interrupted.is_none() {
            if let Err(e) = py.check_signals() {
                cancel.store(true, Ordering::SeqCst);
                interrupted = Some(e);
            }
        }
    }
}

/// A streamed decode: iterating gives the answer's text as it becomes final.
#[pyclass(frozen, module = "refusion._native")]
struct Stream {
    prompt: Vec<u32>,
    tokenizer: Arc<Tokenizer>,
    rx: Mutex<mpsc::Receiver<Reply>>,
    cancel: Arc<AtomicBool>,
    result: Mutex<Option<DecodeResult>>,
}

#[pymethods]
impl Stream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let next = || {
            let rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
            rx.recv_timeout(SIGNAL_POLL)
        };
        loop {
            match py.detach(next) {
                Ok(Reply::Text(t)) => return Ok(Some(t)),
                Ok(Reply::Step(_)) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Ok(Reply::Done(r)) => {
                    let r = r.map_err(py_err)?;
                    *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                    return Ok(None);
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(None),
            }
            if let Err(e) = py.check_signals() {
                self.cancel.store(true, Ordering::SeqCst);
                return Err(e);
            }
        }
    }

    /// The decode's result (as `Model.decode`'s), once the text is exhausted; None before.
    fn result<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let r = self.result.lock().unwrap_or_else(|e| e.into_inner());
        match r.as_ref() {
            Some(r) => Ok(Some(convert::result(
                py,
                &self.tokenizer,
                &self.prompt,
                r,
                Vec::new(),
            )?)),
            None => Ok(None),
        }
    }

    /// Stops the decode at its next step.
    fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

impl Drop for Stream {
    /// A stream dropped before its end stops its decode.
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

/// The engine's load options for the constructor's arguments (each checked, by name).
fn load_options(
    path: std::path::PathBuf,
    n_ctx: Option<usize>,
    n_gpu_layers: Option<i64>,
    (k, v): (Option<&str>, Option<&str>),
    device: Option<&str>,
    (verbose, notes, max_tokens): (bool, Notes, u32),
) -> PyResult<LoadOptions> {
    let kind = |name: &str, t: Option<&str>| -> PyResult<Option<CacheType>> {
        t.map(|t| {
            t.parse::<CacheType>()
                .map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
        })
        .transpose()
    };
    let k = kind("cache_type_k", k)?.unwrap_or(CacheType::F32);
    let v = kind("cache_type_v", v)?.unwrap_or(k);
    let gpu_layers = match n_gpu_layers {
        None => None,
        Some(n) if n < 0 => Some(GpuLayers::All),
        Some(n) => Some(GpuLayers::Count(n as usize)),
    };
    let device = match device {
        None => DeviceChoice::Auto,
        Some(d) => d
            .parse()
            .map_err(|e: String| PyValueError::new_err(format!("device: {e}")))?,
    };
    Ok(LoadOptions {
        path,
        context: n_ctx,
        cache_types: KvTypes { k, v },
        kv_file: None,
        device,
        gpu_layers,
        ubatch: 512,
        no_mmap: false,
        check_tensors: false,
        kv_extra: max_tokens as usize,
        default_threads: false,
        verbose,
        notes,
    })
}

/// A GGUF file of a Hugging Face repository, downloaded into the Hub's cache (or found there):
/// by a quant name or file name (`Q4_K_M`, `model-Q8_0.gguf`, `*q4_k_m.gguf`), else Q4_K_M or
/// the only one. The path.
#[pyfunction]
#[pyo3(signature = (repo_id, filename=None))]
fn hub_gguf(py: Python<'_>, repo_id: &str, filename: Option<&str>) -> PyResult<String> {
    use refusion_engine::load::hub::{Hub, RepoRef};
    let quant = filename.map(|f| f.trim_start_matches('*').to_string());
    let repo = RepoRef::new(repo_id, None);
    let path = py.detach(move || {
        let hub = Hub::from_env(false)?;
        hub.gguf(&repo, quant.as_deref())
    });
    path.map(|p| p.display().to_string())
        .map_err(|e| PyOSError::new_err(e.to_string()))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Model>()?;
    m.add_class::<Stream>()?;
    m.add_function(wrap_pyfunction!(hub_gguf, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
