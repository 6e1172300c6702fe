//! f16 entries: half the bytes, each value rounded to the nearest f16 when written.

use candle_core::DType;
use half::f16;

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
    /// Eight values at a time with F16C where the CPU has it (the same values as one at a
    /// time: a conversion is exact).
    fn read_row(&self, src: &[u8], buf: &mut [f32]) {
        self.read_rows(src, src.len(), &[0], buf)
    }
    /// Every row through one F16C loop (half's slice conversion calls a function per eight
    /// values and checks the CPU per row: at one token over a deep cache, over half of
    /// attention's time).
    fn read_rows(&self, src: &[u8], row_bytes: usize, slots: &[usize], buf: &mut [f32]) {
        let n = buf.len() / slots.len().max(1);
        if n == 0 {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            for &slot in slots {
                assert!((slot + 1) * row_bytes <= src.len() && 2 * n <= row_bytes);
            }
            // SAFETY: AVX2 and F16C checked just above; every row read lies in `src` and holds
            // `n` f16 values (asserted), and `buf` holds `slots.len()` rows of `n`.
            return unsafe { read_rows_f16c(src, row_bytes, slots, n, buf) };
        }
        for (&slot, out) in slots.iter().zip(buf.chunks_exact_mut(n)) {
            let row = &src[slot * row_bytes..slot * row_bytes + 2 * n];
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_ne_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}

/// [`F16::read_rows`] with F16C: eight values a conversion, the tail one at a time.
///
/// # Safety
///
/// The CPU has AVX2 and F16C; `(slot + 1) * row_bytes <= src.len()` for every slot and
/// `2 * n <= row_bytes`; `buf` holds at least `slots.len() * n` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn read_rows_f16c(src: &[u8], row_bytes: usize, slots: &[usize], n: usize, buf: &mut [f32]) {
    use std::arch::x86_64::*;
    let n8 = n / 8 * 8;
    for (&slot, out) in slots.iter().zip(buf.chunks_exact_mut(n)) {
        let row = &src[slot * row_bytes..slot * row_bytes + 2 * n];
        let mut d = 0;
        while d < n8 {
            // SAFETY: `d + 8 <= n`: 16 bytes at `2 * d` lie in `row`, 8 values at `d` in `out`.
            unsafe {
                let h = _mm_loadu_si128(row.as_ptr().add(2 * d) as *const __m128i);
                _mm256_storeu_ps(out.as_mut_ptr().add(d), _mm256_cvtph_ps(h));
            }
            d += 8;
        }
        for (o, b) in out[n8..].iter_mut().zip(row[2 * n8..].chunks_exact(2)) {
            *o = f16::from_ne_bytes([b[0], b[1]]).to_f32();
        }
    }
}
