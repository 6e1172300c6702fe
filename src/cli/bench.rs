//! `refusion bench`: forward throughput in llama-bench's table.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use refusion_convert::gguf::FileType;
use refusion_convert::info::human_bytes;

use super::model_args::ModelArgs;
use crate::model::{Batch, Forward, LogitsFor};
use crate::runtime::{load, resident_bytes};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// New tokens per forward, comma-separated.
    #[arg(
        short = 'p',
        long = "n-prompt",
        default_value = "1,16,32,64,512",
        value_delimiter = ','
    )]
    n_tokens: Vec<usize>,
    /// Entries already in the cache before each forward (llama-bench's depth).
    #[arg(long, short = 'd', default_value_t = 256)]
    prefix: usize,
    /// Timed repetitions per size (after one warm-up).
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// One JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.repetitions == 0 {
        bail!("-r must be at least 1");
    }
    if a.n_tokens.contains(&0) {
        bail!("-p sizes must be positive");
    }
    super::set_threads(a.model.threads)?;
    let threads = rayon::current_num_threads();
    let opts = a.model.load_options(!a.json)?;
    let largest = a.n_tokens.iter().copied().max().unwrap_or(1);
    // Never more than the user set: a test that does not fit is refused, before loading.
    if opts.context != 0 && a.prefix + largest > opts.context {
        bail!(
            "-d {} plus -p {largest} is {} tokens, more than the context (-c {}); raise -c",
            a.prefix,
            a.prefix + largest,
            opts.context
        );
    }
    let loaded = load(&opts)?;
    let mut cache = loaded.new_cache(loaded.context)?;
    let rss = resident_bytes();
    let cfg = loaded.model.config().clone();
    let vocab = cfg.vocab as u32;
    let file_type = loaded
        .file
        .header
        .get("general.file_type")
        .and_then(|v| v.as_u64())
        .and_then(|c| FileType::from_code(c as u32))
        .map(|f| f.display_name())
        .unwrap_or_else(|| "?".into());
    let name = loaded
        .file
        .header
        .get("general.name")
        .and_then(|v| v.as_str())
        .unwrap_or("qwen3")
        .to_string();
    let params: u64 = loaded
        .file
        .header
        .tensors
        .iter()
        .map(|t| t.n_elements())
        .sum();
    let size: u64 = loaded.file.header.tensors.iter().map(|t| t.n_bytes).sum();

    // The shared prefix, committed once.
    let cache = &mut cache;
    if a.prefix > 0 {
        let toks: Vec<u32> = (0..a.prefix as u32)
            .map(|i| (i * 7919 + 13) % vocab)
            .collect();
        let pos: Vec<u32> = (0..a.prefix as u32).collect();
        let mut b = Batch::row(&toks, &pos, 0);
        b.logits_for = LogitsFor::None;
        loaded.model.forward(&b, cache)?;
        cache.commit_row(0)?;
    }
    if !a.json {
        if let Some(rss) = rss {
            eprintln!(
                "resident memory after load: {} (file {})",
                human_bytes(rss),
                human_bytes(loaded.file.file_len())
            );
        }
        println!("| model                          |       size |     params | backend       | threads |            test |                  t/s |");
        println!("| ------------------------------ | ---------: | ---------: | ------------- | ------: | --------------: | -------------------: |");
    }
    // llama-bench's backend column, with the offload: "CUDA ngl 36+o" is every layer and the
    // output layer on the GPU.
    let backend = match loaded.model.offload() {
        Some(o) => format!("CUDA ngl {}{}", o.layers, if o.output { "+o" } else { "" }),
        None => "CPU".to_string(),
    };
    for &n in &a.n_tokens {
        let toks: Vec<u32> = (0..n as u32).map(|i| (i * 104_729 + 7) % vocab).collect();
        let pos: Vec<u32> = (a.prefix as u32..(a.prefix + n) as u32).collect();
        // Logits for the last token only, as llama-bench's prompt processing.
        let mut b = Batch::row(&toks, &pos, 0);
        b.logits_for = LogitsFor::Indices(vec![n - 1]);
        let mut times = Vec::with_capacity(a.repetitions);
        for rep in 0..=a.repetitions {
            let t = Instant::now();
            loaded.model.forward(&b, cache)?;
            let dt = t.elapsed().as_secs_f64();
            cache.clear_rows();
            if rep > 0 {
                times.push(dt);
            }
        }
        if !a.json && n == a.n_tokens[0] {
            if let Some(rss) = resident_bytes() {
                eprintln!(
                    "resident memory after the first forwards: {}",
                    human_bytes(rss)
                );
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let rates: Vec<f64> = times.iter().map(|t| n as f64 / t).collect();
        let mean = rates.iter().sum::<f64>() / rates.len() as f64;
        let sd = (rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>()
            / rates.len().max(2).saturating_sub(1) as f64)
            .sqrt();
        let tps = n as f64 / median;
        if a.json {
            println!(
                "{}",
                serde_json::json!({
                    "n_tokens": n,
                    "prefix": a.prefix,
                    "tokens_per_s": tps,
                    "ms_per_forward": median * 1e3,
                    "threads": threads,
                    "backend": backend,
                    "kernels": crate::model::kquants::path_name(),
                })
            );
        } else {
            println!(
                "| {:<30} | {:>10} | {:>10} | {:<13} | {:>7} | {:>15} | {:>20} |",
                format!("{name} {file_type}"),
                human_bytes(size),
                if params >= 1_000_000_000 {
                    format!("{:.2} B", params as f64 / 1e9)
                } else {
                    format!("{:.2} M", params as f64 / 1e6)
                },
                backend,
                threads,
                format!("pp{n} @ d{}", a.prefix),
                format!("{tps:.2} ± {sd:.2}"),
            );
        }
    }
    Ok(())
}
