//! The element types of the KV cache, one file each. A type says how a row of `head_dim`
//! values is stored (its bytes, in blocks of `block_len` values) and read back for attention;
//! the cache's storage ([`super::host`], [`super::device`], [`super::saved`]) and attention
//! only ever go through [`KvKind`]. A new type is one file here (or, for another of GGUF's
//! block types, one line in `blocks.rs`), its line in [`CacheType`], and (for speed) its
//! attention kernels.

mod blocks;
mod f16;
mod f32;

use candle_core::DType;

/// How one KV cache element type stores and reads its rows.
pub trait KvKind: Sync {
    /// Its name as `--cache-type` (and llama.cpp's `-ctk`/`-ctv`) spell it.
    fn name(&self) -> &'static str;
    /// Its code in a `--kv-file`'s and a saved prefix's header (stable across versions).
    fn code(&self) -> u32;
    /// Values per block: a row is whole blocks (1 for plain floats).
    fn block_len(&self) -> usize;
    /// Bytes of a row of `n` values, `n` a multiple of [`KvKind::block_len`].
    fn row_bytes(&self, n: usize) -> usize;
    /// The element type of device-resident layers, `None` where only the CPU holds it.
    fn dtype(&self) -> Option<DType>;
    /// Stores `src` into `dst` (`row_bytes(src.len())` bytes).
    fn write_row(&self, src: &[f32], dst: &mut [u8]);
    /// The row in `src` as f32 values in `buf` (`buf.len()` values).
    fn read_row(&self, src: &[u8], buf: &mut [f32]);
    /// Rows `slots` of `src` (rows of `row_bytes`) as f32 values, one after the other in `buf`
    /// (`buf.len() / slots.len()` values each): what attention decodes a tile at a time, in one
    /// call (a type may check the CPU once and keep its loop inlined); each row the values
    /// [`KvKind::read_row`] gives.
    fn read_rows(&self, src: &[u8], row_bytes: usize, slots: &[usize], buf: &mut [f32]) {
        let n = buf.len() / slots.len().max(1);
        if n == 0 {
            return;
        }
        for (&slot, out) in slots.iter().zip(buf.chunks_exact_mut(n)) {
            self.read_row(&src[slot * row_bytes..(slot + 1) * row_bytes], out);
        }
    }
    /// The row in place when it is stored as f32 (and suitably aligned), for the kernels that
    /// read f32 entries directly; `None` otherwise.
    fn as_f32<'a>(&self, _src: &'a [u8]) -> Option<&'a [f32]> {
        None
    }
}

/// Element type of the cache (`--cache-type`, `-ctk`/`-ctv`): a name for one [`KvKind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q5_1,
    Q5_0,
    Q4_1,
    Q4_0,
}

impl CacheType {
    /// Every type, in the order the help lists them.
    pub const ALL: [CacheType; 8] = [
        CacheType::F32,
        CacheType::F16,
        CacheType::Bf16,
        CacheType::Q8_0,
        CacheType::Q5_1,
        CacheType::Q5_0,
        CacheType::Q4_1,
        CacheType::Q4_0,
    ];

    /// The type's storage and reading (the one place a type is matched).
    pub fn kind(self) -> &'static dyn KvKind {
        match self {
            CacheType::F32 => &f32::F32,
            CacheType::F16 => &f16::F16,
            CacheType::Bf16 => &blocks::BF16,
            CacheType::Q8_0 => &blocks::Q8_0,
            CacheType::Q5_1 => &blocks::Q5_1,
            CacheType::Q5_0 => &blocks::Q5_0,
            CacheType::Q4_1 => &blocks::Q4_1,
            CacheType::Q4_0 => &blocks::Q4_0,
        }
    }

    /// Whether rows of `head_dim` values are whole blocks of this type; the mistake in words if
    /// not.
    pub fn check_head_dim(self, head_dim: usize) -> std::result::Result<(), String> {
        let b = self.kind().block_len();
        if head_dim.is_multiple_of(b) {
            Ok(())
        } else {
            Err(format!(
                "a {} KV cache needs a head size that is a multiple of {b}; this model's is {head_dim} (use f16)",
                self.name()
            ))
        }
    }

    pub fn name(self) -> &'static str {
        self.kind().name()
    }

    /// The type whose header code is `code`.
    pub fn from_code(code: u32) -> Option<CacheType> {
        Self::ALL.into_iter().find(|t| t.kind().code() == code)
    }
}

/// The element types of keys and of values (`-ctk`, `-ctv`; `--cache-type` sets both): they
/// may differ, as llama.cpp's. The cache, its files and the memory plan take a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvTypes {
    pub k: CacheType,
    pub v: CacheType,
}

impl KvTypes {
    /// Keys and values of one type.
    pub const fn same(t: CacheType) -> KvTypes {
        KvTypes { k: t, v: t }
    }

    /// The type of keys or of values.
    pub fn of(self, kind: super::Kv) -> CacheType {
        match kind {
            super::Kv::K => self.k,
            super::Kv::V => self.v,
        }
    }

    /// Bytes of one key row and one value row of `head_dim` values.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        self.k.kind().row_bytes(head_dim) + self.v.kind().row_bytes(head_dim)
    }

    /// Whether both types take rows of `head_dim` values; the mistake in words if not.
    pub fn check_head_dim(self, head_dim: usize) -> std::result::Result<(), String> {
        self.k.check_head_dim(head_dim)?;
        self.v.check_head_dim(head_dim)
    }

    /// The pair's code in a file header: the key type's code in the low 16 bits, the value
    /// type's in the high ones (every code is a GGML type id, below 2^16).
    pub fn code(self) -> u32 {
        self.k.kind().code() | (self.v.kind().code() << 16)
    }

    /// The pair whose header code is `code` ([`KvTypes::code`]).
    pub fn from_code(code: u32) -> Option<KvTypes> {
        Some(KvTypes {
            k: CacheType::from_code(code & 0xffff)?,
            v: CacheType::from_code(code >> 16)?,
        })
    }
}

impl From<CacheType> for KvTypes {
    fn from(t: CacheType) -> KvTypes {
        KvTypes::same(t)
    }
}

/// One name when keys and values share their type (`q8_0`), else both (`K q8_0, V f16`).
impl std::fmt::Display for KvTypes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.k == self.v {
            f.write_str(self.k.name())
        } else {
            write!(f, "K {}, V {}", self.k.name(), self.v.name())
        }
    }
}

impl std::str::FromStr for CacheType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.to_ascii_lowercase();
        CacheType::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = CacheType::ALL.iter().map(|t| t.name()).collect();
                let (last, rest) = names.split_last().expect("types");
                format!(
                    "unknown cache type '{s}' (expected {} or {last})",
                    rest.join(", ")
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_writes_and_reads_its_rows() {
        let row: Vec<f32> = (0..128).map(|i| (i as f32 - 60.5) * 0.37).collect();
        for t in CacheType::ALL {
            let k = t.kind();
            assert_eq!(t.name().parse::<CacheType>(), Ok(t));
            assert_eq!(CacheType::from_code(k.code()), Some(t));
            let mut bytes = vec![0u8; k.row_bytes(row.len())];
            k.write_row(&row, &mut bytes);
            let mut back = vec![0f32; row.len()];
            k.read_row(&bytes, &mut back);
            // Within each type's rounding: f32 exact, f16/bf16 relative, the block types
            // a step of their block's scale.
            let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            let tol = |a: f32| match t {
                CacheType::F32 => 0.0,
                CacheType::F16 => a.abs() * 1e-3,
                CacheType::Bf16 => a.abs() * 8e-3,
                CacheType::Q8_0 => amax / 127.0,
                CacheType::Q5_0 | CacheType::Q5_1 => amax / 15.0,
                CacheType::Q4_0 | CacheType::Q4_1 => amax / 7.0,
            };
            for (a, b) in row.iter().zip(&back) {
                assert!(
                    (a - b).abs() <= tol(*a),
                    "{}: {a} read back as {b}",
                    t.name()
                );
            }
            if let Some(direct) = k.as_f32(&bytes) {
                assert_eq!(direct, &back[..]);
            }
            // Many rows in one call: each the one row's floats, in the order asked.
            let rows: Vec<Vec<f32>> = (0..5)
                .map(|r| row.iter().map(|x| x * (r as f32 - 1.7)).collect())
                .collect();
            let rb = k.row_bytes(row.len());
            let mut all = vec![0u8; 5 * rb];
            for (r, dst) in rows.iter().zip(all.chunks_exact_mut(rb)) {
                k.write_row(r, dst);
            }
            let slots = [3, 0, 4, 4, 1];
            let mut many = vec![0f32; slots.len() * row.len()];
            k.read_rows(&all, rb, &slots, &mut many);
            for (&s, got) in slots.iter().zip(many.chunks_exact(row.len())) {
                let mut one = vec![0f32; row.len()];
                k.read_row(&all[s * rb..(s + 1) * rb], &mut one);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(&one), "{}: row {s}", t.name());
            }
        }
        assert_eq!(
            "q9".parse::<CacheType>(),
            Err(
                "unknown cache type 'q9' (expected f32, f16, bf16, q8_0, q5_1, q5_0, q4_1 or q4_0)"
                    .to_string()
            )
        );
        assert!(CacheType::Q8_0.check_head_dim(128).is_ok());
        assert!(CacheType::Q8_0.check_head_dim(24).is_err());
        assert!(CacheType::F16.check_head_dim(24).is_ok());
    }

    #[test]
    fn pairs_of_types_have_one_code_and_a_name() {
        for k in CacheType::ALL {
            for v in CacheType::ALL {
                let t = KvTypes { k, v };
                assert_eq!(KvTypes::from_code(t.code()), Some(t));
                assert_eq!(
                    t.row_bytes(64),
                    k.kind().row_bytes(64) + v.kind().row_bytes(64)
                );
            }
        }
        assert_eq!(KvTypes::same(CacheType::Q8_0).to_string(), "q8_0");
        let mixed = KvTypes {
            k: CacheType::Q8_0,
            v: CacheType::F16,
        };
        assert_eq!(mixed.to_string(), "K q8_0, V f16");
        assert!(KvTypes {
            k: CacheType::F16,
            v: CacheType::Q4_0
        }
        .check_head_dim(24)
        .is_err());
        assert_eq!(KvTypes::from_code(0x7777), None);
    }
}
