//! How `refusion generate` shows an answer: streamed text as the committed prefix grows, or
//! the `--visual` canvas (masks, drafts, verified and committed slots), and at the end the
//! figures (`--json`'s object, or llama.cpp's lines on stderr).

use std::io::{IsTerminal, Write};

use refusion_convert::info::human_bytes;

use super::generate::GenerateArgs;
use refusion_engine::chat::{TextStream, Tokenizer};
use refusion_engine::decode::{CellState, DecodeParams, Event, Trace};

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
        Output {
            visual,
            stream: !a.json && !visual && !templated,
            streamer: TextStream::new(tok, prompt.len(), params.eos_id)
                .limit(params.answer_limit()),
            canvas: Canvas::new(Trace::new(params, prompt.len() as u32), !no_color(), |t| {
                tok.decode(&[t], false).unwrap_or_default()
            }),
            tok,
            stdout: std::io::stdout(),
        }
    }

    pub(super) fn event(&mut self, ev: Event<'_>) {
        if self.visual {
            self.canvas.apply(&ev, self.tok);
            self.canvas.draw(&mut self.stdout);
        } else if let (true, Event::Committed { positions, tokens }) = (self.stream, ev) {
            if let Some(text) = self.streamer.push(positions, tokens) {
                let _ = self.stdout.write_all(text.as_bytes());
                let _ = self.stdout.flush();
            }
        }
    }

    /// The streamed text's held-back tail; the canvas's last picture (only the answer).
    pub(super) fn finish(&mut self) {
        if self.visual {
            self.canvas.settle();
            self.canvas.draw(&mut self.stdout);
        }
        if self.stream {
            if let Some(tail) = self.streamer.finish() {
                let _ = self.stdout.write_all(tail.as_bytes());
            }
        }
    }
}

/// What a decode came to, for `--json` or the figures on stderr.
pub(super) struct Report<'r> {
    pub(super) result: &'r refusion_engine::decode::DecodeResult,
    pub(super) text: String,
    /// A template's fills: each gap's text, tokens, first position and whether EOS ended it.
    pub(super) gaps: Option<serde_json::Value>,
    pub(super) prompt_tokens: usize,
    pub(super) cached: usize,
    pub(super) params: &'r DecodeParams,
    pub(super) load_s: f64,
    pub(super) decode_s: f64,
    pub(super) total_s: f64,
    /// The host's share of the memory plan printed at load, and the process's peak resident
    /// memory at the end (Linux), so that the two can be compared.
    pub(super) planned_host_bytes: u64,
    pub(super) peak_resident_bytes: Option<u64>,
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
            // The answer was cut short by its length (a gap too small for its text).
            "truncated": !r.stopped(),
            "finish_reason": if r.stopped() { "stop" } else { "length" },
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
                "slot_threshold": refusion_engine::decode::shortest_f64(p.slot_threshold),
                "token_threshold": refusion_engine::decode::shortest_f64(p.token_threshold),
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
            "memory": {
                "planned_host_bytes": self.planned_host_bytes,
                "peak_resident_bytes": self.peak_resident_bytes,
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
        if let Some(peak) = self.peak_resident_bytes {
            eprintln!(
                "refusion: memory        = {:>10} peak resident (the plan: {} on the host)",
                human_bytes(peak),
                human_bytes(self.planned_host_bytes)
            );
        }
    }
}

/// A template's fills for `--json` (none without a template).
pub(super) fn gaps_json(
    r: &refusion_engine::decode::DecodeResult,
    tok: &Tokenizer,
) -> refusion_engine::error::Result<Option<serde_json::Value>> {
    let Some(f) = &r.filled else {
        return Ok(None);
    };
    let mut gaps = Vec::new();
    for g in &f.gaps {
        gaps.push(serde_json::json!({
            "start": g.start,
            "text": g.text_of(&tok.bytes_of(&g.tokens)),
            "tokens": g.tokens,
            "eos": g.eos,
            "truncated": g.truncated,
        }));
    }
    Ok(Some(serde_json::Value::Array(gaps)))
}

/// Whether `NO_COLOR` asks for no colors (<https://no-color.org>: set and not empty).
pub(super) fn no_color() -> bool {
    std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty())
}

/// The `--visual` canvas: one cell per answer position, as the decode's [`Trace`] has it.
pub(super) struct Canvas {
    trace: Trace,
    /// Each cell's token as text.
    texts: Vec<String>,
    /// ANSI colors for verified and drafted tokens; without them (`NO_COLOR`), verified
    /// tokens are shown plain and drafted ones in brackets.
    color: bool,
}

impl Canvas {
    /// The canvas of a trace (a template's given text shown from the start).
    fn new(trace: Trace, color: bool, piece: impl Fn(u32) -> String) -> Canvas {
        let mut c = Canvas {
            texts: vec![String::new(); trace.cells().len()],
            trace,
            color,
        };
        c.refresh(piece);
        c
    }

    fn apply(&mut self, ev: &Event<'_>, tok: &Tokenizer) {
        self.trace.apply(ev);
        self.refresh(|t| tok.decode(&[t], false).unwrap_or_default());
    }

    /// The answer's end: what was never committed is masked again.
    fn settle(&mut self) {
        self.trace.settle();
        self.refresh(|_| String::new());
    }

    /// The changed cells' texts.
    fn refresh(&mut self, piece: impl Fn(u32) -> String) {
        for (i, cell) in self.trace.take_changes() {
            self.texts[i as usize] = cell.token.map(&piece).unwrap_or_default();
        }
    }

    fn draw(&self, out: &mut impl Write) {
        let mut s = String::from("\x1b[2J\x1b[H");
        for (cell, text) in self.trace.cells().iter().zip(&self.texts) {
            let shown = text.replace('\n', "⏎");
            let drafted = matches!(cell.state, CellState::Planned | CellState::Drafted);
            match (cell.state, self.color) {
                (CellState::Masked, _) => s.push('░'),
                (CellState::Verified, true) => s.push_str(&format!("\x1b[32m{shown}\x1b[0m")),
                (_, true) if drafted => s.push_str(&format!("\x1b[2m{shown}\x1b[0m")),
                (_, false) if drafted => s.push_str(&format!("[{shown}]")),
                _ => s.push_str(&shown),
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
#[cfg(test)]
mod canvas_tests {
    use super::Canvas;
    use refusion_engine::decode::{DecodeParams, Event, Trace};

    fn drawn(color: bool) -> String {
        let d = refusion_gguf::DecodingDefaults {
            gen_length: 4,
            slot_size: 4,
            serial_blocks: 1,
            slot_threshold: 0.9,
            token_threshold: 0.9,
        };
        let piece = |t: u32| ["a", "b", "c"][t as usize].to_string();
        let mut c = Canvas::new(Trace::new(&DecodeParams::new(d, 0, 1), 2), color, piece);
        c.trace.apply(&Event::Committed {
            positions: &[2],
            tokens: &[0],
        });
        c.trace.apply(&Event::Infill {
            slot_starts: &[3],
            tokens: &[vec![1, 2]],
            tags: &[vec![true, false]],
        });
        c.refresh(piece);
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
        assert!(plain.contains("ab[c]░"), "{plain:?}");
        assert!(drawn(true).contains("\x1b[32mb"));
    }
}
