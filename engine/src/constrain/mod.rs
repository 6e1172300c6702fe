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
//! A constrained answer is decoded left to right: slot decoding commits tokens it drafted in
//! parallel and infilled out of order, which a left-to-right grammar cannot vouch for.

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
}

impl Guides {
    /// Over `words`, each token's bytes (a control token's as `0xFF` and its text, how
    /// llguidance names special tokens), with `eos` the end of an answer.
    pub fn new(words: &[Vec<u8>], eos: u32) -> Result<Guides> {
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &[])
            .map_err(|e| Error::model(format!("the grammar engine: {e}")))?;
        factory.quiet();
        Ok(Guides {
            factory,
            trie_eos: eos,
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
        })
    }
}

/// A compiled grammar, ready to constrain any number of decodes.
pub struct Guide {
    proto: TokenParser,
    pub format: Format,
    trie_eos: u32,
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
        self.format == other.format
    }
}

impl Guide {
    /// A fresh constraint for one decode.
    pub fn start(&self) -> Constraint {
        Constraint {
            m: Matcher::new(Ok(self.proto.deep_clone())),
            trie_eos: self.trie_eos,
        }
    }
}

/// One decode's place in its grammar.
pub struct Constraint {
    m: Matcher,
    trie_eos: u32,
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
}

impl Constraint {
    /// The grammar is complete and allows nothing more: the answer ends here.
    pub fn finished(&self) -> bool {
        self.m.is_stopped()
    }

    /// The tokens allowed next.
    pub fn allowed(&mut self) -> Result<Allowed> {
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

    /// `tok` was chosen (one [`Constraint::allowed`] allowed).
    pub fn accept(&mut self, tok: u32) -> Result<()> {
        self.m
            .consume_token(tok)
            .map_err(|e| Error::internal(format!("the grammar refused token {tok}: {e}")))
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
        Guides::new(&words, eos).unwrap()
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
