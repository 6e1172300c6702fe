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
    /// Attention reads every visible row of a quantized cache through here, so the common
    /// types decode here in loops the compiler widens to the CPU's vectors (the format's own
    /// decoder is compiled for the baseline CPU): the same operation on each value, so the
    /// same floats.
    fn read_row(&self, src: &[u8], buf: &mut [f32]) {
        match self.ty {
            GgmlType::BF16 => {
                let n = buf.len().min(src.len() / 2);
                read_rows_bf16(src, src.len(), &[0], &mut buf[..n])
            }
            GgmlType::Q8_0 => widened(decode_q8_0, src, buf),
            GgmlType::Q4_0 => widened(decode_q4_0, src, buf),
            _ => {
                // Every type here decodes (only the activation types Q8_1/Q8_K do not).
                let decoded = dequantize(self.ty, src, buf);
                debug_assert!(decoded, "{} rows decode", self.name);
            }
        }
    }
    /// A tile of rows in one widened loop (one CPU check, the decoder inlined).
    fn read_rows(&self, src: &[u8], row_bytes: usize, slots: &[usize], buf: &mut [f32]) {
        match self.ty {
            GgmlType::BF16 => read_rows_bf16(src, row_bytes, slots, buf),
            GgmlType::Q8_0 => widened_rows(decode_q8_0, src, row_bytes, slots, buf),
            GgmlType::Q4_0 => widened_rows(decode_q4_0, src, row_bytes, slots, buf),
            _ => {
                let n = buf.len() / slots.len().max(1);
                if n == 0 {
                    return;
                }
                for (&slot, out) in slots.iter().zip(buf.chunks_exact_mut(n)) {
                    self.read_row(&src[slot * row_bytes..(slot + 1) * row_bytes], out);
                }
            }
        }
    }
}

/// `f` over rows `slots` of `src` into consecutive rows of `buf`, compiled for AVX2 where the
/// CPU has it (one check a call).
#[inline(always)]
fn widened_rows<F: Fn(&[u8], &mut [f32]) + Copy>(
    f: F,
    src: &[u8],
    row_bytes: usize,
    slots: &[usize],
    buf: &mut [f32],
) {
    let n = buf.len() / slots.len().max(1);
    if n == 0 {
        return;
    }
    let each = |buf: &mut [f32]| {
        for (&slot, out) in slots.iter().zip(buf.chunks_exact_mut(n)) {
            f(&src[slot * row_bytes..(slot + 1) * row_bytes], out);
        }
    };
    widened(|_, buf| each(buf), &[], buf)
}

/// `f` compiled for AVX2 where the CPU has it (the same code, inlined: only wider vectors).
#[inline(always)]
fn widened<F: Fn(&[u8], &mut [f32])>(f: F, src: &[u8], buf: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        /// # Safety
        ///
        /// The CPU has AVX2.
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<F: Fn(&[u8], &mut [f32])>(f: F, src: &[u8], buf: &mut [f32]) {
            f(src, buf)
        }
        // SAFETY: AVX2 checked just above.
        return unsafe { avx2(f, src, buf) };
    }
    f(src, buf)
}

/// bf16 rows `slots` of `src` into consecutive rows of `buf`: with AVX2 eight values a widening
/// (the compiler's loop over byte pairs stayed scalar: at one token over 4,096 entries, 29% of
/// the forward on the Zen 3 VM), else [`decode_bf16`]; the same bits either way.
fn read_rows_bf16(src: &[u8], row_bytes: usize, slots: &[usize], buf: &mut [f32]) {
    let n = buf.len() / slots.len().max(1);
    if n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        for &slot in slots {
            assert!((slot + 1) * row_bytes <= src.len() && 2 * n <= row_bytes);
        }
        // SAFETY: AVX2 checked just above; every row read lies in `src` and holds `n` values
        // (asserted), and `buf` holds `slots.len()` rows of `n`.
        return unsafe { read_rows_bf16_avx2(src, row_bytes, slots, n, buf) };
    }
    for (&slot, out) in slots.iter().zip(buf.chunks_exact_mut(n)) {
        decode_bf16(&src[slot * row_bytes..][..2 * n], out);
    }
}

/// [`read_rows_bf16`] with AVX2: eight bf16 values zero-extended to 32 bits and shifted into
/// the high half, the tail one at a time.
///
/// # Safety
///
/// The CPU has AVX2; `(slot + 1) * row_bytes <= src.len()` for every slot and `2 * n <=
/// row_bytes`; `buf` holds at least `slots.len() * n` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_rows_bf16_avx2(
    src: &[u8],
    row_bytes: usize,
    slots: &[usize],
    n: usize,
    buf: &mut [f32],
) {
    use std::arch::x86_64::*;
    let n8 = n / 8 * 8;
    for (&slot, out) in slots.iter().zip(buf.chunks_exact_mut(n)) {
        let row = &src[slot * row_bytes..][..2 * n];
        let mut d = 0;
        while d < n8 {
            // SAFETY: `d + 8 <= n`: 16 bytes at `2 * d` lie in `row`, 8 values at `d` in `out`.
            unsafe {
                let h = _mm_loadu_si128(row.as_ptr().add(2 * d) as *const __m128i);
                let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                _mm256_storeu_ps(out.as_mut_ptr().add(d), _mm256_castsi256_ps(w));
            }
            d += 8;
        }
        decode_bf16(&row[2 * n8..], &mut out[n8..]);
    }
}

#[inline(always)]
fn decode_bf16(src: &[u8], buf: &mut [f32]) {
    for (o, b) in buf.iter_mut().zip(src.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

/// A q8_0 block: an f16 scale, then 32 signed bytes; each value `q * d`.
#[inline(always)]
fn decode_q8_0(src: &[u8], buf: &mut [f32]) {
    for (b, o) in src.chunks_exact(34).zip(buf.chunks_exact_mut(32)) {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        for (v, &q) in o.iter_mut().zip(&b[2..34]) {
            *v = q as i8 as f32 * d;
        }
    }
}

/// A q4_0 block: an f16 scale, then 16 bytes of two 4-bit values (the low nibbles the first
/// 16 values, the high ones the last 16); each value `(q - 8) * d`.
#[inline(always)]
fn decode_q4_0(src: &[u8], buf: &mut [f32]) {
    for (b, o) in src.chunks_exact(18).zip(buf.chunks_exact_mut(32)) {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let (lo, hi) = o.split_at_mut(16);
        for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..18]) {
            *l = ((q & 0xF) as i32 - 8) as f32 * d;
            *h = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The widened decoders give the format's own decoder's values, bit for bit.
    #[test]
    fn fast_decoders_are_the_formats_own() {
        let row: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.3) * 0.173)
            .collect();
        for b in [&BF16, &Q8_0, &Q4_0] {
            let mut bytes = vec![0u8; b.row_bytes(row.len())];
            b.write_row(&row, &mut bytes);
            let (mut fast, mut own) = (vec![0f32; row.len()], vec![1f32; row.len()]);
            b.read_row(&bytes, &mut fast);
            assert!(dequantize(b.ty, &bytes, &mut own));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&own), "{}", b.name);
        }
    }

    /// A tile of bf16 rows (20 values: two vectors and a tail) read out of order, each row the
    /// format's own decoder's values.
    #[test]
    fn bf16_rows_read_as_a_tile_are_the_formats_own() {
        let n = 20;
        let rows: Vec<Vec<f32>> = (0..5)
            .map(|r| (0..n).map(|i| (r * n + i) as f32 * -0.37 + 1e-3).collect())
            .collect();
        let row_bytes = BF16.row_bytes(n);
        let mut src = vec![0u8; rows.len() * row_bytes];
        for (row, dst) in rows.iter().zip(src.chunks_exact_mut(row_bytes)) {
            BF16.write_row(row, dst);
        }
        let slots = [3, 0, 4];
        let mut tile = vec![0f32; slots.len() * n];
        BF16.read_rows(&src, row_bytes, &slots, &mut tile);
        for (&slot, got) in slots.iter().zip(tile.chunks_exact(n)) {
            let mut own = vec![0f32; n];
            assert!(dequantize(
                GgmlType::BF16,
                &src[slot * row_bytes..][..row_bytes],
                &mut own
            ));
            assert!(got
                .iter()
                .zip(&own)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
