//! `convert --synthetic SHAPE --grow-from DIR`: a file of a real Qwen3 shape (0.6B … 8B, the
//! real 151,671-token vocabulary) that computes a small trained model's function, so that
//! ReFusion's decoding is measured end to end at the cost of the real sizes with answers that
//! mean something. No crate grows a transformer; the construction is ours (docs/convert.md).
//!
//! With `d`/`D` the small and large hidden sizes and `r` the head-size ratio:
//! - the residual stream is the small one times `s = sqrt(D/d)` on dimensions `0..d`, zero
//!   elsewhere but for one constant dimension `c = D-1` holding `v`; embeddings and every
//!   attention-output and FFN-down projection are scaled by `s` (a power of two for 0.6B and
//!   8B from d = 256: exact);
//! - RMSNorm over `D`: `(s²Σx² + v²)/D + eps'` equals `(Σx²/d + eps)` when `s² = D/d` and
//!   `v² = D·(eps - eps')`; the norm weights are divided by `s`. The file's one epsilon,
//!   `eps' = eps/r`, is also the one that makes the q/k norms over the padded head size equal the
//!   small ones (the mean over `r·hd` is the mean over `hd` divided by `r`);
//! - the small head's dimensions sit on the rotary pairs of the same frequency (NeoX halves:
//!   `i → r·i`, `i + hd/2 → r·i + r·hd/2`), and the larger attention scale `1/sqrt(r·hd)` is
//!   undone by the factor `sqrt(r)` the padded q norm gains (the k norm's weights take `1/sqrt(r)`);
//! - small q heads keep their KV group; extra heads, FFN units and layers are zero, so extra
//!   layers add nothing to the residual (they still cost their full forward);
//! - extra vocabulary rows: embeddings hold only `v` at `c`; output rows score `-K` at `c`, where
//!   the final norm's weight is large, so every extra logit is below -10⁴ and no probability moves.

use std::path::Path;
use std::sync::OnceLock;

use serde::Deserialize;

use crate::convert::{metadata, Checkpoint, ConvertOptions};
use crate::error::{Error, Result};
use crate::gguf::{GgmlType, TensorSpec, Value};
use crate::hf::config::Qwen3Config;
use crate::hf::tokenizer::GgufVocab;
use crate::mix::{tensor_type, ModelShape};
use crate::names;
use crate::pipeline::{write_gguf, Job, RowSource, Summary};
use crate::quant;

/// Output-layer weight of the extra vocabulary rows at the constant dimension (negative).
const EXTRA_ROW_WEIGHT: f32 = 1.0e4;
/// The final norm's output at the constant dimension, times the residual's RMS: extra logits
/// are `-EXTRA_ROW_WEIGHT * this / rms`, below -10⁴ for any RMS up to 10³.
const CONST_NORM_OUTPUT: f32 = 1.0e3;

/// How a small checkpoint's dimensions sit in a larger shape.
#[derive(Debug, Clone)]
pub struct Growth {
    pub small: Qwen3Config,
    pub large: Qwen3Config,
    /// `s`: the residual stream's scale.
    pub scale: f32,
    /// `v`: the constant residual dimension's value (at `large.hidden_size - 1`).
    pub const_value: f32,
    /// `r`: large head size over small.
    pub head_ratio: usize,
}

impl Growth {
    /// The large shape `shape` holding `small`: the shape's sizes with the small model's RoPE
    /// base, context, special tokens, an untied output layer and the compensated epsilon.
    pub fn new(small: &Qwen3Config, shape: &Qwen3Config) -> Result<Growth> {
        check_fits(small, shape)?;
        let head_ratio = (shape.head_dim / small.head_dim) as usize;
        let (d, big_d) = (small.hidden_size as f64, shape.hidden_size as f64);
        let eps = small.rms_norm_eps;
        let large_eps = eps / head_ratio as f64;
        let large = Qwen3Config {
            vocab_size: shape.vocab_size.max(small.vocab_size),
            tie_word_embeddings: false,
            rope_theta: small.rope_theta,
            rms_norm_eps: large_eps,
            max_position_embeddings: small.max_position_embeddings,
            bos_token_id: small.bos_token_id,
            eos_token_id: small.eos_token_id,
            mask_token_id: small.mask_token_id,
            ..shape.clone()
        };
        Ok(Growth {
            small: small.clone(),
            large,
            scale: (big_d / d).sqrt() as f32,
            const_value: (big_d * (eps - large_eps)).sqrt() as f32,
            head_ratio,
        })
    }

    fn const_dim(&self) -> usize {
        self.large.hidden_size as usize - 1
    }

    /// The large q head of small q head `h`: the same position in a KV group of the same head.
    fn q_head(&self, h: usize) -> usize {
        let g_small = (self.small.num_attention_heads / self.small.num_key_value_heads) as usize;
        let g_large = (self.large.num_attention_heads / self.large.num_key_value_heads) as usize;
        (h / g_small) * g_large + h % g_small
    }

    /// The large head dimension of small head dimension `i` on the rotary pair of the same
    /// frequency.
    fn rope_dim(&self, i: usize) -> usize {
        let half = self.small.head_dim as usize / 2;
        let large_half = self.large.head_dim as usize / 2;
        if i < half {
            self.head_ratio * i
        } else {
            self.head_ratio * (i - half) + large_half
        }
    }

    /// Heads laid out on a large axis: small head `h`'s dimension `i` at
    /// `head_of(h) * large_hd + dim_of(i)`.
    fn heads(
        &self,
        n_small: u64,
        n_large: u64,
        head_of: impl Fn(usize) -> usize,
        dim_of: impl Fn(usize) -> usize,
    ) -> Axis {
        let (hd, large_hd) = (self.small.head_dim as usize, self.large.head_dim as usize);
        let mut axis = vec![None; n_large as usize * large_hd];
        for h in 0..n_small as usize {
            for i in 0..hd {
                axis[head_of(h) * large_hd + dim_of(i)] = Some((h * hd + i) as u32);
            }
        }
        Axis(axis)
    }

    /// The q heads (`rotary`: on their rotary pairs), or the attention output's axis, whose
    /// values are not rotated.
    fn q_axis(&self, rotary: bool) -> Axis {
        let (s, l) = (&self.small, &self.large);
        self.heads(
            s.num_attention_heads,
            l.num_attention_heads,
            |h| self.q_head(h),
            |i| if rotary { self.rope_dim(i) } else { i },
        )
    }

    fn kv_axis(&self, rotary: bool) -> Axis {
        let (s, l) = (&self.small, &self.large);
        self.heads(
            s.num_key_value_heads,
            l.num_key_value_heads,
            |h| h,
            |i| if rotary { self.rope_dim(i) } else { i },
        )
    }

    fn hidden_axis(&self) -> Axis {
        Axis::prefix(self.small.hidden_size, self.large.hidden_size)
    }

    fn ffn_axis(&self) -> Axis {
        Axis::prefix(self.small.intermediate_size, self.large.intermediate_size)
    }

    /// How large tensor `gguf` is made: its row and column axes over the small tensor (none:
    /// all zero, an extra layer), its scale and constant entries.
    fn recipe(&self, gguf: &str) -> Recipe {
        let layer = names::layer_of(gguf);
        // `blk.N.attn_q.weight` → `attn_q.weight`; other names as they are.
        let suffix = match layer {
            Some(_) => gguf.splitn(3, '.').nth(2).unwrap_or(gguf),
            None => gguf,
        };
        let small_layers = self.small.num_hidden_layers as usize;
        if layer.is_some_and(|l| l >= small_layers) {
            return Recipe::zero();
        }
        let one = Axis(vec![Some(0)]);
        let s = self.scale;
        let c = self.const_dim();
        let (rows, cols, scale) = match suffix {
            "attn_norm.weight" | "ffn_norm.weight" => (one, self.hidden_axis(), 1.0 / s),
            "attn_q_norm.weight" => (one, self.rope_head_axis(), 1.0),
            "attn_k_norm.weight" => (
                one,
                self.rope_head_axis(),
                1.0 / (self.head_ratio as f32).sqrt(),
            ),
            "attn_q.weight" => (self.q_axis(true), self.hidden_axis(), 1.0),
            "attn_k.weight" => (self.kv_axis(true), self.hidden_axis(), 1.0),
            "attn_v.weight" => (self.kv_axis(false), self.hidden_axis(), 1.0),
            "attn_output.weight" => (self.hidden_axis(), self.q_axis(false), s),
            "ffn_gate.weight" | "ffn_up.weight" => (self.ffn_axis(), self.hidden_axis(), 1.0),
            "ffn_down.weight" => (self.hidden_axis(), self.ffn_axis(), s),
            "token_embd.weight" => {
                let rows = Axis::prefix(self.small.vocab_size, self.large.vocab_size);
                let mut r = Recipe::copy(rows, self.hidden_axis(), s);
                r.every = Some((c, self.const_value));
                return r;
            }
            "output_norm.weight" => {
                let mut r = Recipe::copy(one, self.hidden_axis(), 1.0 / s);
                r.every = Some((c, CONST_NORM_OUTPUT / self.const_value));
                return r;
            }
            "output.weight" => {
                let rows = Axis::prefix(self.small.vocab_size, self.large.vocab_size);
                let mut r = Recipe::copy(rows, self.hidden_axis(), 1.0);
                r.blank = Some((c, -EXTRA_ROW_WEIGHT));
                return r;
            }
            other => unreachable!("no recipe for tensor {other}"),
        };
        Recipe::copy(rows, cols, scale)
    }

    /// One head's dimensions on their rotary pairs (the q/k norm weights).
    fn rope_head_axis(&self) -> Axis {
        self.heads(1, 1, |h| h, |i| self.rope_dim(i))
    }
}

/// Refuses a shape that cannot hold the small model.
fn check_fits(small: &Qwen3Config, large: &Qwen3Config) -> Result<()> {
    let too_small = |what: &str, s: u64, l: u64| {
        Error::usage(format!(
            "--grow-from: the target shape's {what} ({l}) is smaller than the checkpoint's ({s})"
        ))
    };
    for (what, s, l) in [
        (
            "layer count",
            small.num_hidden_layers,
            large.num_hidden_layers,
        ),
        ("FFN size", small.intermediate_size, large.intermediate_size),
        (
            "KV head count",
            small.num_key_value_heads,
            large.num_key_value_heads,
        ),
        ("vocabulary", small.vocab_size, large.vocab_size),
    ] {
        if l < s {
            return Err(too_small(what, s, l));
        }
    }
    // The constant dimension must sit in a quantization block (256 at most) of its own.
    if large.hidden_size < small.hidden_size + 256 {
        return Err(Error::usage(format!(
            "--grow-from: the target shape's hidden size ({}) needs 256 more than the checkpoint's ({})",
            large.hidden_size, small.hidden_size
        )));
    }
    let group = |c: &Qwen3Config| c.num_attention_heads / c.num_key_value_heads.max(1);
    if group(large) < group(small) {
        return Err(Error::usage(format!(
            "--grow-from: the target shape has {} q heads per KV head, the checkpoint {}",
            group(large),
            group(small)
        )));
    }
    let ratio = large.head_dim / small.head_dim.max(1);
    if small.head_dim == 0
        || !small.head_dim.is_multiple_of(2)
        || !large.head_dim.is_multiple_of(small.head_dim)
        || ratio < 2
    {
        return Err(Error::usage(format!(
            "--grow-from: the target head size ({}) must be at least twice the checkpoint's ({}) and a multiple of it",
            large.head_dim, small.head_dim
        )));
    }
    Ok(())
}

/// Which small index each large index copies (`None`: zero).
#[derive(Debug, Clone)]
struct Axis(Vec<Option<u32>>);

impl Axis {
    /// The first `small` indices of `large`, in place.
    fn prefix(small: u64, large: u64) -> Axis {
        Axis(
            (0..large)
                .map(|i| (i < small).then_some(i as u32))
                .collect(),
        )
    }
}

/// How one large tensor is made from its small counterpart.
struct Recipe {
    /// `None`: every entry zero (an extra layer).
    axes: Option<(Axis, Axis)>,
    scale: f32,
    /// An entry set on every row (the constant dimension).
    every: Option<(usize, f32)>,
    /// An entry set on rows with no small row (the extra vocabulary).
    blank: Option<(usize, f32)>,
}

impl Recipe {
    fn zero() -> Recipe {
        Recipe {
            axes: None,
            scale: 1.0,
            every: None,
            blank: None,
        }
    }

    fn copy(rows: Axis, cols: Axis, scale: f32) -> Recipe {
        Recipe {
            axes: Some((rows, cols)),
            scale,
            every: None,
            blank: None,
        }
    }
}

/// A large tensor's rows, built from the small tensor held in memory.
struct GrownRows {
    name: String,
    recipe: Recipe,
    /// The small tensor, row-major, and its row length.
    small: Vec<f32>,
    small_cols: usize,
    row_len: usize,
    n_rows: usize,
    /// A row with no small row, encoded once in the tensor's type.
    encoded_blank: OnceLock<(GgmlType, Vec<u8>)>,
}

impl GrownRows {
    fn source_row(&self, row: usize) -> Option<usize> {
        let (rows, _) = self.recipe.axes.as_ref()?;
        rows.0.get(row).copied().flatten().map(|r| r as usize)
    }

    fn fill_row(&self, row: usize, out: &mut [f32]) {
        out.fill(0.0);
        let source = self.source_row(row);
        if let (Some(sr), Some((_, cols))) = (source, &self.recipe.axes) {
            let small = &self.small[sr * self.small_cols..(sr + 1) * self.small_cols];
            for (o, c) in out.iter_mut().zip(&cols.0) {
                if let Some(c) = c {
                    *o = small[*c as usize] * self.recipe.scale;
                }
            }
        }
        if let Some((c, v)) = self.recipe.every {
            out[c] = v;
        }
        if let (None, Some((c, v))) = (source, self.recipe.blank) {
            out[c] = v;
        }
    }
}

impl RowSource for GrownRows {
    fn read_rows(&self, first: usize, count: usize, out: &mut [f32]) {
        for (j, row) in out.chunks_exact_mut(self.row_len).take(count).enumerate() {
            self.fill_row(first + j, row);
        }
    }
    fn input_bytes(&self) -> u64 {
        (self.row_len * self.n_rows * 4) as u64
    }
    fn origin(&self) -> String {
        format!("grown tensor {}", self.name)
    }
    fn input_type(&self) -> String {
        "grown".into()
    }
    fn source_name(&self) -> String {
        self.name.clone()
    }
    /// Rows with no small row are all alike: encoded once, then copied (most of a grown file).
    fn encoded_rows(&self, ty: GgmlType, first: usize, count: usize, out: &mut [u8]) -> bool {
        if (first..first + count).any(|r| self.source_row(r).is_some()) {
            return false;
        }
        let Some(row_bytes) = ty.row_bytes(self.row_len as u64).map(|b| b as usize) else {
            return false;
        };
        let (blank_ty, blank) = self.encoded_blank.get_or_init(|| {
            let mut row = vec![0f32; self.row_len];
            self.fill_row(usize::MAX, &mut row);
            let mut bytes = vec![0u8; row_bytes];
            quant::quantize(ty, &row, self.row_len, &mut bytes);
            (ty, bytes)
        });
        if *blank_ty != ty {
            return false;
        }
        for row in out.chunks_exact_mut(row_bytes).take(count) {
            row.copy_from_slice(blank);
        }
        true
    }
}

/// The small checkpoint's tensor `hf` as f32, row-major.
fn read_small(ckpt: &Checkpoint, hf: &str) -> Result<(Vec<f32>, usize)> {
    let t = ckpt
        .weights
        .tensors
        .get(hf)
        .ok_or_else(|| Error::bad(&ckpt.dir, format!("missing tensor '{hf}'")))?;
    let cols = *t.shape.last().unwrap_or(&1) as usize;
    let rows = t.shape.iter().rev().skip(1).product::<u64>() as usize;
    let mut data = vec![0f32; rows * cols];
    ckpt.weights.read_rows(t, cols, 0, rows, &mut data);
    Ok((data, cols))
}

/// The small tensor a large one copies (`lm_head` falls back to the embedding when tied).
fn small_name(ckpt: &Checkpoint, gguf: &str) -> Option<String> {
    let small = names::checkpoint_tensors(&ckpt.config);
    if gguf == names::LM_HEAD.1 && ckpt.config.tie_word_embeddings {
        return Some(names::EMBED.0.to_string());
    }
    small
        .into_iter()
        .find(|(_, g, _)| g == gguf)
        .map(|(hf, _, _)| hf)
}

/// Writes `shape` grown from the checkpoint in `dir` (see the module's notes).
pub fn write_grown(
    target: &Path,
    shape: &Qwen3Config,
    dir: &Path,
    opts: &ConvertOptions,
) -> Result<Summary> {
    opts.decoding.validate().map_err(Error::usage)?;
    let ckpt = Checkpoint::open(dir)?;
    let growth = Growth::new(&ckpt.config, shape)?;
    let cfg = &growth.large;
    let vocab = GgufVocab::load(dir, cfg)?;
    let mix_shape = ModelShape {
        n_layers: cfg.num_hidden_layers as usize,
        n_gqa: cfg.num_attention_heads / cfg.num_key_value_heads,
        has_output: true,
    };
    let mut jobs = Vec::new();
    for (_, gguf, dims) in names::checkpoint_tensors(cfg) {
        let ne: Vec<u64> = dims.iter().rev().copied().collect();
        let (ty, note) = tensor_type(opts.outtype, &gguf, &ne, &mix_shape, &opts.mix);
        let recipe = growth.recipe(&gguf);
        let (small, small_cols) = match (&recipe.axes, small_name(&ckpt, &gguf)) {
            (Some(_), Some(hf)) => read_small(&ckpt, &hf)?,
            _ => (Vec::new(), 0),
        };
        jobs.push(Job {
            spec: TensorSpec {
                name: gguf.clone(),
                ne: ne.clone(),
                ty,
            },
            source: Box::new(GrownRows {
                name: gguf,
                recipe,
                small,
                small_cols,
                row_len: ne[0] as usize,
                n_rows: ne.iter().skip(1).product::<u64>() as usize,
                encoded_blank: OnceLock::new(),
            }),
            note,
        });
    }
    let name = opts.name.clone().unwrap_or_else(|| {
        let small = dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into());
        format!("{small} grown")
    });
    let mut md = metadata(cfg, &vocab, &name, opts)?;
    md.extend(eval_metadata(dir)?);
    write_gguf(target, &md, jobs, opts.verbosity)
}

#[derive(Deserialize)]
struct HeldOut {
    kind: String,
    question: String,
    answer: String,
}

/// `refusion.eval.*`: the checkpoint's held-out questions (`heldout.json`: kind, question,
/// answer), for `refusion bench --decode` to decode and score. Nothing when the folder has none.
pub fn eval_metadata(dir: &Path) -> Result<Vec<(String, Value)>> {
    let path = dir.join("heldout.json");
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let held: Vec<HeldOut> = crate::hf::read_json(&path)?;
    if held.is_empty() {
        return Ok(Vec::new());
    }
    Ok(vec![
        (
            "refusion.eval.kind".into(),
            Value::strings(held.iter().map(|h| h.kind.clone())),
        ),
        (
            "refusion.eval.question".into(),
            Value::strings(held.iter().map(|h| h.question.clone())),
        ),
        (
            "refusion.eval.answer".into(),
            Value::strings(held.iter().map(|h| h.answer.clone())),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Qwen3Config {
        Qwen3Config {
            hidden_size: 256,
            intermediate_size: 768,
            num_hidden_layers: 6,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 64,
            vocab_size: 768,
            tie_word_embeddings: false,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 2048,
            bos_token_id: None,
            eos_token_id: Some(716),
            mask_token_id: Some(719),
        }
    }

    #[test]
    fn rotary_pairs_keep_their_frequency() {
        let g = Growth::new(&small(), &crate::synthetic::shape("0.6b").unwrap()).unwrap();
        // Pair (i, i+32) of 64 has frequency theta^(-i/32); pair (2i, 2i+64) of 128 the same.
        assert_eq!(g.rope_dim(0), 0);
        assert_eq!(g.rope_dim(31), 62);
        assert_eq!(g.rope_dim(32), 64);
        assert_eq!(g.rope_dim(63), 126);
        assert_eq!(g.scale, 2.0);
        assert_eq!(g.large.rms_norm_eps, 5e-7);
    }

    #[test]
    fn q_heads_keep_their_kv_group() {
        let g = Growth::new(&small(), &crate::synthetic::shape("8b").unwrap()).unwrap();
        // Small: 2 q heads per KV head; 8B: 4. Small heads 0,1 (KV 0) → 0,1; 2,3 (KV 1) → 4,5.
        let heads: Vec<usize> = (0..4).map(|h| g.q_head(h)).collect();
        assert_eq!(heads, [0, 1, 4, 5]);
        assert_eq!(g.scale, 4.0);
    }

    #[test]
    fn shapes_too_small_are_refused_by_what_is_short() {
        let mut shape = crate::synthetic::shape("0.6b").unwrap();
        shape.num_hidden_layers = 4;
        let e = Growth::new(&small(), &shape).unwrap_err().to_string();
        assert!(e.contains("layer count (4)"), "{e}");
        let mut shape = crate::synthetic::shape("0.6b").unwrap();
        shape.head_dim = 64;
        let e = Growth::new(&small(), &shape).unwrap_err().to_string();
        assert!(e.contains("head size"), "{e}");
    }
}
