//! AMX-INT8 kernels for wide products (16 activation rows and more): Q4_K and Q6_K.
//!
//! An AMX tile multiply (`tdpbsud`: signed bytes times unsigned bytes, summed into i32) takes a
//! 16 x K block of activations against K x 16 weights at once, where AVX-512 VNNI needs one
//! `vpdpbusd` per four values of one activation row. The packed tiles already hold the weights
//! in AMX's B layout (four consecutive values of 16 rows in 64 bytes): Q4_K's nibbles are
//! split into bytes per 32-value chunk, Q6_K's six bits assembled per 16-value chunk, as the
//! AVX-512 kernel does. Each chunk's integer sums are exact, as `vpdpbusd`'s, and everything
//! after them is the AVX-512 kernel's float code in the same order: the same floats to the bit.
//!
//! Rust has no stable AMX intrinsics, so the five tile instructions are inline assembly. Linux
//! hands out AMX's 8 KiB of tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`),
//! made once when the path is detected; the path is not offered when it is refused.

use std::arch::asm;
use std::arch::x86_64::*;

use super::tiles::{Packed, Q4K_D, Q4K_DMIN, Q4K_MINS, Q4K_SCALES, Q6K_D, Q6K_HIGH, Q6K_SCALES};
use super::{PackedMatrix, Q8K, QK, ROWS_PER_UNIT};

/// Activation rows per tile multiply (AMX's tile height).
pub(super) const ROWS: usize = 16;

/// Whether the CPU has AMX-TILE and AMX-INT8 and Linux lets this process use them (asked once).
pub fn usable() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| cpu_has_amx_int8() && request_permission())
}

fn cpu_has_amx_int8() -> bool {
    // CPUID leaf 7, sub-leaf 0: EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
    let max = __cpuid(0).eax;
    if max < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: Linux's permission to use the tile
/// data (process-wide). Other systems: not offered.
fn request_permission() -> bool {
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain system call with integer arguments.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// The tile configuration (palette 1): two register sets, `tmm0..3` and `tmm3..6`, so that a
/// chunk's multiply can start while the previous chunk's sums are being stored:
/// activations 16 x K bytes, weights K/4 x 64 bytes (K values of 16 rows), sums 16 x 16 i32,
/// with K = 32 (a Q4_K scale's chunk) or 16 (Q6_K's).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const _: () = assert!(std::mem::size_of::<TileConfig>() == 64);

fn config(k: usize) -> TileConfig {
    let mut c = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    for set in [0, 3] {
        for (t, rows, colsb) in [(0, 16, k), (1, k / 4, 64), (2, 16, 64)] {
            c.rows[set + t] = rows as u8;
            c.colsb[set + t] = colsb as u16;
        }
    }
    c
}

/// Scratch for one thread: each block's weights in AMX's B layout and its chunks' sums, two of
/// each, so that block `b`'s tile multiplies run while block `b - 1`'s sums are read and block
/// `b + 1`'s weights written (AMX loads do not take values from pending vector stores, nor
/// vector loads from pending tile stores: kept a block apart, neither waits).
#[repr(C, align(64))]
struct Scratch {
    /// `[block parity][line]`: Q4_K 8 chunks of 8 lines, Q6_K 16 of 4.
    weights: [[[u8; 64]; 64]; 2],
    /// `[block parity][chunk][activation row][weight row]`.
    sums: [[[[i32; 16]; ROWS]; 16]; 2],
}

thread_local! {
    static SCRATCH: std::cell::Cell<*mut Scratch> = const { std::cell::Cell::new(std::ptr::null_mut()) };
}

/// This thread's scratch (allocated on first use, never freed: one per worker thread).
fn scratch() -> *mut Scratch {
    SCRATCH.with(|s| {
        if s.get().is_null() {
            let b: Box<std::mem::MaybeUninit<Scratch>> = Box::new_uninit();
            s.set(Box::into_raw(b) as *mut Scratch);
        }
        s.get()
    })
}

/// Rows `0..16·pieces` of the activations (whole pieces of 16) against run `run` of `w`.
///
/// # Safety
///
/// The CPU has AVX-512F, BW, VL and VNNI, and [`usable`] is true (AMX-TILE and AMX-INT8, with
/// Linux's permission for this process); `out` has at least `16·pieces·w.rows` values (the
/// stores are unchecked). `w` must be Q4_K or Q6_K, `acts` hold at least `16·pieces` rows of
/// `w.k / 256` blocks and `run` be one of `w`'s runs; these are checked (a panic).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn run_pieces(
    w: &PackedMatrix,
    acts: &[Q8K],
    pieces: usize,
    run: usize,
    out: &mut [f32],
) {
    let kind = match w.kind {
        Packed::Q4K => Kind::Q4K,
        Packed::Q6K => Kind::Q6K,
        Packed::Q5K | Packed::Q8_0 => unreachable!("no AMX kernel for {:?}", w.kind),
    };
    let cfg = config(kind.k());
    // SAFETY: the caller guarantees AMX is usable; `cfg` is a valid palette-1 configuration
    // (64 bytes, aligned) for `kind`'s chunk size.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig, options(nostack, readonly))
    };
    let kb = w.k / QK;
    let r0 = run * ROWS_PER_UNIT;
    let valid = (w.rows - r0).min(ROWS_PER_UNIT);
    let tiles = w.run_tiles(run);
    let scratch = scratch();
    let block = Block {
        kind,
        tile_bytes: w.kind.tile_bytes(),
        stride: kb * std::mem::size_of::<Q8K>(),
        kb,
    };
    for piece in 0..pieces {
        let t0 = piece * ROWS;
        let a = &acts[t0 * kb..(t0 + ROWS) * kb];
        let mut res = [_mm512_setzero_ps(); ROWS];
        // SAFETY: the AVX-512 features by the attribute and the tiles (configured above for
        // `kind`) by the caller; `tiles` is the run's `kb` whole tiles of `w.kind`'s layout,
        // 64-byte aligned (`run_tiles`); `a` is 16 rows of `kb` blocks, `stride` apart;
        // `scratch` is this thread's; block `b`'s weights are unpacked before its multiply,
        // and its sums stored (multiply) before its float work (finish) reads them.
        unsafe {
            block.unpack(tiles, 0, scratch);
            for b in 0..kb {
                block.multiply(a, b, scratch);
                if b + 1 < kb {
                    block.unpack(tiles, b + 1, scratch);
                }
                if b > 0 {
                    block.finish(tiles, a, b - 1, scratch, &mut res);
                }
            }
            block.finish(tiles, a, kb - 1, scratch, &mut res);
        }
        for (t, v) in res.iter().enumerate() {
            // SAFETY: `(t0 + t) * w.rows + r0 + valid <= 16·pieces·w.rows <= out.len()`
            // (the caller), and only the `valid` rows are stored.
            unsafe {
                let o = out.as_mut_ptr().add((t0 + t) * w.rows + r0);
                if valid == ROWS_PER_UNIT {
                    _mm512_storeu_ps(o, *v);
                } else {
                    _mm512_mask_storeu_ps(o, (1u16 << valid) - 1, *v);
                }
            }
        }
    }
    // SAFETY: the tiles were configured above; releasing them ends their use.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Whether `w` has an AMX kernel.
pub(super) fn has_kernel(w: &PackedMatrix) -> bool {
    matches!(w.kind, Packed::Q4K | Packed::Q6K)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Q4K,
    Q6K,
}

impl Kind {
    /// Values per chunk (one scale): one tile multiply's depth.
    fn k(self) -> usize {
        match self {
            Kind::Q4K => 32,
            Kind::Q6K => 16,
        }
    }
    fn chunks(self) -> usize {
        QK / self.k()
    }
}

/// One run's blocks, stage by stage.
struct Block {
    kind: Kind,
    tile_bytes: usize,
    /// Bytes from one activation row's block to the next row's.
    stride: usize,
    kb: usize,
}

/// `sums = acts (16 rows of K bytes at `a`, `stride` apart) x weights (K/4 lines at `w`)` on
/// register set `SET` (0 or 1).
///
/// # Safety
///
/// The CPU has AMX-INT8 with the tile state granted, and the tiles are configured by
/// [`config`] for this `K`; `a` is valid for reading 16 rows of `K` bytes, `stride` apart; `w`
/// for reading `K / 4` lines of 64 bytes; `sums` for writing 16 rows of 16 i32 (64 bytes
/// apart).
#[inline(always)]
unsafe fn multiply<const SET: usize>(a: *const i8, stride: usize, w: *const u8, sums: *mut i32) {
    macro_rules! on {
        ($a:literal, $w:literal, $c:literal) => {
            asm!(
                concat!("tileloadd ", $a, ", [{a} + {stride}*1]"),
                concat!("tileloadd ", $w, ", [{w} + {sixty_four}*1]"),
                concat!("tilezero ", $c),
                concat!("tdpbsud ", $c, ", ", $a, ", ", $w),
                concat!("tilestored [{s} + {sixty_four}*1], ", $c),
                a = in(reg) a,
                stride = in(reg) stride,
                w = in(reg) w,
                s = in(reg) sums,
                sixty_four = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    // SAFETY: the caller guarantees the tile state, its configuration and the three
    // pointers' ranges.
    unsafe {
        if SET == 0 {
            on!("tmm0", "tmm1", "tmm2");
        } else {
            on!("tmm3", "tmm4", "tmm5");
        }
    }
}

/// 16 f16 at `at` in a tile, as f32.
///
/// # Safety
///
/// The CPU has AVX-512F (this is inlined into [`Block::finish`], which enables it), and
/// `tile + at` is valid for reading 32 bytes.
#[inline(always)]
unsafe fn f16x16(tile: *const u8, at: usize) -> __m512 {
    // SAFETY: AVX-512F and the 32 bytes by the caller.
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(tile.add(at) as *const _)) }
}

impl Block {
    /// Block `b`'s weights into the scratch, in AMX's B layout: Q4_K's nibbles split, Q6_K's
    /// six bits assembled, as the AVX-512 kernel does in registers.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F, BW and VL; `tiles` holds at least `b + 1` whole tiles of this
    /// kind's layout (`self.tile_bytes` each), from a 64-byte aligned start; `s` points at
    /// a `Scratch` (its contents may be uninitialized) that nothing else uses meanwhile.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn unpack(&self, tiles: &[u8], b: usize, s: *mut Scratch) {
        // SAFETY: AVX-512F/BW/VL by the attribute; tile `b` lies in `tiles`, 64-byte aligned as
        // every line read (the caller); the lines stored are `weights[b % 2]`'s 64 (Q4_K: 32 x 2,
        // Q6_K: 16 x 4), 64-byte aligned as `Scratch` is.
        unsafe {
            let tile = tiles.as_ptr().add(b * self.tile_bytes);
            let lines = (*s).weights[b % 2].as_mut_ptr() as *mut u8;
            let nib = _mm512_set1_epi8(0x0f);
            let store =
                |line: usize, v: __m512i| _mm512_store_si512(lines.add(64 * line) as *mut _, v);
            match self.kind {
                Kind::Q4K => {
                    for p in 0..32 {
                        super::prefetch_part(tile, self.tile_bytes, p, 32);
                        let q = _mm512_load_si512(tile.add(64 * p) as *const _);
                        store(2 * p, _mm512_and_si512(q, nib));
                        store(2 * p + 1, _mm512_and_si512(_mm512_srli_epi16::<4>(q), nib));
                    }
                }
                Kind::Q6K => {
                    let two = _mm512_set1_epi8(0x03);
                    for c in 0..16 {
                        super::prefetch_part(tile, self.tile_bytes, c, 16);
                        let l0 = _mm512_load_si512(tile.add(64 * (2 * c)) as *const _);
                        let l1 = _mm512_load_si512(tile.add(64 * (2 * c + 1)) as *const _);
                        let h = _mm512_load_si512(tile.add(Q6K_HIGH + 64 * c) as *const _);
                        let top = |shift: usize| match shift {
                            0 => _mm512_and_si512(h, two),
                            2 => _mm512_and_si512(_mm512_srli_epi16::<2>(h), two),
                            4 => _mm512_and_si512(_mm512_srli_epi16::<4>(h), two),
                            _ => _mm512_and_si512(_mm512_srli_epi16::<6>(h), two),
                        };
                        let low = [
                            _mm512_and_si512(l0, nib),
                            _mm512_and_si512(_mm512_srli_epi16::<4>(l0), nib),
                            _mm512_and_si512(l1, nib),
                            _mm512_and_si512(_mm512_srli_epi16::<4>(l1), nib),
                        ];
                        for (i, low) in low.iter().enumerate() {
                            let v = _mm512_or_si512(*low, _mm512_slli_epi16::<4>(top(2 * i)));
                            store(4 * c + i, v);
                        }
                    }
                }
            }
        }
    }

    /// Block `b`'s tile multiplies, every chunk, alternating register sets.
    ///
    /// # Safety
    ///
    /// The CPU has AMX-INT8 with the tile state granted, and the tiles are configured by
    /// [`config`] for this kind; `b < self.kb`; `acts` holds 16 rows of `self.kb` blocks
    /// (`self.stride` bytes apart); `s` points at a `Scratch` that nothing else uses meanwhile,
    /// whose `weights[b % 2]` holds block `b`'s weights ([`Block::unpack`]).
    #[inline(always)]
    unsafe fn multiply(&self, acts: &[Q8K], b: usize, s: *mut Scratch) {
        // SAFETY: the caller guarantees the tiles and `s`; chunk `c`'s activations are the `k`
        // bytes at `k * c` of block `b`'s `qs` in each of the 16 rows (`acts[b + row * kb]`,
        // `stride` bytes apart); its weights `k / 4` lines of `weights[b % 2]`; its sums
        // `sums[b % 2][c]`.
        unsafe {
            let k = self.kind.k();
            let a0 = acts[b].qs.as_ptr();
            let lines = (*s).weights[b % 2].as_ptr() as *const u8;
            let sums = (*s).sums[b % 2].as_mut_ptr();
            for c in 0..self.kind.chunks() {
                let (a, w, out) = (
                    a0.add(k * c),
                    lines.add(64 * (k / 4) * c),
                    sums.add(c) as *mut i32,
                );
                if c % 2 == 0 {
                    multiply::<0>(a, self.stride, w, out);
                } else {
                    multiply::<1>(a, self.stride, w, out);
                }
            }
        }
    }

    /// Block `b`'s float work, the AVX-512 kernel's operations in its order.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F, BW and VL; `tiles` holds at least `b + 1` whole tiles of this
    /// kind's layout; `s` points at a `Scratch` whose `sums[b % 2]` hold block `b`'s sums
    /// ([`Block::multiply`] ran for it: they are initialized), not written meanwhile. (`acts`
    /// is indexed, checked.)
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn finish(
        &self,
        tiles: &[u8],
        acts: &[Q8K],
        b: usize,
        s: *mut Scratch,
        res: &mut [__m512; ROWS],
    ) {
        // SAFETY: AVX-512F/BW/VL by the attribute; tile `b` lies in `tiles` and its scales,
        // minimums and `d`s at their layout's offsets; `sums[b % 2]` initialized and 64-byte
        // aligned (the caller; `Scratch` is aligned).
        unsafe {
            let tile = tiles.as_ptr().add(b * self.tile_bytes);
            let sums = &(*s).sums[b % 2];
            let kb = self.kb;
            let mut acc = [_mm512_setzero_ps(); ROWS];
            match self.kind {
                Kind::Q4K => {
                    let d = f16x16(tile, Q4K_D);
                    let dmin = f16x16(tile, Q4K_DMIN);
                    for (c, sums) in sums.iter().take(8).enumerate() {
                        let sc = _mm_loadu_si128(tile.add(Q4K_SCALES + 16 * c) as *const _);
                        let sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)), d);
                        for (t, acc) in acc.iter_mut().enumerate() {
                            let isum = _mm512_load_si512(sums[t].as_ptr() as *const _);
                            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, *acc);
                        }
                    }
                    for s in 0..8 {
                        let mn = _mm_loadu_si128(tile.add(Q4K_MINS + 16 * s) as *const _);
                        let mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)), dmin);
                        for (t, acc) in acc.iter_mut().enumerate() {
                            let a = &acts[t * kb + b];
                            *acc = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a.fsum32[s]), *acc);
                        }
                    }
                }
                Kind::Q6K => {
                    let d = f16x16(tile, Q6K_D);
                    for (c, sums) in sums.iter().enumerate() {
                        let sc = _mm_loadu_si128(tile.add(Q6K_SCALES + 16 * c) as *const _);
                        let sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), d);
                        for (t, acc) in acc.iter_mut().enumerate() {
                            // The sum starts at the offset term, as `vpdpbusd`'s does there.
                            let start = _mm512_set1_epi32(acts[t * kb + b].q6k_start[c]);
                            let tile_sum = _mm512_load_si512(sums[t].as_ptr() as *const _);
                            let isum = _mm512_add_epi32(start, tile_sum);
                            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, *acc);
                        }
                    }
                }
            }
            for (t, r) in res.iter_mut().enumerate() {
                *r = _mm512_fmadd_ps(acc[t], _mm512_set1_ps(acts[t * kb + b].d), *r);
            }
        }
    }
}
