//! refusion: the command line over the engine (`refusion-engine`), the HTTP server
//! (`refusion-server`) and the converter (`refusion-convert`), all reading and writing the
//! format of `refusion-gguf`.
//!
//! Each crate's dependencies say what it is: the engine links no front end, the server adds
//! axum and tokio, and only this crate parses arguments (clap) and prints to the terminal.

pub mod cli;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
