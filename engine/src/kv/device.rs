//! The K/V of the layers offloaded to an accelerator (`-ngl`): one `[n_kv_heads, capacity,
//! head_dim]` tensor per layer for K and one for V, with the same slot numbering as the map.
//! Writes are scatters, moves a gather and an in-place slice write: the shared prefix is never
//! replicated per row here either.

use candle_core::{DType, Device, Tensor};

use super::cells::Move;
use super::{CacheShape, Kv, KvTypes};
use crate::error::{Error, Result};

/// The K and V tensors of one device-resident layer, `[n_kv_heads, capacity, head_dim]`.
pub struct DeviceLayer {
    pub k: Tensor,
    pub v: Tensor,
}

impl DeviceLayer {
    pub fn get(&self, kind: Kv) -> &Tensor {
        match kind {
            Kv::K => &self.k,
            Kv::V => &self.v,
        }
    }
}

pub struct DeviceStore {
    pub layers: Vec<DeviceLayer>,
    n_kv_heads: usize,
    head_dim: usize,
    types: KvTypes,
    /// The key and value tensors' element types ([`super::KvKind::dtype`]).
    k_dtype: DType,
    v_dtype: DType,
}

impl DeviceStore {
    /// The first `n` layers on `device`, zeroed.
    pub fn new(
        shape: &CacheShape,
        types: KvTypes,
        device: Option<(&Device, usize)>,
    ) -> Result<DeviceStore> {
        let mut layers = Vec::new();
        let dtype = |kind: Kv| match (types.of(kind).kind().dtype(), device) {
            (Some(d), _) => Ok(d),
            (None, None) => Ok(DType::F32),
            (None, Some(_)) => Err(Error::setup(format!(
                "a {} KV cache ({}) has no GPU path yet: use -ngl 0, or f16 for {}",
                types.of(kind).name(),
                if kind == Kv::K { "-ctk" } else { "-ctv" },
                if kind == Kv::K { "keys" } else { "values" },
            ))),
        };
        let (k_dtype, v_dtype) = (dtype(Kv::K)?, dtype(Kv::V)?);
        if let Some((dev, n)) = device {
            let dims = (shape.n_kv_heads, shape.capacity, shape.head_dim);
            for l in 0..n.min(shape.n_layers) {
                let zeros = |dtype| {
                    Tensor::zeros(dims, dtype, dev).map_err(|e| {
                        Error::resource(format!(
                            "cannot allocate the KV cache of layer {l} on {:?}: {e}",
                            dev.location()
                        ))
                    })
                };
                layers.push(DeviceLayer {
                    k: zeros(k_dtype)?,
                    v: zeros(v_dtype)?,
                });
            }
        }
        Ok(DeviceStore {
            layers,
            n_kv_heads: shape.n_kv_heads,
            head_dim: shape.head_dim,
            types,
            k_dtype,
            v_dtype,
        })
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Writes one layer's new entries; `k` and `v` are `[n, n_kv_heads, head_dim]` f32 on the
    /// device; `index` is [`DeviceStore::index`] of their slots.
    pub fn write(&self, layer: usize, index: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let dl = &self.layers[layer];
        for (dst, src, dtype) in [(&dl.k, k, self.k_dtype), (&dl.v, v, self.v_dtype)] {
            let src = src.transpose(0, 1)?.to_dtype(dtype)?.contiguous()?;
            dst.scatter_set(index, &src, 1)?;
        }
        Ok(())
    }

    /// The scatter index for [`DeviceStore::write`]: `slots` broadcast to
    /// `[n_kv_heads, n, head_dim]` (built once per forward, used by every device layer).
    pub fn index(&self, slots: &[usize], device: &Device) -> Result<Tensor> {
        let (nkv, hd) = (self.n_kv_heads, self.head_dim);
        let ids: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
        Ok(Tensor::from_vec(ids, (1, slots.len(), 1), device)?
            .broadcast_as((nkv, slots.len(), hd))?
            .contiguous()?)
    }

    fn ids(&self, slots: &[usize]) -> Result<Tensor> {
        let ids: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
        Ok(Tensor::from_vec(
            ids,
            slots.len(),
            self.layers[0].k.device(),
        )?)
    }

    /// Carries out a move on every device layer: a gather (the staging copy) and an in-place
    /// write.
    pub fn apply(&self, m: &Move) -> Result<()> {
        if m.src.is_empty() || self.layers.is_empty() || m.is_noop() {
            return Ok(());
        }
        let ids = self.ids(&m.src)?;
        for layer in &self.layers {
            for t in [&layer.k, &layer.v] {
                t.slice_set(&t.index_select(&ids, 1)?, 1, m.dst)?;
            }
        }
        Ok(())
    }

    /// One entry as f32 (tests and tools).
    pub fn entry(&self, layer: usize, kind: Kv, kv_head: usize, slot: usize) -> Result<Vec<f32>> {
        Ok(self.layers[layer]
            .get(kind)
            .get(kv_head)?
            .get(slot)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?)
    }

    /// The K/V of the given slots of every layer, as little-endian bytes in file order (layer,
    /// K then V, KV head, entry).
    pub fn entries_le(&self, slots: &[usize]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        if self.layers.is_empty() || slots.is_empty() {
            return Ok(out);
        }
        let ids = self.ids(slots)?;
        for layer in &self.layers {
            for (t, kind) in [(&layer.k, Kv::K), (&layer.v, Kv::V)] {
                let g = t.index_select(&ids, 1)?.flatten_all()?;
                let values = g.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                let kind = self.types.of(kind).kind();
                let rb = kind.row_bytes(self.head_dim);
                let at = out.len();
                out.resize(at + values.len() / self.head_dim * rb, 0);
                for (row, dst) in values
                    .chunks_exact(self.head_dim)
                    .zip(out[at..].chunks_exact_mut(rb))
                {
                    kind.write_row(row, dst);
                }
            }
        }
        Ok(out)
    }

    /// Writes `n` entries per (layer, kind) from little-endian bytes in file order to slots
    /// `dst..dst + n`. Returns the bytes read.
    pub fn load_le(&self, bytes: &[u8], n: usize, dst: usize) -> Result<usize> {
        let (nkv, hd) = (self.n_kv_heads, self.head_dim);
        let total = self.layers.len() * nkv * n * self.types.row_bytes(hd);
        if n == 0 {
            return Ok(total);
        }
        let mut start = 0;
        for layer in &self.layers {
            for (t, kind, dtype) in [
                (&layer.k, Kv::K, self.k_dtype),
                (&layer.v, Kv::V, self.v_dtype),
            ] {
                let kind = self.types.of(kind).kind();
                let rb = kind.row_bytes(hd);
                let b = &bytes[start..start + nkv * n * rb];
                start += b.len();
                let mut v = vec![0f32; nkv * n * hd];
                for (row, src) in v.chunks_exact_mut(hd).zip(b.chunks_exact(rb)) {
                    kind.read_row(src, row);
                }
                let src = Tensor::from_vec(v, (nkv, n, hd), t.device())?.to_dtype(dtype)?;
                t.slice_set(&src, 1, dst)?;
            }
        }
        Ok(total)
    }
}
