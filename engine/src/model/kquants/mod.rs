//! Q4_K, Q5_K, Q6_K and Q8_0 matrix products on x86 (AVX-512 VNNI, AVX-VNNI, AVX2) and
//! aarch64 (NEON, with `dotprod` where present).
//!
//! candle's fast x86 kernels multiply a repacked copy of each weight that is larger than the
//! file's blocks (Q4_K 1.33x, Q6_K 1.52x: scales expanded to f32, Q6_K's quants to bytes),
//! built single-threaded at load, and Q6_K keeps the original too for one-token products;
//! on ARM it has no repacked kernels, and Q5_K has none anywhere.
//! Here each run of 16 weight rows is repacked block by block into a tile of about the file's
//! size ([`PackedMatrix`]: nibbles stay nibbles, 6-bit scales become bytes, `d` stays f16),
//! on all cores, after which the file's pages are released. In a tile, four consecutive
//! values of all 16 rows sit in 64 bytes, so one `vpdpbusd` with a broadcast group of four
//! activations multiplies 16 rows, for one token as for many (llama.cpp's and candle's
//! repacked kernels work the same way); with 256-bit vectors ([`avx2`]) a line is two halves
//! of 8 rows, with NEON's 128-bit ones (`neon`) four quarters of 4 rows (`sdot` by lane).
//!
//! Activations are quantized once per product (shared by q/k/v and by gate/up) to 8-bit
//! blocks of 256 ([`Q8K`], ggml's Q8_K), stored in an order that lines up with Q4_K's
//! nibbles. Work is spread over our worker pool ([`crate::model::pool`]) in runs of 16 rows.
//!
//! Every path gives the same floats to the bit: integer sums are exact, and the float
//! operations are the same fused multiply-adds in the same order.
//!
//! The kernel path ([`CpuPath`]) is the best the CPU has, or the lower one `REFUSION_CPU`
//! names; on other CPUs (and `generic`) [`available`] is false and the model uses candle's
//! kernels.

mod acts;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod caches;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;
#[cfg(target_arch = "x86_64")]
pub(crate) use avx512::transpose16;
mod tiles;

use acts::{quantize_rows, stored_at, Q8K};
use refusion_gguf::GgmlType;
use tiles::Packed;

/// Asks for part `part` of `parts` of the tile [`prefetch_tiles`] ahead of `tile` (reads past a
/// run's last tile are harmless: prefetches never fault); the hardware prefetch of the
/// development VM fell short. A kernel asks for one part per step of its block's loop: the
/// whole tile at once (37 to 68 lines) overflowed the core's queue of outstanding misses and
/// stalled the loads behind it, so that memory and arithmetic took turns instead of
/// overlapping (spread out: the 127 MB output layer of a 0.6B model at 1 and 8 tokens, 2x).
///
/// # Safety
///
/// None: any `tile` is fine (the addresses are computed with wrapping arithmetic, and a
/// prefetch never faults), and the instruction is SSE's, which every x86-64 CPU has. (Being
/// `inline(always)`, the fn has no `#[target_feature]` of its own, so its call to
/// `_mm_prefetch` needs an `unsafe` block.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_part(tile: *const u8, tile_bytes: usize, part: usize, parts: usize) {
    // SAFETY: as this fn's.
    unsafe { prefetch_part_at(prefetch_tiles(), tile, tile_bytes, part, parts) }
}

/// [`prefetch_part`] at `pf` tiles ahead (0: none), for kernels that know when the tiles are
/// already near: a run's later passes over more activation rows read the tiles the first
/// pass brought into the core's caches (AVX2 and AVX-VNNI; without those passes' prefetches
/// Q4_K ran 4-7% faster at 16 and 128 rows on Zen 3).
///
/// # Safety
///
/// None, as [`prefetch_part`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_part_at(
    pf: usize,
    tile: *const u8,
    tile_bytes: usize,
    part: usize,
    parts: usize,
) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    if pf == 0 {
        return;
    }
    let ahead = tile.wrapping_add(pf * tile_bytes);
    let per = tile_bytes.div_ceil(64 * parts);
    for line in part * per..(part + 1) * per {
        // SAFETY: SSE is part of x86-64, and a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8) };
    }
}

/// The prefetch distance in tiles: [`prefetch_tiles`]'s choice, kept in a variable so the
/// timing test can compare distances (`usize::MAX`: not chosen yet).
#[cfg(target_arch = "x86_64")]
static PF_TILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// How many tiles ahead the x86 kernels prefetch: `REFUSION_PREFETCH` (0 switches it off),
/// else by CPU vendor. Measured with `kquants::tests::prefetch_distance` (a matrix 32x the
/// last-level cache, 1-4 activation rows, the distances alternated call by call): on the Zen
/// 4 VM, 2 tiles ahead streams 5-10% more than 4 (Q4_K at one row 24.2 against 22.9 GB/s,
/// Q6_K 21.4 against 19.5; none 16-20); the Intel VMs were tuned at 4.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn prefetch_tiles() -> usize {
    use std::sync::atomic::Ordering;
    match PF_TILES.load(Ordering::Relaxed) {
        usize::MAX => choose_prefetch_tiles(),
        n => n,
    }
}

/// The first call's choice, kept in [`PF_TILES`].
#[cfg(target_arch = "x86_64")]
#[cold]
fn choose_prefetch_tiles() -> usize {
    let n = prefetch_from_env().ok().flatten().unwrap_or_else(|| {
        if cpu_is_amd() {
            2
        } else {
            PREFETCH_TILES
        }
    });
    PF_TILES.store(n, std::sync::atomic::Ordering::Relaxed);
    n
}

/// The prefetch distance in tiles (the NEON kernels' is fixed; `REFUSION_PREFETCH` is x86's).
#[cfg(target_arch = "aarch64")]
pub fn prefetch_tiles() -> usize {
    PREFETCH_TILES
}

/// No prefetch (no kernels of ours on this architecture).
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub fn prefetch_tiles() -> usize {
    0
}

/// The CPU's vendor string (CPUID leaf 0: `GenuineIntel`, `AuthenticAMD`, ...).
#[cfg(target_arch = "x86_64")]
fn cpu_vendor() -> [u8; 12] {
    let r = std::arch::x86_64::__cpuid(0);
    let mut v = [0u8; 12];
    v[..4].copy_from_slice(&r.ebx.to_le_bytes());
    v[4..8].copy_from_slice(&r.edx.to_le_bytes());
    v[8..].copy_from_slice(&r.ecx.to_le_bytes());
    v
}

/// Whether the CPU's vendor string is AMD's.
#[cfg(target_arch = "x86_64")]
fn cpu_is_amd() -> bool {
    &cpu_vendor() == b"AuthenticAMD"
}

/// How far ahead tiles are prefetched by default (x86 other than AMD, and NEON).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const PREFETCH_TILES: usize = 4;

/// Values per super-block.
const QK: usize = 256;
/// Weight rows per unit of work handed to a worker.
const ROWS_PER_UNIT: usize = 16;

/// Which of these kernels run on this CPU.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CpuPath {
    /// None of ours: candle's kernels.
    Generic,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 with AVX-VNNI's 256-bit `vpdpbusd`.
    AvxVnni,
    /// AVX-512 F/BW/VL/VNNI.
    Avx512,
    /// AVX-512 VNNI with AMX-INT8 tiles for Q4_K and Q6_K products of 16 activation rows and
    /// more (Intel Sapphire Rapids and later; Linux grants the tile state on request). Only on
    /// request: see [`CpuPath::detect`].
    Amx,
    /// aarch64 NEON (every 64-bit ARM CPU).
    Neon,
    /// NEON with the `dotprod` extension's `sdot` (ARMv8.2+: Apple, Graviton 2+, recent
    /// Snapdragon and Cortex cores).
    NeonDot,
}

impl CpuPath {
    /// Every path, each architecture's lowest first (so the last one a CPU runs is its best).
    const ALL: [CpuPath; 7] = [
        CpuPath::Generic,
        CpuPath::Avx2,
        CpuPath::AvxVnni,
        CpuPath::Avx512,
        CpuPath::Amx,
        CpuPath::Neon,
        CpuPath::NeonDot,
    ];

    /// The name `REFUSION_CPU` takes and the load line prints.
    pub fn name(self) -> &'static str {
        match self {
            CpuPath::Generic => "generic",
            CpuPath::Avx2 => "avx2",
            CpuPath::AvxVnni => "avxvnni",
            CpuPath::Avx512 => "avx512",
            CpuPath::Amx => "amx",
            CpuPath::Neon => "neon",
            CpuPath::NeonDot => "neondot",
        }
    }

    /// The best path this CPU can run. AMX only when asked for (`REFUSION_CPU=amx`): on the
    /// development machine its products are still slower than AVX-512 VNNI's (one tile store
    /// per 32-value chunk, for the per-chunk scales; docs/cpu-kernels.md).
    pub fn detect() -> CpuPath {
        CpuPath::ALL
            .into_iter()
            .rev()
            .find(|p| *p != CpuPath::Amx && p.runs())
            .unwrap_or(CpuPath::Generic)
    }

    /// Whether this CPU runs the path (an AVX-512 VNNI CPU need not have AVX-VNNI).
    pub fn runs(self) -> bool {
        match self {
            CpuPath::Generic => true,
            CpuPath::Avx2 => x86_has(&[]),
            CpuPath::AvxVnni => x86_has(&["avxvnni"]),
            CpuPath::Avx512 => x86_has(&["avx512f", "avx512bw", "avx512vl", "avx512vnni"]),
            CpuPath::Amx => CpuPath::Avx512.runs() && amx_usable(),
            CpuPath::Neon => cfg!(target_arch = "aarch64"),
            CpuPath::NeonDot => arm_dotprod(),
        }
    }

    /// The paths this CPU can run, lowest first.
    pub fn runnable() -> Vec<CpuPath> {
        CpuPath::ALL.into_iter().filter(|p| p.runs()).collect()
    }

    /// `REFUSION_CPU`'s choice, checked against the CPU: `Ok(None)` when unset.
    pub fn from_env() -> Result<Option<CpuPath>, String> {
        let v = std::env::var_os("REFUSION_CPU");
        CpuPath::choose(v.as_ref().map(|v| v.to_string_lossy()).as_deref())
    }

    /// A `REFUSION_CPU` value, checked against the CPU.
    fn choose(v: Option<&str>) -> Result<Option<CpuPath>, String> {
        let Some(v) = v else {
            return Ok(None);
        };
        let v = v.trim().to_ascii_lowercase();
        if v.is_empty() {
            return Ok(None);
        }
        let Some(path) = CpuPath::ALL.into_iter().find(|p| p.name() == v) else {
            let names: Vec<&str> = CpuPath::ALL.iter().rev().map(|p| p.name()).collect();
            return Err(format!(
                "REFUSION_CPU={v}: unknown kernel path (expected {})",
                names.join(", ")
            ));
        };
        let runnable = CpuPath::runnable();
        if !runnable.contains(&path) {
            let names: Vec<&str> = runnable.iter().rev().map(|p| p.name()).collect();
            return Err(format!(
                "REFUSION_CPU={v}: this CPU cannot run it (it runs {})",
                names.join(", ")
            ));
        }
        Ok(Some(path))
    }
}

/// Whether this is an x86-64 CPU with AVX2, FMA and F16C, and every feature in `more`.
fn x86_has(more: &[&str]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let base = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        base && more.iter().all(|f| match *f {
            "avxvnni" => is_x86_feature_detected!("avxvnni"),
            "avx512f" => is_x86_feature_detected!("avx512f"),
            "avx512bw" => is_x86_feature_detected!("avx512bw"),
            "avx512vl" => is_x86_feature_detected!("avx512vl"),
            "avx512vnni" => is_x86_feature_detected!("avx512vnni"),
            _ => false,
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = more;
        false
    }
}

/// Whether AMX-INT8 is there and granted (x86-64 only).
fn amx_usable() -> bool {
    #[cfg(target_arch = "x86_64")]
    return amx::usable();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this is an aarch64 CPU with the `dotprod` extension.
fn arm_dotprod() -> bool {
    #[cfg(target_arch = "aarch64")]
    return std::arch::is_aarch64_feature_detected!("dotprod");
    #[cfg(not(target_arch = "aarch64"))]
    false
}

/// The kernel path in use: `REFUSION_CPU`'s if valid, else the best the CPU has (an invalid
/// `REFUSION_CPU` is reported by [`check_env`] before the model loads).
pub fn path() -> CpuPath {
    use std::sync::OnceLock;
    static PATH: OnceLock<CpuPath> = OnceLock::new();
    *PATH.get_or_init(|| {
        if std::env::var_os("REFUSION_NO_NATIVE_KQUANTS").is_some() {
            set_enabled(false);
        }
        CpuPath::from_env()
            .ok()
            .flatten()
            .unwrap_or_else(CpuPath::detect)
    })
}

/// Checks `REFUSION_CPU`: one line naming the problem when it is unknown or unavailable.
pub fn check_env() -> Result<(), String> {
    CpuPath::from_env()?;
    prefetch_from_env().map(|_| ())
}

/// `REFUSION_PREFETCH`, when set: a number of tiles from 0 to 64, or one line naming the problem.
fn prefetch_from_env() -> Result<Option<usize>, String> {
    let Some(v) = std::env::var_os("REFUSION_PREFETCH") else {
        return Ok(None);
    };
    let v = v.to_string_lossy();
    match v.trim().parse::<usize>() {
        Ok(n) if n <= 64 => Ok(Some(n)),
        _ => Err(format!(
            "REFUSION_PREFETCH={v}: expected a number of tiles to prefetch ahead, from 0 to 64"
        )),
    }
}

/// The name of the path the model's quantized products take (`candle` when none of ours).
pub fn path_name() -> &'static str {
    if !available() {
        "candle"
    } else if one_row_path() != path() {
        "avx512 (one row: avx2)"
    } else {
        path().name()
    }
}

/// The path of one-row products (a one-token forward's, memory-bound): on AMD CPUs with the
/// `avx512` path detected (not forced by `REFUSION_CPU`), the 256-bit `avx2` kernels, which
/// stream the weights faster there (Zen 4 VM, 2026-12-04, `benches/cpu_paths.py` over five
/// interleaved rounds: pp1 on the synthetic 0.6B Q8_0 file 40-53 t/s against 32-40 with
/// 512-bit vectors; Zen 4 splits each 512-bit operation in two); everywhere else the path.
/// Every path gives the same floats to the bit, so the choice never changes an answer.
pub fn one_row_path() -> CpuPath {
    use std::sync::OnceLock;
    static ONE: OnceLock<CpuPath> = OnceLock::new();
    *ONE.get_or_init(|| {
        let p = path();
        #[cfg(target_arch = "x86_64")]
        if p == CpuPath::Avx512
            && matches!(CpuPath::from_env(), Ok(None))
            && cpu_is_amd()
            && CpuPath::Avx2.runs()
        {
            return CpuPath::Avx2;
        }
        p
    })
}

/// Whether this CPU runs these kernels (and they are not switched off).
pub fn available() -> bool {
    // The path first: the first look also reads the environment switches.
    path() != CpuPath::Generic && ENABLED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Off: weights loaded from now on use candle's kernels (`REFUSION_NO_NATIVE_KQUANTS=1` at
/// start does the same), for comparisons.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, std::sync::atomic::Ordering::Relaxed);
}

static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether a `rows x k` weight of type `ty` runs here.
pub fn supports(ty: GgmlType, k: usize) -> bool {
    Packed::of(ty).is_some() && k > 0 && k.is_multiple_of(QK) && available()
}

/// 64 bytes, aligned: the unit packed tiles are stored in.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// A Q4_K/Q6_K weight matrix (`rows x k`) repacked for these kernels: each run of 16 rows is
/// interleaved block by block (as many bytes as the file's blocks, give or take 6%), so one
/// `vpdpbusd` multiplies 16 rows. The last `rows % 16` rows are a run padded with zero rows,
/// so every row is computed alike on every path (the same float operations in the same order).
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
pub struct PackedMatrix {
    kind: Packed,
    rows: usize,
    k: usize,
    /// `[run of 16 rows][block]` tiles of `kind.tile_lines()` lines each.
    tiles: Vec<Line>,
}

/// Runs packed (and their source released) at a time: 256 runs, 4,096 rows.
const PACK_SLAB_RUNS: usize = 256;

/// Packs the tiles of runs `first..` into `slab` (whole runs of `kb` tiles), on all cores, into
/// memory not zeroed first: every byte is written. Runs from `full` on read `padded`.
fn pack_slab(
    kind: Packed,
    data: &[u8],
    padded: &[u8],
    (first, full, kb): (usize, usize, usize),
    wide: bool,
    slab: &mut [std::mem::MaybeUninit<Line>],
) {
    use rayon::prelude::*;
    let lines = kind.tile_lines();
    slab.par_chunks_mut(lines)
        .enumerate()
        .for_each(|(i, tile)| {
            let (run, b) = (first + i / kb, i % kb);
            let (src, r0) = if run < full {
                (data, run * ROWS_PER_UNIT)
            } else {
                (padded, 0)
            };
            // SAFETY: a tile is `lines` 64-byte lines, all written by either packer (the same
            // bytes); AVX-512's only when `path()` is Avx512 or Amx, which only a CPU with those
            // features gets.
            unsafe {
                let bytes =
                    std::slice::from_raw_parts_mut(tile.as_mut_ptr() as *mut u8, lines * 64);
                #[cfg(target_arch = "x86_64")]
                if wide {
                    avx512::pack_tile(kind, src, r0, b, kb, bytes);
                    return;
                }
                let _ = wide;
                scalar::pack_tile(kind, src, r0, b, kb, bytes);
            };
        });
}

impl PackedMatrix {
    /// Repacks `data`, the file's blocks of a `rows x k` matrix of type `ty` (`supports`
    /// checked by the caller; `data` holds exactly `rows * k / 256` blocks).
    pub fn pack(ty: GgmlType, rows: usize, k: usize, data: &[u8]) -> PackedMatrix {
        Self::pack_releasing(ty, rows, k, data, |_, _| {})
    }

    /// [`PackedMatrix::pack`], slab by slab of [`PACK_SLAB_RUNS`] runs, calling
    /// `release(offset, len)` with the bytes of `data` each slab has packed: a caller reading
    /// `data` from a map lets those pages go then, so that the process never holds a whole
    /// matrix twice (the 8B's output layer is 510 MB).
    pub fn pack_releasing(
        ty: GgmlType,
        rows: usize,
        k: usize,
        data: &[u8],
        release: impl Fn(usize, usize),
    ) -> PackedMatrix {
        let kind = Packed::of(ty).filter(|_| supports(ty, k));
        let Some(kind) = kind else {
            panic!("{ty} {rows}x{k} is not a matrix these kernels run");
        };
        let kb = k / QK;
        let bb = kind.block_bytes();
        assert!(data.len() == rows * kb * bb);
        let runs = rows.div_ceil(ROWS_PER_UNIT);
        let full = rows / ROWS_PER_UNIT;
        // The rows after the last full run, padded with zero blocks (d = 0) to a run.
        let mut padded = Vec::new();
        if runs > full {
            padded.extend_from_slice(&data[full * ROWS_PER_UNIT * kb * bb..]);
            padded.resize(ROWS_PER_UNIT * kb * bb, 0);
        }
        let lines = kind.tile_lines();
        let n = runs * kb * lines;
        let mut tiles: Vec<Line> = Vec::with_capacity(n);
        // AVX-512's packer does Q4_K and Q6_K; the portable one writes the same bytes.
        let wide = matches!(path(), CpuPath::Avx512 | CpuPath::Amx)
            && matches!(kind, Packed::Q4K | Packed::Q6K);
        let run_bytes = ROWS_PER_UNIT * kb * bb;
        for first in (0..runs).step_by(PACK_SLAB_RUNS) {
            let last = (first + PACK_SLAB_RUNS).min(runs);
            let slab = &mut tiles.spare_capacity_mut()[first * kb * lines..last * kb * lines];
            pack_slab(kind, data, &padded, (first, full, kb), wide, slab);
            let end = (last * run_bytes).min(data.len());
            release(first * run_bytes, end - first * run_bytes);
        }
        // SAFETY: the first `n` lines were all initialized, slab by slab.
        unsafe { tiles.set_len(n) };
        PackedMatrix {
            kind,
            rows,
            k,
            tiles,
        }
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The tiles of run `run` (rows `16 run .. 16 run + 16`), block after block.
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(dead_code)
    )]
    fn run_tiles(&self, run: usize) -> &[u8] {
        let n = self.k / QK * self.kind.tile_lines();
        let lines = &self.tiles[run * n..(run + 1) * n];
        // SAFETY: `Line` is 64 plain bytes.
        unsafe { std::slice::from_raw_parts(lines.as_ptr() as *const u8, n * 64) }
    }
}

thread_local! {
    /// Quantized activations of the calling thread's last product (reused, not reallocated).
    static ACTS: std::cell::RefCell<Vec<Q8K>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out[t][r] = sum_i x[t][i] * w[r][i]` for every weight in `ws` (all `k` wide), sharing one
/// quantization of `x` (`m` rows of `k`). `outs[j]` holds `m x ws[j].rows` values.
pub fn matmul_many(ws: &[&PackedMatrix], x: &[f32], m: usize, outs: &mut [&mut [f32]]) {
    let path = if m == 1 { one_row_path() } else { path() };
    matmul_on(path, ws, x, m, outs)
}

/// [`matmul_many`] on the kernels of `path`, which must be one the CPU runs (checked) other
/// than `Generic`.
fn matmul_on(path: CpuPath, ws: &[&PackedMatrix], x: &[f32], m: usize, outs: &mut [&mut [f32]]) {
    assert!(
        path != CpuPath::Generic && path.runs(),
        "{path:?} kernels on a CPU that cannot run them"
    );
    let Some(k) = ws.first().map(|w| w.k) else {
        return;
    };
    assert!(x.len() == m * k && ws.len() == outs.len());
    for (w, o) in ws.iter().zip(outs.iter()) {
        assert!(w.k == k && o.len() == m * w.rows);
    }
    ACTS.with_borrow_mut(|acts| {
        quantize_rows(x, k, acts);
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        {
            let acts: &[Q8K] = acts;
            // Units: runs of 16 weight rows (the last one padded), over all weights, each
            // with every activation row.
            let mut starts = Vec::with_capacity(ws.len() + 1);
            let mut units = 0;
            for w in ws {
                starts.push(units);
                units += w.rows.div_ceil(ROWS_PER_UNIT);
            }
            starts.push(units);
            let outs: Vec<(usize, usize)> = outs
                .iter_mut()
                .map(|o| (o.as_mut_ptr() as usize, o.len()))
                .collect();
            crate::model::pool::WorkerPool::global().execute_chunked(units, |range| {
                for unit in range {
                    let j = starts.partition_point(|&s| s <= unit) - 1;
                    let w = ws[j];
                    let run = unit - starts[j];
                    // SAFETY: units write disjoint rows `16 run ..` of each token's output
                    // of weight `j`, which the caller's `&mut` lends for this call.
                    let out =
                        unsafe { std::slice::from_raw_parts_mut(outs[j].0 as *mut f32, outs[j].1) };
                    // SAFETY: the CPU runs `path`, and `out` has `m * w.rows` values (both
                    // checked above).
                    unsafe { run_unit(path, w, acts, m, run, out) };
                }
            });
        }
    });
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = (path, ws, x, m, outs);
}

/// Run `run` of `w` on `path`'s kernel, which the CPU must run.
///
/// # Safety
///
/// The CPU runs `path` ([`CpuPath::runs`]: its features, and for `Amx` the tile permission),
/// and `out` has at least `m * w.rows()` values (the x86 kernels store unchecked). `acts`
/// must hold `m` rows of `w.k() / 256` blocks and `run` be below `w.rows().div_ceil(16)`; both
/// are checked (a panic).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
unsafe fn run_unit(
    path: CpuPath,
    w: &PackedMatrix,
    acts: &[Q8K],
    m: usize,
    run: usize,
    out: &mut [f32],
) {
    // Every arm: the caller guarantees the CPU runs `path`, whose features each kernel needs
    // (Amx's include Avx512's; every x86 path has AVX2, FMA and F16C), and that `out` has
    // `m * w.rows` values.
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        CpuPath::Avx512 => unsafe { avx512::run(w, acts, m, 0, run, out) },
        #[cfg(target_arch = "x86_64")]
        CpuPath::Amx => {
            // Whole pieces of 16 activation rows on the tiles, the rest on AVX-512.
            let pieces = if amx::has_kernel(w) { m / amx::ROWS } else { 0 };
            if pieces > 0 {
                // SAFETY: as above; `pieces * 16 <= m`, and the AMX tile permission is part
                // of the Amx path.
                unsafe { amx::run_pieces(w, acts, pieces, run, out) };
            }
            // SAFETY: as above.
            unsafe { avx512::run(w, acts, m, pieces * amx::ROWS, run, out) }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        CpuPath::AvxVnni => unsafe { avx2::run_vnni(w, acts, m, run, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        CpuPath::Avx2 => unsafe { avx2::run_avx2(w, acts, m, run, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        CpuPath::NeonDot => unsafe { neon::run_dot(w, acts, m, run, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        CpuPath::Neon => unsafe { neon::run_neon(w, acts, m, run, out) },
        _ => unreachable!("{path:?} has no kernels on this architecture"),
    }
}

/// A Q4_K block's 8 six-bit scales and 8 minimums (ggml's packing), as bytes in two
/// u64s: `(scales, mins)`.
#[inline(always)]
fn q4k_scales(blk: &[u8]) -> (u64, u64) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let at = |i: usize| u32::from_le_bytes([blk[i], blk[i + 1], blk[i + 2], blk[i + 3]]);
    let (u0, u1, u2) = (at(4), at(8), at(12));
    let m_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let m_lo = u1 & KMASK1;
    let s_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let s_lo = u0 & KMASK1;
    (
        s_lo as u64 | (s_hi as u64) << 32,
        m_lo as u64 | (m_hi as u64) << 32,
    )
}

#[cfg(test)]
mod tests;
