//! Which type each tensor gets for a given `--outtype`: llama.cpp's per-tensor rules
//! (`llama_tensor_get_type` in llama-quantize) for the dense qwen3 architecture.

use crate::gguf::{FileType, GgmlType};
use crate::names::layer_of;

/// What the mix rules need to know about the model.
#[derive(Debug, Clone, Copy)]
pub struct ModelShape {
    pub n_layers: usize,
    /// Query heads per KV head.
    pub n_gqa: u64,
    /// Whether the model has its own `output.weight` (false when tied to the embeddings).
    pub has_output: bool,
}

#[derive(Debug, Clone, Default)]
pub struct MixOptions {
    /// `--pure`: every 2-D tensor gets the base type (no per-tensor bumps).
    pub pure: bool,
    pub output_tensor_type: Option<GgmlType>,
    pub token_embedding_type: Option<GgmlType>,
}

/// llama.cpp's layer selection for the "more bits" layers: the first and last eighth, and
/// every third layer in between.
pub fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The type for one tensor, and a note when the row length forced a fallback type.
pub fn tensor_type(
    ftype: FileType,
    name: &str,
    ne: &[u64],
    shape: &ModelShape,
    opts: &MixOptions,
) -> (GgmlType, Option<String>) {
    // Norms and other vectors stay f32, as in every llama.cpp file.
    if ne.len() < 2 {
        return (GgmlType::F32, None);
    }
    let base = ftype.base_type();
    let is_output = name == "output.weight" || (!shape.has_output && name == "token_embd.weight");
    let mut ty = base;
    if base.is_quantized() && !opts.pure {
        ty = mixed_type(ftype, base, name, ne[0], is_output, shape);
    }
    if is_output {
        if let Some(t) = opts.output_tensor_type {
            ty = t;
        }
    } else if name == "token_embd.weight" {
        if let Some(t) = opts.token_embedding_type {
            ty = t;
        }
    }
    fallback(ty, ne[0])
}

fn mixed_type(
    ftype: FileType,
    base: GgmlType,
    name: &str,
    ne0: u64,
    is_output: bool,
    shape: &ModelShape,
) -> GgmlType {
    use FileType as F;
    use GgmlType as G;
    let layer = layer_of(name).unwrap_or(0);
    let n = shape.n_layers;
    if is_output {
        return if !ne0.is_multiple_of(base.block_size() as u64) {
            G::Q8_0
        } else if base != G::Q8_0 {
            G::Q6_K
        } else {
            base
        };
    }
    if name.ends_with("attn_v.weight") {
        return match ftype {
            F::Q2_K if shape.n_gqa >= 4 => G::Q4_K,
            F::Q2_K => G::Q3_K,
            F::Q3_K_M if layer < 2 => G::Q5_K,
            F::Q3_K_M => G::Q4_K,
            F::Q3_K_L => G::Q5_K,
            F::Q4_K_M | F::Q5_K_M if use_more_bits(layer, n) => G::Q6_K,
            F::Q4_K_S if layer < 4 => G::Q5_K,
            _ => base,
        };
    }
    if name.ends_with("ffn_down.weight") {
        return match ftype {
            F::Q2_K => G::Q3_K,
            F::Q3_K_M if layer < n / 16 => G::Q5_K,
            F::Q3_K_M => G::Q4_K,
            F::Q3_K_L => G::Q5_K,
            F::Q4_K_M | F::Q5_K_M if use_more_bits(layer, n) => G::Q6_K,
            F::Q4_K_S if layer < n / 8 => G::Q5_K,
            _ => base,
        };
    }
    if name.ends_with("attn_output.weight") {
        return match ftype {
            F::Q2_K => G::Q3_K,
            F::Q3_K_M => G::Q4_K,
            F::Q3_K_L => G::Q5_K,
            _ => base,
        };
    }
    base
}

/// llama.cpp's substitutes when a row is not a whole number of blocks. Where llama.cpp uses
/// IQ4_NL (for Q2_K/Q3_K), which candle cannot run, we use Q4_0 of the same block size; where
/// llama.cpp gives up (a legacy type that does not fit), we use F16 as its HF converter does.
fn fallback(ty: GgmlType, ne0: u64) -> (GgmlType, Option<String>) {
    let fits = |t: GgmlType| ne0.is_multiple_of(t.block_size() as u64);
    if fits(ty) {
        return (ty, None);
    }
    let mut alt = match ty {
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        _ => GgmlType::F16,
    };
    if !fits(alt) {
        alt = GgmlType::F16;
    }
    let note = format!(
        "row length {ne0} is not a multiple of {ty}'s block of {}: using {alt}",
        ty.block_size()
    );
    (alt, Some(note))
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3_8B: ModelShape = ModelShape {
        n_layers: 36,
        n_gqa: 4,
        has_output: true,
    };

    fn ty(ftype: FileType, name: &str) -> GgmlType {
        tensor_type(
            ftype,
            name,
            &[4096, 4096],
            &QWEN3_8B,
            &MixOptions::default(),
        )
        .0
    }

    #[test]
    fn q4_k_m_matches_llama_cpp() {
        let f = FileType::Q4_K_M;
        assert_eq!(ty(f, "output.weight"), GgmlType::Q6_K);
        assert_eq!(ty(f, "token_embd.weight"), GgmlType::Q4_K);
        assert_eq!(ty(f, "blk.0.attn_v.weight"), GgmlType::Q6_K);
        assert_eq!(ty(f, "blk.5.attn_v.weight"), GgmlType::Q4_K);
        assert_eq!(ty(f, "blk.6.attn_v.weight"), GgmlType::Q6_K);
        assert_eq!(ty(f, "blk.35.ffn_down.weight"), GgmlType::Q6_K);
        assert_eq!(ty(f, "blk.10.attn_q.weight"), GgmlType::Q4_K);
        assert_eq!(ty(f, "blk.10.ffn_gate.weight"), GgmlType::Q4_K);
        let more: Vec<usize> = (0..36).filter(|&i| use_more_bits(i, 36)).collect();
        assert_eq!(
            more,
            vec![0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]
        );
        assert_eq!(ty(f, "blk.0.attn_norm.weight"), GgmlType::Q4_K); // 2-D shape given above
        assert_eq!(
            tensor_type(
                f,
                "blk.0.attn_norm.weight",
                &[4096],
                &QWEN3_8B,
                &MixOptions::default()
            )
            .0,
            GgmlType::F32
        );
    }

    #[test]
    fn other_mixes() {
        assert_eq!(ty(FileType::Q2_K, "blk.3.attn_v.weight"), GgmlType::Q4_K);
        assert_eq!(ty(FileType::Q3_K_M, "blk.1.attn_v.weight"), GgmlType::Q5_K);
        assert_eq!(ty(FileType::Q3_K_M, "blk.2.attn_v.weight"), GgmlType::Q4_K);
        assert_eq!(
            ty(FileType::Q3_K_M, "blk.1.ffn_down.weight"),
            GgmlType::Q5_K
        );
        assert_eq!(
            ty(FileType::Q3_K_M, "blk.3.ffn_down.weight"),
            GgmlType::Q4_K
        );
        assert_eq!(
            ty(FileType::Q3_K_S, "blk.3.ffn_down.weight"),
            GgmlType::Q3_K
        );
        assert_eq!(ty(FileType::Q4_K_S, "blk.3.attn_v.weight"), GgmlType::Q5_K);
        assert_eq!(ty(FileType::Q4_K_S, "blk.4.attn_v.weight"), GgmlType::Q4_K);
        assert_eq!(ty(FileType::Q8_0, "output.weight"), GgmlType::Q8_0);
        assert_eq!(ty(FileType::Q4_0, "output.weight"), GgmlType::Q6_K);
        assert_eq!(ty(FileType::F16, "output.weight"), GgmlType::F16);
        assert_eq!(ty(FileType::BF16, "blk.0.attn_v.weight"), GgmlType::BF16);
    }

    #[test]
    fn tied_embeddings_get_the_output_type_and_overrides_apply() {
        let tied = ModelShape {
            has_output: false,
            ..QWEN3_8B
        };
        let t = tensor_type(
            FileType::Q4_K_M,
            "token_embd.weight",
            &[4096, 1000],
            &tied,
            &MixOptions::default(),
        );
        assert_eq!(t.0, GgmlType::Q6_K);
        let opts = MixOptions {
            output_tensor_type: Some(GgmlType::Q8_0),
            ..Default::default()
        };
        let t = tensor_type(
            FileType::Q4_K_M,
            "output.weight",
            &[4096, 1000],
            &QWEN3_8B,
            &opts,
        );
        assert_eq!(t.0, GgmlType::Q8_0);
        let pure = MixOptions {
            pure: true,
            ..Default::default()
        };
        let t = tensor_type(
            FileType::Q4_K_M,
            "blk.0.attn_v.weight",
            &[4096, 1000],
            &QWEN3_8B,
            &pure,
        );
        assert_eq!(t.0, GgmlType::Q4_K);
    }

    #[test]
    fn fallbacks_for_short_rows() {
        let shape = ModelShape {
            n_layers: 2,
            n_gqa: 2,
            has_output: true,
        };
        let t = |f: FileType, ne0: u64| {
            tensor_type(
                f,
                "blk.0.attn_q.weight",
                &[ne0, 8],
                &shape,
                &MixOptions::default(),
            )
        };
        assert_eq!(t(FileType::Q4_K_M, 96).0, GgmlType::Q5_0);
        assert!(t(FileType::Q4_K_M, 96).1.is_some());
        assert_eq!(t(FileType::Q5_K_S, 64).0, GgmlType::Q5_1);
        assert_eq!(t(FileType::Q6_K, 64).0, GgmlType::Q8_0);
        assert_eq!(t(FileType::Q3_K_S, 64).0, GgmlType::Q4_0);
        assert_eq!(t(FileType::Q4_K_M, 48).0, GgmlType::F16);
        assert_eq!(t(FileType::Q8_0, 48).0, GgmlType::F16);
        assert_eq!(t(FileType::Q4_K_M, 512).0, GgmlType::Q4_K);
    }
}
