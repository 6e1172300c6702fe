//! A streaming GGUF v3 writer: the header (metadata and tensor infos with their final offsets)
//! is written first, then each tensor's data arrives in chunks, in order.

use std::io::{self, Write};

use crate::{align_up, GgmlType, Value, DEFAULT_ALIGNMENT, MAGIC};

/// What the header says about one tensor before its data exists.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    /// Dimensions in GGML order (`ne[0]` is the row length).
    pub ne: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorSpec {
    pub fn n_bytes(&self) -> Option<u64> {
        let rows: u64 = self.ne.iter().skip(1).product();
        self.ty.row_bytes(*self.ne.first()?)?.checked_mul(rows)
    }
}

pub struct GgufWriter<W: Write> {
    w: W,
    pos: u64,
    /// (absolute start, size) of each tensor's data.
    extents: Vec<(u64, u64)>,
    /// Index of the tensor being written and the bytes it still expects.
    current: usize,
    left: u64,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl<W: Write> GgufWriter<W> {
    /// Writes the header and returns a writer positioned for the first tensor's data.
    pub fn new(w: W, metadata: &[(String, Value)], tensors: &[TensorSpec]) -> io::Result<Self> {
        let mut header = Vec::new();
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata {
            put_string(&mut header, key);
            header.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut header, value)?;
        }
        let mut rel = 0u64;
        let mut sizes = Vec::with_capacity(tensors.len());
        for t in tensors {
            let size = t.n_bytes().ok_or_else(|| {
                invalid(format!(
                    "tensor '{}': shape {:?} does not fit type {}",
                    t.name, t.ne, t.ty
                ))
            })?;
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ty.id().to_le_bytes());
            header.extend_from_slice(&rel.to_le_bytes());
            sizes.push((rel, size));
            rel = align_up(rel + size, DEFAULT_ALIGNMENT)
                .ok_or_else(|| invalid("file too large".into()))?;
        }
        let data_start = align_up(header.len() as u64, DEFAULT_ALIGNMENT).unwrap_or(u64::MAX);
        header.resize(data_start as usize, 0);
        let mut w = w;
        w.write_all(&header)?;
        let extents = sizes
            .into_iter()
            .map(|(off, size)| (data_start + off, size))
            .collect();
        let mut writer = GgufWriter {
            w,
            pos: data_start,
            extents,
            current: 0,
            left: 0,
        };
        writer.start_tensor(0)?;
        Ok(writer)
    }

    fn start_tensor(&mut self, idx: usize) -> io::Result<()> {
        self.current = idx;
        if let Some(&(start, size)) = self.extents.get(idx) {
            let pad = start - self.pos;
            self.w.write_all(&vec![0u8; pad as usize])?;
            self.pos = start;
            self.left = size;
        }
        Ok(())
    }

    /// Appends data to the current tensor; moving to the next tensor happens when the current
    /// one is complete. A chunk may not span two tensors.
    pub fn write_data(&mut self, bytes: &[u8]) -> io::Result<()> {
        if bytes.len() as u64 > self.left {
            return Err(invalid(format!(
                "tensor {} got {} bytes, only {} left",
                self.current,
                bytes.len(),
                self.left
            )));
        }
        self.w.write_all(bytes)?;
        self.pos += bytes.len() as u64;
        self.left -= bytes.len() as u64;
        if self.left == 0 && self.current < self.extents.len() {
            self.start_tensor(self.current + 1)?;
        }
        Ok(())
    }

    /// Checks that every tensor got all its bytes, flushes, and returns the inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        if self.current < self.extents.len() {
            return Err(invalid(format!(
                "tensor {} was not written in full",
                self.current
            )));
        }
        self.w.flush()?;
        Ok(self.w)
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) -> io::Result<()> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_string(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(elem, items) => {
            out.extend_from_slice(&elem.id().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                if item.value_type() != *elem {
                    return Err(invalid(format!(
                        "array of {elem:?} holds a {:?}",
                        item.value_type()
                    )));
                }
                put_value(out, item)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GgufHeader, ValueType};

    #[test]
    fn header_round_trips_through_the_reader() {
        let metadata = vec![
            (
                "general.architecture".to_string(),
                Value::String("qwen3".into()),
            ),
            ("a.u32".to_string(), Value::U32(7)),
            ("a.f32".to_string(), Value::F32(0.5)),
            ("a.bool".to_string(), Value::Bool(true)),
            (
                "a.strs".to_string(),
                Value::strings(["x".to_string(), "yz".to_string()]),
            ),
            ("a.empty".to_string(), Value::Array(ValueType::I32, vec![])),
        ];
        let tensors = vec![
            TensorSpec {
                name: "a".into(),
                ne: vec![3],
                ty: GgmlType::F32,
            },
            TensorSpec {
                name: "b".into(),
                ne: vec![32, 2],
                ty: GgmlType::Q8_0,
            },
        ];
        let mut w = GgufWriter::new(Vec::new(), &metadata, &tensors).unwrap();
        w.write_data(&[1u8; 12]).unwrap();
        w.write_data(&[2u8; 34]).unwrap();
        w.write_data(&[3u8; 34]).unwrap();
        let bytes = w.finish().unwrap();
        let h = GgufHeader::parse(&bytes).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.metadata, metadata);
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.tensors[1].offset, 32);
        assert_eq!(h.tensors[1].n_bytes, 68);
        let start = (h.data_offset + 32) as usize;
        assert_eq!(&bytes[start..start + 34], &[2u8; 34]);
    }

    #[test]
    fn writer_refuses_short_or_long_tensors() {
        let tensors = vec![TensorSpec {
            name: "a".into(),
            ne: vec![4],
            ty: GgmlType::F32,
        }];
        let mut w = GgufWriter::new(Vec::new(), &[], &tensors).unwrap();
        assert!(w.write_data(&[0u8; 20]).is_err());
        w.write_data(&[0u8; 8]).unwrap();
        assert!(w.finish().is_err());
    }
}
