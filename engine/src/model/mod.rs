//! The model side of the house: a flat batch of new tokens (each with a position id and a row
//! id) goes in over a KV cache, f32 logits come out. The ReFusion decoder sees nothing else.

pub mod attention;
pub mod config;
pub mod device_attention;
pub mod expf;
mod host;
pub mod kquants;
mod layer;
mod linear;
mod mapped;
pub mod pool;
pub mod qwen3;

pub use config::{Heads, Qwen3Config};
pub use qwen3::Qwen3;

use crate::error::Result;
use crate::kv::KvCache;

/// One forward call: new tokens in a flat list. Token `i` sits at RoPE position
/// `positions[i]` in row `rows[i]` of sequence `seqs[i]`; it attends to its sequence's shared
/// prefix, to its row's private entries, and to the earlier tokens of its row in this batch.
/// Every token's K/V is appended to its row's private entries. Tokens of one sequence come
/// together (the decoders' batches side by side).
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub rows: Vec<u32>,
    /// The sequence of each token; empty: every token in the default sequence.
    pub seqs: Vec<u32>,
    /// Which tokens to compute logits for (batch indices, in the order wanted).
    pub logits_for: LogitsFor,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum LogitsFor {
    /// Every token, in batch order.
    #[default]
    All,
    /// No logits (the call only fills the cache).
    None,
    /// These batch indices, in this order.
    Indices(Vec<usize>),
}

impl Batch {
    /// One row of consecutive tokens.
    pub fn row(tokens: &[u32], positions: &[u32], row: u32) -> Batch {
        Batch {
            tokens: tokens.to_vec(),
            positions: positions.to_vec(),
            rows: vec![row; tokens.len()],
            seqs: Vec::new(),
            logits_for: LogitsFor::All,
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Empties the batch, keeping its buffers (logits for every token again).
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.positions.clear();
        self.rows.clear();
        self.seqs.clear();
        self.logits_for = LogitsFor::All;
    }

    /// The sequence of token `i`.
    pub fn seq(&self, i: usize) -> u32 {
        self.seqs.get(i).copied().unwrap_or(0)
    }

    /// Appends one token at `position` in `row`.
    pub fn push(&mut self, token: u32, position: u32, row: u32) {
        self.tokens.push(token);
        self.positions.push(position);
        self.rows.push(row);
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The batch indices logits are wanted for.
    pub fn logit_indices(&self) -> Vec<usize> {
        match &self.logits_for {
            LogitsFor::All => (0..self.len()).collect(),
            LogitsFor::None => Vec::new(),
            LogitsFor::Indices(i) => i.clone(),
        }
    }
}

/// Logits of the tokens asked for: `n × vocab` f32, row-major.
#[derive(Debug, Clone)]
pub struct Logits {
    pub vocab: usize,
    pub data: Vec<f32>,
}

/// Logits borrowed: rows of a [`Logits`] (one decoder's part of a merged forward).
#[derive(Debug, Clone, Copy)]
pub struct LogitsRef<'a> {
    pub vocab: usize,
    pub data: &'a [f32],
}

impl<'a> LogitsRef<'a> {
    /// Logits of the `i`-th token asked for.
    pub fn row(&self, i: usize) -> &'a [f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

impl Logits {
    pub fn view(&self) -> LogitsRef<'_> {
        LogitsRef {
            vocab: self.vocab,
            data: &self.data,
        }
    }

    pub fn n(&self) -> usize {
        self.data.len().checked_div(self.vocab).unwrap_or(0)
    }

    /// Logits of the `i`-th token asked for.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// Which weights run on an accelerator: the first `layers` layers (their K/V too) and, when
/// `output` is set, the final norm and output layer. Embeddings are always gathered on the CPU.
#[derive(Debug, Clone)]
pub struct Offload {
    pub device: candle_core::Device,
    pub layers: usize,
    pub output: bool,
}

/// What the decoder drives: a forward over a KV cache. The CPU and CUDA paths both serve it.
pub trait Forward {
    fn config(&self) -> &Qwen3Config;
    fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Logits>;
    /// [`Forward::forward`] into `out`, whose buffer is reused (a caller that forwards again
    /// and again keeps one and spares a large allocation per call).
    fn forward_into(&self, batch: &Batch, cache: &mut KvCache, out: &mut Logits) -> Result<()> {
        *out = self.forward(batch, cache)?;
        Ok(())
    }
}
