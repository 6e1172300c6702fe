//! Constrained decoding: a grammar masks each token's logits, so the answer is always in its
//! language (JSON, JSON valid against a schema, a GBNF or Lark grammar, a tool call).
//!
//! llguidance does the hard part (an Earley parser over lexemes, the token masks walked over a
//! trie of the vocabulary, JSON Schema compiled to a grammar). This module adapts it:
//! - the vocabulary as llguidance's token trie ([`Guides`], built once per model);
//! - the formats requests ask for as its grammars ([`Format`]; GBNF through [`gbnf`]);
//! - one [`Constraint`] per decode, which the left-to-right strategy asks for the tokens
//!   allowed next and tells the token it chose.
//!
//! A grammar reads an answer left to right, so a constrained answer is decoded at its frontier:
//! left to right one token a forward (`ar`), or slot decoding's plan and verify on the slot
//! after the committed text (`slots`, [`crate::decode`]'s guided decoder). Either way the text
//! the grammar forces (a schema's keys and brackets, a tool call's tags) is committed without
//! the model ([`Constraint::forced`]).

pub mod gbnf;
pub mod tools;

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value as Json};
use toktrie::{ApproximateTokEnv, InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie};

use crate::error::{Error, RequestError, Result};

/// What an answer must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Format {
    /// Any JSON object (OpenAI's `json_object`, ollama's `"json"`).
    Json,
    /// JSON valid against this JSON Schema.
    JsonSchema(Json),
    /// llama.cpp's GBNF, `root` the start rule.
    Gbnf(String),
    /// llguidance's Lark dialect, `start` the start rule.
    Lark(String),
}

/// How JSON is written: Python's `json.dumps` separators, no free whitespace (a model that may
/// add whitespace anywhere can add it forever).
fn json_style() -> Json {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with the JSON style set, unless it sets its own.
pub(crate) fn styled(schema: &Json) -> Json {
    let mut s = schema.clone();
    if let Some(obj) = s.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(json_style);
    }
    s
}

impl Format {
    fn grammar(&self) -> std::result::Result<TopLevelGrammar, String> {
        Ok(match self {
            Format::Json => TopLevelGrammar::from_json_schema(styled(&json!({"type": "object"}))),
            Format::JsonSchema(s) => {
                if !(s.is_object() || s.is_boolean()) {
                    return Err("a JSON Schema is an object".into());
                }
                TopLevelGrammar::from_json_schema(styled(s))
            }
            Format::Gbnf(g) => TopLevelGrammar::from_lark(gbnf::to_lark(g)?),
            Format::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
        })
    }

    /// What the format is, in a few words (for messages and `--json`).
    pub fn describe(&self) -> &'static str {
        match self {
            Format::Json => "JSON",
            Format::JsonSchema(_) => "JSON Schema",
            Format::Gbnf(_) => "GBNF grammar",
            Format::Lark(_) => "Lark grammar",
        }
    }
}

/// The vocabulary as llguidance sees it, and the compiler of grammars over it: one per model.
pub struct Guides {
    factory: ParserFactory,
    /// The trie's end-of-sequence token (the tokenizer's), which the grammar allows where
    /// it is complete.
    trie_eos: u32,
    tokenize: Option<Shared>,
    vocab: usize,
    /// The tokens whose text opens a tool call (`<tool_call>`...).
    opens_call: Arc<Vec<u32>>,
}

/// [`Tokenize`] shared by the guides, their grammars and each decode's constraint.
type Shared = Arc<dyn Fn(&str) -> Vec<u32> + Send + Sync>;

/// The model's own tokenizer as [`Guides`] takes it: the ids of forced text that no text after
/// it can tokenize differently (its last word may merge with what follows: left out).
pub type Tokenize = Box<dyn Fn(&str) -> Vec<u32> + Send + Sync>;

impl Guides {
    /// Over `words`, each token's bytes (a control token's as `0xFF` and its text, how
    /// llguidance names special tokens), with `eos` the end of an answer. With the model's
    /// `tokenize`, the text a grammar forces is committed without the model
    /// ([`Constraint::forced`]); without it nothing is forced.
    ///
    /// llguidance forces tokens itself only through a canonical tokenizer, and then keeps
    /// none whose bytes some longer token of the vocabulary could continue (a Qwen vocabulary
    /// nearly always has one): the model's tokenizer knows better what it would write.
    pub fn new(words: &[Vec<u8>], eos: u32, tokenize: Option<Tokenize>) -> Result<Guides> {
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, words);
        let opens_call = words
            .iter()
            .enumerate()
            .filter(|(_, w)| w.starts_with(tools::OPEN.as_bytes()))
            .map(|(id, _)| id as u32)
            .collect();
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &[])
            .map_err(|e| Error::model(format!("the grammar engine: {e}")))?;
        factory.quiet();
        Ok(Guides {
            factory,
            trie_eos: eos,
            tokenize: tokenize.map(Arc::from),
            vocab: words.len(),
            opens_call: Arc::new(opens_call),
        })
    }

    /// `format` compiled: a mistake in it (a schema keyword llguidance does not support, a
    /// GBNF syntax error) is the caller's.
    pub fn compile(&self, format: &Format) -> std::result::Result<Guide, RequestError> {
        let refuse = |e: String| RequestError::Grammar(format!("{}: {e}", format.describe()));
        let grammar = format.grammar().map_err(refuse)?;
        let proto = self
            .factory
            .create_parser(grammar)
            .map_err(|e| refuse(e.to_string()))?;
        Ok(Guide {
            proto,
            format: format.clone(),
            trie_eos: self.trie_eos,
            tokenize: self.tokenize.clone(),
            lazy: None,
        })
    }

    /// Tool calls' `format` ([`tools::grammar`]) held only from where the answer opens a call
    /// (a token whose text begins `<tool_call>`): the text before it is free (llama.cpp's lazy
    /// grammars, for `tool_choice: "auto"`).
    pub fn compile_calls(&self, format: &Format) -> std::result::Result<Guide, RequestError> {
        let mut g = self.compile(format)?;
        g.lazy = Some(Trigger {
            opens: self.opens_call.clone(),
            vocab: self.vocab,
        });
        Ok(g)
    }
}

/// What opens a lazy grammar: these tokens, in a vocabulary of `vocab`.
#[derive(Clone)]
struct Trigger {
    opens: Arc<Vec<u32>>,
    vocab: usize,
}

/// A compiled grammar, ready to constrain any number of decodes.
pub struct Guide {
    proto: TokenParser,
    pub format: Format,
    trie_eos: u32,
    tokenize: Option<Shared>,
    /// Held only from a trigger on ([`Guides::compile_calls`]).
    lazy: Option<Trigger>,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("format", &self.format)
            .finish()
    }
}

impl PartialEq for Guide {
    fn eq(&self, other: &Guide) -> bool {
        self.format == other.format && self.lazy.is_some() == other.lazy.is_some()
    }
}

impl Guide {
    /// A fresh constraint for one decode.
    pub fn start(&self) -> Constraint {
        Constraint {
            m: Matcher::new(Ok(self.proto.deep_clone())),
            trie_eos: self.trie_eos,
            tokenize: self.tokenize.clone(),
            lazy: self.lazy.clone().map(|trigger| Lazy {
                trigger,
                log: Vec::new(),
            }),
        }
    }

    /// Whether the grammar holds only from a trigger on (tool calls in `auto`).
    pub fn is_lazy(&self) -> bool {
        self.lazy.is_some()
    }
}

/// One decode's place in its grammar.
pub struct Constraint {
    m: Matcher,
    trie_eos: u32,
    tokenize: Option<Shared>,
    lazy: Option<Lazy>,
}

/// A lazy grammar's place: for each token accepted, whether the grammar took it (from the
/// trigger on); before the trigger every token is allowed.
struct Lazy {
    trigger: Trigger,
    log: Vec<bool>,
}

impl Lazy {
    fn open(&self) -> bool {
        self.log.last() == Some(&true)
    }
}

/// The tokens a constraint allows next.
pub struct Allowed {
    mask: SimpleVob,
    /// The answer may end here (the grammar is complete).
    pub may_end: bool,
    trie_eos: u32,
}

impl Allowed {
    /// Whether `tok` (not the end of the answer, which [`Allowed::may_end`] says) may come next.
    pub fn allows(&self, tok: u32) -> bool {
        tok != self.trie_eos && (tok as usize) < self.mask.len() && self.mask.is_allowed(tok)
    }

    /// The allowed tokens, in order (the end of the answer not among them).
    pub fn each(&self, mut f: impl FnMut(u32)) {
        self.mask.iter_set_entries(|i| {
            if i as u32 != self.trie_eos {
                f(i as u32)
            }
        });
    }

    /// `row` with what is not allowed at minus infinity, in `buf`; `eos` (the model's end of
    /// an answer) kept where the answer may end. `None` when no token is left with a finite
    /// logit.
    pub fn mask<'b>(&self, row: &[f32], eos: u32, buf: &'b mut Vec<f32>) -> Option<&'b [f32]> {
        buf.clear();
        buf.resize(row.len(), f32::NEG_INFINITY);
        let mut any = false;
        self.each(|t| {
            if let Some(&x) = row.get(t as usize) {
                buf[t as usize] = x;
                any |= x > f32::NEG_INFINITY;
            }
        });
        if self.may_end {
            if let Some(&x) = row.get(eos as usize) {
                buf[eos as usize] = x;
                any |= x > f32::NEG_INFINITY;
            }
        }
        any.then_some(buf.as_slice())
    }
}

impl Constraint {
    /// Whether a lazy grammar has not been opened yet (every token is allowed).
    fn waiting(&self) -> bool {
        self.lazy.as_ref().is_some_and(|l| !l.open())
    }

    /// The grammar is complete and allows nothing more: the answer ends here.
    pub fn finished(&self) -> bool {
        !self.waiting() && self.m.is_stopped()
    }

    /// The tokens allowed next.
    pub fn allowed(&mut self) -> Result<Allowed> {
        if let Some(l) = self.lazy.as_ref().filter(|l| !l.open()) {
            return Ok(Allowed {
                mask: SimpleVob::alloc_ones(l.trigger.vocab),
                may_end: true,
                trie_eos: self.trie_eos,
            });
        }
        let mask = self
            .m
            .compute_mask()
            .map_err(|e| Error::internal(format!("the grammar: {e}")))?;
        let may_end = self
            .m
            .is_accepting()
            .map_err(|e| Error::internal(format!("the grammar: {e}")))?;
        Ok(Allowed {
            mask,
            may_end,
            trie_eos: self.trie_eos,
        })
    }

    /// `row` with what the grammar forbids here at minus infinity, in `buf` (the end of the
    /// answer, `eos`, kept where it may end).
    pub fn masked<'b>(
        &mut self,
        row: &[f32],
        eos: u32,
        buf: &'b mut Vec<f32>,
    ) -> Result<&'b [f32]> {
        self.allowed()?
            .mask(row, eos, buf)
            .ok_or_else(|| Error::internal("the grammar allows no token here"))
    }

    /// `tok` was chosen (one [`Constraint::allowed`] allowed).
    pub fn accept(&mut self, tok: u32) -> Result<()> {
        if let Some(l) = &mut self.lazy {
            let takes = l.open() || l.trigger.opens.contains(&tok);
            l.log.push(takes);
            if !takes {
                return Ok(());
            }
        }
        self.m
            .consume_token(tok)
            .map_err(|e| Error::internal(format!("the grammar refused token {tok}: {e}")))
    }

    /// The tokens the grammar allows alone from here (`{"answer": ` of a schema, a tool
    /// call's tags), accepted: the caller commits them without asking the model. The forced
    /// text in the model's own tokenization, less its last word (what follows may join it);
    /// none unless the guides have the model's tokenizer.
    pub fn forced(&mut self) -> Result<Vec<u32>> {
        if self.waiting() {
            return Ok(Vec::new());
        }
        let Some(tokenize) = &self.tokenize else {
            return Ok(Vec::new());
        };
        if self.m.is_stopped() {
            return Ok(Vec::new());
        }
        let bytes = self.m.compute_ff_bytes();
        if let Some(e) = self.m.get_error() {
            return Err(Error::internal(format!("the grammar: {e}")));
        }
        let Ok(text) = std::str::from_utf8(&bytes) else {
            return Ok(Vec::new());
        };
        if text.is_empty() {
            return Ok(Vec::new());
        }
        let ids = tokenize(text);
        let n = self
            .m
            .try_consume_tokens(&ids)
            .map_err(|e| Error::internal(format!("the grammar: {e}")))?;
        if let Some(l) = &mut self.lazy {
            l.log.extend(std::iter::repeat_n(true, n));
        }
        Ok(ids[..n].to_vec())
    }

    /// Takes back the last `n` accepted tokens (a draft tried against the grammar).
    pub fn rollback(&mut self, mut n: usize) -> Result<()> {
        if let Some(l) = &mut self.lazy {
            let keep = l.log.len().saturating_sub(n);
            n = l.log.drain(keep..).filter(|&took| took).count();
        }
        self.m
            .rollback(n)
            .map_err(|e| Error::internal(format!("the grammar: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of single bytes plus a few words, and an end token.
    fn guides() -> Guides {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for w in ["{\"", "\": ", "true", "false", "answer", ", \""] {
            words.push(w.as_bytes().to_vec());
        }
        words.push(b"\xff<|im_end|>".to_vec());
        let eos = words.len() as u32 - 1;
        Guides::new(&words, eos, None).unwrap()
    }

    /// Feeds `text` one byte-token at a time; the byte where it was refused, if any.
    fn refused_at(g: &Guide, text: &str) -> (Option<usize>, bool) {
        let mut c = g.start();
        for (i, b) in text.bytes().enumerate() {
            if c.finished() {
                return (Some(i), false);
            }
            let a = c.allowed().unwrap();
            if !a.allows(b as u32) {
                return (Some(i), a.may_end);
            }
            c.accept(b as u32).unwrap();
        }
        let end = c.finished() || c.allowed().unwrap().may_end;
        (None, end)
    }

    #[test]
    fn json_schema_answers_are_masked_to_the_schema() {
        let g = guides();
        let schema = json!({"type": "object", "properties": {"answer": {"type": "integer"}},
                            "required": ["answer"], "additionalProperties": false});
        let guide = g.compile(&Format::JsonSchema(schema)).unwrap();
        assert_eq!(refused_at(&guide, "{\"answer\": 85}"), (None, true));
        assert_eq!(refused_at(&guide, "{\"answer\": 8"), (None, false));
        assert_eq!(refused_at(&guide, "{\"answer\": \"8").0, Some(11));
        assert_eq!(refused_at(&guide, "{\"other\"").0, Some(2));
        // Python's separators, no free whitespace.
        assert_eq!(refused_at(&guide, "{ ").0, Some(1));
        let json = g.compile(&Format::Json).unwrap();
        assert_eq!(refused_at(&json, "{\"a\": [1, true]}"), (None, true));
        assert_eq!(refused_at(&json, "[1]").0, Some(0));
    }

    #[test]
    fn gbnf_is_matched_character_by_character() {
        let g = guides();
        let guide = g
            .compile(&Format::Gbnf(
                "root ::= [a-z]* \"ing\" | \"n\" [0-9]{2,3}".into(),
            ))
            .unwrap();
        assert_eq!(refused_at(&guide, "walking"), (None, true));
        assert_eq!(refused_at(&guide, "ing"), (None, true));
        assert_eq!(refused_at(&guide, "walk"), (None, false));
        assert_eq!(refused_at(&guide, "n12"), (None, true));
        assert_eq!(refused_at(&guide, "n1234").0, Some(4));
        assert_eq!(refused_at(&guide, "W").0, Some(0));
    }

    #[test]
    fn a_required_tool_call_is_written_in_qwen3s_format() {
        let g = guides();
        let tools = [tools::Tool {
            name: "add".into(),
            parameters: json!({"type": "object", "properties": {"a": {"type": "integer"}},
                               "required": ["a"]}),
        }];
        let guide = g
            .compile(&tools::grammar(&tools, None, false).unwrap())
            .unwrap();
        let call = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        assert_eq!(refused_at(&guide, call), (None, true));
        assert_eq!(
            refused_at(&guide, "<tool_call>\n{\"name\": \"sub\"").0,
            Some(22)
        );
        assert_eq!(refused_at(&guide, "Sure").0, Some(0));
        assert!(tools::grammar(&tools, Some("mul"), false).is_none());
        let parallel = g
            .compile(&tools::grammar(&tools, Some("add"), true).unwrap())
            .unwrap();
        assert_eq!(
            refused_at(&parallel, &format!("{call}\n{call}")),
            (None, true)
        );
    }

    #[test]
    fn bad_grammars_are_the_callers_mistake() {
        let g = guides();
        for f in [
            Format::Gbnf("root ::= x".into()),
            Format::JsonSchema(json!(3)),
            Format::JsonSchema(json!({"type": "nonsense"})),
            Format::Lark("start: (".into()),
        ] {
            match g.compile(&f) {
                Err(RequestError::Grammar(m)) => assert!(m.starts_with(f.describe()), "{m}"),
                other => panic!("{f:?}: {:?}", other.map(|_| ())),
            }
        }
    }
}
