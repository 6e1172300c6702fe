//! Real-sized GGUF files with random weights, written without a checkpoint: benchmarks and GPU
//! checks on Qwen3-0.6B … 8B shapes, with no download and no 16 GB intermediate file.
//!
//! Each tensor's rows are drawn from a small pool of random rows encoded once in the tensor's
//! type (through the same quantizers as `convert`), so every block is valid and writing runs at
//! disk speed. The values mean nothing; the shapes, types and sizes are those of the real model.

use std::path::Path;
use std::sync::OnceLock;

use crate::convert::{metadata, ConvertOptions};
use crate::error::{Error, Result};
use crate::gguf::{GgmlType, TensorSpec};
use crate::hf::config::Qwen3Config;
use crate::hf::tokenizer::GgufVocab;
use crate::mix::{tensor_type, ModelShape};
use crate::names;
use crate::pipeline::{write_gguf, Job, RowSource, Summary};
use crate::quant;

/// Random rows per tensor; rows of the tensor cycle through them in a scrambled order.
const POOL: usize = 16;

/// The Qwen3 shapes ReFusion comes in or is benchmarked at (vocabulary: ReFusion's).
pub fn shape(name: &str) -> Result<Qwen3Config> {
    let (hidden, layers, heads, ffn, tied) = match name.to_ascii_lowercase().as_str() {
        "0.6b" | "qwen3-0.6b" => (1024, 28, 16, 3072, true),
        "1.7b" | "qwen3-1.7b" => (2048, 28, 16, 6144, true),
        "4b" | "qwen3-4b" => (2560, 36, 32, 9728, true),
        "8b" | "qwen3-8b" | "refusion" => (4096, 36, 32, 12288, false),
        _ => {
            return Err(Error::usage(format!(
                "unknown synthetic shape '{name}' (expected 0.6b, 1.7b, 4b or 8b)"
            )))
        }
    };
    Ok(Qwen3Config {
        hidden_size: hidden,
        intermediate_size: ffn,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: 8,
        head_dim: 128,
        vocab_size: 151_671,
        tie_word_embeddings: tied,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 40_960,
        bos_token_id: None,
        eos_token_id: Some(151_645),
        mask_token_id: Some(151_670),
    })
}

struct RandomRows {
    row_len: usize,
    n_rows: usize,
    /// Norm weights are near 1, matrices scaled like a trained model's (1/sqrt(fan-in)).
    is_vector: bool,
    seed: u64,
    /// The pool, encoded in the tensor's type.
    encoded: OnceLock<(GgmlType, Vec<u8>)>,
}

fn xorshift(state: &mut u64) -> f32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

impl RandomRows {
    fn pool(&self) -> Vec<f32> {
        let mut state = self.seed | 1;
        let scale = 1.7 / (self.row_len as f32).sqrt();
        (0..POOL * self.row_len)
            .map(|_| {
                let r = xorshift(&mut state);
                if self.is_vector {
                    1.0 + 0.1 * r
                } else {
                    r * scale
                }
            })
            .collect()
    }

    /// Which pool row row `i` of the tensor takes.
    fn pick(&self, i: usize) -> usize {
        let mut h = (i as u64 ^ self.seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^= h >> 29;
        (h % POOL as u64) as usize
    }
}

impl RowSource for RandomRows {
    fn read_rows(&self, first: usize, count: usize, out: &mut [f32]) {
        let pool = self.pool();
        for (j, row) in out.chunks_exact_mut(self.row_len).take(count).enumerate() {
            let p = self.pick(first + j);
            row.copy_from_slice(&pool[p * self.row_len..(p + 1) * self.row_len]);
        }
    }
    fn input_bytes(&self) -> u64 {
        (self.row_len * self.n_rows * 2) as u64
    }
    fn origin(&self) -> String {
        "synthetic weights".into()
    }
    fn input_type(&self) -> String {
        "rand".into()
    }
    fn source_name(&self) -> String {
        "synthetic".into()
    }
    fn encoded_rows(&self, ty: GgmlType, first: usize, count: usize, out: &mut [u8]) -> bool {
        let Some(row_bytes) = ty.row_bytes(self.row_len as u64).map(|b| b as usize) else {
            return false;
        };
        let (pool_ty, pool) = self.encoded.get_or_init(|| {
            let mut bytes = vec![0u8; POOL * row_bytes];
            quant::quantize(ty, &self.pool(), self.row_len, &mut bytes);
            (ty, bytes)
        });
        if *pool_ty != ty {
            return false;
        }
        for (j, row) in out.chunks_exact_mut(row_bytes).take(count).enumerate() {
            let p = self.pick(first + j);
            row.copy_from_slice(&pool[p * row_bytes..(p + 1) * row_bytes]);
        }
        true
    }
}

/// Writes a GGUF of the given shape with random weights, the types chosen as `convert` would
/// for `opts.outtype`, and the tokenizer and chat template read from `tokenizer_dir`.
pub fn write_synthetic(
    target: &Path,
    cfg: &Qwen3Config,
    tokenizer_dir: &Path,
    opts: &ConvertOptions,
) -> Result<Summary> {
    opts.decoding.validate().map_err(Error::usage)?;
    let vocab = GgufVocab::load(tokenizer_dir, cfg)?;
    let shape = ModelShape {
        n_layers: cfg.num_hidden_layers as usize,
        n_gqa: cfg.num_attention_heads / cfg.num_key_value_heads,
        has_output: !cfg.tie_word_embeddings,
    };
    let mut jobs = Vec::new();
    for (i, (_, gguf, dims)) in names::checkpoint_tensors(cfg).into_iter().enumerate() {
        let ne: Vec<u64> = dims.iter().rev().copied().collect();
        let (ty, note) = tensor_type(opts.outtype, &gguf, &ne, &shape, &opts.mix);
        let row_len = ne[0] as usize;
        let n_rows = ne.iter().skip(1).product::<u64>() as usize;
        jobs.push(Job {
            spec: TensorSpec { name: gguf, ne, ty },
            source: Box::new(RandomRows {
                row_len,
                n_rows,
                is_vector: dims.len() == 1,
                seed: 0x5EED_0000 + i as u64,
                encoded: OnceLock::new(),
            }),
            note,
        });
    }
    let name = opts.name.clone().unwrap_or_else(|| "synthetic".to_string());
    let md = metadata(cfg, &vocab, &name, opts)?;
    write_gguf(target, &md, jobs, opts.verbosity)
}
