//! `refusion demo`: the whole pipeline on a fresh machine with no download. It writes a small
//! ReFusion-shaped checkpoint (random weights, the real ReFusion tokenizer and chat template,
//! the mask token) in the Hugging Face layout, converts it to Q4_K_M with `convert`, and
//! generates from it with `generate`. The text is gibberish (the weights are random); the real
//! weights go through exactly the same two commands (see the README).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use half::bf16;
use refusion_convert::hf::config::Qwen3Config;
use refusion_convert::names::checkpoint_tensors;
use refusion_convert::{ConvertOptions, Verbosity};

use super::generate::GenerateArgs;

/// Where the repository keeps the real ReFusion tokenizer.
pub(crate) const TOKENIZER_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tokenizers/refusion"
);

#[derive(Args)]
pub struct DemoArgs {
    /// Folder for the checkpoint and the GGUF file.
    #[arg(long, default_value = "refusion-demo")]
    dir: PathBuf,
    /// The prompt.
    #[arg(short = 'p', long, default_value = "Write a haiku about the sea.")]
    prompt: String,
    /// Folder with the ReFusion tokenizer.json and tokenizer_config.json.
    #[arg(long, default_value = TOKENIZER_DIR)]
    tokenizer_dir: PathBuf,
    /// Threads.
    #[arg(short = 't', long)]
    threads: Option<usize>,
}

struct Shape {
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
}

const SHAPE: Shape = Shape {
    hidden: 256,
    layers: 4,
    heads: 4,
    kv_heads: 2,
    head_dim: 64,
    ffn: 768,
    vocab: 151_671,
};

/// The checkpoint's tensors (PyTorch names and shapes), from the converter's own list.
fn tensors(s: &Shape) -> Vec<(String, Vec<usize>)> {
    let cfg = Qwen3Config {
        hidden_size: s.hidden as u64,
        intermediate_size: s.ffn as u64,
        num_hidden_layers: s.layers as u64,
        num_attention_heads: s.heads as u64,
        num_key_value_heads: s.kv_heads as u64,
        head_dim: s.head_dim as u64,
        vocab_size: s.vocab as u64,
        tie_word_embeddings: false,
        rope_theta: 1e6,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 40960,
        bos_token_id: None,
        eos_token_id: None,
        mask_token_id: None,
    };
    checkpoint_tensors(&cfg)
        .into_iter()
        .map(|(hf, _, shape)| (hf, shape.iter().map(|&d| d as usize).collect()))
        .collect()
}

/// Writes `model.safetensors` with random bf16 weights (norms near 1).
fn write_weights(path: &Path, s: &Shape) -> Result<()> {
    let specs = tensors(s);
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape) in &specs {
        let n: usize = shape.iter().product::<usize>() * 2;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    let mut header = serde_json::to_vec(&header)?;
    header.resize(header.len().div_ceil(8) * 8, b' ');
    let mut f = std::io::BufWriter::new(
        fs::File::create(path).with_context(|| path.display().to_string())?,
    );
    f.write_all(&(header.len() as u64).to_le_bytes())?;
    f.write_all(&header)?;
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut rand = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    for (_, shape) in &specs {
        let n: usize = shape.iter().product();
        let scale = if shape.len() == 1 {
            0.0
        } else {
            1.7 / (shape[shape.len() - 1] as f32).sqrt()
        };
        let mut buf = Vec::with_capacity(n * 2);
        for _ in 0..n {
            let v = if shape.len() == 1 {
                1.0 + 0.05 * rand()
            } else {
                scale * rand()
            };
            buf.extend_from_slice(&bf16::from_f32(v).to_le_bytes());
        }
        f.write_all(&buf)?;
    }
    f.flush()?;
    Ok(())
}

fn write_checkpoint(dir: &Path, tokenizer_dir: &Path) -> Result<()> {
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let src = tokenizer_dir.join(f);
        if !src.is_file() {
            bail!(
                "{} not found: the demo uses the ReFusion tokenizer from the repository (pass --tokenizer-dir)",
                src.display()
            );
        }
        fs::copy(&src, dir.join(f)).with_context(|| src.display().to_string())?;
    }
    let s = &SHAPE;
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_qwen3_refusion.Qwen3ForCausalLM"},
        "model_type": "qwen3", "hidden_size": s.hidden, "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "vocab_size": s.vocab, "tie_word_embeddings": false,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "bos_token_id": 151643, "eos_token_id": 151645, "mask_token_id": 151670, "rope_scaling": null,
        "torch_dtype": "bfloat16",
    });
    fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    write_weights(&dir.join("model.safetensors"), s)
}

pub fn run(a: DemoArgs) -> Result<()> {
    super::set_threads(a.threads)?;
    let ckpt = a.dir.join("checkpoint");
    fs::create_dir_all(&ckpt).with_context(|| ckpt.display().to_string())?;
    eprintln!(
        "1/3 writing a random ReFusion-shaped checkpoint to {}",
        ckpt.display()
    );
    write_checkpoint(&ckpt, &a.tokenizer_dir)?;
    let gguf = a.dir.join("refusion-demo-Q4_K_M.gguf");
    eprintln!(
        "2/3 refusion convert {} --outfile {} --outtype q4_k_m",
        ckpt.display(),
        gguf.display()
    );
    let opts = ConvertOptions {
        name: Some("refusion-demo".into()),
        verbosity: Verbosity::Quiet,
        ..Default::default()
    };
    let summary = refusion_convert::convert(&ckpt, &gguf, &opts)?;
    eprintln!(
        "    {} tensors, {} in {:.2} s",
        summary.n_tensors,
        refusion_convert::info::human_bytes(summary.output_bytes),
        summary.elapsed.as_secs_f64()
    );
    eprintln!(
        "3/3 refusion generate -m {} -p {:?} -n 64 (random weights: expect gibberish)",
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
    let mut argv = vec![
        "generate",
        "-m",
        &m,
        "-p",
        &a.prompt,
        "-n",
        "64",
        "--slot-size",
        "4",
        "--serial-blocks",
        "4",
    ];
    let t;
    if let Some(n) = a.threads {
        t = n.to_string();
        argv.extend(["-t", &t]);
    }
    let w = Wrap::try_parse_from(argv).context("demo arguments")?;
    super::generate::run(w.g)
}
