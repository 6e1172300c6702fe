//! refusion: run the ReFusion diffusion language model locally from GGUF weights.
//!
//! The converter lives in the `refusion-convert` crate (`convert/`); this crate holds the
//! front ends.

pub mod cli;

pub use refusion_convert as convert;
