//! Checkpoint tensor names and the llama.cpp `qwen3` names they become.

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

/// Checkpoint entries that carry no weights llama.cpp needs (older exports keep RoPE tables).
pub fn is_ignorable(hf_name: &str) -> bool {
    hf_name.ends_with(".rotary_emb.inv_freq")
}

/// The layer index of a GGUF tensor name (`blk.N.…`).
pub fn layer_of(gguf_name: &str) -> Option<usize> {
    gguf_name
        .strip_prefix("blk.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_index_parses() {
        assert_eq!(layer_of("blk.12.attn_v.weight"), Some(12));
        assert_eq!(layer_of("output.weight"), None);
    }
}
