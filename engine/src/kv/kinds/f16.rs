//! f16 entries: half the bytes, each value rounded to the nearest f16 when written.

use candle_core::DType;
use half::f16;
use half::slice::HalfFloatSliceExt;

use super::KvKind;

pub struct F16;

impl KvKind for F16 {
    fn name(&self) -> &'static str {
        "f16"
    }
    fn code(&self) -> u32 {
        1
    }
    fn block_len(&self) -> usize {
        1
    }
    fn row_bytes(&self, n: usize) -> usize {
        2 * n
    }
    fn dtype(&self) -> Option<DType> {
        Some(DType::F16)
    }
    fn write_row(&self, src: &[f32], dst: &mut [u8]) {
        for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
            d.copy_from_slice(&f16::from_f32(x).to_ne_bytes());
        }
    }
    /// Eight values at a time with F16C where the CPU has it (half's slice conversion, the
    /// same values as one at a time: a conversion is exact).
    fn read_row(&self, src: &[u8], buf: &mut [f32]) {
        match bytemuck::try_cast_slice::<u8, f16>(src) {
            Ok(row) => row.convert_to_f32_slice(buf),
            Err(_) => {
                for (o, b) in buf.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f16::from_ne_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }
}
