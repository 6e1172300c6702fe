//! Streaming an answer as text: ReFusion commits slots in any order, so text is released only
//! as the contiguous prefix after the prompt grows, and never past the first EOS.

use std::collections::BTreeMap;

use super::Tokenizer;

pub struct TextStream<'t> {
    tokenizer: &'t Tokenizer,
    prompt_len: u32,
    eos: u32,
    committed: BTreeMap<u32, u32>,
    prefix: Vec<u32>,
    emitted: usize,
    done: bool,
    limit: usize,
}

impl<'t> TextStream<'t> {
    pub fn new(tokenizer: &'t Tokenizer, prompt_len: usize, eos: u32) -> TextStream<'t> {
        TextStream {
            tokenizer,
            prompt_len: prompt_len as u32,
            eos,
            committed: BTreeMap::new(),
            prefix: Vec::new(),
            emitted: 0,
            done: false,
            limit: usize::MAX,
        }
    }

    /// Stops the text after `n` tokens (the gen length: slot decoding may commit a little past
    /// it, rounding it up to whole slots).
    pub fn limit(mut self, n: usize) -> Self {
        self.limit = n;
        self
    }

    /// Whether the text has ended (its EOS was reached).
    pub fn ended(&self) -> bool {
        self.done
    }

    /// Records committed tokens and returns the text that became final, if any.
    pub fn push(&mut self, positions: &[u32], tokens: &[u32]) -> Option<String> {
        for (&p, &t) in positions.iter().zip(tokens) {
            self.committed.insert(p, t);
        }
        let before = self.prefix.len();
        while !self.done {
            if self.prefix.len() >= self.limit {
                self.done = true;
                break;
            }
            let next = self.prompt_len + self.prefix.len() as u32;
            match self.committed.get(&next) {
                Some(&t) if t == self.eos => self.done = true,
                Some(&t) => self.prefix.push(t),
                None => break,
            }
        }
        if self.prefix.len() == before {
            return None;
        }
        let text = self.tokenizer.decode(&self.prefix, true).ok()?;
        // Hold back an incomplete UTF-8 sequence (a token boundary inside a character).
        let stable = text.trim_end_matches('\u{FFFD}');
        if stable.len() <= self.emitted || !stable.is_char_boundary(self.emitted) {
            return None;
        }
        let new = stable[self.emitted..].to_string();
        self.emitted = stable.len();
        Some(new)
    }

    /// At the end of the answer: what was held back (an incomplete UTF-8 sequence, shown as
    /// the replacement character, as a full decode of the answer shows it).
    pub fn finish(&mut self) -> Option<String> {
        let text = self.tokenizer.decode(&self.prefix, true).ok()?;
        if text.len() <= self.emitted || !text.is_char_boundary(self.emitted) {
            return None;
        }
        let rest = text[self.emitted..].to_string();
        self.emitted = text.len();
        Some(rest)
    }

    /// The text released so far.
    pub fn emitted_len(&self) -> usize {
        self.emitted
    }
}
