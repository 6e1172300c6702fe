//! One answer on its way to the client, assembled on the worker's thread from the scheduler's
//! updates: the committed text streamed as deltas (cut at stop strings; a template's per gap),
//! the decode's steps drawn for the web page, and the last messages with the figures.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use crate::api::ApiError;
use crate::fill::Fills;
use crate::jobs::{Figures, Msg};
use crate::prepare::Prepared;
use crate::shutdown::{shutting_down, Shutdown};
use crate::stop::StopFilter;
use refusion_engine::chat::{TextStream, Tokenizer};
use refusion_engine::decode::{Event, Trace};
use refusion_engine::error::Error;
use refusion_engine::sched::{Sink, Update};

/// The scheduler's sink for `request`: every update becomes the client's messages on `tx`;
/// `cancel` is set when stop strings have ended the answer.
pub(crate) fn sink<'t>(
    request: &Prepared,
    tokenizer: &'t Tokenizer,
    shutdown: &'t Shutdown,
    cancel: Arc<AtomicBool>,
    tx: UnboundedSender<Msg>,
) -> Sink<'t> {
    let (params, prompt_tokens) = (&request.params, request.prompt.len());
    let stops = request.stops.clone();
    let mut answer = Answer {
        stream: TextStream::new(tokenizer, prompt_tokens, params.eos_id)
            .limit(params.answer_limit()),
        fills: params
            .template
            .is_some()
            .then(|| Fills::new(tokenizer, params, prompt_tokens, &stops)),
        filter: StopFilter::new(stops),
        prompt_tokens,
        scoring: params
            .logprobs
            .map(|_| (request.prompt.clone(), params.score_prompt)),
        reused: 0,
        started: None,
        forwards: 0,
    };
    let mut steps = request
        .decode_events
        .then(|| Steps::new(Trace::new(params, prompt_tokens as u32), tokenizer));
    Box::new(move |u: Update<'_>| match u {
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
                    cancel.store(true, Ordering::SeqCst);
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
            shutdown.end(&cancel);
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
    })
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

/// One answer on its way to the client: the committed text, cut at a stop string (a
/// template's: each gap's).
struct Answer<'t> {
    stream: TextStream<'t>,
    fills: Option<Fills<'t>>,
    filter: StopFilter,
    prompt_tokens: usize,
    /// With `logprobs`: the prompt (its tokens are named when scored) and whether it was.
    scoring: Option<(Vec<u32>, bool)>,
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
                if let Some((prompt, scored)) = &self.scoring {
                    let scores = crate::logprobs::Scores::new(&r, prompt, *scored, tokenizer);
                    msgs.push(Msg::Scores(Box::new(scores)));
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
                    .encode(self.filter.sent())
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
            Err(e) => Err(e.into()),
        }
    }
}
