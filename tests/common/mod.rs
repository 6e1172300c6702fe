//! Helpers shared by the integration tests: building tiny Qwen3 checkpoints on disk and
//! running the `refusion` binary.

#![allow(dead_code)]

pub mod hub;
pub mod server;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use refusion_convert::hf::config::Qwen3Config;
use refusion_convert::names;
use refusion_gguf::{GgufFile, GgufWriter, TensorSpec, Value};
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value as Json};

/// The binary under test; `REFUSION_BIN` overrides it (test binaries built ahead and run on
/// another machine, as scripts/gpu-check.sh does).
pub fn bin() -> PathBuf {
    std::env::var_os("REFUSION_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_refusion")))
}

/// The repository's test fixtures; `REFUSION_REPO` names the checkout when the test binary was
/// built elsewhere.
pub fn fixtures() -> PathBuf {
    std::env::var_os("REFUSION_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join("tests/fixtures")
}

pub fn fixture_model(name: &str) -> PathBuf {
    fixtures().join("models").join(name)
}

/// The temporaries refusion's writers left for `out` (`.NAME.XXXXXXXX.partial` beside it),
/// and files with the fixed `NAME.partial` of older versions.
pub fn temporaries(out: &Path) -> Vec<PathBuf> {
    let name = out.file_name().unwrap().to_string_lossy().into_owned();
    let dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Ok(entries) = fs::read_dir(&dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            *n == format!("{name}.partial")
                || (n.starts_with(&format!(".{name}.")) && n.ends_with(".partial"))
        })
        .map(|n| dir.join(n))
        .collect()
}

/// Runs `refusion ARGS...` and returns its output.
pub fn run(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .output()
        .expect("failed to start refusion")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts a clean failure: non-zero exit, the expected words in stderr, and no panic.
pub fn assert_fails_with(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(
        !o.status.success(),
        "expected failure, got success; stderr:\n{err}"
    );
    assert!(!err.contains("panicked"), "panicked:\n{err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}:\n{err}");
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokLayout {
    /// `tokenizer.json`
    Fast,
    /// `vocab.json` + `merges.txt` + `added_tokens.json` (as the ReFusion repo ships)
    Slow,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dt {
    F32,
    BF16,
    F16,
}

/// The shape of a tiny checkpoint to build.
#[derive(Clone, Debug)]
pub struct Tiny {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    /// Must be at least the tokenizer's 512 entries; extra ids are padding.
    pub vocab: usize,
    pub tied: bool,
    pub dtype: Dt,
    pub shards: usize,
    pub tokenizer: TokLayout,
    pub seed: u64,
}

impl Default for Tiny {
    fn default() -> Self {
        Tiny {
            hidden: 256,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ffn: 512,
            vocab: 512,
            tied: false,
            dtype: Dt::BF16,
            shards: 1,
            tokenizer: TokLayout::Fast,
            seed: 1,
        }
    }
}

/// A deterministic pseudo-random stream in [-1, 1).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// The tensors (PyTorch names and shapes) of a Qwen3 checkpoint of this shape, from the
/// converter's own list.
pub fn tensor_shapes(t: &Tiny) -> Vec<(String, Vec<usize>)> {
    let cfg = Qwen3Config {
        hidden_size: t.hidden as u64,
        intermediate_size: t.ffn as u64,
        num_hidden_layers: t.layers as u64,
        num_attention_heads: t.heads as u64,
        num_key_value_heads: t.kv_heads as u64,
        head_dim: t.head_dim as u64,
        vocab_size: t.vocab as u64,
        tie_word_embeddings: t.tied,
        rope_theta: 1e6,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 4096,
        bos_token_id: None,
        eos_token_id: None,
        mask_token_id: None,
    };
    names::checkpoint_tensors(&cfg)
        .into_iter()
        .map(|(hf, _, shape)| (hf, shape.iter().map(|&d| d as usize).collect()))
        .collect()
}

pub fn config_json(t: &Tiny) -> Json {
    json!({
        "architectures": ["Qwen3ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_qwen3.Qwen3Config",
            "AutoModelForCausalLM": "modeling_qwen3_refusion.Qwen3ForCausalLM"
        },
        "attention_bias": false,
        "bos_token_id": 506,
        "eos_token_id": 508,
        "mask_token_id": 511,
        "head_dim": t.head_dim,
        "hidden_act": "silu",
        "hidden_size": t.hidden,
        "intermediate_size": t.ffn,
        "max_position_embeddings": 4096,
        "model_type": "qwen3",
        "num_attention_heads": t.heads,
        "num_hidden_layers": t.layers,
        "num_key_value_heads": t.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": null,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": t.tied,
        "torch_dtype": "bfloat16",
        "use_sliding_window": false,
        "vocab_size": t.vocab
    })
}

fn encode(dt: Dt, values: &[f32]) -> (Dtype, Vec<u8>, Vec<f32>) {
    match dt {
        Dt::F32 => (
            Dtype::F32,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            values.to_vec(),
        ),
        Dt::BF16 => {
            let q: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
            (
                Dtype::BF16,
                q.iter().flat_map(|v| v.to_le_bytes()).collect(),
                q.iter().map(|v| v.to_f32()).collect(),
            )
        }
        Dt::F16 => {
            let q: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
            (
                Dtype::F16,
                q.iter().flat_map(|v| v.to_le_bytes()).collect(),
                q.iter().map(|v| v.to_f32()).collect(),
            )
        }
    }
}

/// Writes `tensors` as safetensors files in `dir`: one `model.safetensors`, or `shards`
/// files with an index.
pub fn write_weights(dir: &Path, tensors: &[(String, Vec<usize>, Dtype, Vec<u8>)], shards: usize) {
    let write = |path: &Path, items: &[&(String, Vec<usize>, Dtype, Vec<u8>)]| {
        let views: Vec<(String, TensorView)> = items
            .iter()
            .map(|(n, s, d, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    };
    if shards <= 1 {
        write(
            &dir.join("model.safetensors"),
            &tensors.iter().collect::<Vec<_>>(),
        );
        return;
    }
    let per = tensors.len().div_ceil(shards);
    let mut map = serde_json::Map::new();
    for (i, chunk) in tensors.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
        write(&dir.join(&file), &chunk.iter().collect::<Vec<_>>());
        for (name, ..) in chunk {
            map.insert(name.clone(), Json::String(file.clone()));
        }
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
    fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
}

/// Writes the tokenizer of the pub-a fixture in the requested layout.
pub fn write_tokenizer(dir: &Path, layout: TokLayout) {
    let src = fixture_model("pub-a");
    fs::copy(
        src.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    match layout {
        TokLayout::Fast => {
            fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        }
        TokLayout::Slow => write_slow_tokenizer(&src.join("tokenizer.json"), dir),
    }
}

/// Splits a tokenizer.json into the slow-tokenizer files transformers' save_pretrained writes.
pub fn write_slow_tokenizer(tokenizer_json: &Path, dir: &Path) {
    let tj: Json = serde_json::from_str(&fs::read_to_string(tokenizer_json).unwrap()).unwrap();
    fs::write(
        dir.join("vocab.json"),
        serde_json::to_string(&tj["model"]["vocab"]).unwrap(),
    )
    .unwrap();
    let mut merges = String::from("#version: 0.2\n");
    for m in tj["model"]["merges"].as_array().unwrap() {
        match m {
            Json::String(s) => merges.push_str(s),
            Json::Array(p) => {
                merges.push_str(p[0].as_str().unwrap());
                merges.push(' ');
                merges.push_str(p[1].as_str().unwrap());
            }
            _ => panic!("bad merge"),
        }
        merges.push('\n');
    }
    fs::write(dir.join("merges.txt"), merges).unwrap();
    let mut added = serde_json::Map::new();
    for a in tj["added_tokens"].as_array().unwrap() {
        added.insert(a["content"].as_str().unwrap().to_string(), a["id"].clone());
    }
    fs::write(
        dir.join("added_tokens.json"),
        serde_json::to_string(&added).unwrap(),
    )
    .unwrap();
}

/// Builds a checkpoint folder and returns the exact f32 values of every tensor (after the
/// checkpoint dtype's rounding), keyed by PyTorch name.
pub fn build_checkpoint(dir: &Path, t: &Tiny) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    fs::create_dir_all(dir).unwrap();
    fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config_json(t)).unwrap(),
    )
    .unwrap();
    fs::write(
        dir.join("generation_config.json"),
        r#"{"bos_token_id": 506, "eos_token_id": [508, 506], "do_sample": false}"#,
    )
    .unwrap();
    write_tokenizer(dir, t.tokenizer);
    let mut rng = Rng::new(t.seed);
    let mut values = BTreeMap::new();
    let mut raw = Vec::new();
    for (name, shape) in tensor_shapes(t) {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = if shape.len() == 1 {
            (0..n).map(|_| 1.0 + 0.1 * rng.next()).collect()
        } else {
            (0..n)
                .map(|i| 0.05 * rng.next() * if i % 61 == 0 { 8.0 } else { 1.0 })
                .collect()
        };
        let (dtype, bytes, exact) = encode(t.dtype, &v);
        raw.push((name.clone(), shape.clone(), dtype, bytes));
        values.insert(name, (shape, exact));
    }
    write_weights(dir, &raw, t.shards);
    values
}

/// Reads a safetensors file's tensor as f32 (for comparing fixtures).
pub fn read_safetensors_f32(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        assert_eq!(view.dtype(), Dtype::F32);
        let v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        out.insert(name, (view.shape().to_vec(), v));
    }
    out
}

/// The GGUF name of a checkpoint tensor.
pub fn gguf_name(hf: &str) -> String {
    for (h, g) in [names::EMBED, names::FINAL_NORM, names::LM_HEAD] {
        if hf == h {
            return g.to_string();
        }
    }
    let rest = hf.strip_prefix("model.layers.").expect("layer tensor");
    let (layer, suffix) = rest.split_once('.').unwrap();
    let g = names::LAYER_TENSORS
        .iter()
        .find(|(h, _)| *h == suffix)
        .expect("known suffix")
        .1;
    format!("blk.{layer}.{g}")
}

/// Converts the checkpoint folder `dir` to `out` as `outtype`, quietly; it must succeed.
pub fn convert_quiet(dir: &Path, out: &Path, outtype: &str) {
    let o = run(&[
        "convert",
        dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--outtype",
        outtype,
        "-q",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A tiny model with the real ReFusion vocabulary, converted to Q8_0 in `dir`.
/// The trained tiny ReFusion's Hugging Face folder (`models/refusion-tiny`).
/// The Python that runs the reference scripts and the official clients (`REFUSION_PYTHON`,
/// as `.ci/run` sets it to its virtualenv; else `python3`).
pub fn python() -> String {
    std::env::var("REFUSION_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// A golden case's model folder: the trained tiny model, or a random fixture by name.
pub fn model_dir(name: &str) -> PathBuf {
    if name == "refusion-tiny" {
        trained_tiny()
    } else {
        fixture_model(name)
    }
}

/// The random fixture `pub-a` converted at f32 into `dir` (`a.gguf`).
pub fn pub_a_f32(dir: &Path) -> PathBuf {
    let out = dir.join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "f32");
    out
}

pub fn trained_tiny() -> PathBuf {
    fixtures().join("../../models/refusion-tiny")
}

/// The trained tiny model's first `n` held-out JSON questions (`heldout_chats.json`, kind
/// "json"): each with its `messages` and worked `response` (`{"answer": ...}`).
pub fn heldout_json_questions(n: usize) -> Vec<Json> {
    let chats: Json =
        serde_json::from_slice(&fs::read(trained_tiny().join("heldout_chats.json")).unwrap())
            .unwrap();
    let out: Vec<Json> = chats
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h["kind"] == "json")
        .take(n)
        .cloned()
        .collect();
    assert_eq!(out.len(), n, "held-out JSON questions");
    out
}

/// The JSON Schema of a held-out JSON answer like `want`: `{"answer": integer}`, or an array
/// of integers for a list question.
pub fn answer_schema(want: &Json) -> Json {
    let value = match want["answer"].is_array() {
        true => json!({"type": "array", "items": {"type": "integer"}}),
        false => json!({"type": "integer"}),
    };
    json!({"type": "object", "properties": {"answer": value},
           "required": ["answer"], "additionalProperties": false})
}

/// The trained tiny ReFusion converted to `outtype` in `dir` (`tiny-OUTTYPE.gguf`).
pub fn trained_tiny_gguf(dir: &Path, outtype: &str) -> PathBuf {
    let out = dir.join(format!("tiny-{outtype}.gguf"));
    convert_quiet(&trained_tiny(), &out, outtype);
    out
}

/// A random real-sized file (`convert --synthetic SIZE --outtype OUTTYPE`) in `dir`.
pub fn synthetic_gguf(dir: &Path, size: &str, outtype: &str) -> PathBuf {
    let out = dir.join(format!("synthetic-{size}-{outtype}.gguf"));
    let o = run(&[
        "convert",
        "--synthetic",
        size,
        "--outtype",
        outtype,
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    out
}

pub fn tiny_refusion_gguf(dir: &Path) -> PathBuf {
    let ckpt = dir.join("ckpt");
    build_refusion_vocab_checkpoint(&ckpt, TokLayout::Fast);
    let out = dir.join("tiny.gguf");
    convert_quiet(&ckpt, &out, "q8_0");
    out
}

/// A tiny model with the real ReFusion vocabulary (151671 ids, `<|mask|>` 151670) and the real
/// tokenizer in the given layout.
pub fn build_refusion_vocab_checkpoint(dir: &Path, layout: TokLayout) {
    let spec = Tiny {
        hidden: 32,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        ffn: 64,
        layers: 1,
        vocab: 151671,
        tied: true,
        ..Default::default()
    };
    build_checkpoint(dir, &spec);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let _ = fs::remove_file(dir.join(f));
    }
    let real = fixtures().join("tokenizers/refusion");
    match layout {
        TokLayout::Fast => {
            fs::copy(real.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        }
        TokLayout::Slow => write_slow_tokenizer(&real.join("tokenizer.json"), dir),
    }
    fs::copy(
        real.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    let mut cfg = config_json(&spec);
    cfg["bos_token_id"] = 151643.into();
    cfg["eos_token_id"] = 151645.into();
    cfg["mask_token_id"] = 151670.into();
    fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

/// Rewrites a GGUF with metadata edited (tensors unchanged).
pub fn with_metadata(src: &Path, dst: &Path, edit: impl Fn(&mut Vec<(String, Value)>)) {
    let f = GgufFile::open(src).unwrap();
    let mut meta = f.header.metadata.clone();
    edit(&mut meta);
    let specs: Vec<TensorSpec> = f
        .header
        .tensors
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            ne: t.ne.clone(),
            ty: t.ty,
        })
        .collect();
    let mut w = GgufWriter::new(std::fs::File::create(dst).unwrap(), &meta, &specs).unwrap();
    for t in &f.header.tensors {
        w.write_data(f.tensor_data(t)).unwrap();
    }
    w.finish().unwrap();
}

/// A golden case's token ids (`prompt`, `tokens`, ...).
pub fn golden_ids(v: &Json) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A golden case's decoding parameters (slot decoding, seed 0).
pub fn golden_params(case: &Json) -> refusion_engine::decode::DecodeParams {
    let n = |k: &str| case[k].as_u64().unwrap() as u32;
    let x = |k: &str| case[k].as_f64().unwrap();
    refusion_engine::decode::DecodeParams {
        gen_length: n("gen_length"),
        slot_size: n("slot_size"),
        serial_blocks: n("serial_num_blocks"),
        slot_threshold: x("slot_threshold") as f32,
        token_threshold: x("token_threshold") as f32,
        temperature: x("temperature"),
        ..refusion_engine::decode::DecodeParams::new(Default::default(), n("eos_id"), n("mask_id"))
    }
}

/// Results of scheduler requests by index (`sched_request`'s sink fills it).
pub type SchedResults =
    std::cell::RefCell<std::collections::HashMap<usize, refusion_engine::decode::DecodeResult>>;

/// A scheduler request whose result lands in `out` under `i`.
pub fn sched_request<'a>(
    i: usize,
    prompt: Vec<u32>,
    params: refusion_engine::decode::DecodeParams,
    out: &'a SchedResults,
) -> refusion_engine::sched::Request<'a> {
    refusion_engine::sched::Request {
        prompt,
        params,
        cancel: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
        sink: Box::new(move |u| {
            if let refusion_engine::sched::Update::Finished(r) = u {
                out.borrow_mut().insert(i, r.unwrap());
            }
        }),
    }
}

/// `convert --synthetic 0.6b --outtype OUTTYPE` into `dir`.
pub fn synthetic_0_6b_as(dir: &std::path::Path, outtype: &str) -> std::path::PathBuf {
    let out = dir.join(format!("syn-{outtype}.gguf"));
    let o = run(&[
        "convert",
        "--synthetic",
        "0.6b",
        "--outtype",
        outtype,
        "-o",
        out.to_str().unwrap(),
        "-q",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    out
}
