//! Flags shared by every command that runs a model (llama.cpp's names where they exist).

use std::path::PathBuf;

use clap::Args;

use crate::kv::CacheType;
use crate::runtime::{DeviceChoice, LoadOptions};

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model file.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Context size in tokens (0: the model's trained context).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Threads for the forward (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// KV cache element type: f32 or f16.
    #[arg(long, default_value = "f32", value_parser = parse_cache_type)]
    pub cache_type: CacheType,
    /// Back the KV cache with this file instead of anonymous memory.
    #[arg(long, value_name = "PATH")]
    pub kv_file: Option<PathBuf>,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceChoice,
}

fn parse_cache_type(s: &str) -> Result<CacheType, String> {
    s.parse()
}

fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    s.parse()
}

impl ModelArgs {
    pub fn load_options(&self, verbose: bool) -> LoadOptions {
        LoadOptions {
            path: self.model.clone(),
            context: self.ctx_size,
            cache_type: self.cache_type,
            kv_file: self.kv_file.clone(),
            device: self.device.clone(),
            verbose,
        }
    }
}
