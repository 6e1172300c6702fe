//! The chat's input: on a terminal, rustyline's line editing (arrows, Ctrl-A/E/W, Ctrl-R
//! search) with a history kept across runs, as ollama's `run` has; from a pipe, plain lines.

use std::path::PathBuf;

use super::bounded;

use anyhow::Result;
use rustyline::error::ReadlineError;
use rustyline::DefaultEditor;

/// What one read gave.
pub enum Line {
    Text(String),
    /// Ctrl-C at the prompt (on a terminal).
    Interrupted,
    /// Ctrl-D, or the end of the piped input.
    Eof,
}

pub enum Input {
    Terminal {
        editor: Box<DefaultEditor>,
        history: Option<PathBuf>,
        warned: bool,
    },
    /// Lines of at most [`bounded::LINE_BYTES`].
    Pipe(bounded::Lines<std::io::StdinLock<'static>>),
}

/// `$XDG_STATE_HOME/refusion/chat_history`, else `~/.local/state/refusion/chat_history`.
pub fn history_path() -> Option<PathBuf> {
    let state = std::env::var_os("XDG_STATE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".local/state"))
        })?;
    Some(state.join("refusion").join("chat_history"))
}

impl Input {
    /// Line editing when stdin is a terminal (and rustyline can drive it), plain lines otherwise.
    pub fn new(terminal: bool) -> Input {
        if terminal {
            if let Ok(mut editor) = DefaultEditor::new() {
                let history = history_path();
                if let Some(p) = &history {
                    // A first run has no history yet: not an error.
                    let _ = editor.load_history(p);
                }
                return Input::Terminal {
                    editor: Box::new(editor),
                    history,
                    warned: false,
                };
            }
        }
        Input::Pipe(bounded::Lines::new(
            std::io::stdin().lock(),
            bounded::LINE_BYTES,
        ))
    }

    pub fn read(&mut self, prompt: &str) -> Result<Line> {
        match self {
            Input::Pipe(lines) => match lines.next_line() {
                Ok(Some(line)) => Ok(Line::Text(line)),
                Ok(None) => Ok(Line::Eof),
                Err(e) => Err(anyhow::anyhow!("standard input: {e}")),
            },
            Input::Terminal {
                editor,
                history,
                warned,
            } => match editor.readline(prompt) {
                Ok(line) => {
                    if !line.trim().is_empty() {
                        let _ = editor.add_history_entry(line.as_str());
                        if let Some(p) = history {
                            if let Err(e) = save_history(editor, p) {
                                if !*warned {
                                    eprintln!(
                                        "note: chat history not saved to {}: {e}",
                                        p.display()
                                    );
                                    *warned = true;
                                }
                            }
                        }
                    }
                    Ok(Line::Text(line))
                }
                Err(ReadlineError::Interrupted) => Ok(Line::Interrupted),
                Err(ReadlineError::Eof) => Ok(Line::Eof),
                Err(e) => Err(anyhow::anyhow!("reading the terminal: {e}")),
            },
        }
    }
}

/// Saved after every line, so a killed chat keeps what was typed.
fn save_history(editor: &mut DefaultEditor, path: &std::path::Path) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    editor.save_history(path)?;
    Ok(())
}
