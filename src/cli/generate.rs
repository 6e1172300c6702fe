//! `refusion generate`: one answer from a prompt, streamed as the committed prefix grows.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{ArgGroup, Args};
use refusion_gguf::decoding::{KEY_GEN_LENGTH, KEY_SERIAL_BLOCKS, KEY_SLOT_SIZE, MAX_TOKENS};
use refusion_gguf::DecodingDefaults;
use refusion_gguf::{GgufHeader, Value};

use super::answer::{Output, Report};
use super::model_args::ModelArgs;
use refusion_engine::chat::{ChatTemplate, Message, Tokenizer};
use refusion_engine::decode::DecodeParams;

use super::grammar_args::GrammarArgs;
use refusion_engine::kv::claim::{claim, CacheFile};
use refusion_engine::load::plan::Workload;
use refusion_engine::load::runtime::{load, load_for};
use refusion_engine::session::Session;

#[derive(Args)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "file", "prompt_ids", "batch"])))]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text (sent through the model's chat template unless --no-chat-template).
    #[arg(short = 'p', long)]
    prompt: Option<String>,
    /// Read the prompt text from a file (`-` for standard input).
    #[arg(short = 'f', long)]
    file: Option<PathBuf>,
    /// Prompt as token ids, fed as they are (no template).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// A system message for the chat template.
    #[arg(long)]
    system: Option<String>,
    /// Tokenize the prompt text as it is, without the chat template.
    #[arg(long)]
    no_chat_template: bool,
    /// llama-cli's -cnv: refused, pointing to `refusion chat`.
    #[arg(long = "conversation", hide = true)]
    conversation: bool,
    /// llama-cli's -i: refused, pointing to `refusion chat`.
    #[arg(short = 'i', long = "interactive", hide = true)]
    interactive: bool,
    /// llama-cli's -no-cnv and -st: generate answers one prompt and exits (accepted).
    #[arg(long = "no-conversation", hide = true)]
    no_conversation: bool,
    #[arg(long = "single-turn", hide = true)]
    single_turn: bool,
    #[command(flatten)]
    decode: DecodeArgs,
    /// Fill the gaps of this answer (any-order generation): known text with `{{gap}}` (at
    /// most -n tokens) or `{{gap:N}}` markers. With the chat template it is the assistant's
    /// answer; with --no-chat-template, the text right after the prompt. See docs/infill.md.
    #[arg(long, value_name = "TEXT", conflicts_with_all = ["batch", "suffix"])]
    template: Option<String>,
    /// The text after the answer: shorthand for --template '{{gap}}TEXT'.
    #[arg(long, value_name = "TEXT", conflicts_with = "batch")]
    suffix: Option<String>,
    #[command(flatten)]
    grammar: super::grammar_args::GrammarArgs,
    /// Take `\n`, `\t`, `\\` ... in -p, --system, --template and --suffix as they are
    /// written, without llama.cpp's escape processing (on by default, as there).
    #[arg(long)]
    no_escape: bool,
    /// Print the prompt's tokens (id and text) to stderr before the answer, as llama-cli does.
    #[arg(long)]
    verbose_prompt: bool,
    /// llama-cli's --color: refused by name (the answer is plain text; --visual draws the
    /// decode).
    #[arg(long, hide = true)]
    color: bool,
    /// llama.cpp's -e/--escape: escapes are processed by default (accepted).
    #[arg(short = 'e', long = "escape", hide = true)]
    escape: bool,
    /// Read special tokens' text in a template's known spans as the tokens (llama.cpp's
    /// `parse_special`); by default `<|im_end|>` written there is text.
    #[arg(long)]
    parse_special: bool,
    /// Print one JSON object with the tokens, text and figures instead of streaming text.
    #[arg(long)]
    pub(super) json: bool,
    /// Show the canvas live: masks, drafts, verified and committed slots.
    #[arg(long)]
    pub(super) visual: bool,
    /// Save the prompt's KV cache to this file, and reuse it when a later prompt starts with
    /// the same tokens (llama.cpp's --prompt-cache).
    #[arg(long, value_name = "FILE")]
    prompt_cache: Option<PathBuf>,
    /// Run every request of a JSON-lines file (one object per line: `prompt` or `messages`,
    /// optional decoding fields) together, writing one JSON result per line in input order
    /// (`-` reads standard input).
    #[arg(long, value_name = "FILE.jsonl", conflicts_with_all = ["json", "visual", "prompt_cache"])]
    batch: Option<PathBuf>,
    /// With --batch: write the results to this file (atomically) instead of standard output.
    #[arg(short = 'o', long = "output", value_name = "FILE", requires = "batch")]
    output: Option<PathBuf>,
    /// With --batch: requests decoded together (`-np`).
    #[arg(
        long = "parallel",
        value_name = "N",
        default_value_t = 8,
        requires = "batch"
    )]
    parallel: usize,
}

/// ReFusion's decoding knobs, shared by `generate`, `chat` and `serve`.
#[derive(Args, Clone, Debug)]
pub struct DecodeArgs {
    /// Tokens to generate (rounded up to whole slots; -1: the file's) [default: from the file,
    /// else 512].
    #[arg(short = 'n', long, visible_aliases = ["n-predict", "predict"], allow_negative_numbers = true)]
    gen_length: Option<i64>,
    /// Tokens per slot [default: from the file, else 4].
    #[arg(long, allow_negative_numbers = true)]
    slot_size: Option<u32>,
    /// Serial blocks the answer is decoded in, left to right [default: from the file, else 32].
    #[arg(long, allow_negative_numbers = true)]
    serial_blocks: Option<u32>,
    /// Slots whose first token is more likely than this are drafted together [default: 0.6].
    #[arg(long, allow_negative_numbers = true)]
    slot_threshold: Option<f32>,
    /// Tokens more likely than this are accepted in verification [default: 0.3].
    #[arg(long, allow_negative_numbers = true)]
    token_threshold: Option<f32>,
    /// Temperature of the planning drafts (0: greedy).
    #[arg(long = "temp", default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f64,
    /// How to decode: `slots` (ReFusion's slot decoding), `ar` (plain left-to-right, one
    /// token per forward, to compare with on the same file) or `infill` (gaps; chosen by
    /// --template/--suffix).
    #[arg(long, value_name = "slots|ar|infill", value_parser = parse_strategy)]
    strategy: Option<refusion_engine::decode::Kind>,
    /// Seed of the sampling noise (-1: a random one, printed).
    #[arg(short = 's', long, default_value_t = 0, allow_negative_numbers = true)]
    seed: i128,
    /// llama.cpp's sampling flags, which slot decoding cannot honour: refused by name.
    #[arg(long = "top-k", hide = true, allow_hyphen_values = true)]
    top_k: Option<String>,
    #[arg(long = "top-p", hide = true, allow_hyphen_values = true)]
    top_p: Option<String>,
    #[arg(long = "min-p", hide = true, allow_hyphen_values = true)]
    min_p: Option<String>,
    #[arg(long = "repeat-penalty", hide = true, allow_hyphen_values = true)]
    repeat_penalty: Option<String>,
}

impl DecodeArgs {
    /// What can be checked before the model loads: sampling flags slot decoding cannot honour,
    /// the temperature and the thresholds' range.
    pub fn check(&self) -> Result<()> {
        for (flag, set) in [
            ("--top-k", self.top_k.is_some()),
            ("--top-p", self.top_p.is_some()),
            ("--min-p", self.min_p.is_some()),
            ("--repeat-penalty", self.repeat_penalty.is_some()),
        ] {
            if set {
                anyhow::bail!(
                    "{flag} is not supported: ReFusion's slot decoding takes the most likely token in verification and infill (--temp only adds noise to the planning drafts)"
                );
            }
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            anyhow::bail!("--temp must be >= 0, got {}", self.temperature);
        }
        if let Some(n) = self.gen_length.filter(|&n| n != -1) {
            if !(1..=MAX_TOKENS as i64).contains(&n) {
                anyhow::bail!(
                    "-n must be -1 (the file's gen length) or between 1 and {MAX_TOKENS}, got {n}"
                );
            }
        }
        if !(-1..=u64::MAX as i128).contains(&self.seed) {
            anyhow::bail!(
                "-s must be -1 (a random seed) or between 0 and {}, got {}",
                u64::MAX,
                self.seed
            );
        }
        for (flag, v) in [
            ("--slot-size", self.slot_size),
            ("--serial-blocks", self.serial_blocks),
        ] {
            if let Some(v) = v.filter(|v| !(1..=MAX_TOKENS).contains(v)) {
                anyhow::bail!("{flag} must be between 1 and {MAX_TOKENS}, got {v}");
            }
        }
        for (flag, v) in [
            ("--slot-threshold", self.slot_threshold),
            ("--token-threshold", self.token_threshold),
        ] {
            if let Some(v) = v.filter(|v| !(0.0..=1.0).contains(v)) {
                anyhow::bail!("{flag} must be in [0, 1], got {v}");
            }
        }
        Ok(())
    }

    /// `-n`, where it is given as a number (-1 is the file's).
    fn gen_length(&self) -> Option<u32> {
        self.gen_length.and_then(|n| u32::try_from(n).ok())
    }

    /// `-s`; -1 draws a random seed and prints it, so the run can be repeated.
    fn seed(&self) -> u64 {
        match u64::try_from(self.seed) {
            Ok(s) => s,
            Err(_) => {
                use std::hash::{BuildHasher, Hasher};
                let s = std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish();
                eprintln!("seed: {s}");
                s
            }
        }
    }

    /// The parameters: these flags over the file's defaults over the model card's.
    pub fn params(&self, header: &GgufHeader, tok: &Tokenizer) -> Result<DecodeParams> {
        self.params_for(header, tok, false)
    }

    /// [`Self::params`], checked for the infill strategy when `infill` (a template to fill)
    /// and no other strategy is named.
    pub fn params_for(
        &self,
        header: &GgufHeader,
        tok: &Tokenizer,
        infill: bool,
    ) -> Result<DecodeParams> {
        let d = DecodingDefaults::from_metadata(header).map_err(anyhow::Error::msg)?;
        let eos = tok
            .eos_id
            .context("the model file has no EOS token (tokenizer.ggml.eos_token_id)")?;
        let mask = tok.mask_id.context(
            "the model file has no mask token (neither tokenizer.ggml.mask_token_id nor <|mask|> in its vocabulary): not a ReFusion model",
        )?;
        if tok.mask_from_vocab {
            eprintln!(
                "note: the file has no tokenizer.ggml.mask_token_id (llama.cpp's converter omits it); using <|mask|> = {mask} from its vocabulary"
            );
        }
        let mut p = DecodeParams::new(d, eos, mask);
        p.gen_length = self.gen_length().unwrap_or(d.gen_length);
        p.slot_size = self.slot_size.unwrap_or(d.slot_size);
        p.serial_blocks = self.serial_blocks.unwrap_or(d.serial_blocks);
        if self.serial_blocks.is_none() && p.gen_length != d.gen_length {
            // Keep the default block length rather than the default block count.
            let block = DecodeParams::new(d, eos, mask).block_len();
            p.fit_serial_blocks(block);
        }
        p.slot_threshold = self.slot_threshold.unwrap_or(d.slot_threshold);
        p.token_threshold = self.token_threshold.unwrap_or(d.token_threshold);
        p.temperature = self.temperature;
        p.seed = self.seed();
        p.strategy = match self.strategy {
            Some(k) => k,
            None if infill => refusion_engine::decode::Kind::Infill,
            None => refusion_engine::decode::Kind::Slots,
        };
        p.validate().map_err(|e| {
            // Name the file's keys behind the values the flags left alone.
            let from_file: Vec<String> = [
                (self.gen_length(), KEY_GEN_LENGTH, "-n"),
                (self.slot_size, KEY_SLOT_SIZE, "--slot-size"),
                (self.serial_blocks, KEY_SERIAL_BLOCKS, "--serial-blocks"),
            ]
            .iter()
            .filter(|(flag, key, _)| flag.is_none() && header.get(key).is_some())
            .map(|(_, key, flag)| format!("{key} (or {flag})"))
            .collect();
            if from_file.is_empty() {
                anyhow::Error::from(e)
            } else {
                anyhow::anyhow!("{e}; from the file's {}", from_file.join(", "))
            }
        })?;
        if p.strategy == refusion_engine::decode::Kind::Slots && p.dropped_tail() > 0 {
            eprintln!(
                "note: the last {} positions do not fill a serial block and are not generated (as in the reference)",
                p.dropped_tail()
            );
        }
        Ok(p)
    }
}

/// `--batch`: the file read and checked first, then the model loaded and every line run.
fn run_batch(a: &GenerateArgs, path: &std::path::Path) -> Result<()> {
    if !(1..=256).contains(&a.parallel) {
        bail!("--parallel must be between 1 and 256, got {}", a.parallel);
    }
    if let Some(out) = &a.output {
        let parent = out.parent().filter(|p| !p.as_os_str().is_empty());
        if parent.is_some_and(|p| !p.is_dir()) {
            bail!(
                "output folder '{}' does not exist",
                parent.unwrap_or(out).display()
            );
        }
        refusion_gguf::atomic::check_target(out)?;
        if out.canonicalize().ok() == path.canonicalize().ok() && out.exists() {
            bail!(
                "{}: the output would overwrite the batch file",
                out.display()
            );
        }
    }
    let lines = super::batch::read(path)?;
    let loaded = load(&a.model.load_options(true)?)?;
    let base = a.decode.params(&loaded.file.header, &loaded.tokenizer)?;
    super::batch::run(
        &loaded,
        lines,
        &super::batch::BatchRun {
            base,
            use_template: !a.no_chat_template,
            parallel: a.parallel,
            output: a.output.as_deref(),
            quiet: a.model.log_disable,
        },
    )
}

/// The prompt's token ids, through the chat template where there is text.
pub fn prompt_tokens(
    tokenizer: &Tokenizer,
    header: &GgufHeader,
    text: &str,
    system: Option<&str>,
    use_template: bool,
) -> Result<Vec<u32>> {
    if text.trim().is_empty() {
        bail!("the prompt is empty");
    }
    if !use_template {
        return Ok(tokenizer.encode(text)?);
    }
    let source = header
        .get("tokenizer.chat_template")
        .and_then(Value::as_str)
        .context(
            "the model file has no chat template; pass --no-chat-template to use the text as it is",
        )?;
    let template = ChatTemplate::new(source)?;
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(Message::new("system", s));
    }
    messages.push(Message::new("user", text));
    Ok(tokenizer.encode(&template.render(&messages, true)?)?)
}

fn parse_strategy(s: &str) -> std::result::Result<refusion_engine::decode::Kind, String> {
    s.parse()
}

/// Cache entries one request needs: its prompt, its answer and the decoder's speculative rows.
fn cache_entries(params: &DecodeParams, prompt_len: usize) -> usize {
    prompt_len + params.answer_len() as usize + params.strategy.scratch(params)
}

/// What one request asks of the model, for the memory plan: its cache, its widest forward (the
/// prompt, or a block's committed tokens, fed with a planning forward's masks) and the logits
/// of at most one serial block (a planning forward's masks; a verification, draft or recheck
/// reads fewer). A prompt and answer beyond the context are refused here, before the weights
/// load.
fn workload(params: &DecodeParams, prompt_len: usize, context: usize) -> Result<Workload> {
    let gen = params.answer_len() as usize;
    if prompt_len + gen > context {
        bail!(
            "the prompt ({prompt_len} tokens) and the gen length ({gen}) need {} tokens, more than the context of {context} (raise -c or lower -n)",
            prompt_len + gen,
        );
    }
    let block = params.strategy.scratch(params);
    Ok(Workload {
        kv_entries: cache_entries(params, prompt_len),
        forward_tokens: prompt_len.max(block) + block,
        logit_rows: block,
    })
}

pub fn run(mut a: GenerateArgs) -> Result<()> {
    if !a.no_escape {
        for text in [&mut a.prompt, &mut a.system, &mut a.template, &mut a.suffix]
            .into_iter()
            .flatten()
        {
            *text = process_escapes(text);
        }
    }
    a.decode.check()?;
    let format = a.grammar.format()?;
    if let Some(pieces) = a.template_pieces(1) {
        // The markers are checked before the model loads (the gap default comes with it).
        pieces?;
    }
    if a.conversation || a.interactive {
        let flag = if a.conversation { "-cnv" } else { "-i" };
        bail!("{flag}: for a conversation, use refusion chat (generate answers one prompt)");
    }
    // -no-cnv and -st ask for what generate does anyway.
    let _ = (a.no_conversation, a.single_turn, a.escape);
    if a.color {
        bail!("--color: refusion prints the answer as plain text (--visual draws the decode as it goes)");
    }
    super::set_threads(a.model.threads)?;
    if let Some(path) = &a.batch {
        return run_batch(&a, path);
    }
    let opts = a.model.load_options(true)?;
    if let Some(path) = &a.prompt_cache {
        claim(path, CacheFile::Prefix, Some(&opts.path))?;
    }
    let file_text = match (&a.prompt_ids, &a.prompt, &a.file) {
        (None, None, Some(path)) => Some(super::bounded::read_text(
            path,
            "prompt text",
            super::bounded::prompt_limit(a.model.ctx_size),
        )?),
        _ => None,
    };
    let start = Instant::now();
    // The parameters and the prompt's tokens come before the weights: a prompt beyond the
    // context is refused without reading them, and the memory plan is of this request.
    let mut request = None;
    let loaded = load_for(&opts, |m| -> Result<_> {
        let params = a.decode.params_for(m.header, m.tokenizer, a.templated())?;
        let params = a.with_template(params, m.tokenizer, m.vocab)?;
        let params = GrammarArgs::apply(format.as_ref(), params, m.tokenizer)?;
        let mut prompt = a.prompt_of(m.tokenizer, m.header, file_text.as_deref())?;
        let params = match (&a.suffix, &params.template) {
            // The text before the cursor is the prompt: its end is healed as a span's would be.
            (Some(_), Some(t)) => {
                let mut t = refusion_engine::decode::Template::clone(t);
                t.heal_prompt_end(&mut prompt, m.tokenizer);
                params.with_template(t)
            }
            _ => params,
        };
        // A saved prompt longer than this request's cache is loaded whole (its common prefix
        // is kept): room for it, up to the context (a longer one cannot be loaded anyway).
        let saved = (a.prompt_cache.as_deref())
            .and_then(refusion_engine::kv::saved::saved_entries)
            .map_or(0, |n| n.min(m.context));
        let mut workload = workload(&params, prompt.len(), m.context)?;
        workload.kv_entries = workload.kv_entries.max(saved);
        request = Some((params, prompt, workload.kv_entries));
        Ok(Some(workload))
    })?;
    let (params, prompt, capacity) =
        request.context("internal error: the request was not prepared")?;
    if a.verbose_prompt {
        eprintln!("prompt: {} tokens", prompt.len());
        for &id in &prompt {
            let piece = loaded.tokenizer.decode(&[id], false).unwrap_or_default();
            eprintln!("{id:>8} -> {piece:?}");
        }
    }
    let mut session = a.session(&loaded, capacity, &prompt)?;
    let mut out = Output::new(&a, &loaded.tokenizer, &prompt, &params);
    let decode_start = Instant::now();
    let never = AtomicBool::new(false);
    let result = session.generate(&prompt, &params, &never, &mut |ev| out.event(ev))?;
    let decode_s = decode_start.elapsed().as_secs_f64();
    out.finish();
    if let Some(path) = &a.prompt_cache {
        let hash = loaded.file.layout_hash();
        session.cache.save_prefix(path, hash, &prompt, b"")?;
    }
    let report = Report {
        result: &result,
        text: loaded.tokenizer.decode(result.answer(), true)?,
        gaps: super::answer::gaps_json(&result, &loaded.tokenizer)?,
        prompt_tokens: prompt.len(),
        cached: session.last_reused,
        params: &params,
        load_s: loaded.load_seconds,
        decode_s,
        total_s: start.elapsed().as_secs_f64(),
        planned_host_bytes: loaded.plan.on_cpu.total(),
        peak_resident_bytes: refusion_engine::load::runtime::peak_resident_bytes(),
    };
    if a.json {
        println!("{}", report.json());
    } else {
        println!(
            "{}",
            if out.visual {
                format!("\n{}", report.text)
            } else if params.template.is_some() {
                report.text.clone()
            } else {
                String::new()
            }
        );
        if !a.model.log_disable {
            report.print_stats();
        }
    }
    Ok(())
}

impl GenerateArgs {
    /// Whether there are gaps to fill (`--template` or `--suffix`).
    fn templated(&self) -> bool {
        self.template.is_some() || self.suffix.is_some()
    }

    /// The template's pieces, `{{gap}}` of `default_gap` tokens: `--template`'s markers, or
    /// one gap and `--suffix`'s text taken as it is (markers in a suffix are text).
    fn template_pieces(
        &self,
        default_gap: u32,
    ) -> Option<refusion_engine::error::Result<Vec<refusion_engine::decode::TextPiece>>> {
        use refusion_engine::decode::TextPiece;
        match (&self.template, &self.suffix) {
            (Some(t), _) => {
                Some(refusion_engine::decode::template::parse(t, default_gap).map_err(Into::into))
            }
            (None, Some(s)) => Some(Ok(vec![
                TextPiece::Gap(refusion_engine::decode::GapSize::most(default_gap)),
                TextPiece::Text(s.clone()),
            ])),
            _ => None,
        }
    }

    /// The parameters with the template's spans tokenized and its gaps (`{{gap}}`: -n).
    fn with_template(
        &self,
        params: DecodeParams,
        tokenizer: &Tokenizer,
        vocab: usize,
    ) -> Result<DecodeParams> {
        let Some(pieces) = self.template_pieces(params.gen_length) else {
            return Ok(params);
        };
        let pieces = pieces?;
        let encode = |s: &str| match self.parse_special {
            true => tokenizer.encode(s),
            false => tokenizer.encode_text(s),
        };
        let t = refusion_engine::decode::Template::from_text(&pieces, encode, Some(tokenizer))?;
        t.validate_for(params.mask_id, vocab, params.slot_size)?;
        let params = params.with_template(t);
        params.validate()?;
        Ok(params)
    }
    /// The prompt's token ids: `--prompt-ids` as they are, or the text of `-p` or `-f` (read
    /// before the model loaded), through the chat template unless told otherwise.
    fn prompt_of(
        &self,
        tok: &Tokenizer,
        header: &GgufHeader,
        file_text: Option<&str>,
    ) -> Result<Vec<u32>> {
        let text = match (&self.prompt_ids, &self.prompt, file_text) {
            (Some(ids), _, _) if ids.is_empty() => bail!("the prompt is empty"),
            (Some(ids), _, _) => return Ok(ids.clone()),
            (_, Some(text), _) => text.as_str(),
            (_, _, Some(text)) => text,
            _ => bail!("give a prompt with -p, -f or --prompt-ids"),
        };
        let (system, template) = (self.system.as_deref(), !self.no_chat_template);
        prompt_tokens(tok, header, text, system, template)
    }

    /// A session over a cache of `capacity` entries, with `--prompt-cache`'s entries loaded and
    /// the reuse noted (notes go to stderr before the answer, not after it).
    fn session<'m>(
        &self,
        loaded: &'m refusion_engine::load::runtime::Loaded,
        capacity: usize,
        prompt: &[u32],
    ) -> Result<Session<'m, refusion_engine::model::Qwen3>> {
        let cache = loaded.new_cache(capacity)?;
        let mut session = Session::new(&loaded.model, &loaded.tokenizer, None, cache);
        let Some(path) = &self.prompt_cache else {
            return Ok(session);
        };
        if path.exists() {
            match session.cache.load_prefix(path, loaded.file.layout_hash()) {
                Ok(saved) => session.set_cached(saved.tokens),
                // Ours (checked before loading) but for another model or shape: rebuilt.
                Err(e) => eprintln!("prompt cache: {e}; starting fresh"),
            }
        }
        let reused = session.prepare(prompt);
        if reused > 0 {
            eprintln!(
                "prompt cache: reused {reused} of {} prompt tokens",
                prompt.len()
            );
        }
        Ok(session)
    }
}

/// llama.cpp's escape processing of prompt text (`-e`, on by default): `\n`, `\r`, `\t`, `\'`,
/// `\"`, `\\` and `\xHH` (ASCII) become the characters they name; any other backslash is kept
/// as written.
pub(super) fn process_escapes(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        let named = match chars.peek().copied() {
            Some('n') => Some('\n'),
            Some('r') => Some('\r'),
            Some('t') => Some('\t'),
            Some(q @ ('\'' | '"' | '\\')) => Some(q),
            Some('x') => {
                let hex: String = chars.clone().skip(1).take(2).collect();
                let byte = u8::from_str_radix(&hex, 16).ok();
                match byte.filter(|b| hex.len() == 2 && b.is_ascii()) {
                    Some(b) => {
                        chars.nth(1); // the 'x' and the first digit; the second below
                        Some(b as char)
                    }
                    None => None,
                }
            }
            _ => None,
        };
        match named {
            Some(ch) => {
                out.push(ch);
                chars.next();
            }
            None => out.push('\\'),
        }
    }
    out
}

#[cfg(test)]
mod escape_tests {
    use super::process_escapes;

    #[test]
    fn escapes_are_llama_cpps() {
        assert_eq!(process_escapes(r"a\nb"), "a\nb");
        assert_eq!(
            process_escapes(r"t\tx \\n \'q\' \x41\x4"),
            "t\tx \\n 'q' A\\x4"
        );
        assert_eq!(process_escapes(r"C:\path\z"), r"C:\path\z");
        assert_eq!(process_escapes("end\\"), "end\\");
        assert_eq!(process_escapes(r"\xzz\x7f"), "\\xzz\x7f");
    }
}
