//! SIGINT and SIGTERM: the first starts shutdown (a stream of names, on the runtime), the
//! second exits at once with 130, from the signal handler itself: tokio's streams report
//! "at least one more" and would merge a second signal sent right after the first, and once
//! the drain has ended nothing would be left to hear it.

use crate::error::Result;

#[cfg(unix)]
static RECEIVED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts SIGINT and SIGTERM as they are delivered; the second ends the process (130) after
/// one line on stderr. Only async-signal-safe calls (an atomic add, `write`, `_exit`).
#[cfg(unix)]
fn install_second_signal_exit() -> Result<()> {
    use crate::error::ServeError;
    fn on_signal(msg: &'static [u8]) {
        if RECEIVED.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= 1 {
            // SAFETY: write(2) and _exit(2) are async-signal-safe; `msg` is a static buffer.
            unsafe {
                libc::write(2, msg.as_ptr().cast(), msg.len());
                libc::_exit(130);
            }
        }
    }
    for (sig, msg) in [
        (
            libc::SIGINT,
            &b"refusion serve: second SIGINT: exiting now\n"[..],
        ),
        (
            libc::SIGTERM,
            &b"refusion serve: second SIGTERM: exiting now\n"[..],
        ),
    ] {
        // SAFETY: the action only calls async-signal-safe functions (above).
        unsafe { signal_hook_registry::register(sig, move || on_signal(msg)) }
            .map_err(|e| ServeError::System(format!("cannot handle signals: {e}")))?;
    }
    Ok(())
}

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
            use crate::error::ServeError;
            use tokio::signal::unix::{signal, SignalKind};
            let install = |kind| {
                signal(kind).map_err(|e| ServeError::System(format!("cannot handle signals: {e}")))
            };
            let signals = Signals {
                int: install(SignalKind::interrupt())?,
                term: install(SignalKind::terminate())?,
            };
            install_second_signal_exit()?;
            Ok(signals)
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
