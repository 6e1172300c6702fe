//! Tests of the module above.

use super::*;
use refusion_gguf::quant;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn dequantized_acts(acts: &[Q8K]) -> Vec<f32> {
    let mut out = Vec::new();
    for a in acts {
        for i in 0..QK {
            out.push(a.qs[stored_at(i)] as f32 * a.d);
        }
    }
    out
}

/// Our paths this CPU runs.
fn paths() -> Vec<CpuPath> {
    CpuPath::runnable()
        .into_iter()
        .filter(|&p| p != CpuPath::Generic)
        .collect()
}

/// The kernels of every runnable path against dequantized weights times dequantized
/// activations (f64).
fn check(ty: GgmlType, rows: usize, k: usize, m: usize) {
    let mut seed = 7u64 + rows as u64 * 31 + m as u64;
    let wf: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed)).collect();
    let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed) * 3.0).collect();
    let mut data = vec![0u8; rows * k / QK * Packed::of(ty).unwrap().block_bytes()];
    quant::quantize(ty, &wf, k, &mut data);
    check_data(ty, rows, k, m, &data, &x);
}

/// [`check`] of the file's bytes `data` (`rows x k` of `ty`) against activations `x`.
fn check_data(ty: GgmlType, rows: usize, k: usize, m: usize, data: &[u8], x: &[f32]) {
    let mut wd = vec![0f32; rows * k];
    assert!(quant::dequantize(ty, data, &mut wd));
    let mut acts = Vec::new();
    quantize_rows(x, k, &mut acts);
    let xd = dequantized_acts(&acts);
    let w = PackedMatrix::pack(ty, rows, k, data);
    let mut first: Option<(CpuPath, Vec<f32>)> = None;
    for path in paths() {
        // NaN past the end: nothing may be written there (the padded last run).
        let mut buf = vec![f32::NAN; m * rows + 16];
        let (out, beyond) = buf.split_at_mut(m * rows);
        matmul_on(path, &[&w], x, m, &mut [&mut out[..]]);
        assert!(
            beyond.iter().all(|v| v.is_nan()),
            "{path:?} wrote past the output"
        );
        for t in 0..m {
            for r in 0..rows {
                let want: f64 = (0..k)
                    .map(|i| wd[r * k + i] as f64 * xd[t * k + i] as f64)
                    .sum();
                let got = out[t * rows + r] as f64;
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "{path:?} {ty} rows {rows} k {k} m {m}: [{t}][{r}] {got} vs {want}"
                );
            }
        }
        // Every path gives the same floats to the bit (exact integer sums, the same
        // float operations in the same order).
        match &first {
            None => first = Some((path, out.to_vec())),
            Some((p0, o0)) => assert!(
                o0.iter()
                    .zip(out.iter())
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{path:?} and {p0:?} differ on {ty} rows {rows} k {k} m {m}"
            ),
        }
    }
}

const TYPES: [GgmlType; 4] = [
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
];

#[test]
fn stored_order_is_a_permutation() {
    let mut seen = [false; QK];
    for i in 0..QK {
        assert!(!seen[stored_at(i)]);
        seen[stored_at(i)] = true;
    }
}

#[test]
fn quantized_activations_round_trip() {
    let mut seed = 3;
    let x: Vec<f32> = (0..2 * QK).map(|_| lcg(&mut seed)).collect();
    let mut acts = Vec::new();
    quantize_rows(&x, QK, &mut acts);
    let back = dequantized_acts(&acts);
    for (a, b) in x.iter().zip(&back) {
        assert!((a - b).abs() <= acts[0].d.abs().max(acts[1].d.abs()) * 0.51);
    }
    for a in &acts {
        for (s, c) in a.bsums.iter().enumerate() {
            let want: i16 = (0..16).map(|i| a.qs[stored_at(16 * s + i)] as i16).sum();
            assert_eq!(*c, want);
        }
    }
}

#[test]
fn every_type_matches_the_dequantized_product() {
    if !available() {
        return;
    }
    for ty in TYPES {
        // 37 rows: two packed runs and a 5-row tail; 1..9 tokens: every tile width; 16 and
        // more: AMX's pieces of 16, alone, several, and with a tail.
        for m in [1, 2, 3, 4, 5, 9, 16, 35, 51, 64] {
            check(ty, 37, 512, m);
        }
        check(ty, 16, 2048, 4);
        // 45 rows: a last run of 13, whose second half is partly stored (AVX2's wide Q6_K).
        check(ty, 45, 512, 9);
    }
}

/// Q6_K at its extremes: every value 0 or every value 63 (stored; -32 and 31 after the
/// offset), with the largest scales of either sign, against activations of +-127 and of
/// alternating sign: the kernels' integer sums at their largest (AVX2's i16 pair sums, the
/// offset's start), where a sum that wrapped or saturated would show.
#[test]
fn q6k_extremes_match_the_dequantized_product() {
    if !available() {
        return;
    }
    // A Q6_K block: 128 bytes of low bits, 64 of top bits, 16 i8 scales, f16 d.
    let block = |q: u8, scale: i8| {
        let mut b = vec![if q & 15 == 15 { 0xff } else { 0 }; 128];
        b.extend(vec![if q >> 4 == 3 { 0xff } else { 0 }; 64]);
        b.extend(vec![scale as u8; 16]);
        b.extend(half::f16::from_f32(0.01).to_le_bytes());
        b
    };
    let (rows, k) = (16, 512);
    // 3 rows: every kernel's narrow passes; 6: AVX2's passes over one half of a tile.
    for (q, m) in [0, 63].into_iter().flat_map(|q| [(q, 3), (q, 6)]) {
        for scale in [127, -128] {
            let data: Vec<u8> = (0..rows * k / QK).flat_map(|_| block(q, scale)).collect();
            let x: Vec<f32> = (0..m * k)
                .map(|i| match i / k {
                    0 => 1.0,
                    1 => -1.0,
                    _ => [1.0, -1.0][i / 2 % 2],
                })
                .collect();
            check_data(GgmlType::Q6_K, rows, k, m, &data, &x);
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn the_portable_packer_writes_the_avx512_packers_bytes() {
    if !paths().contains(&CpuPath::Avx512) {
        return;
    }
    let (rows, k) = (32, 512);
    let mut seed = 5;
    // Q5_K and Q8_0 have only the portable packer.
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
        let wf: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed)).collect();
        let mut data = vec![0u8; rows * k / QK * Packed::of(ty).unwrap().block_bytes()];
        quant::quantize(ty, &wf, k, &mut data);
        let lines = Packed::of(ty).unwrap().tile_bytes();
        for (r0, b) in [(0, 0), (16, 1)] {
            let (mut wide, mut portable) = (vec![0u8; lines], vec![1u8; lines]);
            // SAFETY: the CPU has AVX-512 (checked above); `wide` is a whole tile.
            unsafe { avx512::pack_tile(Packed::of(ty).unwrap(), &data, r0, b, k / QK, &mut wide) };
            scalar::pack_tile(Packed::of(ty).unwrap(), &data, r0, b, k / QK, &mut portable);
            assert!(wide == portable, "{ty} tile ({r0}, {b}) differs");
        }
    }
}

#[test]
fn refusion_cpu_names_a_path_the_cpu_runs() {
    assert_eq!(CpuPath::choose(None), Ok(None));
    for p in CpuPath::runnable() {
        assert_eq!(CpuPath::choose(Some(p.name())), Ok(Some(p)));
        assert_eq!(CpuPath::choose(Some(&p.name().to_uppercase())), Ok(Some(p)));
    }
    let err = CpuPath::choose(Some("sse9")).unwrap_err();
    assert!(
        err.contains("unknown kernel path") && err.contains("avx2"),
        "{err}"
    );
    // The other architecture's paths, and AVX-512 where the CPU lacks it.
    let other = if cfg!(target_arch = "aarch64") {
        "avx2"
    } else {
        "neon"
    };
    for name in [other, "avx512"] {
        if !CpuPath::runnable().iter().any(|p| p.name() == name) {
            let err = CpuPath::choose(Some(name)).unwrap_err();
            assert!(err.contains("cannot run"), "{err}");
        }
    }
}

#[test]
fn several_weights_share_one_quantization() {
    if !available() {
        return;
    }
    let k = 256;
    let mut seed = 11;
    let x: Vec<f32> = (0..3 * k).map(|_| lcg(&mut seed)).collect();
    let mk = |ty: GgmlType, rows: usize, seed: &mut u64| {
        let wf: Vec<f32> = (0..rows * k).map(|_| lcg(seed)).collect();
        let mut data = vec![0u8; rows * k / QK * Packed::of(ty).unwrap().block_bytes()];
        quant::quantize(ty, &wf, k, &mut data);
        data
    };
    let a = mk(GgmlType::Q4_K, 20, &mut seed);
    let b = mk(GgmlType::Q6_K, 33, &mut seed);
    let wa = PackedMatrix::pack(GgmlType::Q4_K, 20, k, &a);
    let wb = PackedMatrix::pack(GgmlType::Q6_K, 33, k, &b);
    let (mut oa, mut ob) = (vec![0f32; 3 * 20], vec![0f32; 3 * 33]);
    matmul_many(&[&wa, &wb], &x, 3, &mut [&mut oa, &mut ob]);
    let (mut sa, mut sb) = (vec![0f32; 3 * 20], vec![0f32; 3 * 33]);
    matmul_many(&[&wa], &x, 3, &mut [&mut sa]);
    matmul_many(&[&wb], &x, 3, &mut [&mut sb]);
    assert_eq!(oa, sa);
    assert_eq!(ob, sb);
}

/// Batch invariance: a token's output is the same to the bit whether it is multiplied alone
/// or as row `t` of a batch of any size (so a request's answer cannot depend on what else
/// is in the forward), on every path the CPU runs.
#[test]
fn a_tokens_product_does_not_depend_on_the_batch() {
    if !available() {
        return;
    }
    let (rows, k) = (40, 512);
    for ty in TYPES {
        let mut seed = 5u64;
        let wf: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed)).collect();
        let mut data = vec![0u8; rows * k / QK * Packed::of(ty).unwrap().block_bytes()];
        quant::quantize(ty, &wf, k, &mut data);
        let w = PackedMatrix::pack(ty, rows, k, &data);
        let x: Vec<f32> = (0..17 * k).map(|_| lcg(&mut seed) * 2.0).collect();
        for path in paths() {
            let alone: Vec<Vec<f32>> = (0..17)
                .map(|t| {
                    let mut o = vec![0f32; rows];
                    matmul_on(path, &[&w], &x[t * k..(t + 1) * k], 1, &mut [&mut o[..]]);
                    o
                })
                .collect();
            for m in 1..=17 {
                let mut o = vec![0f32; m * rows];
                matmul_on(path, &[&w], &x[..m * k], m, &mut [&mut o[..]]);
                for (t, want) in alone.iter().enumerate().take(m) {
                    let got = &o[t * rows..(t + 1) * rows];
                    assert!(
                        got.iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{path:?} {ty}: token {t} in a batch of {m} differs from alone"
                    );
                }
            }
        }
    }
}

/// Time of one product per path (`cargo test --release --lib kquants::tests::timing --
/// --ignored --nocapture`): a 3072x1024 matrix (in the last-level cache;
/// `REFUSION_TIMING_SHAPE=ROWSxK` another, such as `1024x12288`, an 8B model's down projection's
/// long rows, 128 of which outgrow an L2) at 1, 2, 8, 16 and 128 activation rows, every shape
/// and path once per round, interleaved over 7 rounds (a drifting machine moves them alike),
/// the median and range printed; then the instruction peaks the products are set against
/// (`vpdpbusd`, and AVX2's `vpmaddubsw` with its add, on as many threads as the pool has).
#[test]
#[ignore]
fn timing() {
    let (rows, k) = timing_shape();
    println!(
        "a {rows}x{k} matrix; caches: {}",
        caches::caches().describe()
    );
    const ROUNDS: usize = 7;
    let sizes = [1usize, 2, 8, 16, 128];
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0] {
        let mut seed = 9;
        let wf: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed)).collect();
        let mut data = vec![0u8; rows * k / QK * Packed::of(ty).unwrap().block_bytes()];
        quant::quantize(ty, &wf, k, &mut data);
        let w = PackedMatrix::pack(ty, rows, k, &data);
        let xs: Vec<Vec<f32>> = sizes
            .iter()
            .map(|&m| (0..m * k).map(|_| lcg(&mut seed)).collect())
            .collect();
        let mut rates = vec![vec![Vec::new(); paths().len()]; sizes.len()];
        for _ in 0..ROUNDS {
            for (si, &m) in sizes.iter().enumerate() {
                let mut out = vec![0f32; m * rows];
                for (pi, &path) in paths().iter().enumerate() {
                    matmul_on(path, &[&w], &xs[si], m, &mut [&mut out[..]]);
                    let reps = (2048 / m).clamp(10, 200);
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        matmul_on(path, &[&w], &xs[si], m, &mut [&mut out[..]]);
                    }
                    let dt = t.elapsed().as_secs_f64() / reps as f64;
                    rates[si][pi].push((rows * k * m) as f64 / dt / 1e9);
                }
            }
        }
        for (si, &m) in sizes.iter().enumerate() {
            for (pi, path) in paths().iter().enumerate() {
                let r = &mut rates[si][pi];
                r.sort_by(f64::total_cmp);
                println!(
                    "{ty} m {m} {path:?}: {:.0} GMAC/s (median of {ROUNDS}, {:.0}-{:.0})",
                    r[ROUNDS / 2],
                    r[0],
                    r[ROUNDS - 1]
                );
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        const ITERS: usize = 20_000_000;
        let threads = crate::model::pool::WorkerPool::global().threads();
        // Independent chains of the product instruction on every thread: per ns, all threads.
        let peak = |chains: usize, f: &(dyn Fn() -> i32 + Sync)| {
            let t = std::time::Instant::now();
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(|| std::hint::black_box(f()));
                }
            });
            (threads * ITERS * chains) as f64 / t.elapsed().as_secs_f64() / 1e9
        };
        if std::arch::is_x86_feature_detected!("avx512vnni") {
            // SAFETY: the CPU has AVX-512 VNNI (checked).
            let per_ns = peak(16, &|| unsafe { vnni_chains(ITERS) });
            println!(
                "peak: {per_ns:.2} vpdpbusd/ns on {threads} threads, {:.0} GMAC/s (64 each)",
                per_ns * 64.0
            );
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked).
            let per_ns = peak(12, &|| unsafe { maddubs_chains(ITERS) });
            println!(
                "peak (avx2): {per_ns:.2} vpmaddubsw+vpaddw/ns on {threads} threads, {:.0} GMAC/s \
                 (32 each)",
                per_ns * 32.0
            );
        }
    }
}

/// The timing test's matrix: `REFUSION_TIMING_SHAPE` (`ROWSxK`, K a multiple of 256), or
/// 3072x1024.
fn timing_shape() -> (usize, usize) {
    let Ok(v) = std::env::var("REFUSION_TIMING_SHAPE") else {
        return (3072, 1024);
    };
    let parse = |s: &str| s.trim().parse::<usize>().ok().filter(|&n| n > 0);
    match v.split_once('x').map(|(r, k)| (parse(r), parse(k))) {
        Some((Some(rows), Some(k))) if k % QK == 0 => (rows, k),
        _ => panic!("REFUSION_TIMING_SHAPE={v}: expected ROWSxK with K a multiple of {QK}"),
    }
}

/// `iters` x 12 independent 256-bit `vpmaddubsw`, each added into its i16 sums (`vpaddw`): the
/// AVX2 kernels' product without VNNI, which never goes without its add.
///
/// # Safety
///
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn maddubs_chains(iters: usize) -> i32 {
    use std::arch::x86_64::*;
    let b = _mm256_set1_epi8(2);
    let mut acc = [_mm256_set1_epi8(1); 12];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            // The sums themselves as the unsigned operand: nothing to hoist out of the loop.
            *v = _mm256_add_epi16(*v, _mm256_maddubs_epi16(*v, b));
        }
    }
    let all = acc
        .iter()
        .fold(_mm256_setzero_si256(), |x, y| _mm256_xor_si256(x, *y));
    _mm256_extract_epi32::<0>(all)
}

/// `iters` x 16 independent 512-bit `vpdpbusd`.
///
/// # Safety
///
/// The CPU has AVX-512F and AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn vnni_chains(iters: usize) -> i32 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_epi8(1);
    let b = _mm512_set1_epi8(2);
    let mut acc = [_mm512_setzero_si512(); 16];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_dpbusd_epi32(*v, a, b);
        }
    }
    _mm512_reduce_add_epi32(
        acc.iter()
            .fold(_mm512_setzero_si512(), |x, y| _mm512_add_epi32(x, *y)),
    )
}

/// Prefetch distances on a matrix far larger than the last-level cache, one activation row
/// (the one-token forward's shape), alternated call by call so the machine's drift moves them
/// alike (`cargo test --release --lib kquants::tests::prefetch_distance -- --ignored
/// --nocapture`).
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn prefetch_distance() {
    use std::sync::atomic::Ordering;
    let (rows, k) = (32768, 4096);
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0] {
        let mut seed = 9;
        let block: Vec<f32> = (0..64 * k).map(|_| lcg(&mut seed)).collect();
        let bb = Packed::of(ty).unwrap().block_bytes() * k / QK;
        let mut one = vec![0u8; 64 * bb];
        quant::quantize(ty, &block, k, &mut one);
        let data: Vec<u8> = one.iter().copied().cycle().take(rows * bb).collect();
        let w = PackedMatrix::pack(ty, rows, k, &data);
        let bytes = (rows * bb) as f64;
        for m in [1usize, 2, 4] {
            let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let mut out = vec![0f32; m * rows];
            let dists = [0usize, 2, 4, 8, 16];
            let mut t = vec![Vec::new(); dists.len()];
            for _ in 0..40 {
                for (i, &d) in dists.iter().enumerate() {
                    super::PF_TILES.store(d, Ordering::Relaxed);
                    let t0 = std::time::Instant::now();
                    matmul_on(super::path(), &[&w], &x, m, &mut [&mut out[..]]);
                    t[i].push(t0.elapsed().as_secs_f64());
                }
            }
            super::PF_TILES.store(usize::MAX, Ordering::Relaxed);
            for (i, &d) in dists.iter().enumerate() {
                t[i].sort_by(f64::total_cmp);
                println!(
                    "{ty} m {m} prefetch {d}: {:.1} GB/s (median of 40)",
                    bytes / t[i][20] / 1e9
                );
            }
        }
    }
}
