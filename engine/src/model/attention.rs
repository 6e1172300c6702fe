//! Causal attention of a flat batch over the KV cache, on the CPU.
//!
//! Token `i` sees its sequence's shared prefix (read in place from the cache by every token:
//! never copied per row) and the private slots of its own row up to and including its own
//! entry, in cache order. Positions play no part here: they entered through RoPE.

use std::cell::RefCell;

pub use crate::kv::Visible;
use crate::kv::{HeadView, Kv, KvCache, Segment};
use crate::model::{expf, Heads};

/// `a · b` with eight partial sums (vectorizes; keeps rounding error low).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] = x[j].mul_add(y[j], acc[j]);
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `o += p * v`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn axpy_generic(o: &mut [f32], p: f32, v: &[f32]) {
    for (o, x) in o.iter_mut().zip(v) {
        *o = p.mul_add(*x, *o);
    }
}

/// [`dot_generic`] compiled for AVX2 and FMA.
///
/// # Safety
///
/// The CPU has AVX2 and FMA (any slices are fine).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_generic(a, b)
}

/// [`axpy_generic`] compiled for AVX2 and FMA.
///
/// # Safety
///
/// The CPU has AVX2 and FMA (any slices are fine).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(o: &mut [f32], p: f32, v: &[f32]) {
    axpy_generic(o, p, v)
}

/// Most (token, head) queries one task's fast path handles (8 tokens of up to 16 heads per KV
/// head on AVX-512; on AVX2 up to 32 tokens, at most [`AVX2_BLOCK_QUERIES`] queries:
/// [`block_tokens`]); beyond, the portable loop runs.
#[cfg(target_arch = "x86_64")]
const MAX_QUERIES: usize = 128;

/// Most queries of an AVX2 block ([`block_tokens`]).
#[cfg(target_arch = "x86_64")]
const AVX2_BLOCK_QUERIES: usize = 64;

/// Queries whose dot products with one key run side by side in [`dots_avx2`].
#[cfg(target_arch = "x86_64")]
const DOT_QUERIES: usize = 8;

/// `put(i, dot(qs[i], k) * scale)` for every query, [`DOT_QUERIES`] at a time: eight
/// independent FMA chains hide the four-cycle latency a single chain waits on (four chains
/// left the FMA units half idle). Each value is `dot(q, k, true) * scale` to the bit: the same
/// eight lanes over the same chunks, summed in the same order, the same tail.
///
/// # Safety
///
/// The CPU has AVX2 and FMA, and every query in `qs` has at least `k.len()` values (the
/// vector loads read the first `k.len() / 8 * 8` of each unchecked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_avx2(qs: &[&[f32]], k: &[f32], scale: f32, mut put: impl FnMut(usize, f32)) {
    for (c, chunk) in qs.chunks(DOT_QUERIES).enumerate() {
        let put = |i: usize, v: f32| put(c * DOT_QUERIES + i, v);
        // SAFETY: each arm's `N` is `chunk.len()` (`chunks` gives 1 to 8 queries, so the last
        // arm has 1); the caller guarantees AVX2, FMA and the queries' lengths.
        unsafe {
            match chunk.len() {
                8 => dots_n::<8>(chunk, k, scale, put),
                7 => dots_n::<7>(chunk, k, scale, put),
                6 => dots_n::<6>(chunk, k, scale, put),
                5 => dots_n::<5>(chunk, k, scale, put),
                4 => dots_n::<4>(chunk, k, scale, put),
                3 => dots_n::<3>(chunk, k, scale, put),
                2 => dots_n::<2>(chunk, k, scale, put),
                _ => dots_n::<1>(chunk, k, scale, put),
            }
        }
    }
}

/// [`dots_avx2`] for `N` queries (`qs.len() == N`).
///
/// # Safety
///
/// The CPU has AVX2 and FMA; `qs.len() == N`, and each query has at least `k.len()` values
/// (the first `k.len() / 8 * 8` are read unchecked).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_n<const N: usize>(
    qs: &[&[f32]],
    k: &[f32],
    scale: f32,
    mut put: impl FnMut(usize, f32),
) {
    use std::arch::x86_64::*;
    let hd = k.len();
    let n8 = hd / 8 * 8;
    // The loads below read `hd / 8 * 8` values of each query unchecked.
    debug_assert!(qs.len() == N && qs.iter().all(|q| q.len() >= hd));
    let q: [*const f32; N] = std::array::from_fn(|i| qs[i].as_ptr());
    let mut acc = [_mm256_setzero_ps(); N];
    let mut d = 0;
    while d < n8 {
        // SAFETY: `d + 8 <= n8 <= hd`: the 8 values at `d` are inside `k`, and inside each
        // query (at least `hd` values, by the caller).
        unsafe {
            let kv = _mm256_loadu_ps(k.as_ptr().add(d));
            for i in 0..N {
                acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q[i].add(d)), kv, acc[i]);
            }
        }
        d += 8;
    }
    for i in 0..N {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds the 8 values stored.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i]) };
        let mut s = lanes.iter().sum::<f32>();
        for (x, y) in qs[i][n8..hd].iter().zip(&k[n8..hd]) {
            s += x * y;
        }
        put(i, s * scale);
    }
}

/// `out = sum over t of ps[t] * values[slots[t]]`, each output element accumulated over `t` in
/// order with a fused multiply-add from 0, as `axpy(.., true)` entry by entry gives it, to the
/// bit; the accumulators stay in registers (64 elements at a time) instead of memory.
///
/// # Safety
///
/// The CPU has AVX2 and FMA; `out` has at least `hd / 8 * 8` values, and every slot paired
/// with a probability satisfies `(slot + 1) * hd <= values.len()` (the vector loads and
/// stores are unchecked; the tail past `hd / 8 * 8` is indexed, checked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_sum_avx2(
    ps: &[f32],
    slots: &[usize],
    values: &[f32],
    hd: usize,
    out: &mut [f32],
) {
    // SAFETY: our caller's guarantees, which are this one's.
    unsafe { weighted_sum_avx2_from(ps, slots, values, hd, out, false) }
}

/// [`weighted_sum_avx2`], each chain starting from `out`'s values when `from_out` (a sum
/// continued over the next slots: the same floats as one sum over all of them, in order).
///
/// # Safety
///
/// As [`weighted_sum_avx2`]'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_sum_avx2_from(
    ps: &[f32],
    slots: &[usize],
    values: &[f32],
    hd: usize,
    out: &mut [f32],
    from_out: bool,
) {
    use std::arch::x86_64::*;
    let n8 = hd / 8 * 8;
    let mut d0 = 0;
    let base = out.as_mut_ptr();
    // SAFETY (the loads of `out` below, through `base`): `at + 8 <= n8 <= out.len()` (the
    // caller), and nothing else writes `out` meanwhile.
    let start = |at: usize| match from_out {
        true => unsafe { _mm256_loadu_ps(base.add(at)) },
        false => _mm256_setzero_ps(),
    };
    while d0 + 64 <= n8 {
        let mut acc: [__m256; 8] = std::array::from_fn(|i| start(d0 + 8 * i));
        for (&p, &slot) in ps.iter().zip(slots) {
            let pv = _mm256_set1_ps(p);
            // SAFETY: `d0 + 64 <= n8 <= hd`, so the 64 values at `slot * hd + d0` are inside
            // `values` (the caller guarantees `(slot + 1) * hd <= values.len()`).
            unsafe {
                let v = values.as_ptr().add(slot * hd + d0);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v.add(8 * i)), *a);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: `d0 + 8 * i + 8 <= n8 <= out.len()` (the caller).
            unsafe { _mm256_storeu_ps(base.add(d0 + 8 * i), *a) };
        }
        d0 += 64;
    }
    while d0 < n8 {
        let mut a = start(d0);
        for (&p, &slot) in ps.iter().zip(slots) {
            // SAFETY: `d0 + 8 <= n8 <= hd`, inside `slot`'s entry (as above).
            let v = unsafe { _mm256_loadu_ps(values.as_ptr().add(slot * hd + d0)) };
            a = _mm256_fmadd_ps(_mm256_set1_ps(p), v, a);
        }
        // SAFETY: `d0 + 8 <= n8 <= out.len()` (the caller).
        unsafe { _mm256_storeu_ps(base.add(d0), a) };
        d0 += 8;
    }
    for (d, o) in out.iter_mut().enumerate().take(hd).skip(n8) {
        let mut a = if from_out { *o } else { 0f32 };
        for (&p, &slot) in ps.iter().zip(slots) {
            a = p.mul_add(values[slot * hd + d], a);
        }
        *o = a;
    }
}

/// Whether attention may use AVX-512: the kernel path in use is an AVX-512 one (so
/// `REFUSION_CPU=avx2` keeps the whole forward on AVX2, as an AVX2-only CPU runs it).
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    use crate::model::kquants::{path, CpuPath};
    matches!(path(), CpuPath::Avx512 | CpuPath::Amx)
}

/// Tests set it to hold a path back, to compare the paths: 1 runs the AVX2 fast path where the
/// AVX-512 one would run, 2 the entry-by-entry loop where either would.
#[cfg(all(test, target_arch = "x86_64"))]
static HOLD_BACK: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// How far the tests hold the fast paths back (0: not at all, always outside the tests).
#[cfg(target_arch = "x86_64")]
fn held_back() -> u8 {
    #[cfg(test)]
    return HOLD_BACK.load(std::sync::atomic::Ordering::SeqCst);
    #[cfg(not(test))]
    0
}

/// Whether this CPU has AVX2 and FMA (checked once).
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32], avx2: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: only called when the CPU has AVX2 and FMA.
        return unsafe { dot_avx2(a, b) };
    }
    let _ = avx2;
    // Without FMA hardware, mul_add would be a slow libm call: plain multiply-add instead.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>()
}

#[inline]
fn axpy(o: &mut [f32], p: f32, v: &[f32], avx2: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: only called when the CPU has AVX2 and FMA.
        return unsafe { axpy_avx2(o, p, v) };
    }
    let _ = avx2;
    for (o, x) in o.iter_mut().zip(v) {
        *o += p * x;
    }
}

thread_local! {
    /// Per-thread scratch (scores and one converted entry), grown as needed and reused: no
    /// allocation per token or per forward once warm.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// What the unchecked loads and stores of [`attend`]'s kernels rely on, checked once per call
/// (a few comparisons per token): the shapes agree with the cache, and every slot a token sees
/// lies inside it. A safe caller can then never make them read or write out of bounds.
fn check_sight(q: &[f32], cache: &KvCache, visible: &[Visible<'_>], heads: Heads, out: &[f32]) {
    let shape = cache.shape();
    let n = visible.len() * heads.n * heads.dim;
    assert!(
        heads.dim == shape.head_dim && heads.kv == shape.n_kv_heads,
        "attention heads {heads:?} do not match the cache ({} KV heads of {})",
        shape.n_kv_heads,
        shape.head_dim
    );
    assert!(
        heads.kv > 0 && heads.n.is_multiple_of(heads.kv),
        "{heads:?}: query heads not whole groups"
    );
    assert!(
        q.len() >= n && out.len() >= n,
        "attention buffers shorter than the batch"
    );
    for v in visible {
        let inside = v.prefix.iter().all(|g| g.start + g.len <= shape.capacity)
            && v.count <= v.row_slots.len()
            && v.row_slots[..v.count].iter().all(|&s| s < shape.capacity);
        assert!(inside, "a token sees slots outside the cache");
    }
}

/// Tokens of one sequence handled together (one task per KV head): each prefix entry is read,
/// and decoded from another type than f32, once for all of them. 8 on AVX-512 (as tuned on
/// Zen 4 and Intel); on AVX2 up to 32 tokens of at most 64 queries: at 128 tokens over 4,096
/// bf16 entries, 8-token blocks spent 11% of the forward decoding each tile again (the Zen 3
/// VM). A thread's scores hold its block's queries over the whole context, and the memory
/// plan counts four rows per token of the widest chunk (`ModelSizes::scratch`): 64 rows a
/// thread stay inside it up to 32 threads at chunks of 512. Elsewhere 8.
fn block_tokens(group: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && !has_avx512() {
        return (AVX2_BLOCK_QUERIES / group.max(1)).clamp(1, 32);
    }
    let _ = group;
    8
}

/// `q`: `[n, n_heads, head_dim]` (after RoPE); writes `[n, n_heads, head_dim]` to `out`.
///
/// Batch-invariant: each token's result is computed in the same order (its prefix entries in
/// cache order, then its row's, one fixed dot product each, one softmax, the values summed in
/// the same order) whatever else is in the batch, how the batch is chunked, or where in the
/// cache its entries lie. So a request's answer does not depend on its neighbours.
pub fn attend(
    q: &[f32],
    cache: &KvCache,
    layer: usize,
    visible: &[Visible<'_>],
    heads: Heads,
    out: &mut [f32],
) {
    let (n_heads, n_kv_heads, head_dim) = (heads.n, heads.kv, heads.dim);
    check_sight(q, cache, visible, heads, out);
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let avx2 = has_avx2();
    let block = block_tokens(group);
    // Runs of at most `block` consecutive tokens of the same sequence.
    let mut blocks: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, v) in visible.iter().enumerate() {
        match blocks.last_mut() {
            Some(b) if b.len() < block && visible[b.start].seq == v.seq => b.end = i + 1,
            _ => blocks.push(i..i + 1),
        }
    }
    let stride = visible
        .iter()
        .map(|v| v.prefix_len() + v.count)
        .max()
        .unwrap_or(0);
    let n_tasks = blocks.len() * n_kv_heads;
    let out_ptr = SharedOut(out.as_mut_ptr());
    // Run on candle's worker pool (the threads that just ran the matmuls): a second pool would
    // oversubscribe the cores while candle's workers spin between operations.
    crate::model::pool::WorkerPool::global().execute_chunked(n_tasks, |tasks| {
        for task in tasks {
            let (b, g) = (task / n_kv_heads, task % n_kv_heads);
            let toks = blocks[b].clone();
            let keys = cache.head(layer, Kv::K, g);
            let values = cache.head(layer, Kv::V, g);
            let block = Block {
                q,
                n_heads,
                g,
                group,
                head_dim,
                prefix: visible[toks.start].prefix,
                toks,
                visible,
                stride,
                scale,
            };
            #[cfg(target_arch = "x86_64")]
            if avx2 && block.toks.len() * group <= MAX_QUERIES && held_back() < 2 {
                // SAFETY: the CPU has AVX2 and FMA; this task writes only its own tokens'
                // heads of `out`, which outlives the call; the slots `visible` names are the
                // cache's own, below its capacity, the length of each head's view; at most
                // MAX_QUERIES queries (checked just above).
                unsafe { block.run_avx2(&keys, &values, &out_ptr) };
                continue;
            }
            block.run_portable(&keys, &values, &out_ptr, avx2);
        }
    });
}

impl Block<'_> {
    /// Query (token `j`, head `h`) of this block: row index `j * group + h`.
    fn q_of(&self, j: usize, h: usize) -> &[f32] {
        let i = self.toks.start + j;
        &self.q[(i * self.n_heads + self.g * self.group + h) * self.head_dim..][..self.head_dim]
    }

    /// The block's queries, (token `j`, head `h`) at `j * group + h`, and how many there are
    /// (at most [`MAX_QUERIES`], as the fast path's callers guarantee).
    #[cfg(target_arch = "x86_64")]
    fn queries(&self) -> ([&[f32]; MAX_QUERIES], usize) {
        let mut qs: [&[f32]; MAX_QUERIES] = [&[]; MAX_QUERIES];
        for j in 0..self.toks.len() {
            for h in 0..self.group {
                qs[j * self.group + h] = self.q_of(j, h);
            }
        }
        (qs, self.toks.len() * self.group)
    }

    /// The portable loops (any cache type, any CPU): the block's scores against the shared
    /// prefix (each key read once for the whole block) and each token's own row entries, one
    /// softmax each, then the values summed in the same order.
    fn run_portable(
        &self,
        keys: &HeadView<'_>,
        values: &HeadView<'_>,
        out_ptr: &SharedOut,
        avx2: bool,
    ) {
        let (nt, group, stride, head_dim) =
            (self.toks.len(), self.group, self.stride, self.head_dim);
        let shared = self.visible[self.toks.start].prefix_len();
        SCRATCH.with(|cell| {
            let mut cell = cell.borrow_mut();
            let (scores, kbuf) = &mut *cell;
            let need = nt * group * stride;
            if scores.len() < need {
                scores.resize(need, 0.0);
            }
            if kbuf.len() < head_dim {
                kbuf.resize(head_dim, 0.0);
            }
            let scores = &mut scores[..need];
            let kbuf = &mut kbuf[..head_dim];
            let prefix_slots = || self.prefix.iter().flat_map(|s| s.start..s.start + s.len);
            // Scores against the shared prefix: one read of each key for the whole block.
            for (t, slot) in prefix_slots().enumerate() {
                let k = keys.row(slot, kbuf);
                for j in 0..nt {
                    for h in 0..group {
                        scores[(j * group + h) * stride + t] =
                            dot(self.q_of(j, h), k, avx2) * self.scale;
                    }
                }
            }
            // Scores against each token's own row entries.
            for j in 0..nt {
                let vis = self.visible[self.toks.start + j];
                for u in 0..vis.count {
                    let k = keys.row(vis.row_slots[u], kbuf);
                    for h in 0..group {
                        scores[(j * group + h) * stride + shared + u] =
                            dot(self.q_of(j, h), k, avx2) * self.scale;
                    }
                }
            }
            for j in 0..nt {
                let n_keys = shared + self.visible[self.toks.start + j].count;
                for h in 0..group {
                    softmax(&mut scores[(j * group + h) * stride..][..n_keys]);
                }
            }
            // SAFETY: each task writes the (token, head group) parts of `out` that belong to
            // its own tokens and KV head: disjoint across tasks; `out` outlives the call.
            let out_of = |j: usize, h: usize| unsafe {
                let i = self.toks.start + j;
                std::slice::from_raw_parts_mut(
                    out_ptr
                        .get()
                        .add((i * self.n_heads + self.g * group + h) * head_dim),
                    head_dim,
                )
            };
            for j in 0..nt {
                for h in 0..group {
                    out_of(j, h).fill(0.0);
                }
            }
            for (t, slot) in prefix_slots().enumerate() {
                let v = values.row(slot, kbuf);
                for j in 0..nt {
                    for h in 0..group {
                        axpy(out_of(j, h), scores[(j * group + h) * stride + t], v, avx2);
                    }
                }
            }
            for j in 0..nt {
                let vis = self.visible[self.toks.start + j];
                for u in 0..vis.count {
                    let v = values.row(vis.row_slots[u], kbuf);
                    for h in 0..group {
                        let p = scores[(j * group + h) * stride + shared + u];
                        axpy(out_of(j, h), p, v, avx2);
                    }
                }
            }
        });
    }
}

/// One task of [`attend`]: a block of one sequence's tokens and one KV head.
struct Block<'a> {
    q: &'a [f32],
    n_heads: usize,
    g: usize,
    group: usize,
    head_dim: usize,
    toks: std::ops::Range<usize>,
    visible: &'a [Visible<'a>],
    prefix: &'a [Segment],
    stride: usize,
    scale: f32,
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The fast path's scratch: scores, the slots one token's values are summed over, and a
    /// key row read from a cache of another type than f32.
    static FAST: RefCell<(Vec<f32>, Vec<usize>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

#[cfg(target_arch = "x86_64")]
impl Block<'_> {
    /// The f32 cache on AVX2: the same values as the portable loop below, to the bit (the
    /// kernels' notes), with the FMA chains of several queries interleaved.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA (AVX-512F is used only where [`has_avx512`] says the kernel
    /// path is an AVX-512 one, which only a CPU with it gets). `out` points at the whole
    /// `[n, n_heads, head_dim]` output, and no other thread reads or writes the heads this
    /// block writes (its tokens' heads `g * group..(g + 1) * group`) meanwhile. Every slot the
    /// block's tokens see (its prefix's, and each token's `row_slots[..count]`) is below
    /// `keys.len() / head_dim` and `values.len() / head_dim` (the kernels read entries
    /// unchecked).
    ///
    /// A cache of another type goes to [`Block::run_coded_avx2`] (its rows decoded a tile at
    /// a time into the same kernels), which asks the same of its caller.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, key_rows: &HeadView<'_>, value_rows: &HeadView<'_>, out: &SharedOut) {
        let (Some(keys), Some(values)) = (key_rows.as_f32(), value_rows.as_f32()) else {
            // SAFETY: our caller's guarantees, which are this one's.
            return unsafe { self.run_coded_avx2(key_rows, value_rows, out) };
        };
        let (hd, group) = (self.head_dim, self.group);
        let avx512 = has_avx512() && held_back() == 0;
        let nt = self.toks.len();
        let stride = self.stride;
        let (qs, nq) = self.queries();
        let qs = &qs[..nq];
        let shared: usize = self.prefix.iter().map(|s| s.len).sum();
        FAST.with(|cell| {
            let mut cell = cell.borrow_mut();
            let (scores, slots, kbuf) = &mut *cell;
            if scores.len() < nq * stride {
                scores.resize(nq * stride, 0.0);
            }
            kbuf.resize(hd, 0.0);
            slots.clear();
            slots.extend(self.prefix.iter().flat_map(|s| s.start..s.start + s.len));
            if avx512 && hd <= avx512::MAX_HEAD_DIM {
                // SAFETY: `avx512` only on an AVX-512 kernel path, which only a CPU with
                // AVX-512F gets; `hd <= MAX_HEAD_DIM` just checked; `qs` are the block's
                // `nq` queries of `hd` values; the slots index `keys` (our caller); `scores`
                // has `nq * stride` values, and `stride` is at least any token's prefix plus
                // row entries (the block's tokens share `slots`, the prefix).
                unsafe { self.scores_avx512(qs, keys, slots, &mut scores[..nq * stride]) };
            } else {
                let scores = &mut scores[..nq * stride];
                // SAFETY: AVX2 and FMA (our caller); every query has `hd` values; the slots
                // index `keys` (our caller).
                unsafe {
                    self.prefix_scores(qs, keys, slots, 0, scores, false);
                    self.row_scores_avx2(qs, key_rows, kbuf, scores, shared);
                }
            }
            for j in 0..nt {
                let n_keys = shared + self.visible[self.toks.start + j].count;
                for h in 0..group {
                    softmax(&mut scores[(j * group + h) * stride..][..n_keys]);
                }
            }
            for j in 0..nt {
                let vis = self.visible[self.toks.start + j];
                slots.truncate(shared);
                slots.extend_from_slice(&vis.row_slots[..vis.count]);
                let i = self.toks.start + j;
                // SAFETY: head `h < group` of token `i` lies inside `out` (our caller), and the
                // (token, head) slices belong to this task only.
                let o = |h: usize| unsafe {
                    out.get().add((i * self.n_heads + self.g * group + h) * hd)
                };
                let ps = |h: usize| &scores[(j * group + h) * stride..][..slots.len()];
                let mut h = 0;
                // The calls below: `avx512` only on an AVX-512 kernel path (the CPU has
                // AVX-512F), AVX2 and FMA by our caller; each `o(h)` is this task's own `hd`
                // values of head `h` of token `i`; `ps(h)` has `slots.len()` values; the slots
                // index `values` (our caller).
                if avx512 {
                    while h + 2 <= group {
                        // SAFETY: as said above.
                        unsafe {
                            avx512::weighted_sum_avx512::<2>(
                                [ps(h), ps(h + 1)],
                                slots,
                                values,
                                hd,
                                [o(h), o(h + 1)],
                            )
                        };
                        h += 2;
                    }
                    if h < group {
                        // SAFETY: as said above.
                        unsafe {
                            avx512::weighted_sum_avx512::<1>([ps(h)], slots, values, hd, [o(h)])
                        };
                        h += 1;
                    }
                }
                for h in h..group {
                    // SAFETY: as said above.
                    let o = unsafe { std::slice::from_raw_parts_mut(o(h), hd) };
                    // SAFETY: as said above; `o` has `hd` values.
                    unsafe { weighted_sum_avx2(ps(h), slots, values, hd, o) };
                }
            }
        });
    }
}

#[cfg(target_arch = "x86_64")]
impl Block<'_> {
    /// The scores of the block's queries against their rows' own entries, after the `shared`
    /// prefix scores. Tokens of one row (a planning forward's masks, a slot's tokens) see
    /// the same entries up to their own: each entry is read once and dotted with every query
    /// of the block's tokens that see it, so the FMA chains of up to [`DOT_QUERIES`] queries
    /// run side by side (one token's `group` queries alone left the units waiting on each
    /// chain's latency). Each score is the same dot product as one at a time, to the bit.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA, and each of `qs` has at least `head_dim` values (the keys,
    /// read in place or into `kbuf` of `head_dim` values, and `scores` are indexed, checked).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row_scores_avx2(
        &self,
        qs: &[&[f32]],
        keys: &HeadView<'_>,
        kbuf: &mut [f32],
        scores: &mut [f32],
        shared: usize,
    ) {
        let stride = self.stride;
        let mut sel: [&[f32]; MAX_QUERIES] = [&[]; MAX_QUERIES];
        let mut at = [0usize; MAX_QUERIES];
        for (j, most) in self.rows() {
            let row = self.vis(j).row_slots;
            for (u, &slot) in row[..most].iter().enumerate() {
                let mut n = 0;
                for qi in self.row_queries(j, u) {
                    sel[n] = qs[qi];
                    at[n] = qi * stride + shared + u;
                    n += 1;
                }
                let k = keys.row(slot, kbuf);
                // SAFETY: AVX2 and FMA (our caller); the queries have `hd` values, as `k`.
                unsafe { dots_avx2(&sel[..n], k, self.scale, |i, v| scores[at[i]] = v) };
            }
        }
    }

    /// Each query's scores against `keys`' rows `slots`, at `t0..` of its run of `stride`:
    /// 16 queries at a time with [`avx512::dots`] when `avx512`, else in tiles of queries by
    /// keys with [`avx2::scores`] (the same floats to the bit).
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA, and AVX-512F when `avx512` (then `head_dim <=
    /// avx512::MAX_HEAD_DIM` and at most 16 queries a call, as [`avx512::dots`] asks); each
    /// of `qs` has at least `head_dim` values; every slot satisfies `(slot + 1) * head_dim
    /// <= keys.len()`; `t0 + slots.len() <= stride` and `scores` holds `qs.len() * stride`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn prefix_scores(
        &self,
        qs: &[&[f32]],
        keys: &[f32],
        slots: &[usize],
        t0: usize,
        scores: &mut [f32],
        avx512: bool,
    ) {
        let (hd, stride) = (self.head_dim, self.stride);
        if !avx512 {
            // SAFETY: AVX2 and FMA (our caller); every query has `hd` values; the slots index
            // `keys` (our caller).
            unsafe {
                avx2::scores(qs, keys, slots, hd, self.scale, |qi, t, v| {
                    scores[qi * stride + t0 + t] = v
                })
            };
            return;
        }
        let mut at = [0usize; 16];
        for (c, chunk) in qs.chunks(16).enumerate() {
            for (i, a) in at.iter_mut().enumerate().take(chunk.len()) {
                *a = (16 * c + i) * stride + t0;
            }
            // SAFETY: AVX-512F, `hd`, the queries' lengths and the slots by our caller; at
            // most 16 queries; query `qi`'s scores `t0..t0 + slots.len()` lie within its run.
            unsafe {
                avx512::dots(
                    chunk,
                    &at[..chunk.len()],
                    keys,
                    hd,
                    slots,
                    self.scale,
                    scores,
                )
            };
        }
    }

    /// The scores against the shared prefix (`slots`) and the rows' own entries with
    /// [`avx512::dots`], 16 queries at a time. A row's entries are dotted with each query of
    /// its tokens up to the block's last token's count (the rest of a token's scores past its
    /// own count are written but never read: softmax and the values stop at its count).
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F; `head_dim <= avx512::MAX_HEAD_DIM`; `qs` holds the block's
    /// `toks.len() * group` queries, each of at least `head_dim` values; every slot in `slots`
    /// and in the block's tokens' `row_slots[..count]` is below `keys.len() / head_dim`;
    /// `scores` holds `qs.len() * stride` values, and `slots.len()` plus any of the block's
    /// tokens' `count` is at most `stride`.
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_avx512(
        &self,
        qs: &[&[f32]],
        keys: &[f32],
        slots: &[usize],
        scores: &mut [f32],
    ) {
        let (hd, stride) = (self.head_dim, self.stride);
        // SAFETY: AVX-512F (AVX2 and FMA with it on an AVX-512 kernel path), `hd`, the
        // queries' lengths and the slots by our caller; `slots.len() <= stride`.
        unsafe { self.prefix_scores(qs, keys, slots, 0, scores, true) };
        let mut at = [0usize; 16];
        let mut sel: [&[f32]; 16] = [&[]; 16];
        for (j, most) in self.rows() {
            let row = &self.vis(j).row_slots[..most];
            let mut n = 0;
            for qi in self.row_queries(j, 0) {
                sel[n] = qs[qi];
                at[n] = qi * stride + slots.len();
                n += 1;
                if n == 16 {
                    // SAFETY: as above; the row's `most` scores of query `qi` start at
                    // `qi * stride + slots.len()`, and `slots.len() + most <= stride`.
                    unsafe { avx512::dots(&sel, &at, keys, hd, row, self.scale, scores) };
                    n = 0;
                }
            }
            if n > 0 {
                // SAFETY: as just above, for the last `n` queries.
                unsafe { avx512::dots(&sel[..n], &at[..n], keys, hd, row, self.scale, scores) };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Block<'_> {
    /// What the block's token `j` sees.
    fn vis(&self, j: usize) -> Visible<'_> {
        self.visible[self.toks.start + j]
    }

    /// Whether the block's tokens `a` and `b` are of one row (see the same private slots).
    fn same_row(&self, a: usize, b: usize) -> bool {
        std::ptr::eq(
            self.vis(a).row_slots.as_ptr(),
            self.vis(b).row_slots.as_ptr(),
        )
    }

    /// The queries (indices into the block's) of the tokens of token `j`'s row from `j` on
    /// that see the row's entry `u`: each such token's `group` heads.
    fn row_queries(&self, j: usize, u: usize) -> impl Iterator<Item = usize> + '_ {
        let group = self.group;
        (j..self.toks.len())
            .filter(move |&j2| self.same_row(j, j2) && self.vis(j2).count > u)
            .flat_map(move |j2| j2 * group..(j2 + 1) * group)
    }

    /// The block's rows, each once: its first token and the most entries one of its tokens
    /// sees (a row's tokens see the same slots, each its first `count`).
    fn rows(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let nt = self.toks.len();
        (0..nt)
            .filter(move |&j| !(0..j).any(|j0| self.same_row(j0, j)))
            .map(move |j| {
                let most = (j..nt)
                    .filter(|&j2| self.same_row(j, j2))
                    .map(|j2| self.vis(j2).count)
                    .max()
                    .unwrap_or(0);
                (j, most)
            })
    }
}

/// Softmax in place, in f32: the maximum, each exponential (our [`expf`], vectorized where
/// this is inlined), their sum in [`expf::LANES`] lanes folded in a fixed tree, and each
/// divided by it. torch's CPU softmax likewise takes a vectorized `exp` and a lane-wise sum;
/// libm's `expf` per score and one sum in order cost about as much as the dot products. A
/// lone NaN score weighs 0 (a NaN row of scores still gives NaN, as does its NaN value).
#[inline(always)]
fn softmax(s: &mut [f32]) {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let sum = expf::exp_in_place(s, max);
    for x in s.iter_mut() {
        *x /= sum;
    }
}

/// The output buffer, shared by the pool's threads (each writes a disjoint part).
struct SharedOut(*mut f32);

// SAFETY: the pointer is only used to build disjoint slices, one per task.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn get(&self) -> *mut f32 {
        self.0
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod coded;
#[cfg(all(test, target_arch = "x86_64"))]
mod tests;
