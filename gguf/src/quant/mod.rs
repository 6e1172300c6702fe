//! Encoders and decoders for every tensor type the converter writes.

mod float;
mod kquants;
mod legacy;
pub mod search;

use rayon::prelude::*;

use crate::GgmlType;

/// Encodes `x` (a whole number of rows of `row_len` elements) as `ty` into `out`, which must be
/// exactly the encoded size. Rows are spread over the rayon pool.
pub fn quantize(ty: GgmlType, x: &[f32], row_len: usize, out: &mut [u8]) {
    let row_bytes = ty
        .row_bytes(row_len as u64)
        .expect("row length checked by the caller") as usize;
    debug_assert_eq!(x.len() / row_len * row_bytes, out.len());
    x.par_chunks(row_len)
        .zip(out.par_chunks_mut(row_bytes))
        .for_each(|(row, dst)| quantize_row(ty, row, dst));
}

/// Encodes one row; `x.len()` must be a multiple of the type's block size.
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut [u8]) {
    match ty {
        GgmlType::F32 => float::encode_f32(x, out),
        GgmlType::F16 => float::encode_f16(x, out),
        GgmlType::BF16 => float::encode_bf16(x, out),
        GgmlType::Q8_0 => legacy::q8_0(x, out),
        GgmlType::Q4_0 => legacy::q4_0(x, out),
        GgmlType::Q4_1 => legacy::q4_1(x, out),
        GgmlType::Q5_0 => legacy::q5_0(x, out),
        GgmlType::Q5_1 => legacy::q5_1(x, out),
        GgmlType::Q2_K => kquants::q2_k(x, out),
        GgmlType::Q3_K => kquants::q3_k(x, out),
        GgmlType::Q4_K => kquants::q4_k(x, out),
        GgmlType::Q5_K => kquants::q5_k(x, out),
        GgmlType::Q6_K => kquants::q6_k(x, out),
        GgmlType::Q8_1 | GgmlType::Q8_K => unreachable!("{ty} is never written"),
    }
}

/// Decodes `bytes` of type `ty` into `out`. Returns false for the activation-only types
/// (Q8_1, Q8_K), which model files do not hold.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> bool {
    match ty {
        GgmlType::F32 => float::decode_f32(bytes, out),
        GgmlType::F16 => float::decode_f16(bytes, out),
        GgmlType::BF16 => float::decode_bf16(bytes, out),
        GgmlType::Q8_0 => legacy::dequant_q8_0(bytes, out),
        GgmlType::Q4_0 => legacy::dequant_q4_0(bytes, out),
        GgmlType::Q4_1 => legacy::dequant_q4_1(bytes, out),
        GgmlType::Q5_0 => legacy::dequant_q5_0(bytes, out),
        GgmlType::Q5_1 => legacy::dequant_q5_1(bytes, out),
        GgmlType::Q2_K => kquants::dequant_q2_k(bytes, out),
        GgmlType::Q3_K => kquants::dequant_q3_k(bytes, out),
        GgmlType::Q4_K => kquants::dequant_q4_k(bytes, out),
        GgmlType::Q5_K => kquants::dequant_q5_k(bytes, out),
        GgmlType::Q6_K => kquants::dequant_q6_k(bytes, out),
        GgmlType::Q8_1 | GgmlType::Q8_K => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic, heavy-tailed test signal.
    fn signal(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
                let spike = if i % 97 == 0 { 6.0 } else { 1.0 };
                u * u * u.signum() * 0.05 * spike + 0.001 * (i % 7) as f32
            })
            .collect()
    }

    fn rel_rmse(ty: GgmlType, x: &[f32]) -> f32 {
        let mut q = vec![0u8; ty.row_bytes(x.len() as u64).unwrap() as usize];
        quantize(ty, x, x.len(), &mut q);
        let mut y = vec![0f32; x.len()];
        assert!(dequantize(ty, &q, &mut y));
        let err: f32 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
        let pow: f32 = x.iter().map(|a| a * a).sum();
        (err / pow).sqrt()
    }

    #[test]
    fn every_type_round_trips_within_its_bound() {
        let x = signal(4096, 7);
        // Relative RMSE bounds: about 1.3x what these encoders reach on this signal, so a
        // broken bit layout or scale search fails loudly.
        let bounds = [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 3e-4),
            (GgmlType::BF16, 3e-3),
            (GgmlType::Q8_0, 0.01),
            (GgmlType::Q6_K, 0.03),
            (GgmlType::Q5_0, 0.08),
            (GgmlType::Q5_1, 0.06),
            (GgmlType::Q5_K, 0.055),
            (GgmlType::Q4_0, 0.15),
            (GgmlType::Q4_1, 0.12),
            (GgmlType::Q4_K, 0.11),
            (GgmlType::Q3_K, 0.23),
            (GgmlType::Q2_K, 0.4),
        ];
        let mut errs = std::collections::HashMap::new();
        for (ty, bound) in bounds {
            let e = rel_rmse(ty, &x);
            assert!(e <= bound, "{ty}: relative rmse {e} > {bound}");
            errs.insert(ty, e);
        }
        // More bits, less error; k-quants beat the legacy formats of the same width.
        use GgmlType as G;
        for (better, worse) in [
            (G::Q8_0, G::Q6_K),
            (G::Q6_K, G::Q5_K),
            (G::Q5_K, G::Q5_0),
            (G::Q5_K, G::Q4_K),
            (G::Q4_K, G::Q4_0),
            (G::Q4_K, G::Q3_K),
            (G::Q3_K, G::Q2_K),
        ] {
            assert!(errs[&better] < errs[&worse], "{better} should beat {worse}");
        }
    }

    #[test]
    fn zeros_and_constants_are_exact_enough() {
        for ty in GgmlType::ALL.into_iter().filter(|t| t.is_writable()) {
            let zeros = vec![0f32; 256];
            let mut q = vec![0u8; ty.row_bytes(256).unwrap() as usize];
            quantize(ty, &zeros, 256, &mut q);
            let mut y = vec![1f32; 256];
            dequantize(ty, &q, &mut y);
            assert!(y.iter().all(|v| *v == 0.0), "{ty} zeros");
        }
    }

    #[test]
    fn q8_0_matches_the_obvious_encoding() {
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 10.0).collect();
        let mut q = vec![0u8; 34];
        quantize(GgmlType::Q8_0, &x, 32, &mut q);
        let d = half::f16::from_le_bytes([q[0], q[1]]).to_f32();
        assert!((d - 21.0 / 127.0).abs() < 1e-4);
        assert_eq!(q[2 + 31] as i8, 127);
        assert_eq!(q[2] as i8, -60);
    }
}
