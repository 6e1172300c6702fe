//! The layers that run on the CPU with our kernels, over plain f32 buffers kept from one
//! forward to the next.
//!
//! candle's tensor ops allocate (and zero) a new buffer for every result, and spread their
//! larger element-wise work (RMS norms of more than 32 rows, SiLU, products, sums) over
//! rayon's pool: a second set of threads that then spins beside the worker pool our products
//! and attention run on, on the same cores. Here every step writes into a buffer of
//! [`Scratch`], in place where it can, and the element-wise work of a large batch runs on the
//! same worker pool as the products. Each value is computed with exactly the float operations
//! candle uses (tested to the bit), so a forward gives the same logits either way.

use std::ops::Range;

/// Buffers of one forward chunk, grown to the largest chunk seen and then reused.
#[derive(Default)]
pub struct Scratch {
    /// Normalized hidden states (the input of q/k/v and of gate/up).
    pub h: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub attn: Vec<f32>,
    /// The output of the attention's projection, then of the feed-forward's.
    pub o: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
}

/// Sets `buf` to `len` values; what it held is left as it was (every caller overwrites it).
pub fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    &mut buf[..len]
}

/// Element-wise work below this many values runs on the calling thread (a round on the pool
/// costs a few microseconds).
const PARALLEL_VALUES: usize = 16 * 1024;

/// `f` over `0..n_rows` in ranges: on the worker pool when `n_rows * row_len` is large.
fn for_rows(n_rows: usize, row_len: usize, f: impl Fn(Range<usize>) + Sync) {
    if n_rows * row_len < PARALLEL_VALUES || n_rows < 2 {
        f(0..n_rows);
    } else {
        crate::model::pool::WorkerPool::global().execute_chunked(n_rows, f);
    }
}

/// A pointer shared by the tasks of one parallel loop, each writing its own rows.
#[derive(Clone, Copy)]
struct Rows(*mut f32);
// SAFETY: the loops below hand each task disjoint rows.
unsafe impl Sync for Rows {}
unsafe impl Send for Rows {}

impl Rows {
    /// Rows `r` of `len` values.
    ///
    /// # Safety
    ///
    /// `r.start <= r.end`, the values `r.start * len..r.end * len` are inside the buffer the
    /// pointer was taken from, that buffer outlives `'a`, and nothing else reads or writes those
    /// values while the slice lives (each task of a loop gets its own rows).
    unsafe fn get<'a>(self, r: &Range<usize>, len: usize) -> &'a mut [f32] {
        // SAFETY: the caller guarantees `get`'s conditions, which are `span`'s for these bounds.
        unsafe { self.span(r.start * len, r.end * len) }
    }

    /// Values `a..b`.
    ///
    /// # Safety
    ///
    /// `a <= b`, the values `a..b` are inside the buffer the pointer was taken from, that buffer
    /// outlives `'a`, and nothing else reads or writes those values while the slice lives.
    unsafe fn span<'a>(self, a: usize, b: usize) -> &'a mut [f32] {
        // SAFETY: the caller guarantees `a..b` is inside the live buffer and not aliased.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(a), b - a) }
    }
}

/// One row's RMS norm as candle's CPU kernel computes it: the squares summed in order in f32,
/// `sqrt(sum / n + eps)`, then each value divided by it and times its weight.
#[inline]
fn rms_row(src: &[f32], w: &[f32], eps: f32, dst: &mut [f32]) {
    let sum2: f32 = src.iter().map(|&v| v * v).sum();
    let m = (sum2 / src.len() as f32 + eps).sqrt();
    for ((d, &s), &a) in dst.iter_mut().zip(src).zip(w) {
        *d = s / m * a;
    }
}

/// `out` = each row of `x` (rows of `w.len()` values) RMS-normalized and scaled by `w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(x.len() == out.len() && x.len().is_multiple_of(n));
    let dst = Rows(out.as_mut_ptr());
    for_rows(x.len() / n, n, |r| {
        // SAFETY: each task writes its own rows of `out`.
        let d = unsafe { dst.get(&r, n) };
        for (src, dst) in x[r.start * n..r.end * n]
            .chunks_exact(n)
            .zip(d.chunks_exact_mut(n))
        {
            rms_row(src, w, eps, dst);
        }
    });
}

/// [`rms_norm`] of every row of `x` in place (the per-head q and k norms).
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    assert!(x.len().is_multiple_of(n));
    let rows = Rows(x.as_mut_ptr());
    for_rows(x.len() / n, n, |r| {
        // SAFETY: each task reads and writes its own rows.
        let x = unsafe { rows.get(&r, n) };
        for row in x.chunks_exact_mut(n) {
            rms_row_in_place(row, w, eps);
        }
    });
}

/// [`rms_row`] in place: the row copied to the stack first (to the heap past 512 values).
#[inline]
fn rms_row_in_place(row: &mut [f32], w: &[f32], eps: f32) {
    let mut tmp = [0f32; 512];
    if let Some(src) = tmp.get_mut(..row.len()) {
        src.copy_from_slice(row);
        rms_row(src, w, eps, row);
    } else {
        let src = row.to_vec();
        rms_row(&src, w, eps, row);
    }
}

/// `x += y` (a residual connection), then `out` = each row of `x` RMS-normalized and scaled by
/// `w`: [`add_in_place`] and [`rms_norm`] in one pass over the rows.
pub fn add_and_norm(x: &mut [f32], y: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(x.len() == y.len() && x.len() == out.len() && x.len().is_multiple_of(n));
    let (xs, dst) = (Rows(x.as_mut_ptr()), Rows(out.as_mut_ptr()));
    for_rows(x.len() / n, n, |r| {
        // SAFETY: each task reads and writes its own rows of `x` and `out`.
        let (x, d) = unsafe { (xs.get(&r, n), dst.get(&r, n)) };
        for ((x, y), d) in x
            .chunks_exact_mut(n)
            .zip(y[r.start * n..r.end * n].chunks_exact(n))
            .zip(d.chunks_exact_mut(n))
        {
            for (x, &y) in x.iter_mut().zip(y) {
                *x += y;
            }
            rms_row(x, w, eps, d);
        }
    });
}

/// Each token's query and key heads RMS-normalized (`qw`, `kw`) and rotated by its row of
/// `rope`, in place: per-head norms then RoPE, in one pass over the tokens.
pub fn norm_and_rope(
    q: &mut [f32],
    k: &mut [f32],
    (qw, kw): (&[f32], &[f32]),
    eps: f32,
    rope: &RopeTable,
) {
    let n = rope.tokens();
    assert!(n > 0 && q.len().is_multiple_of(n) && k.len().is_multiple_of(n));
    let (ql, kl) = (q.len() / n, k.len() / n);
    let (qs, ks) = (Rows(q.as_mut_ptr()), Rows(k.as_mut_ptr()));
    for_rows(n, ql + kl, |r| {
        // SAFETY: each task reads and writes its own tokens' heads.
        let (q, k) = unsafe { (qs.get(&r, ql), ks.get(&r, kl)) };
        for (j, (q, k)) in q
            .chunks_exact_mut(ql)
            .zip(k.chunks_exact_mut(kl))
            .enumerate()
        {
            for (x, w) in [(&mut *q, qw), (&mut *k, kw)] {
                for head in x.chunks_exact_mut(w.len()) {
                    rms_row_in_place(head, w, eps);
                }
                rope.rotate(x, r.start + j);
            }
        }
    });
}

/// `x += y`, element by element (the residual connections).
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    assert!(x.len() == y.len());
    const ROW: usize = 1024;
    let n_rows = x.len().div_ceil(ROW);
    let len = x.len();
    let dst = Rows(x.as_mut_ptr());
    for_rows(n_rows, ROW, |r| {
        let (a, b) = (r.start * ROW, (r.end * ROW).min(len));
        // SAFETY: each task writes its own range of `x`.
        let x = unsafe { dst.span(a, b) };
        for (x, &y) in x.iter_mut().zip(&y[a..b]) {
            *x += y;
        }
    });
}

/// `gate = silu(gate) * up`, with candle's SiLU (`v / (1 + exp(-v))`).
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    assert!(gate.len() == up.len());
    const ROW: usize = 1024;
    let len = gate.len();
    let n_rows = len.div_ceil(ROW);
    let dst = Rows(gate.as_mut_ptr());
    for_rows(n_rows, ROW, |r| {
        let (a, b) = (r.start * ROW, (r.end * ROW).min(len));
        // SAFETY: each task writes its own range of `gate`.
        let g = unsafe { dst.span(a, b) };
        for (g, &u) in g.iter_mut().zip(&up[a..b]) {
            let v = *g;
            *g = (v / (1.0 + (-v).exp())) * u;
        }
    });
}

/// RoPE's cosines and sines for each token of a chunk (computed once, used by every layer).
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// The angles `position * inv_freq[j]` in f32, as transformers computes them.
    pub fn new(positions: &[u32], inv_freq: &[f32]) -> RopeTable {
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Tokens in the table.
    pub fn tokens(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates `x` (`[n, heads, 2 * half]`) in place, token `i` by its row of the table
    /// (rotate-half layout, as transformers' Qwen3).
    pub fn apply(&self, x: &mut [f32], heads: usize) {
        for (i, tok) in x.chunks_exact_mut(heads * 2 * self.half).enumerate() {
            self.rotate(tok, i);
        }
    }

    /// Rotates every head of one token (`[heads, 2 * half]`) by row `i` of the table.
    fn rotate(&self, tok: &mut [f32], i: usize) {
        let half = self.half;
        let cos = &self.cos[i * half..(i + 1) * half];
        let sin = &self.sin[i * half..(i + 1) * half];
        for v in tok.chunks_exact_mut(2 * half) {
            let (lo, hi) = v.split_at_mut(half);
            for j in 0..half {
                let (a, b) = (lo[j], hi[j]);
                lo[j] = a * cos[j] + (-b) * sin[j];
                hi[j] = b * cos[j] + a * sin[j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    fn host(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Small and large batches (the large ones on the worker pool): candle's floats to the bit.
    #[test]
    fn the_element_wise_steps_give_candles_floats() {
        for rows in [1, 3, 40, 700] {
            let n = 128;
            let x = values(rows * n, rows as u64);
            let w = values(n, 99);
            let xt = Tensor::from_vec(x.clone(), (rows, n), &Device::Cpu).unwrap();
            let wt = Tensor::from_vec(w.clone(), n, &Device::Cpu).unwrap();
            let want = host(&candle_nn::ops::rms_norm(&xt, &wt, 1e-6).unwrap());
            let mut out = vec![0f32; rows * n];
            rms_norm(&x, &w, 1e-6, &mut out);
            assert_eq!(bits(&out), bits(&want), "rms_norm over {rows} rows");
            let mut inplace = x.clone();
            rms_norm_in_place(&mut inplace, &w, 1e-6);
            assert_eq!(
                bits(&inplace),
                bits(&want),
                "rms_norm in place over {rows} rows"
            );

            let y = values(rows * n, 7 + rows as u64);
            let yt = Tensor::from_vec(y.clone(), (rows, n), &Device::Cpu).unwrap();
            let want = host(&(&xt + &yt).unwrap());
            let mut sum = x.clone();
            add_in_place(&mut sum, &y);
            assert_eq!(bits(&sum), bits(&want), "add over {rows} rows");

            // Fused: the residual then the norm, as the two steps give them.
            let mut normed = vec![0f32; rows * n];
            rms_norm(&sum, &w, 1e-6, &mut normed);
            let (mut x2, mut out2) = (x.clone(), vec![0f32; rows * n]);
            add_and_norm(&mut x2, &y, &w, 1e-6, &mut out2);
            assert_eq!(bits(&x2), bits(&sum), "add_and_norm's sum over {rows} rows");
            assert_eq!(bits(&out2), bits(&normed), "add_and_norm over {rows} rows");

            let want = host(&(candle_nn::ops::silu(&xt).unwrap() * &yt).unwrap());
            let mut g = x.clone();
            swiglu_in_place(&mut g, &y);
            assert_eq!(bits(&g), bits(&want), "swiglu over {rows} rows");
        }
    }

    /// Per-head norms and RoPE in one pass give the separate steps' floats.
    #[test]
    fn norm_and_rope_is_the_two_steps() {
        for (hd, n) in [(64, 1), (64, 5), (64, 300), (640, 3)] {
            let (nh, nkv) = (4, 2);
            let inv: Vec<f32> = (0..hd / 2)
                .map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / hd as f32))
                .collect();
            let positions: Vec<u32> = (0..n as u32).map(|i| i * 3 + 7).collect();
            let rope = RopeTable::new(&positions, &inv);
            let (q, k) = (values(n * nh * hd, 1), values(n * nkv * hd, 2));
            let (qw, kw) = (values(hd, 3), values(hd, 4));
            let (mut q1, mut k1) = (q.clone(), k.clone());
            rms_norm_in_place(&mut q1, &qw, 1e-6);
            rms_norm_in_place(&mut k1, &kw, 1e-6);
            rope.apply(&mut q1, nh);
            rope.apply(&mut k1, nkv);
            let (mut q2, mut k2) = (q, k);
            norm_and_rope(&mut q2, &mut k2, (&qw, &kw), 1e-6, &rope);
            assert_eq!(bits(&q1), bits(&q2), "q over {n} tokens");
            assert_eq!(bits(&k1), bits(&k2), "k over {n} tokens");
        }
    }
}
