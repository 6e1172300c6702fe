//! refusion-engine: the ReFusion runtime without a front end, for the command line, the server
//! and embedders (a Python extension) alike. It links neither clap nor axum nor tokio.
//!
//! Data flows one way, floor by floor:
//! - the file: `refusion-gguf` (the format: reader, writer, types and their codecs, ReFusion's
//!   decoding keys);
//! - loading ([`load`]): the memory plan, the Hub, and the model on its device with its
//!   tokenizer and KV cache;
//! - the weights and the forward ([`model`]), over the KV cache ([`kv`]), which places each
//!   batch and says what every token sees;
//! - a decoding [`decode::Strategy`] (ReFusion's slot decoding, or left to right) asks for
//!   forwards and commits tokens; one alone ([`decode::generate`], [`session`] for a chat), or
//!   many merged into each forward by the scheduler ([`sched`]);
//! - the chat template and tokenizer ([`chat`]) turn messages into tokens and back.
//!
//! Errors are [`error::Error`]; what a caller can get wrong is [`error::RequestError`].

pub mod chat;
pub mod constrain;
pub mod decode;
pub mod error;
pub mod kv;
pub mod load;
pub mod model;
pub mod sched;
pub mod session;
