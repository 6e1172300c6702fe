//! Text in and out: the tokenizer (and, later, the chat template).

pub mod tokenizer;

pub use tokenizer::Tokenizer;
