//! The runtime's error type. Every message is one line that names the problem.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Msg(String),
    #[error("the context is full: {needed} entries needed, {capacity} available (raise -c)")]
    ContextFull { needed: usize, capacity: usize },
    #[error(transparent)]
    File(#[from] refusion_convert::Error),
    #[error("cancelled")]
    Cancelled,
    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn msg(m: impl Into<String>) -> Error {
        Error::Msg(m.into())
    }
}
