//! The memory plan: which layers run on the GPU (`-ngl`), and what every device then holds
//! (weights, KV cache, scratch for the largest forward chunk). It is computed from the GGUF's
//! tensor sizes before anything is allocated, printed at load, and a model that fits nowhere
//! is refused with it.

use std::fmt;

use refusion_gguf::human_bytes;
use refusion_gguf::{GgmlType, GgufHeader, TensorInfo};

use crate::kv::{CacheType, KvTypes};
use crate::model::device_attention::ATTN_TILE;
use crate::model::{kquants, Qwen3Config};

/// `-ngl`: how many layers go to the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuLayers {
    /// As many as fit in free VRAM after the KV cache and scratch, the output layer last.
    Auto,
    /// Every layer and the output layer.
    All,
    /// The first N layers; above the model's layer count the output layer too (llama.cpp's
    /// convention: `-ngl 99` offloads everything).
    Count(usize),
}

impl std::str::FromStr for GpuLayers {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(GpuLayers::Auto),
            "all" => Ok(GpuLayers::All),
            _ => s.parse().map(GpuLayers::Count).map_err(|_| {
                format!("invalid -ngl '{s}' (expected a number of layers, auto or all)")
            }),
        }
    }
}

/// The GPU the plan is for.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    /// How the plan names it, e.g. `CUDA0 (NVIDIA GeForce RTX 3060)`.
    pub name: String,
    /// Free memory now, after the driver's context was created.
    pub free: u64,
}

/// What a model needs, per part, read off its GGUF.
#[derive(Debug, Clone)]
pub struct ModelSizes {
    /// Bytes of each layer's weights (as stored, which is what a GPU holds).
    pub layer_weights: Vec<u64>,
    /// Extra host bytes per layer when it runs on the CPU (see `repack_extra`).
    pub layer_repack: Vec<u64>,
    /// The output layer (or the tied embedding it reuses) and the final norm.
    pub output_weights: u64,
    pub output_repack: u64,
    /// K and V of one layer for one token.
    pub kv_per_layer_token: u64,
    /// The types they are stored as (what the advice on a cache too large steps down from).
    pub kv_types: KvTypes,
    pub hidden: u64,
    pub ffn: u64,
    pub n_heads: u64,
    pub n_kv_heads: u64,
    pub head_dim: u64,
    pub vocab: u64,
}

/// Host bytes a CPU weight needs beyond its size in the file: candle's x86 kernels keep a
/// repacked copy of Q4_K, Q6_K and Q8_0 weights beside the original; our Q4_K/Q5_K/Q6_K/Q8_0
/// tiles replace the original (its pages are released) and are at most 2.8% larger (plus a last run
/// padded to 16 rows: a few KiB, within the 3.1% counted for any matrix of Qwen3's sizes).
fn repack_extra(t: &TensorInfo) -> u64 {
    if kquants::supports(t.ty, t.ne.first().copied().unwrap_or(0) as usize) {
        t.n_bytes / 32
    } else if cfg!(target_arch = "x86_64")
        && matches!(t.ty, GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::Q8_0)
    {
        t.n_bytes
    } else {
        0
    }
}

impl ModelSizes {
    pub fn from_gguf(header: &GgufHeader, cfg: &Qwen3Config, cache_types: KvTypes) -> ModelSizes {
        let mut layer_weights = vec![0u64; cfg.n_layers];
        let mut layer_repack = vec![0u64; cfg.n_layers];
        let (mut output_weights, mut output_repack) = (0u64, 0u64);
        let output_name = if cfg.tied_output {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        for t in &header.tensors {
            let extra = repack_extra(t);
            let layer = refusion_gguf::layer_of(&t.name).filter(|&l| l < cfg.n_layers);
            if let Some(l) = layer {
                layer_weights[l] += t.n_bytes;
                layer_repack[l] += extra;
            } else if t.name == output_name || t.name == "output_norm.weight" {
                output_weights += t.n_bytes;
                output_repack += extra;
            }
        }
        ModelSizes {
            layer_weights,
            layer_repack,
            output_weights,
            output_repack,
            kv_per_layer_token: (cfg.n_kv_heads * cache_types.row_bytes(cfg.head_dim)) as u64,
            kv_types: cache_types,
            hidden: cfg.hidden as u64,
            ffn: cfg.ffn as u64,
            n_heads: cfg.n_heads as u64,
            n_kv_heads: cfg.n_kv_heads as u64,
            head_dim: cfg.head_dim as u64,
            vocab: cfg.vocab as u64,
        }
    }

    pub fn n_layers(&self) -> usize {
        self.layer_weights.len()
    }

    /// Working memory of one forward chunk of `n` tokens over a context of `context` entries:
    /// activations, attention scores (the largest part for long contexts) and, where the output
    /// layer runs, the logits of `logit_rows` tokens (and their copy out). The GPU path holds
    /// the scores of every head for one tile of the context ([`ATTN_TILE`] entries) and a
    /// running output per head; the CPU kernel one head per thread over the whole context
    /// (counted as two).
    pub fn scratch(&self, n: u64, context: u64, logit_rows: u64, gpu: bool) -> u64 {
        let qkv = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim;
        let activations = n * (6 * self.hidden + 2 * qkv + 3 * self.ffn) * 4;
        // Scores and their exponentials over a tile (GPU) or the whole context (CPU).
        let scores = if gpu {
            let tile = context.min(ATTN_TILE as u64);
            2 * self.n_heads * n * tile * 4 + 2 * self.n_heads * n * (self.head_dim + 2) * 4
        } else {
            2 * 2 * n * context * 4
        };
        activations + scores + 2 * logit_rows.min(n) * self.vocab * 4
    }
}

/// What one device holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Share {
    pub weights: u64,
    pub kv: u64,
    pub scratch: u64,
    /// The process before any weight is read: the program, the file's metadata and the
    /// tokenizer (host only; measured, not estimated).
    pub program: u64,
}

impl Share {
    pub fn total(&self) -> u64 {
        self.weights + self.kv + self.scratch + self.program
    }
}

/// The plan's note when the cache is one request's (`generate`): its size follows the request,
/// not `-c`.
const WORKLOAD_NOTE: &str = "this prompt and its answer";

/// Kept free on the GPU beyond the plan: cuBLAS workspaces, kernel modules, fragmentation.
pub const GPU_RESERVE: u64 = 384 << 20;

#[derive(Debug, Clone)]
pub struct MemoryPlan {
    pub gpu: Option<GpuInfo>,
    pub n_layers: usize,
    pub gpu_layers: usize,
    pub output_on_gpu: bool,
    pub on_gpu: Share,
    pub on_cpu: Share,
    /// Memory the process may use on the host (`None`: unknown).
    pub host_available: Option<u64>,
    /// The CPU layers' KV cache lives in a file (`--kv-file`), not in memory.
    pub kv_in_file: bool,
    pub context: usize,
    /// Entries of the cache the front end allocates (the context, the server's room for
    /// answers, or what one `generate` needs).
    pub kv_entries: usize,
    /// Why the cache is not the context (a note for the plan's last line).
    pub kv_note: Option<String>,
    /// Tokens per forward chunk: the largest batch the scratch is reserved for.
    pub ubatch: usize,
}

/// What a front end will ask of the model, where it knows before the weights load
/// (`generate` does: one prompt, one answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// Entries of the cache it allocates.
    pub kv_entries: usize,
    /// Tokens of its widest forward.
    pub forward_tokens: usize,
    /// The most tokens one forward asks logits for.
    pub logit_rows: usize,
}

/// Why a plan was refused: a one-line reason (naming the flag to change) and the plan.
#[derive(Debug, Clone)]
pub struct Refused {
    pub reason: String,
    pub plan: MemoryPlan,
}

/// Inputs of a plan besides the model.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    pub gpu: Option<GpuInfo>,
    pub layers: GpuLayers,
    pub host_available: Option<u64>,
    pub kv_in_file: bool,
    pub context: usize,
    /// Cache entries the caller adds beyond the context (the server's room for answers).
    pub kv_extra: usize,
    pub ubatch: usize,
    /// What the front end will ask, when it knows; otherwise any forward of `ubatch` tokens
    /// may ask logits for all of them.
    pub workload: Option<Workload>,
    /// Resident bytes of the process now, before the weights load.
    pub program: u64,
}

impl MemoryPlan {
    /// Places the layers and checks that every device can hold its share.
    pub fn new(sizes: &ModelSizes, req: &PlanRequest) -> Result<MemoryPlan, Box<Refused>> {
        let n = sizes.n_layers();
        // The cache's entries: what attention runs over and the KV holds. The room for answers
        // never exceeds the context (the server lowers its limit to what fits).
        let kv_extra = req.kv_extra.min(req.context);
        let (kv_entries, kv_note) = match req.workload {
            Some(w) if w.kv_entries == req.context => (w.kv_entries, None),
            Some(w) => (w.kv_entries, Some(WORKLOAD_NOTE.to_string())),
            None if kv_extra > 0 => (
                req.context + kv_extra,
                Some(format!("+{kv_extra} for answers")),
            ),
            None => (req.context, None),
        };
        let ctx = kv_entries as u64;
        let mut ub = req.ubatch.min(req.context.max(1)).max(1) as u64;
        if let Some(g) = &req.gpu {
            // Scores of a chunk grow with the context: shrink the chunk until its scratch
            // takes at most a quarter of the free VRAM.
            let budget = g.free.saturating_sub(GPU_RESERVE) / 4;
            while ub > 16 && sizes.scratch(ub, ctx, ub, true) > budget {
                ub /= 2;
            }
        }
        let (gpu_layers, output_on_gpu) = match (&req.gpu, req.layers) {
            (None, _) => (0, false),
            (Some(_), GpuLayers::All) => (n, true),
            (Some(_), GpuLayers::Count(k)) => (k.min(n), k > n),
            (Some(g), GpuLayers::Auto) => fit(sizes, g.free.saturating_sub(GPU_RESERVE), ctx, ub),
        };
        let mut plan = MemoryPlan {
            gpu: req.gpu.clone(),
            n_layers: n,
            gpu_layers,
            output_on_gpu,
            on_gpu: Share::default(),
            on_cpu: Share::default(),
            host_available: req.host_available,
            kv_in_file: req.kv_in_file,
            context: req.context,
            kv_entries,
            kv_note,
            ubatch: ub as usize,
        };
        // What the scratch is reserved for: the widest forward the front end makes (at most one
        // chunk) and the logits it asks for, or any chunk with all its logits.
        let (widest, rows) = match req.workload {
            Some(w) => {
                let widest = (w.forward_tokens.max(1) as u64).min(ub);
                (widest, (w.logit_rows as u64).min(widest))
            }
            None => (ub, ub),
        };
        plan.on_gpu = gpu_share(sizes, gpu_layers, output_on_gpu, ctx, ub);
        let cpu_layers = gpu_layers..n;
        plan.on_cpu = Share {
            weights: cpu_layers
                .clone()
                .map(|l| sizes.layer_weights[l] + sizes.layer_repack[l])
                .sum::<u64>()
                + if output_on_gpu {
                    0
                } else {
                    sizes.output_weights + sizes.output_repack
                },
            kv: if req.kv_in_file {
                0
            } else {
                cpu_layers.len() as u64 * sizes.kv_per_layer_token * ctx
            },
            scratch: sizes.scratch(widest, ctx, if output_on_gpu { 0 } else { rows }, false),
            program: req.program,
        };

        match plan.refusal(sizes) {
            Some(reason) => Err(Box::new(Refused { reason, plan })),
            None => Ok(plan),
        }
    }

    /// Why this plan does not fit, when it does not: the GPU's share beyond its free memory,
    /// or the CPU's beyond what is available (the weights, the KV cache or the scratch named).
    fn refusal(&self, sizes: &ModelSizes) -> Option<String> {
        if let Some(g) = &self.gpu {
            if self.on_gpu.total() + GPU_RESERVE > g.free && self.gpu_layers > 0 {
                return Some(format!(
                    "{} layers{} need {} on {} but only {} is free; lower -ngl (or use -ngl auto), -c or --ubatch-size",
                    self.gpu_layers,
                    if self.output_on_gpu { " and the output layer" } else { "" },
                    human_bytes(self.on_gpu.total() + GPU_RESERVE),
                    g.name,
                    human_bytes(g.free)
                ));
            }
        }
        // What is available is what the process does not hold yet: the program is already
        // resident (and counted out of `MemAvailable`).
        let avail = self.host_available?;
        let c = self.on_cpu;
        if c.total() - c.program <= avail {
            return None;
        }
        Some(if c.weights > avail {
            format!(
                "the weights need about {} of memory on the CPU (with candle's repacked copies) but only {} is available; \
                 use a smaller quantization{}",
                human_bytes(c.weights),
                human_bytes(avail),
                if self.gpu.is_some() { " or offload more layers (-ngl)" } else { "" }
            )
        } else if c.weights + c.kv > avail {
            format!(
                "the KV cache for {} tokens needs {} on the CPU but only {} of memory is available besides the weights; {}",
                self.kv_entries,
                human_bytes(c.kv),
                human_bytes(avail - c.weights),
                self.kv_advice(sizes, avail - c.weights - c.scratch.min(avail - c.weights)),
            )
        } else {
            format!(
                "a forward chunk of {} tokens over a context of {} needs about {} of working memory but only {} is left; \
                 lower --ubatch-size or -c",
                self.ubatch,
                self.context,
                human_bytes(c.scratch),
                human_bytes(avail - c.weights - c.kv)
            )
        })
    }
}

impl MemoryPlan {
    /// What would make the CPU's KV cache fit in `room` bytes: the largest `-c` at its types
    /// (where the cache follows the context: not for one request's own cache), the first
    /// smaller types (q8_0, then q4_0, for keys and values) that hold it (not with layers on a
    /// GPU, which has no path for them), or a file.
    fn kv_advice(&self, sizes: &ModelSizes, room: u64) -> String {
        let kv = self.on_cpu.kv.max(1);
        let mut ways = Vec::new();
        if self.kv_note.as_deref() != Some(WORKLOAD_NOTE) {
            // The entries that fit; the context beside its room for answers (at most the
            // context) within them.
            let fit = (self.kv_entries as u128 * room as u128 / kv as u128) as u64;
            let extra = self.kv_entries.saturating_sub(self.context) as u64;
            let context = if fit >= 2 * extra {
                fit - extra
            } else {
                fit / 2
            };
            let context = context / 256 * 256;
            ways.push(if context > 0 {
                format!("lower -c to {context}")
            } else {
                "lower -c".to_string()
            });
        }
        let hd = sizes.head_dim as usize;
        let now = sizes.kv_types.row_bytes(hd) as u64;
        let smaller = [CacheType::Q8_0, CacheType::Q4_0]
            .map(KvTypes::same)
            .into_iter()
            .filter(|t| t.check_head_dim(hd).is_ok() && (t.row_bytes(hd) as u64) < now)
            .find(|t| kv / now * t.row_bytes(hd) as u64 <= room);
        if let (Some(t), 0) = (smaller, self.gpu_layers) {
            ways.push(format!("use -ctk {} -ctv {}", t.k.name(), t.v.name()));
        }
        ways.push("back it with a file (--kv-file)".to_string());
        match ways.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{}, or {last}", rest.join(", ")),
            _ => ways.concat(),
        }
    }
}

fn gpu_share(sizes: &ModelSizes, layers: usize, output: bool, ctx: u64, ub: u64) -> Share {
    if layers == 0 && !output {
        return Share::default();
    }
    Share {
        weights: sizes.layer_weights[..layers].iter().sum::<u64>()
            + if output { sizes.output_weights } else { 0 },
        kv: layers as u64 * sizes.kv_per_layer_token * ctx,
        scratch: sizes.scratch(ub, ctx, if output { ub } else { 0 }, true),
        program: 0,
    }
}

/// `-ngl auto`: the most leading layers that fit in `budget`, then the output layer if it
/// fits too.
fn fit(sizes: &ModelSizes, budget: u64, ctx: u64, ub: u64) -> (usize, bool) {
    let n = sizes.n_layers();
    let fits =
        |layers: usize, output: bool| gpu_share(sizes, layers, output, ctx, ub).total() <= budget;
    let mut layers = 0;
    while layers < n && fits(layers + 1, false) {
        layers += 1;
    }
    if layers == 0 {
        return (0, false);
    }
    (layers, layers == n && fits(n, true))
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = |x: u64| human_bytes(x);
        match &self.gpu {
            Some(g) => writeln!(
                f,
                "memory plan: {}/{} layers on {}, output layer on {}",
                self.gpu_layers,
                self.n_layers,
                g.name,
                if self.output_on_gpu {
                    "the GPU"
                } else {
                    "the CPU"
                }
            )?,
            None => writeln!(f, "memory plan: {} layers on the CPU", self.n_layers)?,
        }
        let line = |f: &mut fmt::Formatter<'_>, name: &str, s: &Share, of: String| {
            let program = match s.program {
                0 => String::new(),
                p => format!("  program {:>10}", b(p)),
            };
            writeln!(
                f,
                "  {name:<5} weights {:>10}  KV {:>10}  scratch {:>10}{program}  total {:>10}{of}",
                b(s.weights),
                b(s.kv),
                b(s.scratch),
                b(s.total()),
            )
        };
        if let Some(g) = &self.gpu {
            line(
                f,
                "GPU",
                &self.on_gpu,
                format!(" (+{} reserve) of {} free", b(GPU_RESERVE), b(g.free)),
            )?;
        }
        line(
            f,
            "CPU",
            &self.on_cpu,
            match self.host_available {
                Some(a) if self.on_cpu.program > 0 => format!(" ({} more available)", b(a)),
                Some(a) => format!(" of {} available", b(a)),
                None => String::new(),
            },
        )?;
        write!(
            f,
            "  context {} tokens{}{}; forwards run in chunks of up to {} tokens",
            self.context,
            match &self.kv_note {
                None => String::new(),
                Some(why) => format!(" (the cache holds {} entries: {why})", self.kv_entries),
            },
            if self.kv_in_file {
                ", CPU layers' KV in the --kv-file"
            } else {
                ""
            },
            self.ubatch
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-8B-like numbers at Q4_K_M: 36 layers of ~130 MB, output ~650 MB.
    fn sizes_8b() -> ModelSizes {
        ModelSizes {
            layer_weights: vec![130 << 20; 36],
            layer_repack: vec![100 << 20; 36],
            output_weights: 650 << 20,
            output_repack: 650 << 20,
            kv_per_layer_token: 2 * 8 * 128 * 2,
            kv_types: KvTypes::same(CacheType::F16),
            hidden: 4096,
            ffn: 12288,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            vocab: 151_671,
        }
    }

    fn req(free: Option<u64>, layers: GpuLayers) -> PlanRequest {
        PlanRequest {
            gpu: free.map(|free| GpuInfo {
                name: "CUDA0".into(),
                free,
            }),
            layers,
            host_available: Some(64 << 30),
            kv_in_file: false,
            context: 4096,
            kv_extra: 0,
            ubatch: 512,
            workload: None,
            program: 0,
        }
    }

    #[test]
    fn gpu_attention_scratch_stops_growing_at_one_tile() {
        let s = sizes_8b();
        let tile = ATTN_TILE as u64;
        // The GPU's scores cover one tile of the context at most; the CPU's the whole context.
        assert_eq!(
            s.scratch(512, tile, 512, true),
            s.scratch(512, 32 * tile, 512, true)
        );
        assert!(s.scratch(512, tile / 2, 512, true) < s.scratch(512, tile, 512, true));
        assert!(s.scratch(512, tile, 512, false) < s.scratch(512, 32 * tile, 512, false));
        // So a long context keeps the full chunk on a 16 GiB card (whole-context scores would
        // have taken 4.3 GB, more than the quarter of free VRAM a chunk may use).
        let mut r = req(Some(16 << 30), GpuLayers::All);
        r.context = 32768;
        let p = MemoryPlan::new(&s, &r).unwrap();
        assert_eq!(p.ubatch, 512, "{p}");
    }

    #[test]
    fn auto_fits_what_free_vram_holds() {
        let s = sizes_8b();
        // 24 GiB: everything, output included.
        let p = MemoryPlan::new(&s, &req(Some(24 << 30), GpuLayers::Auto)).unwrap();
        assert_eq!((p.gpu_layers, p.output_on_gpu), (36, true));
        // 4 GiB: some layers, no output layer; the plan stays within the budget.
        let p = MemoryPlan::new(&s, &req(Some(4 << 30), GpuLayers::Auto)).unwrap();
        assert!(p.gpu_layers > 0 && p.gpu_layers < 36, "{p}");
        assert!(!p.output_on_gpu);
        assert!(p.on_gpu.total() + GPU_RESERVE <= 4 << 30);
        // One more layer would not have fitted.
        let more = gpu_share(&s, p.gpu_layers + 1, false, 4096, 512).total();
        assert!(more + GPU_RESERVE > 4 << 30);
        // Almost nothing free: all on the CPU.
        let p = MemoryPlan::new(&s, &req(Some(300 << 20), GpuLayers::Auto)).unwrap();
        assert_eq!((p.gpu_layers, p.on_gpu.total()), (0, 0));
        assert_eq!(p.on_cpu.kv, 36 * 4096 * 4096);
    }

    #[test]
    fn explicit_counts_follow_llama_cpp_and_are_checked() {
        let s = sizes_8b();
        let p = MemoryPlan::new(&s, &req(Some(24 << 30), GpuLayers::Count(10))).unwrap();
        assert_eq!((p.gpu_layers, p.output_on_gpu), (10, false));
        assert_eq!(p.on_gpu.kv, 10 * 4096 * 4096);
        assert_eq!(p.on_cpu.kv, 26 * 4096 * 4096);
        let p = MemoryPlan::new(&s, &req(Some(24 << 30), GpuLayers::Count(99))).unwrap();
        assert_eq!((p.gpu_layers, p.output_on_gpu), (36, true));
        assert_eq!(p.on_cpu.weights, 0);
        let e = MemoryPlan::new(&s, &req(Some(2 << 30), GpuLayers::All)).unwrap_err();
        assert!(e.reason.contains("-ngl"), "{}", e.reason);
        assert!(e.plan.to_string().contains("36/36 layers"), "{}", e.plan);
        // Without a GPU, -ngl places nothing.
        let p = MemoryPlan::new(&s, &req(None, GpuLayers::All)).unwrap();
        assert_eq!(p.gpu_layers, 0);
    }

    #[test]
    fn the_host_side_is_checked_too() {
        let s = sizes_8b();
        let mut r = req(None, GpuLayers::Auto);
        r.host_available = Some(1 << 30);
        let e = MemoryPlan::new(&s, &r).unwrap_err();
        assert!(e.reason.contains("the weights need about"), "{}", e.reason);
        r.host_available = Some(12 << 30);
        r.context = 40_000;
        let e = MemoryPlan::new(&s, &r).unwrap_err();
        assert!(e.reason.contains("--kv-file"), "{}", e.reason);
        // The cache advice names the context and the types that would fit.
        assert!(
            e.reason.contains("lower -c to ") && e.reason.contains("-ctk q4_0 -ctv q4_0"),
            "{}",
            e.reason
        );
        r.context = 20_000;
        let e = MemoryPlan::new(&s, &r).unwrap_err();
        assert!(e.reason.contains("-ctk q8_0 -ctv q8_0"), "{}", e.reason);
        // The -c advised fits, beside a server's room for answers too.
        for extra in [0, 4096, 20_000] {
            let mut r = r.clone();
            r.kv_extra = extra;
            let e = MemoryPlan::new(&s, &r).unwrap_err();
            let advised: usize = e
                .reason
                .split("lower -c to ")
                .nth(1)
                .unwrap()
                .split(',')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            r.context = advised;
            assert!(
                MemoryPlan::new(&s, &r).is_ok(),
                "-c {advised} (+{extra}): {}",
                e.reason
            );
        }
        // One request's own cache does not follow -c: no -c to advise.
        let mut w = r.clone();
        w.context = 32_768;
        w.workload = Some(Workload {
            kv_entries: 30_000,
            forward_tokens: 512,
            logit_rows: 32,
        });
        let e = MemoryPlan::new(&s, &w).unwrap_err();
        assert!(!e.reason.contains("lower -c"), "{}", e.reason);
        assert!(
            e.reason.contains("use -ctk q8_0 -ctv q8_0, or back it"),
            "{}",
            e.reason
        );
        r.kv_in_file = true;
        let p = MemoryPlan::new(&s, &r).unwrap();
        assert_eq!(p.on_cpu.kv, 0);
        // Offloading layers moves their share off the host.
        let mut r = req(Some(24 << 30), GpuLayers::All);
        r.host_available = Some(1 << 30);
        assert!(MemoryPlan::new(&s, &r).is_ok());
    }

    #[test]
    fn a_known_workload_plans_its_cache_and_logits_and_the_program_is_counted_not_refused() {
        let s = sizes_8b();
        let mut r = req(None, GpuLayers::Auto);
        let full = MemoryPlan::new(&s, &r).unwrap();
        r.workload = Some(Workload {
            kv_entries: 600,
            forward_tokens: 40,
            logit_rows: 16,
        });
        r.program = 80 << 20;
        let p = MemoryPlan::new(&s, &r).unwrap();
        // The cache is the request's, not the context's.
        assert_eq!(p.on_cpu.kv, 36 * 4096 * 600);
        assert!(p.to_string().contains("the cache holds 600 entries"), "{p}");
        // The scratch is a 40-token forward with 16 rows of logits, not a chunk of 512 with all.
        assert_eq!(p.on_cpu.scratch, s.scratch(40, 600, 16, false));
        assert!(p.on_cpu.scratch * 10 < full.on_cpu.scratch);
        // The program is in the total, but not held against what is still available (it
        // already is resident): a plan that fits besides it is not refused.
        assert_eq!(
            p.on_cpu.total(),
            p.on_cpu.weights + p.on_cpu.kv + p.on_cpu.scratch + (80 << 20)
        );
        r.host_available = Some(p.on_cpu.total() - (80 << 20));
        assert!(MemoryPlan::new(&s, &r).is_ok());
        r.host_available = Some(p.on_cpu.total() - (80 << 20) - 1);
        assert!(MemoryPlan::new(&s, &r).is_err());
    }

    #[test]
    fn ngl_values_parse_like_llama_cpp() {
        assert_eq!("auto".parse::<GpuLayers>(), Ok(GpuLayers::Auto));
        assert_eq!("all".parse::<GpuLayers>(), Ok(GpuLayers::All));
        assert_eq!("12".parse::<GpuLayers>(), Ok(GpuLayers::Count(12)));
        assert!("-1".parse::<GpuLayers>().is_err());
        assert!("lots".parse::<GpuLayers>().unwrap_err().contains("-ngl"));
    }
}
