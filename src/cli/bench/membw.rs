//! `refusion bench --membw`: what this machine's cores can read from memory per second, the
//! anchor a one-token forward (which reads every weight once) is set against.
//!
//! Written here because the anchor must read the way a kernel can: numpy's reductions
//! (`benches/membw.py`) read below what both llama.cpp and refusion reach on the Zen 4 VM, and
//! STREAM's copy mixes writes in. Each way of reading is timed over a buffer far larger than the
//! last-level cache, split over the same worker pool the kernels use (`-t`):
//! - `sse2` (`neon` on ARM): 128-bit loads, one stream per thread (what a plain loop compiles to);
//! - `avx2`, `avx512`: 256- and 512-bit loads, one stream per thread;
//! - `x4`: the widest loads, four streams per thread (four places in its share, in turn);
//! - `prefetch`: the widest loads with the kernels' software prefetch, 4 KiB ahead;
//! - `nt`: non-temporal loads (`vmovntdqa`), the widest available.
//!
//! The anchor is the best of them (the median of its rounds).

use std::time::Instant;

use anyhow::Result;

/// One way of reading, and its bandwidth.
pub struct Stream {
    pub name: &'static str,
    /// Median over the rounds, and the rounds' range, in GB/s (10^9 bytes).
    pub gbps: f64,
    pub low: f64,
    pub high: f64,
}

/// The buffer read: 1 GiB, 32x the largest last-level cache of the machines measured.
const BYTES: usize = 1 << 30;
/// Slices handed to the pool (each read whole by one thread).
const SLICES: usize = 256;

/// A way of reading: xor-folds the whole slice into one word.
///
/// Unsafe to call: the caller must ensure the CPU has the reader's target features (`ways`
/// lists only those it detected) and that the slice starts on a 64-byte boundary (the vector
/// readers use aligned loads).
type ReadFn = unsafe fn(&[u8]) -> u64;

/// The ways of reading this CPU can run.
fn ways() -> Vec<(&'static str, ReadFn)> {
    // 128-bit loads: SSE2 on x86_64, NEON on aarch64.
    let narrow: (&'static str, ReadFn) = if cfg!(target_arch = "aarch64") {
        ("neon", read_narrow)
    } else {
        ("sse2", read_narrow)
    };
    #[cfg(target_arch = "x86_64")]
    return x86::ways(narrow);
    #[cfg(not(target_arch = "x86_64"))]
    vec![narrow]
}

/// Times every way over `rounds` rounds, interleaved (each round reads once with every way, so
/// a machine whose speed drifts moves them all alike).
pub fn measure(rounds: usize) -> Result<Vec<Stream>> {
    // Page-aligned (the non-temporal loads need 32- or 64-byte alignment).
    let mut buf = memmap2::MmapMut::map_anon(BYTES)
        .map_err(|e| anyhow::anyhow!("--membw needs 1 GiB of memory for its buffer: {e}"))?;
    // Written, so every page is real (an untouched page reads the shared zero page, from cache).
    buf.fill(0x5a);
    let buf: &[u8] = &buf;
    let ways = ways();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
    let pool = refusion_engine::model::pool::WorkerPool::global();
    for round in 0..=rounds {
        for (w, &(_, read)) in ways.iter().enumerate() {
            let slice = BYTES / SLICES;
            let sink = std::sync::atomic::AtomicU64::new(0);
            let t = Instant::now();
            pool.execute_chunked(SLICES, |range| {
                for s in range {
                    // SAFETY: the CPU runs `read`'s instructions (`ways` checked), and every
                    // slice starts on a 64-byte boundary (the map is page-aligned, a slice is
                    // 4 MiB).
                    let x = unsafe { read(&buf[s * slice..(s + 1) * slice]) };
                    sink.fetch_xor(x, std::sync::atomic::Ordering::Relaxed);
                }
            });
            let dt = t.elapsed().as_secs_f64();
            std::hint::black_box(sink.into_inner());
            if round > 0 {
                times[w].push(dt);
            }
        }
    }
    Ok(ways
        .iter()
        .zip(times)
        .map(|(&(name, _), mut t)| {
            t.sort_by(f64::total_cmp);
            let rate = |dt: f64| BYTES as f64 / dt / 1e9;
            Stream {
                name,
                gbps: rate(t[t.len() / 2]),
                low: rate(t[t.len() - 1]),
                high: rate(t[0]),
            }
        })
        .collect())
}

/// 128-bit reads (SSE2 on x86_64, NEON on aarch64: the compiler's plain vector loop).
///
/// # Safety
///
/// None: any slice is fine, and SSE2 and NEON are baseline on their targets. The fn is
/// `unsafe` only to have the type [`ReadFn`] shared with the vector readers.
unsafe fn read_narrow(s: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    for c in s.chunks_exact(64) {
        for (a, w) in acc.iter_mut().zip(c.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            *a ^= u64::from_ne_bytes(b);
        }
    }
    acc.iter().fold(0, |x, y| x ^ y)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    type ReadFn = super::ReadFn;

    /// `narrow`, then the wider ways this CPU runs.
    pub(super) fn ways(narrow: (&'static str, ReadFn)) -> Vec<(&'static str, ReadFn)> {
        let mut v = vec![narrow];
        let avx2 = std::arch::is_x86_feature_detected!("avx2");
        if avx2 {
            v.push(("avx2", read256::<1, false, false> as ReadFn));
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            v.push(("avx512", read512::<1, false, false>));
            v.push(("x4", read512::<4, false, false>));
            v.push(("prefetch", read512::<1, true, false>));
            v.push(("nt", read512::<1, false, true>));
        } else if avx2 {
            v.push(("x4", read256::<4, false, false>));
            v.push(("prefetch", read256::<1, true, false>));
            v.push(("nt", read256::<1, false, true>));
        }
        v
    }

    /// How far ahead `prefetch` asks for lines.
    const AHEAD: usize = 4096;

    /// A reader of one vector width: `STREAMS` places in the slice read in turn, 4 vectors at
    /// a time each, with the software prefetch (`PF`) or non-temporal loads (`NT`); the
    /// vectors are xor-folded into the result so no load is dropped.
    macro_rules! reader {
        ($name:ident, $feat:literal, $vec:ty, $load:ident, $load_nt:ident, $xor:ident, $zero:ident, $fold:ident) => {
            /// # Safety
            ///
            /// The CPU has the target feature enabled below (AVX2 for `read256`, AVX-512F for
            /// `read512`), and `s.as_ptr()` is aligned to the vector's size (32 or 64 bytes):
            /// the loads are aligned ones, at multiples of the vector's size from the start.
            #[target_feature(enable = $feat)]
            unsafe fn $name<const STREAMS: usize, const PF: bool, const NT: bool>(s: &[u8]) -> u64 {
                const W: usize = std::mem::size_of::<$vec>();
                const UNROLL: usize = 4;
                let step = W * UNROLL;
                let part = s.len() / STREAMS / step * step;
                let mut acc = [[$zero(); UNROLL]; STREAMS];
                let mut off = 0;
                while off < part {
                    for (k, a) in acc.iter_mut().enumerate() {
                        // SAFETY: in bounds, `k * part + off < STREAMS * part <= s.len()`.
                        let p = unsafe { s.as_ptr().add(k * part + off) };
                        if PF {
                            for line in (0..step).step_by(64) {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    p.wrapping_add(AHEAD + line) as *const i8
                                );
                            }
                        }
                        for (u, v) in a.iter_mut().enumerate() {
                            // SAFETY: in bounds, `off + step <= part` and `u * W < step`.
                            let at = unsafe { p.add(u * W) } as *const $vec;
                            // SAFETY: `at..at + W` lies in `s` (as above) and is aligned to `W`
                            // (`s` is, by the caller, and `part`, `off` and `u * W` are multiples
                            // of `W`); the CPU has the loads' feature (the caller guarantees
                            // `$feat`, which implies theirs).
                            let x = unsafe {
                                if NT {
                                    $load_nt(at)
                                } else {
                                    $load(at)
                                }
                            };
                            *v = $xor(*v, x);
                        }
                    }
                    off += step;
                }
                let mut x = $zero();
                for a in acc.iter().flatten() {
                    x = $xor(x, *a);
                }
                // SAFETY: the caller guarantees `$feat`, the feature `$fold` needs.
                unsafe { $fold(x) }
            }
        };
    }

    // The helpers below are `#[inline(always)]` (which `#[target_feature]` does not allow), so
    // they inherit their callers' features; they state the ones they need.

    /// # Safety
    ///
    /// The CPU has AVX (AVX2 in `read256`, which implies it).
    #[inline(always)]
    unsafe fn fold256(x: __m256i) -> u64 {
        // SAFETY: the caller guarantees AVX.
        unsafe {
            // Every lane, so no load can be narrowed to the lanes used.
            (_mm256_extract_epi64::<0>(x)
                ^ _mm256_extract_epi64::<1>(x)
                ^ _mm256_extract_epi64::<2>(x)
                ^ _mm256_extract_epi64::<3>(x)) as u64
        }
    }
    /// # Safety
    ///
    /// The CPU has AVX-512F.
    #[inline(always)]
    unsafe fn fold512(x: __m512i) -> u64 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_reduce_or_epi64(x) as u64 }
    }
    /// # Safety
    ///
    /// `p` is valid for reading 32 bytes and aligned to 32; the CPU has AVX.
    #[inline(always)]
    unsafe fn load256(p: *const __m256i) -> __m256i {
        // SAFETY: the caller guarantees the pointer and AVX.
        unsafe { _mm256_load_si256(p) }
    }
    /// # Safety
    ///
    /// `p` is valid for reading 32 bytes and aligned to 32; the CPU has AVX2.
    #[inline(always)]
    unsafe fn load256_nt(p: *const __m256i) -> __m256i {
        // SAFETY: the caller guarantees the pointer and AVX2.
        unsafe { _mm256_stream_load_si256(p) }
    }
    /// # Safety
    ///
    /// `p` is valid for reading 64 bytes and aligned to 64; the CPU has AVX-512F.
    #[inline(always)]
    unsafe fn load512(p: *const __m512i) -> __m512i {
        // SAFETY: the caller guarantees the pointer and AVX-512F.
        unsafe { _mm512_load_si512(p as *const _) }
    }
    /// # Safety
    ///
    /// `p` is valid for reading 64 bytes and aligned to 64; the CPU has AVX-512F.
    #[inline(always)]
    unsafe fn load512_nt(p: *const __m512i) -> __m512i {
        // SAFETY: the caller guarantees the pointer and AVX-512F.
        unsafe { _mm512_stream_load_si512(p as *const _) }
    }

    reader!(
        read256,
        "avx2",
        __m256i,
        load256,
        load256_nt,
        _mm256_xor_si256,
        _mm256_setzero_si256,
        fold256
    );
    reader!(
        read512,
        "avx512f",
        __m512i,
        load512,
        load512_nt,
        _mm512_xor_si512,
        _mm512_setzero_si512,
        fold512
    );
}
