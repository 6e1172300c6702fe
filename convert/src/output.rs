//! Interrupts of a long write (Ctrl-C, SIGTERM), polled by the converter's loops; the file
//! itself is written by [`AtomicFile`] (a fresh temporary, fsync, rename: see
//! `refusion_gguf::atomic`), which removes its temporary when dropped on the way out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

use crate::error::{Error, Result};
pub use refusion_gguf::atomic::AtomicFile;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static HANDLER: Once = Once::new();

/// Routes Ctrl-C and SIGTERM to a flag that long loops poll through [`check_interrupt`].
pub fn install_interrupt_handler() {
    HANDLER.call_once(|| {
        let _ = ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst));
    });
}

pub fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        Err(Error::Interrupted)
    } else {
        Ok(())
    }
}
