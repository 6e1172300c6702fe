//! Loading a model for running: the GGUF map, the weights on a device, the tokenizer and a
//! KV cache sized for the context, with a one-line report of what was loaded.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use refusion_gguf::{GgufFile, GgufHeader};

use super::Notes;
use crate::chat::Tokenizer;
use crate::error::{Error, Result};
use crate::kv::claim::{claim, CacheFile};
use crate::kv::{KvCache, KvTypes};
use crate::load::plan::{GpuInfo, GpuLayers, MemoryPlan, ModelSizes, PlanRequest, Workload};
use crate::model::{Forward, Offload, Qwen3, Qwen3Config};

/// Where the forward runs (`--device`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    Cuda(usize),
    /// CUDA when a GPU is there, else the CPU.
    Auto,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "auto" => Ok(DeviceChoice::Auto),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Ok(DeviceChoice::Cuda(n)),
                _ => Err(format!(
                    "unknown device '{s}' (expected cpu, cuda, cuda:N or auto)"
                )),
            },
        }
    }
}

impl DeviceChoice {
    /// The candle device, or a clear error when the build or the machine has no GPU.
    pub fn open(&self, notes: &Notes) -> Result<Device> {
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda(n) => open_cuda(*n),
            DeviceChoice::Auto => match open_cuda(0) {
                Ok(d) => Ok(d),
                Err(e) => {
                    if cfg!(feature = "cuda") {
                        notes.say(&format!("no usable GPU ({e}); running on the CPU"));
                    }
                    Ok(Device::Cpu)
                }
            },
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(n: usize) -> Result<Device> {
    // candle reports a missing device or driver as a multi-line debug dump: keep one line.
    let device = Device::new_cuda(n).map_err(|e| {
        let e = e.to_string();
        let first = e
            .lines()
            .next()
            .unwrap_or("unknown error")
            .trim()
            .to_string();
        Error::setup(format!("cannot open CUDA device {n}: {first}"))
    })?;
    if let (Device::Cuda(cd), Some(built)) = (&device, BUILT_FOR_CAP) {
        let ctx = cd.cuda_stream().context().clone();
        if let Ok((major, minor)) = ctx.compute_capability() {
            let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
            check_compute_cap(built, major, minor)
                .map_err(|e| Error::setup(format!("CUDA device {n} ({name}): {e}")))?;
        }
    }
    Ok(device)
}

/// The GPU family this build's CUDA kernels were compiled for (`CUDA_COMPUTE_CAP` at build time).
#[cfg(feature = "cuda")]
const BUILT_FOR_CAP: Option<&str> = option_env!("CUDA_COMPUTE_CAP");

/// Whether kernels built for `built` (e.g. "86", "90") run on a GPU of compute capability
/// `major.minor`. candle compiles its quantized matmuls (mmq/mmvq) to machine code for exactly
/// one architecture, with no PTX to fall back on: code for sm_XY runs on sm_XZ with Z >= Y,
/// and from sm_90 on candle builds the arch-specific variants (sm_90a, sm_120a) that run on
/// that one architecture only. Refusing up front beats "no kernel image is available" at the
/// first matmul.
pub fn check_compute_cap(built: &str, major: i32, minor: i32) -> Result<(), String> {
    let base: i32 = built
        .trim_end_matches(|c: char| c.is_ascii_alphabetic())
        .parse()
        .map_err(|_| format!("unreadable CUDA_COMPUTE_CAP {built:?} in this build"))?;
    let (b_major, b_minor) = (base / 10, base % 10);
    let runs = if base >= 90 {
        (major, minor) == (b_major, b_minor)
    } else {
        major == b_major && minor >= b_minor
    };
    if runs {
        Ok(())
    } else {
        Err(format!(
            "this refusion's CUDA kernels are built for sm_{base} and the GPU is sm_{major}{minor}; \
             rebuild with CUDA_COMPUTE_CAP={major}{minor} (one build per GPU family, see the README)"
        ))
    }
}

/// The GPU's name and free memory, for the plan.
#[cfg(feature = "cuda")]
fn gpu_info(device: &Device) -> Option<GpuInfo> {
    let Device::Cuda(cd) = device else {
        return None;
    };
    let stream = cd.cuda_stream();
    let ctx = stream.context();
    let (free, _total) = ctx.mem_get_info().ok()?;
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    Some(GpuInfo {
        name: format!("CUDA{} ({name})", ctx.ordinal()),
        free: free as u64,
    })
}

#[cfg(not(feature = "cuda"))]
fn gpu_info(_device: &Device) -> Option<GpuInfo> {
    None
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_n: usize) -> Result<Device> {
    Err(Error::setup(
        "this refusion was built without CUDA (rebuild with `--features cuda`)",
    ))
}

/// The context when `-c` is not given (llama.cpp's default is 4096 too).
pub const DEFAULT_CONTEXT: usize = 4096;

/// The largest context accepted (`-c`, or a file's trained context with `-c 0`): 2^24 tokens,
/// far beyond what a Qwen3 is trained on, and small enough that positions (u32) and every size
/// the memory plan multiplies from it stay exact.
pub const MAX_CONTEXT: usize = 1 << 24;

/// The most threads accepted (`-t`), as llama.cpp's `GGML_MAX_N_THREADS`: far more than any
/// CPU has, and few enough that spawning them cannot take minutes.
pub const MAX_THREADS: usize = 512;

/// Sizes the thread pools (`-t`, the Python module's `n_threads`): rayon's global pool, which
/// our kernels and candle's quantized matmuls use, and candle's own count for its f32 matmuls.
/// 0 or absent: one thread per core. The pools can be sized once per process: asking again
/// for the same count is fine, for another an error; more threads than the CPUs this process
/// may use get a warning in `notes`.
pub fn set_threads(threads: Option<usize>, notes: &Notes) -> std::result::Result<(), String> {
    static SET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let Some(n) = threads.filter(|&n| n > 0) else {
        return Ok(());
    };
    match SET.get() {
        Some(&done) if done == n => return Ok(()),
        Some(&done) => {
            return Err(format!(
                "cannot set {n} threads: already running with {done}"
            ))
        }
        None => {}
    }
    // The CPUs this process may run on (its affinity mask and cgroup quota): more threads
    // than that only take turns.
    if let Some(cpus) = std::thread::available_parallelism()
        .ok()
        .filter(|c| n > c.get())
    {
        notes.say(&format!(
            "warning: -t {n} is more threads than the {cpus} CPUs this process may use; they will take turns, which is slower (-t {cpus} or fewer)"
        ));
    }
    // candle reads RAYON_NUM_THREADS for its gemm parallelism; set before any use.
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| format!("cannot set {n} threads: {e}"))?;
    let _ = SET.set(n);
    Ok(())
}

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub path: PathBuf,
    /// Context size in entries; 0 means the model's trained context, `None`
    /// [`DEFAULT_CONTEXT`] or the trained context if smaller.
    pub context: Option<usize>,
    /// The KV cache's key and value types (`-ctk`, `-ctv`).
    pub cache_types: KvTypes,
    pub kv_file: Option<PathBuf>,
    pub device: DeviceChoice,
    /// `-ngl`; `None` means auto (and no warning when there is no GPU).
    pub gpu_layers: Option<GpuLayers>,
    /// Most tokens per forward chunk (`-ub`); the plan may lower it to fit the GPU.
    pub ubatch: usize,
    /// Copy quantized CPU weights into memory instead of reading them from the map.
    pub no_mmap: bool,
    /// Check every tensor's data before anything else (`--check-tensors`).
    pub check_tensors: bool,
    /// Cache entries the caller will allocate beyond the context (`serve`'s room for
    /// answers), planned with it.
    pub kv_extra: usize,
    /// The thread count is the default (one per CPU): a busy machine gets a note.
    pub default_threads: bool,
    /// The plan and the load line as well as the warnings.
    pub verbose: bool,
    /// Where those lines go.
    pub notes: Notes,
}

pub struct Loaded {
    pub file: Arc<GgufFile>,
    pub model: Qwen3,
    pub tokenizer: Arc<Tokenizer>,
    pub load_seconds: f64,
    /// The context (`-c`) in tokens: prompt plus answer.
    pub context: usize,
    pub plan: MemoryPlan,
    cache_types: KvTypes,
    kv_file: Option<PathBuf>,
    verbose: bool,
    notes: Notes,
}

impl Loaded {
    /// The KV cache's key and value types (`-ctk`, `-ctv`).
    pub fn cache_types(&self) -> KvTypes {
        self.cache_types
    }

    /// A KV cache of `capacity` entries (the context plus any scratch the caller needs).
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let shape = self.model.cache_shape(capacity);
        let host_layers = shape.n_layers - self.model.gpu_layers().min(shape.n_layers);
        let kv_bytes = (shape.layer_bytes_per_token(self.cache_types) as u64)
            .saturating_mul(host_layers as u64)
            .saturating_mul(capacity as u64);
        if self.kv_file.is_none() {
            if let Some(avail) = available_memory() {
                if kv_bytes > avail {
                    return Err(Error::setup(format!(
                        "the KV cache for {capacity} tokens needs {} ({} per token, {}) but only {} of memory is available; \
                         lower -c, use a smaller -ctk/-ctv (q8_0 halves f16), or back it with a file (--kv-file)",
                        mib(kv_bytes),
                        shape.bytes_per_token(self.cache_types),
                        self.cache_types,
                        mib(avail)
                    )));
                }
            }
        }
        let cache = self
            .model
            .new_cache(capacity, self.cache_types, self.kv_file.as_deref())?;
        if self.verbose {
            let per_token = shape.bytes_per_token(self.cache_types);
            self.notes.say(&format!(
                "KV cache: {capacity} entries x {per_token} bytes per token ({}, {:.1} MiB{})",
                self.cache_types,
                (per_token * capacity) as f64 / (1 << 20) as f64,
                self.kv_file
                    .as_ref()
                    .map(|p| format!(", file {}", p.display()))
                    .unwrap_or_default(),
            ));
        }
        Ok(cache)
    }
}

/// Memory this process may still use: `REFUSION_MAX_MEMORY` (bytes) if set, else the kernel's
/// MemAvailable (Linux). `None` when unknown (then nothing is checked).
pub fn available_memory() -> Option<u64> {
    if let Some(v) = std::env::var("REFUSION_MAX_MEMORY")
        .ok()
        .and_then(|v| v.trim().parse().ok())
    {
        return Some(v);
    }
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn mib(b: u64) -> String {
    refusion_gguf::human_bytes(b)
}

/// The tensors' types and how many of each ("q4_K 197, q6_K 29, f32 113"), so that what was
/// accepted is said (`refusion info` lists each tensor's).
fn type_census(file: &GgufFile) -> String {
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for t in &file.header.tensors {
        *counts.entry(t.ty.name()).or_default() += 1;
    }
    let mut v: Vec<(&str, usize)> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    v.iter()
        .map(|(n, c)| format!("{n} {c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Resident memory of this process in bytes (Linux), for reports.
pub fn resident_bytes() -> Option<u64> {
    status_bytes("VmRSS:")
}

/// The most resident memory this process has held (Linux's high-water mark), for reports.
pub fn peak_resident_bytes() -> Option<u64> {
    status_bytes("VmHWM:")
}

fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn load(opts: &LoadOptions) -> Result<Loaded> {
    load_for(opts, |_| Ok(None))
}

/// What [`load_for`]'s front end is shown before the weights load: the tokenizer, the file's
/// metadata, the model's vocabulary and the context.
pub struct BeforeWeights<'a> {
    pub tokenizer: &'a Tokenizer,
    pub header: &'a GgufHeader,
    pub vocab: usize,
    pub context: usize,
}

/// [`load`] for a front end that knows its workload once the tokenizer is built (`generate`:
/// its prompt's length), so that the memory plan is of what it will use. An error from
/// `workload` (a prompt beyond the context) stops the load before any weight is read.
pub fn load_for<E: From<Error>>(
    opts: &LoadOptions,
    workload: impl FnOnce(BeforeWeights<'_>) -> std::result::Result<Option<Workload>, E>,
) -> std::result::Result<Loaded, E> {
    let start = Instant::now();
    let opened = open(opts)?;
    let workload = workload(BeforeWeights {
        tokenizer: &opened.tokenizer,
        header: &opened.file.header,
        vocab: opened.setup.cfg.vocab,
        context: opened.setup.context,
    })?;
    Ok(finish_load(opts, opened, workload, start)?)
}

/// A model file opened, its tokenizer built, before any weight is read.
struct Opened {
    file: Arc<GgufFile>,
    tokenizer: Tokenizer,
    setup: Setup,
}

fn open(opts: &LoadOptions) -> Result<Opened> {
    crate::model::kquants::check_env().map_err(Error::setup)?;
    // Before anything loads: never a file of the user's, least of all the model itself.
    if let Some(kv) = &opts.kv_file {
        claim(kv, CacheFile::Live, Some(&opts.path))?;
    }
    let file = Arc::new(GgufFile::open(&opts.path)?);
    if opts.check_tensors {
        file.check_tensors()?;
    }
    if file.header.version != 3 && opts.verbose {
        opts.notes.say(&format!(
            "note: {} is GGUF version {} (read as version 3, whose layout it shares)",
            opts.path.display(),
            file.header.version
        ));
    }
    let in_file = |e: Error| Error::InFile {
        path: opts.path.clone(),
        error: Box::new(e),
    };
    // The tokenizer (a vocabulary and merge table to build) loads beside the device and the
    // config; the plan waits for it, so that it counts the process as it stands.
    let (tokenizer, setup) = std::thread::scope(|scope| {
        let tokenizer = scope.spawn(|| Tokenizer::from_gguf(&file.header));
        let setup = prepare(opts, &file);
        let tokenizer = tokenizer
            .join()
            .map_err(|_| Error::internal("building the tokenizer panicked"));
        (tokenizer, setup)
    });
    let tokenizer = tokenizer?.map_err(in_file)?;
    let setup = setup.map_err(in_file)?;
    if tokenizer.vocab_size() > setup.cfg.vocab {
        return Err(in_file(Error::model(format!(
            "the tokenizer has {} tokens but the model only {} embedding rows",
            tokenizer.vocab_size(),
            setup.cfg.vocab
        ))));
    }
    Ok(Opened {
        file,
        tokenizer,
        setup,
    })
}

fn finish_load(
    opts: &LoadOptions,
    Opened {
        file,
        tokenizer,
        setup,
    }: Opened,
    workload: Option<Workload>,
    start: Instant,
) -> Result<Loaded> {
    let in_file = |e: Error| Error::InFile {
        path: opts.path.clone(),
        error: Box::new(e),
    };
    let Weights {
        model,
        plan,
        context,
        device,
    } = load_weights(opts, &file, setup, workload).map_err(in_file)?;
    let cfg = model.config();
    let load_seconds = start.elapsed().as_secs_f64();
    if opts.verbose {
        opts.notes.say(&format!(
            "loaded {} ({} layers, hidden {}, vocab {}; tensors {}) on {:?} in {:.2} s (kernels: {})",
            Path::new(&opts.path).display(),
            cfg.n_layers,
            cfg.hidden,
            cfg.vocab,
            type_census(&file),
            device.location(),
            load_seconds,
            crate::model::kquants::path_name(),
        ));
        if let Some(note) = busy_note().filter(|_| opts.default_threads) {
            opts.notes.say(&note);
        }
    }
    Ok(Loaded {
        file,
        model,
        tokenizer: Arc::new(tokenizer),
        load_seconds,
        context,
        plan,
        cache_types: opts.cache_types,
        kv_file: opts.kv_file.clone(),
        verbose: opts.verbose,
        notes: opts.notes.clone(),
    })
}

/// The model's weights, placed by the memory plan.
struct Weights {
    model: Qwen3,
    plan: MemoryPlan,
    context: usize,
    device: Device,
}

/// What the plan starts from: the device, the config and the context.
struct Setup {
    device: Device,
    cfg: Qwen3Config,
    context: usize,
}

fn prepare(opts: &LoadOptions, file: &GgufFile) -> Result<Setup> {
    let device = opts.device.open(&opts.notes)?;
    let cfg = Qwen3Config::from_gguf(&file.header)?;
    let context = context_for(opts.context, &cfg, &opts.notes)?;
    Ok(Setup {
        device,
        cfg,
        context,
    })
}

/// The memory plan (checked before anything is allocated), then the weights where the plan
/// puts them.
fn load_weights(
    opts: &LoadOptions,
    file: &Arc<GgufFile>,
    Setup {
        device,
        cfg,
        context,
    }: Setup,
    workload: Option<Workload>,
) -> Result<Weights> {
    let gpu = gpu_info(&device);
    if gpu.is_none() {
        if let Some(GpuLayers::Count(n)) = opts.gpu_layers.filter(|&l| l != GpuLayers::Count(0)) {
            opts.notes.say(&format!(
                "warning: -ngl {n} has no effect: running on the CPU"
            ));
        }
    }
    opts.cache_types
        .check_head_dim(cfg.head_dim)
        .map_err(Error::setup)?;
    let sizes = ModelSizes::from_gguf(&file.header, &cfg, opts.cache_types);
    let request = PlanRequest {
        gpu,
        layers: opts.gpu_layers.unwrap_or(GpuLayers::Auto),
        host_available: available_memory(),
        kv_in_file: opts.kv_file.is_some(),
        context,
        kv_extra: opts.kv_extra,
        ubatch: opts.ubatch,
        workload,
        program: resident_bytes().unwrap_or(0),
    };
    let plan = MemoryPlan::new(&sizes, &request)
        .map_err(|r| Error::setup(format!("{}\n{}", r.reason, r.plan)))?;
    if plan.gpu_layers > 0 {
        for (flag, t) in [("-ctk", opts.cache_types.k), ("-ctv", opts.cache_types.v)] {
            if t.kind().dtype().is_none() {
                return Err(Error::setup(format!(
                    "{flag} {}: a {} KV cache has no GPU path yet; use -ngl 0, or {flag} f16",
                    t.name(),
                    t.name()
                )));
            }
        }
    }
    if plan.gpu.is_some() || opts.verbose {
        opts.notes.say(&plan.to_string());
    }
    let offload = (plan.gpu_layers > 0 || plan.output_on_gpu).then(|| Offload {
        device: device.clone(),
        layers: plan.gpu_layers,
        output: plan.output_on_gpu,
    });
    let mut model = Qwen3::load_with(file.clone(), offload, !opts.no_mmap)?;
    model.set_ubatch(plan.ubatch);
    Ok(Weights {
        model,
        plan,
        context,
        device,
    })
}

/// The context `-c` asks for: 0 the trained one, none the default (or the trained one if
/// smaller); never beyond [`MAX_CONTEXT`], and a warning beyond the trained one.
fn context_for(asked: Option<usize>, cfg: &Qwen3Config, notes: &Notes) -> Result<usize> {
    let context = match asked {
        Some(0) if cfg.context_length > MAX_CONTEXT => {
            return Err(Error::setup(format!(
                "-c 0 asks for the trained context, qwen3.context_length = {}, beyond the most \
                 refusion runs ({MAX_CONTEXT}); give -c",
                cfg.context_length
            )))
        }
        Some(0) => cfg.context_length,
        Some(n) if n > MAX_CONTEXT => {
            return Err(Error::setup(format!(
                "-c {n} is beyond the most refusion runs ({MAX_CONTEXT})"
            )))
        }
        Some(n) => n,
        None => DEFAULT_CONTEXT.min(cfg.context_length),
    };
    if context > cfg.context_length {
        notes.say(&format!(
            "warning: the context ({context} tokens) is beyond what the model was trained on \
             ({}); positions past it may give poor answers",
            cfg.context_length
        ));
    }
    Ok(context)
}

#[cfg(test)]
mod tests {
    use super::check_compute_cap;

    #[test]
    fn a_build_runs_on_its_own_gpu_family_only() {
        // sm_86 code runs on 8.6 and 8.9 (same major, newer minor), not on 8.0 or 9.0.
        assert!(check_compute_cap("86", 8, 6).is_ok());
        assert!(check_compute_cap("86", 8, 9).is_ok());
        assert!(check_compute_cap("86", 8, 0).is_err());
        let e = check_compute_cap("86", 9, 0).unwrap_err();
        assert!(
            e.contains("sm_86") && e.contains("sm_90") && e.contains("CUDA_COMPUTE_CAP=90"),
            "{e}"
        );
        // From sm_90 on the arch-specific variant runs on that architecture only.
        assert!(check_compute_cap("90", 9, 0).is_ok());
        assert!(check_compute_cap("90a", 9, 0).is_ok());
        assert!(check_compute_cap("90", 10, 0).is_err());
        assert!(check_compute_cap("120", 12, 0).is_ok());
        assert!(check_compute_cap("120", 12, 1).is_err());
        assert!(check_compute_cap("75", 8, 6).is_err());
        assert!(check_compute_cap("x", 8, 6).is_err());
    }
}

/// With the default thread count (one per CPU), a note when other work already keeps the
/// CPUs busy: the forward's threads then take turns with it. (Our pool yields and parks, so a
/// busy machine costs a share, not a collapse: 94% of quiet speed kept with one of two cores
/// taken, benches/README.md; the note says how to give the other work room.)
fn busy_note() -> Option<String> {
    let cpus = std::thread::available_parallelism().ok()?.get();
    let load: f64 = std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    busy_note_for(load, cpus)
}

fn busy_note_for(load: f64, cpus: usize) -> Option<String> {
    let idle = (cpus as f64 - load).floor();
    (idle < cpus as f64 / 2.0 && cpus > 1).then(|| {
        let fewer = (idle as usize).max(1);
        format!(
            "note: the machine is busy (load {load:.1} on {cpus} CPUs): all {cpus} threads share them with that work; -t {fewer} leaves it room"
        )
    })
}

#[cfg(test)]
mod busy_tests {
    #[test]
    fn a_note_only_when_most_cpus_are_taken() {
        assert!(super::busy_note_for(0.2, 2).is_none());
        let note = super::busy_note_for(1.1, 2).unwrap();
        assert!(
            note.contains("load 1.1 on 2 CPUs") && note.contains("-t 1"),
            "{note}"
        );
        assert!(super::busy_note_for(7.5, 8).unwrap().contains("-t 1"));
        assert!(super::busy_note_for(3.0, 8).is_none());
        assert!(super::busy_note_for(5.0, 1).is_none());
    }
}
