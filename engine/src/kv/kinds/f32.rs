//! f32 entries: the exact cache, read in place by attention.

use candle_core::DType;

use super::KvKind;

pub struct F32;

impl KvKind for F32 {
    fn name(&self) -> &'static str {
        "f32"
    }
    fn code(&self) -> u32 {
        0
    }
    fn block_len(&self) -> usize {
        1
    }
    fn row_bytes(&self, n: usize) -> usize {
        4 * n
    }
    fn dtype(&self) -> Option<DType> {
        Some(DType::F32)
    }
    fn write_row(&self, src: &[f32], dst: &mut [u8]) {
        match bytemuck::try_cast_slice_mut::<u8, f32>(dst) {
            Ok(d) => d.copy_from_slice(src),
            Err(_) => {
                for (d, x) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&x.to_ne_bytes());
                }
            }
        }
    }
    fn read_row(&self, src: &[u8], buf: &mut [f32]) {
        for (o, b) in buf.iter_mut().zip(src.chunks_exact(4)) {
            *o = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    fn as_f32<'a>(&self, src: &'a [u8]) -> Option<&'a [f32]> {
        bytemuck::try_cast_slice(src).ok()
    }
}
