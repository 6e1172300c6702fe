//! Answer templates for any-order generation ("fill the gaps"): an answer's known spans and
//! gaps, in order. The text form marks a gap with `{{gap}}` (the request's gen length) or
//! `{{gap:N}}` (at most N tokens); [`parse`] splits it, the front end tokenizes the spans, and
//! the [`Template`] (token ids) rides in [`super::DecodeParams`] to the infill strategy
//! ([`super::Kind::Infill`]), which commits the spans at their positions and decodes the gaps'
//! slots. Semantics: docs/infill.md.

use crate::error::RequestError;

/// One piece of a template's text: literal text, or a gap of at most this many tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextPiece {
    Text(String),
    Gap(u32),
}

/// One piece of a template in tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// A known span: committed at its positions before decoding.
    Known(Vec<u32>),
    /// A gap of at most this many tokens (rounded up to whole slots when laid out).
    Gap(u32),
}

/// An answer template in tokens: at least one gap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pub pieces: Vec<Piece>,
}

const OPEN: &str = "{{gap";

/// Splits a template's text at its `{{gap}}` / `{{gap:N}}` markers; `{{gap}}` is a gap of
/// `default_gap` tokens. Refused: no gap, a malformed marker (`{{gap` not followed by `}}` or
/// `:N}}`), a gap of 0 tokens or of more than [`refusion_gguf::decoding::MAX_TOKENS`].
pub fn parse(text: &str, default_gap: u32) -> Result<Vec<TextPiece>, RequestError> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        if at > 0 {
            pieces.push(TextPiece::Text(rest[..at].to_string()));
        }
        let after = &rest[at + OPEN.len()..];
        let end = after.find("}}").ok_or_else(|| malformed(&rest[at..]))?;
        let n = match &after[..end] {
            "" => default_gap,
            arg => {
                let digits = arg
                    .strip_prefix(':')
                    .ok_or_else(|| malformed(&rest[at..]))?;
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(malformed(&rest[at..]));
                }
                digits
                    .parse::<u64>()
                    .map_or(u32::MAX, |n| n.min(u32::MAX as u64) as u32)
            }
        };
        check_gap(n)?;
        pieces.push(TextPiece::Gap(n));
        rest = &after[end + 2..];
    }
    if !rest.is_empty() {
        pieces.push(TextPiece::Text(rest.to_string()));
    }
    if !pieces.iter().any(|p| matches!(p, TextPiece::Gap(_))) {
        return Err(RequestError::Template(
            "the template has no gap: mark one with {{gap}} or {{gap:N}}".into(),
        ));
    }
    Ok(pieces)
}

fn malformed(at: &str) -> RequestError {
    let shown: String = at.chars().take(24).collect();
    RequestError::Template(format!(
        "malformed gap marker at '{shown}': expected {{{{gap}}}} or {{{{gap:N}}}}"
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
    /// added); empty spans are left out.
    pub fn from_text<E>(
        pieces: &[TextPiece],
        mut encode: impl FnMut(&str) -> Result<Vec<u32>, E>,
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
                TextPiece::Gap(n) => out.push(Piece::Gap(*n)),
            }
        }
        Ok(Template { pieces: out })
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

    /// Tokens the gaps may hold together (each rounded up to whole slots).
    pub fn gap_positions(&self, slot_size: u32) -> u64 {
        let k = slot_size.max(1) as u64;
        self.pieces
            .iter()
            .map(|p| match p {
                Piece::Gap(n) => (*n as u64).div_ceil(k) * k,
                Piece::Known(_) => 0,
            })
            .sum()
    }

    /// Positions the answer takes: the spans, and each gap rounded up to whole `slot_size`
    /// slots (in u64: no overflow for any template).
    pub fn positions(&self, slot_size: u32) -> u64 {
        let k = slot_size.max(1) as u64;
        self.pieces
            .iter()
            .map(|p| match p {
                Piece::Known(ids) => ids.len() as u64,
                Piece::Gap(n) => (*n as u64).div_ceil(k) * k,
            })
            .sum()
    }

    /// The known spans' tokens and positions, the answer starting at `start`.
    pub fn known(&self, start: u32, slot_size: u32) -> (Vec<u32>, Vec<u32>) {
        let (mut tokens, mut positions) = (Vec::new(), Vec::new());
        let mut pos = start;
        for p in &self.pieces {
            match p {
                Piece::Known(ids) => {
                    tokens.extend_from_slice(ids);
                    positions.extend(pos..pos + ids.len() as u32);
                    pos += ids.len() as u32;
                }
                Piece::Gap(n) => pos += n.div_ceil(slot_size) * slot_size,
            }
        }
        (tokens, positions)
    }

    /// The gaps as `(first position, slots)`, the answer starting at `start`.
    pub fn gaps(&self, start: u32, slot_size: u32) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        let mut pos = start;
        for p in &self.pieces {
            match p {
                Piece::Known(ids) => pos += ids.len() as u32,
                Piece::Gap(n) => {
                    let slots = n.div_ceil(slot_size);
                    out.push((pos, slots));
                    pos += slots * slot_size;
                }
            }
        }
        out
    }
}

/// What a gap was filled with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GapFill {
    /// The gap's first position.
    pub start: u32,
    /// Its tokens up to (not including) its first EOS.
    pub tokens: Vec<u32>,
    /// Whether an EOS ended it (the rest of the gap was dropped).
    pub eos: bool,
}

/// A decoded template: the answer (spans and fills stitched in order) and each gap's fill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filled {
    pub answer: Vec<u32>,
    pub gaps: Vec<GapFill>,
}

impl Filled {
    /// Stitches `template`'s spans with the committed `tokens` at `positions` (sorted, after
    /// the prompt): each gap's fill is its committed tokens up to its first EOS.
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
        for p in &template.pieces {
            match p {
                Piece::Known(ids) => {
                    answer.extend_from_slice(ids);
                    pos += ids.len() as u32;
                }
                Piece::Gap(n) => {
                    let end = pos + n.div_ceil(slot_size) * slot_size;
                    let from = positions.partition_point(|&q| q < pos);
                    let to = positions.partition_point(|&q| q < end);
                    let inside = &tokens[from..to];
                    let cut = inside.iter().position(|&t| t == eos_id);
                    let fill = &inside[..cut.unwrap_or(inside.len())];
                    answer.extend_from_slice(fill);
                    gaps.push(GapFill {
                        start: pos,
                        tokens: fill.to_vec(),
                        eos: cut.is_some(),
                    });
                    pos = end;
                }
            }
        }
        Filled { answer, gaps }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_split_the_text() {
        let p = parse("a {{gap}} b{{gap:7}}", 16).unwrap();
        assert_eq!(
            p,
            vec![
                TextPiece::Text("a ".into()),
                TextPiece::Gap(16),
                TextPiece::Text(" b".into()),
                TextPiece::Gap(7)
            ]
        );
        assert_eq!(parse("{{gap}}", 5).unwrap(), vec![TextPiece::Gap(5)]);
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
}
