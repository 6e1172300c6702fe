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
    let group = n_heads / n_kv_heads;
    let shared = cache.shared_len();
    let scale = 1.0 / (head_dim as f32).sqrt();
    let avx2 = has_avx2();
    let chunk = group * head_dim;
    let n_tasks = out.len() / chunk;
    let out_ptr = SharedOut(out.as_mut_ptr());
    // Run on candle's worker pool (the threads that just ran the matmuls): a second pool would
    // oversubscribe the cores while candle's workers spin between operations.
    candle_core::utils::barrier_pool().execute_chunked(n_tasks, |tasks| {
        for task in tasks {
            // SAFETY: every task writes its own `chunk` of `out`, which outlives the call.
            let out =
                unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(task * chunk), chunk) };
            let (i, g) = (task / n_kv_heads, task % n_kv_heads);
            let vis = visible[i];
            let keys = cache.head(layer, false, g);
            let values = cache.head(layer, true, g);
            let n_keys = shared + vis.count;
            let slot_of = |t: usize| {
                if t < shared {
                    t
                } else {
                    vis.row_slots[t - shared]
                }
            };
            SCRATCH.with(|cell| {
                let mut cell = cell.borrow_mut();
                let (scores, kbuf) = &mut *cell;
                if scores.len() < group * n_keys {
                    scores.resize(group * n_keys, 0.0);
                }
                if kbuf.len() < head_dim {
                    kbuf.resize(head_dim, 0.0);
                }
                let scores = &mut scores[..group * n_keys];
                let kbuf = &mut kbuf[..head_dim];
                for t in 0..n_keys {
                    let k = entry(&keys, slot_of(t), head_dim, kbuf);
                    for h in 0..group {
                        let qh = &q[(i * n_heads + g * group + h) * head_dim..][..head_dim];
                        scores[h * n_keys + t] = dot(qh, k, avx2) * scale;
                    }
                }
                for h in 0..group {
                    let s = &mut scores[h * n_keys..(h + 1) * n_keys];
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
                out.fill(0.0);
                for t in 0..n_keys {
                    let v = entry(&values, slot_of(t), head_dim, kbuf);
                    for h in 0..group {
                        let p = scores[h * n_keys + t];
                        axpy(&mut out[h * head_dim..(h + 1) * head_dim], p, v, avx2);
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
