//! `refusion convert`: a Hugging Face Qwen3/ReFusion folder to one llama.cpp `qwen3` GGUF.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::decoding::DecodingDefaults;
use crate::error::{Error, Result};
use crate::gguf::{FileType, TensorSpec, Value};
use crate::hf::config::Qwen3Config;
use crate::hf::tokenizer::GgufVocab;
use crate::hf::weights::{SourceTensor, Weights};
use crate::mix::{tensor_type, MixOptions, ModelShape};
use crate::names;
use crate::pipeline::{write_gguf, Job, RowSource, Summary, Verbosity};

#[derive(Debug, Clone)]
pub struct ConvertOptions {
    pub outtype: FileType,
    pub mix: MixOptions,
    /// `general.name`; defaults to the checkpoint folder's name.
    pub name: Option<String>,
    pub decoding: DecodingDefaults,
    pub verbosity: Verbosity,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            outtype: FileType::Q4_K_M,
            mix: MixOptions::default(),
            name: None,
            decoding: DecodingDefaults::default(),
            verbosity: Verbosity::Normal,
        }
    }
}

struct SafetensorsRows<'a> {
    weights: &'a Weights,
    tensor: &'a SourceTensor,
    row_len: usize,
}

impl RowSource for SafetensorsRows<'_> {
    fn read_rows(&self, first: usize, count: usize, out: &mut [f32]) {
        self.weights
            .read_rows(self.tensor, self.row_len, first, count, out);
    }
    fn input_bytes(&self) -> u64 {
        self.tensor.len as u64
    }
    fn release_rows(&self, first: usize, count: usize) {
        self.weights
            .release_rows(self.tensor, self.row_len, first, count);
    }
    fn origin(&self) -> String {
        self.weights.path_of(self.tensor).display().to_string()
    }
    fn input_type(&self) -> String {
        format!("{:?}", self.tensor.dtype).to_lowercase()
    }
    fn source_name(&self) -> String {
        self.tensor.name.clone()
    }
}

fn u32_of(what: &str, v: u64) -> Result<Value> {
    u32::try_from(v)
        .map(Value::U32)
        .map_err(|_| Error::usage(format!("{what} {v} does not fit in 32 bits")))
}

/// Metadata in the order it is written.
pub(crate) fn metadata(
    cfg: &Qwen3Config,
    vocab: &GgufVocab,
    name: &str,
    opts: &ConvertOptions,
) -> Result<Vec<(String, Value)>> {
    let mut md = model_metadata(cfg, name, opts)?;
    md.extend(tokenizer_metadata(vocab)?);
    md.extend(opts.decoding.to_metadata());
    Ok(md)
}

/// `general.*` and the `qwen3.*` hyper-parameters, as llama.cpp's converter writes them.
fn model_metadata(
    cfg: &Qwen3Config,
    name: &str,
    opts: &ConvertOptions,
) -> Result<Vec<(String, Value)>> {
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("qwen3".into())),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name.to_string())),
        ("general.file_type".into(), Value::U32(opts.outtype.code())),
        ("general.quantization_version".into(), Value::U32(2)),
    ];
    for (key, what, v) in [
        ("block_count", "num_hidden_layers", cfg.num_hidden_layers),
        (
            "context_length",
            "max_position_embeddings",
            cfg.max_position_embeddings,
        ),
        ("embedding_length", "hidden_size", cfg.hidden_size),
        (
            "feed_forward_length",
            "intermediate_size",
            cfg.intermediate_size,
        ),
        (
            "attention.head_count",
            "num_attention_heads",
            cfg.num_attention_heads,
        ),
        (
            "attention.head_count_kv",
            "num_key_value_heads",
            cfg.num_key_value_heads,
        ),
        ("attention.key_length", "head_dim", cfg.head_dim),
        ("attention.value_length", "head_dim", cfg.head_dim),
    ] {
        md.push((format!("qwen3.{key}"), u32_of(what, v)?));
    }
    md.push((
        "qwen3.rope.freq_base".into(),
        Value::F32(cfg.rope_theta as f32),
    ));
    md.push((
        "qwen3.attention.layer_norm_rms_epsilon".into(),
        Value::F32(cfg.rms_norm_eps as f32),
    ));
    Ok(md)
}

/// `tokenizer.ggml.*` (llama.cpp's gpt2/qwen2 tokenizer), our normalizer key and the chat
/// template.
fn tokenizer_metadata(vocab: &GgufVocab) -> Result<Vec<(String, Value)>> {
    let mut md: Vec<(String, Value)> = vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::strings(vocab.tokens.iter().cloned()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::i32s(vocab.token_types.iter().copied()),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::strings(vocab.merges.iter().cloned()),
        ),
    ];
    for (key, id) in [
        ("tokenizer.ggml.eos_token_id", vocab.eos_id),
        ("tokenizer.ggml.padding_token_id", vocab.pad_id),
        ("tokenizer.ggml.bos_token_id", vocab.bos_id),
        ("tokenizer.ggml.mask_token_id", vocab.mask_id),
    ] {
        if let Some(id) = id {
            md.push((key.into(), u32_of(key, id)?));
        }
    }
    md.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)));
    // Not a llama.cpp key: lets our runtime rebuild the tokenizer exactly (llama.cpp's
    // qwen2 pre-tokenizer does not normalize; the Hugging Face tokenizers do NFC).
    md.push((
        "refusion.tokenizer.normalizer".into(),
        Value::String(vocab.normalizer.into()),
    ));
    if let Some(t) = &vocab.chat_template {
        md.push(("tokenizer.chat_template".into(), Value::String(t.clone())));
    }
    Ok(md)
}

/// What a conversion would write: tensors with their types, and the metadata.
pub struct Plan<'a> {
    pub jobs: Vec<Job<'a>>,
    pub metadata: Vec<(String, Value)>,
    pub warnings: Vec<String>,
}

/// Everything read from a checkpoint folder, kept alive while the plan borrows it.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: Qwen3Config,
    pub vocab: GgufVocab,
    pub weights: Weights,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        if dir.is_file() {
            return Err(Error::usage(format!(
                "'{}' is a file, not a checkpoint folder: convert takes a Hugging Face folder \
                 (to change a GGUF file's type, use refusion quantize)",
                dir.display()
            )));
        }
        if !dir.is_dir() {
            return Err(Error::usage(format!(
                "checkpoint folder '{}' does not exist",
                dir.display()
            )));
        }
        let config = Qwen3Config::load(dir)?;
        let vocab = GgufVocab::load(dir, &config)?;
        let weights = Weights::open(dir)?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            vocab,
            weights,
        })
    }

    pub fn plan(&self, opts: &ConvertOptions) -> Result<Plan<'_>> {
        opts.decoding.validate().map_err(Error::usage)?;
        let cfg = &self.config;
        let expected = names::checkpoint_tensors(cfg);
        let shape = ModelShape {
            n_layers: cfg.num_hidden_layers as usize,
            n_gqa: cfg.num_attention_heads / cfg.num_key_value_heads,
            has_output: !cfg.tie_word_embeddings,
        };
        let mut jobs = Vec::with_capacity(expected.len());
        for (hf, gguf, want) in &expected {
            let t = self.tensor(hf, gguf, want)?;
            let ne: Vec<u64> = want.iter().rev().copied().collect();
            let (ty, note) = tensor_type(opts.outtype, gguf, &ne, &shape, &opts.mix);
            let row_len = ne[0] as usize;
            jobs.push(Job {
                spec: TensorSpec {
                    name: gguf.clone(),
                    ne,
                    ty,
                },
                source: Box::new(SafetensorsRows {
                    weights: &self.weights,
                    tensor: t,
                    row_len,
                }),
                note,
            });
        }
        let mut warnings = self.vocab.warnings.clone();
        self.check_unexpected(&expected, &mut warnings)?;
        let name = opts.name.clone().unwrap_or_else(|| {
            self.dir
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "model".to_string())
        });
        let mut metadata = metadata(cfg, &self.vocab, &name, opts)?;
        metadata.extend(crate::grow::eval_metadata(&self.dir)?);
        Ok(Plan {
            jobs,
            metadata,
            warnings,
        })
    }

    /// The checkpoint's tensor `hf` (the GGUF's `gguf`), of the shape config.json implies.
    fn tensor(
        &self,
        hf: &str,
        gguf: &str,
        want: &[u64],
    ) -> Result<&crate::hf::weights::SourceTensor> {
        let t = self.weights.tensors.get(hf).ok_or_else(|| {
            Error::bad(
                &self.dir,
                format!("missing tensor '{hf}' (needed for {gguf})"),
            )
        })?;
        if t.shape != want {
            return Err(Error::bad(
                self.weights.path_of(t),
                format!(
                    "tensor '{hf}' has shape {:?} but {} implies {:?}",
                    t.shape,
                    self.dir.join("config.json").display(),
                    want
                ),
            ));
        }
        Ok(t)
    }

    /// Refuses tensors a qwen3 model has no place for (a tied model's `lm_head` is only a
    /// warning).
    fn check_unexpected(
        &self,
        expected: &[(String, String, Vec<u64>)],
        warnings: &mut Vec<String>,
    ) -> Result<()> {
        let known: BTreeSet<&str> = expected.iter().map(|(hf, _, _)| hf.as_str()).collect();
        let mut unexpected = Vec::new();
        for name in self.weights.tensors.keys() {
            if known.contains(name.as_str()) || names::is_ignorable(name) {
                continue;
            }
            if name == names::LM_HEAD.0 && self.config.tie_word_embeddings {
                warnings
                    .push("lm_head.weight present but tie_word_embeddings is true: ignored".into());
                continue;
            }
            unexpected.push(name.clone());
        }
        if unexpected.is_empty() {
            return Ok(());
        }
        let shown: Vec<_> = unexpected.iter().take(5).cloned().collect();
        Err(Error::bad(
            &self.dir,
            format!(
                "{} unexpected tensor(s) for a qwen3 model: {}{}",
                unexpected.len(),
                shown.join(", "),
                if unexpected.len() > 5 { ", ..." } else { "" }
            ),
        ))
    }
}

/// Converts the checkpoint in `dir` to `outfile`.
pub fn convert(dir: &Path, outfile: &Path, opts: &ConvertOptions) -> Result<Summary> {
    let ckpt = Checkpoint::open(dir)?;
    let plan = ckpt.plan(opts)?;
    if opts.verbosity == Verbosity::Normal {
        for w in &plan.warnings {
            eprintln!("warning: {w}");
        }
        eprintln!(
            "converting {} ({} layers, hidden {}, vocab {}, tokenizer from {}) to {} as {}",
            dir.display(),
            ckpt.config.num_hidden_layers,
            ckpt.config.hidden_size,
            ckpt.config.vocab_size,
            ckpt.vocab.source,
            outfile.display(),
            opts.outtype
        );
    }
    write_gguf(outfile, &plan.metadata, plan.jobs, opts.verbosity)
}
