//! llama-server's `POST /infill`, in its shapes: the text between `input_prefix` and
//! `input_suffix`. llama-server builds `[input_extra] <FIM_PRE> prefix <FIM_SUF> suffix <FIM_MID>
//! prompt` for models trained on fill-in-the-middle tokens; ReFusion needs none: the prompt is
//! the extra context, the prefix and `prompt` (the middle's start, already written), and the
//! suffix is the known text after one gap of at most `n_predict` tokens (docs/infill.md).
//! Answered whole (`content`, `stop`, `tokens_predicted`, `timings`, ...) or streamed as
//! server-sent events of `{"content", "stop"}`.
//!
//! The editor plugins' fields (llama.vim, llama.vscode): `n_predict: 0` (a request that only
//! sends context) is answered at once with no content; `n_indent` ends the middle before its
//! first later line indented less (llama-server's rule); `t_max_predict_ms` bounds the
//! generation (past it, the middle is given up: empty content, `stop_type` "limit");
//! `response_fields` answers only the fields named (nested ones by `parent/child`, as keys).
//! The sampler fields (`top_k`, `top_p`, `samplers`, ...) are read as on every endpoint: at
//! temperature 0 (greedy) a filter changes nothing and is accepted, above it it is refused by
//! name ([`Sampling`]); `cache_prompt` is what the server does anyway; `t_max_prompt_ms` is
//! accepted as llama-server accepts it, which does not act on it either (its `slot_params`:
//! "TODO: implement"); `id_slot` as on `/completion`; `n_probs` is refused by name (a gap's
//! tokens get no log-probabilities).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use super::api::{parse_llama, ApiError};
use super::fill::{FillSource, FillSpec};
use super::jobs::{collect, submit};
use super::llama_fields::LlamaFields;
use crate::jobs::Msg;
use crate::prepare::JobInput;
use crate::AppState;

/// One file of `input_extra`: context before the prefix.
#[derive(Debug, Deserialize)]
struct Extra {
    #[serde(default)]
    filename: String,
    #[serde(default)]
    text: String,
}

#[derive(Debug, Deserialize)]
struct InfillRequest {
    #[serde(default)]
    input_prefix: String,
    #[serde(default)]
    input_suffix: String,
    #[serde(default)]
    input_extra: Vec<Extra>,
    /// The middle's beginning, already written (llama-server: after `<FIM_MID>`).
    #[serde(default)]
    prompt: String,
    /// The middle ends before its first later line indented less than this (in bytes of
    /// leading whitespace).
    n_indent: Option<u32>,
    /// The most milliseconds the generation may take (0: no limit).
    t_max_predict_ms: Option<u64>,
    /// llama-server reads it and does not act on it ("TODO: implement"); so here.
    #[serde(rename = "t_max_prompt_ms")]
    _t_max_prompt_ms: Option<i64>,
    #[serde(flatten)]
    llama: LlamaFields,
}

impl InfillRequest {
    /// The text before the gap: each extra file (its name on a line, then its text), the
    /// prefix, and the middle's start.
    fn before(&self) -> String {
        let mut s = String::new();
        for e in &self.input_extra {
            if !e.filename.is_empty() {
                s.push_str(&e.filename);
                s.push('\n');
            }
            s.push_str(&e.text);
            if !e.text.ends_with('\n') {
                s.push('\n');
            }
        }
        s.push_str(&self.input_prefix);
        s.push_str(&self.prompt);
        s
    }
}

pub async fn infill(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match infill_inner(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn infill_inner(state: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: InfillRequest = parse_llama(&body)?;
    let before = req.before();
    let knobs = req.llama.knobs()?;
    if knobs.scoring.logprobs.is_some() {
        return Err(ApiError::bad_request(
            "n_probs is not supported on /infill: the middle is a gap filled by slot decoding (docs/logprobs.md)",
        )
        .param("n_probs"));
    }
    let fields = req.llama.response_fields.clone();
    if knobs.max_tokens == Some(0) {
        // Context only (llama.vim sends its ring of chunks so): nothing to generate.
        let v = json!({"content": "", "stop": true, "model": state.model, "stop_type": "limit",
                       "tokens_predicted": 0, "tokens_evaluated": 0, "truncated": false});
        return Ok(Json(only(v, fields.as_deref())).into_response());
    }
    if before.is_empty() {
        return Err(ApiError::bad_request(
            "input_prefix (or input_extra, or prompt) must not be empty: the middle needs text before it",
        )
        .param("input_prefix"));
    }
    let template = FillSpec::new(FillSource::Suffix(req.input_suffix.clone()), "input_suffix");
    let (rx, guard, prompt_tokens) =
        submit(&state, JobInput::Text(before), knobs, Some(template)).await?;
    let model = state.model.clone();
    let last = move |reason: &str, predicted: usize, evaluated: usize| -> Value {
        json!({
            "content": "", "stop": true, "model": model,
            "stop_type": if reason == "stop" { "eos" } else { "limit" },
            "tokens_predicted": predicted, "tokens_evaluated": evaluated, "truncated": false,
        })
    };
    let limit = req
        .t_max_predict_ms
        .filter(|&ms| ms > 0)
        .map(std::time::Duration::from_millis);
    if !req.llama.stream {
        let got = match limit {
            Some(limit) => match tokio::time::timeout(limit, collect(rx)).await {
                Ok(got) => got?,
                // Past the time limit: the generation is cancelled (the guard goes) and the
                // middle given up.
                Err(_) => {
                    drop(guard);
                    let v = last("length", 0, prompt_tokens);
                    return Ok(Json(only(v, fields.as_deref())).into_response());
                }
            },
            None => collect(rx).await?,
        };
        drop(guard);
        let mut v = last(got.finish_reason, got.completion_tokens, got.prompt_tokens);
        v["content"] = json!(within_indent(&got.text, req.n_indent));
        v["timings"] = got
            .figures
            .timings(got.prompt_tokens, got.completion_tokens);
        return Ok(Json(only(v, fields.as_deref())).into_response());
    }
    let events = UnboundedReceiverStream::new(rx).filter_map(move |msg| {
        let _keep = &guard;
        let v = match msg {
            Msg::Delta(text) | Msg::Fill { text, .. } => json!({"content": text, "stop": false}),
            Msg::Done {
                finish_reason,
                completion_tokens,
                ..
            } => last(finish_reason, completion_tokens, prompt_tokens),
            Msg::Error(e) => e.body(),
            Msg::Started { .. } | Msg::Step(_) | Msg::Scores(_) | Msg::End => return None,
        };
        Some(Ok::<_, std::convert::Infallible>(
            SseEvent::default().data(v.to_string()),
        ))
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// llama-server's `n_indent`: the text up to its first line after the first that is not
/// blank and is indented less than `n_indent` bytes of whitespace (that line and the rest go).
fn within_indent(text: &str, n_indent: Option<u32>) -> String {
    let Some(n) = n_indent.filter(|&n| n > 0) else {
        return text.to_string();
    };
    let mut end = text.len();
    let mut at = match text.find('\n') {
        Some(i) => i + 1,
        None => return text.to_string(),
    };
    while at < text.len() {
        let line_end = text[at..].find('\n').map_or(text.len(), |i| at + i);
        let line = &text[at..line_end];
        let indent = line.len() - line.trim_start_matches([' ', '\t']).len();
        if !line.trim().is_empty() && (indent as u32) < n {
            end = at;
            break;
        }
        at = line_end + 1;
    }
    text[..end].to_string()
}

/// The answer with only `fields` (llama-server's `response_fields`: a nested field by its
/// path, `timings/predicted_n`, kept under that path as its key); all of it without.
pub(crate) fn only(v: Value, fields: Option<&[String]>) -> Value {
    let Some(fields) = fields else {
        return v;
    };
    let mut out = serde_json::Map::new();
    for f in fields {
        let got = f.split('/').try_fold(&v, |node, key| node.get(key));
        if let Some(got) = got {
            out.insert(f.clone(), got.clone());
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn n_indent_ends_the_middle_at_a_shallower_line() {
        let text = "x = 1\n    y = 2\n\n  z\nw";
        assert_eq!(within_indent(text, Some(4)), "x = 1\n    y = 2\n\n");
        assert_eq!(within_indent(text, None), text);
        assert_eq!(within_indent("one line", Some(8)), "one line");
    }

    #[test]
    fn response_fields_keep_the_paths_asked_for() {
        let v = json!({"content": "a", "timings": {"predicted_n": 3}, "stop": true});
        let got = only(
            v,
            Some(&[
                "content".into(),
                "timings/predicted_n".into(),
                "nope".into(),
            ]),
        );
        assert_eq!(got, json!({"content": "a", "timings/predicted_n": 3}));
    }
}
