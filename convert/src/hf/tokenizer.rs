//! The tokenizer as llama.cpp stores it (`tokenizer.ggml.*`), read from either layout a
//! checkpoint ships: `tokenizer.json`, or the slow-tokenizer files `vocab.json` + `merges.txt`
//! (+ `added_tokens.json`), with `tokenizer_config.json` for specials and the chat template.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value as Json;

use super::config::Qwen3Config;
use super::read_json;
use crate::error::{Error, Result};

/// llama.cpp's token types.
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
}

#[derive(Debug, Clone)]
pub struct GgufVocab {
    /// One string per id, padded to the model's vocab_size.
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    /// "left right" pairs in merge-priority order.
    pub merges: Vec<String>,
    pub bos_id: Option<u64>,
    pub eos_id: Option<u64>,
    pub pad_id: Option<u64>,
    pub mask_id: Option<u64>,
    pub chat_template: Option<String>,
    /// Which layout it came from, for the log.
    pub source: &'static str,
    /// The text normalizer the original tokenizer applies: "nfc" or "none".
    pub normalizer: &'static str,
    /// Things worth telling the user (e.g. no mask token found).
    pub warnings: Vec<String>,
}

struct AddedToken {
    id: u64,
    content: String,
    special: Option<bool>,
}

/// A token string that llama.cpp's converter treats as a control token even when the
/// tokenizer does not mark it special.
fn looks_special(s: &str) -> bool {
    (s.starts_with("<|") && s.ends_with("|>")) || matches!(s, "<pad>" | "<mask>")
}

/// The text of a special-token entry in tokenizer_config.json: a string or `{content: ...}`.
fn token_text(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// Merges in either tokenizers format: "a b" strings or ["a", "b"] pairs. Spaces inside a
/// pair's parts are encoded as U+0120 + 256 shifted, as llama.cpp's gguf-py does.
fn parse_merges(path: &Path, v: &Json) -> Result<Vec<String>> {
    let items = v
        .as_array()
        .ok_or_else(|| Error::bad(path, "model.merges is not a list"))?;
    items
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(pair) if pair.len() == 2 => {
                let part = |p: &Json| -> Result<String> {
                    let s = p
                        .as_str()
                        .ok_or_else(|| Error::bad(path, "a merge part is not a string"))?;
                    Ok(s.chars()
                        .map(|c| if c == ' ' { '\u{0120}' } else { c })
                        .collect())
                };
                Ok(format!("{} {}", part(&pair[0])?, part(&pair[1])?))
            }
            other => Err(Error::bad(path, format!("unexpected merge entry {other}"))),
        })
        .collect()
}

fn parse_vocab(path: &Path, v: &Json) -> Result<HashMap<String, u64>> {
    let map = v
        .as_object()
        .ok_or_else(|| Error::bad(path, "vocabulary is not a JSON object"))?;
    map.iter()
        .map(|(k, id)| {
            id.as_u64()
                .map(|id| (k.clone(), id))
                .ok_or_else(|| Error::bad(path, format!("token {k:?} has a non-integer id {id}")))
        })
        .collect()
}

/// A tokenizer as the checkpoint ships it: `tokenizer.json`, or the slow files.
struct Source {
    vocab: HashMap<String, u64>,
    merges: Vec<String>,
    added: Vec<AddedToken>,
    source: &'static str,
    normalizer: &'static str,
}

impl Source {
    /// `tokenizer.json`: a BPE model, its merges, the added tokens, NFC or no normalizer.
    fn fast(path: &Path) -> Result<Source> {
        let json: Json = read_json(path)?;
        let normalizer = match json.get("normalizer") {
            None | Some(Json::Null) => "none",
            Some(n) if n.get("type").and_then(|t| t.as_str()) == Some("NFC") => "nfc",
            Some(n) => {
                return Err(Error::bad(
                    path,
                    format!("normalizer {n} is not supported (Qwen uses NFC or none)"),
                ))
            }
        };
        let model = json
            .get("model")
            .ok_or_else(|| Error::bad(path, "no 'model' section"))?;
        let kind = model.get("type").and_then(|t| t.as_str()).unwrap_or("BPE");
        if kind != "BPE" {
            return Err(Error::bad(
                path,
                format!("tokenizer model '{kind}' is not supported (need BPE)"),
            ));
        }
        let vocab = parse_vocab(path, model.get("vocab").unwrap_or(&Json::Null))?;
        let merges = parse_merges(path, model.get("merges").unwrap_or(&Json::Array(vec![])))?;
        let mut added = Vec::new();
        for t in json
            .get("added_tokens")
            .and_then(|a| a.as_array())
            .into_iter()
            .flatten()
        {
            let id = t.get("id").and_then(|i| i.as_u64());
            let content = t.get("content").and_then(|c| c.as_str());
            match (id, content) {
                (Some(id), Some(content)) => added.push(AddedToken {
                    id,
                    content: content.to_string(),
                    special: t.get("special").and_then(|s| s.as_bool()),
                }),
                _ => return Err(Error::bad(path, format!("malformed added token {t}"))),
            }
        }
        Ok(Source {
            vocab,
            merges,
            added,
            source: "tokenizer.json",
            normalizer,
        })
    }

    /// `vocab.json` + `merges.txt` (+ `added_tokens.json`), with `tokenizer_config.json`'s
    /// `added_tokens_decoder` saying which added tokens are special.
    fn slow(dir: &Path, tok_config: &Json, config_path: &Path) -> Result<Source> {
        let vocab_path = dir.join("vocab.json");
        let merges_path = dir.join("merges.txt");
        if !vocab_path.is_file() || !merges_path.is_file() {
            return Err(Error::bad(
                dir,
                "no tokenizer found: expected tokenizer.json, or vocab.json + merges.txt",
            ));
        }
        let vocab = parse_vocab(&vocab_path, &read_json(&vocab_path)?)?;
        let text = crate::files::read_to_string_regular(&merges_path)?;
        let merges: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with("#version") && !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        if let Some(bad) = merges.iter().find(|m| m.split(' ').count() != 2) {
            return Err(Error::bad(
                &merges_path,
                format!("malformed merge line {bad:?}"),
            ));
        }
        let mut added = Vec::new();
        let added_path = dir.join("added_tokens.json");
        if added_path.is_file() {
            for (content, id) in parse_vocab(&added_path, &read_json(&added_path)?)? {
                added.push(AddedToken {
                    id,
                    content,
                    special: None,
                });
            }
        }
        merge_added_decoder(&mut added, tok_config, config_path)?;
        Ok(Source {
            vocab,
            merges,
            added,
            source: "vocab.json + merges.txt",
            normalizer: "nfc",
        })
    }

    /// Every id of the model's vocabulary (`n`) with its text and type: the BPE tokens, the
    /// added ones (control when special), `[PADi]` for ids nothing names.
    fn lay_out(&self, dir: &Path, n: usize) -> Result<(Vec<String>, Vec<i32>)> {
        let mut tokens: Vec<Option<String>> = vec![None; n];
        let mut types = vec![token_type::UNUSED; n];
        let mut place = |id: u64, text: &str, ty: i32, what: &str| -> Result<()> {
            let slot = tokens.get_mut(id as usize).ok_or_else(|| {
                Error::bad(
                    dir,
                    format!("{what} {text:?} has id {id}, outside the model's vocab_size {n}"),
                )
            })?;
            *slot = Some(text.to_string());
            types[id as usize] = ty;
            Ok(())
        };
        let mut by_id: Vec<(&String, u64)> = self.vocab.iter().map(|(k, &v)| (k, v)).collect();
        by_id.sort_by_key(|&(_, id)| id);
        if let Some(w) = by_id.windows(2).find(|w| w[0].1 == w[1].1) {
            return Err(Error::bad(
                dir,
                format!("tokens {:?} and {:?} share id {}", w[0].0, w[1].0, w[0].1),
            ));
        }
        for (text, id) in by_id {
            place(id, text, token_type::NORMAL, "token")?;
        }
        for a in &self.added {
            let special = a.special.unwrap_or(false) || looks_special(&a.content);
            let ty = if special {
                token_type::CONTROL
            } else {
                token_type::USER_DEFINED
            };
            place(a.id, &a.content, ty, "added token")?;
        }
        let tokens = tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| t.unwrap_or_else(|| format!("[PAD{i}]")))
            .collect();
        Ok((tokens, types))
    }
}

/// `added_tokens_decoder`: which added tokens are special (and tokens `added_tokens.json`
/// lacks).
fn merge_added_decoder(
    added: &mut Vec<AddedToken>,
    tok_config: &Json,
    config_path: &Path,
) -> Result<()> {
    let Some(dec) = tok_config
        .get("added_tokens_decoder")
        .and_then(|d| d.as_object())
    else {
        return Ok(());
    };
    for (id, entry) in dec {
        let id: u64 = id.parse().map_err(|_| {
            Error::bad(
                config_path,
                format!("added_tokens_decoder key '{id}' is not an id"),
            )
        })?;
        let content = token_text(Some(entry)).ok_or_else(|| {
            Error::bad(
                config_path,
                format!("added_tokens_decoder entry {id} has no content"),
            )
        })?;
        let special = entry.get("special").and_then(|s| s.as_bool());
        match added.iter_mut().find(|a| a.id == id) {
            Some(a) => {
                a.special = special;
                a.content = content;
            }
            None => added.push(AddedToken {
                id,
                content,
                special,
            }),
        }
    }
    Ok(())
}

/// The chat template: `tokenizer_config.json`'s (a string, or the one named "default" of a
/// list), else `chat_template.jinja` beside it.
fn chat_template(dir: &Path, tok_config: &Json) -> Result<Option<String>> {
    Ok(match tok_config.get("chat_template") {
        Some(Json::String(s)) => Some(s.clone()),
        // A list of named templates: the default one is what apply_chat_template uses.
        Some(Json::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => {
            let jinja = dir.join("chat_template.jinja");
            if jinja.is_file() {
                Some(crate::files::read_to_string_regular(&jinja)?)
            } else {
                None
            }
        }
    })
}

impl GgufVocab {
    pub fn load(dir: &Path, cfg: &Qwen3Config) -> Result<GgufVocab> {
        let config_path = dir.join("tokenizer_config.json");
        let tok_config: Json = if config_path.is_file() {
            read_json(&config_path)?
        } else {
            Json::Null
        };
        let fast = dir.join("tokenizer.json");
        let src = if fast.is_file() {
            Source::fast(&fast)?
        } else {
            Source::slow(dir, &tok_config, &config_path)?
        };
        let (tokens, token_types) = src.lay_out(dir, cfg.vocab_size as usize)?;

        let lookup = |text: &str| tokens.iter().position(|t| t == text).map(|i| i as u64);
        let special = |key: &str| token_text(tok_config.get(key)).and_then(|t| lookup(&t));
        let mut warnings = Vec::new();
        let eos_id = special("eos_token").or(cfg.eos_token_id);
        let bos_id = special("bos_token").or(cfg.bos_token_id);
        let pad_id = special("pad_token");
        let mask_id = cfg
            .mask_token_id
            .or_else(|| special("mask_token"))
            .or_else(|| lookup("<|mask|>"));
        if mask_id.is_none() {
            warnings.push(
                "no mask token (config mask_token_id, tokenizer mask_token or <|mask|>): the file can be \
                 used as a plain Qwen3 model but not for ReFusion decoding"
                    .to_string(),
            );
        }
        if let (Some(tok), Some(cfg_eos)) = (special("eos_token"), cfg.eos_token_id) {
            if tok != cfg_eos {
                warnings.push(format!(
                    "tokenizer eos_token is id {tok} but config.json eos_token_id is {cfg_eos}; using {tok} as the tokenizer does"
                ));
            }
        }
        let chat_template = chat_template(dir, &tok_config)?;
        if chat_template.is_none() {
            warnings
                .push("no chat template found: text prompts will need --no-chat-template".into());
        }
        Ok(GgufVocab {
            tokens,
            token_types,
            merges: src.merges,
            bos_id,
            eos_id,
            pad_id,
            mask_id,
            chat_template,
            source: src.source,
            normalizer: src.normalizer,
            warnings,
        })
    }
}
