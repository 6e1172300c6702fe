//! Text in and out: the tokenizer and the chat template.

pub mod stream;
pub mod template;
pub mod tokenizer;

pub use stream::TextStream;
pub use template::{ChatTemplate, Message};
pub use tokenizer::Tokenizer;
