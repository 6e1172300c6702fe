//! ReFusion's decoding parameters as stored under `refusion.*` in the GGUF.

use crate::{GgufHeader, Value};

pub const KEY_GEN_LENGTH: &str = "refusion.gen_length";
pub const KEY_SLOT_SIZE: &str = "refusion.slot_size";
pub const KEY_SERIAL_BLOCKS: &str = "refusion.serial_num_blocks";
pub const KEY_SLOT_THRESHOLD: &str = "refusion.slot_threshold";
pub const KEY_TOKEN_THRESHOLD: &str = "refusion.token_threshold";

/// The largest gen length, slot size or serial-block count accepted, from a file, a flag or a
/// request: 2^20 tokens, far beyond any context a model runs with, and small enough that every
/// size computed from them (padded lengths, blocks, positions) fits a u32 with room to spare.
pub const MAX_TOKENS: u32 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodingDefaults {
    pub gen_length: u32,
    pub slot_size: u32,
    pub serial_blocks: u32,
    pub slot_threshold: f32,
    pub token_threshold: f32,
}

impl Default for DecodingDefaults {
    /// The model card's `main()`.
    fn default() -> Self {
        DecodingDefaults {
            gen_length: 512,
            slot_size: 4,
            serial_blocks: 32,
            slot_threshold: 0.6,
            token_threshold: 0.3,
        }
    }
}

impl DecodingDefaults {
    /// Checks the combination the reference decoder can run: the gen length, rounded up to
    /// whole slots, must split into `serial_blocks` blocks of whole slots.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("slot threshold", self.slot_threshold),
            ("token threshold", self.token_threshold),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{name} must be in [0, 1], got {v}"));
            }
        }
        let (l, k, b) = (self.gen_length, self.slot_size, self.serial_blocks);
        if l == 0 || k == 0 || b == 0 {
            return Err(format!(
                "gen length ({l}), slot size ({k}) and serial blocks ({b}) must all be positive"
            ));
        }
        for (name, v) in [("gen length", l), ("slot size", k), ("serial blocks", b)] {
            if v > MAX_TOKENS {
                return Err(format!("{name} must be at most {MAX_TOKENS}, got {v}"));
            }
        }
        // The reference's rule: the padded length, divided into `b` blocks (a remainder is
        // silently never generated), must give blocks of whole slots.
        // At most 2^21 (both at most 2^20): no overflow.
        let padded = l.div_ceil(k) * k;
        let block = padded / b;
        if block == 0 || block % k != 0 {
            let works: Vec<String> = (1..=padded / k)
                .filter(|&nb| padded % nb == 0 && (padded / nb) % k == 0)
                .map(|nb| nb.to_string())
                .collect();
            return Err(format!(
                "gen length {l} (padded to {padded}) does not split into {b} serial blocks of whole {k}-token slots; \
                 serial blocks that work: {}",
                works.join(", ")
            ));
        }
        Ok(())
    }

    /// The `refusion.*` values of a file over the model card's. A key that is present must
    /// hold a number in range (integers 1..=[`MAX_TOKENS`], thresholds in [0, 1]); anything else
    /// is refused naming the key. Whether the values work together is [`Self::validate`]'s
    /// question, asked once flags and requests have had their say.
    pub fn from_metadata(h: &GgufHeader) -> Result<DecodingDefaults, String> {
        let d = DecodingDefaults::default();
        let count = |key: &str, default: u32| -> Result<u32, String> {
            let Some(v) = h.get(key) else {
                return Ok(default);
            };
            match v.as_u64() {
                Some(n) if (1..=MAX_TOKENS as u64).contains(&n) => Ok(n as u32),
                _ => Err(format!(
                    "metadata key {key} = {v} is out of range (expected an integer in 1..={MAX_TOKENS})"
                )),
            }
        };
        let threshold = |key: &str, default: f32| -> Result<f32, String> {
            let Some(v) = h.get(key) else {
                return Ok(default);
            };
            match v.as_f64() {
                Some(x) if (0.0..=1.0).contains(&x) => Ok(x as f32),
                _ => Err(format!(
                    "metadata key {key} = {v} is out of range (expected a number in [0, 1])"
                )),
            }
        };
        Ok(DecodingDefaults {
            gen_length: count(KEY_GEN_LENGTH, d.gen_length)?,
            slot_size: count(KEY_SLOT_SIZE, d.slot_size)?,
            serial_blocks: count(KEY_SERIAL_BLOCKS, d.serial_blocks)?,
            slot_threshold: threshold(KEY_SLOT_THRESHOLD, d.slot_threshold)?,
            token_threshold: threshold(KEY_TOKEN_THRESHOLD, d.token_threshold)?,
        })
    }

    pub fn to_metadata(&self) -> Vec<(String, Value)> {
        vec![
            (KEY_GEN_LENGTH.into(), Value::U32(self.gen_length)),
            (KEY_SLOT_SIZE.into(), Value::U32(self.slot_size)),
            (KEY_SERIAL_BLOCKS.into(), Value::U32(self.serial_blocks)),
            (KEY_SLOT_THRESHOLD.into(), Value::F32(self.slot_threshold)),
            (KEY_TOKEN_THRESHOLD.into(), Value::F32(self.token_threshold)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_card_and_paper_settings_are_valid() {
        assert!(DecodingDefaults::default().validate().is_ok());
        for (k, b) in [(16, 4), (8, 64), (32, 4), (32, 8), (8, 32)] {
            let d = DecodingDefaults {
                slot_size: k,
                serial_blocks: b,
                ..Default::default()
            };
            assert!(d.validate().is_ok(), "k={k} b={b}");
        }
    }

    #[test]
    fn bad_combinations_name_what_works() {
        let d = DecodingDefaults {
            gen_length: 512,
            slot_size: 4,
            serial_blocks: 3,
            ..Default::default()
        };
        let e = d.validate().unwrap_err();
        assert!(e.contains("serial blocks that work: 1, 2, 4, 8"), "{e}");
        let d = DecodingDefaults {
            slot_threshold: 1.5,
            ..Default::default()
        };
        assert!(d.validate().unwrap_err().contains("slot threshold"));
    }
}
