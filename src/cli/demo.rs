//! `refusion demo`: the whole pipeline on a fresh machine with no download. The binary carries a
//! tiny ReFusion trained here with ReFusion's own objective (`train/`, `models/refusion-tiny`:
//! 5 M parameters that learned worked additions, one-step word problems, list questions and
//! small Python functions). The demo writes that Hugging Face folder out, converts it to Q8_0
//! and Q4_K_M with `convert`, and answers a question with `generate`, which prints the tokens per
//! forward (TPF), the forward calls and tokens/s. The real weights go through the same two
//! commands (see the README).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use refusion_convert::{ConvertOptions, Verbosity};
use refusion_gguf::FileType;

use super::generate::GenerateArgs;

/// The real ReFusion tokenizer, carried for `convert --synthetic` (gzipped: 1.9 MB instead of
/// 6 MB; a test checks it is the repository's `tests/fixtures/tokenizers/refusion`).
const TOKENIZER_JSON_GZ: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/assets/refusion-tokenizer.json.gz"
));
const TOKENIZER_CONFIG: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tokenizers/refusion/tokenizer_config.json"
));

/// A folder holding the carried tokenizer, removed when dropped.
pub(crate) struct EmbeddedTokenizer {
    pub(crate) dir: std::path::PathBuf,
}

impl EmbeddedTokenizer {
    /// Writes the tokenizer files into a fresh folder under the temporary directory.
    pub(crate) fn write() -> anyhow::Result<EmbeddedTokenizer> {
        use std::io::Read;
        let dir = std::env::temp_dir().join(format!(
            "refusion-tokenizer-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        std::fs::create_dir(&dir)
            .map_err(|e| anyhow::anyhow!("cannot write the tokenizer to {}: {e}", dir.display()))?;
        let t = EmbeddedTokenizer { dir };
        let mut json = Vec::with_capacity(6 << 20);
        flate2::read::GzDecoder::new(TOKENIZER_JSON_GZ).read_to_end(&mut json)?;
        std::fs::write(t.dir.join("tokenizer.json"), json)?;
        std::fs::write(t.dir.join("tokenizer_config.json"), TOKENIZER_CONFIG)?;
        Ok(t)
    }
}

impl Drop for EmbeddedTokenizer {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod embedded_tokenizer_tests {
    #[test]
    fn the_carried_tokenizer_is_the_repositorys() {
        let t = super::EmbeddedTokenizer::write().unwrap();
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers/refusion");
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            assert!(
                std::fs::read(t.dir.join(f)).unwrap() == std::fs::read(fixture.join(f)).unwrap(),
                "{f}: assets/ is out of date: gzip -9 -n the fixture again"
            );
        }
        let dir = t.dir.clone();
        drop(t);
        assert!(!dir.exists());
    }
}

macro_rules! embedded {
    ($($name:literal),*) => {
        [$(($name, include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/models/refusion-tiny/", $name)) as &[u8])),*]
    };
}

/// The tiny ReFusion's Hugging Face folder, in the binary (about 10 MB, bf16).
const CHECKPOINT: [(&str, &[u8]); 5] = embedded!(
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json"
);

#[derive(Clone, Copy, ValueEnum)]
enum Quant {
    #[value(name = "q4_k_m")]
    Q4KM,
    #[value(name = "q8_0")]
    Q80,
}

#[derive(Args)]
pub struct DemoArgs {
    /// Folder for the checkpoint and the GGUF files.
    #[arg(long, default_value = "refusion-demo")]
    dir: PathBuf,
    /// The question (the tiny model knows additions, word problems, lists and small Python
    /// functions; anything else gets a confident guess in that style).
    #[arg(short = 'p', long, default_value = "What is 47 + 38?")]
    prompt: String,
    /// Which of the two converted files answers.
    #[arg(long, value_enum, default_value = "q4_k_m")]
    quant: Quant,
    /// Print `refusion generate`'s JSON object instead of the streamed answer.
    #[arg(long)]
    json: bool,
    /// Any-order generation: hide the "Ones" line of the question's worked sum and let the
    /// model fill that gap between the known lines (the question must add two two-digit
    /// numbers, as the default does).
    #[arg(long)]
    infill: bool,
    /// Threads.
    #[arg(short = 't', long)]
    threads: Option<usize>,
}

/// The worked answer to "What is A + B?" (two-digit numbers) as the tiny model learned to
/// write it (train/corpus.py), with its "Ones" line a gap: `--infill`'s template.
fn worked_sum_template(question: &str) -> Option<String> {
    let digits: Vec<u32> = question
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect();
    let [a, b] = digits[..] else {
        return None;
    };
    if !((10..100).contains(&a) && (10..100).contains(&b) && question.contains('+')) {
        return None;
    }
    let ones = a % 10 + b % 10;
    let tens = a / 10 + b / 10 + ones / 10;
    let carry = if ones >= 10 { " + 1" } else { "" };
    // A gap is a maximum: the fill takes the hidden line's length, whatever it is.
    Some(format!(
        "We add {a} and {b} column by column.\n{{{{gap}}}}Tens: {} + {}{carry} = {tens}, write {tens}.\nSo {a} + {b} = {}.\nThe answer is {}.",
        a / 10,
        b / 10,
        a + b,
        a + b
    ))
}

fn write_checkpoint(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    for (name, bytes) in CHECKPOINT {
        // As every file refusion writes: never through a link planted in the folder.
        let mut out = refusion_gguf::atomic::AtomicFile::create(&dir.join(name))?;
        let path = out.temp_path().to_path_buf();
        out.file()
            .write_all(bytes)
            .with_context(|| path.display().to_string())?;
        out.commit()?;
    }
    Ok(())
}

fn convert(ckpt: &Path, out: &Path, outtype: FileType, name: &str) -> Result<()> {
    eprintln!(
        "    refusion convert {} --outfile {} --outtype {name}",
        ckpt.display(),
        out.display()
    );
    let opts = ConvertOptions {
        name: Some("refusion-tiny".into()),
        outtype,
        verbosity: Verbosity::Quiet,
        ..Default::default()
    };
    let summary = refusion_convert::convert(ckpt, out, &opts)?;
    eprintln!(
        "    {} tensors, {} in {:.2} s",
        summary.n_tensors,
        refusion_convert::info::human_bytes(summary.output_bytes),
        summary.elapsed.as_secs_f64()
    );
    Ok(())
}

pub fn run(a: DemoArgs) -> Result<()> {
    super::set_threads(a.threads)?;
    let template = match (a.infill, worked_sum_template(&a.prompt)) {
        (false, _) => None,
        (true, Some(t)) => Some(t),
        (true, None) => anyhow::bail!(
            "--infill fills a line of a worked sum: give a question like -p \"What is 47 + 38?\" (two two-digit numbers), got {:?}",
            a.prompt
        ),
    };
    let ckpt = a.dir.join("refusion-tiny");
    eprintln!(
        "1/3 writing the embedded tiny ReFusion (trained by train/train.py) to {}",
        ckpt.display()
    );
    write_checkpoint(&ckpt)?;
    eprintln!("2/3 converting it to GGUF");
    let q8 = a.dir.join("refusion-tiny-Q8_0.gguf");
    let q4 = a.dir.join("refusion-tiny-Q4_K_M.gguf");
    convert(&ckpt, &q8, FileType::Q8_0, "q8_0")?;
    convert(&ckpt, &q4, FileType::Q4_K_M, "q4_k_m")?;
    let gguf = match a.quant {
        Quant::Q4KM => q4,
        Quant::Q80 => q8,
    };
    eprintln!(
        "3/3 refusion generate -m {} -p {:?} (the file's decoding defaults: the model card's)",
        gguf.display(),
        a.prompt
    );
    use clap::Parser;
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        g: GenerateArgs,
    }
    let m = gguf.to_string_lossy().to_string();
    let mut argv = vec!["generate", "-m", &m, "-p", &a.prompt];
    if a.json {
        argv.push("--json");
    }
    if let Some(t) = &template {
        eprintln!("    --template {t:?} (the gap: the ones line)");
        argv.extend(["--template", t]);
    }
    let t;
    if let Some(n) = a.threads {
        t = n.to_string();
        argv.extend(["-t", &t]);
    }
    let w = Wrap::try_parse_from(argv).context("demo arguments")?;
    super::generate::run(w.g)
}
