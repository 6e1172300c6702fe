//! Writing an output file atomically: `NAME.partial` beside the target, fsync, rename.
//! Until the rename, an existing file of the same name is untouched; on any error, on Ctrl-C
//! or on SIGTERM the partial file is removed.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

use crate::error::{Error, Result};

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

pub struct AtomicFile {
    target: PathBuf,
    partial: PathBuf,
    file: Option<File>,
}

impl AtomicFile {
    pub fn create(target: &Path) -> Result<AtomicFile> {
        let name = target.file_name().ok_or_else(|| {
            Error::usage(format!(
                "output path '{}' has no file name",
                target.display()
            ))
        })?;
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !parent.is_dir() {
            return Err(Error::usage(format!(
                "output folder '{}' does not exist",
                parent.display()
            )));
        }
        if target.is_dir() {
            return Err(Error::usage(format!(
                "output path '{}' is a directory",
                target.display()
            )));
        }
        let mut partial_name = name.to_os_string();
        partial_name.push(".partial");
        let partial = parent.join(partial_name);
        let file = File::create(&partial).map_err(|e| Error::io(&partial, e))?;
        Ok(AtomicFile {
            target: target.to_path_buf(),
            partial,
            file: Some(file),
        })
    }

    pub fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("file is present until commit")
    }

    pub fn partial_path(&self) -> &Path {
        &self.partial
    }

    /// Flushes to disk and moves the file into place.
    pub fn commit(mut self) -> Result<()> {
        let file = self.file.take().expect("file is present until commit");
        file.sync_all().map_err(|e| Error::io(&self.partial, e))?;
        drop(file);
        check_interrupt()?;
        fs::rename(&self.partial, &self.target).map_err(|e| Error::io(&self.target, e))?;
        if let Some(parent) = self.target.parent().filter(|p| !p.as_os_str().is_empty()) {
            if let Ok(dir) = File::open(parent) {
                let _ = dir.sync_all();
            }
        }
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() || self.partial.exists() {
            let _ = fs::remove_file(&self.partial);
        }
    }
}
