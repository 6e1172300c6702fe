//! Flags shared by every command that runs a model (llama.cpp's names where they exist).

use std::path::PathBuf;

use clap::Args;

use refusion_engine::kv::{CacheType, KvTypes};
use refusion_engine::load::plan::GpuLayers;
use refusion_engine::load::runtime::{DeviceChoice, LoadOptions, MAX_CONTEXT, MAX_THREADS};

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model file.
    #[arg(short = 'm', long = "model", required_unless_present_any = ["hf_repo", "model_arg"])]
    pub model: Option<PathBuf>,
    /// The model as an argument (ollama's way): a GGUF file, or ORG/NAME[:QUANT] on the Hub.
    #[arg(value_name = "MODEL", conflicts_with_all = ["model", "hf_repo"])]
    pub model_arg: Option<String>,
    /// A GGUF repository on the Hugging Face Hub (llama.cpp's -hf): REPO[:QUANT] picks the file
    /// by its quant name (default Q4_K_M, else the only GGUF) and downloads only that file into
    /// the Hugging Face cache.
    #[arg(
        long = "hf-repo",
        value_name = "REPO[:QUANT]",
        conflicts_with = "model"
    )]
    pub hf_repo: Option<String>,
    /// Context size in tokens (0: the model's trained context) [default: 4096, or the
    /// trained context if it is smaller].
    #[arg(short = 'c', long = "ctx-size", value_parser = parse_context, allow_negative_numbers = true)]
    pub ctx_size: Option<usize>,
    /// Threads for the forward (default: all cores).
    #[arg(short = 't', long, value_parser = parse_threads, allow_negative_numbers = true)]
    pub threads: Option<usize>,
    /// KV cache element type of keys and values alike: f32 (exact, the default), f16, bf16,
    /// q8_0, q5_1, q5_0, q4_1 or q4_0 (llama.cpp's names; the block types on the CPU only).
    #[arg(long, value_parser = parse_cache_type)]
    pub cache_type: Option<CacheType>,
    /// KV cache type of the keys (llama.cpp's -ctk; over --cache-type).
    #[arg(long = "cache-type-k", value_name = "TYPE", value_parser = parse_cache_type)]
    pub cache_type_k: Option<CacheType>,
    /// KV cache type of the values (llama.cpp's -ctv; over --cache-type).
    #[arg(long = "cache-type-v", value_name = "TYPE", value_parser = parse_cache_type)]
    pub cache_type_v: Option<CacheType>,
    /// Back the KV cache with this file instead of anonymous memory.
    #[arg(long, value_name = "PATH")]
    pub kv_file: Option<PathBuf>,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceChoice,
    /// Layers to run on the GPU (`-ngl`): a count (above the layer count, the output layer
    /// too), auto (what fits in free VRAM; the default) or all.
    #[arg(long = "n-gpu-layers", visible_alias = "gpu-layers", value_name = "N|auto|all", value_parser = parse_gpu_layers)]
    pub gpu_layers: Option<GpuLayers>,
    /// Most tokens per forward chunk (`-ub`); the memory plan may lower it to fit the GPU.
    #[arg(long = "ubatch-size", default_value_t = refusion_engine::model::qwen3::DEFAULT_UBATCH, value_parser = parse_ubatch, allow_negative_numbers = true)]
    pub ubatch: usize,
    /// Copy the weights into memory instead of reading them from the memory-mapped file
    /// (llama.cpp's --no-mmap; uses more memory, avoids page faults on slow filesystems).
    /// Q4_K/Q5_K/Q6_K/Q8_0 weights on CPUs with AVX2 or better are repacked into memory either
    /// way.
    #[arg(long)]
    pub no_mmap: bool,
    /// llama.cpp's --mlock: refused by name (the weights stay mapped; --no-mmap reads them
    /// into memory).
    #[arg(long, hide = true)]
    pub mlock: bool,
    /// Read every tensor before running and refuse the file if any float value or quantized
    /// block scale is NaN or infinite (llama.cpp's --check-tensors; reads the whole file).
    #[arg(long)]
    pub check_tensors: bool,
    /// No notes on stderr (the memory plan, the load line); errors still print (llama.cpp's
    /// --log-disable).
    #[arg(long)]
    pub log_disable: bool,
    /// llama.cpp's -fa [on|off|auto]: refusion has one attention path, which is what off and
    /// auto give; on is refused by name.
    #[arg(long = "flash-attn", hide = true, num_args = 0..=1, default_missing_value = "on")]
    flash_attn: Option<String>,
}

fn parse_ubatch(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 && n <= MAX_CONTEXT => Ok(n),
        _ => Err(format!(
            "invalid micro-batch '{s}' (expected a positive number of tokens, at most {MAX_CONTEXT})"
        )),
    }
}

fn parse_context(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n <= MAX_CONTEXT => Ok(n),
        _ => Err(format!(
            "invalid context '{s}' (expected 0 for the model's trained context, or a number of tokens up to {MAX_CONTEXT})"
        )),
    }
}

fn parse_threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n <= MAX_THREADS => Ok(n),
        _ => Err(format!(
            "invalid thread count '{s}' (expected 0 for one per core, or up to {MAX_THREADS})"
        )),
    }
}

fn parse_gpu_layers(s: &str) -> Result<GpuLayers, String> {
    s.parse()
}

fn parse_cache_type(s: &str) -> Result<CacheType, String> {
    s.parse()
}

fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    s.parse()
}

impl ModelArgs {
    /// What to load, after checking llama.cpp's flags that map onto ours or cannot.
    /// The model file: `-m`, or the GGUF `-hf` names, from the Hugging Face cache (downloaded
    /// there first when missing). Called after every other flag has been checked.
    pub fn model_path(&self) -> anyhow::Result<PathBuf> {
        if let Some(m) = &self.model {
            return Ok(m.clone());
        }
        if let Some(spec) = &self.model_arg {
            return super::models::resolve(spec, true, !self.log_disable);
        }
        let spec = self.hf_repo.as_deref().unwrap_or_default();
        let (id, quant) = match spec.split_once(':') {
            Some((id, q)) if !q.is_empty() => (id, Some(q)),
            Some((id, _)) => (id, None),
            None => (spec, None),
        };
        if !refusion_engine::load::hub::is_repo_id(id) {
            anyhow::bail!("-hf {spec}: expected a Hub repo id, org/name[:QUANT]");
        }
        let repo = refusion_engine::load::hub::RepoRef::new(id, None);
        let hub = refusion_engine::load::hub::Hub::from_env(!self.log_disable)?
            .with_notes(crate::cli::notes());
        Ok(hub.gguf(&repo, quant)?)
    }

    /// ollama's `OLLAMA_KV_CACHE_TYPE` (for K and V alike), when `--cache-type` is not given on
    /// the command line (`-ctk`/`-ctv` still set their own kind): what `serve` honours when it
    /// runs under ollama's environment.
    pub fn take_ollama_cache_type(&mut self) -> anyhow::Result<()> {
        // It stands for --cache-type: -ctk/-ctv still set their kind over it.
        let given = self.cache_type.is_some();
        let Ok(v) = std::env::var("OLLAMA_KV_CACHE_TYPE") else {
            return Ok(());
        };
        if given || v.is_empty() {
            return Ok(());
        }
        let t =
            parse_cache_type(&v).map_err(|e| anyhow::anyhow!("OLLAMA_KV_CACHE_TYPE={v}: {e}"))?;
        if !self.log_disable {
            eprintln!("note: KV cache type {} from OLLAMA_KV_CACHE_TYPE", t.name());
        }
        self.cache_type = Some(t);
        Ok(())
    }

    /// The KV cache's types: `-ctk`/`-ctv` each over `--cache-type`, over the default (f32).
    pub fn cache_types(&self) -> KvTypes {
        let both = self.cache_type.unwrap_or(CacheType::F32);
        KvTypes {
            k: self.cache_type_k.unwrap_or(both),
            v: self.cache_type_v.unwrap_or(both),
        }
    }

    pub fn load_options(&self, verbose: bool) -> anyhow::Result<LoadOptions> {
        if self.mlock {
            anyhow::bail!(
                "--mlock is not supported: the weights stay memory-mapped (--no-mmap reads them into memory)"
            );
        }
        if let Some(v) = self.flash_attn.as_deref() {
            if !matches!(v, "off" | "0" | "auto") {
                anyhow::bail!(
                    "-fa {v}: refusion has one attention path (no flash-attention switch); drop the flag"
                );
            }
        }
        Ok(LoadOptions {
            path: self.model_path()?,
            context: self.ctx_size,
            cache_types: self.cache_types(),
            kv_file: self.kv_file.clone(),
            device: self.device.clone(),
            gpu_layers: self.gpu_layers,
            ubatch: self.ubatch,
            no_mmap: self.no_mmap,
            check_tensors: self.check_tensors,
            default_threads: self.threads.is_none_or(|n| n == 0),
            kv_extra: 0,
            verbose: verbose && !self.log_disable,
            notes: crate::cli::notes(),
        })
    }
}
