//! Decoding parameters and their checks.

use refusion_convert::DecodingDefaults;

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct DecodeParams {
    pub gen_length: u32,
    pub slot_size: u32,
    pub serial_blocks: u32,
    pub slot_threshold: f32,
    pub token_threshold: f32,
    /// 0: greedy planning; above 0, the reference's noise on the planning drafts.
    pub temperature: f64,
    pub seed: u64,
    pub eos_id: u32,
    pub mask_id: u32,
    /// Reproduce the reference's EOS-index bug (for comparison with its raw output only).
    pub reference_eos_bug: bool,
}

impl DecodeParams {
    pub fn new(d: DecodingDefaults, eos_id: u32, mask_id: u32) -> DecodeParams {
        DecodeParams {
            gen_length: d.gen_length,
            slot_size: d.slot_size,
            serial_blocks: d.serial_blocks,
            slot_threshold: d.slot_threshold,
            token_threshold: d.token_threshold,
            temperature: 0.0,
            seed: 0,
            eos_id,
            mask_id,
            reference_eos_bug: false,
        }
    }

    fn defaults(&self) -> DecodingDefaults {
        DecodingDefaults {
            gen_length: self.gen_length,
            slot_size: self.slot_size,
            serial_blocks: self.serial_blocks,
            slot_threshold: self.slot_threshold,
            token_threshold: self.token_threshold,
        }
    }

    /// The gen length rounded up to whole slots.
    pub fn padded_gen_length(&self) -> u32 {
        self.gen_length.div_ceil(self.slot_size.max(1)) * self.slot_size
    }

    /// Positions after the last serial block that the reference never generates (when the
    /// padded length does not split evenly into serial blocks).
    pub fn dropped_tail(&self) -> u32 {
        let padded = self.padded_gen_length();
        padded - padded / self.serial_blocks.max(1) * self.serial_blocks
    }

    pub fn validate(&self) -> Result<()> {
        self.defaults().validate().map_err(Error::msg)?;
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::msg(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            )));
        }
        if self.eos_id == self.mask_id {
            return Err(Error::msg("the EOS and mask tokens are the same id"));
        }
        Ok(())
    }
}
