//! Causal attention of a flat batch over the KV cache, on the CPU.
//!
//! Token `i` sees its sequence's shared prefix (read in place from the cache by every token:
//! never copied per row) and the private slots of its own row up to and including its own
//! entry, in cache order. Positions play no part here: they entered through RoPE.

use std::cell::RefCell;

use crate::kv::{HeadView, Kv, KvCache, Segment};

/// What one new token attends to: its sequence's shared prefix (segments of slots, in cache
/// order) and the first `count` private slots of its row.
#[derive(Debug, Clone, Copy)]
pub struct Visible<'a> {
    /// The token's sequence (tokens of one sequence see the same prefix).
    pub seq: u32,
    pub prefix: &'a [Segment],
    pub row_slots: &'a [usize],
    pub count: usize,
}

impl Visible<'_> {
    pub fn prefix_len(&self) -> usize {
        self.prefix.iter().map(|s| s.len).sum()
    }
}

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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_generic(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(o: &mut [f32], p: f32, v: &[f32]) {
    axpy_generic(o, p, v)
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

/// One cached entry as f32: borrowed in place from an f32 cache, converted into `buf` from f16.
#[inline]
fn entry<'a>(view: &'a HeadView<'_>, slot: usize, hd: usize, buf: &'a mut [f32]) -> &'a [f32] {
    match view {
        HeadView::F32(v) => &v[slot * hd..(slot + 1) * hd],
        HeadView::F16(v) => {
            for (o, x) in buf.iter_mut().zip(&v[slot * hd..(slot + 1) * hd]) {
                *o = x.to_f32();
            }
            buf
        }
    }
}

thread_local! {
    /// Per-thread scratch (scores and one converted entry), grown as needed and reused: no
    /// allocation per token or per forward once warm.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `q`: `[n, n_heads, head_dim]` (after RoPE); writes `[n, n_heads, head_dim]` to `out`.
///
/// Batch-invariant: each token's result is computed in the same order (its prefix entries in
/// cache order, then its row's, one fixed dot product each, one softmax, the values summed in
/// the same order) whatever else is in the batch, how the batch is chunked, or where in the
/// cache its entries lie. So a request's answer does not depend on its neighbours.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    cache: &KvCache,
    layer: usize,
    visible: &[Visible<'_>],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    /// Tokens of one sequence handled together: each prefix entry is read once for all of them.
    const BLOCK: usize = 8;
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let avx2 = has_avx2();
    // Runs of at most BLOCK consecutive tokens of the same sequence.
    let mut blocks: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, v) in visible.iter().enumerate() {
        match blocks.last_mut() {
            Some(b) if b.len() < BLOCK && visible[b.start].seq == v.seq => b.end = i + 1,
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
    candle_core::utils::barrier_pool().execute_chunked(n_tasks, |tasks| {
        for task in tasks {
            let (b, g) = (task / n_kv_heads, task % n_kv_heads);
            let toks = blocks[b].clone();
            let nt = toks.len();
            let prefix = visible[toks.start].prefix;
            let shared = visible[toks.start].prefix_len();
            let keys = cache.head(layer, Kv::K, g);
            let values = cache.head(layer, Kv::V, g);
            // Query (token, head) pairs of this task, in order: row index = j * group + h.
            let q_of = |j: usize, h: usize| {
                let i = toks.start + j;
                &q[(i * n_heads + g * group + h) * head_dim..][..head_dim]
            };
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
                let prefix_slots = || prefix.iter().flat_map(|s| s.start..s.start + s.len);
                // Scores against the shared prefix: one read of each key for the whole block.
                for (t, slot) in prefix_slots().enumerate() {
                    let k = entry(&keys, slot, head_dim, kbuf);
                    for j in 0..nt {
                        for h in 0..group {
                            scores[(j * group + h) * stride + t] = dot(q_of(j, h), k, avx2) * scale;
                        }
                    }
                }
                // Scores against each token's own row entries.
                for j in 0..nt {
                    let vis = visible[toks.start + j];
                    for u in 0..vis.count {
                        let k = entry(&keys, vis.row_slots[u], head_dim, kbuf);
                        for h in 0..group {
                            scores[(j * group + h) * stride + shared + u] =
                                dot(q_of(j, h), k, avx2) * scale;
                        }
                    }
                }
                for j in 0..nt {
                    let n_keys = shared + visible[toks.start + j].count;
                    for h in 0..group {
                        let s = &mut scores[(j * group + h) * stride..][..n_keys];
                        let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                        let mut sum = 0f32;
                        for x in s.iter_mut() {
                            *x = (*x - max).exp();
                            sum += *x;
                        }
                        for x in s.iter_mut() {
                            *x /= sum;
                        }
                    }
                }
                // SAFETY: each task writes the (token, head group) parts of `out` that belong
                // to its own tokens and KV head: disjoint across tasks; `out` outlives the call.
                let out_of = |j: usize, h: usize| unsafe {
                    let i = toks.start + j;
                    std::slice::from_raw_parts_mut(
                        out_ptr.get().add((i * n_heads + g * group + h) * head_dim),
                        head_dim,
                    )
                };
                for j in 0..nt {
                    for h in 0..group {
                        out_of(j, h).fill(0.0);
                    }
                }
                for (t, slot) in prefix_slots().enumerate() {
                    let v = entry(&values, slot, head_dim, kbuf);
                    for j in 0..nt {
                        for h in 0..group {
                            axpy(out_of(j, h), scores[(j * group + h) * stride + t], v, avx2);
                        }
                    }
                }
                for j in 0..nt {
                    let vis = visible[toks.start + j];
                    for u in 0..vis.count {
                        let v = entry(&values, vis.row_slots[u], head_dim, kbuf);
                        for h in 0..group {
                            axpy(
                                out_of(j, h),
                                scores[(j * group + h) * stride + shared + u],
                                v,
                                avx2,
                            );
                        }
                    }
                }
            });
        }
    });
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
