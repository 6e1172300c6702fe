//! The converter's error type: every variant renders as one line that names the file and
//! the problem, which is what the command line prints.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The OS's message is part of this one line, not a source the command line would print a
    /// second time.
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A file whose contents are wrong: corrupt, truncated, or not what the model needs.
    #[error("{}: {msg}", path.display())]
    BadFile { path: PathBuf, msg: String },
    /// A problem with what the user asked for (flags, paths).
    #[error("{0}")]
    Usage(String),
    #[error("interrupted")]
    Interrupted,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Error {
        Error::Io {
            path: path.as_ref().to_path_buf(),
            error: source,
        }
    }

    pub fn bad(path: impl AsRef<Path>, msg: impl Into<String>) -> Error {
        Error::BadFile {
            path: path.as_ref().to_path_buf(),
            msg: msg.into(),
        }
    }

    pub fn usage(msg: impl Into<String>) -> Error {
        Error::Usage(msg.into())
    }
}
