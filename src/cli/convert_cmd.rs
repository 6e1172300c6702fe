//! `convert`, `quantize` and `info`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use refusion_convert::gguf::{FileType, GgmlType, GgufFile};
use refusion_convert::info::{describe, human_bytes};
use refusion_convert::{ConvertOptions, DecodingDefaults, MixOptions, Summary, Verbosity};

fn parse_ftype(s: &str) -> Result<FileType, String> {
    s.parse()
}

fn parse_ggml_type(s: &str) -> Result<GgmlType, String> {
    s.parse()
}

/// llama-quantize's per-tensor type controls.
#[derive(Args, Clone)]
pub struct MixArgs {
    /// Give every tensor the base type of the output type (no per-tensor bumps).
    #[arg(long)]
    pure: bool,
    /// Type for output.weight (e.g. q8_0, q6_k, f16).
    #[arg(long, value_name = "TYPE", value_parser = parse_ggml_type)]
    output_tensor_type: Option<GgmlType>,
    /// Type for token_embd.weight.
    #[arg(long, value_name = "TYPE", value_parser = parse_ggml_type)]
    token_embedding_type: Option<GgmlType>,
    /// Worker threads for quantization (default: all cores).
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// Print nothing but errors.
    #[arg(short, long)]
    quiet: bool,
}

impl MixArgs {
    fn mix(&self) -> MixOptions {
        MixOptions {
            pure: self.pure,
            output_tensor_type: self.output_tensor_type,
            token_embedding_type: self.token_embedding_type,
        }
    }
    fn verbosity(&self) -> Verbosity {
        if self.quiet {
            Verbosity::Quiet
        } else {
            Verbosity::Normal
        }
    }
}

#[derive(Args)]
pub struct ConvertArgs {
    /// Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files).
    #[arg(required_unless_present = "synthetic")]
    hf_dir: Option<PathBuf>,
    /// Instead of a checkpoint: random weights in a real Qwen3 shape (0.6b, 1.7b, 4b, 8b),
    /// for benchmarks; the tokenizer comes from --tokenizer-dir.
    #[arg(long, value_name = "SHAPE", conflicts_with = "hf_dir")]
    synthetic: Option<String>,
    /// Tokenizer folder for --synthetic (default: the ReFusion tokenizer in this repository).
    #[arg(long, value_name = "DIR", default_value = super::demo::TOKENIZER_DIR, requires = "synthetic")]
    tokenizer_dir: PathBuf,
    /// Output file (default: <folder name>-<TYPE>.gguf in the current directory).
    #[arg(short, long)]
    outfile: Option<PathBuf>,
    /// Output type: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k_s q3_k_m q3_k_l q4_k_s q4_k_m q5_k_s q5_k_m q6_k.
    #[arg(long, default_value = "q4_k_m", value_parser = parse_ftype)]
    outtype: FileType,
    /// general.name (default: the folder name).
    #[arg(long)]
    name: Option<String>,
    /// Default generation length stored in the file.
    #[arg(long)]
    gen_length: Option<u32>,
    /// Default slot size stored in the file.
    #[arg(long)]
    slot_size: Option<u32>,
    /// Default number of serial blocks stored in the file.
    #[arg(long)]
    serial_blocks: Option<u32>,
    /// Default slot confidence threshold stored in the file.
    #[arg(long)]
    slot_threshold: Option<f32>,
    /// Default token confidence threshold stored in the file.
    #[arg(long)]
    token_threshold: Option<f32>,
    #[command(flatten)]
    mix: MixArgs,
}

#[derive(Args)]
pub struct QuantizeArgs {
    /// Input GGUF (f32, f16 or bf16 tensors).
    input: PathBuf,
    /// Output GGUF.
    output: PathBuf,
    /// Output type, as for `convert --outtype`.
    #[arg(value_parser = parse_ftype)]
    outtype: FileType,
    #[command(flatten)]
    mix: MixArgs,
}

#[derive(Args)]
pub struct InfoArgs {
    /// GGUF file.
    file: PathBuf,
}

fn report(path: &std::path::Path, s: &Summary, verbosity: Verbosity) {
    if verbosity == Verbosity::Quiet {
        return;
    }
    let secs = s.elapsed.as_secs_f64();
    eprintln!(
        "wrote {}: {} tensors, {} ({:.2} bits per weight) in {:.2} s, {:.1} MB/s of input",
        path.display(),
        s.n_tensors,
        human_bytes(s.output_bytes),
        s.bits_per_weight(),
        secs,
        s.input_bytes as f64 / 1e6 / secs.max(1e-9)
    );
}

pub fn convert(a: ConvertArgs) -> Result<()> {
    super::set_threads(a.mix.threads)?;
    let d = DecodingDefaults::default();
    let opts = ConvertOptions {
        outtype: a.outtype,
        mix: a.mix.mix(),
        name: a.name.clone(),
        decoding: DecodingDefaults {
            gen_length: a.gen_length.unwrap_or(d.gen_length),
            slot_size: a.slot_size.unwrap_or(d.slot_size),
            serial_blocks: a.serial_blocks.unwrap_or(d.serial_blocks),
            slot_threshold: a.slot_threshold.unwrap_or(d.slot_threshold),
            token_threshold: a.token_threshold.unwrap_or(d.token_threshold),
        },
        verbosity: a.mix.verbosity(),
    };
    let stem = match (&a.hf_dir, &a.synthetic) {
        (_, Some(shape)) => format!("synthetic-{shape}"),
        (Some(dir), None) => dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into()),
        (None, None) => "model".into(),
    };
    let outfile = a
        .outfile
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{stem}-{}.gguf", a.outtype.display_name())));
    let summary = match (&a.hf_dir, &a.synthetic) {
        (_, Some(shape)) => {
            let cfg = refusion_convert::synthetic::shape(shape)?;
            refusion_convert::synthetic::write_synthetic(&outfile, &cfg, &a.tokenizer_dir, &opts)?
        }
        (Some(dir), None) => refusion_convert::convert(dir, &outfile, &opts)?,
        (None, None) => anyhow::bail!("give a checkpoint folder or --synthetic SHAPE"),
    };
    report(&outfile, &summary, opts.verbosity);
    Ok(())
}

pub fn quantize(a: QuantizeArgs) -> Result<()> {
    // Writing the output over the input would destroy it (the atomic rename replaces it).
    if let (Ok(i), Ok(o)) = (a.input.canonicalize(), a.output.canonicalize()) {
        if i == o {
            anyhow::bail!(
                "{}: the output would overwrite the input; choose another output file",
                a.output.display()
            );
        }
    }
    super::set_threads(a.mix.threads)?;
    let summary = refusion_convert::requantize(
        &a.input,
        &a.output,
        a.outtype,
        &a.mix.mix(),
        a.mix.verbosity(),
    )?;
    report(&a.output, &summary, a.mix.verbosity());
    Ok(())
}

pub fn info(a: InfoArgs) -> Result<()> {
    let file = GgufFile::open(&a.file)?;
    print!("{}", describe(&file));
    Ok(())
}
