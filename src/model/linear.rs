//! A weight matrix applied as `x · Wᵀ`: read in place from the GGUF map by our K-quant
//! kernels ([`super::kquants`]) where the CPU and the type allow, else through candle.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{DType, Device, Module, Tensor};
use refusion_convert::gguf::{GgmlType, GgufFile, TensorInfo};

use super::kquants::{self, KQuantWeight};
use crate::error::{Error, Result};

pub enum Linear {
    /// Q4_K/Q6_K blocks multiplied where they lie: in the map, or (`--no-mmap`) in a copy.
    Mapped {
        blocks: Blocks,
        ty: GgmlType,
        rows: usize,
        k: usize,
    },
    /// Anything else: candle's quantized or float matmul, on any device.
    Candle(QMatMul),
}

/// Where a weight's blocks are.
pub enum Blocks {
    Map(Arc<GgufFile>, TensorInfo),
    Copy(Vec<u8>),
}

impl Blocks {
    fn bytes(&self) -> &[u8] {
        match self {
            Blocks::Map(file, info) => file.tensor_data(info),
            Blocks::Copy(v) => v,
        }
    }
}

impl Linear {
    /// The map's tensor `info` (`rows x k`), when it runs on our kernels: read in place, or
    /// copied out of the map when `copy`.
    pub fn mapped(file: &Arc<GgufFile>, info: &TensorInfo, copy: bool) -> Option<Linear> {
        let [k, rows] = info.ne[..] else {
            return None;
        };
        if !runs_mapped(info) {
            return None;
        }
        let blocks = if copy {
            let v = file.tensor_data(info).to_vec();
            file.release(info, 0, info.n_bytes);
            Blocks::Copy(v)
        } else {
            Blocks::Map(file.clone(), info.clone())
        };
        Some(Linear::Mapped {
            blocks,
            ty: info.ty,
            rows: rows as usize,
            k: k as usize,
        })
    }

    fn weight(&self) -> Option<KQuantWeight<'_>> {
        match self {
            Linear::Mapped {
                blocks,
                ty,
                rows,
                k,
            } => Some(KQuantWeight {
                ty: *ty,
                rows: *rows,
                k: *k,
                data: blocks.bytes(),
            }),
            Linear::Candle(_) => None,
        }
    }

    /// Has candle build its repacked copy of a CPU weight now (it does so on first use): one
    /// small product, as the forward's shapes would (two rows: Q6_K packs only for several).
    pub fn prepack(&self) -> Result<()> {
        if let Linear::Candle(QMatMul::QTensor(q)) = self {
            let packs = matches!(q.dtype(), GgmlDType::Q4K | GgmlDType::Q6K | GgmlDType::Q8_0);
            if packs && q.device().is_cpu() {
                let (_, k) = q.shape().dims2()?;
                self.forward(&Tensor::zeros((2, k), DType::F32, &Device::Cpu)?)?;
            }
        }
        Ok(())
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Candle(m) => Ok(m.forward(x)?),
            Linear::Mapped { .. } => Ok(Self::forward_shared(&[self], x)?.remove(0)),
        }
    }

    /// Every one of `ls` applied to the same `x`; the mapped ones share one quantization of
    /// `x` and one parallel region (q, k and v; gate and up).
    pub fn forward_shared(ls: &[&Linear], x: &Tensor) -> Result<Vec<Tensor>> {
        let ws: Option<Vec<KQuantWeight<'_>>> = ls.iter().map(|l| l.weight()).collect();
        let Some(ws) = ws else {
            return ls.iter().map(|l| l.forward(x)).collect();
        };
        let dims = x.dims().to_vec();
        let k = ws[0].k;
        if dims.last() != Some(&k) || x.dtype() != DType::F32 || !x.device().is_cpu() {
            return Err(Error::msg(format!(
                "a {k}-wide weight applied to a {:?} {:?} tensor",
                x.dtype(),
                dims
            )));
        }
        let m = x.elem_count() / k;
        let x = x.contiguous()?;
        let (storage, layout) = x.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(Error::msg("mapped weights need CPU activations"));
        };
        let start = layout.start_offset();
        let xs = &cpu.as_slice::<f32>()?[start..start + m * k];
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; m * w.rows]).collect();
        let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
        kquants::matmul_many(&ws, xs, m, &mut views);
        outs.into_iter()
            .zip(&ws)
            .map(|(o, w)| {
                let mut shape = dims.clone();
                if let Some(last) = shape.last_mut() {
                    *last = w.rows;
                }
                Ok(Tensor::from_vec(o, shape, &Device::Cpu)?)
            })
            .collect()
    }
}

/// Whether a tensor of this type is read by our kernels (and so must stay mapped).
pub fn runs_mapped(info: &TensorInfo) -> bool {
    matches!(info.ne[..], [k, _] if kquants::supports(info.ty, k as usize))
}
