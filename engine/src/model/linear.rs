//! A weight matrix applied as `x · Wᵀ`: repacked at load for our K-quant kernels
//! ([`super::kquants`]) where the CPU and the type allow, else through candle.

use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{DType, Device, Module, Tensor};
use refusion_gguf::{GgufFile, TensorInfo};

use super::kquants::{self, PackedMatrix};
use crate::error::{Error, Result};

pub enum Linear {
    /// Q4_K/Q5_K/Q6_K/Q8_0 weights repacked for our kernels (the map's pages released).
    Packed(PackedMatrix),
    /// Anything else: candle's quantized or float matmul, on any device.
    Candle(QMatMul),
}

impl Linear {
    /// The map's tensor `info`, repacked for our kernels when they run it.
    pub fn packed(file: &GgufFile, info: &TensorInfo) -> Option<Linear> {
        let [k, rows] = info.ne[..] else {
            return None;
        };
        if !runs_packed(info) {
            return None;
        }
        let (rows, k) = (rows as usize, k as usize);
        // The file's pages go as each slab is packed (not read again).
        let packed =
            PackedMatrix::pack_releasing(info.ty, rows, k, file.tensor_data(info), |at, len| {
                file.release(info, at as u64, len as u64)
            });
        Some(Linear::Packed(packed))
    }

    /// The repacked weight, when it runs on our kernels.
    pub fn weight(&self) -> Option<&PackedMatrix> {
        match self {
            Linear::Packed(p) => Some(p),
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
            Linear::Packed(_) => Ok(Self::forward_shared(&[self], x)?.remove(0)),
        }
    }

    /// Every one of `ls` applied to the same `x`. When all are packed they share one
    /// quantization of `x` and one parallel region (q, k and v; gate and up); otherwise each
    /// runs on its own.
    pub fn forward_shared(ls: &[&Linear], x: &Tensor) -> Result<Vec<Tensor>> {
        let ws: Option<Vec<&PackedMatrix>> = ls.iter().map(|l| l.weight()).collect();
        let Some(ws) = ws else {
            return ls.iter().map(|l| l.forward(x)).collect();
        };
        let dims = x.dims().to_vec();
        let k = ws[0].k();
        if dims.last() != Some(&k) || x.dtype() != DType::F32 || !x.device().is_cpu() {
            return Err(Error::internal(format!(
                "a {k}-wide weight applied to a {:?} {:?} tensor",
                x.dtype(),
                dims
            )));
        }
        let m = x.elem_count() / k;
        let x = x.contiguous()?;
        let (storage, layout) = x.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(Error::internal("mapped weights need CPU activations"));
        };
        let start = layout.start_offset();
        let xs = &cpu.as_slice::<f32>()?[start..start + m * k];
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; m * w.rows()]).collect();
        let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
        kquants::matmul_many(&ws, xs, m, &mut views);
        outs.into_iter()
            .zip(&ws)
            .map(|(o, w)| {
                let mut shape = dims.clone();
                if let Some(last) = shape.last_mut() {
                    *last = w.rows();
                }
                Ok(Tensor::from_vec(o, shape, &Device::Cpu)?)
            })
            .collect()
    }
}

/// Whether a tensor runs on our kernels (and so is repacked at load).
pub fn runs_packed(info: &TensorInfo) -> bool {
    matches!(info.ne[..], [k, _] if kquants::supports(info.ty, k as usize))
}
