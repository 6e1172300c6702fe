//! The cache in one of GGUF's block types (bf16, q8_0, q4_0, q4_1, q5_0, q5_1), as llama.cpp's
//! `-ctk`/`-ctv` name them: each row encoded and decoded by the format's own codecs
//! (`refusion_gguf::quant`, the converter's), so a q8_0 entry holds exactly the bytes a q8_0
//! tensor row would. Attention reads a row back as f32, one row at a time, never the whole
//! cache. The CPU only: no GPU path yet (refused by name when layers are offloaded).

use candle_core::DType;
use refusion_gguf::quant::{dequantize, quantize_row};
use refusion_gguf::GgmlType;

use super::KvKind;

/// One GGUF block type as a KV cache element type; its header code is the type's GGML id.
pub struct Blocks {
    ty: GgmlType,
    name: &'static str,
}

pub static BF16: Blocks = Blocks::new(GgmlType::BF16, "bf16");
pub static Q8_0: Blocks = Blocks::new(GgmlType::Q8_0, "q8_0");
pub static Q5_1: Blocks = Blocks::new(GgmlType::Q5_1, "q5_1");
pub static Q5_0: Blocks = Blocks::new(GgmlType::Q5_0, "q5_0");
pub static Q4_1: Blocks = Blocks::new(GgmlType::Q4_1, "q4_1");
pub static Q4_0: Blocks = Blocks::new(GgmlType::Q4_0, "q4_0");

impl Blocks {
    const fn new(ty: GgmlType, name: &'static str) -> Blocks {
        Blocks { ty, name }
    }
}

impl KvKind for Blocks {
    fn name(&self) -> &'static str {
        self.name
    }
    fn code(&self) -> u32 {
        self.ty.id()
    }
    fn block_len(&self) -> usize {
        self.ty.block_size()
    }
    fn row_bytes(&self, n: usize) -> usize {
        n / self.ty.block_size() * self.ty.type_size()
    }
    fn dtype(&self) -> Option<DType> {
        None
    }
    fn write_row(&self, src: &[f32], dst: &mut [u8]) {
        quantize_row(self.ty, src, dst);
    }
    fn read_row(&self, src: &[u8], buf: &mut [f32]) {
        // Every type here decodes (only the activation types Q8_1/Q8_K do not).
        let decoded = dequantize(self.ty, src, buf);
        debug_assert!(decoded, "{} rows decode", self.name);
    }
}
