//! OpenAI's API: `/v1/chat/completions` and `/v1/completions`, streamed (server-sent events)
//! or whole, and `/v1/models`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use super::api::{
    parse_with_knobs, ApiError, ChatRequest, CompletionRequest, Endpoint, PromptField,
};
use super::fill::{stitch, FillSource, FillSpec};
use super::jobs::{collect, enqueue, now, started, submit, usage, UsageTail};
use crate::jobs::Msg;
use crate::prepare::JobInput;
use crate::tool_stream::{self, CallStream};
use crate::tools;
use crate::AppState;
use refusion_engine::decode::TextPiece;

pub(super) async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match chat_inner(&state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn chat_inner(state: &Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let mut req: ChatRequest = parse_with_knobs(&body)?;
    req.knobs.read_scoring(Endpoint::Chat)?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty").param("messages"));
    }
    let template = if req.infill {
        let mut spec = infill_answer(&mut req.messages)?;
        spec.parse_special = req.parse_special;
        Some(spec)
    } else {
        None
    };
    let plan = tools::plan(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    if plan.read_calls && template.is_some() {
        return Err(
            ApiError::bad_request("tools and infill cannot be used together").param("tools"),
        );
    }
    let messages = req
        .messages
        .iter()
        .map(|m| m.message())
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(f) = plan.forced.clone() {
        req.knobs.forced = Some((f, "tool_choice"));
    }
    req.knobs.calls = plan.calls.clone();
    let stream = req.knobs.stream;
    if req.knobs.decode_events && !stream {
        return Err(ApiError::bad_request(
            "decode_events streams the decode's steps: it needs stream: true",
        )
        .param("decode_events"));
    }
    let include_usage = req
        .knobs
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let pieces = match &template {
        Some(t) => Some(t.pieces(1)?),
        None => None,
    };
    let input = JobInput::Chat {
        messages,
        tools: plan.tools.clone(),
    };
    let (rx, guard, _) = submit(state, input, req.knobs, template).await?;
    let n = state.next_id.fetch_add(1, Ordering::Relaxed).to_string();
    let id = format!("chatcmpl-{n}");
    let created = now();
    let model = state.model.clone();
    if !stream {
        let got = collect(rx).await?;
        drop(guard);
        let logprobs = got.scores.as_ref().map_or(json!(null), |s| s.chat());
        let mut choice = json!({"index": 0, "message": {"role": "assistant", "content": got.text}, "logprobs": logprobs, "finish_reason": got.finish_reason});
        if let Some(pieces) = &pieces {
            // The answer with its gaps filled, and each gap's fill.
            let fills = gap_fills(pieces, &got.fills);
            choice["message"]["content"] = json!(stitch(pieces, &fills));
            choice["fills"] = json!(fills);
        }
        if plan.read_calls {
            let parsed = tools::read(&got.text, got.finish_reason == "length")?;
            if !parsed.calls.is_empty() {
                let content = Some(parsed.content).filter(|c| !c.is_empty());
                choice["message"] = json!({"role": "assistant", "content": content,
                                           "tool_calls": tools::openai_calls(parsed.calls.iter().enumerate(), &n)});
                choice["finish_reason"] = json!("tool_calls");
            }
        }
        return Ok(Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice],
            "usage": usage(got.prompt_tokens, got.completion_tokens),
            "timings": got.figures.timings(got.prompt_tokens, got.completion_tokens),
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
    let mut watch = plan.read_calls.then(CallStream::default);
    let events = UnboundedReceiverStream::new(rx).filter_map(move |msg| {
        let _keep = &guard;
        match msg {
            Msg::Delta(d) => {
                let delta = match watch.as_mut() {
                    // Text, and calls as they are written (OpenAI's tool_calls deltas).
                    Some(w) => tool_stream::delta(&w.push(&d), &n)?,
                    None if d.is_empty() => return None,
                    None => json!({ "content": d }),
                };
                Some(SseEvent::default().data(chunk(delta, None)))
            }
            Msg::Fill { gap, text } => {
                Some(SseEvent::default().data(chunk(json!({"content": text, "gap": gap}), None)))
            }
            Msg::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                figures,
            } => {
                let mut v: serde_json::Value =
                    serde_json::from_str(&chunk(json!({}), Some(finish_reason))).ok()?;
                // What is still held back (text that only looked like a call, a call written
                // in another shape) goes out with the finish.
                if let Some(w) = &watch {
                    match w.finish(finish_reason == "length") {
                        Ok((rest, left)) => {
                            let mut delta = serde_json::Map::new();
                            if !rest.is_empty() {
                                delta.insert("content".into(), json!(rest));
                            }
                            if !left.is_empty() {
                                let calls = left.iter().map(|(i, c)| (*i, c));
                                delta.insert("tool_calls".into(), tools::openai_calls(calls, &n));
                            }
                            if w.called() || !left.is_empty() {
                                v["choices"][0]["finish_reason"] = json!("tool_calls");
                            }
                            v["choices"][0]["delta"] = serde_json::Value::Object(delta);
                        }
                        Err(e) => return Some(SseEvent::default().data(e.body().to_string())),
                    }
                }
                // Asked for, usage rides only on the extra last chunk (as OpenAI sends it: a
                // client summing usage per chunk counts it once); else on the finish chunk,
                // as llama-server puts it.
                if !include_usage {
                    v["usage"] = usage(prompt_tokens, completion_tokens);
                }
                v["timings"] = figures.timings(prompt_tokens, completion_tokens);
                tail.done(&v, prompt_tokens, completion_tokens);
                Some(SseEvent::default().data(v.to_string()))
            }
            Msg::End => tail.end(),
            Msg::Error(e) => Some(SseEvent::default().data(e.body().to_string())),
            Msg::Step(step) => Some(SseEvent::default().event("refusion.step").data(step)),
            Msg::Started { .. } | Msg::Scores(_) => None,
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

pub(super) async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match completions_inner(&state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn completions_inner(
    state: &Arc<AppState>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut req: CompletionRequest = parse_with_knobs(&body)?;
    req.knobs.read_scoring(Endpoint::Completions)?;
    if req.knobs.decode_events {
        return Err(ApiError::bad_request(
            "decode_events is served by /v1/chat/completions (streamed), not here",
        )
        .param("decode_events"));
    }
    let inputs = prompts(req.prompt, state.queue)?;
    // `echo`: each prompt's text goes before its answer.
    let echoes: Vec<String> = match req.knobs.scoring.echo {
        true => inputs.iter().map(|i| echo_text(state, i)).collect(),
        false => vec![String::new(); inputs.len()],
    };
    // An empty suffix is none (as in ollama): plain generation.
    let template = req
        .suffix
        .filter(|s| !s.is_empty())
        .map(|s| FillSpec::new(FillSource::Suffix(s), "suffix"));
    let include_usage = req
        .knobs
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    // All queued first (they decode together), then each waited for.
    let mut queued = Vec::with_capacity(inputs.len());
    for input in inputs {
        queued.push(enqueue(state, input, req.knobs.clone(), template.clone())?);
    }
    let mut streams = Vec::with_capacity(queued.len());
    for (mut rx, guard) in queued {
        started(&mut rx).await?;
        streams.push((rx, guard));
    }
    let head = Head {
        id: format!("cmpl-{}", state.next_id.fetch_add(1, Ordering::Relaxed)),
        created: now(),
        model: state.model.clone(),
    };
    if req.knobs.stream {
        Ok(stream_completions(head, streams, echoes, include_usage))
    } else {
        whole_completions(head, streams, echoes).await
    }
}

/// A prompt's text as `echo` repeats it: as sent, or its token ids' text.
fn echo_text(state: &AppState, input: &JobInput) -> String {
    match input {
        JobInput::Text(s) => s.clone(),
        JobInput::Tokens(ids) => state.tokenizer.decode(ids, false).unwrap_or_default(),
        JobInput::Chat { .. } => String::new(),
    }
}

/// OpenAI's prompt: a string, token ids, or a list of either (one choice each, in order), at
/// most as many as the queue holds.
fn prompts(prompt: PromptField, queue: usize) -> Result<Vec<JobInput>, ApiError> {
    let inputs: Vec<JobInput> = match prompt {
        PromptField::One(s) => vec![JobInput::Text(s)],
        PromptField::Many(v) => v.into_iter().map(JobInput::Text).collect(),
        PromptField::Tokens(ids) => vec![JobInput::Tokens(ids)],
        PromptField::TokenLists(v) => v.into_iter().map(JobInput::Tokens).collect(),
    };
    if inputs.is_empty() {
        return Err(ApiError::bad_request("prompt must not be an empty list").param("prompt"));
    }
    if inputs.len() > queue {
        return Err(ApiError::bad_request(format!(
            "at most {queue} prompts per request (the queue's size), got {}",
            inputs.len()
        ))
        .param("prompt"));
    }
    Ok(inputs)
}

/// What every completion object repeats.
#[derive(Clone)]
struct Head {
    id: String,
    created: u64,
    model: String,
}

type Answering = (
    tokio::sync::mpsc::UnboundedReceiver<Msg>,
    super::jobs::CancelOnDrop,
);

/// Every prompt's answer whole (after its echoed prompt), as one `text_completion`.
async fn whole_completions(
    head: Head,
    streams: Vec<Answering>,
    echoes: Vec<String>,
) -> Result<Response, ApiError> {
    let (mut choices, mut p, mut c) = (Vec::new(), 0, 0);
    for (index, ((rx, guard), echo)) in streams.into_iter().zip(echoes).enumerate() {
        let got = collect(rx).await?;
        drop(guard);
        let logprobs = got.scores.as_ref().map_or(json!(null), |s| s.completions());
        let text = echo + &got.text;
        choices.push(json!({"index": index, "text": text, "finish_reason": got.finish_reason, "logprobs": logprobs}));
        (p, c) = (p + got.prompt_tokens, c + got.completion_tokens);
    }
    Ok(Json(json!({
        "id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
        "choices": choices,
        "usage": usage(p, c),
    }))
    .into_response())
}

/// Every prompt's answer streamed as it comes (server-sent events, choices by index; an
/// echoed prompt first), then the usage chunk (when asked for) and `[DONE]` once all have
/// ended.
fn stream_completions(
    head: Head,
    streams: Vec<Answering>,
    echoes: Vec<String>,
    include_usage: bool,
) -> Response {
    let n = streams.len();
    let chunk = move |index: usize, text: &str, finish: Option<&str>| {
        json!({"id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
               "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": null}]})
    };
    let mut merged = tokio_stream::StreamMap::new();
    let mut guards = Vec::with_capacity(n);
    for (index, (rx, guard)) in streams.into_iter().enumerate() {
        merged.insert(index, UnboundedReceiverStream::new(rx));
        guards.push(guard);
    }
    let echoed: Vec<SseEvent> = echoes
        .iter()
        .enumerate()
        .filter(|(_, e)| !e.is_empty())
        .map(|(index, e)| SseEvent::default().data(chunk(index, e, None).to_string()))
        .collect();
    let mut tail = UsageTail::new(include_usage);
    let (mut ended, mut p, mut c) = (0, 0, 0);
    let events = merged.filter_map(move |(index, msg)| {
        let _keep = &guards;
        match msg {
            // With a suffix, the one gap's fill is the completion.
            Msg::Delta(d) | Msg::Fill { text: d, .. } => {
                Some(SseEvent::default().data(chunk(index, &d, None).to_string()))
            }
            Msg::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                ..
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
            Msg::Started { .. } | Msg::Step(_) | Msg::Scores(_) => None,
        }
    });
    let events = tokio_stream::iter(echoed)
        .chain(events)
        .chain(tokio_stream::iter(UsageTail::last(include_usage)));
    Sse::new(events.map(Ok::<_, std::convert::Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// A chat request's final `assistant` message as the template to fill (taken off the
/// messages: the answer continues the conversation before it).
fn infill_answer(messages: &mut Vec<super::api::ChatMessage>) -> Result<FillSpec, ApiError> {
    let last = messages
        .last()
        .filter(|m| m.role == "assistant")
        .ok_or_else(|| {
            ApiError::bad_request(
                "infill: the last message must be the assistant's answer with {{gap}} markers",
            )
            .param("messages")
        })?;
    let text = last.content.text()?;
    messages.pop();
    if messages.is_empty() {
        return Err(ApiError::bad_request(
            "infill: the answer needs a conversation before it (at least one message)",
        )
        .param("messages"));
    }
    Ok(FillSpec::new(FillSource::Markers(text), "messages"))
}

/// Each gap's fill, `""` for a gap that got none.
fn gap_fills(pieces: &[TextPiece], got: &[String]) -> Vec<String> {
    let gaps = pieces
        .iter()
        .filter(|p| matches!(p, TextPiece::Gap(_)))
        .count();
    (0..gaps)
        .map(|i| got.get(i).cloned().unwrap_or_default())
        .collect()
}

pub(super) async fn models(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [{"id": state.model, "object": "model", "created": 0, "owned_by": "refusion"}]}))
        .into_response()
}
