//! OpenAI-compatible request bodies and the errors the server answers with.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value as Json};

use refusion_engine::constrain::Format;
use refusion_engine::error::{Error, RequestError};

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
        }
    }

    pub fn param(mut self, p: &str) -> ApiError {
        self.param = Some(p.to_string());
        self
    }

    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
        }
    }

    /// The message alone (for errors reported outside HTTP).
    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn body(&self) -> Json {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": null}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// A message's content: a string, or a list of parts of which the text parts count.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
    Null(()),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

impl Content {
    pub fn text(&self) -> Result<String, ApiError> {
        match self {
            Content::Text(s) => Ok(s.clone()),
            Content::Null(()) => Ok(String::new()),
            Content::Parts(parts) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::bad_request(format!(
                                "content part type '{kind}' is not supported"
                            ))
                            .param("messages"))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// Absent is empty (ollama's client drops empty fields).
    #[serde(default)]
    pub content: Content,
    /// An assistant turn's calls (OpenAI's shape), given back to the template.
    #[serde(default)]
    pub tool_calls: Option<Vec<Json>>,
    /// A tool turn's call id.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    /// ollama's images on a message: refused (the model reads text).
    #[serde(default)]
    pub images: Option<Json>,
}

/// ollama's `images` (on a message or a generate request): refused unless empty.
pub fn refuse_images(images: &Option<Json>) -> Result<(), ApiError> {
    match images {
        None | Some(Json::Null) => Ok(()),
        Some(Json::Array(a)) if a.is_empty() => Ok(()),
        Some(_) => Err(
            ApiError::bad_request("images is not supported: ReFusion reads text only")
                .param("images"),
        ),
    }
}

/// ollama's `think`: `true` (a separate reasoning trace) is refused; ReFusion answers
/// without one.
pub fn refuse_think(think: &Option<Json>) -> Result<(), ApiError> {
    match think {
        None | Some(Json::Null) | Some(Json::Bool(false)) => Ok(()),
        Some(_) => Err(ApiError::bad_request(
            "think is not supported: ReFusion answers without a separate reasoning trace",
        )
        .param("think")),
    }
}

impl ChatMessage {
    /// The message as the chat template reads it (the role checked).
    pub fn message(&self) -> Result<refusion_engine::chat::Message, ApiError> {
        if !matches!(self.role.as_str(), "system" | "user" | "assistant" | "tool") {
            return Err(
                ApiError::bad_request(format!("unknown role '{}'", self.role)).param("messages"),
            );
        }
        refuse_images(&self.images)?;
        let mut m = refusion_engine::chat::Message::new(&self.role, &self.content.text()?);
        m.tool_calls = self.tool_calls.clone();
        m.tool_call_id = self.tool_call_id.clone();
        m.name = self.name.clone();
        Ok(m)
    }
}

impl Default for Content {
    fn default() -> Content {
        Content::Null(())
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn list(&self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        }
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect()
    }
}

/// `stream_options`: `include_usage` adds a last chunk with the usage and no choices.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by both endpoints, including ReFusion's own knobs. Unknown fields are
/// ignored, as clients send many.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Knobs {
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub slot_size: Option<u32>,
    /// Choices per request: only 1 is supported (checked, never silently one).
    pub n: Option<u32>,
    pub stream_options: Option<StreamOptions>,
    pub serial_blocks: Option<u32>,
    pub slot_threshold: Option<f32>,
    pub token_threshold: Option<f32>,
    /// `slots` (the default), `ar` or `infill`.
    pub strategy: Option<String>,
    /// Stream the decode's steps as `refusion.step` events (chat completions, streamed).
    #[serde(default)]
    pub decode_events: bool,
    /// Log-probabilities: on completions the number of alternatives, on chat completions
    /// `true` (with `top_logprobs` alternatives); read by [`Knobs::read_scoring`].
    #[serde(default)]
    pub logprobs: Option<serde_json::Value>,
    #[serde(default)]
    pub top_logprobs: Option<serde_json::Value>,
    #[serde(default)]
    pub echo: Option<serde_json::Value>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`: the answer's format.
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    /// llama-server's: a JSON Schema the answer follows.
    #[serde(default)]
    pub json_schema: Option<serde_json::Value>,
    /// llama-server's: a GBNF grammar the answer follows.
    #[serde(default)]
    pub grammar: Option<String>,
    /// A format the handler sets (a required tool call, ollama's `format`), with the field
    /// it came from.
    #[serde(skip)]
    pub forced: Option<(Format, &'static str)>,
    /// Tool calls' grammar when the model may call (`tool_choice: "auto"`), held from where it
    /// opens a call; a format above wins over it.
    #[serde(skip)]
    pub calls: Option<Format>,
    /// What `logprobs`, `top_logprobs` and `echo` ask for, as the handler read them.
    #[serde(skip)]
    pub scoring: Scoring,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// The samplers' filters and penalties clients send (OpenAI's `top_p`, `presence_penalty`,
/// `frequency_penalty`; llama-server's `top_k`, `min_p`, ...), and the fields no decode here
/// acts on. A filter keeps the most likely token, so at temperature 0 (greedy) it changes
/// nothing and is accepted; above it, ReFusion samples its planning drafts with the
/// reference's noise, unfiltered, so a filtering value is refused by name. A penalty or bias
/// changes the logits, greedy or not: any value but its neutral one is refused.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    pub top_p: Option<f64>,
    pub top_k: Option<f64>,
    pub min_p: Option<f64>,
    pub typical_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repeat_penalty: Option<f64>,
    pub dry_multiplier: Option<f64>,
    pub mirostat: Option<f64>,
    pub logit_bias: Option<Json>,
    pub ignore_eos: Option<bool>,
    /// OpenAI's deprecated function calling (`tools` replaced it).
    pub functions: Option<Json>,
    pub function_call: Option<Json>,
    pub audio: Option<Json>,
    pub modalities: Option<Json>,
    pub prediction: Option<Json>,
    /// OpenAI's reasoning and tool-side options, which would change the answer: refused when
    /// given (ReFusion writes its answer without a reasoning phase, and searches nothing).
    pub reasoning_effort: Option<Json>,
    pub verbosity: Option<Json>,
    pub web_search_options: Option<Json>,
    /// llama-server's sampler chain by name (`["top_k", "top_p", "infill"]`, as llama.vim and
    /// llama.vscode send it): at temperature 0 no sampler acts; above it, a chain naming a
    /// filter or penalty is refused as the filters are.
    pub samplers: Option<Vec<String>>,
}

/// llama-server's sampler names (`--samplers`, the request's `samplers`).
const SAMPLERS: [&str; 11] = [
    "dry",
    "top_k",
    "typ_p",
    "typical_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
    "infill",
    "penalties",
    "top_n_sigma",
];

impl Sampling {
    /// Refuses what would act at `temperature` and what is never acted on.
    pub fn check(&self, temperature: f64) -> Result<(), ApiError> {
        let refuse = |name: &str, why: &str| {
            Err(ApiError::bad_request(format!("{name} is not supported: {why}")).param(name))
        };
        let filter = "ReFusion samples its planning drafts with the reference's noise, unfiltered (at temperature 0, greedy, a filter changes nothing and is accepted)";
        let penalty = "ReFusion's decoding takes the model's logits as they are";
        // Each with the value at which it does nothing, and whether it acts at temperature 0.
        let all = [
            ("top_p", self.top_p, 1.0, false),
            ("top_k", self.top_k, 0.0, false),
            ("min_p", self.min_p, 0.0, false),
            ("typical_p", self.typical_p, 1.0, false),
            ("presence_penalty", self.presence_penalty, 0.0, true),
            ("frequency_penalty", self.frequency_penalty, 0.0, true),
            ("repeat_penalty", self.repeat_penalty, 1.0, true),
            ("dry_multiplier", self.dry_multiplier, 0.0, true),
            ("mirostat", self.mirostat, 0.0, true),
        ];
        for (name, value, neutral, greedy_too) in all {
            let Some(v) = value else { continue };
            if !v.is_finite() {
                return Err(ApiError::bad_request(format!("{name} must be a number")).param(name));
            }
            if v != neutral && (greedy_too || temperature > 0.0) {
                return refuse(name, if greedy_too { penalty } else { filter });
            }
        }
        let given = |v: &Option<Json>| match v {
            None | Some(Json::Null) => false,
            Some(Json::Object(o)) => !o.is_empty(),
            Some(Json::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        if given(&self.logit_bias) {
            return refuse("logit_bias", penalty);
        }
        if self.ignore_eos == Some(true) {
            return refuse("ignore_eos", "an answer ends at its end-of-sequence token");
        }
        if given(&self.functions) || given(&self.function_call) {
            let field = if given(&self.functions) {
                "functions"
            } else {
                "function_call"
            };
            return refuse(
                field,
                "use tools and tool_choice (OpenAI's current function calling)",
            );
        }
        if given(&self.audio) {
            return refuse("audio", "ReFusion reads and writes text only");
        }
        let text_only = match &self.modalities {
            Some(Json::Array(a)) => a.iter().all(|m| m == "text"),
            _ => true,
        };
        if !text_only {
            return refuse("modalities", "ReFusion reads and writes text only");
        }
        if given(&self.prediction) {
            return refuse(
                "prediction",
                "predicted outputs are not used by slot decoding",
            );
        }
        match &self.reasoning_effort {
            None | Some(Json::Null) => {}
            Some(Json::String(e)) if e == "none" => {}
            Some(_) => {
                return refuse(
                    "reasoning_effort",
                    "ReFusion answers without a reasoning phase (send \"none\" or leave it out)",
                )
            }
        }
        if given(&self.verbosity) {
            return refuse(
                "verbosity",
                "the answer's length is max_tokens and the model's own",
            );
        }
        if given(&self.web_search_options) {
            return refuse("web_search_options", "refusion searches nothing");
        }
        self.check_samplers(temperature)
    }

    fn check_samplers(&self, temperature: f64) -> Result<(), ApiError> {
        for name in self.samplers.iter().flatten() {
            if !SAMPLERS.contains(&name.as_str()) {
                return Err(ApiError::bad_request(format!(
                    "samplers: unknown sampler {name:?} (llama-server's are {})",
                    SAMPLERS.join(", ")
                ))
                .param("samplers"));
            }
            if temperature > 0.0 && name != "temperature" {
                return Err(ApiError::bad_request(format!(
                    "samplers is not supported above temperature 0 ({name:?}): ReFusion samples its planning drafts with the reference's noise, unfiltered (at temperature 0, greedy, no sampler acts and the list is accepted)"
                ))
                .param("samplers"));
            }
        }
        Ok(())
    }
}

/// OpenAI's `response_format` as a format (none: text).
fn response_format(v: &Json) -> Result<Option<Format>, ApiError> {
    let bad = |m: &str| Err(ApiError::bad_request(m.to_string()).param("response_format"));
    if v.is_null() {
        return Ok(None);
    }
    match v.get("type").and_then(Json::as_str) {
        Some("text") => Ok(None),
        // llama-server also takes a schema here.
        Some("json_object") => Ok(Some(match v.get("schema") {
            Some(s) if !s.is_null() => Format::JsonSchema(s.clone()),
            _ => Format::Json,
        })),
        Some("json_schema") => match v.pointer("/json_schema/schema") {
            Some(s) if s.is_object() => Ok(Some(Format::JsonSchema(s.clone()))),
            _ => bad("response_format.json_schema.schema is required (a JSON Schema object)"),
        },
        _ => bad("response_format.type must be text, json_object or json_schema"),
    }
}

/// Which endpoint's `logprobs` fields a request's are: they differ in shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`: `logprobs` is the number of alternatives, `echo` repeats the prompt.
    Completions,
    /// `/v1/chat/completions`: `logprobs` is a switch, `top_logprobs` the alternatives.
    Chat,
}

/// What a request asks of log-probabilities (docs/logprobs.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Scoring {
    /// Each answer token's log-probability, with this many alternatives.
    pub logprobs: Option<u32>,
    /// The prompt repeated before the answer (`/v1/completions`' `echo`); with `logprobs`,
    /// its tokens scored too.
    pub echo: bool,
}

impl Knobs {
    /// Reads `logprobs`, `top_logprobs` and `echo` as `endpoint` defines them into
    /// [`Knobs::scoring`]; what cannot be honoured is refused by name. Their "off" values
    /// (`false`, `null`, `0`) pass everywhere.
    pub fn read_scoring(&mut self, endpoint: Endpoint) -> Result<(), ApiError> {
        use serde_json::Value;
        let bad = |field: &str, m: String| Err(ApiError::bad_request(m).param(field));
        let off = |v: &Option<Value>| match v {
            None | Some(Value::Null) | Some(Value::Bool(false)) => true,
            Some(Value::Number(n)) => n.as_u64() == Some(0),
            _ => false,
        };
        let count = |field: &str, v: &Option<Value>| -> Result<u32, ApiError> {
            let max = refusion_engine::decode::MAX_TOP_LOGPROBS;
            match v.as_ref().and_then(Value::as_u64) {
                Some(n) if n <= max as u64 => Ok(n as u32),
                _ if off(v) => Ok(0),
                _ => Err(ApiError::bad_request(format!(
                    "{field} must be an integer from 0 to {max}"
                ))
                .param(field)),
            }
        };
        let mut s = Scoring::default();
        match endpoint {
            Endpoint::Completions => {
                if !off(&self.top_logprobs) {
                    return bad("top_logprobs", "top_logprobs is not supported on /v1/completions (a chat completions field: logprobs gives the number of alternatives here)".into());
                }
                let n = count("logprobs", &self.logprobs)?;
                s.logprobs = (n > 0).then_some(n);
                s.echo = match &self.echo {
                    v if off(v) => false,
                    Some(Value::Bool(true)) => true,
                    _ => return bad("echo", "echo must be true or false".into()),
                };
            }
            Endpoint::Chat => {
                if !off(&self.echo) {
                    return bad(
                        "echo",
                        "echo is not supported on chat completions (a /v1/completions field)"
                            .into(),
                    );
                }
                let on = match &self.logprobs {
                    v if off(v) => false,
                    Some(Value::Bool(true)) => true,
                    _ => return bad("logprobs", "logprobs must be true or false on chat completions (top_logprobs gives the alternatives)".into()),
                };
                let top = count("top_logprobs", &self.top_logprobs)?;
                if top > 0 && !on {
                    return bad(
                        "top_logprobs",
                        "top_logprobs is not supported without logprobs: true".into(),
                    );
                }
                s.logprobs = on.then_some(top);
            }
        }
        self.set_scoring(s, "logprobs")
    }

    /// Asks for `s` (its request field: `field`): log-probabilities are kept with the decode's
    /// result, which a streamed or stop-cut answer does not wait for, so those are refused.
    pub fn set_scoring(&mut self, s: Scoring, field: &'static str) -> Result<(), ApiError> {
        if s.logprobs.is_some() {
            let bad = |m: String| Err(ApiError::bad_request(m).param(field));
            if self.stream {
                return bad(format!(
                    "{field} is not supported with stream: true (ask for the answer whole)"
                ));
            }
            if self.stop.as_ref().is_some_and(|st| !st.list().is_empty()) {
                return bad(format!("{field} is not supported with stop strings (the answer is cut by text, its log-probabilities by token)"));
            }
        }
        self.scoring = s;
        Ok(())
    }

    /// The format the answer must follow and the field that asked for it: one of
    /// `response_format`, `json_schema`, `grammar` and the handler's own.
    pub fn format(&self) -> Result<Option<(Format, &'static str)>, ApiError> {
        let mut found: Vec<(Format, &'static str)> = Vec::new();
        if let Some(v) = &self.response_format {
            if let Some(f) = response_format(v)? {
                found.push((f, "response_format"));
            }
        }
        if let Some(v) = self.json_schema.as_ref().filter(|v| !v.is_null()) {
            found.push((Format::JsonSchema(v.clone()), "json_schema"));
        }
        if let Some(g) = self.grammar.as_ref().filter(|g| !g.trim().is_empty()) {
            found.push((Format::Gbnf(g.clone()), "grammar"));
        }
        if let Some(f) = &self.forced {
            found.push(f.clone());
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|(_, n)| *n).collect();
            return Err(ApiError::bad_request(format!(
                "{} each constrain the answer: give one",
                names.join(" and ")
            ))
            .param(names[1]));
        }
        Ok(found.pop())
    }

    /// The request's decoding parameters: its fields over the server's defaults (`base`),
    /// checked; `n` other than 1 is refused here (one choice per request).
    pub fn params(
        &self,
        base: &refusion_engine::decode::DecodeParams,
        max_gen_length: u32,
    ) -> Result<refusion_engine::decode::DecodeParams, ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_request(
                "n must be 1: one choice per request is supported (send several requests)",
            )
            .param("n"));
        }
        let overrides = refusion_engine::decode::Overrides {
            max_tokens: self.max_completion_tokens.or(self.max_tokens),
            temperature: self.temperature,
            seed: self.seed,
            slot_size: self.slot_size,
            serial_blocks: self.serial_blocks,
            slot_threshold: self.slot_threshold,
            token_threshold: self.token_threshold,
            strategy: self.strategy.clone(),
            logprobs: self.scoring.logprobs,
            score_prompt: self.scoring.echo && self.scoring.logprobs.is_some(),
        };
        let params = overrides.apply(base, max_gen_length).map_err(|e| match e {
            refusion_engine::error::RequestError::Field { field, message } => {
                ApiError::bad_request(message).param(field)
            }
            e => ApiError::bad_request(e.to_string()),
        })?;
        self.sampling.check(params.temperature)?;
        Ok(params)
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// Fill the `{{gap}}` / `{{gap:N}}` markers of the final `assistant` message (any-order
    /// generation); without it, text is never read as markers.
    #[serde(default)]
    pub infill: bool,
    /// With `infill`: special tokens' text in the answer's known text is read as the tokens
    /// (llama.cpp's `parse_special`); by default it is text.
    #[serde(default)]
    pub parse_special: bool,
    /// Functions the model may call (OpenAI's list).
    #[serde(default)]
    pub tools: Option<Json>,
    /// `none`, `auto` (the default with tools), `required`, or a named function.
    #[serde(default)]
    pub tool_choice: Option<Json>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub knobs: Knobs,
}

/// `prompt`: a string, a list holding one string, token ids, or a list holding one list of
/// token ids (as OpenAI's and llama-server's completions take them).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    One(String),
    Many(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    /// The text after the completion: the completion fills the gap between the prompt and it
    /// (at most `max_tokens`), and the answer is that fill alone.
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub knobs: Knobs,
}

/// Parses a JSON body, turning every problem into a 400 that says what is wrong in plain
/// words, naming the field (`max_tokens must be an integer`) and setting `param` to it.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    parse_inner(body, &[])
}

/// [`parse`] for the OpenAI requests, whose [`Knobs`] are flattened into them.
pub fn parse_with_knobs<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    parse_inner(body, &[probe::<Knobs>, probe::<Sampling>])
}

/// [`parse`] for llama-server's `/completion` and `/infill`, whose shared fields
/// ([`crate::llama_fields::LlamaFields`]) are flattened into them.
pub(crate) fn parse_llama<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    parse_inner(
        body,
        &[probe::<crate::llama_fields::LlamaFields>, probe::<Sampling>],
    )
}

/// serde loses the path inside `#[serde(flatten)]`: a flattened part read on its own finds
/// the field (its path and error), when the mistake is in it.
type Probe = fn(&[u8]) -> Option<(String, serde_json::Error)>;

fn probe<U: serde::de::DeserializeOwned>(body: &[u8]) -> Option<(String, serde_json::Error)> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, U>(de) {
        Err(e) if e.path().to_string() != "." => Some((e.path().to_string(), e.into_inner())),
        _ => None,
    }
}

fn parse_inner<T: serde::de::DeserializeOwned>(
    body: &[u8],
    probes: &[Probe],
) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let value = deserialize_inner(de, body, probes)?;
    // One JSON value and nothing after it but whitespace: `{...}{...}` or `{...}xx` is not a
    // request to guess at.
    de.end().map_err(|e| {
        ApiError::bad_request(format!(
            "malformed JSON: trailing data after the request object ({e})"
        ))
    })?;
    Ok(value)
}

fn deserialize_inner<T: serde::de::DeserializeOwned>(
    de: &mut serde_json::Deserializer<serde_json::de::SliceRead<'_>>,
    body: &[u8],
    probes: &[Probe],
) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(de).map_err(|e| {
        let (mut path, mut inner) = (e.path().to_string(), e.into_inner());
        if path == "." && !(inner.is_syntax() || inner.is_eof()) {
            // The first flattened part that names the field (the sampler fields are
            // flattened once more, inside the others, so they come last).
            if let Some(found) = probes.iter().find_map(|p| p(body)) {
                (path, inner) = found;
            }
        }
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::bad_request(format!("malformed JSON: {inner}"));
        }
        // serde reads and checks at once, so a value of the wrong type can be met before the
        // body turns out not to be JSON at all (100,000 unclosed `[`): that is said first.
        if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            if e.is_syntax() || e.is_eof() {
                return ApiError::bad_request(format!("malformed JSON: {e}"));
            }
        }
        let msg = inner.to_string();
        let msg = msg.split(" at line ").next().unwrap_or(&msg);
        // A missing field is reported on the object that lacks it.
        if let Some(field) = msg
            .strip_prefix("missing field `")
            .and_then(|m| m.strip_suffix('`'))
        {
            let full = if path == "." || path.is_empty() {
                field.to_string()
            } else {
                format!("{path}.{field}")
            };
            return ApiError::bad_request(format!("{full} is required")).param(&full);
        }
        if path == "." || path.is_empty() {
            return ApiError::bad_request(format!("invalid request: {msg}"));
        }
        ApiError::bad_request(format!("{path} {}", plain(&path, msg))).param(&path)
    })
}

/// What a field must be, from serde's message about it.
fn plain(path: &str, msg: &str) -> String {
    let expected = msg.rsplit("expected ").next().unwrap_or(msg);
    let unsigned = ["u8", "u16", "u32", "u64", "usize"]
        .iter()
        .any(|t| expected.starts_with(t));
    if unsigned {
        "must be an integer of 0 or more".into()
    } else if expected.starts_with("i32") || expected.starts_with("i64") {
        "must be an integer".into()
    } else if expected.starts_with("f32") || expected.starts_with("f64") {
        "must be a number".into()
    } else if expected.starts_with("a boolean") {
        "must be true or false".into()
    } else if expected.starts_with("a string") {
        "must be a string".into()
    } else if expected.starts_with("a sequence") {
        "must be a list".into()
    } else if msg.contains("untagged enum") {
        match path.rsplit('.').next().unwrap_or(path) {
            "prompt" => "must be a string, a list of one string, or token ids".into(),
            "stop" => "must be a string or a list of strings".into(),
            "content" => "must be a string or a list of text parts".into(),
            _ => format!("has the wrong type ({msg})"),
        }
    } else {
        format!("is invalid ({msg})")
    }
}

/// The one place an engine error becomes an HTTP answer: a caller's mistake is a 400 naming
/// its field, the system's refusal a 503, anything else a 500.
impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
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
                    // The front ends name the field the grammar came in.
                    RequestError::Grammar(_) => err.param("response_format"),
                    // The front ends check their templates first and name their own field; this
                    // is the completions' one.
                    RequestError::Template(_) => err.param("suffix"),
                }
            }
            Error::Resource(m) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", m)
            }
            e => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_with_data_after_its_object_is_refused() {
        let ok = br#"{"messages":[{"role":"user","content":"hi"}]} "#;
        assert!(parse_with_knobs::<ChatRequest>(ok).is_ok());
        for bad in [
            &br#"{"messages":[{"role":"user","content":"hi"}]}{"a":1}"#[..],
            br#"{"messages":[{"role":"user","content":"hi"}]}xx"#,
            br#"{"messages":[{"role":"user","content":"hi"}]} 1"#,
        ] {
            let e = parse_with_knobs::<ChatRequest>(bad).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(format!("{e:?}").contains("trailing data"), "{e:?}");
        }
        assert!(parse::<Knobs>(b"{}{}").is_err());
    }

    #[test]
    fn a_body_that_is_not_json_is_called_malformed_whatever_it_starts_with() {
        for bad in [
            "[".repeat(100_000),
            format!("{}1", "[".repeat(100)),
            r#"{"max_tokens":"x","#.to_string(),
        ] {
            let e = parse_with_knobs::<ChatRequest>(bad.as_bytes()).unwrap_err();
            assert!(e.message().starts_with("malformed JSON"), "{e:?}");
        }
        let e = parse_with_knobs::<ChatRequest>(br#"{"max_tokens":"x"}"#).unwrap_err();
        assert!(e.message().contains("max_tokens"), "{e:?}");
    }
}
