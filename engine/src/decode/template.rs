//! Answer templates for any-order generation ("fill the gaps"): an answer's known spans and
//! gaps, in order. The text form marks a gap with `{{gap}}` (at most the request's gen length),
//! `{{gap:N}}` (at most N tokens) or `{{gap:=N}}` (exactly N); [`parse`] splits it, the front
//! end tokenizes the spans ([`Template::from_text`]: token healing at a fitted gap's edges), and
//! the [`Template`] (token ids) rides in [`super::DecodeParams`] to the infill strategy
//! ([`super::Kind::Infill`]), which commits the spans at their positions and decodes the gaps'
//! slots; a fitted gap is found its length by [`super::fit`]. Semantics: docs/infill.md.

use std::sync::Arc;

use crate::error::RequestError;

/// One piece of a template's text: literal text, or a gap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextPiece {
    Text(String),
    Gap(GapSize),
}

/// A gap's size as written: at most `tokens` (the fill takes the length the text needs), or
/// exactly `tokens` (`{{gap:=N}}`: filled to its end unless an EOS ends it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GapSize {
    pub tokens: u32,
    pub exact: bool,
}

impl GapSize {
    /// At most `tokens`.
    pub fn most(tokens: u32) -> GapSize {
        GapSize {
            tokens,
            exact: false,
        }
    }

    /// Exactly `tokens`.
    pub fn exactly(tokens: u32) -> GapSize {
        GapSize {
            tokens,
            exact: true,
        }
    }
}

/// One piece of a template in tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// A known span: committed at its positions before decoding.
    Known(Vec<u32>),
    /// A gap of exactly this many tokens (rounded up to whole slots when laid out).
    Gap(u32),
    /// A gap of at most `max` tokens, decoded now at `size`: [`super::fit`].
    Fit(FitGap),
}

/// An answer template in tokens: at least one gap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pub pieces: Vec<Piece>,
}

/// A gap whose fill takes the length its text needs, up to `max` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FitGap {
    pub max: u32,
    /// The tokens it is decoded at now (`max` at first; the length found, afterwards).
    pub size: u32,
    /// Token healing at its start: the span before it ended with a token that the whole text
    /// may have tokenized otherwise; that token was taken off the span and the fill's first
    /// token must be one of these (sorted): the tokens whose text starts with its text.
    pub first: Option<Healed>,
    /// Token healing at its end: the span after it started with this token, taken off the
    /// span; the fill is expected to end with its text (`ends`: the tokens whose text ends
    /// with it, sorted), else the token is put back when the answer is stitched.
    pub last: Option<Healed>,
    /// The tokens the probe found its text to take ([`super::fit`]), once found.
    pub found: Option<u32>,
}

/// Tokens taken off a known span at a fitted gap's edge, and the tokens that may stand for
/// them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Healed {
    /// In the span's order.
    pub tokens: Vec<u32>,
    /// Their text's length in bytes.
    pub bytes: u32,
    /// The tokens whose text starts (at a gap's start) or ends (at its end) with its text.
    pub fits: Arc<[u32]>,
}

impl Healed {
    pub fn admits(&self, token: u32) -> bool {
        self.fits.binary_search(&token).is_ok()
    }
}

/// The text of a vocabulary's tokens, as bytes (a token may hold part of a character), for
/// token healing.
pub trait TokenBytes {
    /// Ids there are.
    fn vocab_len(&self) -> usize;
    /// A token's bytes; `None` for a special token (never healed, never admitted).
    fn token_bytes(&self, id: u32) -> Option<&[u8]>;
}

const OPEN: &str = "{{gap";

/// Splits a template's text at its `{{gap}}` / `{{gap:N}}` / `{{gap:=N}}` markers; `{{gap}}`
/// is a gap of at most `default_gap` tokens. Refused: no gap, a malformed marker, a gap of 0
/// tokens or of more than [`refusion_gguf::decoding::MAX_TOKENS`].
pub fn parse(text: &str, default_gap: u32) -> Result<Vec<TextPiece>, RequestError> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        if at > 0 {
            pieces.push(TextPiece::Text(rest[..at].to_string()));
        }
        let after = &rest[at + OPEN.len()..];
        let end = after.find("}}").ok_or_else(|| malformed(&rest[at..]))?;
        let size = match &after[..end] {
            "" => GapSize::most(default_gap),
            arg => {
                let arg = arg
                    .strip_prefix(':')
                    .ok_or_else(|| malformed(&rest[at..]))?;
                let (digits, exact) = match arg.strip_prefix('=') {
                    Some(d) => (d, true),
                    None => (arg, false),
                };
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(malformed(&rest[at..]));
                }
                let n = digits
                    .parse::<u64>()
                    .map_or(u32::MAX, |n| n.min(u32::MAX as u64) as u32);
                GapSize { tokens: n, exact }
            }
        };
        check_gap(size.tokens)?;
        pieces.push(TextPiece::Gap(size));
        rest = &after[end + 2..];
    }
    if !rest.is_empty() {
        pieces.push(TextPiece::Text(rest.to_string()));
    }
    if !pieces.iter().any(|p| matches!(p, TextPiece::Gap(_))) {
        return Err(RequestError::Template(
            "the template has no gap: mark one with {{gap}}, {{gap:N}} or {{gap:=N}}".into(),
        ));
    }
    Ok(pieces)
}

fn malformed(at: &str) -> RequestError {
    let shown: String = at.chars().take(24).collect();
    RequestError::Template(format!(
        "malformed gap marker at '{shown}': expected {{{{gap}}}}, {{{{gap:N}}}} or {{{{gap:=N}}}}"
    ))
}

fn check_gap(n: u32) -> Result<(), RequestError> {
    let max = refusion_gguf::decoding::MAX_TOKENS;
    if n == 0 {
        return Err(RequestError::Template("a gap of 0 tokens".into()));
    }
    if n > max {
        return Err(RequestError::Template(format!(
            "a gap of {n} tokens is beyond any context (at most {max})"
        )));
    }
    Ok(())
}

impl Template {
    /// The plain generation of `gen_length` tokens: one gap.
    pub fn single_gap(gen_length: u32) -> Template {
        Template {
            pieces: vec![Piece::Gap(gen_length)],
        }
    }

    /// Tokenizes `pieces`' text with `encode` (the front end's tokenizer, no special tokens
    /// added); empty spans are left out. With `vocab`, each fitted gap's edges are token
    /// healed ([`FitGap::first`], [`FitGap::last`]).
    pub fn from_text<E>(
        pieces: &[TextPiece],
        mut encode: impl FnMut(&str) -> Result<Vec<u32>, E>,
        vocab: Option<&dyn TokenBytes>,
    ) -> Result<Template, E> {
        let mut out = Vec::with_capacity(pieces.len());
        for p in pieces {
            match p {
                TextPiece::Text(t) => {
                    let ids = encode(t)?;
                    if !ids.is_empty() {
                        out.push(Piece::Known(ids));
                    }
                }
                TextPiece::Gap(g) if g.exact => out.push(Piece::Gap(g.tokens)),
                TextPiece::Gap(g) => out.push(Piece::Fit(FitGap {
                    max: g.tokens,
                    size: g.tokens,
                    first: None,
                    last: None,
                    found: None,
                })),
            }
        }
        let mut t = Template { pieces: out };
        if let Some(v) = vocab {
            t.heal(v);
        }
        Ok(t)
    }

    /// Token healing at the prompt's end, for a template that starts with a fitted gap (a
    /// `suffix` request: the text before the cursor is the prompt): the prompt's last tokens are
    /// healed as a span before the gap would be (`prompt` loses them; the fill's first token
    /// must start with their text, and the answer holds it). A prompt of one token, one ending
    /// in a special token, or in a line break (a chat template's opened turn; a line's end,
    /// where the text after starts afresh) is left alone.
    pub fn heal_prompt_end(&mut self, prompt: &mut Vec<u32>, vocab: &dyn TokenBytes) {
        let Some(Piece::Fit(f)) = self.pieces.first_mut() else {
            return;
        };
        let ends_a_line = |t: &u32| vocab.token_bytes(*t).is_none_or(|b| b.ends_with(b"\n"));
        if f.first.is_some() || prompt.len() < 2 || prompt.last().is_none_or(ends_a_line) {
            return;
        }
        let m = heal_len(prompt, prompt.len() - 1, vocab, Edge::End);
        if m > 0 {
            let tokens = prompt.split_off(prompt.len() - m);
            f.first = Some(healed(tokens, vocab, Edge::End));
            f.max = f.max.saturating_add(1);
            f.size = f.max;
        }
    }

    /// Token healing at every fitted gap's edges: the tokens of the word a span is cut in
    /// (or its last token) are taken off the span next to the gap and their text left for the
    /// fill to write, as the whole text would be tokenized there (a cursor inside a word, `.`
    /// then a newline the model learned as one token). The span after a gap gives its first
    /// tokens when it keeps one (its tokens anchor the gap's end); the span before gives its
    /// last when that leaves the gap before it an anchor. Special tokens are never taken, and
    /// no more than a token of the vocabulary can hold.
    fn heal(&mut self, vocab: &dyn TokenBytes) {
        let n = self.pieces.len();
        for i in 0..n {
            if !matches!(self.pieces[i], Piece::Fit(_)) {
                continue;
            }
            let taken = match self.pieces.get_mut(i + 1) {
                Some(Piece::Known(ids)) if ids.len() >= 2 => {
                    let m = heal_len(ids, ids.len() - 1, vocab, Edge::Start);
                    (m > 0).then(|| ids.drain(..m).collect::<Vec<u32>>())
                }
                _ => None,
            };
            if let (Some(tokens), Piece::Fit(f)) = (taken, &mut self.pieces[i]) {
                f.last = Some(healed(tokens, vocab, Edge::Start));
                // The gap holds the healed text besides the N tokens asked for.
                f.max = f.max.saturating_add(1);
                f.size = f.max;
            }
        }
        for i in (1..n).rev() {
            if !matches!(self.pieces[i], Piece::Fit(_)) {
                continue;
            }
            let anchors_a_gap = i >= 2 && matches!(self.pieces[i - 2], Piece::Fit(_));
            let taken = match &mut self.pieces[i - 1] {
                Piece::Known(ids) => {
                    let most = ids.len().saturating_sub(anchors_a_gap as usize);
                    let m = heal_len(ids, most, vocab, Edge::End);
                    (m > 0).then(|| ids.split_off(ids.len() - m))
                }
                _ => None,
            };
            if let (Some(tokens), Piece::Fit(f)) = (taken, &mut self.pieces[i]) {
                f.first = Some(healed(tokens, vocab, Edge::End));
                f.max = f.max.saturating_add(1);
                f.size = f.max;
            }
        }
        self.pieces
            .retain(|p| !matches!(p, Piece::Known(ids) if ids.is_empty()));
    }

    /// Refuses what cannot be decoded: no gap, a gap of 0 or too many tokens, a mask token or
    /// an id outside the vocabulary in a known span.
    pub fn validate(&self, mask_id: u32, vocab: usize) -> Result<(), RequestError> {
        let mut gaps = 0;
        let mut offset = 0;
        for p in &self.pieces {
            match p {
                Piece::Gap(n) => {
                    check_gap(*n)?;
                    gaps += 1;
                }
                Piece::Fit(f) => {
                    check_gap(f.max)?;
                    check_gap(f.size)?;
                    gaps += 1;
                }
                Piece::Known(ids) => {
                    if let Some(i) = ids.iter().position(|&t| t == mask_id) {
                        return Err(RequestError::Template(format!(
                            "the mask token ({mask_id}) is inside a known span, at answer token {}",
                            offset + i
                        )));
                    }
                    if let Some(&token) = ids.iter().find(|&&t| t as usize >= vocab) {
                        return Err(RequestError::OutsideVocabulary { token, vocab });
                    }
                    offset += ids.len();
                }
            }
        }
        if gaps == 0 {
            return Err(RequestError::Template("the template has no gap".into()));
        }
        Ok(())
    }

    /// [`Self::validate`], and the answer's positions (spans and gaps rounded up to whole
    /// `slot_size` slots) within any context: at most [`refusion_gguf::decoding::MAX_TOKENS`]
    /// (so no position arithmetic can overflow).
    pub fn validate_for(
        &self,
        mask_id: u32,
        vocab: usize,
        slot_size: u32,
    ) -> Result<(), RequestError> {
        self.validate(mask_id, vocab)?;
        let max = refusion_gguf::decoding::MAX_TOKENS as u64;
        let n = self.positions(slot_size);
        if n > max {
            return Err(RequestError::Template(format!(
                "the answer takes {n} positions (its spans and gaps), more than any context (at most {max})"
            )));
        }
        Ok(())
    }

    /// Whether some gap's length is to be found ([`Piece::Fit`]).
    pub fn fits(&self) -> bool {
        self.pieces.iter().any(|p| matches!(p, Piece::Fit(_)))
    }

    /// The tokens a gap piece is decoded at now (none for a known span).
    fn gap_tokens(p: &Piece) -> Option<u32> {
        match p {
            Piece::Known(_) => None,
            Piece::Gap(n) => Some(*n),
            Piece::Fit(f) => Some(f.size),
        }
    }

    /// Tokens the gaps may hold together (each rounded up to whole slots).
    pub fn gap_positions(&self, slot_size: u32) -> u64 {
        let k = slot_size.max(1) as u64;
        self.pieces
            .iter()
            .filter_map(Template::gap_tokens)
            .map(|n| (n as u64).div_ceil(k) * k)
            .sum()
    }

    /// Positions the answer takes: the spans, and each gap rounded up to whole `slot_size`
    /// slots (in u64: no overflow for any template).
    pub fn positions(&self, slot_size: u32) -> u64 {
        let known: u64 = self
            .pieces
            .iter()
            .map(|p| match p {
                Piece::Known(ids) => ids.len() as u64,
                _ => 0,
            })
            .sum();
        known + self.gap_positions(slot_size)
    }

    /// The known spans' tokens and positions, the answer starting at `start`.
    pub fn known(&self, start: u32, slot_size: u32) -> (Vec<u32>, Vec<u32>) {
        let (mut tokens, mut positions) = (Vec::new(), Vec::new());
        let mut pos = start;
        for p in &self.pieces {
            match (p, Template::gap_tokens(p)) {
                (Piece::Known(ids), _) => {
                    tokens.extend_from_slice(ids);
                    positions.extend(pos..pos + ids.len() as u32);
                    pos += ids.len() as u32;
                }
                (_, Some(n)) => pos += n.div_ceil(slot_size) * slot_size,
                (_, None) => {}
            }
        }
        (tokens, positions)
    }

    /// The gaps as `(first position, slots)`, the answer starting at `start`.
    pub fn gaps(&self, start: u32, slot_size: u32) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        let mut pos = start;
        for p in &self.pieces {
            match (p, Template::gap_tokens(p)) {
                (Piece::Known(ids), _) => pos += ids.len() as u32,
                (_, Some(n)) => {
                    let slots = n.div_ceil(slot_size);
                    out.push((pos, slots));
                    pos += slots * slot_size;
                }
                (_, None) => {}
            }
        }
        out
    }

    /// The healed first tokens: each fitted gap's first position and the tokens it admits,
    /// the answer starting at `start`.
    pub fn first_tokens(&self, start: u32, slot_size: u32) -> Vec<(u32, Arc<[u32]>)> {
        let gaps = self.gaps(start, slot_size);
        self.pieces
            .iter()
            .filter(|p| Template::gap_tokens(p).is_some())
            .zip(gaps)
            .filter_map(|(p, (at, _))| match p {
                Piece::Fit(FitGap { first: Some(h), .. }) => Some((at, h.fits.clone())),
                _ => None,
            })
            .collect()
    }
}

/// Which end of a span is healed: its start (the span after a gap) or its end (before one).
#[derive(Clone, Copy)]
enum Edge {
    Start,
    End,
}

/// The most tokens healing takes off a span.
const MOST_HEALED: usize = 4;

/// A byte inside a word: a letter, a digit, `_`, or part of a non-ASCII character.
fn word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80
}

/// Whether a token `t` of one character goes with the word `word` that follows it, as Qwen's
/// pre-tokenizer splits text (`[^\r\n\p{L}\p{N}]?\p{L}+`: one character that is not a
/// letter, digit or line break, then letters): a cursor after `The answer i` ends the span in
/// ` ` and `i`, where the whole text has ` is`, so both are healed.
fn attaches(t: &[u8], word: &[u8]) -> bool {
    let letter = |b: u8| b.is_ascii_alphabetic() || b >= 0x80;
    match (t, word.first()) {
        ([c], Some(&w)) => {
            !(c.is_ascii_alphanumeric() || *c == b'\r' || *c == b'\n' || *c >= 0x80) && letter(w)
        }
        _ => false,
    }
}

/// How many of `ids`' tokens at `edge` to heal (at most `most`): the last (first) one, and
/// before (after) it the rest of the word it is cut in, as long as some token of the
/// vocabulary starts (ends) with their text; 0 when a special token is there.
fn heal_len(ids: &[u32], most: usize, vocab: &dyn TokenBytes, edge: Edge) -> usize {
    let at = |j: usize| match edge {
        Edge::End => ids[ids.len() - 1 - j],
        Edge::Start => ids[j],
    };
    let most = most.min(MOST_HEALED).min(ids.len());
    let mut n = 0;
    while n < most {
        let Some(t) = vocab.token_bytes(at(n)).filter(|t| !t.is_empty()) else {
            break;
        };
        if n > 0 {
            // The word goes on across the boundary between token n-1 and token n.
            let inner = vocab.token_bytes(at(n - 1)).unwrap_or_default();
            let joined = match edge {
                Edge::End => t.last().zip(inner.first()),
                Edge::Start => inner.last().zip(t.first()),
            };
            if !joined.is_some_and(|(&a, &b)| word_byte(a) && word_byte(b)) {
                // Before the word, the one character Qwen's pre-tokenizer joins to it.
                if let Edge::End = edge {
                    n += attaches(t, inner) as usize;
                }
                break;
            }
        }
        n += 1;
    }
    // No more than one token of the vocabulary can stand for.
    while n > 1 {
        let tokens: Vec<u32> = (0..n).map(at).collect();
        if !fitting(&tokens, vocab, edge).is_empty() {
            break;
        }
        n -= 1;
    }
    n
}

/// The text of `tokens` (in order for `Edge::Start`, reversed for `Edge::End`).
fn healed_text(tokens: &[u32], vocab: &dyn TokenBytes, edge: Edge) -> Vec<u8> {
    let mut ordered = tokens.to_vec();
    if let Edge::End = edge {
        ordered.reverse();
    }
    ordered
        .iter()
        .flat_map(|&t| vocab.token_bytes(t).unwrap_or_default().to_vec())
        .collect()
}

/// The vocabulary's tokens that can stand for the healed `tokens`' text: those starting with
/// it (the gap's first token, healing the span before) or ending with it (its last token,
/// healing the span after), sorted.
///
/// A run of blanks before a gap (a cursor in a line's indentation) also admits the run one
/// space shorter: Qwen's pre-tokenizer gives a run's last space to the word after it
/// (`\s+(?!\S)`), so the whole text of `        total` is 7 spaces, then ` total`; the fill's
/// next token, starting with the space, completes the healed text.
fn fitting(tokens: &[u32], vocab: &dyn TokenBytes, edge: Edge) -> Vec<u32> {
    let text = healed_text(tokens, vocab, edge);
    let shorter = match edge {
        Edge::End if blank_run(&text) => Some(&text[..text.len() - 1]),
        _ => None,
    };
    (0..vocab.vocab_len() as u32)
        .filter(|&id| {
            vocab.token_bytes(id).is_some_and(|t| {
                !t.is_empty()
                    && match edge {
                        Edge::End => t.starts_with(&text) || shorter == Some(t),
                        Edge::Start => t.ends_with(&text),
                    }
            })
        })
        .collect()
}

/// Two or more spaces and tabs, the last a space.
fn blank_run(text: &[u8]) -> bool {
    text.len() >= 2 && text.ends_with(b" ") && text.iter().all(|&b| b == b' ' || b == b'\t')
}

/// The healed `tokens` (taken from a span's `edge`, in the span's order) and what may stand
/// for them.
fn healed(tokens: Vec<u32>, vocab: &dyn TokenBytes, edge: Edge) -> Healed {
    let fits = fitting(
        &match edge {
            Edge::End => tokens.iter().rev().copied().collect::<Vec<u32>>(),
            Edge::Start => tokens.clone(),
        },
        vocab,
        edge,
    );
    let bytes = healed_text(&tokens, vocab, Edge::Start).len() as u32;
    Healed {
        tokens,
        bytes,
        fits: fits.into(),
    }
}

/// Where a fitted gap's fill meets the span after it: how many of the fill's tokens are its
/// own, the rest being the span's text written again (a gap longer than its text). A cut at
/// `i` needs the fill's token `i - 1` to end with the healed token's text (`last`, when the
/// span's first token was taken into the gap) and the tokens after `i` to agree with the span
/// (one a prefix of the other) on at least `min_agree` tokens; among the cuts, the one that
/// agrees on most tokens, then the latest. Without `last`, a cut must agree on one token at
/// least (an empty tail says nothing).
pub fn junction(
    fill: &[u32],
    span: &[u32],
    last: Option<&Healed>,
    min_agree: usize,
) -> Option<usize> {
    let mut best: Option<(usize, usize)> = None;
    let from = last.is_some() as usize;
    for i in from..=fill.len() {
        if let Some(h) = last {
            if !h.admits(fill[i - 1]) {
                continue;
            }
        }
        let tail = &fill[i..];
        let n = tail.len().min(span.len());
        if tail[..n] != span[..n] {
            continue;
        }
        if n < min_agree.max(last.is_none() as usize) {
            continue;
        }
        if best.is_none_or(|(agree, _)| n >= agree) {
            best = Some((n, i));
        }
    }
    best.map(|(_, i)| i)
}

/// Where a fill writes the span after it again, read loosely (the model wrote the token the
/// span was healed of otherwise): the first index from 1 where the span's first tokens (3, or
/// all of a shorter span, at least 2) follow in the fill.
pub fn rewritten_at(fill: &[u32], span: &[u32]) -> Option<usize> {
    let m = span.len().min(3);
    if m < 2 || fill.len() < m {
        return None;
    }
    (1..=fill.len() - m).find(|&i| fill[i..i + m] == span[..m])
}

/// The fewest tokens a loose match ([`loosely_at`]) compares (fewer when the span is shorter).
const LOOSE_MIN: usize = 4;

/// Where a fill writes the span after it again with a few tokens written otherwise (the model
/// names a variable its own way: `sum(xs)` where the span has `sum(nums)`; or it garbles one
/// token), when no cut agrees exactly: the cut whose tail agrees with the span's start, token
/// for token, at the most places, at least three in four of the tokens compared (the tail's
/// or the span's, the fewer, and at least [`LOOSE_MIN`] of them). A cut at `i` needs the fill's
/// token `i - 1` to stand for the healed token (`last`), as at a [`junction`]; among cuts with
/// as many agreeing tokens, the latest.
pub fn loosely_at(fill: &[u32], span: &[u32], last: Option<&Healed>) -> Option<usize> {
    let least = LOOSE_MIN.min(span.len());
    let mut best: Option<(usize, usize)> = None;
    for i in 1..=fill.len() {
        if last.is_some_and(|h| !h.admits(fill[i - 1])) {
            continue;
        }
        let tail = &fill[i..];
        let n = tail.len().min(span.len());
        if n == 0 || n < least {
            continue;
        }
        let agree = tail.iter().zip(span).filter(|(a, b)| a == b).count();
        if agree * 4 < n * 3 {
            continue;
        }
        if best.is_none_or(|(most, _)| agree >= most) {
            best = Some((agree, i));
        }
    }
    best.map(|(_, i)| i)
}

/// What a gap was filled with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GapFill {
    /// The gap's first position.
    pub start: u32,
    /// Its tokens, up to (not including) its first EOS, and for a fitted gap up to where the
    /// span after it begins again. A healed edge's token is among them: its text starts with
    /// `skip` bytes of the span before and ends with `trim` bytes of the span after.
    pub tokens: Vec<u32>,
    /// Whether an EOS ended it (the rest of the gap was dropped).
    pub eos: bool,
    /// Whether the gap was too small for its text: filled to its end with no EOS and, for a
    /// fitted gap, without meeting the span after it (`finish_reason: "length"`).
    pub truncated: bool,
    /// Bytes at the start of the tokens' text that belong to the span before (token healing).
    pub skip: u32,
    /// Bytes at the end of the tokens' text that belong to the span after.
    pub trim: u32,
}

impl GapFill {
    /// The fill's own text, given its tokens' text as bytes.
    pub fn text_of(&self, bytes: &[u8]) -> String {
        let from = (self.skip as usize).min(bytes.len());
        let to = bytes.len().saturating_sub(self.trim as usize).max(from);
        String::from_utf8_lossy(&bytes[from..to]).into_owned()
    }
}

/// A decoded template: the answer (spans and fills stitched in order) and each gap's fill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filled {
    pub answer: Vec<u32>,
    pub gaps: Vec<GapFill>,
}

impl Filled {
    /// Stitches `template`'s spans with the committed `tokens` at `positions` (sorted, after
    /// the prompt): each gap's fill is its committed tokens up to its first EOS, a fitted
    /// gap's cut where the span after it begins again ([`junction`]); a healed token the fill
    /// does not stand for is put back.
    pub fn stitch(
        template: &Template,
        start: u32,
        slot_size: u32,
        tokens: &[u32],
        positions: &[u32],
        eos_id: u32,
    ) -> Filled {
        let mut answer = Vec::new();
        let mut gaps = Vec::new();
        let mut pos = start;
        for (i, p) in template.pieces.iter().enumerate() {
            let n = match (p, Template::gap_tokens(p)) {
                (Piece::Known(ids), _) => {
                    answer.extend_from_slice(ids);
                    pos += ids.len() as u32;
                    continue;
                }
                (_, Some(n)) => n,
                (_, None) => continue,
            };
            let end = pos + n.div_ceil(slot_size) * slot_size;
            let from = positions.partition_point(|&q| q < pos);
            let to = positions.partition_point(|&q| q < end);
            let inside = &tokens[from..to];
            let cut = inside.iter().position(|&t| t == eos_id);
            let raw = &inside[..cut.unwrap_or(inside.len())];
            let full = cut.is_none() && raw.len() as u32 >= n;
            let gap = match p {
                Piece::Fit(f) => {
                    let span = match template.pieces.get(i + 1) {
                        Some(Piece::Known(ids)) => Some(ids.as_slice()),
                        _ => None,
                    };
                    fitted(f, raw, span, cut.is_some(), full, &mut answer)
                }
                _ => {
                    answer.extend_from_slice(raw);
                    GapFill {
                        start: pos,
                        tokens: raw.to_vec(),
                        eos: cut.is_some(),
                        truncated: cut.is_none(),
                        skip: 0,
                        trim: 0,
                    }
                }
            };
            gaps.push(GapFill { start: pos, ..gap });
            pos = end;
        }
        Filled { answer, gaps }
    }
}

/// A fitted gap's fill from its committed tokens `raw` (before any EOS), appended to `answer`
/// with its healed tokens put back where the fill does not stand for them.
fn fitted(
    f: &FitGap,
    raw: &[u32],
    span: Option<&[u32]>,
    eos: bool,
    full: bool,
    answer: &mut Vec<u32>,
) -> GapFill {
    // Where the fill meets its span: written again after the cut (the strongest sign); else
    // at the length the probe found, where the fill stands for the healed text there (the
    // positions after the text, up to the slot's end, hold whatever the model put there);
    // else at a fill that ends with the healed text.
    let agreeing = span.and_then(|s| junction(raw, s, f.last.as_ref(), 1));
    // The healed text written more than once before the span (a slot's positions past the
    // text filled with it): the first time it is.
    let repeated = f.last.as_ref().and_then(|h| {
        (1..=raw.len()).find(|&i| h.admits(raw[i - 1]) && raw[i..].iter().all(|&t| h.admits(t)))
    });
    let at_found = f.found.map(|n| n as usize).filter(|&n| {
        span.is_some()
            && n >= 1
            && n <= raw.len()
            && f.last.as_ref().is_some_and(|h| h.admits(raw[n - 1]))
    });
    let meets = agreeing
        .or(repeated)
        .or(at_found)
        .or_else(|| span.and_then(|s| junction(raw, s, f.last.as_ref(), 0)));
    // Else where the span's text comes again, if it does (the healed token not stood for).
    let again = meets
        .is_none()
        .then(|| span.and_then(|s| rewritten_at(raw, s)))
        .flatten();
    // Else where it writes the span again loosely (a few of its tokens otherwise).
    let loose = (meets.is_none() && again.is_none())
        .then(|| span.and_then(|s| loosely_at(raw, s, f.last.as_ref())))
        .flatten();
    let fill = &raw[..meets.or(again).or(loose).unwrap_or(raw.len())];
    let first = f.first.as_ref();
    let skip = match (first, fill.first()) {
        (Some(h), Some(&t)) if h.admits(t) => h.bytes,
        (Some(h), _) => {
            answer.extend_from_slice(&h.tokens);
            0
        }
        (None, _) => 0,
    };
    answer.extend_from_slice(fill);
    // The span's first token is stood for by the fill's last one when the cut was made there
    // (a lone token that also stands for the span before cannot be both).
    let lone_healed = fill.len() == 1 && first.is_some_and(|h| h.tokens == fill);
    let stood = (meets.is_some() || loose.is_some()) && f.last.is_some() && !lone_healed;
    let trim = match &f.last {
        Some(h) if stood => h.bytes,
        Some(h) => {
            answer.extend_from_slice(&h.tokens);
            0
        }
        None => 0,
    };
    GapFill {
        start: 0,
        tokens: fill.to_vec(),
        eos,
        truncated: !eos && full && meets.or(again).or(loose).is_none(),
        skip,
        trim,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_split_the_text() {
        let p = parse("a {{gap}} b{{gap:7}}{{gap:=3}}", 16).unwrap();
        assert_eq!(
            p,
            vec![
                TextPiece::Text("a ".into()),
                TextPiece::Gap(GapSize::most(16)),
                TextPiece::Text(" b".into()),
                TextPiece::Gap(GapSize::most(7)),
                TextPiece::Gap(GapSize::exactly(3)),
            ]
        );
        assert_eq!(
            parse("{{gap}}", 5).unwrap(),
            vec![TextPiece::Gap(GapSize::most(5))]
        );
    }

    #[test]
    fn bad_templates_are_refused_by_name() {
        for (text, says) in [
            ("no marker here", "no gap"),
            ("a {{gap", "malformed"),
            ("a {{gap:}} b", "malformed"),
            ("a {{gap:x}} b", "malformed"),
            ("a {{gap:-3}}", "malformed"),
            ("a {{gap 3}}", "malformed"),
            ("a {{gap:=}}", "malformed"),
            ("a {{gap:=x}}", "malformed"),
            ("a {{gap=3}}", "malformed"),
            ("a {{gap:=0}}", "0 tokens"),
            ("a {{gap:0}}", "0 tokens"),
            ("a {{gap:99999999999}}", "beyond"),
        ] {
            let e = parse(text, 8).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
        assert!(parse("{{gap}}", 0).is_err(), "a default gap of 0");
    }

    #[test]
    fn layout_rounds_gaps_to_whole_slots() {
        let t = Template {
            pieces: vec![
                Piece::Known(vec![1, 2, 3]),
                Piece::Gap(5),
                Piece::Known(vec![4]),
                Piece::Gap(8),
            ],
        };
        assert_eq!(t.positions(4), 3 + 8 + 1 + 8);
        assert_eq!(t.known(10, 4), (vec![1, 2, 3, 4], vec![10, 11, 12, 21]));
        assert_eq!(t.gaps(10, 4), vec![(13, 2), (22, 2)]);
        assert!(t.validate(9, 100).is_ok());
        assert!(t.validate(4, 100).unwrap_err().to_string().contains("mask"));
        assert!(t.validate(9, 4).is_err());
    }

    #[test]
    fn a_fill_ends_at_its_eos() {
        let t = Template {
            pieces: vec![Piece::Gap(4), Piece::Known(vec![7]), Piece::Gap(4)],
        };
        // Gap 1 at 10..14 (EOS 0 at 12), the span at 14, gap 2 at 15..19.
        let toks = [1, 2, 0, 7, 3, 4, 5, 6];
        let pos = [10, 11, 12, 14, 15, 16, 17, 18];
        let f = Filled::stitch(&t, 10, 4, &toks, &pos, 0);
        assert_eq!(f.answer, vec![1, 2, 7, 3, 4, 5, 6]);
        assert_eq!((f.gaps[0].eos, f.gaps[1].eos), (true, false));
        assert_eq!(f.gaps[1].start, 15);
    }

    /// A vocabulary of a few tokens' texts.
    struct Vocab(Vec<&'static str>);

    impl TokenBytes for Vocab {
        fn vocab_len(&self) -> usize {
            self.0.len()
        }
        fn token_bytes(&self, id: u32) -> Option<&[u8]> {
            self.0
                .get(id as usize)
                .filter(|t| !t.starts_with("<|"))
                .map(|t| t.as_bytes())
        }
    }

    fn vocab() -> Vocab {
        Vocab(vec![
            "We", " add", ".", ".\n", "\n", "The", " answer", " i", " in", "n", " xs", "<|e|>",
            " wr", "ite", " write", "w",
        ])
    }

    fn fit(max: u32) -> TextPiece {
        TextPiece::Gap(GapSize::most(max))
    }

    /// "We add." | a gap of at most 5 | "\nThe answer", healed on both sides.
    fn healed_template(v: &Vocab) -> Template {
        let pieces = [
            TextPiece::Text("a".into()),
            fit(5),
            TextPiece::Text("b".into()),
        ];
        let ids = |t: &str| {
            if t == "a" {
                vec![0, 1, 2]
            } else {
                vec![4, 5, 6]
            }
        };
        Template::from_text(&pieces, |s| Ok::<_, ()>(ids(s)), Some(v)).unwrap()
    }

    #[test]
    fn healing_takes_the_tokens_next_to_a_fitted_gap() {
        let v = vocab();
        let t = healed_template(&v);
        let Piece::Fit(f) = &t.pieces[1] else {
            panic!("{t:?}")
        };
        assert_eq!(t.pieces[0], Piece::Known(vec![0, 1]));
        assert_eq!(t.pieces[2], Piece::Known(vec![5, 6]));
        assert_eq!((f.max, f.size), (7, 7), "one more token a healed edge");
        let first = f.first.as_ref().unwrap();
        assert_eq!((first.tokens.clone(), &*first.fits), (vec![2], &[2, 3][..]));
        let last = f.last.as_ref().unwrap();
        assert_eq!((last.tokens.clone(), &*last.fits), (vec![4], &[3, 4][..]));
        // An exact gap is left alone, and so is a special token.
        let pieces = [
            TextPiece::Text("a".into()),
            TextPiece::Gap(GapSize::exactly(5)),
        ];
        let t = Template::from_text(&pieces, |_| Ok::<_, ()>(vec![0, 1, 2]), Some(&v)).unwrap();
        assert_eq!(t.pieces, vec![Piece::Known(vec![0, 1, 2]), Piece::Gap(5)]);
        let pieces = [TextPiece::Text("a".into()), fit(5)];
        let t = Template::from_text(&pieces, |_| Ok::<_, ()>(vec![0, 11]), Some(&v)).unwrap();
        assert_eq!(t.pieces[0], Piece::Known(vec![0, 11]));
    }

    #[test]
    fn healing_takes_the_rest_of_a_word_cut_by_the_cursor() {
        let v = vocab();
        // "We w" + "r" would not be a token pair the model saw: " wr" is taken whole when a
        // token starts with it.
        let pieces = [TextPiece::Text("a".into()), fit(5)];
        let t = Template::from_text(&pieces, |_| Ok::<_, ()>(vec![0, 12]), Some(&v)).unwrap();
        let Piece::Fit(f) = &t.pieces[1] else {
            panic!("{t:?}")
        };
        assert_eq!(t.pieces[0], Piece::Known(vec![0]));
        let first = f.first.as_ref().unwrap();
        assert_eq!(first.tokens, vec![12]);
        assert_eq!(&*first.fits, &[12, 14], "the tokens starting with ' wr'");
        // Two tokens of one word ("w", "rite" is not one: " wr" + "ite"): both go, when some
        // token starts with their text.
        let t = Template::from_text(&pieces, |_| Ok::<_, ()>(vec![0, 12, 13]), Some(&v)).unwrap();
        let Piece::Fit(f) = &t.pieces[1] else {
            panic!("{t:?}")
        };
        assert_eq!(f.first.as_ref().unwrap().tokens, vec![12, 13]);
        assert_eq!(&*f.first.as_ref().unwrap().fits, &[14]);
    }

    #[test]
    fn healing_takes_the_space_before_a_word_cut_by_the_cursor() {
        let v = vocab();
        // "The answer i|": the span ends in " answer", " " (16) and "i" (17), where the whole
        // text has " is": the space goes with the word, and both are healed.
        let mut v = v;
        v.0.extend([" ", "i", " is"]);
        let pieces = [TextPiece::Text("a".into()), fit(5)];
        let t =
            Template::from_text(&pieces, |_| Ok::<_, ()>(vec![5, 6, 16, 17]), Some(&v)).unwrap();
        let Piece::Fit(f) = &t.pieces[1] else {
            panic!("{t:?}")
        };
        assert_eq!(t.pieces[0], Piece::Known(vec![5, 6]));
        let first = f.first.as_ref().unwrap();
        assert_eq!(first.tokens, vec![16, 17]);
        assert_eq!(&*first.fits, &[7, 8, 18], "the tokens starting with ' i'");
        // Not before a digit, nor a newline before a word.
        assert!(!attaches(b" ", b"7"));
        assert!(!attaches(b"\n", b"The"));
        assert!(attaches(b"(", b"x"));
    }

    #[test]
    fn a_cursor_in_the_indentation_admits_the_run_a_space_shorter() {
        let mut v = vocab();
        // 16 "   ", 17 "  ", 18 " total", 19 "    ": "We" then a cursor after three spaces.
        v.0.extend(["   ", "  ", " total", "    "]);
        let pieces = [TextPiece::Text("a".into()), fit(5)];
        let t = Template::from_text(&pieces, |_| Ok::<_, ()>(vec![0, 4, 16]), Some(&v)).unwrap();
        let Piece::Fit(f) = &t.pieces[1] else {
            panic!("{t:?}")
        };
        let first = f.first.as_ref().unwrap();
        assert_eq!(first.tokens, vec![16]);
        // The whole text of "   total" is "  " then " total"; "    " (more indentation) too.
        assert_eq!(&*first.fits, &[16, 17, 19]);
        assert!(blank_run(b"\t  ") && !blank_run(b" ") && !blank_run(b"  \t"));
    }

    #[test]
    fn a_suffix_requests_prompt_end_is_healed() {
        let v = vocab();
        let pieces = [fit(5), TextPiece::Text("b".into())];
        let t = Template::from_text(&pieces, |_| Ok::<_, ()>(vec![5, 6]), Some(&v)).unwrap();
        // "We wr|": " wr" leaves the prompt; the fill's first token must start with it.
        let (mut healed, mut prompt) = (t.clone(), vec![0, 12]);
        healed.heal_prompt_end(&mut prompt, &v);
        assert_eq!(prompt, vec![0]);
        let Piece::Fit(f) = &healed.pieces[0] else {
            panic!("{healed:?}")
        };
        assert_eq!(f.first.as_ref().unwrap().tokens, vec![12]);
        // A prompt ending a line (a chat turn opened) or in a special token is left alone.
        for end in [3, 11] {
            let (mut same, mut prompt) = (t.clone(), vec![0, end]);
            same.heal_prompt_end(&mut prompt, &v);
            assert_eq!((same, prompt), (t.clone(), vec![0, end]));
        }
    }

    #[test]
    fn a_fill_that_writes_its_span_again_loosely_is_cut_there() {
        let last = Healed {
            tokens: vec![4],
            bytes: 1,
            fits: vec![3, 4].into(),
        };
        // The span 5 6 7 8 written again as 5 9 7 8 after ".\n": three of four agree.
        assert_eq!(
            loosely_at(&[1, 3, 5, 9, 7, 8], &[5, 6, 7, 8], Some(&last)),
            Some(2)
        );
        // Two of four is not enough; nor is a cut after a token that does not end with "\n".
        assert_eq!(
            loosely_at(&[1, 3, 5, 9, 9, 8], &[5, 6, 7, 8], Some(&last)),
            None
        );
        assert_eq!(
            loosely_at(&[1, 2, 5, 9, 7, 8], &[5, 6, 7, 8], Some(&last)),
            None
        );
        // Fewer than four tokens compared: none (unless the span is that short).
        assert_eq!(
            loosely_at(&[1, 3, 5, 9, 7], &[5, 6, 7, 8], Some(&last)),
            None
        );
        assert_eq!(loosely_at(&[1, 5, 9], &[5, 6], None), None, "1 of 2");
        assert_eq!(loosely_at(&[1, 5, 6], &[5, 6], None), Some(1));
    }

    #[test]
    fn a_fill_is_cut_where_the_span_after_it_comes_again() {
        let last = Healed {
            tokens: vec![4],
            bytes: 1,
            fits: vec![3, 4].into(),
        };
        // middle ".\n" then "The answer" again: cut after ".\n" (it stands for the "\n").
        assert_eq!(junction(&[1, 3, 5, 6], &[5, 6], Some(&last), 0), Some(2));
        // The gap's end without a spill: the fill ends with the healed text.
        assert_eq!(junction(&[1, 3], &[5, 6], Some(&last), 0), Some(2));
        // Not: a fill that does not end with it, or whose tail disagrees.
        assert_eq!(junction(&[1, 2], &[5, 6], Some(&last), 0), None);
        assert_eq!(junction(&[1, 3, 6], &[5, 6], Some(&last), 0), None);
        // A probe needs two of the span's tokens after the cut.
        assert_eq!(junction(&[1, 3, 5], &[5, 6, 7], Some(&last), 2), None);
        assert_eq!(junction(&[1, 3, 5, 6], &[5, 6, 7], Some(&last), 2), Some(2));
        // Without a healed token: at least one agreeing token; the most agreeing, then latest.
        assert_eq!(junction(&[1, 5], &[5, 6], None, 0), Some(1));
        assert_eq!(junction(&[1, 2], &[5, 6], None, 0), None);
        assert_eq!(rewritten_at(&[1, 2, 5, 6, 7], &[5, 6, 7, 8]), Some(2));
        assert_eq!(rewritten_at(&[5, 6, 7], &[5, 6, 7]), None, "from index 1");
    }

    #[test]
    fn a_fitted_fill_is_stitched_with_its_healed_edges() {
        let v = vocab();
        let t = healed_template(&v);
        // The gap (7 tokens, 2 slots of 4) at 12..20, the span at 20.. : the fill writes
        // The fill writes ".\n add.\n" and then the span's "The answer" again: its first
        // ".\n" stands for the healed "." (skipped), its last for the healed "\n" (trimmed).
        let toks = [3, 1, 3, 5, 6, 0, 0, 0];
        let pos: Vec<u32> = (12..20).collect();
        let f = Filled::stitch(&t, 10, 4, &toks, &pos, 99);
        let g = &f.gaps[0];
        assert_eq!(g.tokens, vec![3, 1, 3]);
        assert_eq!((g.skip, g.trim, g.truncated), (1, 1, false));
        assert_eq!(f.answer, vec![0, 1, 3, 1, 3, 5, 6]);
        assert_eq!(g.text_of(".\n add.\n".as_bytes()), "\n add.");
        // A fill that stands for neither healed token gets both back, and is too small.
        let toks = [0, 0, 0, 0, 0, 0, 0, 0];
        let f = Filled::stitch(&t, 10, 4, &toks, &pos, 99);
        assert_eq!(
            f.answer,
            [vec![0, 1, 2], vec![0; 8], vec![4, 5, 6]].concat()
        );
        assert!(f.gaps[0].truncated);
    }
}
