//! A request built and checked in its handler, before it is queued: the chat template
//! rendered, the prompt tokenized, the decoding parameters (and a template's gaps) checked. A
//! mistake is the caller's 400 at once and never takes a place in the queue; the worker gets
//! only requests it can run (the scheduler's own checks aside: the context, the cache).

use std::sync::Arc;

use crate::api::{ApiError, Knobs};
use crate::fill::{FillSource, FillSpec};
use crate::worker::Limits;
use refusion_engine::chat::{ChatTemplate, Message, Tokenizer};
use refusion_engine::constrain::Format;
use refusion_engine::decode::{DecodeParams, Kind, Template};
use refusion_engine::load::runtime::Loaded;

/// What a request asks the model to continue.
pub enum JobInput {
    /// Messages through the chat template, with the tools the model may call.
    Chat {
        messages: Vec<Message>,
        tools: Option<serde_json::Value>,
    },
    Text(String),
    Tokens(Vec<u32>),
}

/// A request ready for the scheduler.
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub params: DecodeParams,
    /// Stop strings (the text is cut at the first one met).
    pub stops: Vec<String>,
    /// Stream the decode's steps (`refusion.step` events).
    pub decode_events: bool,
}

/// What checking a request needs from the model, shared by the handlers.
pub struct Preparer {
    tokenizer: Arc<Tokenizer>,
    /// The file's chat template (none: chat requests are refused).
    template: Option<ChatTemplate>,
    vocab: usize,
    base: DecodeParams,
    max_gen_length: u32,
}

impl Preparer {
    pub fn new(loaded: &Loaded, limits: &Limits) -> Preparer {
        let template = loaded
            .file
            .header
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .and_then(|s| ChatTemplate::new(s).ok());
        Preparer {
            tokenizer: loaded.tokenizer.clone(),
            template,
            vocab: refusion_engine::model::Forward::config(&loaded.model).vocab,
            base: limits.base.clone(),
            max_gen_length: limits.max_gen_length,
        }
    }

    /// The request's prompt and parameters, checked; `template`: gaps to fill in the answer.
    pub fn prepare(
        &self,
        input: &JobInput,
        knobs: &Knobs,
        template: Option<&FillSpec>,
    ) -> Result<Prepared, ApiError> {
        // A template is decoded by the infill strategy (unless the request names another):
        // its parameters are checked as that strategy's.
        let mut base = self.base.clone();
        if template.is_some() {
            base.strategy = Kind::Infill;
        }
        let mut params = knobs.params(&base, self.max_gen_length)?;
        if let Some(spec) = template {
            params = spec.apply(params, &self.tokenizer, self.vocab, self.max_gen_length)?;
        }
        if let Some((format, field)) = knobs.format()? {
            params = self.constrained(params, &format, field)?;
        } else if let Some(calls) = &knobs.calls {
            // A call the model opens is written in the tools' grammar.
            let guide = self.tokenizer.guides()?.compile_calls(calls);
            let guide =
                guide.map_err(|e| ApiError::bad_request(format!("tools: {e}")).param("tools"))?;
            params = params.with_guide(Arc::new(guide));
            params
                .validate()
                .map_err(|e| ApiError::bad_request(format!("tools: {e}")).param("tools"))?;
        }
        let mut prompt = self.prompt(input)?;
        if let (
            Some(FillSpec {
                source: FillSource::Suffix(_),
                ..
            }),
            Some(t),
        ) = (template, &params.template)
        {
            // The text before the cursor is the prompt: its end is healed as a span's would be.
            let mut t = Template::clone(t);
            t.heal_prompt_end(&mut prompt, &*self.tokenizer);
            params.template = Some(Arc::new(t));
        }
        Ok(Prepared {
            prompt,
            params,
            stops: knobs.stop.as_ref().map(|s| s.list()).unwrap_or_default(),
            decode_events: knobs.decode_events,
        })
    }

    /// `params` with the answer constrained to `format` (which came in `field`).
    fn constrained(
        &self,
        params: DecodeParams,
        format: &Format,
        field: &'static str,
    ) -> Result<DecodeParams, ApiError> {
        let refuse = |e: refusion_engine::error::RequestError| {
            ApiError::bad_request(format!("{field}: {e}")).param(field)
        };
        let guide = self.tokenizer.guides()?.compile(format).map_err(refuse)?;
        let params = params.with_guide(Arc::new(guide));
        params.validate().map_err(refuse)?;
        Ok(params)
    }

    /// The chat template's prompt for `messages` (and `tools`), the assistant's turn opened.
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
    ) -> Result<String, ApiError> {
        let t = self
            .template
            .as_ref()
            .ok_or_else(|| ApiError::bad_request("the model file has no chat template"))?;
        t.render_with_tools(messages, tools, true)
            .map_err(|e| ApiError::bad_request(e.to_string()))
    }

    fn prompt(&self, input: &JobInput) -> Result<Vec<u32>, ApiError> {
        let tok = &self.tokenizer;
        match input {
            JobInput::Chat { messages, tools } => {
                let text = self.render(messages, tools.as_ref())?;
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
