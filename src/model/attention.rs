//! Causal attention of a flat batch over the KV cache, on the CPU.
//!
//! Token `i` sees the shared prefix (read in place from the cache by every token: never copied
//! per row) and the private slots of its own row up to and including its own entry, in cache
//! order. Positions play no part here: they entered through RoPE.

use std::cell::RefCell;

use crate::kv::{HeadView, KvCache};

/// What one new token may attend to beyond the shared prefix: the first `count` private slots
/// of its row.
#[derive(Debug, Clone, Copy)]
pub struct Visible<'a> {
    pub row_slots: &'a [usize],
    pub count: usize,
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
    // For a few tokens, per-entry dot products beat a matrix product (its packing overhead).
    if cache.cache_type() == crate::kv::CacheType::F32
        && cache.shared_len() > 0
        && visible.len() >= 4
    {
        attend_gemm(q, cache, layer, visible, n_heads, n_kv_heads, head_dim, out);
    } else {
        attend_direct(q, cache, layer, visible, n_heads, n_kv_heads, head_dim, out);
    }
}

/// The f32-cache path: scores against the shared prefix and the weighted sum of its values are
/// two matrix products per query head (all tokens of the batch at once), run with the `gemm`
/// crate straight on the cache's memory; each token's own row entries are added on top.
#[allow(clippy::too_many_arguments)]
fn attend_gemm(
    q: &[f32],
    cache: &KvCache,
    layer: usize,
    visible: &[Visible<'_>],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let group = n_heads / n_kv_heads;
    let shared = cache.shared_len();
    let scale = 1.0 / (head_dim as f32).sqrt();
    let avx2 = has_avx2();
    let n = visible.len();
    let max_private = visible.iter().map(|v| v.count).max().unwrap_or(0);
    let stride = shared + max_private;
    let out_ptr = SharedOut(out.as_mut_ptr());
    let row = (n_heads * head_dim) as isize;
    candle_core::utils::barrier_pool().execute_chunked(n_heads, |heads| {
        for head in heads {
            let g = head / group;
            let (HeadView::F32(keys), HeadView::F32(values)) =
                (cache.head(layer, false, g), cache.head(layer, true, g))
            else {
                unreachable!("f32 cache");
            };
            SCRATCH.with(|cell| {
                let mut cell = cell.borrow_mut();
                let (scores, _) = &mut *cell;
                if scores.len() < n * stride {
                    scores.resize(n * stride, 0.0);
                }
                let scores = &mut scores[..n * stride];
                // S[i, t] = scale * q_i · k_t over the shared prefix.
                // SAFETY: all pointers address live buffers with the given strides and extents:
                // q is [n, n_heads, head_dim], keys/values hold `shared` entries of head_dim.
                unsafe {
                    gemm::gemm(
                        n,
                        shared,
                        head_dim,
                        scores.as_mut_ptr(),
                        1,
                        stride as isize,
                        false,
                        q.as_ptr().add(head * head_dim),
                        1,
                        row,
                        keys.as_ptr(),
                        head_dim as isize,
                        1,
                        0.0,
                        scale,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                for (i, vis) in visible.iter().enumerate() {
                    let qh = &q[(i * n_heads + head) * head_dim..][..head_dim];
                    for u in 0..vis.count {
                        let slot = vis.row_slots[u];
                        scores[i * stride + shared + u] =
                            dot(qh, &keys[slot * head_dim..(slot + 1) * head_dim], avx2) * scale;
                    }
                    let s = &mut scores[i * stride..i * stride + shared + vis.count];
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
                // O[i, :] = sum_t P[i, t] v_t over the shared prefix, then the row entries.
                // SAFETY: as above; this task writes only column block `head` of `out`.
                unsafe {
                    gemm::gemm(
                        n,
                        head_dim,
                        shared,
                        out_ptr.get().add(head * head_dim),
                        1,
                        row,
                        false,
                        scores.as_ptr(),
                        1,
                        stride as isize,
                        values.as_ptr(),
                        1,
                        head_dim as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                for (i, vis) in visible.iter().enumerate() {
                    // SAFETY: the (token i, head) slice belongs to this task only.
                    let o = unsafe {
                        std::slice::from_raw_parts_mut(
                            out_ptr.get().add((i * n_heads + head) * head_dim),
                            head_dim,
                        )
                    };
                    for u in 0..vis.count {
                        let slot = vis.row_slots[u];
                        axpy(
                            o,
                            scores[i * stride + shared + u],
                            &values[slot * head_dim..(slot + 1) * head_dim],
                            avx2,
                        );
                    }
                }
            });
        }
    });
}

/// The direct path (f16 cache, or an empty shared prefix): dot products per entry.
#[allow(clippy::too_many_arguments)]
fn attend_direct(
    q: &[f32],
    cache: &KvCache,
    layer: usize,
    visible: &[Visible<'_>],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    /// Tokens handled together: each shared-prefix entry is read once for all of them.
    const BLOCK: usize = 8;
    let group = n_heads / n_kv_heads;
    let shared = cache.shared_len();
    let scale = 1.0 / (head_dim as f32).sqrt();
    let avx2 = has_avx2();
    let n = visible.len();
    let n_blocks = n.div_ceil(BLOCK);
    let n_tasks = n_blocks * n_kv_heads;
    let max_private = visible.iter().map(|v| v.count).max().unwrap_or(0);
    let stride = shared + max_private;
    let out_ptr = SharedOut(out.as_mut_ptr());
    // Run on candle's worker pool (the threads that just ran the matmuls): a second pool would
    // oversubscribe the cores while candle's workers spin between operations.
    candle_core::utils::barrier_pool().execute_chunked(n_tasks, |tasks| {
        for task in tasks {
            let (b, g) = (task / n_kv_heads, task % n_kv_heads);
            let toks = b * BLOCK..((b + 1) * BLOCK).min(n);
            let nt = toks.len();
            let keys = cache.head(layer, false, g);
            let values = cache.head(layer, true, g);
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
                // Scores against the shared prefix: one read of each key for the whole block.
                for t in 0..shared {
                    let k = entry(&keys, t, head_dim, kbuf);
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
                for t in 0..shared {
                    let v = entry(&values, t, head_dim, kbuf);
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
