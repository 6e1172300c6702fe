//! The tokenizer, rebuilt from a GGUF's `tokenizer.ggml.*` metadata with the `tokenizers`
//! crate, so that a GGUF file is all a user needs. It tokenizes exactly as the model's original
//! `tokenizer.json` (tested with the real Qwen3/ReFusion tokenizer).

use refusion_gguf::{GgufHeader, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{Error, Result};

/// The pre-tokenizer split of Qwen2/Qwen3 (llama.cpp's `qwen2` pre-tokenizer).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Our converter records the original tokenizer's normalizer here ("nfc" or "none").
pub const NORMALIZER_KEY: &str = "refusion.tokenizer.normalizer";

/// ReFusion's mask token, taken from the vocabulary when the file has no mask id.
pub const MASK_TOKEN: &str = "<|mask|>";

const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;
const TOKEN_UNUSED: i32 = 5;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    pub eos_id: Option<u32>,
    pub bos_id: Option<u32>,
    pub mask_id: Option<u32>,
    /// The mask id came from the vocabulary's `<|mask|>`, not from `tokenizer.ggml.mask_token_id`
    /// (llama.cpp's converter writes the key only when the tokenizer declares a `mask_token`,
    /// and ReFusion's declares `<|mask|>` only as an additional special token).
    pub mask_from_vocab: bool,
    /// Control tokens (chat markers, mask, ...), which decoding can skip.
    special: Vec<bool>,
    /// Every token's text as bytes, end to end (`bytes[offsets[i]..offsets[i + 1]]`), for
    /// token healing; a control token's is empty.
    bytes: Vec<u8>,
    offsets: Vec<u32>,
    /// A copy that reads special tokens' text as text (llama.cpp's `parse_special: false`),
    /// made the first time it is needed ([`Tokenizer::encode_text`]).
    plain: std::sync::OnceLock<tokenizers::Tokenizer>,
    /// The vocabulary as the grammar engine sees it, made the first time a request is
    /// constrained ([`Tokenizer::guides`]).
    guides: std::sync::OnceLock<std::result::Result<crate::constrain::Guides, String>>,
}

/// GPT-2's byte-level alphabet read back: the character standing for each byte (printable
/// bytes stand for themselves, the others for 256 + n in order).
fn byte_of_char() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut map = std::collections::HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            b as u32
        } else {
            n += 1;
            255 + n
        };
        if let Some(c) = char::from_u32(c) {
            map.insert(c, b);
        }
    }
    map
}

/// Each token's bytes, end to end, and where each starts (see [`Tokenizer::bytes`]).
fn token_bytes(tokens: &[&str], types: &[i32]) -> (Vec<u8>, Vec<u32>) {
    let map = byte_of_char();
    let mut bytes = Vec::new();
    let mut offsets = Vec::with_capacity(tokens.len() + 1);
    offsets.push(0);
    for (i, t) in tokens.iter().enumerate() {
        match types.get(i).copied() {
            Some(TOKEN_CONTROL) => {}
            // Added tokens are their text as written.
            Some(TOKEN_USER_DEFINED) => bytes.extend_from_slice(t.as_bytes()),
            _ => {
                for c in t.chars() {
                    match map.get(&c) {
                        Some(&b) => bytes.push(b),
                        None => bytes.extend_from_slice(c.to_string().as_bytes()),
                    }
                }
            }
        }
        offsets.push(bytes.len() as u32);
    }
    (bytes, offsets)
}

fn strings<'a>(h: &'a GgufHeader, key: &str) -> Result<Vec<&'a str>> {
    h.get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| Error::model(format!("metadata key {key} is missing or not an array")))?
        .iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| Error::model(format!("{key} holds a non-string")))
        })
        .collect()
}

fn token_id(h: &GgufHeader, key: &str, n: usize) -> Result<Option<u32>> {
    match h.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(id) if (id as usize) < n => Ok(Some(id as u32)),
            _ => Err(Error::model(format!(
                "{key} = {v} is not a token id of this vocabulary ({n} tokens)"
            ))),
        },
    }
}

/// `tokenizer.ggml.token_type`: one i32 per token (all normal when absent).
fn token_types(h: &GgufHeader, n: usize) -> Result<Vec<i32>> {
    let types: Vec<i32> = match h.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
        Some(a) => a
            .iter()
            .map(|v| match v {
                Value::I32(t) => Ok(*t),
                other => Err(Error::model(format!(
                    "tokenizer.ggml.token_type holds {other}"
                ))),
            })
            .collect::<Result<_>>()?,
        None => vec![1; n],
    };
    if types.len() != n {
        return Err(Error::model(format!(
            "tokenizer.ggml.token_type has {} entries for {n} tokens",
            types.len()
        )));
    }
    Ok(types)
}

/// The BPE vocabulary, the added tokens (control and user-defined, in id order) and which ids
/// are special (control).
fn split_vocabulary(
    tokens: &[&str],
    types: &[i32],
) -> (
    tokenizers::models::bpe::Vocab,
    Vec<(usize, AddedToken)>,
    Vec<bool>,
) {
    let mut vocab = tokenizers::models::bpe::Vocab::default();
    let mut special = vec![false; tokens.len()];
    let mut added = Vec::new();
    for (id, (&text, &ty)) in tokens.iter().zip(types).enumerate() {
        match ty {
            TOKEN_UNUSED => {}
            TOKEN_CONTROL => {
                special[id] = true;
                let tok = AddedToken::from(text.to_string(), true).normalized(false);
                added.push((id, tok));
            }
            TOKEN_USER_DEFINED => {
                let tok = AddedToken::from(text.to_string(), false).normalized(false);
                added.push((id, tok));
            }
            _ => {
                vocab.insert(text.to_string(), id as u32);
            }
        }
    }
    added.sort_by_key(|(id, _)| *id);
    (vocab, added, special)
}

/// The byte-level BPE of Qwen2/3: the merges, NFC (unless the file says otherwise), Qwen2's
/// split pattern, byte-level pre-tokenizer and decoder.
fn bpe(
    h: &GgufHeader,
    vocab: tokenizers::models::bpe::Vocab,
    merges: &[&str],
) -> Result<tokenizers::Tokenizer> {
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| Error::model(format!("malformed merge {m:?}")))?;
            Ok((a.to_string(), b.to_string()))
        })
        .collect::<Result<_>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| Error::model(format!("building the BPE tokenizer: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let normalizer = h
        .get(NORMALIZER_KEY)
        .and_then(Value::as_str)
        .unwrap_or("nfc");
    if normalizer == "nfc" {
        inner.with_normalizer(Some(NFC));
    }
    let split = Split::new(
        SplitPattern::Regex(QWEN2_PATTERN.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| Error::model(format!("pre-tokenizer pattern: {e}")))?;
    let pre = Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
    ]);
    inner.with_pre_tokenizer(Some(pre));
    inner.with_decoder(Some(ByteLevelDecoder::new(false, false, false)));
    Ok(inner)
}

impl Tokenizer {
    pub fn from_gguf(h: &GgufHeader) -> Result<Tokenizer> {
        let model = h
            .get("tokenizer.ggml.model")
            .and_then(Value::as_str)
            .unwrap_or("");
        let pre = h
            .get("tokenizer.ggml.pre")
            .and_then(Value::as_str)
            .unwrap_or("");
        if model != "gpt2" || pre != "qwen2" {
            return Err(Error::model(format!(
                "tokenizer '{model}' with pre-tokenizer '{pre}' is not supported (expected gpt2 / qwen2)"
            )));
        }
        let tokens = strings(h, "tokenizer.ggml.tokens")?;
        let types = token_types(h, tokens.len())?;
        let (bytes, offsets) = token_bytes(&tokens, &types);
        let (vocab, added, special) = split_vocabulary(&tokens, &types);
        let mut inner = bpe(h, vocab, &strings(h, "tokenizer.ggml.merges")?)?;
        // Added tokens must keep their ids: registered in id order.
        for (id, tok) in added {
            if special[id] {
                inner.add_special_tokens(&[tok]);
            } else {
                inner.add_tokens(&[tok]);
            }
            if inner.token_to_id(tokens[id]) != Some(id as u32) {
                return Err(Error::model(format!(
                    "added token {:?} does not keep its id {id}",
                    tokens[id]
                )));
            }
        }
        let n = tokens.len();
        let mut mask_id = token_id(h, "tokenizer.ggml.mask_token_id", n)?;
        let mask_from_vocab = mask_id.is_none();
        if mask_from_vocab {
            mask_id = inner.token_to_id(MASK_TOKEN);
        }
        Ok(Tokenizer {
            inner,
            vocab_size: n,
            eos_id: token_id(h, "tokenizer.ggml.eos_token_id", n)?,
            bos_id: token_id(h, "tokenizer.ggml.bos_token_id", n)?,
            mask_from_vocab: mask_from_vocab && mask_id.is_some(),
            mask_id,
            special,
            bytes,
            offsets,
            plain: std::sync::OnceLock::new(),
            guides: std::sync::OnceLock::new(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Token ids of `text`; special tokens written in the text are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::model(format!("tokenizing: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` read as text: a special token's text written in it (`<|im_end|>`)
    /// is those characters, not the token (a template's known spans, by default).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let plain = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = plain
            .encode(text, false)
            .map_err(|e| Error::model(format!("tokenizing: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; control tokens are dropped when `skip_special`. Ids without a token
    /// (padding rows of the embedding) decode to nothing.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| Error::model(format!("detokenizing: {e}")))
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    /// The grammar engine over this vocabulary (built once, on first use: it indexes every
    /// token's bytes).
    pub fn guides(&self) -> Result<&crate::constrain::Guides> {
        self.guides
            .get_or_init(|| {
                let eos = self
                    .eos_id
                    .ok_or("the file names no end-of-sequence token to end a constrained answer")?;
                let words: Vec<Vec<u8>> = (0..self.vocab_size as u32)
                    .map(|id| match self.is_special(id) {
                        // llguidance names a special token by 0xFF and its text.
                        true => {
                            let text = self.inner.id_to_token(id).unwrap_or_default();
                            [&[0xFF], text.as_bytes()].concat()
                        }
                        false => self.raw_bytes(id).to_vec(),
                    })
                    .collect();
                let tokenize = self.forced_tokenizer();
                crate::constrain::Guides::new(&words, eos, Some(tokenize))
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Error::model(e.clone()))
    }

    /// Forced text (a grammar's) in this tokenizer's ids, less its last word: the tokenizer
    /// splits text into words (an added token is one) before merging bytes, so only the last
    /// word can join what follows; an added token stays unless a longer one begins with it.
    fn forced_tokenizer(&self) -> crate::constrain::Tokenize {
        let mut plain = self.inner.clone();
        // Forced text is text: a control token's name written in it is characters.
        plain.set_encode_special_tokens(true);
        let added: Vec<(u32, String)> = plain
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| !t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        let closed: std::collections::HashSet<u32> = added
            .iter()
            .filter(|(_, c)| {
                !added
                    .iter()
                    .any(|(_, o)| o.len() > c.len() && o.starts_with(c.as_str()))
            })
            .map(|(id, _)| *id)
            .collect();
        Box::new(move |text: &str| {
            let Ok(enc) = plain.encode(text, false) else {
                return Vec::new();
            };
            let (ids, words) = (enc.get_ids(), enc.get_word_ids());
            let Some(&last) = words.last() else {
                return Vec::new();
            };
            let first_of_last = words.iter().position(|&w| w == last).unwrap_or(0);
            let whole = ids.len() - first_of_last == 1 && closed.contains(&ids[first_of_last]);
            ids[..if whole { ids.len() } else { first_of_last }].to_vec()
        })
    }

    /// One token as a client is shown it (`logprobs`): its text's bytes and their text (lossy
    /// where the token holds part of a character), or for a control token, which has no
    /// bytes, its name.
    pub fn piece(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.raw_bytes(id);
        if bytes.is_empty() {
            let name = self.decode(&[id], false).unwrap_or_default();
            return (name.clone(), name.into_bytes());
        }
        (String::from_utf8_lossy(bytes).into_owned(), bytes.to_vec())
    }

    /// The text of `ids` as bytes, end to end (control tokens give none).
    pub fn bytes_of(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            out.extend_from_slice(self.raw_bytes(id));
        }
        out
    }

    fn raw_bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.bytes[a as usize..b as usize],
            _ => &[],
        }
    }
}

impl crate::decode::template::TokenBytes for Tokenizer {
    fn vocab_len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        (!self.is_special(id)).then(|| self.raw_bytes(id))
    }
}
