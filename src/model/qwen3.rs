//! Qwen3 (and ReFusion, which is Qwen3-8B with a mask token) over memory-mapped GGUF weights.
//!
//! The weight structs mirror the file's tensors; the forward reads top to bottom. Differences
//! from a plain left-to-right model, all needed by ReFusion:
//! - a flat batch of several rows over one cache, each token with its own position id;
//! - RoPE from f32 angles computed per token (no f16 tables, exact far from position 0);
//! - logits only for the tokens asked for, so `output` runs only on those;
//! - `token_embd` is never dequantized as a whole: the rows needed are decoded from the map.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use refusion_convert::gguf::{GgmlType, GgufFile, TensorInfo};
use refusion_convert::quant;

use super::attention::{attend, Visible};
use super::{Batch, Forward, Logits, Qwen3Config};
use crate::error::{Error, Result};
use crate::kv::{CacheShape, KvCache};

fn candle_dtype(ty: GgmlType) -> GgmlDType {
    match ty {
        GgmlType::F32 => GgmlDType::F32,
        GgmlType::F16 => GgmlDType::F16,
        GgmlType::BF16 => GgmlDType::BF16,
        GgmlType::Q4_0 => GgmlDType::Q4_0,
        GgmlType::Q4_1 => GgmlDType::Q4_1,
        GgmlType::Q5_0 => GgmlDType::Q5_0,
        GgmlType::Q5_1 => GgmlDType::Q5_1,
        GgmlType::Q8_0 => GgmlDType::Q8_0,
        GgmlType::Q8_1 => GgmlDType::Q8_1,
        GgmlType::Q2_K => GgmlDType::Q2K,
        GgmlType::Q3_K => GgmlDType::Q3K,
        GgmlType::Q4_K => GgmlDType::Q4K,
        GgmlType::Q5_K => GgmlDType::Q5K,
        GgmlType::Q6_K => GgmlDType::Q6K,
        GgmlType::Q8_K => GgmlDType::Q8K,
    }
}

struct Layer {
    attn_norm: Tensor,
    attn_q: QMatMul,
    attn_k: QMatMul,
    attn_v: QMatMul,
    attn_output: QMatMul,
    attn_q_norm: Tensor,
    attn_k_norm: Tensor,
    ffn_norm: Tensor,
    ffn_gate: QMatMul,
    ffn_up: QMatMul,
    ffn_down: QMatMul,
}

pub struct Qwen3 {
    cfg: Qwen3Config,
    device: Device,
    file: Arc<GgufFile>,
    token_embd: TensorInfo,
    layers: Vec<Layer>,
    output_norm: Tensor,
    output: QMatMul,
    /// RoPE inverse frequencies, computed in f32 as transformers does.
    inv_freq: Vec<f32>,
}

struct Loader<'a> {
    file: &'a GgufFile,
    device: &'a Device,
}

impl Loader<'_> {
    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.file
            .header
            .tensor(name)
            .ok_or_else(|| Error::msg(format!("tensor {name} is missing")))
    }

    /// A weight matrix, copied once from the map into candle's storage.
    fn matmul(&self, name: &str) -> Result<QMatMul> {
        let t = self.info(name)?;
        let data = self.file.tensor_data(t);
        let dims: Vec<usize> = t.ne.iter().rev().map(|&d| d as usize).collect();
        if !t.ty.is_quantized() {
            // Plain float weights run through candle's f32 matmul.
            let dtype = match t.ty {
                GgmlType::F16 => DType::F16,
                GgmlType::BF16 => DType::BF16,
                _ => DType::F32,
            };
            let w =
                Tensor::from_raw_buffer(data, dtype, &dims, self.device)?.to_dtype(DType::F32)?;
            self.file.release(t, 0, t.n_bytes);
            return Ok(QMatMul::Tensor(w));
        }
        let storage = QStorage::from_data(Cow::Borrowed(data), self.device, candle_dtype(t.ty))?;
        let q = QTensor::new(storage, dims)?;
        // The pages were copied: let the kernel drop them from this process.
        self.file.release(t, 0, t.n_bytes);
        Ok(QMatMul::from_arc(Arc::new(q))?)
    }

    /// A vector (norm weights), as f32.
    fn vector(&self, name: &str) -> Result<Tensor> {
        let t = self.info(name)?;
        let mut v = vec![0f32; t.n_elements() as usize];
        if !quant::dequantize(t.ty, self.file.tensor_data(t), &mut v) {
            return Err(Error::msg(format!(
                "tensor {name} has unsupported type {}",
                t.ty
            )));
        }
        Ok(Tensor::from_vec(v, t.n_elements() as usize, self.device)?)
    }
}

impl Qwen3 {
    /// Loads the weights of a validated qwen3 GGUF.
    pub fn load(file: Arc<GgufFile>, device: &Device) -> Result<Qwen3> {
        let cfg = Qwen3Config::from_gguf(&file.header)?;
        cfg.validate_tensors(&file.header)?;
        let token_embd = file
            .header
            .tensor("token_embd.weight")
            .cloned()
            .ok_or_else(|| Error::msg("tensor token_embd.weight is missing"))?;
        if matches!(token_embd.ty, GgmlType::Q8_1 | GgmlType::Q8_K) {
            return Err(Error::msg(format!(
                "token_embd.weight has unsupported type {}",
                token_embd.ty
            )));
        }
        let ld = Loader {
            file: &file,
            device,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: ld.vector(&n("attn_norm"))?,
                attn_q: ld.matmul(&n("attn_q"))?,
                attn_k: ld.matmul(&n("attn_k"))?,
                attn_v: ld.matmul(&n("attn_v"))?,
                attn_output: ld.matmul(&n("attn_output"))?,
                attn_q_norm: ld.vector(&n("attn_q_norm"))?,
                attn_k_norm: ld.vector(&n("attn_k_norm"))?,
                ffn_norm: ld.vector(&n("ffn_norm"))?,
                ffn_gate: ld.matmul(&n("ffn_gate"))?,
                ffn_up: ld.matmul(&n("ffn_up"))?,
                ffn_down: ld.matmul(&n("ffn_down"))?,
            });
        }
        let output_norm = ld.vector("output_norm.weight")?;
        let output = if cfg.tied_output {
            ld.matmul("token_embd.weight")?
        } else {
            ld.matmul("output.weight")?
        };
        let hd = cfg.head_dim;
        let inv_freq = (0..hd / 2)
            .map(|i| 1.0f32 / cfg.rope_theta.powf((2 * i) as f32 / hd as f32))
            .collect();
        Ok(Qwen3 {
            cfg,
            device: device.clone(),
            file,
            token_embd,
            layers,
            output_norm,
            output,
            inv_freq,
        })
    }

    /// The cache geometry for a context of `capacity` entries.
    pub fn cache_shape(&self, capacity: usize) -> CacheShape {
        CacheShape {
            n_layers: self.cfg.n_layers,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
            capacity,
        }
    }

    /// Decodes the embedding rows of `tokens` from the mapped file.
    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let h = self.cfg.hidden;
        let t = &self.token_embd;
        let row_bytes = t.ty.row_bytes(t.ne[0]).unwrap_or(0) as usize;
        let data = self.file.tensor_data(t);
        let mut out = vec![0f32; tokens.len() * h];
        for (i, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            if tok >= self.cfg.vocab {
                return Err(Error::msg(format!(
                    "token id {tok} is outside the vocabulary ({})",
                    self.cfg.vocab
                )));
            }
            quant::dequantize(
                t.ty,
                &data[tok * row_bytes..(tok + 1) * row_bytes],
                &mut out[i * h..(i + 1) * h],
            );
        }
        Ok(Tensor::from_vec(out, (tokens.len(), h), &self.device)?)
    }

    /// Rotates `x` (`[n, heads, head_dim]`) in place, token `i` at `positions[i]`
    /// (rotate-half layout, as transformers' Qwen3).
    fn rope(&self, x: &mut [f32], positions: &[u32], heads: usize) {
        let hd = self.cfg.head_dim;
        let half = hd / 2;
        let mut cos = vec![0f32; half];
        let mut sin = vec![0f32; half];
        for (i, &p) in positions.iter().enumerate() {
            for (j, &f) in self.inv_freq.iter().enumerate() {
                let angle = p as f32 * f;
                cos[j] = angle.cos();
                sin[j] = angle.sin();
            }
            for h in 0..heads {
                let v = &mut x[(i * heads + h) * hd..(i * heads + h + 1) * hd];
                for j in 0..half {
                    let (a, b) = (v[j], v[j + half]);
                    v[j] = a * cos[j] + (-b) * sin[j];
                    v[j + half] = b * cos[j] + a * sin[j];
                }
            }
        }
    }
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(x, w, eps as f32)?)
}

impl Forward for Qwen3 {
    fn config(&self) -> &Qwen3Config {
        &self.cfg
    }

    fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Logits> {
        let cfg = &self.cfg;
        let n = batch.len();
        if batch.positions.len() != n || batch.rows.len() != n {
            return Err(Error::msg(
                "batch tokens, positions and rows differ in length",
            ));
        }
        let wanted = batch.logit_indices();
        if let Some(&bad) = wanted.iter().find(|&&i| i >= n) {
            return Err(Error::msg(format!(
                "logits asked for token {bad} of a batch of {n}"
            )));
        }
        if n == 0 {
            return Ok(Logits {
                vocab: cfg.vocab,
                data: Vec::new(),
            });
        }
        let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let mut x = self.embed(&batch.tokens)?;
        // Which private slots each token sees: its row's earlier entries and its own. Count
        // each row's entries before this batch's land.
        let mut seen: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
        for &r in &batch.rows {
            seen.entry(r as usize)
                .or_insert_with(|| cache.row_len(r as usize));
        }
        let slots = cache.allocate(&batch.rows, &batch.positions)?;
        let counts: Vec<(usize, usize)> = batch
            .rows
            .iter()
            .map(|&r| {
                let c = seen.entry(r as usize).or_default();
                *c += 1;
                (r as usize, *c)
            })
            .collect();

        let mut attn = vec![0f32; n * nh * hd];
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
            let q = layer.attn_q.forward(&h)?.reshape((n, nh, hd))?;
            let k = layer.attn_k.forward(&h)?.reshape((n, nkv, hd))?;
            let v = layer.attn_v.forward(&h)?;
            let q = rms_norm(&q, &layer.attn_q_norm, cfg.rms_eps)?;
            let k = rms_norm(&k, &layer.attn_k_norm, cfg.rms_eps)?;
            let mut q = q.flatten_all()?.to_vec1::<f32>()?;
            let mut k = k.flatten_all()?.to_vec1::<f32>()?;
            let v = v.flatten_all()?.to_vec1::<f32>()?;
            self.rope(&mut q, &batch.positions, nh);
            self.rope(&mut k, &batch.positions, nkv);
            cache.write(l, &slots, &k, &v);
            let visible: Vec<Visible> = counts
                .iter()
                .map(|&(r, count)| Visible {
                    row_slots: cache.row_slots(r),
                    count,
                })
                .collect();
            attend(&q, cache, l, &visible, nh, nkv, hd, &mut attn);
            let a = Tensor::from_slice(&attn, (n, nh * hd), &self.device)?;
            x = (x + layer.attn_output.forward(&a)?)?;
            let h = rms_norm(&x, &layer.ffn_norm, cfg.rms_eps)?;
            let gate = candle_nn::ops::silu(&layer.ffn_gate.forward(&h)?)?;
            let up = layer.ffn_up.forward(&h)?;
            x = (x + layer.ffn_down.forward(&(gate * up)?)?)?;
        }

        if wanted.is_empty() {
            return Ok(Logits {
                vocab: cfg.vocab,
                data: Vec::new(),
            });
        }
        let idx: Vec<u32> = wanted.iter().map(|&i| i as u32).collect();
        let idx = Tensor::from_vec(idx, wanted.len(), &self.device)?;
        let x = x.index_select(&idx, 0)?;
        let x = rms_norm(&x, &self.output_norm, cfg.rms_eps)?;
        let logits = self.output.forward(&x)?.to_dtype(DType::F32)?;
        Ok(Logits {
            vocab: cfg.vocab,
            data: logits.flatten_all()?.to_vec1::<f32>()?,
        })
    }
}
