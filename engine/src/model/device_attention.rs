//! Attention of a flat batch over device-resident KV layers, in candle tensor operations (so it
//! runs wherever candle does: CUDA, and the CPU for tests).
//!
//! The same visibility as the CPU kernel in `attention.rs`: token `i` sees its sequence's shared
//! prefix and the first `count` private slots of its row. The shared prefix is read in place
//! (narrows of the cache tensor, segment by segment, never copied or replicated per row); the
//! private slots of the rows in the batch are gathered once (a few slots per row) and masked per
//! token. Softmax runs over both parts together without concatenating them: one max, one sum.

use candle_core::{DType, Device, Tensor, D};

use crate::error::Result;
use crate::kv::{DeviceLayer, KvCache, Segment, SeqId, Sight};

/// The tokens of one sequence in a forward (consecutive in the batch) and what they see.
struct Group {
    start: usize,
    len: usize,
    /// The sequence's shared prefix, read in place tile by tile.
    prefix: Vec<Segment>,
    /// Private slots of every row of the group (`[u]`, u32).
    private: Tensor,
    /// `[len, u]`: 0 where a token sees a private slot, -inf elsewhere.
    mask: Tensor,
}

/// What one forward's tokens see, built once per forward and used by every device layer.
pub struct DeviceVisibility {
    groups: Vec<Group>,
    /// Scatter index of the batch's new entries ([`KvCache::device_index`]).
    pub write_index: Tensor,
    /// RoPE tables for the batch's positions, `[n, head_dim / 2]`.
    pub cos: Tensor,
    pub sin: Tensor,
}

impl DeviceVisibility {
    /// `visible[i]`: what token `i` sees (its sequence's shared prefix and the first `count`
    /// private slots of its row, [`Sight`]). `slots` are the batch's new entries (already
    /// allocated in `cache`); `inv_freq` is RoPE's.
    pub fn new(
        cache: &KvCache,
        slots: &[usize],
        visible: &[Sight],
        positions: &[u32],
        inv_freq: &[f32],
        device: &Device,
    ) -> Result<DeviceVisibility> {
        let mut groups = Vec::new();
        let mut start = 0;
        while start < visible.len() {
            let seq = visible[start].seq;
            let len = visible[start..].iter().take_while(|v| v.seq == seq).count();
            groups.push(Self::group(
                cache,
                seq,
                start,
                &visible[start..start + len],
                device,
            )?);
            start += len;
        }
        let half = inv_freq.len();
        let n = visible.len();
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for &p in positions {
            for &f in inv_freq {
                // The same f32 angle as the CPU path's RoPE.
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Ok(DeviceVisibility {
            groups,
            write_index: cache.device_index(slots, device)?,
            cos: Tensor::from_vec(cos, (n, half), device)?,
            sin: Tensor::from_vec(sin, (n, half), device)?,
        })
    }

    fn group(
        cache: &KvCache,
        seq: u32,
        start: usize,
        visible: &[Sight],
        device: &Device,
    ) -> Result<Group> {
        let id = SeqId(seq);
        let n = visible.len();
        // Each row's slots once, in order of first appearance in the group.
        let mut offsets: Vec<(usize, usize)> = Vec::new();
        let mut private: Vec<u32> = Vec::new();
        for &Sight { row: r, .. } in visible {
            if !offsets.iter().any(|&(row, _)| row == r) {
                offsets.push((r, private.len()));
                private.extend(cache.cells().row_slots(id, r).iter().map(|&s| s as u32));
            }
        }
        let u = private.len();
        let mut mask = vec![f32::NEG_INFINITY; n * u];
        for (i, &Sight { row: r, count, .. }) in visible.iter().enumerate() {
            let o = offsets
                .iter()
                .find(|&&(row, _)| row == r)
                .map_or(0, |&(_, o)| o);
            mask[i * u + o..i * u + o + count].fill(0.0);
        }
        Ok(Group {
            start,
            len: n,
            prefix: cache.cells().segments(id)?,
            private: Tensor::from_vec(private, u, device)?,
            mask: Tensor::from_vec(mask, (n, u), device)?,
        })
    }
}

/// Rotates `x` (`[n, heads, head_dim]`, rotate-half layout) by the batch's positions.
pub fn rope(x: &Tensor, vis: &DeviceVisibility) -> Result<Tensor> {
    let x = x.unsqueeze(0)?.contiguous()?;
    Ok(candle_nn::rotary_emb::rope_thd(&x, &vis.cos, &vis.sin)?.squeeze(0)?)
}

/// Shared-prefix entries per tile: a chunk's scores take `n_heads x n x TILE` floats at most,
/// whatever the context (llama.cpp's flash attention and FlashAttention-2 tile the same way).
pub const ATTN_TILE: usize = 1024;

/// Softmax-weighted sums over the keys seen so far (online softmax): the largest score, the
/// sum of exponentials relative to it, and the unnormalised output.
struct Running {
    max: Tensor,
    sum: Tensor,
    out: Tensor,
}

impl Running {
    /// Takes in one tile's scores `s` (`[nkv, group * n, t]`, f32) and values `v` (`[nkv, t, hd]`),
    /// rescaling what came before to the new maximum.
    fn absorb(self_: Option<Running>, s: &Tensor, v: &Tensor) -> Result<Running> {
        let dtype = v.dtype();
        let tile_max = s.max_keepdim(D::Minus1)?;
        let max = match &self_ {
            Some(r) => r.max.maximum(&tile_max)?,
            None => tile_max,
        };
        let e = s.broadcast_sub(&max)?.exp()?;
        let sum = e.sum_keepdim(D::Minus1)?;
        let out = e.to_dtype(dtype)?.matmul(v)?.to_dtype(DType::F32)?;
        Ok(match self_ {
            None => Running { max, sum, out },
            Some(r) => {
                let scale = (r.max - &max)?.exp()?;
                Running {
                    sum: (r.sum.mul(&scale)? + sum)?,
                    out: (r.out.broadcast_mul(&scale)? + out)?,
                    max,
                }
            }
        })
    }
}

/// Attention of `q` (`[n, n_heads, head_dim]`, after RoPE) over one device layer, each
/// sequence's tokens over its own shared prefix and rows. Returns `[n, n_heads * head_dim]` f32.
pub fn attend(
    q: &Tensor,
    layer: &DeviceLayer,
    vis: &DeviceVisibility,
    tile: usize,
) -> Result<Tensor> {
    let outs = vis
        .groups
        .iter()
        .map(|g| attend_group(&q.narrow(0, g.start, g.len)?, layer, g, tile))
        .collect::<Result<Vec<_>>>()?;
    Ok(match outs.len() {
        1 => outs.into_iter().next().unwrap_or_else(|| unreachable!()),
        _ => Tensor::cat(&outs, 0)?,
    })
}

/// One sequence's tokens. The shared prefix is read in tiles of `tile` entries with a running
/// maximum and sum, so the scratch does not grow with the context; the rows' private slots
/// (masked per token) come last.
fn attend_group(q: &Tensor, layer: &DeviceLayer, g: &Group, tile: usize) -> Result<Tensor> {
    let (n, nh, hd) = q.dims3()?;
    let (nkv, _, _) = layer.k.dims3()?;
    let group = nh / nkv;
    let dtype = layer.k.dtype();
    let scale = 1.0 / (hd as f64).sqrt();
    // Query heads that share a KV head become one matrix: [nkv, group * n, hd].
    let q = (q.transpose(0, 1)?.contiguous()? * scale)?
        .reshape((nkv, group * n, hd))?
        .to_dtype(dtype)?;

    let mut run = None;
    let tile = tile.max(1);
    for seg in &g.prefix {
        for start in (0..seg.len).step_by(tile) {
            let len = tile.min(seg.len - start);
            let k = layer.k.narrow(1, seg.start + start, len)?;
            let s = q.matmul(&k.t()?)?.to_dtype(DType::F32)?;
            let v = layer.v.narrow(1, seg.start + start, len)?;
            run = Some(Running::absorb(run, &s, &v)?);
        }
    }
    let kp = layer.k.index_select(&g.private, 1)?;
    let vp = layer.v.index_select(&g.private, 1)?;
    let u = kp.dim(1)?;
    // Every token sees at least itself, a private slot, so the maximum is finite.
    let sp = q
        .matmul(&kp.t()?)?
        .to_dtype(DType::F32)?
        .reshape((nkv, group, n, u))?
        .broadcast_add(&g.mask)?
        .reshape((nkv, group * n, u))?;
    let run = Running::absorb(run, &sp, &vp)?;
    let out = run.out.broadcast_div(&run.sum)?;
    Ok(out
        .reshape((nh, n, hd))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((n, nh * hd))?)
}
