//! refusion: run the ReFusion diffusion language model locally from GGUF weights.
//!
//! Data flows one way, floor by floor:
//! - the file: `refusion-gguf` (the format: reader, writer, types, ReFusion's decoding keys)
//!   and `refusion-convert` (Hugging Face checkpoints to GGUF, quantization);
//! - the weights and the forward ([`model`]), over the KV cache ([`kv`]), which places each
//!   batch and says what every token sees;
//! - a decoding [`decode::Strategy`] (ReFusion's slot decoding, or left to right) asks for
//!   forwards and commits tokens; one alone ([`decode::generate`], [`session`] for a chat), or
//!   many merged into each forward by the scheduler ([`sched`]);
//! - the front ends: the command line ([`cli`]) and the HTTP server ([`server`]), with the chat
//!   template and tokenizer ([`chat`]), the Hub ([`hub`]) and the memory plan ([`plan`],
//!   [`runtime`]).

#![deny(unsafe_op_in_unsafe_fn)]

pub mod chat;
pub mod cli;
pub mod decode;
pub mod error;
#[cfg(feature = "fuzzing")]
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
pub use refusion_gguf as gguf;
