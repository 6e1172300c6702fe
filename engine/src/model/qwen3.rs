//! Qwen3 (and ReFusion, which is Qwen3-8B with a mask token) over memory-mapped GGUF weights.
//!
//! The weight structs mirror the file's tensors; the forward reads top to bottom. Differences
//! from a plain left-to-right model, all needed by ReFusion:
//! - a flat batch of several rows over one cache, each token with its own position id;
//! - RoPE from f32 angles computed per token (no f16 tables, exact far from position 0);
//! - logits only for the tokens asked for, so `output` runs only on those;
//! - `token_embd` is never dequantized as a whole: the rows needed are decoded from the map;
//! - with [`Offload`], the first layers (and maybe the output layer) run on an accelerator,
//!   their K/V in device tensors; the rest on the CPU over the memory-mapped cache;
//! - batches longer than the micro-batch run in chunks, bounding scratch memory.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use refusion_gguf::quant;
use refusion_gguf::{GgmlType, GgufFile, TensorInfo};

use super::device_attention::{self, DeviceVisibility};
use super::host::{self, sized, RopeTable, Scratch};
use super::kquants::matmul_many;
use super::layer::{Attention, Chunk, Layer, Mlp, Pass};
use super::linear::Linear;
use super::{Batch, Forward, Logits, Offload, Qwen3Config};
use crate::error::{Error, RequestError, Result};
use crate::kv::{CacheShape, KvCache};

fn candle_dtype(ty: GgmlType) -> GgmlDType {
    match ty {
        GgmlType::F32 => GgmlDType::F32,
        GgmlType::F16 => GgmlDType::F16,
        GgmlType::BF16 => GgmlDType::BF16,
        GgmlType::Q4_0 => GgmlDType::Q4_0,
        GgmlType::Q4_1 => GgmlDType::Q4_1,
        GgmlType::Q5_0 => GgmlDType::Q5_0,
        GgmlType::Q5_1 => GgmlDType::Q5_1,
        GgmlType::Q8_0 => GgmlDType::Q8_0,
        GgmlType::Q8_1 => GgmlDType::Q8_1,
        GgmlType::Q2_K => GgmlDType::Q2K,
        GgmlType::Q3_K => GgmlDType::Q3K,
        GgmlType::Q4_K => GgmlDType::Q4K,
        GgmlType::Q5_K => GgmlDType::Q5K,
        GgmlType::Q6_K => GgmlDType::Q6K,
        GgmlType::Q8_K => GgmlDType::Q8K,
    }
}

/// The hidden states between layers: a tensor on the layer's device, or a host buffer.
enum Hidden {
    Tensor(Tensor),
    Host(Vec<f32>),
}

impl Hidden {
    /// As a host buffer (moved off its device, once).
    fn host(&mut self) -> Result<&mut Vec<f32>> {
        if let Hidden::Tensor(t) = self {
            *self = Hidden::Host(t.flatten_all()?.to_vec1::<f32>()?);
        }
        match self {
            Hidden::Host(v) => Ok(v),
            Hidden::Tensor(_) => unreachable!("converted above"),
        }
    }

    /// As a tensor of `n` rows on `device`.
    fn tensor(self, n: usize, device: &Device) -> Result<Tensor> {
        Ok(match self {
            Hidden::Tensor(t) => t.to_device(device)?,
            Hidden::Host(v) => {
                let h = v.len() / n.max(1);
                Tensor::from_vec(v, (n, h), &Device::Cpu)?.to_device(device)?
            }
        })
    }
}

pub struct Qwen3 {
    cfg: Qwen3Config,
    /// Layers `0..offload.layers` (and the output layer if `offload.output`) run there.
    offload: Option<Offload>,
    /// Tokens per chunk of a forward.
    ubatch: usize,
    /// Shared-prefix entries per tile of the device attention.
    attn_tile: usize,
    file: Arc<GgufFile>,
    token_embd: TensorInfo,
    layers: Vec<Layer>,
    output_norm: Tensor,
    output: Linear,
    /// RoPE inverse frequencies, computed in f32 as transformers does.
    inv_freq: Vec<f32>,
    output_device: Device,
    /// `output_norm` as a host vector when the output layer runs on the host path.
    output_norm_host: Option<Vec<f32>>,
    /// The host path's buffers (one forward at a time holds them).
    scratch: std::sync::Mutex<Scratch>,
}

struct Loader<'a> {
    file: &'a Arc<GgufFile>,
    device: Device,
    /// Read quantized CPU weights in place from the map (else copy them, `--no-mmap`).
    mmap: bool,
}

impl Loader<'_> {
    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.file
            .header
            .tensor(name)
            .ok_or_else(|| Error::model(format!("tensor {name} is missing")))
    }

    /// A weight matrix: Q4_K/Q5_K/Q6_K/Q8_0 CPU weights are repacked for our kernels; others are
    /// candle's (read in place from the map for its packing, or copied with `--no-mmap`).
    fn matmul(&self, name: &str) -> Result<Linear> {
        let t = self.info(name)?;
        if self.device.is_cpu() {
            if let Some(l) = Linear::packed(self.file, t) {
                // Packed, the file's pages released as it went.
                return Ok(l);
            }
        }
        self.candle_matmul(t).map(Linear::Candle)
    }

    fn candle_matmul(&self, t: &TensorInfo) -> Result<QMatMul> {
        let data = self.file.tensor_data(t);
        let dims: Vec<usize> = t.ne.iter().rev().map(|&d| d as usize).collect();
        if !t.ty.is_quantized() {
            // Plain float weights run through candle's f32 matmul.
            let dtype = match t.ty {
                GgmlType::F16 => DType::F16,
                GgmlType::BF16 => DType::BF16,
                _ => DType::F32,
            };
            let w =
                Tensor::from_raw_buffer(data, dtype, &dims, &self.device)?.to_dtype(DType::F32)?;
            self.file.release(t, 0, t.n_bytes);
            return Ok(QMatMul::Tensor(w));
        }
        let dtype = candle_dtype(t.ty);
        if self.device.is_cpu() && self.mmap {
            // Read in place from the map; its pages are released once packed (`prepack`).
            if let Some(storage) = super::mapped::mapped_storage(self.file, t, dtype) {
                return Ok(QMatMul::from_arc(Arc::new(QTensor::new(storage, dims)?))?);
            }
        }
        let storage = QStorage::from_data(Cow::Borrowed(data), &self.device, dtype)?;
        let q = QTensor::new(storage, dims)?;
        // The pages were copied: let the kernel drop them from this process.
        self.file.release(t, 0, t.n_bytes);
        Ok(QMatMul::from_arc(Arc::new(q))?)
    }

    /// A vector (norm weights), as f32.
    fn vector(&self, name: &str) -> Result<Tensor> {
        let t = self.info(name)?;
        let mut v = vec![0f32; t.n_elements() as usize];
        if !quant::dequantize(t.ty, self.file.tensor_data(t), &mut v) {
            return Err(Error::model(format!(
                "tensor {name} has unsupported type {}",
                t.ty
            )));
        }
        Ok(Tensor::from_vec(v, t.n_elements() as usize, &self.device)?)
    }
}

/// Where each part of the model loads: the first `offload.layers` layers (and the output layer
/// when `offload.output`) on the accelerator, the rest on the CPU.
struct Places<'a> {
    file: &'a Arc<GgufFile>,
    offload: Option<&'a Offload>,
    /// Read quantized CPU weights in place from the map (else copy them, `--no-mmap`).
    mmap: bool,
}

impl Places<'_> {
    fn loader(&self, on_gpu: bool) -> Loader<'_> {
        let device = match (self.offload, on_gpu) {
            (Some(o), true) => o.device.clone(),
            _ => Device::Cpu,
        };
        Loader {
            file: self.file,
            device,
            mmap: self.mmap,
        }
    }

    fn n_gpu(&self) -> usize {
        self.offload.map_or(0, |o| o.layers)
    }

    fn layer(&self, l: usize) -> Result<Layer> {
        let ld = self.loader(l < self.n_gpu());
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let m = |s: &str| ld.matmul(&n(s));
        Layer {
            index: l,
            device: ld.device.clone(),
            attn: Attention::new(
                ld.vector(&n("attn_norm"))?,
                [m("attn_q")?, m("attn_k")?, m("attn_v")?, m("attn_output")?],
                ld.vector(&n("attn_q_norm"))?,
                ld.vector(&n("attn_k_norm"))?,
            ),
            mlp: Mlp::new(
                ld.vector(&n("ffn_norm"))?,
                [m("ffn_gate")?, m("ffn_up")?, m("ffn_down")?],
            ),
        }
        .with_host_norms()
    }

    /// Every layer: the device ones in order, then the CPU ones on one thread per core, each
    /// packed for candle's x86 kernels right away (the single-threaded repacking would
    /// otherwise run on one core, during the first forward; not on our worker pool: the
    /// packing products call into candle's, which must not nest).
    fn layers(&self, n_layers: usize) -> Result<Vec<Layer>> {
        let n_gpu = self.n_gpu();
        let mut loaded: Vec<(usize, Result<Layer>)> =
            (0..n_gpu).map(|l| (l, self.layer(l))).collect();
        let next = std::sync::atomic::AtomicUsize::new(n_gpu);
        let workers = candle_core::utils::get_num_threads().clamp(1, n_layers.max(1));
        std::thread::scope(|scope| -> Result<()> {
            let handles: Vec<_> = (0..workers)
                .map(|_| {
                    scope.spawn(|| {
                        let mut mine = Vec::new();
                        loop {
                            let l = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if l >= n_layers {
                                return mine;
                            }
                            let r = self
                                .layer(l)
                                .and_then(|layer| layer.prepack().map(|_| layer));
                            // Packed: what is still read of the originals comes back from the
                            // page cache.
                            release_prefix(self.file, &format!("blk.{l}."));
                            mine.push((l, r));
                        }
                    })
                })
                .collect();
            for h in handles {
                let mine = h
                    .join()
                    .map_err(|_| Error::internal("loading a layer panicked"))?;
                loaded.extend(mine);
            }
            Ok(())
        })?;
        loaded.sort_by_key(|&(l, _)| l);
        loaded.into_iter().map(|(_, r)| r).collect()
    }

    /// The output norm and layer (`token_embd` when tied) and where they run.
    fn output(&self, tied: bool) -> Result<(Tensor, Linear, Device)> {
        let ld = self.loader(self.offload.is_some_and(|o| o.output));
        let norm = ld.vector("output_norm.weight")?;
        let name = if tied { "token_embd" } else { "output" };
        let output = ld.matmul(&format!("{name}.weight"))?;
        output.prepack()?;
        release_prefix(self.file, &format!("{name}."));
        Ok((norm, output, ld.device))
    }
}

impl Qwen3 {
    /// Loads the weights of a validated qwen3 GGUF onto `device` (all of them on a GPU).
    pub fn load(file: Arc<GgufFile>, device: &Device) -> Result<Qwen3> {
        let offload = match device {
            Device::Cpu => None,
            d => Some(Offload {
                device: d.clone(),
                layers: usize::MAX,
                output: true,
            }),
        };
        Self::load_offloaded(file, offload)
    }

    /// Loads the weights with the first `offload.layers` layers (and the output layer when
    /// `offload.output`) on `offload.device`, the rest on the CPU.
    pub fn load_offloaded(file: Arc<GgufFile>, offload: Option<Offload>) -> Result<Qwen3> {
        Self::load_with(file, offload, true)
    }

    /// As [`Qwen3::load_offloaded`]; with `mmap` false, quantized CPU weights are copied into
    /// memory instead of read in place from the map (llama.cpp's `--no-mmap`).
    pub fn load_with(file: Arc<GgufFile>, offload: Option<Offload>, mmap: bool) -> Result<Qwen3> {
        let cfg = Qwen3Config::from_gguf(&file.header)?;
        cfg.validate_tensors(&file.header)?;
        let token_embd = file
            .header
            .tensor("token_embd.weight")
            .cloned()
            .ok_or_else(|| Error::model("tensor token_embd.weight is missing"))?;
        if matches!(token_embd.ty, GgmlType::Q8_1 | GgmlType::Q8_K) {
            return Err(Error::model(format!(
                "token_embd.weight has unsupported type {}",
                token_embd.ty
            )));
        }
        let offload = offload.map(|o| Offload {
            layers: o.layers.min(cfg.n_layers),
            ..o
        });
        let places = Places {
            file: &file,
            offload: offload.as_ref(),
            mmap,
        };
        let layers = places.layers(cfg.n_layers)?;
        let (output_norm, output, output_device) = places.output(cfg.tied_output)?;
        let output_norm_host = match (output_device.is_cpu(), output.weight()) {
            (true, Some(_)) => Some(output_norm.to_vec1::<f32>()?),
            _ => None,
        };
        let hd = cfg.head_dim;
        let inv_freq = (0..hd / 2)
            .map(|i| 1.0f32 / cfg.rope_theta.powf((2 * i) as f32 / hd as f32))
            .collect();
        Ok(Qwen3 {
            cfg,
            offload,
            ubatch: DEFAULT_UBATCH,
            attn_tile: device_attention::ATTN_TILE,
            file,
            token_embd,
            layers,
            output_norm,
            output,
            inv_freq,
            output_device,
            output_norm_host,
            scratch: std::sync::Mutex::new(Scratch::default()),
        })
    }

    /// Where layers run: `None` when all on the CPU.
    pub fn offload(&self) -> Option<&Offload> {
        self.offload.as_ref()
    }

    /// Layers whose weights and K/V live on the accelerator.
    pub fn gpu_layers(&self) -> usize {
        self.offload.as_ref().map_or(0, |o| o.layers)
    }

    /// Runs every layer through candle's tensors, not the host path's plain buffers (tests
    /// compare the two: the same logits to the bit).
    pub fn use_tensor_path(&mut self) {
        for l in &mut self.layers {
            l.drop_host_norms();
        }
        self.output_norm_host = None;
    }

    /// Whether any layer runs on the host path.
    pub fn uses_host_path(&self) -> bool {
        self.layers.iter().any(|l| l.on_host_path())
    }

    /// Sets the most tokens one chunk of a forward holds (at least 1).
    pub fn set_ubatch(&mut self, n: usize) {
        self.ubatch = n.max(1);
    }

    /// Sets the shared-prefix entries per tile of the device attention (at least 1; tests use
    /// small tiles to cross many tile edges).
    pub fn set_attn_tile(&mut self, n: usize) {
        self.attn_tile = n.max(1);
    }

    /// A KV cache of `capacity` entries placed like the layers: device tensors for the
    /// offloaded ones, a map (anonymous, or the file at `path`) for the others.
    pub fn new_cache(
        &self,
        capacity: usize,
        types: impl Into<crate::kv::KvTypes>,
        path: Option<&std::path::Path>,
    ) -> Result<KvCache> {
        let device = self.offload.as_ref().map(|o| (&o.device, o.layers));
        KvCache::placed(self.cache_shape(capacity), types, path, device)
    }

    /// The cache geometry for a context of `capacity` entries.
    pub fn cache_shape(&self, capacity: usize) -> CacheShape {
        CacheShape {
            n_layers: self.cfg.n_layers,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
            capacity,
        }
    }

    /// Decodes the embedding rows of `tokens`, read from the file.
    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let h = self.cfg.hidden;
        let t = &self.token_embd;
        let row_bytes = t.ty.row_bytes(t.ne[0]).unwrap_or(0) as usize;
        let mut row = vec![0u8; row_bytes];
        let mut out = vec![0f32; tokens.len() * h];
        for (i, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            if tok >= self.cfg.vocab {
                return Err(RequestError::OutsideVocabulary {
                    token: tok as u32,
                    vocab: self.cfg.vocab,
                }
                .into());
            }
            // Read, not mapped: see `GgufFile::read_tensor_bytes`.
            self.file
                .read_tensor_bytes(t, (tok * row_bytes) as u64, &mut row)?;
            quant::dequantize(t.ty, &row, &mut out[i * h..(i + 1) * h]);
        }
        Ok(out)
    }
}

/// Tokens per forward chunk unless set otherwise (llama.cpp's default micro-batch).
pub const DEFAULT_UBATCH: usize = 512;

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(x, w, eps as f32)?)
}

/// Drops the pages of the tensors under `prefix` from this process (they were copied or
/// packed).
fn release_prefix(file: &GgufFile, prefix: &str) {
    for t in file
        .header
        .tensors
        .iter()
        .filter(|t| t.name.starts_with(prefix))
    {
        file.release(t, 0, t.n_bytes);
    }
}

impl Qwen3 {
    /// Runs one chunk through every layer; the logits of the tokens in `c.wanted` go to `out`
    /// (`wanted x vocab`, resized; left empty when none are wanted).
    fn forward_chunk(&self, c: &Chunk<'_>, cache: &mut KvCache, out: &mut Vec<f32>) -> Result<()> {
        let cfg = &self.cfg;
        let n = c.tokens.len();
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let mut x = Hidden::Host(self.embed(c.tokens)?);
        let vis = match &self.offload {
            Some(o) if o.layers > 0 => Some(DeviceVisibility::new(
                cache,
                c.slots,
                c.sights,
                c.positions,
                &self.inv_freq,
                &o.device,
            )?),
            _ => None,
        };
        let rope = RopeTable::new(c.positions, &self.inv_freq);
        let mut pass = Pass {
            chunk: c,
            rope: &rope,
            cache,
            heads: cfg.heads(),
            eps: cfg.rms_eps,
            device: vis.as_ref(),
            attn_tile: self.attn_tile,
        };
        for layer in &self.layers {
            if layer.on_host_path() {
                layer.forward_host(x.host()?, &mut pass, &mut scratch)?;
            } else {
                let t = x.tensor(n, &layer.device)?;
                x = Hidden::Tensor(layer.forward_tensors(t, &mut pass)?);
            }
        }
        if c.wanted.is_empty() {
            out.clear();
            return Ok(());
        }
        if let (Some(norm), Some(w)) = (&self.output_norm_host, self.output.weight()) {
            // The wanted rows, normalized, times the output layer straight into `out`.
            let x = x.host()?;
            let hsz = cfg.hidden;
            let h = sized(&mut scratch.h, c.wanted.len() * hsz);
            for (dst, &i) in h.chunks_exact_mut(hsz).zip(&c.wanted) {
                dst.copy_from_slice(&x[i * hsz..(i + 1) * hsz]);
            }
            host::rms_norm_in_place(h, norm, cfg.rms_eps as f32);
            // Every value is overwritten: only a longer buffer than last time is zeroed first.
            out.resize(c.wanted.len() * w.rows(), 0.0);
            matmul_many(&[w], h, c.wanted.len(), &mut [&mut out[..]]);
            return Ok(());
        }
        let x = x.tensor(n, &self.output_device)?;
        let idx: Vec<u32> = c.wanted.iter().map(|&i| i as u32).collect();
        let idx = Tensor::from_vec(idx, c.wanted.len(), &self.output_device)?;
        let x = x.index_select(&idx, 0)?;
        let x = rms_norm(&x, &self.output_norm, cfg.rms_eps)?;
        let logits = self.output.forward(&x)?.to_dtype(DType::F32)?;
        out.clear();
        out.extend(logits.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    }
}

impl Forward for Qwen3 {
    fn config(&self) -> &Qwen3Config {
        &self.cfg
    }

    fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Logits> {
        let mut out = Logits {
            vocab: self.cfg.vocab,
            data: Vec::new(),
        };
        self.forward_into(batch, cache, &mut out)?;
        Ok(out)
    }

    fn forward_into(&self, batch: &Batch, cache: &mut KvCache, out: &mut Logits) -> Result<()> {
        let cfg = &self.cfg;
        out.vocab = cfg.vocab;
        let n = batch.len();
        if batch.positions.len() != n
            || batch.rows.len() != n
            || !(batch.seqs.is_empty() || batch.seqs.len() == n)
        {
            return Err(Error::internal(
                "batch tokens, positions, rows and sequences differ in length",
            ));
        }
        let wanted = batch.logit_indices();
        if let Some(&bad) = wanted.iter().find(|&&i| i >= n) {
            return Err(Error::internal(format!(
                "logits asked for token {bad} of a batch of {n}"
            )));
        }
        if n == 0 {
            out.data.clear();
            return Ok(());
        }
        if cache.device_layers() != self.gpu_layers() {
            return Err(Error::internal(format!(
                "the KV cache holds {} layers on the device but the model runs {} there",
                cache.device_layers(),
                self.gpu_layers()
            )));
        }
        // Where the tokens go and what each sees: the cache's answer.
        let placement = cache.place(&batch.seqs, &batch.rows, &batch.positions)?;
        let chunk = |start: usize, end: usize, wanted: Vec<usize>| Chunk {
            tokens: &batch.tokens[start..end],
            positions: &batch.positions[start..end],
            slots: &placement.slots[start..end],
            sights: &placement.sights[start..end],
            placement: &placement,
            range: start..end,
            wanted,
        };
        if n <= self.ubatch {
            // One chunk: its logits come out in the order asked for, into `out`, no copy.
            return self.forward_chunk(&chunk(0, n, wanted), cache, &mut out.data);
        }
        // Chunks run through every layer in turn: a later chunk sees the entries an earlier
        // one wrote, an earlier one never sees later ones (its counts stop before them).
        let v = cfg.vocab;
        let data = &mut out.data;
        data.clear();
        data.resize(wanted.len() * v, 0.0);
        let mut logits = Vec::new();
        for start in (0..n).step_by(self.ubatch) {
            let end = (start + self.ubatch).min(n);
            let mine: Vec<(usize, usize)> = wanted
                .iter()
                .enumerate()
                .filter(|&(_, &i)| (start..end).contains(&i))
                .map(|(out, &i)| (out, i - start))
                .collect();
            let c = chunk(start, end, mine.iter().map(|&(_, i)| i).collect());
            self.forward_chunk(&c, cache, &mut logits)?;
            for (j, &(out, _)) in mine.iter().enumerate() {
                data[out * v..(out + 1) * v].copy_from_slice(&logits[j * v..(j + 1) * v]);
            }
        }
        Ok(())
    }
}
