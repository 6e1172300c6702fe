//! Gap filling on the server (any-order generation, docs/infill.md): what a request's
//! template is made of ([`FillSpec`]: a `suffix` after one gap, or `{{gap}}` markers in a chat
//! answer), how the worker turns it into the decoder's [`Template`], and each gap's text as it
//! grows ([`Fills`]), sent as [`Msg::Fill`] with the gap's index.

use super::api::ApiError;
use crate::jobs::Msg;
use crate::stop::StopFilter;
use refusion_engine::chat::{TextStream, Tokenizer};
use refusion_engine::decode::template::{parse, GapSize, TextPiece};
use refusion_engine::decode::{DecodeParams, DecodeResult, Template};

/// Where a request's template comes from.
#[derive(Debug, Clone)]
pub enum FillSource {
    /// One gap (the request's max tokens) and this text after it: OpenAI's and ollama's
    /// `suffix`, llama-server's `input_suffix`. The text is taken as it is (no markers).
    Suffix(String),
    /// Text with `{{gap}}` / `{{gap:N}}` markers (a chat request's final assistant message,
    /// with `"infill": true`).
    Markers(String),
}

/// A request's template and the field that holds it (named in its errors).
#[derive(Debug, Clone)]
pub struct FillSpec {
    pub source: FillSource,
    pub field: &'static str,
    /// Special tokens' text in the known spans is read as the tokens (the chat API's
    /// `parse_special`); by default it is text.
    pub parse_special: bool,
}

impl FillSpec {
    pub fn new(source: FillSource, field: &'static str) -> FillSpec {
        FillSpec {
            source,
            field,
            parse_special: false,
        }
    }

    /// The template's text pieces, `{{gap}}` (and a suffix's gap) of `default_gap` tokens.
    pub fn pieces(&self, default_gap: u32) -> Result<Vec<TextPiece>, ApiError> {
        match &self.source {
            FillSource::Suffix(s) => Ok(vec![
                TextPiece::Gap(GapSize::most(default_gap)),
                TextPiece::Text(s.clone()),
            ]),
            FillSource::Markers(s) => parse(s, default_gap).map_err(|e| self.error(e)),
        }
    }

    /// `params` decoding this template: spans tokenized, checked against the vocabulary and
    /// the mask token, its gaps within `max_gen` tokens together (the server's
    /// `--max-gen-length`); a mistake is a 400 naming the field.
    pub fn apply(
        &self,
        params: DecodeParams,
        tok: &Tokenizer,
        vocab: usize,
        max_gen: u32,
    ) -> Result<DecodeParams, ApiError> {
        // Gaps are filled by slot decoding (a template turns plain slot decoding into infill).
        if !params.strategy.method().uses_slots() {
            return Err(ApiError::bad_request(format!(
                "strategy '{}' cannot fill gaps (a {} asks for them): gaps are filled by slot decoding",
                params.strategy, self.field
            ))
            .param("strategy"));
        }
        let pieces = self.pieces(params.gen_length)?;
        let encode = |s: &str| match self.parse_special {
            true => tok.encode(s),
            false => tok.encode_text(s),
        };
        let t = Template::from_text(&pieces, encode, Some(tok))
            .map_err(|e| ApiError::bad_request(e.to_string()).param(self.field))?;
        t.validate_for(params.mask_id, vocab, params.slot_size)
            .map_err(|e| self.error(e))?;
        let gaps = t.gap_positions(params.slot_size);
        if gaps > max_gen as u64 {
            return Err(self.error(format!(
                "template: its gaps hold {gaps} tokens together, more than this server's max_tokens limit ({max_gen})"
            )));
        }
        let params = params.with_template(t);
        params.validate().map_err(|e| self.error(e))?;
        Ok(params)
    }

    fn error(&self, e: impl std::fmt::Display) -> ApiError {
        ApiError::bad_request(e.to_string()).param(self.field)
    }
}

/// The stitched text of a template: its text pieces with each gap's fill in place.
pub fn stitch(pieces: &[TextPiece], fills: &[String]) -> String {
    let mut out = String::new();
    let mut gap = 0;
    for p in pieces {
        match p {
            TextPiece::Text(t) => out.push_str(t),
            TextPiece::Gap(_) => {
                out.push_str(fills.get(gap).map_or("", String::as_str));
                gap += 1;
            }
        }
    }
    out
}

/// Each gap's committed text as it grows (up to its EOS), cut at a stop string. A template
/// with fitted gaps (`{{gap}}`, `{{gap:N}}`, a suffix) has its fills' text only once the
/// decode is done (a fill's length is found by decoding it again, and where it meets the text
/// after it is known at its end): it is sent then.
pub struct Fills<'t> {
    gaps: Vec<Gap<'t>>,
    /// The fills are sent whole, from the result ([`Fills::finish`]).
    whole: bool,
    tok: &'t Tokenizer,
}

struct Gap<'t> {
    start: u32,
    end: u32,
    stream: TextStream<'t>,
    filter: StopFilter,
    /// This commit's tokens in the gap (reused between commits).
    pos: Vec<u32>,
    toks: Vec<u32>,
}

impl<'t> Fills<'t> {
    pub fn new(
        tok: &'t Tokenizer,
        params: &DecodeParams,
        prompt_len: usize,
        stops: &[String],
    ) -> Fills<'t> {
        let k = params.slot_size;
        let t = params.answer_template();
        let whole = t.fits();
        let gaps = t
            .gaps(prompt_len as u32, k)
            .into_iter()
            .map(|(start, slots)| Gap {
                start,
                end: start + slots * k,
                stream: TextStream::new(tok, start as usize, params.eos_id),
                filter: StopFilter::new(stops.to_vec()),
                pos: Vec::new(),
                toks: Vec::new(),
            })
            .collect();
        Fills { gaps, whole, tok }
    }

    /// Whether a stop string cut some gap and every gap is over (cut, or ended at its EOS):
    /// the decode may stop.
    pub fn all_stopped(&self) -> bool {
        self.any_stopped() && self.gaps.iter().all(|g| g.filter.hit || g.stream.ended())
    }

    /// The text sent so far, every gap's (a stopped decode counts its tokens from it).
    pub fn sent(&self) -> String {
        self.gaps.iter().map(|g| g.filter.sent()).collect()
    }

    /// Whether a stop string cut some gap.
    pub fn any_stopped(&self) -> bool {
        self.gaps.iter().any(|g| g.filter.hit)
    }

    /// Committed tokens: the text each gap gained.
    pub fn push(&mut self, positions: &[u32], tokens: &[u32]) -> Vec<Msg> {
        if self.whole {
            return Vec::new();
        }
        // Each token to its gap (gaps are in position order).
        for (&p, &t) in positions.iter().zip(tokens) {
            let i = self.gaps.partition_point(|g| g.start <= p);
            if let Some(g) = i.checked_sub(1).and_then(|i| self.gaps.get_mut(i)) {
                if p < g.end {
                    g.pos.push(p);
                    g.toks.push(t);
                }
            }
        }
        let mut out = Vec::new();
        for (i, g) in self.gaps.iter_mut().enumerate() {
            if g.pos.is_empty() {
                continue;
            }
            let text = g.stream.push(&g.pos, &g.toks);
            g.pos.clear();
            g.toks.clear();
            if let Some(text) = text {
                let text = g.filter.push(&text);
                if !text.is_empty() {
                    out.push(Msg::Fill { gap: i, text });
                }
            }
        }
        out
    }

    /// The held-back tails; fills sent whole, from the decode's `result`.
    pub fn finish(&mut self, result: Option<&DecodeResult>) -> Vec<Msg> {
        let mut out = Vec::new();
        if self.whole {
            let filled = result.and_then(|r| r.filled.as_ref());
            let fills = filled.map(|f| f.gaps.as_slice()).unwrap_or_default();
            for (i, (g, fill)) in self.gaps.iter_mut().zip(fills).enumerate() {
                let text = fill.text_of(&self.tok.bytes_of(&fill.tokens));
                let mut text = g.filter.push(&text);
                text.push_str(&g.filter.finish());
                if !text.is_empty() {
                    out.push(Msg::Fill { gap: i, text });
                }
            }
            return out;
        }
        for (i, g) in self.gaps.iter_mut().enumerate() {
            let mut text = g
                .stream
                .finish()
                .map(|t| g.filter.push(&t))
                .unwrap_or_default();
            text.push_str(&g.filter.finish());
            if !text.is_empty() {
                out.push(Msg::Fill { gap: i, text });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_suffix_is_text_not_markers() {
        let s = FillSpec::new(FillSource::Suffix("a {{gap}} b".into()), "suffix");
        assert_eq!(
            s.pieces(9).unwrap(),
            vec![
                TextPiece::Gap(GapSize::most(9)),
                TextPiece::Text("a {{gap}} b".into())
            ]
        );
        let m = FillSpec::new(
            FillSource::Markers("x {{gap:3}} y {{gap".into()),
            "messages",
        );
        let e = m.pieces(9).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    #[test]
    fn stitching_puts_fills_in_their_gaps() {
        let p = parse("A{{gap}}C{{gap:2}}", 4).unwrap();
        assert_eq!(stitch(&p, &["b".into(), "d".into()]), "AbCd");
        assert_eq!(stitch(&p, &["b".into()]), "AbC");
    }
}
