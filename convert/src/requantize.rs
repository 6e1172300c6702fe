//! `refusion quantize IN.gguf OUT.gguf TYPE`: re-encode an f32/f16/bf16 qwen3 GGUF (ours or
//! llama.cpp's) to another type, keeping its metadata.

use std::path::Path;

use crate::error::{Error, Result};
use crate::gguf::{FileType, GgmlType, GgufFile, TensorInfo, TensorSpec, Value};
use crate::mix::{tensor_type, MixOptions, ModelShape};
use crate::pipeline::{write_gguf, Job, RowSource, Summary, Verbosity};
use crate::quant;

struct GgufRows<'a> {
    file: &'a GgufFile,
    tensor: &'a TensorInfo,
}

impl RowSource for GgufRows<'_> {
    fn read_rows(&self, first: usize, count: usize, out: &mut [f32]) {
        let row_len = self.tensor.ne[0];
        let row_bytes = self.tensor.ty.row_bytes(row_len).unwrap_or(0) as usize;
        let data = self.file.tensor_data(self.tensor);
        let bytes = &data[first * row_bytes..(first + count) * row_bytes];
        quant::dequantize(self.tensor.ty, bytes, &mut out[..count * row_len as usize]);
    }
    fn input_bytes(&self) -> u64 {
        self.tensor.n_bytes
    }
    fn release_rows(&self, first: usize, count: usize) {
        let row_bytes = self.tensor.ty.row_bytes(self.tensor.ne[0]).unwrap_or(0);
        self.file.release(
            self.tensor,
            first as u64 * row_bytes,
            count as u64 * row_bytes,
        );
    }
    fn origin(&self) -> String {
        self.file.path.display().to_string()
    }
    fn input_type(&self) -> String {
        self.tensor.ty.name().to_string()
    }
    fn source_name(&self) -> String {
        self.tensor.name.clone()
    }
}

fn meta_u64(file: &GgufFile, key: &str) -> Result<u64> {
    file.header.get(key).and_then(Value::as_u64).ok_or_else(|| {
        Error::bad(
            &file.path,
            format!("missing or non-integer metadata key {key}"),
        )
    })
}

pub fn requantize(
    input: &Path,
    output: &Path,
    ftype: FileType,
    mix: &MixOptions,
    verbosity: Verbosity,
) -> Result<Summary> {
    let file = GgufFile::open(input)?;
    let arch = file
        .header
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("");
    if arch != "qwen3" {
        return Err(Error::bad(
            input,
            format!("architecture '{arch}' is not supported (expected qwen3)"),
        ));
    }
    let n_layers = meta_u64(&file, "qwen3.block_count")?;
    let heads = meta_u64(&file, "qwen3.attention.head_count")?;
    let kv_heads = meta_u64(&file, "qwen3.attention.head_count_kv")?.max(1);
    let shape = ModelShape {
        n_layers: n_layers as usize,
        n_gqa: heads / kv_heads,
        has_output: file.header.tensor("output.weight").is_some(),
    };

    let mut jobs = Vec::with_capacity(file.header.tensors.len());
    for t in &file.header.tensors {
        if !matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Err(Error::bad(
                input,
                format!(
                    "tensor '{}' is already quantized ({}); quantize from an f32, f16 or bf16 file",
                    t.name, t.ty
                ),
            ));
        }
        let (ty, note) = tensor_type(ftype, &t.name, &t.ne, &shape, mix);
        jobs.push(Job {
            spec: TensorSpec {
                name: t.name.clone(),
                ne: t.ne.clone(),
                ty,
            },
            source: Box::new(GgufRows {
                file: &file,
                tensor: t,
            }),
            note,
        });
    }

    let mut metadata: Vec<(String, Value)> = file
        .header
        .metadata
        .iter()
        .filter(|(k, _)| k != "general.alignment")
        .cloned()
        .collect();
    for (key, value) in [
        ("general.file_type", Value::U32(ftype.code())),
        ("general.quantization_version", Value::U32(2)),
    ] {
        match metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => metadata.push((key.to_string(), value)),
        }
    }
    if verbosity == Verbosity::Normal {
        eprintln!(
            "quantizing {} to {} as {}",
            input.display(),
            output.display(),
            ftype
        );
    }
    write_gguf(output, &metadata, jobs, verbosity)
}
