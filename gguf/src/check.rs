//! Tensor data checks (`--check-tensors`, as llama.cpp's): float values and quantized blocks'
//! scales must be finite. A NaN or infinite weight loads and runs without a word otherwise and
//! turns every logit into NaN (the answer `!!!!`).

use crate::types::GgmlType;

/// What is wrong with a tensor's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadData {
    Nan,
    Inf,
    /// A block's scale (or minimum) is NaN or infinite.
    BlockScale,
}

impl std::fmt::Display for BadData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BadData::Nan => "holds NaN",
            BadData::Inf => "holds Inf",
            BadData::BlockScale => "holds a block whose scale is NaN or Inf",
        })
    }
}

/// Where the f16 scales (and minimums) of a block lie, in bytes from its start.
fn f16_scales(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 => &[0, 2],
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_K => &[],
    }
}

fn f16_finite(lo: u8, hi: u8) -> bool {
    u16::from_le_bytes([lo, hi]) & 0x7c00 != 0x7c00
}

/// Checks the data of a tensor of type `ty`: the first problem found, if any.
pub fn check_data(ty: GgmlType, data: &[u8]) -> Result<(), BadData> {
    let classify = |nan: bool| if nan { BadData::Nan } else { BadData::Inf };
    match ty {
        GgmlType::F32 => {
            for c in data.chunks_exact(4) {
                let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                if !x.is_finite() {
                    return Err(classify(x.is_nan()));
                }
            }
        }
        GgmlType::F16 => {
            for c in data.chunks_exact(2) {
                if !f16_finite(c[0], c[1]) {
                    return Err(classify(u16::from_le_bytes([c[0], c[1]]) & 0x03ff != 0));
                }
            }
        }
        GgmlType::BF16 => {
            for c in data.chunks_exact(2) {
                let b = u16::from_le_bytes([c[0], c[1]]);
                if b & 0x7f80 == 0x7f80 {
                    return Err(classify(b & 0x007f != 0));
                }
            }
        }
        GgmlType::Q8_K => {
            for block in data.chunks_exact(ty.type_size()) {
                let d = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
                if !d.is_finite() {
                    return Err(BadData::BlockScale);
                }
            }
        }
        _ => {
            let at = f16_scales(ty);
            for block in data.chunks_exact(ty.type_size()) {
                if at.iter().any(|&o| !f16_finite(block[o], block[o + 1])) {
                    return Err(BadData::BlockScale);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_and_block_scales_are_checked() {
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(check_data(GgmlType::F32, &f32s(&[1.0, -2.0])), Ok(()));
        assert_eq!(
            check_data(GgmlType::F32, &f32s(&[1.0, f32::NAN])),
            Err(BadData::Nan)
        );
        assert_eq!(
            check_data(GgmlType::F32, &f32s(&[f32::NEG_INFINITY])),
            Err(BadData::Inf)
        );
        let f16 = |x: f32| half::f16::from_f32(x).to_le_bytes();
        assert_eq!(check_data(GgmlType::F16, &f16(0.5)), Ok(()));
        assert_eq!(check_data(GgmlType::F16, &f16(f32::NAN)), Err(BadData::Nan));
        assert_eq!(
            check_data(GgmlType::F16, &f16(f32::INFINITY)),
            Err(BadData::Inf)
        );
        let bf16 = |x: f32| half::bf16::from_f32(x).to_le_bytes();
        assert_eq!(check_data(GgmlType::BF16, &bf16(3.0)), Ok(()));
        assert_eq!(
            check_data(GgmlType::BF16, &bf16(f32::NAN)),
            Err(BadData::Nan)
        );
        // Every quantized type: a zero block is fine, a NaN at each scale is found.
        for ty in GgmlType::ALL.into_iter().filter(|t| t.is_quantized()) {
            let blocks = vec![0u8; ty.type_size() * 3];
            assert_eq!(check_data(ty, &blocks), Ok(()), "{ty:?}");
            let offsets: Vec<usize> = if ty == GgmlType::Q8_K {
                vec![0]
            } else {
                f16_scales(ty).to_vec()
            };
            for o in offsets {
                let mut b = blocks.clone();
                let at = ty.type_size() + o;
                if ty == GgmlType::Q8_K {
                    b[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
                } else {
                    b[at..at + 2].copy_from_slice(&f16(f32::INFINITY));
                }
                assert_eq!(check_data(ty, &b), Err(BadData::BlockScale), "{ty:?} @ {o}");
            }
        }
    }
}
