//! The `refusion` command line.

mod answer;
mod batch;
mod bench;
mod bounded;
mod chat;
mod convert_cmd;
mod demo;
pub mod generate;
mod grammar_args;
mod line_input;
pub mod model_args;
mod models;
mod serve;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "refusion",
    version,
    about = "Run the ReFusion diffusion language model from GGUF files"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert a Hugging Face Qwen3/ReFusion checkpoint folder to one GGUF file.
    Convert(convert_cmd::ConvertArgs),
    /// Re-encode an f32/f16/bf16 GGUF file to another type (like llama-quantize).
    Quantize(convert_cmd::QuantizeArgs),
    /// Print a GGUF file's metadata and tensor table.
    Info(convert_cmd::InfoArgs),
    /// Write the embedded tiny ReFusion, convert it and answer a question with it (no download).
    Demo(demo::DemoArgs),
    /// Generate an answer with ReFusion's slot decoding.
    Generate(generate::GenerateArgs),
    /// Chat in the terminal; earlier turns stay in the KV cache.
    Chat(chat::ChatArgs),
    /// Serve an OpenAI-compatible API (chat and text completions, streaming).
    Serve(serve::ServeArgs),
    /// Measure forward throughput (llama-bench's table).
    Bench(bench::BenchArgs),
    /// Run a model (ollama's `run`): a file or ORG/NAME[:QUANT] (pulled when missing); with a
    /// prompt, generate; without, chat.
    Run(models::RunArgs),
    /// Download a GGUF model from the Hugging Face Hub into its cache (ollama's `pull`).
    Pull(models::PullArgs),
    /// The GGUF models in the Hugging Face cache (ollama's `list`).
    #[command(visible_alias = "ls")]
    List(models::ListArgs),
    /// A model's architecture, size, quant, context, decoding defaults and template.
    Show(models::ShowArgs),
    /// Delete models from the Hugging Face cache (ollama's `rm`).
    Rm(models::RmArgs),
    /// What a running `refusion serve` has loaded (asked through its API).
    Ps(models::PsArgs),
}

/// Runs the command line and returns the process exit code.
pub fn main() -> i32 {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().map(llama_cpp_flag).collect();
    if let Some(code) = bench::lists::run_if_lists(&argv) {
        return code;
    }
    let cli = Cli::parse_from(argv);
    quiet_on_closed_stdout(&cli.command);
    quiet_on_lost_terminal();
    let result = dispatch(cli.command);
    exit_code(result)
}

/// The engine's notes while loading (the plan, the load line, warnings), to stderr as they come.
pub(crate) fn notes() -> refusion_engine::load::Notes {
    refusion_engine::load::Notes::to(|line| eprintln!("{line}"))
}

/// Runs another command line (`run` hands over to `generate` or `chat`).
fn run_argv(argv: Vec<String>) -> anyhow::Result<()> {
    let cli = Cli::try_parse_from(argv.into_iter().map(|a| llama_cpp_flag(a.into())))
        .map_err(|e| anyhow::anyhow!("{}", e.render().to_string().trim_end()))?;
    dispatch(cli.command)
}

fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Convert(args) => convert_cmd::convert(args),
        Command::Quantize(args) => convert_cmd::quantize(args),
        Command::Info(args) => convert_cmd::info(args),
        Command::Demo(args) => demo::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Run(args) => models::run(args),
        Command::Pull(args) => models::pull(args),
        Command::List(args) => models::list(args),
        Command::Show(args) => models::show(args),
        Command::Rm(args) => models::rm(args),
        Command::Ps(args) => models::ps(args),
    }
}

fn exit_code(result: anyhow::Result<()>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            if matches!(
                e.downcast_ref::<refusion_gguf::Error>(),
                Some(refusion_gguf::Error::Interrupted)
            ) {
                eprintln!("interrupted: no output file was written");
                return 130;
            }
            eprintln!("error: {e:#}");
            1
        }
    }
}

/// A terminal closed under the program (its window shut while `chat` waits at the prompt, the
/// session gone with SIGHUP ignored) makes the next `print!` fail with EIO, which Rust turns into
/// a panic (exit 101 and a panic message), as does `eprint!`. That is the terminal going away,
/// not a bug: the process ends with one line on stderr (if it still has one) and exit code 74
/// (EX_IOERR).
fn quiet_on_lost_terminal() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        let lost = ["failed printing to stdout: ", "failed printing to stderr: "]
            .iter()
            .find_map(|p| msg.strip_prefix(p));
        if let Some(why) = lost {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "error: the terminal went away ({why})");
            std::process::exit(74);
        }
        default(info);
    }));
}

/// `refusion generate ... | head -1`: once the reader has gone, the next write to stdout ends
/// the process quietly (SIGPIPE's default action, exit status 141 in a shell), as `cat` and
/// llama.cpp's tools do. Rust ignores SIGPIPE, which turns that write into an error, and
/// `println!` into a panic. Output files are written atomically, so being stopped this way
/// leaves at most a `.partial` beside an untouched target. The server keeps ignoring it: a
/// client that hangs up is an error to handle there, never a reason to exit.
fn quiet_on_closed_stdout(command: &Command) {
    #[cfg(unix)]
    if !matches!(command, Command::Serve(_)) {
        // SAFETY: restoring a signal's default action, before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    #[cfg(not(unix))]
    let _ = command;
}

/// llama.cpp's multi-letter short flags, which clap cannot declare, as their long forms.
fn llama_cpp_flag(arg: std::ffi::OsString) -> std::ffi::OsString {
    let Some(s) = arg.to_str() else {
        return arg;
    };
    for (short, long) in [
        ("-ngl", "--n-gpu-layers"),
        ("-hf", "--hf-repo"),
        ("-np", "--parallel"),
        ("-hfr", "--hf-repo"),
        ("-ub", "--ubatch-size"),
        ("-sys", "--system"),
        ("-ctk", "--cache-type-k"),
        ("-ctv", "--cache-type-v"),
        ("-fa", "--flash-attn"),
        ("-cnv", "--conversation"),
        ("-no-cnv", "--no-conversation"),
        ("-st", "--single-turn"),
        ("-cb", "--cont-batching"),
        ("-nocb", "--no-cont-batching"),
        ("-pg", "--pg"),
        ("-mli", "--multiline-input"),
        ("-to", "--timeout"),
    ] {
        if s == short {
            return long.into();
        }
        let Some(rest) = s.strip_prefix(short) else {
            continue;
        };
        // `-ngl=99`, or a number written onto the flag (`-ngl99`, `-np4`), which clap would
        // read as a one-letter flag and its value (`-n gl99`).
        let number = !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit());
        if let Some(v) = rest.strip_prefix('=').or(number.then_some(rest)) {
            return format!("{long}={v}").into();
        }
    }
    arg
}

/// Sizes the thread pools (`-t`): [`refusion_engine::load::runtime::set_threads`], its
/// warning on stderr.
pub(crate) fn set_threads(threads: Option<usize>) -> anyhow::Result<()> {
    let notes = refusion_engine::load::Notes::to(|line| eprintln!("{line}"));
    refusion_engine::load::runtime::set_threads(threads, &notes).map_err(anyhow::Error::msg)
}
