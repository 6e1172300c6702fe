//! Many requests at once (continuous batching): each request is a decoding [`Strategy`] over its own
//! sequence of one shared KV cache; every step, the scheduler asks each running decoder for its
//! next batch, runs them all as one forward, and hands each its logits back. A new request
//! joins at the next step; a finished or cancelled one leaves at once, freeing its entries.
//!
//! Requests are admitted in arrival order (no request is overtaken, so none starves) up to
//! `parallel` at a time and as long as the cache has room for a request's prompt, answer and
//! scratch; the prompt entries of earlier requests are shared ([`prefixes`]).
//!
//! One request alone gives exactly the forwards, tokens and TPF of [`crate::decode::generate`];
//! with others, the same tokens (the kernels are batch-invariant).

pub mod prefixes;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::decode::{self, DecodeParams, DecodeResult, Event, Poll, Strategy};
use crate::error::{Error, RequestError, Result};
use crate::kv::{KvCache, SeqId};
use crate::model::{Batch, Forward, Logits, LogitsFor, LogitsRef};
use prefixes::Prefixes;

/// What a request hears of its decode.
pub enum Update<'e> {
    /// Admitted: decoding starts, `reused` prompt tokens borrowed from a cached prompt.
    Started {
        reused: usize,
    },
    Event(Event<'e>),
    /// A forward served it: the events since the last `Stepped` are one step.
    Stepped,
    /// The end: the result, [`Error::Cancelled`] when its cancel flag was set, or the error.
    Finished(Result<DecodeResult>),
}

pub type Sink<'a> = Box<dyn FnMut(Update<'_>) + 'a>;

pub struct Request<'a> {
    pub prompt: Vec<u32>,
    pub params: DecodeParams,
    /// Set to stop it (a client went away, a stop string was met): it leaves at the next step.
    pub cancel: Arc<AtomicBool>,
    pub sink: Sink<'a>,
}

struct Running<'a> {
    req: Request<'a>,
    seq: SeqId,
    dec: Box<dyn Strategy>,
    /// Its prompt's entries are in the cache (after its first forward) and cached for others.
    prompt_cached: bool,
    /// Own prompt entries (not borrowed): what stays cached when it ends.
    own_prompt: usize,
}

/// Counters for `/metrics` and the batch report.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub requests_finished: u64,
    pub requests_cancelled: u64,
    pub requests_failed: u64,
    pub tokens_generated: u64,
    pub prompt_tokens: u64,
    pub prompt_tokens_reused: u64,
    pub forwards: u64,
    pub forward_tokens: u64,
    /// Rows of logits the forwards computed (each a product with the whole output layer).
    pub forward_logit_rows: u64,
    /// Seconds spent in forwards, and in handing their logits to the decoders.
    pub forward_seconds: f64,
    pub feed_seconds: f64,
    /// Tokens of the last forward, and how many requests it served.
    pub last_batch_tokens: usize,
    pub last_batch_requests: usize,
    pub running: usize,
    pub waiting: usize,
    pub kv_used: usize,
    pub kv_capacity: usize,
    pub cached_prompts: usize,
}

pub struct Scheduler<'a, M: Forward + ?Sized> {
    model: &'a M,
    cache: KvCache,
    parallel: usize,
    /// Entries a request's prompt, answer and scratch may take (the context it is promised;
    /// the cache may be larger).
    request_limit: usize,
    waiting: VecDeque<Request<'a>>,
    running: Vec<Running<'a>>,
    prefixes: Prefixes,
    stats: Stats,
    /// The merged batch (reused between steps).
    batch: Batch,
    /// The logits of the last forward (the buffer kept from one forward to the next).
    logits: Logits,
}

/// Where a decoder's tokens and logits sit in the merged batch.
struct Part {
    logits_start: usize,
    logits_len: usize,
}

impl<'a, M: Forward + ?Sized> Scheduler<'a, M> {
    /// A scheduler over `cache` (its sequences are dropped: it becomes a pool), running up to
    /// `parallel` requests together.
    pub fn new(model: &'a M, mut cache: KvCache, parallel: usize) -> Scheduler<'a, M> {
        for id in cache.cells().seq_ids() {
            let _ = cache.remove_seq(id, 0);
        }
        let capacity = cache.shape().capacity;
        Scheduler {
            model,
            cache,
            parallel: parallel.max(1),
            request_limit: capacity,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefixes: Prefixes::new(64),
            stats: Stats {
                kv_capacity: capacity,
                ..Stats::default()
            },
            batch: Batch::default(),
            logits: Logits {
                vocab: 0,
                data: Vec::new(),
            },
        }
    }

    /// Limits what one request may take to `entries` of the cache (default: all of it).
    pub fn limit_requests(&mut self, entries: usize) {
        self.request_limit = entries.min(self.cache.shape().capacity);
    }

    /// Queues a request after checking it ([`decode::check`], the one check of a request: a
    /// mistake is answered at once through its sink).
    pub fn submit(&mut self, mut req: Request<'a>) {
        match decode::check(
            &req.prompt,
            &req.params,
            self.model.config().vocab,
            self.request_limit,
        ) {
            Ok(()) => self.waiting.push_back(req),
            Err(e) => {
                self.stats.requests_failed += 1;
                (req.sink)(Update::Finished(Err(e)));
            }
        }
    }

    /// Whether nothing is running or waiting.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.running = self.running.len();
        s.waiting = self.waiting.len();
        s.kv_used = self.cache.cells().used_slots();
        s.cached_prompts = self.prefixes.len();
        s
    }

    /// Entries in use (sequences and cached prompts), for tests.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Drops the cached prompts (every entry not used by a running request is freed).
    pub fn clear_prefixes(&mut self) {
        self.prefixes.clear(self.cache.cells_mut());
    }

    /// Runs one step: admits what fits, then one merged forward of every running decoder.
    /// Returns whether anything is left to do.
    pub fn step(&mut self) -> bool {
        self.reap_cancelled();
        self.admit();
        if self.running.is_empty() {
            return !self.waiting.is_empty();
        }
        if let Err(e) = self.forward_all() {
            // A failed forward leaves the cache's rows undefined for everyone in it.
            let msg = e.to_string();
            for r in std::mem::take(&mut self.running) {
                self.finish(r, Err(Error::Forward(msg.clone())));
            }
        }
        !self.is_idle()
    }

    /// Runs until every request has finished.
    pub fn run_to_end(&mut self) {
        while self.step() {}
    }

    fn reap_cancelled(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].cancel.load(Ordering::SeqCst) {
                if let Some(mut r) = self.waiting.remove(i) {
                    self.stats.requests_cancelled += 1;
                    (r.sink)(Update::Finished(Err(Error::Cancelled)));
                }
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].req.cancel.load(Ordering::SeqCst) {
                let r = self.running.swap_remove(i);
                self.finish(r, Err(Error::Cancelled));
            } else {
                i += 1;
            }
        }
    }

    /// Admits waiting requests in order while there is room (cached prompts are dropped, least
    /// recently used first, to make it).
    fn admit(&mut self) {
        while self.running.len() < self.parallel {
            let Some(req) = self.waiting.front() else {
                return;
            };
            let (gen, block) = req.params.answer_room();
            let (seq, reused) = loop {
                let reuse = req.params.max_reuse(req.prompt.len());
                let hit = self.prefixes.lookup(&req.prompt, reuse);
                let reused = hit.as_ref().map_or(0, |h| h.len);
                let borrow = hit.map(|h| h.segments).unwrap_or_default();
                let reserve = req.prompt.len() - reused + gen + block;
                if let Some(seq) = self.cache.add_seq(reserve, &borrow) {
                    break (seq, reused);
                }
                if !self.prefixes.evict_lru(self.cache.cells_mut()) {
                    if self.running.is_empty() {
                        // Nothing will free room: it can never run.
                        let mut req = self.waiting.pop_front().unwrap_or_else(|| unreachable!());
                        self.stats.requests_failed += 1;
                        (req.sink)(Update::Finished(Err(RequestError::TooLong {
                            prompt: req.prompt.len(),
                            gen,
                            block,
                            capacity: self.cache.cells().largest_free(),
                        }
                        .into())));
                    }
                    return;
                }
            };
            let Some(mut req) = self.waiting.pop_front() else {
                return;
            };
            self.stats.prompt_tokens += req.prompt.len() as u64;
            self.stats.prompt_tokens_reused += reused as u64;
            (req.sink)(Update::Started { reused });
            let dec = decode::start(&req.prompt, reused, &req.params);
            let own_prompt = req.prompt.len() - reused;
            self.running.push(Running {
                req,
                seq,
                dec,
                prompt_cached: false,
                own_prompt,
            });
        }
    }

    /// One forward of every running decoder's next batch, the logits handed back.
    fn forward_all(&mut self) -> Result<()> {
        let parts = self.gather()?;
        let forwarded = self.forward(parts.iter().filter(|p| p.is_some()).count())?;
        let fed_at = std::time::Instant::now();
        let done = self.feed_all(&parts, forwarded);
        self.stats.feed_seconds += fed_at.elapsed().as_secs_f64();
        for (i, err) in done.into_iter().rev() {
            let mut r = self.running.remove(i);
            let result = match err {
                Some(e) => Err(e),
                None => Ok(r.dec.result()),
            };
            self.finish(r, result);
        }
        Ok(())
    }

    /// Polls every running decoder and merges their batches into one; where each one's
    /// logits will be (`None`: it asked for no forward, it is done).
    fn gather(&mut self) -> Result<Vec<Option<Part>>> {
        self.batch.clear();
        let mut indices = Vec::new();
        let mut parts = Vec::with_capacity(self.running.len());
        for r in self.running.iter_mut() {
            let sink = &mut r.req.sink;
            match r.dec.poll(&mut |ev| sink(Update::Event(ev)))? {
                Poll::Done => parts.push(None),
                Poll::Forward(b) => {
                    let offset = self.batch.len();
                    let wanted = b.logit_indices();
                    parts.push(Some(Part {
                        logits_start: indices.len(),
                        logits_len: wanted.len(),
                    }));
                    indices.extend(wanted.iter().map(|&i| offset + i));
                    for i in 0..b.len() {
                        self.batch.push(b.tokens[i], b.positions[i], b.rows[i]);
                        self.batch.seqs.push(r.seq.0);
                    }
                }
            }
        }
        self.batch.logits_for = LogitsFor::Indices(indices);
        Ok(parts)
    }

    /// Runs the merged batch (`served` decoders' tokens), counted; false when it is empty.
    fn forward(&mut self, served: usize) -> Result<bool> {
        if self.batch.is_empty() {
            return Ok(false);
        }
        let st = &mut self.stats;
        st.forwards += 1;
        st.forward_tokens += self.batch.len() as u64;
        st.last_batch_tokens = self.batch.len();
        st.last_batch_requests = served;
        st.forward_logit_rows += self.batch.logit_indices().len() as u64;
        let t = std::time::Instant::now();
        self.model
            .forward_into(&self.batch, &mut self.cache, &mut self.logits)?;
        self.stats.forward_seconds += t.elapsed().as_secs_f64();
        Ok(true)
    }

    /// Hands each decoder its logits and caches a prompt once its entries are in; the
    /// decoders that are done or failed, by index in `running`.
    fn feed_all(&mut self, parts: &[Option<Part>], forwarded: bool) -> Vec<(usize, Option<Error>)> {
        let vocab = self.model.config().vocab;
        let mut done = Vec::new();
        for (i, (r, part)) in self.running.iter_mut().zip(parts).enumerate() {
            let Some(part) = part.as_ref().filter(|_| forwarded) else {
                done.push((i, None));
                continue;
            };
            let view = LogitsRef {
                vocab,
                data: &self.logits.data
                    [part.logits_start * vocab..(part.logits_start + part.logits_len) * vocab],
            };
            let sink = &mut r.req.sink;
            let fed = r.dec.feed(&view, &mut self.cache.seq(r.seq), &mut |ev| {
                sink(Update::Event(ev))
            });
            if let Err(e) = fed {
                done.push((i, Some(e)));
                continue;
            }
            sink(Update::Stepped);
            if !r.prompt_cached && r.dec.prompt_cached() {
                // The prompt's entries are in: they can serve later requests.
                r.prompt_cached = true;
                if r.own_prompt > 0 {
                    let prompt = &r.req.prompt;
                    if let Ok(segments) = self.cache.cells().prefix_segments(r.seq, prompt.len()) {
                        self.prefixes
                            .insert(self.cache.cells_mut(), prompt, segments);
                    }
                }
            }
            if r.dec.is_done() {
                done.push((i, None));
            }
        }
        done
    }

    /// Ends a request: frees its sequence (its prompt stays while cached) and answers it.
    fn finish(&mut self, mut r: Running<'a>, result: Result<DecodeResult>) {
        let keep = if r.prompt_cached { r.own_prompt } else { 0 };
        let _ = self.cache.remove_seq(r.seq, keep);
        match &result {
            Ok(d) => {
                self.stats.requests_finished += 1;
                self.stats.tokens_generated += d.completion_tokens() as u64;
            }
            Err(Error::Cancelled) => self.stats.requests_cancelled += 1,
            Err(_) => self.stats.requests_failed += 1,
        }
        (r.req.sink)(Update::Finished(result));
    }
}
