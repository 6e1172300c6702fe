//! Log-probabilities as the OpenAI APIs return them: the decode's per-token figures
//! ([`refusion_engine::decode::TokenLogprob`]) with each token's text, in `/v1/completions`'
//! shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`; with `echo`, the
//! prompt's tokens first, the first of them unscored), in `/v1/chat/completions`' shape
//! (`content`: one object per token with its `bytes` and `top_logprobs`) and in llama-server's
//! (`completion_probabilities`, for `/completion`'s `n_probs`).

use serde_json::{json, Value};

use refusion_engine::chat::Tokenizer;
use refusion_engine::decode::{shortest_f64, DecodeResult, TokenLogprob};

/// One token as the client sees it.
#[derive(Debug, Clone)]
pub struct ScoredToken {
    pub id: u32,
    pub text: String,
    pub bytes: Vec<u8>,
    /// None for the prompt's first token (nothing before it to predict it).
    pub logprob: Option<f32>,
    /// The most likely tokens where it was chosen or scored, most likely first.
    pub top: Vec<Alternative>,
}

/// One of a token's most likely alternatives.
#[derive(Debug, Clone)]
pub struct Alternative {
    pub id: u32,
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// A request's scored tokens: the prompt's (when `echo` asked for them) and the answer's.
#[derive(Debug, Clone, Default)]
pub struct Scores {
    pub prompt: Vec<ScoredToken>,
    pub answer: Vec<ScoredToken>,
    /// The end-of-sequence token that ended the answer before `max_tokens` (no text).
    pub eos: Option<ScoredToken>,
}

fn scored(tok: &Tokenizer, id: u32, lp: Option<&TokenLogprob>) -> ScoredToken {
    let (text, bytes) = tok.piece(id);
    let top = lp
        .map(|l| {
            l.top
                .iter()
                .map(|&(t, p)| {
                    let (text, bytes) = tok.piece(t);
                    Alternative {
                        id: t,
                        text,
                        bytes,
                        logprob: p,
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    ScoredToken {
        id,
        text,
        bytes,
        logprob: lp.map(|l| l.logprob),
        top,
    }
}

impl Scores {
    /// `r`'s scores: the prompt's when it was scored, and the answer's tokens (up to, not
    /// including, its end-of-sequence token: the text the client gets).
    pub fn new(r: &DecodeResult, prompt: &[u32], prompt_scored: bool, tok: &Tokenizer) -> Scores {
        let prompt = if prompt_scored {
            let mut out = Vec::with_capacity(prompt.len());
            for (i, &id) in prompt.iter().enumerate() {
                let lp = i.checked_sub(1).and_then(|j| r.prompt_logprobs.get(j));
                out.push(scored(tok, id, lp));
            }
            out
        } else {
            Vec::new()
        };
        let answer = r
            .answer()
            .iter()
            .zip(&r.logprobs)
            .map(|(&id, lp)| scored(tok, id, Some(lp)))
            .collect();
        let eos = r
            .eos_index
            .filter(|&i| i == r.answer().len() && i < r.limit)
            .and_then(|i| Some(scored(tok, r.tokens[i], Some(r.logprobs.get(i)?))))
            .map(|s| ScoredToken {
                text: String::new(),
                bytes: Vec::new(),
                ..s
            });
        Scores {
            prompt,
            answer,
            eos,
        }
    }

    /// `/v1/completions`' `logprobs` object, over the prompt's tokens (when echoed), the
    /// answer's and the end-of-sequence token that ended it (as vLLM gives it: with no text;
    /// lm-evaluation-harness counts on one token after the prompt with `max_tokens: 1`);
    /// `text_offset` counts characters from the start of the returned text.
    pub fn completions(&self) -> Value {
        let all = self.prompt.iter().chain(&self.answer).chain(&self.eos);
        let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
        let mut offset = 0usize;
        for t in all {
            tokens.push(json!(t.text));
            lps.push(t.logprob.map_or(Value::Null, number));
            tops.push(match t.logprob {
                None => Value::Null,
                Some(_) => {
                    let mut m = serde_json::Map::new();
                    for a in &t.top {
                        m.entry(a.text.clone()).or_insert(number(a.logprob));
                    }
                    Value::Object(m)
                }
            });
            offsets.push(json!(offset));
            offset += t.text.chars().count();
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }

    /// `/v1/chat/completions`' `logprobs` object: the answer's tokens.
    pub fn chat(&self) -> Value {
        let content: Vec<Value> = self
            .answer
            .iter()
            .map(|t| {
                let top: Vec<Value> = t
                    .top
                    .iter()
                    .map(|a| json!({"token": a.text, "logprob": number(a.logprob), "bytes": a.bytes}))
                    .collect();
                json!({"token": t.text, "logprob": t.logprob.map_or(Value::Null, number),
                       "bytes": t.bytes, "top_logprobs": top})
            })
            .collect();
        json!({"content": content, "refusal": null})
    }

    /// llama-server's `completion_probabilities` (`n_probs`): the answer's tokens, each with
    /// its id, text, bytes, logprob and `top_logprobs`.
    pub fn llama(&self) -> Value {
        let entry = |id: u32, text: &str, bytes: &[u8], lp: Option<f32>| json!({"id": id, "token": text, "bytes": bytes, "logprob": lp.map_or(Value::Null, number)});
        let all: Vec<Value> = self
            .answer
            .iter()
            .map(|t| {
                let mut v = entry(t.id, &t.text, &t.bytes, t.logprob);
                let alts = t.top.iter();
                v["top_logprobs"] = alts
                    .map(|a| entry(a.id, &a.text, &a.bytes, Some(a.logprob)))
                    .collect();
                v
            })
            .collect();
        Value::Array(all)
    }
}

/// An f32 as its shortest decimal (-0.25, not -0.25000000372529), null when not finite.
fn number(x: f32) -> Value {
    if x.is_finite() {
        json!(shortest_f64(x))
    } else {
        Value::Null
    }
}
