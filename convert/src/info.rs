//! `refusion info FILE.gguf`: the metadata and the tensor table.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::gguf::{FileType, GgufFile, Value};

pub use refusion_gguf::human_bytes;

/// Renders the report `refusion info` prints.
pub fn describe(file: &GgufFile) -> String {
    let h = &file.header;
    let mut s = String::new();
    let n_params: u64 = h.tensors.iter().map(|t| t.n_elements()).sum();
    let data: u64 = h.tensors.iter().map(|t| t.n_bytes).sum();
    let _ = writeln!(s, "file:       {}", file.path.display());
    let _ = writeln!(
        s,
        "format:     GGUF v{}, {} metadata keys, {} tensors, alignment {}",
        h.version,
        h.metadata.len(),
        h.tensors.len(),
        h.alignment
    );
    let _ = writeln!(
        s,
        "size:       {} ({} of tensor data)",
        human_bytes(file.file_len()),
        human_bytes(data)
    );
    let ftype = h.get("general.file_type").and_then(Value::as_u64);
    let ftype_name = ftype
        .and_then(|c| u32::try_from(c).ok())
        .and_then(FileType::from_code)
        .map(|f| f.display_name())
        .unwrap_or_else(|| {
            ftype
                .map(|c| format!("code {c}"))
                .unwrap_or_else(|| "unknown".into())
        });
    let bpw = if n_params > 0 {
        data as f64 * 8.0 / n_params as f64
    } else {
        0.0
    };
    let _ = writeln!(
        s,
        "parameters: {n_params} ({:.3} B), {ftype_name}, {bpw:.2} bits per weight",
        n_params as f64 / 1e9
    );

    let mut by_type: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for t in &h.tensors {
        let e = by_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    let types: Vec<String> = by_type
        .iter()
        .map(|(k, (n, b))| format!("{k}: {n} ({})", human_bytes(*b)))
        .collect();
    let _ = writeln!(s, "types:      {}", types.join(", "));

    let _ = writeln!(s, "\nmetadata:");
    for (k, v) in &h.metadata {
        let _ = writeln!(s, "  {k:<44} = {v}");
    }
    let _ = writeln!(s, "\ntensors:");
    let _ = writeln!(
        s,
        "  {:>4}  {:<28} {:<6} {:<22} {:>12} {:>12}",
        "#", "name", "type", "shape", "bytes", "offset"
    );
    for (i, t) in h.tensors.iter().enumerate() {
        let shape = format!("{:?}", t.ne);
        let _ = writeln!(
            s,
            "  {:>4}  {:<28} {:<6} {:<22} {:>12} {:>12}",
            i,
            t.name,
            t.ty.name(),
            shape,
            t.n_bytes,
            t.offset
        );
    }
    s
}
