//! `refusion chat`: a multi-turn conversation in the terminal. The KV cache of earlier turns is
//! kept: a new turn costs only its new tokens.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use refusion_gguf::Value;

use super::generate::DecodeArgs;
use super::line_input::{Input, Line};
use super::model_args::ModelArgs;
use refusion_engine::chat::{ChatTemplate, Message, TextStream};
use refusion_engine::decode::{Event, TextPiece};
use refusion_engine::load::runtime::load;
use refusion_engine::session::Session;

static GENERATING: AtomicBool = AtomicBool::new(false);
static CANCEL: AtomicBool = AtomicBool::new(false);

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    decode: DecodeArgs,
    #[command(flatten)]
    grammar: super::grammar_args::GrammarArgs,
    /// A system message that starts the conversation.
    #[arg(long)]
    system: Option<String>,
    /// llama-cli's -i / -cnv: chat is interactive (accepted).
    #[arg(short = 'i', long = "interactive", hide = true)]
    interactive: bool,
    #[arg(long = "conversation", hide = true)]
    conversation: bool,
    /// llama-cli's -mli: refused by name (one line is one message; `\n` in /template).
    #[arg(long = "multiline-input", hide = true)]
    multiline_input: bool,
    /// llama-cli's -no-cnv / -st: refused, pointing to `refusion generate`.
    #[arg(long = "no-conversation", hide = true)]
    no_conversation: bool,
    #[arg(long = "single-turn", hide = true)]
    single_turn: bool,
}

const HELP: &str = "commands: /reset (or /clear)  /save FILE  /load FILE  /template TEXT  \
/set parameter NAME VALUE  /set system TEXT  /show [parameters|system|template]  /bye (or /exit)  \
/? (or /help)  (Ctrl-C stops an answer, Ctrl-D quits; arrows and Ctrl-R recall earlier lines)\n\
/template TEXT: the next answer fills TEXT's {{gap}} / {{gap:N}} (at most N) / {{gap:=N}} markers \
(escapes as in -p: \\n is a newline); \
/template alone forgets it";

/// Saves the conversation: the KV cache, its tokens and the messages.
fn save<M: refusion_engine::model::Forward + ?Sized>(
    s: &Session<'_, M>,
    path: &Path,
    model_hash: u64,
) -> Result<()> {
    let extra = serde_json::to_vec(&s.messages)?;
    s.cache
        .save_prefix(path, model_hash, s.cached_tokens(), &extra)?;
    Ok(())
}

fn restore<M: refusion_engine::model::Forward + ?Sized>(
    s: &mut Session<'_, M>,
    path: &Path,
    model_hash: u64,
) -> Result<()> {
    // A file refused (another model, corrupt, its messages unreadable) leaves the
    // conversation and its cache as they were: every check comes before the cache is touched.
    let mut messages = None;
    let before = s.cache.available();
    let loaded = s.cache.load_prefix_checked(path, model_hash, |extra| {
        let m = serde_json::from_slice::<Vec<Message>>(extra)
            .map_err(|_| "the saved conversation's messages are corrupt".to_string())?;
        messages = Some(m);
        Ok(())
    });
    match (loaded, messages) {
        (Ok(saved), Some(messages)) => {
            s.set_cached(saved.tokens);
            s.messages = messages;
            Ok(())
        }
        (Err(e), _) => {
            // Only a failure while copying entries in (after every check) touched the cache.
            if s.cache.available() != before {
                s.forget_cache();
            }
            Err(e.into())
        }
        (Ok(_), None) => {
            s.forget_cache();
            anyhow::bail!("the saved conversation's messages are missing")
        }
    }
}

pub fn run(a: ChatArgs) -> Result<()> {
    a.decode.check()?;
    let format = a.grammar.format()?;
    if a.multiline_input {
        anyhow::bail!("-mli is not supported: chat takes one line per message (end it with Enter)");
    }
    if a.no_conversation || a.single_turn {
        let flag = if a.single_turn { "-st" } else { "-no-cnv" };
        anyhow::bail!("{flag}: for one answer without a conversation, use refusion generate");
    }
    let _ = (a.interactive, a.conversation);
    super::set_threads(a.model.threads)?;
    let loaded = load(&a.model.load_options(true)?)?;
    let header = &loaded.file.header;
    let params = a.decode.params(header, &loaded.tokenizer)?;
    let params =
        super::grammar_args::GrammarArgs::apply(format.as_ref(), params, &loaded.tokenizer)?;
    let source = header
        .get("tokenizer.chat_template")
        .and_then(Value::as_str)
        .context("the model file has no chat template, which chat needs")?;
    let template = ChatTemplate::new(source)?;
    let block = params.strategy.scratch(&params);
    let cache = loaded.new_cache(loaded.context + block)?;
    let mut chat = Chat {
        session: Session::new(&loaded.model, &loaded.tokenizer, Some(template), cache),
        params,
        context: loaded.context,
        system: a.system.clone(),
        model_hash: loaded.file.layout_hash(),
        chat_template: source.to_string(),
        template: None,
    };
    chat.reset();
    let _ = ctrlc::set_handler(|| {
        if GENERATING.load(Ordering::SeqCst) {
            CANCEL.store(true, Ordering::SeqCst);
        } else {
            std::process::exit(130);
        }
    });
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("{HELP}");
    }
    let mut input_lines = Input::new(interactive);
    loop {
        let line = match input_lines.read("> ")? {
            Line::Text(line) => line,
            Line::Eof => break,
            // ollama's answer to Ctrl-C at the prompt: the chat goes on.
            Line::Interrupted => {
                eprintln!("(Ctrl-D or /bye to exit)");
                continue;
            }
        };
        // ollama's multi-line input: from a line starting with """ to one ending with it.
        if line.trim_start().starts_with(QUOTES) {
            if let Some(message) = multi_line(&line, &mut input_lines)? {
                if !message.trim().is_empty() {
                    chat.turn(&message)?;
                }
            }
            continue;
        }
        match chat.command(&line) {
            Flow::Quit => break,
            Flow::Next => continue,
            Flow::Message => chat.turn(&line)?,
        }
    }
    Ok(())
}

const QUOTES: &str = "\"\"\"";

/// A message typed over several lines, ollama's way: `first` starts with """, and lines are
/// read until one ends with """ (or the input ends). `None`: Ctrl-C dropped it.
fn multi_line(first: &str, input: &mut Input) -> Result<Option<String>> {
    let mut text = first.trim_start()[QUOTES.len()..].to_string();
    if let Some(done) = text.trim_end().strip_suffix(QUOTES) {
        return Ok(Some(done.to_string()));
    }
    loop {
        match input.read("... ")? {
            Line::Text(l) => {
                text.push('\n');
                if let Some(last) = l.trim_end().strip_suffix(QUOTES) {
                    text.push_str(last);
                    return Ok(Some(text.trim_start_matches('\n').to_string()));
                }
                text.push_str(&l);
            }
            Line::Eof => return Ok(Some(text.trim_start_matches('\n').to_string())),
            Line::Interrupted => {
                eprintln!("(message dropped)");
                return Ok(None);
            }
        }
    }
}

/// A chat in the terminal: the session (its messages and cache) and what each turn needs.
struct Chat<'m> {
    session: Session<'m, refusion_engine::model::Qwen3>,
    params: refusion_engine::decode::DecodeParams,
    context: usize,
    system: Option<String>,
    model_hash: u64,
    /// The file's chat template (`/show template`).
    chat_template: String,
    /// `/template`: the next answer fills its gaps.
    template: Option<String>,
}

/// What a line of input asks for.
enum Flow {
    Quit,
    /// Handled (a command, or nothing): read the next line.
    Next,
    /// A message to answer.
    Message,
}

impl Chat<'_> {
    /// A fresh conversation, with the system message if there is one.
    fn reset(&mut self) {
        self.session.reset();
        if let Some(s) = &self.system {
            self.session.messages.push(Message::new("system", s));
        }
    }

    /// Carries out a `/command`; anything else is a message (or nothing, when blank).
    fn command(&mut self, input: &str) -> Flow {
        if input.trim().is_empty() {
            return Flow::Next;
        }
        let (cmd, arg) = input
            .split_once(' ')
            .map(|(c, a)| (c, a.trim()))
            .unwrap_or((input, ""));
        match cmd {
            "/exit" | "/quit" | "/bye" => return Flow::Quit,
            "/help" | "/?" => eprintln!("{HELP}"),
            "/reset" | "/clear" => {
                self.reset();
                eprintln!("(conversation reset)");
            }
            "/set" => self.set(arg),
            "/show" => self.show(arg),
            "/save" | "/load" if arg.is_empty() => eprintln!("usage: {cmd} FILE"),
            "/save" => match save(&self.session, Path::new(arg), self.model_hash) {
                Ok(()) => {
                    let n = self.session.cached_tokens().len();
                    eprintln!("(saved {n} tokens to {arg})")
                }
                Err(e) => eprintln!("error: {e:#}"),
            },
            "/load" => match restore(&mut self.session, Path::new(arg), self.model_hash) {
                Ok(()) => eprintln!(
                    "(loaded {} messages, {} cached tokens from {arg})",
                    self.session.messages.len(),
                    self.session.cached_tokens().len()
                ),
                Err(e) => eprintln!("error: {e:#} (the conversation goes on as it was)"),
            },
            "/template" if arg.is_empty() => {
                self.template = None;
                eprintln!("(answers are generated freely again)");
            }
            "/template" => {
                let text = super::generate::process_escapes(arg);
                match refusion_engine::decode::template::parse(&text, self.params.gen_length) {
                    Ok(pieces) => {
                        let gaps = pieces
                            .iter()
                            .filter(|p| matches!(p, TextPiece::Gap(_)))
                            .count();
                        eprintln!("(the next answer fills this template's {gaps} gap(s))");
                        self.template = Some(text);
                    }
                    Err(e) => eprintln!("error: {e}"),
                }
            }
            // ollama's habit: any other /word is a mistyped command, not a message.
            c if c.starts_with('/') && c.len() > 1 => {
                eprintln!("unknown command {c} (/? for help)")
            }
            _ => return Flow::Message,
        }
        Flow::Next
    }

    /// ollama's `/set parameter NAME VALUE` (its names and ReFusion's) and `/set system TEXT`
    /// (the conversation goes on under the new system message).
    fn set(&mut self, arg: &str) {
        let (what, rest) = arg
            .split_once(' ')
            .map_or((arg, ""), |(w, r)| (w, r.trim()));
        match what {
            "system" if !rest.is_empty() => {
                self.system = Some(rest.to_string());
                let messages = &mut self.session.messages;
                match messages.first_mut() {
                    Some(m) if m.role == "system" => *m = Message::new("system", rest),
                    _ => messages.insert(0, Message::new("system", rest)),
                }
                eprintln!("(system message set)");
            }
            "parameter" => {
                let Some((name, value)) = rest.split_once(' ') else {
                    eprintln!("usage: /set parameter NAME VALUE");
                    return;
                };
                match set_parameter(&self.params, name, value.trim()) {
                    Ok(p) => {
                        self.params = p;
                        eprintln!("(set {name} to {})", value.trim());
                    }
                    Err(e) => eprintln!("error: {e}"),
                }
            }
            _ => eprintln!("usage: /set parameter NAME VALUE, or /set system TEXT"),
        }
    }

    /// ollama's `/show`: the decoding parameters, the system message, the chat template.
    fn show(&self, arg: &str) {
        let p = &self.params;
        match arg {
            "" | "parameters" | "info" => eprintln!(
                "num_predict {}  temperature {}  seed {}  slot_size {}  serial_blocks {}  \
                 slot_threshold {}  token_threshold {}  strategy {}  num_ctx {}",
                p.gen_length,
                p.temperature,
                p.seed,
                p.slot_size,
                p.serial_blocks,
                refusion_engine::decode::shortest_f64(p.slot_threshold),
                refusion_engine::decode::shortest_f64(p.token_threshold),
                p.strategy,
                self.context
            ),
            "system" => eprintln!(
                "{}",
                self.system.as_deref().unwrap_or("(no system message)")
            ),
            "template" => eprintln!("{}", self.chat_template),
            _ => eprintln!("usage: /show [parameters|system|template]"),
        }
    }

    /// The parameters for an answer that fills `template`'s gaps.
    fn templated(
        &self,
        template: &str,
    ) -> refusion_engine::error::Result<refusion_engine::decode::DecodeParams> {
        let pieces = refusion_engine::decode::template::parse(template, self.params.gen_length)?;
        let tok = self.session.tokenizer();
        let t = refusion_engine::decode::Template::from_text(
            &pieces,
            |s| tok.encode_text(s),
            Some(tok),
        )?;
        let base = self.params.clone();
        let vocab = refusion_engine::model::Forward::config(self.session.model()).vocab;
        t.validate_for(base.mask_id, vocab, base.slot_size)?;
        let p = base.with_template(t);
        p.validate()?;
        Ok(p)
    }

    /// Answers one message, streaming the answer; a mistake is said and the chat goes on.
    fn turn(&mut self, input: &str) -> Result<()> {
        let start = Instant::now();
        let mut messages = self.session.messages.clone();
        messages.push(Message::new("user", input));
        let prompt = match self.session.render(&messages) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: {e}");
                return Ok(());
            }
        };
        let params = match self.template.take() {
            Some(t) => match self.templated(&t) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("error: {e}");
                    return Ok(());
                }
            },
            None => self.params.clone(),
        };
        let gen = params.answer_len() as usize;
        if prompt.len() + gen > self.context {
            eprintln!(
                "error: the conversation ({} tokens) plus an answer ({gen}) exceeds the context of {}; /reset or raise -c",
                prompt.len(),
                self.context
            );
            return Ok(());
        }
        let tok = self.session.tokenizer();
        let mut stream =
            TextStream::new(tok, prompt.len(), params.eos_id).limit(params.answer_limit());
        // A template's gaps fill in any order: its answer is printed once filled.
        let streaming = params.template.is_none();
        let mut stdout = std::io::stdout();
        CANCEL.store(false, Ordering::SeqCst);
        GENERATING.store(true, Ordering::SeqCst);
        let result = self.session.generate(&prompt, &params, &CANCEL, &mut |ev| {
            if let (true, Event::Committed { positions, tokens }) = (streaming, ev) {
                if let Some(text) = stream.push(positions, tokens) {
                    let _ = stdout.write_all(text.as_bytes());
                    let _ = stdout.flush();
                }
            }
        });
        GENERATING.store(false, Ordering::SeqCst);
        match &result {
            Ok(_) if streaming => {
                if let Some(tail) = stream.finish() {
                    let _ = stdout.write_all(tail.as_bytes());
                }
            }
            Ok(r) => {
                let _ = stdout.write_all(tok.decode(r.answer(), true)?.as_bytes());
            }
            Err(_) => {}
        }
        println!();
        match result {
            Ok(r) => {
                let text = tok.decode(r.answer(), true)?;
                messages.push(Message::new("assistant", &text));
                self.session.messages = messages;
                let secs = start.elapsed().as_secs_f64();
                eprintln!(
                    "[{} tokens in {:.2} s, {:.1} tokens/s, TPF {:.2}, {} of {} prompt tokens from the cache]",
                    r.completion_tokens(),
                    secs,
                    r.completion_tokens() as f64 / secs.max(1e-9),
                    r.tpf,
                    self.session.last_reused,
                    prompt.len()
                );
            }
            Err(refusion_engine::error::Error::Cancelled) => eprintln!("(stopped)"),
            Err(e) => eprintln!("error: {e}"),
        }
        Ok(())
    }
}

/// `params` with one setting changed by `/set parameter`: ollama's names (`num_predict`,
/// `temperature`, `seed`) and ReFusion's; checked as a request's are.
fn set_parameter(
    params: &refusion_engine::decode::DecodeParams,
    name: &str,
    value: &str,
) -> Result<refusion_engine::decode::DecodeParams> {
    fn num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
        v.parse()
            .map_err(|_| anyhow::anyhow!("{name}: '{v}' is not a valid value"))
    }
    let mut p = params.clone();
    match name {
        "num_predict" | "max_tokens" => {
            // As `-n` does: serial blocks kept near the block length they had.
            p.gen_length = num(name, value)?;
            p.fit_serial_blocks(params.block_len());
        }
        "temperature" => p.temperature = num(name, value)?,
        "seed" => p.seed = num(name, value)?,
        "slot_size" => p.slot_size = num(name, value)?,
        "serial_blocks" => p.serial_blocks = num(name, value)?,
        "slot_threshold" => p.slot_threshold = num(name, value)?,
        "token_threshold" => p.token_threshold = num(name, value)?,
        _ => anyhow::bail!(
            "unknown parameter '{name}' (num_predict, temperature, seed, slot_size, serial_blocks, slot_threshold, token_threshold)"
        ),
    }
    p.validate()?;
    Ok(p)
}
