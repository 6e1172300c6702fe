//! A streamed answer's tool calls as OpenAI streams them: a call's first delta carries its
//! index, id, type and name (with empty arguments), the next ones pieces of its arguments as
//! the model writes them. The answer is read as it comes, in Qwen3's format
//! (`<tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call>`); text outside the calls
//! goes out as content, text that may open a call is held until it does or does not.
//!
//! A call written otherwise (keys in another order, escapes in the name) is held and sent whole
//! at the end, once the answer is read in full (`tools::read`), which also decides whether the
//! calls are well formed: a malformed one is an error event even when its start went out.

use refusion_engine::constrain::tools::{self, Call};

use crate::api::ApiError;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// What goes out for a piece of the answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    /// A call begins: its index among the calls, and its function's name.
    Start {
        index: usize,
        name: String,
    },
    /// More of a call's arguments, as written.
    Arguments {
        index: usize,
        text: String,
    },
}

#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum State {
    /// Outside a call.
    #[default]
    Text,
    /// After `<tool_call>`, before the arguments begin.
    Header,
    /// Inside the arguments value: its nesting depth, and whether in a string (and after a
    /// backslash there).
    Arguments {
        depth: u32,
        string: bool,
        escape: bool,
    },
    /// After the arguments: the object's `}` and `</tool_call>` still to come.
    Close,
    /// A call not in the expected shape: nothing more goes out until the end.
    Held,
}

/// Reads a streamed answer for calls; [`CallStream::push`] for each delta, then
/// [`CallStream::finish`].
#[derive(Debug, Default)]
pub struct CallStream {
    all: String,
    /// How far the answer has been read.
    pos: usize,
    state: State,
    /// Calls whose start went out.
    started: usize,
}

/// How a header reads so far: its name and length, more needed, or not the shape expected.
enum Header {
    Done(String, usize),
    More,
    Other,
}

/// `{"name": "NAME", "arguments": ` (any whitespace between), at the start of `s`.
fn header(s: &str) -> Header {
    let b = s.as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let lit = |i: &mut usize, l: &str| -> Option<bool> {
        ws(i);
        let rest = &s[*i..];
        if rest.starts_with(l) {
            *i += l.len();
            Some(true)
        } else if l.starts_with(rest) {
            None
        } else {
            Some(false)
        }
    };
    for l in ["{", "\"name\"", ":", "\""] {
        match lit(&mut i, l) {
            Some(true) => {}
            Some(false) => return Header::Other,
            None => return Header::More,
        }
    }
    let Some(len) = s[i..].find('"') else {
        return Header::More;
    };
    let name = s[i..i + len].to_string();
    if name.contains('\\') {
        return Header::Other;
    }
    i += len + 1;
    for l in [",", "\"arguments\"", ":"] {
        match lit(&mut i, l) {
            Some(true) => {}
            Some(false) => return Header::Other,
            None => return Header::More,
        }
    }
    ws(&mut i);
    if i == b.len() {
        return Header::More;
    }
    Header::Done(name, i)
}

impl CallStream {
    /// What can go out now that `delta` came.
    pub fn push(&mut self, delta: &str) -> Vec<Piece> {
        self.all.push_str(delta);
        let mut out = Vec::new();
        loop {
            let before = (self.pos, self.state);
            self.step(&mut out);
            if (self.pos, self.state) == before {
                return out;
            }
        }
    }

    /// Reads on from `pos` in the current state, as far as it can.
    fn step(&mut self, out: &mut Vec<Piece>) {
        let rest = &self.all[self.pos..];
        match self.state {
            State::Text => {
                let upto = tools::may_open(rest).unwrap_or(rest.len());
                if upto > 0 {
                    out.push(Piece::Text(rest[..upto].to_string()));
                    self.pos += upto;
                } else if rest.starts_with(OPEN) {
                    self.pos += OPEN.len();
                    self.state = State::Header;
                }
            }
            State::Header => match header(rest) {
                Header::Done(name, len) => {
                    out.push(Piece::Start {
                        index: self.started,
                        name,
                    });
                    self.started += 1;
                    self.pos += len;
                    self.state = State::Arguments {
                        depth: 0,
                        string: false,
                        escape: false,
                    };
                }
                Header::More => {}
                Header::Other => self.state = State::Held,
            },
            State::Arguments { .. } => self.arguments(out),
            State::Close => {
                let t = rest.trim_start();
                let skipped = rest.len() - t.len();
                if let Some(after) = t.strip_prefix('}') {
                    let a = after.trim_start();
                    if a.starts_with(CLOSE) {
                        self.pos += skipped + 1 + (after.len() - a.len()) + CLOSE.len();
                        self.state = State::Text;
                    } else if !(a.is_empty() || CLOSE.starts_with(a)) {
                        self.state = State::Held;
                    }
                } else if !t.is_empty() {
                    self.state = State::Held;
                }
            }
            State::Held => {}
        }
    }

    /// The arguments value as far as it is written: it ends where its brackets close.
    fn arguments(&mut self, out: &mut Vec<Piece>) {
        let State::Arguments {
            mut depth,
            mut string,
            mut escape,
        } = self.state
        else {
            return;
        };
        let rest = &self.all[self.pos..];
        let mut end = None;
        for (i, c) in rest.char_indices() {
            if string {
                match (escape, c) {
                    (true, _) => escape = false,
                    (false, '\\') => escape = true,
                    (false, '"') => string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => string = true,
                '{' | '[' => depth += 1,
                '}' | ']' if depth > 0 => depth -= 1,
                _ if depth == 0 && !c.is_whitespace() => {
                    // Not an object or a list: not the shape the stream reads.
                    self.state = State::Held;
                    return;
                }
                _ => {}
            }
            if depth == 0 && matches!(c, '}' | ']') {
                end = Some(i + c.len_utf8());
                break;
            }
        }
        let taken = end.unwrap_or(rest.len());
        if taken > 0 {
            out.push(Piece::Arguments {
                index: self.started - 1,
                text: rest[..taken].to_string(),
            });
        }
        self.pos += taken;
        self.state = match end {
            Some(_) => State::Close,
            None => State::Arguments {
                depth,
                string,
                escape,
            },
        };
    }

    /// At the end (`cut`: by max_tokens): the text still held back, and the calls that have
    /// not gone out (all of the answer's calls past the ones started), with their indexes.
    /// A malformed call is the error [`crate::tools::read`] makes of it.
    pub fn finish(&self, cut: bool) -> Result<(String, Vec<(usize, Call)>), ApiError> {
        let parsed = crate::tools::read(&self.all, cut)?;
        if parsed.calls.is_empty() {
            return Ok((self.all[self.pos..].to_string(), Vec::new()));
        }
        let rest = if self.state == State::Text {
            self.all[self.pos..].to_string()
        } else {
            String::new()
        };
        let left = parsed
            .calls
            .into_iter()
            .enumerate()
            .skip(self.started)
            .collect();
        Ok((rest, left))
    }

    /// Whether any call went out.
    pub fn called(&self) -> bool {
        self.started > 0
    }
}

/// One chunk's `delta` for the pieces a push gave (none when they are empty): the text as
/// `content`, each call's start and arguments as one `tool_calls` entry per call, as OpenAI's
/// client accumulates them. `request` names the calls' ids as [`crate::tools::openai_calls`]
/// does.
pub fn delta(pieces: &[Piece], request: &str) -> Option<serde_json::Value> {
    use serde_json::json;
    let mut text = String::new();
    let mut calls: Vec<serde_json::Value> = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => text.push_str(t),
            Piece::Start { index, name } => calls.push(json!({
                "index": index, "id": format!("call_{request}_{index}"), "type": "function",
                "function": {"name": name, "arguments": ""}})),
            Piece::Arguments { index, text } => {
                match calls.iter_mut().find(|c| c["index"] == *index) {
                    Some(c) => {
                        let so_far = c["function"]["arguments"].as_str().unwrap_or("");
                        c["function"]["arguments"] = json!(format!("{so_far}{text}"));
                    }
                    None => calls.push(json!({"index": index, "function": {"arguments": text}})),
                }
            }
        }
    }
    let mut d = serde_json::Map::new();
    if !text.is_empty() {
        d.insert("content".into(), json!(text));
    }
    if !calls.is_empty() {
        d.insert("tool_calls".into(), json!(calls));
    }
    (!d.is_empty()).then_some(serde_json::Value::Object(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pieces: &[&str]) -> (Vec<Piece>, CallStream) {
        let mut s = CallStream::default();
        let mut out = Vec::new();
        for p in pieces {
            out.extend(s.push(p));
        }
        (out, s)
    }

    #[test]
    fn a_call_goes_out_as_its_name_then_its_arguments_as_written() {
        let (out, s) = run(&[
            "Let me add. <to",
            "ol_call>\n{\"name\": \"ad",
            "d\", \"arguments\": {\"a\": 1",
            "20, \"b\": \"}\"}",
            "}\n</tool_call>",
        ]);
        let text: String = out
            .iter()
            .filter_map(|p| match p {
                Piece::Arguments { index: 0, text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(out[0], Piece::Text("Let me add. ".into()));
        assert_eq!(
            out[1],
            Piece::Start {
                index: 0,
                name: "add".into()
            }
        );
        assert_eq!(text, "{\"a\": 120, \"b\": \"}\"}");
        let (rest, left) = s.finish(false).unwrap();
        assert!(rest.is_empty() && left.is_empty() && s.called());
    }

    #[test]
    fn two_calls_take_two_indexes() {
        let one = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let (out, s) = run(&[one, "\n", one]);
        let starts: Vec<_> = out
            .iter()
            .filter_map(|p| match p {
                Piece::Start { index, .. } => Some(*index),
                _ => None,
            })
            .collect();
        assert_eq!(starts, [0, 1]);
        assert!(s.finish(false).unwrap().1.is_empty());
    }

    #[test]
    fn a_call_in_another_shape_is_held_and_sent_whole_at_the_end() {
        let (out, s) =
            run(&["<tool_call>\n{\"arguments\": {\"a\": 1}, \"name\": \"add\"}\n</tool_call>"]);
        assert!(out.is_empty(), "{out:?}");
        let (_, left) = s.finish(false).unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!((left[0].0, left[0].1.name.as_str()), (0, "add"));
    }

    #[test]
    fn text_that_only_looked_like_a_call_goes_out_at_the_end() {
        let (out, s) = run(&["a <", "b <tool"]);
        assert_eq!(out, [Piece::Text("a ".into()), Piece::Text("<b ".into())]);
        assert_eq!(s.finish(false).unwrap().0, "<tool");
    }

    #[test]
    fn a_malformed_call_is_an_error_even_after_its_start_went_out() {
        let (out, s) = run(&["<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": "]);
        assert!(matches!(out[0], Piece::Start { .. }));
        assert!(s.finish(true).unwrap_err().message().contains("max_tokens"));
    }
}
