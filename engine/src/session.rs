//! A conversation over one KV cache: each new prompt reuses the longest cached prefix, and after
//! an answer the cache is compacted so that it holds exactly the prompt and the answer up to and
//! including the EOS (ReFusion may commit slots at positions after the EOS; those entries are
//! dropped, never re-encoded). Used by `chat` and `serve`.

use std::sync::atomic::AtomicBool;

use crate::chat::{ChatTemplate, Message, Tokenizer};
use crate::decode::{generate_cancellable, DecodeParams, DecodeResult, Event};
use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::Forward;

pub struct Session<'m, M: Forward + ?Sized> {
    model: &'m M,
    tokenizer: &'m Tokenizer,
    template: Option<ChatTemplate>,
    pub cache: KvCache,
    /// Token at each position of the cache's shared entries (positions 0..len).
    cached: Vec<u32>,
    /// The conversation so far (for `chat_turn`).
    pub messages: Vec<Message>,
    /// Tokens reused from the cache by the last generation.
    pub last_reused: usize,
}

impl<'m, M: Forward + ?Sized> Session<'m, M> {
    pub fn new(
        model: &'m M,
        tokenizer: &'m Tokenizer,
        template: Option<ChatTemplate>,
        mut cache: KvCache,
    ) -> Self {
        cache.crop(0);
        Session {
            model,
            tokenizer,
            template,
            cache,
            cached: Vec::new(),
            messages: Vec::new(),
            last_reused: 0,
        }
    }

    /// The tokenizer the session renders and decodes with.
    pub fn tokenizer(&self) -> &'m Tokenizer {
        self.tokenizer
    }

    /// The model it decodes with.
    pub fn model(&self) -> &'m M {
        self.model
    }

    /// Starts over: no messages, an empty cache.
    pub fn reset(&mut self) {
        self.messages.clear();
        self.cache.crop(0);
        self.cached.clear();
    }

    /// Drops what the cache holds but keeps the conversation: the next turn renders it in
    /// full (after a failed load, which may have written part of the cache).
    pub fn forget_cache(&mut self) {
        self.cache.crop(0);
        self.cached.clear();
    }

    /// Tokens the cache holds, by position.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.cached
    }

    /// Replaces the cache state (after loading a saved session or prompt cache): the cache's
    /// shared entries must be exactly the positions `0..tokens.len()`.
    pub fn set_cached(&mut self, tokens: Vec<u32>) {
        self.cached = tokens;
    }

    /// The chat template's rendering of `messages` with the assistant's turn opened.
    pub fn render(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let t = self
            .template
            .as_ref()
            .ok_or_else(|| Error::model("the model file has no chat template"))?;
        self.tokenizer.encode(&t.render(messages, true)?)
    }

    /// Keeps the cached prefix `prompt` shares and returns its length, as `generate` will
    /// (idempotent), so that a front end can report the reuse before the answer.
    pub fn prepare(&mut self, prompt: &[u32]) -> usize {
        self.last_reused = self.reuse_prefix(prompt);
        self.last_reused
    }

    /// Keeps the longest cached prefix of `prompt` (dropping everything else) and returns its
    /// length. At least one prompt token is left to feed, so the first forward has an input.
    fn reuse_prefix(&mut self, prompt: &[u32]) -> usize {
        let mut n = self
            .cached
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        n = n.min(prompt.len().saturating_sub(1));
        if n < self.cache.shared_len() || n < self.cached.len() {
            n = self.keep_positions(n);
            self.cached.truncate(n);
        }
        self.cache.clear_rows();
        n
    }

    /// Keeps the shared entries at positions `0..n`; on a device error, keeps nothing (the
    /// next prompt is then fed whole). Returns how many positions are kept.
    fn keep_positions(&mut self, n: usize) -> usize {
        match self.cache.retain_shared(|_, pos| (pos as usize) < n) {
            Ok(()) => n,
            Err(_) => {
                self.cache.crop(0);
                self.cached.clear();
                0
            }
        }
    }

    /// Generates after `prompt` (token ids), reusing the cache where the prompt starts with what
    /// it holds, and leaves the cache holding the prompt and the answer through its EOS.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        params: &DecodeParams,
        cancel: &AtomicBool,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<DecodeResult> {
        self.last_reused = self.reuse_prefix(prompt);
        let result = generate_cancellable(
            self.model,
            &mut self.cache,
            prompt,
            params,
            cancel,
            on_event,
        );
        let r = match result {
            Ok(r) => r,
            Err(e) => {
                // Keep only what is known good: the reused prefix and, if it was fed, the prompt.
                let keep = if self.cache.shared_len() >= prompt.len() {
                    prompt.len()
                } else {
                    self.last_reused
                };
                let keep = self.keep_positions(keep);
                self.cached = prompt[..keep.min(self.cache.shared_len())].to_vec();
                return Err(e);
            }
        };
        // The answer through its EOS, contiguous from the prompt on.
        let keep = match r.eos_index {
            Some(i) => i + 1,
            None => r.tokens.len(),
        };
        let mut tokens = prompt.to_vec();
        for (i, (&t, &p)) in r.tokens.iter().zip(&r.positions).take(keep).enumerate() {
            if p as usize != prompt.len() + i {
                break;
            }
            tokens.push(t);
        }
        // Only what the cache holds: left-to-right decoding never feeds its last token.
        let end = self
            .keep_positions(tokens.len())
            .min(self.cache.shared_len());
        tokens.truncate(end);
        self.cached = tokens;
        Ok(r)
    }

    /// One chat turn: adds the user's message, renders the whole conversation with the chat
    /// template, generates (reusing the cached conversation), and records the answer.
    pub fn chat_turn(
        &mut self,
        user: &str,
        params: &DecodeParams,
        cancel: &AtomicBool,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<(String, DecodeResult)> {
        let mut messages = self.messages.clone();
        messages.push(Message::new("user", user));
        let prompt = self.render(&messages)?;
        let r = self.generate(&prompt, params, cancel, on_event)?;
        let text = self.tokenizer.decode(r.answer(), true)?;
        messages.push(Message::new("assistant", &text));
        self.messages = messages;
        Ok((text, r))
    }
}
