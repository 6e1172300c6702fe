//! Qwen3 hyper-parameters read from GGUF metadata, and the tensor shapes they imply.

use refusion_gguf::{GgufHeader, Value};

use crate::error::{Error, Result};

/// The attention's shape: query heads, KV heads (each shared by `n / kv` query heads) and the
/// head size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub n: usize,
    pub kv: usize,
    pub dim: usize,
}

impl Heads {
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n / self.kv
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3Config {
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rope_theta: f32,
    pub rms_eps: f64,
    pub context_length: usize,
    pub tied_output: bool,
}

fn get_u64(h: &GgufHeader, key: &str) -> Result<u64> {
    h.get(key)
        .and_then(Value::as_u64)
        .ok_or_else(|| Error::model(format!("metadata key {key} is missing or not an integer")))
}

fn get_f64(h: &GgufHeader, key: &str) -> Result<f64> {
    h.get(key)
        .and_then(Value::as_f64)
        .ok_or_else(|| Error::model(format!("metadata key {key} is missing or not a number")))
}

fn positive(key: &str, v: u64) -> Result<usize> {
    if v == 0 || v > (1 << 31) {
        return Err(Error::model(format!(
            "metadata key {key} = {v} is out of range"
        )));
    }
    Ok(v as usize)
}

/// The attention's shape: heads, KV heads (a divisor of the heads) and an even head size.
fn read_heads(h: &GgufHeader, hidden: usize) -> Result<Heads> {
    let n = positive(
        "qwen3.attention.head_count",
        get_u64(h, "qwen3.attention.head_count")?,
    )?;
    let kv = match h.get("qwen3.attention.head_count_kv") {
        Some(v) => positive(
            "qwen3.attention.head_count_kv",
            v.as_u64()
                .ok_or_else(|| Error::model("qwen3.attention.head_count_kv is not an integer"))?,
        )?,
        None => n,
    };
    if n % kv != 0 {
        return Err(Error::model(format!(
            "head_count {n} is not a multiple of head_count_kv {kv}"
        )));
    }
    let dim = match h.get("qwen3.attention.key_length") {
        Some(v) => positive("qwen3.attention.key_length", v.as_u64().unwrap_or(0))?,
        None => hidden / n,
    };
    if let Some(v) = h.get("qwen3.attention.value_length") {
        if v.as_u64() != Some(dim as u64) {
            return Err(Error::model(format!(
                "attention.value_length {v} differs from key_length {dim}; not supported"
            )));
        }
    }
    if dim % 2 != 0 {
        return Err(Error::model(format!(
            "head dimension {dim} must be even for RoPE"
        )));
    }
    Ok(Heads { n, kv, dim })
}

/// RoPE's frequency base (default 1e6) and the norms' epsilon, both positive and finite.
fn read_rope_and_eps(h: &GgufHeader) -> Result<(f64, f64)> {
    let rope_theta = match h.get("qwen3.rope.freq_base") {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| Error::model("qwen3.rope.freq_base is not a number"))?,
        None => 1_000_000.0,
    };
    let rms_eps = get_f64(h, "qwen3.attention.layer_norm_rms_epsilon")?;
    if !(rope_theta.is_finite() && rope_theta > 0.0 && rms_eps.is_finite() && rms_eps > 0.0) {
        return Err(Error::model(format!(
            "invalid rope.freq_base {rope_theta} or rms epsilon {rms_eps}"
        )));
    }
    Ok((rope_theta, rms_eps))
}

impl Qwen3Config {
    /// The attention's shape.
    pub fn heads(&self) -> Heads {
        Heads {
            n: self.n_heads,
            kv: self.n_kv_heads,
            dim: self.head_dim,
        }
    }

    /// Reads and checks the `qwen3.*` keys, and the vocabulary from `token_embd`.
    pub fn from_gguf(h: &GgufHeader) -> Result<Qwen3Config> {
        let arch = h
            .get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or("");
        if arch != "qwen3" {
            return Err(Error::model(format!(
                "architecture '{arch}' is not supported (refusion runs qwen3 models: ReFusion and Qwen3)"
            )));
        }
        let hidden = positive(
            "qwen3.embedding_length",
            get_u64(h, "qwen3.embedding_length")?,
        )?;
        let heads = read_heads(h, hidden)?;
        let embd = h
            .tensor("token_embd.weight")
            .ok_or_else(|| Error::model("tensor token_embd.weight is missing"))?;
        if embd.ne.len() != 2 || embd.ne[0] as usize != hidden {
            return Err(Error::model(format!(
                "tensor token_embd.weight has shape {:?}, expected [{hidden}, vocab]",
                embd.ne
            )));
        }
        let (rope_theta, rms_eps) = read_rope_and_eps(h)?;
        Ok(Qwen3Config {
            n_layers: positive("qwen3.block_count", get_u64(h, "qwen3.block_count")?)?,
            hidden,
            n_heads: heads.n,
            n_kv_heads: heads.kv,
            head_dim: heads.dim,
            ffn: positive(
                "qwen3.feed_forward_length",
                get_u64(h, "qwen3.feed_forward_length")?,
            )?,
            vocab: positive("vocab (token_embd rows)", embd.ne[1])?,
            rope_theta: rope_theta as f32,
            rms_eps,
            context_length: positive("qwen3.context_length", get_u64(h, "qwen3.context_length")?)?,
            tied_output: h.tensor("output.weight").is_none(),
        })
    }

    /// Every tensor the model needs, with its GGML shape.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<u64>)> {
        let (h, q, kv, hd, ff) = (
            self.hidden as u64,
            (self.n_heads * self.head_dim) as u64,
            (self.n_kv_heads * self.head_dim) as u64,
            self.head_dim as u64,
            self.ffn as u64,
        );
        let mut v = vec![("token_embd.weight".to_string(), vec![h, self.vocab as u64])];
        for l in 0..self.n_layers {
            let p = |n: &str| format!("blk.{l}.{n}.weight");
            v.push((p("attn_norm"), vec![h]));
            v.push((p("attn_q"), vec![h, q]));
            v.push((p("attn_k"), vec![h, kv]));
            v.push((p("attn_v"), vec![h, kv]));
            v.push((p("attn_output"), vec![q, h]));
            v.push((p("attn_q_norm"), vec![hd]));
            v.push((p("attn_k_norm"), vec![hd]));
            v.push((p("ffn_norm"), vec![h]));
            v.push((p("ffn_gate"), vec![h, ff]));
            v.push((p("ffn_up"), vec![h, ff]));
            v.push((p("ffn_down"), vec![ff, h]));
        }
        v.push(("output_norm.weight".to_string(), vec![h]));
        if !self.tied_output {
            v.push(("output.weight".to_string(), vec![h, self.vocab as u64]));
        }
        v
    }

    /// Checks that every tensor is present with the right shape, before anything is computed.
    pub fn validate_tensors(&self, h: &GgufHeader) -> Result<()> {
        for (name, ne) in self.expected_tensors() {
            let t = h
                .tensor(&name)
                .ok_or_else(|| Error::model(format!("tensor {name} is missing")))?;
            if t.ne != ne {
                return Err(Error::model(format!(
                    "tensor {name} has shape {:?}, but the metadata implies {ne:?}",
                    t.ne
                )));
            }
        }
        Ok(())
    }
}
