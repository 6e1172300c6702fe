//! Any-order generation as a strategy (`--strategy infill`, and whenever an answer template
//! has gaps): the template's known spans committed at their positions, its gaps decoded by
//! slot decoding's plan, verify and infill. A gap sized `{{gap:=N}}` is filled to its end by
//! the slot decoder over the template's layout (`slots.rs`, `slots/layout.rs`); a gap that is
//! a maximum first finds its length (`fit.rs`). Without a template: one gap of the gen length.

use refusion_gguf::DecodingDefaults;

use super::strategy::{Method, Strategy};
use super::DecodeParams;
use crate::error::RequestError;

pub struct AnyOrder;

impl Method for AnyOrder {
    fn name(&self) -> &'static str {
        "infill"
    }
    fn fills_gaps(&self) -> bool {
        true
    }
    /// The largest serial block: every gap's share of slots in it.
    fn scratch(&self, params: &DecodeParams) -> usize {
        super::slots::infill_scratch(params)
    }
    /// Gaps are cut into blocks of the gen length's block length (at least a slot): any
    /// number of serial blocks works.
    fn checked(
        &self,
        mut d: DecodingDefaults,
        params: &DecodeParams,
    ) -> Result<DecodingDefaults, RequestError> {
        if !(1..=refusion_gguf::decoding::MAX_TOKENS).contains(&params.serial_blocks) {
            return Err(RequestError::Params(format!(
                "serial blocks must be in 1..={}, got {}",
                refusion_gguf::decoding::MAX_TOKENS,
                params.serial_blocks
            )));
        }
        d.serial_blocks = 1;
        Ok(d)
    }
    fn start(&self, prompt: &[u32], cached: usize, params: &DecodeParams) -> Box<dyn Strategy> {
        if params.answer_template().fits() {
            Box::new(super::fit::Fit::new(prompt, cached, params))
        } else {
            Box::new(super::slots::SlotDecoder::infill(prompt, cached, params))
        }
    }
}
