//! `convert`, `quantize` and `info`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use refusion_convert::info::{describe, human_bytes};
use refusion_convert::{ConvertOptions, DecodingDefaults, MixOptions, Summary, Verbosity};
use refusion_gguf::{FileType, GgmlType, GgufFile};

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
    /// Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files), or a Hub
    /// repo id (org/name: downloads what the conversion needs into the Hugging Face cache).
    #[arg(required_unless_present = "synthetic", value_name = "HF_DIR|REPO")]
    hf_dir: Option<PathBuf>,
    /// With a repo id: the branch, tag or commit to take (default: main).
    #[arg(long, value_name = "REV")]
    revision: Option<String>,
    /// Instead of a checkpoint: random weights in a real Qwen3 shape (0.6b, 1.7b, 4b, 8b),
    /// for benchmarks; the tokenizer comes from --tokenizer-dir.
    #[arg(long, value_name = "SHAPE", conflicts_with = "hf_dir")]
    synthetic: Option<String>,
    /// With --synthetic: instead of random weights, this trained checkpoint folder grown to the
    /// shape so that it computes the same function (its tokenizer, padded to ReFusion's 151,671
    /// tokens, and its held-out questions for `bench --decode`).
    #[arg(long, value_name = "DIR", requires = "synthetic")]
    grow_from: Option<PathBuf>,
    /// Tokenizer folder for --synthetic (default: the ReFusion tokenizer this binary carries).
    #[arg(
        long,
        value_name = "DIR",
        requires = "synthetic",
        conflicts_with = "grow_from"
    )]
    tokenizer_dir: Option<PathBuf>,
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
    /// Read every tensor and check its data: float values and quantized blocks' scales must be
    /// finite (llama.cpp's --check-tensors).
    #[arg(long)]
    check_tensors: bool,
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
    // A repo id where a folder was expected: the checkpoint comes from the Hub's cache.
    let repo = a
        .hf_dir
        .as_deref()
        .and_then(|d| d.to_str())
        .filter(|d| a.synthetic.is_none() && refusion_engine::load::hub::is_repo_id(d))
        .map(|d| refusion_engine::load::hub::RepoRef::new(d, a.revision.as_deref()));
    if a.revision.is_some() && repo.is_none() {
        anyhow::bail!("--revision needs a Hub repo id (org/name) in place of the folder");
    }
    // general.name: the repository's name, not the snapshot folder's (a commit hash).
    let mut opts = opts;
    if opts.name.is_none() {
        opts.name = repo.as_ref().map(|r| r.name().to_string());
    }
    let stem = match (&a.hf_dir, &a.synthetic, &repo) {
        (_, Some(shape), _) if a.grow_from.is_some() => format!("grown-{shape}"),
        (_, Some(shape), _) => format!("synthetic-{shape}"),
        (_, None, Some(r)) => r.name().to_string(),
        (Some(dir), None, None) => dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into()),
        (None, None, None) => "model".into(),
    };
    let outfile = a
        .outfile
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{stem}-{}.gguf", a.outtype.display_name())));
    let summary = match (&a.hf_dir, &a.synthetic, &repo) {
        (_, Some(shape), _) => {
            let cfg = refusion_convert::synthetic::shape(shape)?;
            match &a.grow_from {
                Some(dir) => refusion_convert::grow::write_grown(&outfile, &cfg, dir, &opts)?,
                None => {
                    // The carried tokenizer, unless a folder is named (removed after).
                    let carried;
                    let dir = match &a.tokenizer_dir {
                        Some(d) => d.as_path(),
                        None => {
                            carried = super::demo::EmbeddedTokenizer::write()?;
                            carried.dir.as_path()
                        }
                    };
                    refusion_convert::synthetic::write_synthetic(&outfile, &cfg, dir, &opts)?
                }
            }
        }
        (_, None, Some(r)) => {
            // The output's folder is checked before gigabytes are downloaded.
            check_output_folder(&outfile)?;
            let hub =
                refusion_engine::load::hub::Hub::from_env(opts.verbosity != Verbosity::Quiet)?
                    .with_notes(crate::cli::notes());
            let dir = hub.checkpoint(r)?;
            if opts.verbosity != Verbosity::Quiet {
                eprintln!("{} ({}): {}", r.id, r.revision, dir.display());
            }
            refusion_convert::convert(&dir, &outfile, &opts)?
        }
        (Some(dir), None, None) => refusion_convert::convert(dir, &outfile, &opts)?,
        (None, None, None) => anyhow::bail!("give a checkpoint folder or --synthetic SHAPE"),
    };
    report(&outfile, &summary, opts.verbosity);
    Ok(())
}

fn check_output_folder(outfile: &std::path::Path) -> Result<()> {
    let parent = match outfile.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    if !parent.is_dir() {
        anyhow::bail!("output folder '{}' does not exist", parent.display());
    }
    // A link, directory, FIFO or device is refused before any work (see refusion_gguf::atomic).
    refusion_gguf::atomic::check_target(outfile)?;
    Ok(())
}

pub fn quantize(a: QuantizeArgs) -> Result<()> {
    check_output_folder(&a.output)?;
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
    if a.check_tensors {
        file.check_tensors()?;
    }
    print!("{}", describe(&file));
    if a.check_tensors {
        println!(
            "\nchecked:    all {} tensors hold finite values and block scales",
            file.header.tensors.len()
        );
    }
    Ok(())
}
