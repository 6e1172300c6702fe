//! The runtime's error type. Every message is one line that names the problem.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// What the run was asked for cannot be had here: a device, a context, a memory plan that
    /// does not fit, a setting of the environment. The user's to change (a flag), checked
    /// before heavy work.
    #[error("{0}")]
    Setup(String),
    /// The system refused what the run needs: memory, a `--kv-file`'s I/O, a device
    /// allocation.
    #[error("{0}")]
    Resource(String),
    /// An error about the file at `path` (the model being loaded). The inner error is part
    /// of this one's message, not its `source()`: a front end that prints the chain
    /// (`{:#}`) would otherwise print it twice.
    #[error("{}: {error}", path.display())]
    InFile {
        path: std::path::PathBuf,
        error: Box<Error>,
    },
    /// A forward that every request in it shared failed (each gets this).
    #[error("{0}")]
    Forward(String),
    /// The model file's contents are not what the model needs (metadata, tensor shapes or
    /// types, tokenizer): the file's fault, not the request's.
    #[error("{0}")]
    Model(String),
    /// A broken invariant of this program (a bug to report), never the caller's doing.
    #[error("internal error: {0}")]
    Internal(String),
    /// A request the caller got wrong (HTTP 400), checked before any work.
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("the context is full: {needed} entries needed, {capacity} available (raise -c)")]
    ContextFull { needed: usize, capacity: usize },
    #[error(transparent)]
    File(#[from] refusion_gguf::Error),
    #[error("cancelled")]
    Cancelled,
    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

/// What a caller can get wrong in a request: front ends answer these as the caller's mistake
/// (HTTP 400) without checking again.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt contains the mask token ({id}) at index {index}; ReFusion does not infill user masks")]
    MaskInPrompt { index: usize, id: u32 },
    #[error("prompt token {token} is outside the vocabulary ({vocab})")]
    OutsideVocabulary { token: u32, vocab: usize },
    #[error("prompt ({prompt} tokens) + gen length ({gen}) + one serial block of scratch ({block}) = {} exceeds the context of {capacity} entries", prompt + gen + block)]
    TooLong {
        prompt: usize,
        gen: usize,
        block: usize,
        capacity: usize,
    },
    #[error("{0}")]
    Params(String),
    /// An answer template that cannot be decoded (no gap, a malformed marker, ...).
    #[error("template: {0}")]
    Template(String),
    /// A grammar, schema or format the answer cannot be constrained to.
    #[error("{0}")]
    Grammar(String),
    /// A request field out of range or unknown (`field` as the API names it).
    #[error("{message}")]
    Field {
        field: &'static str,
        message: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn setup(m: impl Into<String>) -> Error {
        Error::Setup(m.into())
    }

    pub fn resource(m: impl Into<String>) -> Error {
        Error::Resource(m.into())
    }

    pub fn model(m: impl Into<String>) -> Error {
        Error::Model(m.into())
    }

    pub fn internal(m: impl Into<String>) -> Error {
        Error::Internal(m.into())
    }
}
