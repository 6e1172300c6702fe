//! SIGINT and SIGTERM as a stream of names: the first starts shutdown, the second exits.

use crate::error::Result;

pub struct Signals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers (inside the runtime): from here on the signals are ours.
    pub fn new() -> Result<Signals> {
        #[cfg(unix)]
        {
            use crate::error::Error;
            use tokio::signal::unix::{signal, SignalKind};
            let install =
                |kind| signal(kind).map_err(|e| Error::msg(format!("cannot handle signals: {e}")));
            Ok(Signals {
                int: install(SignalKind::interrupt())?,
                term: install(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    /// The next signal's name.
    pub async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.int.recv() => "SIGINT",
                _ = self.term.recv() => "SIGTERM",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}
