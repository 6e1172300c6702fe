//! The server's own errors, apart from a request's ([`crate::api::ApiError`], an HTTP answer):
//! what stops `refusion serve` from starting or ends it.

/// Why the server did not start, or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A launch setting that cannot work (`--host`, `--api-key`, `--cors-origin`): the user's
    /// to change, found before anything loads.
    #[error("{0}")]
    Config(String),
    /// The system refused what the server needs: its address, threads, signal handlers.
    #[error("{0}")]
    System(String),
    /// The model worker failed (setting up its cache, or a panic): its reason.
    #[error("{0}")]
    Worker(String),
}

pub type Result<T, E = ServeError> = std::result::Result<T, E>;
