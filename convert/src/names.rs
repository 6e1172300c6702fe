//! Checkpoint tensor names and the llama.cpp `qwen3` names they become.

use crate::hf::config::Qwen3Config;

/// The tensors of one Qwen3 layer: (Hugging Face suffix after `model.layers.N.`, GGUF suffix
/// after `blk.N.`), in the order they are written.
pub const LAYER_TENSORS: [(&str, &str); 11] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

pub const EMBED: (&str, &str) = ("model.embed_tokens.weight", "token_embd.weight");
pub const FINAL_NORM: (&str, &str) = ("model.norm.weight", "output_norm.weight");
pub const LM_HEAD: (&str, &str) = ("lm_head.weight", "output.weight");

/// The expected (HF name, GGUF name, PyTorch shape) of every tensor of the model.
pub fn checkpoint_tensors(cfg: &Qwen3Config) -> Vec<(String, String, Vec<u64>)> {
    let (h, v, ff) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let mut out = vec![(EMBED.0.to_string(), EMBED.1.to_string(), vec![v, h])];
    for layer in 0..cfg.num_hidden_layers {
        for (hf, gg) in LAYER_TENSORS {
            let shape = match gg {
                "attn_norm.weight" | "ffn_norm.weight" => vec![h],
                "attn_q.weight" => vec![q, h],
                "attn_k.weight" | "attn_v.weight" => vec![kv, h],
                "attn_output.weight" => vec![h, q],
                "attn_q_norm.weight" | "attn_k_norm.weight" => vec![cfg.head_dim],
                "ffn_gate.weight" | "ffn_up.weight" => vec![ff, h],
                "ffn_down.weight" => vec![h, ff],
                other => unreachable!("unlisted layer tensor {other}"),
            };
            out.push((
                format!("model.layers.{layer}.{hf}"),
                format!("blk.{layer}.{gg}"),
                shape,
            ));
        }
    }
    out.push((FINAL_NORM.0.to_string(), FINAL_NORM.1.to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push((LM_HEAD.0.to_string(), LM_HEAD.1.to_string(), vec![v, h]));
    }
    out
}

/// Checkpoint entries that carry no weights llama.cpp needs (older exports keep RoPE tables).
pub fn is_ignorable(hf_name: &str) -> bool {
    hf_name.ends_with(".rotary_emb.inv_freq")
}

pub use refusion_gguf::layer_of;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_index_parses() {
        assert_eq!(layer_of("blk.12.attn_v.weight"), Some(12));
        assert_eq!(layer_of("output.weight"), None);
    }
}
