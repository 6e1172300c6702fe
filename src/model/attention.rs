//! Causal attention of a flat batch over the KV cache, on the CPU.
//!
//! Token `i` sees the shared prefix (read in place from the cache by every token: never copied
//! per row) and the private slots of its own row up to and including its own entry, in cache
//! order. Positions play no part here: they entered through RoPE.

use rayon::prelude::*;

use crate::kv::{HeadView, KvCache};

/// What one new token may attend to beyond the shared prefix: the first `count` private slots
/// of its row.
#[derive(Debug, Clone, Copy)]
pub struct Visible<'a> {
    pub row_slots: &'a [usize],
    pub count: usize,
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent partial sums: vectorizes, and keeps rounding error low.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for j in chunks * 8..a.len() {
        s += a[j] * b[j];
    }
    s
}

/// Copies one cached entry into f32.
#[inline]
fn load(view: &HeadView<'_>, slot: usize, hd: usize, out: &mut [f32]) {
    match view {
        HeadView::F32(v) => out.copy_from_slice(&v[slot * hd..(slot + 1) * hd]),
        HeadView::F16(v) => {
            for (o, x) in out.iter_mut().zip(&v[slot * hd..(slot + 1) * hd]) {
                *o = x.to_f32();
            }
        }
    }
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
    out.par_chunks_mut(group * head_dim)
        .enumerate()
        .for_each(|(task, out)| {
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
            let mut scores = vec![0f32; group * n_keys];
            let mut kbuf = vec![0f32; head_dim];
            for t in 0..n_keys {
                load(&keys, slot_of(t), head_dim, &mut kbuf);
                for h in 0..group {
                    let qh = &q[(i * n_heads + g * group + h) * head_dim..][..head_dim];
                    scores[h * n_keys + t] = dot(qh, &kbuf) * scale;
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
                load(&values, slot_of(t), head_dim, &mut kbuf);
                for h in 0..group {
                    let p = scores[h * n_keys + t];
                    let o = &mut out[h * head_dim..(h + 1) * head_dim];
                    for (o, v) in o.iter_mut().zip(&kbuf) {
                        *o += p * v;
                    }
                }
            }
        });
}
