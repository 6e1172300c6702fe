//! How `refusion generate` shows an answer: streamed text as the committed prefix grows, or
//! the `--visual` canvas (masks, drafts, verified and committed slots), and at the end the
//! figures (`--json`'s object, or llama.cpp's lines on stderr).

use std::io::{IsTerminal, Write};

use super::generate::GenerateArgs;
use crate::chat::{TextStream, Tokenizer};
use crate::decode::{DecodeParams, Event};

/// Where the answer goes as it decodes: streamed text, or the `--visual` canvas, or nothing
/// until the end (`--json`).
pub(super) struct Output<'t> {
    pub(super) visual: bool,
    stream: bool,
    streamer: TextStream<'t>,
    canvas: Canvas,
    tok: &'t Tokenizer,
    stdout: std::io::Stdout,
}

impl<'t> Output<'t> {
    pub(super) fn new(
        a: &GenerateArgs,
        tok: &'t Tokenizer,
        prompt: &[u32],
        params: &DecodeParams,
    ) -> Self {
        // The canvas is drawn with escape codes: only on a terminal.
        let visual = a.visual && !a.json && std::io::stdout().is_terminal();
        // A template's answer is printed once its gaps are filled (they fill in any order).
        let templated = params.template.is_some();
        if a.visual && !a.json && !visual {
            eprintln!("note: --visual needs a terminal; printing the answer as text");
        }
        let gen = params.answer_len() as usize;
        Output {
            visual,
            stream: !a.json && !visual && !templated,
            streamer: TextStream::new(tok, prompt.len(), params.eos_id)
                .limit(params.answer_limit()),
            canvas: Canvas {
                prompt_len: prompt.len() as u32,
                cells: vec![(' ', String::new()); gen],
                color: !no_color(),
            },
            tok,
            stdout: std::io::stdout(),
        }
    }

    fn piece(&self, t: u32) -> String {
        self.tok.decode(&[t], false).unwrap_or_default()
    }

    pub(super) fn event(&mut self, ev: Event<'_>) {
        match ev {
            Event::Committed { positions, tokens } if self.visual => {
                for (&p, &t) in positions.iter().zip(tokens) {
                    self.canvas.set(p, 'C', self.piece(t));
                }
            }
            Event::Committed { positions, tokens } if self.stream => {
                if let Some(text) = self.streamer.push(positions, tokens) {
                    let _ = self.stdout.write_all(text.as_bytes());
                    let _ = self.stdout.flush();
                }
                return;
            }
            Event::Planned {
                slot_starts,
                slot_size,
                tokens,
            } if self.visual => {
                for (s, &start) in slot_starts.iter().enumerate() {
                    for j in 0..slot_size {
                        let piece = self.piece(tokens[s * slot_size + j]);
                        self.canvas.set(start + j as u32, 'D', piece);
                    }
                }
            }
            Event::Infill {
                slot_starts,
                tokens,
                tags,
            } if self.visual => {
                for (r, &start) in slot_starts.iter().enumerate() {
                    for (j, &t) in tokens[r].iter().enumerate() {
                        let state = if tags[r][j] { 'V' } else { 'D' };
                        self.canvas.set(start + j as u32, state, self.piece(t));
                    }
                }
            }
            _ => return,
        }
        self.canvas.draw(&mut self.stdout);
    }

    /// The streamed text's held-back tail.
    pub(super) fn finish(&mut self) {
        if self.stream {
            if let Some(tail) = self.streamer.finish() {
                let _ = self.stdout.write_all(tail.as_bytes());
            }
        }
    }
}

/// What a decode came to, for `--json` or the figures on stderr.
pub(super) struct Report<'r> {
    pub(super) result: &'r crate::decode::DecodeResult,
    pub(super) text: String,
    /// A template's fills: each gap's text, tokens, first position and whether EOS ended it.
    pub(super) gaps: Option<serde_json::Value>,
    pub(super) prompt_tokens: usize,
    pub(super) cached: usize,
    pub(super) params: &'r DecodeParams,
    pub(super) load_s: f64,
    pub(super) decode_s: f64,
    pub(super) total_s: f64,
}

impl Report<'_> {
    /// Tokens the model wrote, counted as the server's `usage` counts them.
    fn generated(&self) -> usize {
        self.result.completion_tokens()
    }

    fn tokens_per_s(&self) -> f64 {
        self.generated() as f64 / self.decode_s.max(1e-9)
    }

    pub(super) fn json(&self) -> serde_json::Value {
        let (r, p) = (self.result, self.params);
        serde_json::json!({
            "tokens": r.tokens,
            "positions": r.positions,
            "text": self.text,
            "answer_tokens": r.answer().len(),
            "eos_found": r.stopped(),
            "gaps": self.gaps,
            "tpf": r.tpf,
            "forward_calls": r.forward_calls,
            "forward_tokens": r.forward_tokens,
            "forward_sizes": r.forward_sizes,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached,
            "params": {
                "gen_length": p.gen_length,
                "slot_size": p.slot_size,
                "serial_blocks": p.serial_blocks,
                "slot_threshold": as_f64(p.slot_threshold),
                "token_threshold": as_f64(p.token_threshold),
                "temperature": p.temperature,
                "seed": p.seed,
                "strategy": p.strategy.name(),
            },
            "timings": {
                "load_ms": self.load_s * 1e3,
                "generate_ms": self.decode_s * 1e3,
                "total_ms": self.total_s * 1e3,
                "tokens_per_s": self.tokens_per_s(),
            },
        })
    }

    /// llama.cpp's figures on stderr.
    pub(super) fn print_stats(&self) {
        let r = self.result;
        eprintln!();
        eprintln!("refusion: load time     = {:>10.2} ms", self.load_s * 1e3);
        eprintln!(
            "refusion: prompt        = {:>10} tokens",
            self.prompt_tokens
        );
        eprintln!(
            "refusion: generated     = {:>10} tokens ({}) in {:.2} ms, {:.2} tokens/s",
            self.generated(),
            match (&r.filled, r.eos_index) {
                (Some(f), _) => format!(
                    "in {} gaps, {} ended by EOS",
                    f.gaps.len(),
                    f.gaps.iter().filter(|g| g.eos).count()
                ),
                (None, Some(i)) => format!("answer: {i} before EOS"),
                (None, None) => "no EOS".to_string(),
            },
            self.decode_s * 1e3,
            self.tokens_per_s()
        );
        eprintln!(
            "refusion: forward calls = {:>10} ({:.1} tokens fed per call), TPF {:.3} (tokens committed per forward, the reference's measure)",
            r.forward_calls,
            r.forward_tokens as f64 / r.forward_calls.max(1) as f64,
            r.tpf
        );
    }
}

/// A template's fills for `--json` (none without a template).
pub(super) fn gaps_json(
    r: &crate::decode::DecodeResult,
    tok: &Tokenizer,
) -> crate::error::Result<Option<serde_json::Value>> {
    let Some(f) = &r.filled else {
        return Ok(None);
    };
    let mut gaps = Vec::new();
    for g in &f.gaps {
        gaps.push(serde_json::json!({
            "start": g.start,
            "text": tok.decode(&g.tokens, true)?,
            "tokens": g.tokens,
            "eos": g.eos,
        }));
    }
    Ok(Some(serde_json::Value::Array(gaps)))
}

/// Whether `NO_COLOR` asks for no colors (<https://no-color.org>: set and not empty).
pub(super) fn no_color() -> bool {
    std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty())
}

/// The `--visual` canvas: one cell per generated position.
pub(super) struct Canvas {
    prompt_len: u32,
    cells: Vec<(char, String)>,
    /// ANSI colors for verified and drafted tokens; without them (`NO_COLOR`), verified
    /// tokens are shown plain and drafted ones in brackets.
    color: bool,
}

impl Canvas {
    fn set(&mut self, pos: u32, state: char, text: String) {
        if let Some(c) = self.cells.get_mut((pos - self.prompt_len) as usize) {
            if c.0 != 'C' {
                *c = (state, text);
            }
        }
    }

    fn draw(&self, out: &mut impl Write) {
        let mut s = String::from("\x1b[2J\x1b[H");
        for (state, text) in &self.cells {
            let shown = text.replace('\n', "⏎");
            match (state, self.color) {
                ('C', _) | ('V', false) => s.push_str(&shown),
                ('V', true) => s.push_str(&format!("\x1b[32m{shown}\x1b[0m")),
                ('D', true) => s.push_str(&format!("\x1b[2m{shown}\x1b[0m")),
                ('D', false) => s.push_str(&format!("[{shown}]")),
                _ => s.push('░'),
            }
        }
        s.push_str(if self.color {
            "\n\n\x1b[0mcommitted  \x1b[32mverified\x1b[0m  \x1b[2mdrafted\x1b[0m  ░ masked\n"
        } else {
            "\n\ncommitted or verified  [drafted]  ░ masked\n"
        });
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
    }
}

/// An f32 as the f64 with the same shortest decimal form (0.6, not 0.6000000238).
pub(super) fn as_f64(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

#[cfg(test)]
mod canvas_tests {
    use super::Canvas;

    fn drawn(color: bool) -> String {
        let mut c = Canvas {
            prompt_len: 2,
            cells: vec![(' ', String::new()); 3],
            color,
        };
        c.set(2, 'C', "a".into());
        c.set(3, 'V', "b".into());
        c.set(4, 'D', "c".into());
        let mut out = Vec::new();
        c.draw(&mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn no_color_draws_without_color_codes() {
        let plain = drawn(false);
        assert!(
            !plain.contains("\x1b[3") && !plain.contains("\x1b[2m"),
            "{plain:?}"
        );
        assert!(plain.contains("ab[c]"), "{plain:?}");
        assert!(drawn(true).contains("\x1b[32mb"));
    }
}
