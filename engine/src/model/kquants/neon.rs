//! The packed kernels on aarch64 NEON (Apple Silicon, Graviton, Snapdragon, Raspberry Pi):
//! the x86 kernels' tiles, a 64-byte line read as four quarters of 4 rows (16 bytes: four
//! values of each row).
//!
//! With the `dotprod` extension (ARMv8.2+, every Apple and Graviton 2+ core), one `sdot`
//! multiplies a quarter by a group of four activations picked by lane from a 16-byte load and
//! adds each row's four products into its i32 lane. Without it, `smull`/`smull2` give the
//! i16 products (at most 128 x 127 in magnitude), `addp` adds neighbours (below 32767), and
//! `sadalp` adds each row's pairs into its i32 lane. Weights are signed bytes here (Q4_K to
//! Q6_K's values are below 64, Q8_0's are i8), so no offset is needed.
//!
//! The integer sums are exact, and the float operations are the x86 kernels' (the same
//! fused multiply-adds in the same order), so NEON gives the same floats to the bit.
//!
//! `sdot` by element and the f16 widening `fcvtl` are written as inline assembly: their
//! intrinsics are not stable Rust yet (`stdarch_neon_dotprod`, `stdarch_neon_f16`).

// The kernels index several register arrays (sums, accumulators, quarters) by the same counters.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;
use std::arch::asm;

use super::tiles::{Packed, Q4K_D, Q4K_DMIN, Q4K_MINS, Q4K_SCALES, Q6K_D, Q6K_SCALES, Q8_0_D};
use super::{PackedMatrix, PREFETCH_TILES, Q8K, QK, ROWS_PER_UNIT};

/// Activation rows per pass over a run's tiles.
const TILE_MT: usize = 4;

/// Adds each row's four products `w · a[lane]` into its i32 lane.
trait Dot {
    /// # Safety
    ///
    /// The CPU has the instructions the implementation uses: `dotprod`'s `sdot` for [`SDot`];
    /// base NEON, which every aarch64 CPU has, for [`Widen`]. `LANE` is 0 to 3.
    unsafe fn dot<const LANE: i32>(sum: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t;
}

/// With `sdot` (the `dotprod` extension; only instantiated under `run_dot`).
struct SDot;

impl Dot for SDot {
    /// # Safety
    ///
    /// The CPU has the `dotprod` extension.
    #[inline(always)]
    unsafe fn dot<const LANE: i32>(mut sum: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
        // SAFETY: the caller guarantees `dotprod`; the instruction touches registers only.
        unsafe {
            asm!(
                ".arch_extension dotprod",
                "sdot {s:v}.4s, {w:v}.16b, {a:v}.4b[{l}]",
                s = inout(vreg) sum,
                w = in(vreg) w,
                a = in(vreg) a,
                l = const LANE,
                options(pure, nomem, nostack, preserves_flags)
            );
            sum
        }
    }
}

/// With widening multiplies and pairwise adds (any ARMv8 NEON).
struct Widen;

impl Dot for Widen {
    /// # Safety
    ///
    /// None beyond base NEON, which every aarch64 CPU has (`LANE` is 0 to 3, checked at
    /// compile time).
    #[inline(always)]
    unsafe fn dot<const LANE: i32>(sum: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
        // SAFETY: base NEON, part of every aarch64 CPU (this `inline(always)` fn has no
        // `#[target_feature]` to list it).
        unsafe {
            let a = vreinterpretq_s8_s32(vdupq_laneq_s32::<LANE>(vreinterpretq_s32_s8(a)));
            let lo = vmull_s8(vget_low_s8(w), vget_low_s8(a));
            let hi = vmull_high_s8(w, a);
            vpadalq_s16(sum, vpaddq_s16(lo, hi))
        }
    }
}

/// `D::dot` with a lane chosen at run time (0..4; folded when the loops unroll).
///
/// # Safety
///
/// As [`Dot::dot`]: the CPU has `D`'s instructions.
#[inline(always)]
unsafe fn dot_lane<D: Dot>(sum: int32x4_t, w: int8x16_t, a: int8x16_t, lane: usize) -> int32x4_t {
    // SAFETY: the caller guarantees `D`'s instructions; the lane is 0 to 3.
    unsafe {
        match lane {
            0 => D::dot::<0>(sum, w, a),
            1 => D::dot::<1>(sum, w, a),
            2 => D::dot::<2>(sum, w, a),
            _ => D::dot::<3>(sum, w, a),
        }
    }
}

/// Four f16 at `p` as f32 (`fcvtl` is base NEON; only its intrinsic is unstable).
///
/// # Safety
///
/// `p` is valid for reading 8 bytes and 2-byte aligned (the tiles' f16 fields are).
#[inline(always)]
unsafe fn f16x4(p: *const u8) -> float32x4_t {
    // SAFETY: the caller guarantees the 8 bytes; `fcvtl` touches registers only.
    unsafe {
        let h = vld1_u16(p as *const u16);
        let out: float32x4_t;
        asm!(
            "fcvtl {o:v}.4s, {h:v}.4h",
            o = out(vreg) out,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
        out
    }
}

/// Four bytes at `p` (u8, or i8 when `SIGNED`) as f32.
///
/// # Safety
///
/// `p` is valid for reading 4 bytes (any alignment).
#[inline(always)]
unsafe fn bytes4<const SIGNED: bool>(p: *const u8) -> float32x4_t {
    // SAFETY: the caller guarantees the 4 bytes.
    unsafe {
        let v = vreinterpret_u8_u32(vdup_n_u32(std::ptr::read_unaligned(p as *const u32)));
        if SIGNED {
            vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(v)))))
        } else {
            vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(v))))
        }
    }
}

/// 16 bytes of line `line`, quarter `q`, of a tile.
///
/// # Safety
///
/// `q < 4`, and line `line` lies inside the tile at `tile` (valid for reading).
#[inline(always)]
unsafe fn quarter(tile: *const u8, line: usize, q: usize) -> uint8x16_t {
    // SAFETY: the 16 bytes at `64 * line + 16 * q` lie in the line (the caller).
    unsafe { vld1q_u8(tile.add(64 * line + 16 * q)) }
}

/// Sixteen activations at `at` (stored order).
///
/// # Safety
///
/// `at + 16 <= 256` (read unchecked).
#[inline(always)]
unsafe fn acts16(a: &Q8K, at: usize) -> int8x16_t {
    // SAFETY: `at + 16 <= 256 == a.qs.len()` (the caller).
    unsafe { vld1q_s8(a.qs.as_ptr().add(at)) }
}

/// Bit `e` of each byte moved to bit 4 (a Q5_K value's fifth bit), the others cleared.
///
/// # Safety
///
/// None beyond base NEON, which every aarch64 CPU has.
#[inline(always)]
unsafe fn fifth_bit(hb: uint8x16_t, e: usize) -> uint8x16_t {
    // SAFETY: base NEON, part of every aarch64 CPU.
    unsafe {
        let v = match e {
            0 => vshlq_n_u8::<4>(hb),
            1 => vshlq_n_u8::<3>(hb),
            2 => vshlq_n_u8::<2>(hb),
            3 => vshlq_n_u8::<1>(hb),
            4 => hb,
            5 => vshrq_n_u8::<1>(hb),
            6 => vshrq_n_u8::<2>(hb),
            _ => vshrq_n_u8::<3>(hb),
        };
        vandq_u8(v, vdupq_n_u8(0x10))
    }
}

/// Asks for part `part` of `parts` of the tile a few ahead (reads past a run's last tile are
/// harmless: prefetches never fault; `prfm`'s intrinsic is not stable Rust), one part per
/// quarter of the block's loop: the whole tile at once overflowed x86 cores' queues of
/// outstanding misses (see the x86 kernels' `prefetch_part`; not measured on ARM).
///
/// # Safety
///
/// None on the arguments: any `tile` is fine (the addresses are computed with wrapping
/// arithmetic, and `prfm` never faults).
#[inline(always)]
unsafe fn prefetch_part(tile: *const u8, tile_bytes: usize, part: usize, parts: usize) {
    let ahead = tile.wrapping_add(PREFETCH_TILES * tile_bytes);
    let per = tile_bytes.div_ceil(64 * parts);
    for line in part * per..(part + 1) * per {
        // SAFETY: a prefetch is a hint: it never faults, whatever the address.
        unsafe {
            asm!(
                "prfm pldl1keep, [{p}]",
                p = in(reg) ahead.wrapping_add(64 * line),
                options(readonly, nostack, preserves_flags)
            )
        };
    }
}

/// Run `run` of `w` against every activation row, into `out` (`m x w.rows`), with `sdot`.
///
/// # Safety
///
/// The CPU has the `dotprod` extension. (`acts`, `run` and `out`'s length are checked: a
/// panic.)
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn run_dot(
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    run: usize,
    out: &mut [f32],
) {
    // SAFETY: `dotprod` by the attribute, `SDot`'s instruction.
    unsafe { run_body::<SDot>(w, acts, m, run, out) }
}

/// As [`run_dot`], with base NEON's widening multiplies.
///
/// # Safety
///
/// None beyond base NEON, which every aarch64 CPU has (the fn is `unsafe` as [`run_dot`] is,
/// for [`super::run_unit`]'s match). (`acts`, `run` and `out`'s length are checked: a panic.)
#[target_feature(enable = "neon")]
pub(super) unsafe fn run_neon(
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    run: usize,
    out: &mut [f32],
) {
    // SAFETY: `Widen` needs base NEON only.
    unsafe { run_body::<Widen>(w, acts, m, run, out) }
}

/// Per activation row, the four quarters of 4 rows' sums.
type Res = [[float32x4_t; 4]; TILE_MT];

/// The kernels' driver: passes of up to [`TILE_MT`] activation rows over the run's tiles.
///
/// # Safety
///
/// The CPU has `D`'s instructions ([`Dot::dot`]). (`acts`, `run` and `out`'s length are
/// checked: a panic.)
#[inline(always)]
unsafe fn run_body<D: Dot>(w: &PackedMatrix, acts: &[Q8K], m: usize, run: usize, out: &mut [f32]) {
    let kb = w.k / QK;
    let r0 = run * ROWS_PER_UNIT;
    let valid = (w.rows - r0).min(ROWS_PER_UNIT);
    let tiles = w.run_tiles(run);
    let tile_bytes = w.kind.tile_bytes();
    let mut t0 = 0;
    while t0 < m {
        let mt = (m - t0).min(TILE_MT);
        let a = &acts[t0 * kb..(t0 + mt) * kb];
        // SAFETY: base NEON, part of every aarch64 CPU.
        let mut res: Res = [[unsafe { vdupq_n_f32(0.0) }; 4]; TILE_MT];
        macro_rules! kernel {
            ($($n:literal)*) => {
                match (w.kind, mt) {
                    $((Packed::Q4K, $n) =>
                        packed_q4k::<$n, D, false>(tiles, tile_bytes, a, kb, &mut res),
                      (Packed::Q5K, $n) =>
                        packed_q4k::<$n, D, true>(tiles, tile_bytes, a, kb, &mut res),
                      (Packed::Q6K, $n) =>
                        packed_q6k::<$n, D>(tiles, tile_bytes, a, kb, &mut res),
                      (Packed::Q8_0, $n) => packed_q8_0::<$n, D>(tiles, tile_bytes, a, kb, &mut res),)*
                    _ => unreachable!("mt is 1..=TILE_MT"),
                }
            };
        }
        // SAFETY: `D`'s instructions by the caller; the kernels get the run's `kb` whole tiles
        // of `w.kind`'s layout (`run_tiles`), `tile_bytes` apart, `mt * kb` blocks of
        // activations (`a`, sliced, checked), and `mt <= TILE_MT`.
        unsafe { kernel!(1 2 3 4) };
        for (t, v) in res[..mt].iter().enumerate() {
            let mut all = [0f32; ROWS_PER_UNIT];
            for (q, v) in v.iter().enumerate() {
                // SAFETY: `4 * q + 4 <= 16`, inside `all`.
                unsafe { vst1q_f32(all.as_mut_ptr().add(4 * q), *v) };
            }
            // The padded run: only its real rows.
            let o = &mut out[(t0 + t) * w.rows + r0..][..valid];
            o.copy_from_slice(&all[..valid]);
        }
        t0 += mt;
    }
}

/// 16 packed Q4_K rows (Q5_K when `FIVE`: fifth bits from lines 37..45) dotted with `N`
/// activation rows into `res`, quarter by quarter within each tile.
///
/// # Safety
///
/// The CPU has `D`'s instructions ([`Dot::dot`]); `tiles` holds `kb` whole Q4_K (Q5_K when
/// `FIVE`) tiles, `tile_bytes` apart, from a 2-byte aligned start (the f16 loads); `acts`
/// holds at least `N * kb` blocks (indexed, checked); `N <= TILE_MT`.
#[inline(always)]
unsafe fn packed_q4k<const N: usize, D: Dot, const FIVE: bool>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut Res,
) {
    // SAFETY: `D`'s instructions by the caller; tile `b` is `tile_bytes` bytes inside `tiles`, and
    // every quarter, scale and `d` read is inside it (the layout's fields, `tiles.rs`); every
    // `acts16` reads 16 activations at an offset of at most 240.
    unsafe {
        let nib = vdupq_n_u8(0x0f);
        for b in 0..kb {
            let tile = tiles.as_ptr().add(b * tile_bytes);
            for q in 0..4 {
                prefetch_part(tile, tile_bytes, q, 4);
                let d = f16x4(tile.add(Q4K_D + 8 * q));
                let dmin = f16x4(tile.add(Q4K_DMIN + 8 * q));
                let mut acc = [vdupq_n_f32(0.0); N];
                for c in 0..8 {
                    let hb = if FIVE {
                        quarter(tile, 37 + c, q)
                    } else {
                        vdupq_n_u8(0)
                    };
                    let mut isum = [vdupq_n_s32(0); N];
                    for j in 0..2 {
                        // Activations 32c + 16j.. cover lines 4c + 2j (lanes 0, 1) and 4c + 2j + 1.
                        let mut a = [vdupq_n_s8(0); N];
                        for t in 0..N {
                            a[t] = acts16(&acts[t * kb + b], 32 * c + 16 * j);
                        }
                        for u in 0..2 {
                            let i = 2 * j + u;
                            let v = quarter(tile, 4 * c + i, q);
                            let mut lo = vandq_u8(v, nib);
                            let mut hi = vshrq_n_u8::<4>(v);
                            if FIVE {
                                lo = vorrq_u8(lo, fifth_bit(hb, 2 * i));
                                hi = vorrq_u8(hi, fifth_bit(hb, 2 * i + 1));
                            }
                            let (lo, hi) = (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi));
                            for t in 0..N {
                                isum[t] = dot_lane::<D>(isum[t], lo, a[t], 2 * u);
                                isum[t] = dot_lane::<D>(isum[t], hi, a[t], 2 * u + 1);
                            }
                        }
                    }
                    let sc = vmulq_f32(bytes4::<false>(tile.add(Q4K_SCALES + 16 * c + 4 * q)), d);
                    for t in 0..N {
                        acc[t] = vfmaq_f32(acc[t], vcvtq_f32_s32(isum[t]), sc);
                    }
                }
                for s in 0..8 {
                    let mn = vmulq_f32(bytes4::<false>(tile.add(Q4K_MINS + 16 * s + 4 * q)), dmin);
                    for t in 0..N {
                        let a = &acts[t * kb + b];
                        acc[t] = vfmsq_f32(acc[t], mn, vdupq_n_f32(a.fsum32[s]));
                    }
                }
                for t in 0..N {
                    let ad = vdupq_n_f32(acts[t * kb + b].d);
                    res[t][q] = vfmaq_f32(res[t][q], acc[t], ad);
                }
            }
        }
    }
}

/// 16 packed Q6_K rows dotted with `N` activation rows into `res`.
///
/// # Safety
///
/// The CPU has `D`'s instructions ([`Dot::dot`]); `tiles` holds `kb` whole Q6_K tiles,
/// `tile_bytes` apart, from a 2-byte aligned start (the f16 loads); `acts` holds at least
/// `N * kb` blocks (indexed, checked); `N <= TILE_MT`.
#[inline(always)]
unsafe fn packed_q6k<const N: usize, D: Dot>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut Res,
) {
    // SAFETY: `D`'s instructions by the caller; tile `b` is `tile_bytes` bytes inside `tiles`, and
    // every quarter, scale and `d` read is inside it (the layout's fields, `tiles.rs`); every
    // `acts16` reads 16 activations at an offset of at most 240.
    unsafe {
        let nib = vdupq_n_u8(0x0f);
        let two = vdupq_n_u8(0x03);
        for b in 0..kb {
            let tile = tiles.as_ptr().add(b * tile_bytes);
            for q in 0..4 {
                prefetch_part(tile, tile_bytes, q, 4);
                let d = f16x4(tile.add(Q6K_D + 8 * q));
                let mut acc = [vdupq_n_f32(0.0); N];
                for c in 0..16 {
                    let (l0, l1) = (quarter(tile, 2 * c, q), quarter(tile, 2 * c + 1, q));
                    let h = quarter(tile, 32 + c, q);
                    let top = |v: uint8x16_t| vshlq_n_u8::<4>(vandq_u8(v, two));
                    let w = [
                        vorrq_u8(vandq_u8(l0, nib), top(h)),
                        vorrq_u8(vshrq_n_u8::<4>(l0), top(vshrq_n_u8::<2>(h))),
                        vorrq_u8(vandq_u8(l1, nib), top(vshrq_n_u8::<4>(h))),
                        vorrq_u8(vshrq_n_u8::<4>(l1), top(vshrq_n_u8::<6>(h))),
                    ]
                    .map(|v| vreinterpretq_s8_u8(v));
                    let sc = vmulq_f32(bytes4::<true>(tile.add(Q6K_SCALES + 16 * c + 4 * q)), d);
                    for t in 0..N {
                        let a = acts16(&acts[t * kb + b], 16 * c);
                        // The sum starts at the stored values' offset of 32, taken off exactly.
                        let mut isum = vdupq_n_s32(acts[t * kb + b].q6k_start[c]);
                        for (i, w) in w.iter().enumerate() {
                            isum = dot_lane::<D>(isum, *w, a, i);
                        }
                        acc[t] = vfmaq_f32(acc[t], vcvtq_f32_s32(isum), sc);
                    }
                }
                for t in 0..N {
                    let ad = vdupq_n_f32(acts[t * kb + b].d);
                    res[t][q] = vfmaq_f32(res[t][q], acc[t], ad);
                }
            }
        }
    }
}

/// 16 packed Q8_0 rows dotted with `N` activation rows into `res`.
///
/// # Safety
///
/// The CPU has `D`'s instructions ([`Dot::dot`]); `tiles` holds `kb` whole Q8_0 tiles,
/// `tile_bytes` apart, from a 2-byte aligned start (the f16 loads); `acts` holds at least
/// `N * kb` blocks (indexed, checked); `N <= TILE_MT`.
#[inline(always)]
unsafe fn packed_q8_0<const N: usize, D: Dot>(
    tiles: &[u8],
    tile_bytes: usize,
    acts: &[Q8K],
    kb: usize,
    res: &mut Res,
) {
    // SAFETY: `D`'s instructions by the caller; tile `b` is `tile_bytes` bytes inside `tiles`, and
    // every quarter, scale and `d` read is inside it (the layout's fields, `tiles.rs`); every
    // `acts16` reads 16 activations at an offset of at most 240.
    unsafe {
        for b in 0..kb {
            let tile = tiles.as_ptr().add(b * tile_bytes);
            for q in 0..4 {
                prefetch_part(tile, tile_bytes, q, 4);
                let mut acc = [vdupq_n_f32(0.0); N];
                for c in 0..8 {
                    let mut isum = [vdupq_n_s32(0); N];
                    for j in 0..2 {
                        // Activations 32c + 16j.. cover lines 8c + 4j .. 8c + 4j + 4, a lane each.
                        let mut a = [vdupq_n_s8(0); N];
                        for t in 0..N {
                            a[t] = acts16(&acts[t * kb + b], 32 * c + 16 * j);
                        }
                        for u in 0..4 {
                            let v = vreinterpretq_s8_u8(quarter(tile, 8 * c + 4 * j + u, q));
                            for t in 0..N {
                                isum[t] = dot_lane::<D>(isum[t], v, a[t], u);
                            }
                        }
                    }
                    let d = f16x4(tile.add(Q8_0_D + 32 * c + 8 * q));
                    for t in 0..N {
                        acc[t] = vfmaq_f32(acc[t], vcvtq_f32_s32(isum[t]), d);
                    }
                }
                for t in 0..N {
                    let ad = vdupq_n_f32(acts[t * kb + b].d);
                    res[t][q] = vfmaq_f32(res[t][q], acc[t], ad);
                }
            }
        }
    }
}
