//! One Qwen3 block, as its parts: [`Attention`] (norm, q/k/v with their per-head norms and
//! RoPE, attention over the cache, output projection) and [`Mlp`] (norm, SwiGLU), joined by
//! their residuals in [`Layer`]. Each part has two forwards with the same floats: the host
//! path (plain buffers on our kernels, `Scratch` reused between forwards) and candle's tensors
//! (on an accelerator, or for weights our kernels do not run).

use candle_core::{Device, Tensor};

use super::attention::{attend, Visible};
use super::device_attention::{self, DeviceVisibility};
use super::host::{self, sized, RopeTable, Scratch};
use super::kquants::{matmul_many, PackedMatrix};
use super::linear::Linear;
use super::Heads;
use crate::error::{Error, Result};
use crate::kv::{KvCache, Placement, Sight};

/// One chunk of a forward: its tokens, their cache slots and what each sees.
pub(super) struct Chunk<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    /// Where the chunk's tokens' entries go, and what each sees (its part of the placement).
    pub slots: &'a [usize],
    pub sights: &'a [Sight],
    pub placement: &'a Placement,
    pub range: std::ops::Range<usize>,
    /// Chunk indices logits are wanted for.
    pub wanted: Vec<usize>,
}

impl Chunk<'_> {
    /// What each token sees, as the attention reads it (after this layer's entries landed).
    pub fn visible_in<'c>(&'c self, cache: &'c KvCache) -> Vec<Visible<'c>> {
        self.placement.visible(self.range.clone(), cache)
    }
}

/// What every layer of a chunk's forward shares.
pub(super) struct Pass<'a, 'c> {
    pub chunk: &'a Chunk<'c>,
    pub rope: &'a RopeTable,
    pub cache: &'a mut KvCache,
    pub heads: Heads,
    pub eps: f64,
    /// The device layers' RoPE, scatter index and masks (when any layer is offloaded).
    pub device: Option<&'a DeviceVisibility>,
    /// Shared-prefix entries per tile of the device attention.
    pub attn_tile: usize,
}

pub(super) struct Attention {
    pub norm: Tensor,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Tensor,
    pub k_norm: Tensor,
    /// The norms as host vectors, on the host path.
    host: Option<[Vec<f32>; 3]>,
}

pub(super) struct Mlp {
    pub norm: Tensor,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    /// The norm as a host vector, on the host path.
    host: Option<Vec<f32>>,
}

pub(super) struct Layer {
    /// Its index in the model (its K/V's layer in the cache).
    pub index: usize,
    /// Where its weights (and K/V) live.
    pub device: Device,
    pub attn: Attention,
    pub mlp: Mlp,
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(x, w, eps as f32)?)
}

impl Attention {
    pub fn new(norm: Tensor, [q, k, v, o]: [Linear; 4], q_norm: Tensor, k_norm: Tensor) -> Self {
        Attention {
            norm,
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            host: None,
        }
    }

    fn linears(&self) -> [&Linear; 4] {
        [&self.q, &self.k, &self.v, &self.o]
    }

    /// q, k, v and the output projection, when all run on our kernels.
    fn packed(&self) -> Option<[&PackedMatrix; 4]> {
        let [q, k, v, o] = self.linears();
        Some([q.weight()?, k.weight()?, v.weight()?, o.weight()?])
    }

    /// The host path: the attention of `x` (`n` rows) into `s.o`; `s.h` is left normalized.
    fn forward_host(
        &self,
        l: usize,
        x: &[f32],
        p: &mut Pass<'_, '_>,
        s: &mut Scratch,
    ) -> Result<()> {
        let (Some([norm, qn, kn]), Some([wq, wk, wv, wo])) = (&self.host, self.packed()) else {
            return Err(Error::internal(format!(
                "layer {l} is not on the host path"
            )));
        };
        let (n, hs, eps) = (p.chunk.tokens.len(), p.heads, p.eps as f32);
        let h = sized(&mut s.h, x.len());
        host::rms_norm(x, norm, eps, h);
        let (q, k, v) = (
            sized(&mut s.q, n * wq.rows()),
            sized(&mut s.k, n * wk.rows()),
            sized(&mut s.v, n * wv.rows()),
        );
        matmul_many(&[wq, wk, wv], h, n, &mut [&mut *q, &mut *k, &mut *v]);
        host::norm_and_rope(q, k, (qn, kn), eps, p.rope);
        p.cache.write(l, p.chunk.slots, k, v);
        let attn = sized(&mut s.attn, n * hs.n * hs.dim);
        attend(q, p.cache, l, &p.chunk.visible_in(p.cache), hs, attn);
        let o = sized(&mut s.o, x.len());
        matmul_many(&[wo], attn, n, &mut [&mut *o]);
        Ok(())
    }

    /// Candle's tensors: the attention of `x` (`n` rows), before its residual.
    fn forward_tensors(
        &self,
        l: usize,
        x: &Tensor,
        p: &mut Pass<'_, '_>,
        dev: &Device,
    ) -> Result<Tensor> {
        let (n, hs) = (p.chunk.tokens.len(), p.heads);
        let h = rms_norm(x, &self.norm, p.eps)?;
        let [q, k, v]: [Tensor; 3] = Linear::forward_shared(&[&self.q, &self.k, &self.v], &h)?
            .try_into()
            .map_err(|_| Error::internal("q, k and v"))?;
        let q = rms_norm(&q.reshape((n, hs.n, hs.dim))?, &self.q_norm, p.eps)?;
        let k = rms_norm(&k.reshape((n, hs.kv, hs.dim))?, &self.k_norm, p.eps)?;
        let a = match p.device {
            Some(vis) if l < p.cache.device_layers() => {
                let q = device_attention::rope(&q, vis)?;
                let k = device_attention::rope(&k, vis)?;
                let v = v.reshape((n, hs.kv, hs.dim))?;
                p.cache.write_device(l, &vis.write_index, &k, &v)?;
                device_attention::attend(&q, p.cache.device_layer(l), vis, p.attn_tile)?
            }
            _ => {
                let mut q = q.flatten_all()?.to_vec1::<f32>()?;
                let mut k = k.flatten_all()?.to_vec1::<f32>()?;
                let v = v.flatten_all()?.to_vec1::<f32>()?;
                p.rope.apply(&mut q, hs.n);
                p.rope.apply(&mut k, hs.kv);
                p.cache.write(l, p.chunk.slots, &k, &v);
                let mut attn = vec![0f32; n * hs.n * hs.dim];
                attend(&q, p.cache, l, &p.chunk.visible_in(p.cache), hs, &mut attn);
                Tensor::from_vec(attn, (n, hs.n * hs.dim), dev)?
            }
        };
        self.o.forward(&a)
    }
}

impl Mlp {
    pub fn new(norm: Tensor, [gate, up, down]: [Linear; 3]) -> Self {
        Mlp {
            norm,
            gate,
            up,
            down,
            host: None,
        }
    }

    fn linears(&self) -> [&Linear; 3] {
        [&self.gate, &self.up, &self.down]
    }

    fn packed(&self) -> Option<[&PackedMatrix; 3]> {
        let [g, u, d] = self.linears();
        Some([g.weight()?, u.weight()?, d.weight()?])
    }

    /// The host path: SwiGLU of the normalized `s.h` (`n` rows) into `s.o`.
    fn forward_host(&self, n: usize, s: &mut Scratch) -> Result<()> {
        let Some([wg, wu, wd]) = self.packed() else {
            return Err(Error::internal("the feed-forward is not on the host path"));
        };
        let (gate, up) = (
            sized(&mut s.gate, n * wg.rows()),
            sized(&mut s.up, n * wu.rows()),
        );
        matmul_many(&[wg, wu], &s.h, n, &mut [&mut *gate, &mut *up]);
        host::swiglu_in_place(gate, up);
        matmul_many(&[wd], gate, n, &mut [&mut s.o[..]]);
        Ok(())
    }

    /// Candle's tensors: the feed-forward with its residual.
    fn forward_tensors(&self, x: Tensor, eps: f64) -> Result<Tensor> {
        let h = rms_norm(&x, &self.norm, eps)?;
        let [gate, up]: [Tensor; 2] = Linear::forward_shared(&[&self.gate, &self.up], &h)?
            .try_into()
            .map_err(|_| Error::internal("gate and up"))?;
        let gate = candle_nn::ops::silu(&gate)?;
        Ok((x + self.down.forward(&(gate * up)?)?)?)
    }
}

impl Layer {
    /// Sets the host norms when every weight runs on our kernels on the CPU (the host path).
    pub fn with_host_norms(mut self) -> Result<Layer> {
        if self.device.is_cpu() && self.attn.packed().is_some() && self.mlp.packed().is_some() {
            let a = &self.attn;
            self.attn.host = Some([a.norm.to_vec1()?, a.q_norm.to_vec1()?, a.k_norm.to_vec1()?]);
            self.mlp.host = Some(self.mlp.norm.to_vec1()?);
        }
        Ok(self)
    }

    /// Back to candle's tensors (tests compare the two paths).
    pub fn drop_host_norms(&mut self) {
        self.attn.host = None;
        self.mlp.host = None;
    }

    pub fn on_host_path(&self) -> bool {
        self.attn.host.is_some() && self.mlp.host.is_some()
    }

    /// Packs every weight for the CPU kernels that run it (candle's x86 repacking).
    pub fn prepack(&self) -> Result<()> {
        for m in self.attn.linears().into_iter().chain(self.mlp.linears()) {
            m.prepack()?;
        }
        Ok(())
    }

    /// The block on the host path: `x` updated in place, every step into `s`.
    pub fn forward_host(&self, x: &mut [f32], p: &mut Pass<'_, '_>, s: &mut Scratch) -> Result<()> {
        let Some(ffn_norm) = &self.mlp.host else {
            return Err(Error::internal(format!(
                "layer {} is not on the host path",
                self.index
            )));
        };
        self.attn.forward_host(self.index, x, p, s)?;
        // The residual and the feed-forward's norm in one pass.
        host::add_and_norm(x, &s.o, ffn_norm, p.eps as f32, &mut s.h[..x.len()]);
        self.mlp.forward_host(p.chunk.tokens.len(), s)?;
        host::add_in_place(x, &s.o);
        Ok(())
    }

    /// The block through candle's tensors, on its device.
    pub fn forward_tensors(&self, x: Tensor, p: &mut Pass<'_, '_>) -> Result<Tensor> {
        let a = self.attn.forward_tensors(self.index, &x, p, &self.device)?;
        self.mlp.forward_tensors((x + a)?, p.eps)
    }
}
