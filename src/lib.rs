//! refusion: run the ReFusion diffusion language model locally from GGUF weights.
//!
//! Data flows one way: file (`refusion-convert`'s GGUF reader) → weights and forward
//! ([`model`]) over the KV cache ([`kv`]) ← decoder ← front ends ([`cli`]).

pub mod chat;
pub mod cli;
pub mod decode;
pub mod error;
pub mod fuzzing;
pub mod hub;
pub mod kv;
pub mod model;
pub mod plan;
pub mod runtime;
pub mod sched;
pub mod server;
pub mod session;

pub use refusion_convert as convert;
