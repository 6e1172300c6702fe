//! Quantized CPU weights read in place from the GGUF map, as candle's quantized storage.
//!
//! candle copies a weight into its own `Vec` of blocks, and its x86 kernels then build a
//! repacked copy of Q4_K/Q6_K/Q8_0 weights on top: two copies in anonymous memory. Here the
//! storage is the map itself: candle packs from it at load (see `qwen3::prepack`), the pages read
//! for that are then released, and whatever still reads the original blocks (types and shapes
//! without a packed kernel, Q6_K's one-row product) faults them back in from the page cache.
//! Resident memory is the packed copies plus the pages in use, and nothing is copied at load.

use std::sync::Arc;

use candle_core::quantized::k_quants::{
    self, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1,
    BlockQ6K, BlockQ8_0, GgmlType,
};
use candle_core::quantized::{GgmlDType, QStorage, QuantizedType};
use candle_core::{CpuStorage, Result};
use half::f16;
use refusion_gguf::{GgufFile, TensorInfo};

/// The blocks of one tensor, in the map of `file`.
struct MappedBlocks<T> {
    /// Keeps the map (and so `ptr`) alive.
    _file: Arc<GgufFile>,
    ptr: *const T,
    len: usize,
}

// SAFETY: the blocks are immutable bytes of a read-only map that lives as long as `_file`;
// sharing them between threads is sharing `&[T]` with `T: Sync`.
unsafe impl<T: Sync> Send for MappedBlocks<T> {}
unsafe impl<T: Sync> Sync for MappedBlocks<T> {}

impl<T: GgmlType> MappedBlocks<T> {
    fn blocks(&self) -> &[T] {
        // SAFETY: `ptr` is aligned for `T` and addresses `len` blocks inside the live map
        // (checked in `mapped_storage`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: GgmlType + 'static> QuantizedType for MappedBlocks<T> {
    fn dtype(&self) -> GgmlDType {
        T::DTYPE
    }

    fn matmul_t(&self, mkn: (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) -> Result<()> {
        k_quants::matmul(mkn, lhs, self.blocks(), dst)
    }

    fn matmul_t_f16(&self, mkn: (usize, usize, usize), lhs: &[f16], dst: &mut [f16]) -> Result<()> {
        k_quants::matmul_f16(mkn, lhs, self.blocks(), dst)
    }

    fn embedding(&self, ids: &[u32], rows: usize, hidden: usize) -> Result<CpuStorage> {
        let per_row = hidden / T::BLCK_SIZE;
        if !hidden.is_multiple_of(T::BLCK_SIZE) || per_row * rows != self.len {
            candle_core::bail!("embedding of {rows}x{hidden} over {} blocks", self.len)
        }
        let mut out = vec![0f32; ids.len() * hidden];
        for (i, &id) in ids.iter().enumerate() {
            let r = id as usize;
            if r >= rows {
                candle_core::bail!("embedding id {r} is out of range for {rows} rows")
            }
            T::to_float(
                &self.blocks()[r * per_row..(r + 1) * per_row],
                &mut out[i * hidden..(i + 1) * hidden],
            );
        }
        Ok(CpuStorage::F32(out))
    }

    fn dequantize(&self, elem_count: usize) -> Result<CpuStorage> {
        let mut out = vec![0f32; elem_count];
        T::to_float(self.blocks(), &mut out);
        Ok(CpuStorage::F32(out))
    }

    fn storage_size_in_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    fn as_ptr(&self) -> *const u8 {
        self.ptr as *const u8
    }

    fn block_size(&self) -> usize {
        T::BLCK_SIZE
    }

    fn from_float(&mut self, _xs: &[f32]) {
        // Only candle's quantize-from-f32 constructors write storage; weights read from a
        // file are never built that way.
        unreachable!("weights mapped from a GGUF file are read-only")
    }

    fn from_float_imatrix(&mut self, _xs: &[f32], _w: &[f32], _n_per_row: usize) {
        unreachable!("weights mapped from a GGUF file are read-only")
    }

    fn size(&self) -> usize {
        self.storage_size_in_bytes()
    }
}

fn blocks_of<T: GgmlType + 'static>(file: &Arc<GgufFile>, t: &TensorInfo) -> Option<QStorage> {
    let data = file.tensor_data(t);
    let size = std::mem::size_of::<T>();
    if !data.len().is_multiple_of(size)
        || !(data.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        return None;
    }
    Some(QStorage::Cpu(Box::new(MappedBlocks::<T> {
        _file: file.clone(),
        ptr: data.as_ptr() as *const T,
        len: data.len() / size,
    })))
}

/// The tensor's blocks as candle CPU storage over the map, for the quantized types candle
/// multiplies; `None` for others (or data that is not aligned for the block type).
pub fn mapped_storage(file: &Arc<GgufFile>, t: &TensorInfo, dtype: GgmlDType) -> Option<QStorage> {
    match dtype {
        GgmlDType::Q4_0 => blocks_of::<BlockQ4_0>(file, t),
        GgmlDType::Q4_1 => blocks_of::<BlockQ4_1>(file, t),
        GgmlDType::Q5_0 => blocks_of::<BlockQ5_0>(file, t),
        GgmlDType::Q5_1 => blocks_of::<BlockQ5_1>(file, t),
        GgmlDType::Q8_0 => blocks_of::<BlockQ8_0>(file, t),
        GgmlDType::Q2K => blocks_of::<BlockQ2K>(file, t),
        GgmlDType::Q3K => blocks_of::<BlockQ3K>(file, t),
        GgmlDType::Q4K => blocks_of::<BlockQ4K>(file, t),
        GgmlDType::Q5K => blocks_of::<BlockQ5K>(file, t),
        GgmlDType::Q6K => blocks_of::<BlockQ6K>(file, t),
        _ => None,
    }
}
