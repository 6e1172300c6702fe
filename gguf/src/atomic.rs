//! The one way refusion writes a file a user names (a converted or quantized GGUF, a prompt
//! cache, a batch's results): into a fresh temporary beside the target, then fsync, then
//! rename over the target. The target either keeps its old bytes or gets all of the new ones.
//!
//! What this guards against:
//! - **Links.** The temporary is created exclusively (`O_CREAT|O_EXCL`, which never follows
//!   a symbolic link, dangling or not) under a random name, by `tempfile`; nothing is ever
//!   opened through a name someone else could have placed first, so a planted symbolic or hard
//!   link is never written through. The rename replaces the target's directory entry, never
//!   what a link there points to; a target that is itself a symbolic link, a directory, a FIFO
//!   or a device is refused in one line before anything is written.
//! - **Races.** Two writers to one target each have their own temporary; the last rename wins,
//!   whole. Neither ever sees the other's bytes.
//! - **Leftovers.** A writer holds an exclusive `flock` on its temporary while it writes. A run
//!   killed by SIGKILL (or a power cut) leaves its hidden temporary,
//!   `.NAME.XXXXXXXX.partial`, which the next write to the same target removes once nothing
//!   holds its lock (see [`sweep_leftovers`]). A leftover is never reused: every writer starts a
//!   new one. On an error, Ctrl-C or SIGTERM the temporary is removed by its owner.
//!
//! `tempfile` does the exclusive creation and the rename; what is written by hand here is the
//! target's check, the lock, and the sweep, which no crate does for this naming.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tempfile::NamedTempFile;

use crate::error::{Error, Result};
use crate::files::kind_name;

/// The suffix of every temporary (`.NAME.XXXXXXXX.partial`).
pub const TEMP_SUFFIX: &str = ".partial";
/// Random characters in a temporary's name.
const RANDOM_CHARS: usize = 8;
/// A leftover younger than this is left alone even when unlocked: a writer locks its
/// temporary microseconds after creating it, so only that window needs the margin.
const LEFTOVER_MIN_AGE: Duration = Duration::from_secs(10);

/// A file being written to replace `target`; [`AtomicFile::commit`] moves it into place, and
/// dropping it uncommitted removes it.
pub struct AtomicFile {
    target: PathBuf,
    temp: NamedTempFile,
}

impl AtomicFile {
    /// Checks `target` and starts its temporary (see the module's notes).
    pub fn create(target: &Path) -> Result<AtomicFile> {
        let (dir, name) = split(target)?;
        check_target(target)?;
        sweep_leftovers(&dir, name);
        let prefix = temp_prefix(name);
        let temp = builder(&prefix)
            .tempfile_in(&dir)
            .map_err(|e| Error::io(&dir, e))?;
        lock(temp.as_file()).map_err(|e| Error::io(temp.path(), e))?;
        Ok(AtomicFile {
            target: target.to_path_buf(),
            temp,
        })
    }

    pub fn file(&mut self) -> &mut File {
        self.temp.as_file_mut()
    }

    /// Where the bytes go until the commit (for error messages).
    pub fn temp_path(&self) -> &Path {
        self.temp.path()
    }

    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Flushes to disk and moves the file into place (replacing what is there), then makes the
    /// rename durable. The target is checked again first: a link or FIFO swapped in while we
    /// wrote is refused, not replaced.
    pub fn commit(self) -> Result<()> {
        let AtomicFile { target, temp } = self;
        temp.as_file()
            .sync_all()
            .map_err(|e| Error::io(temp.path(), e))?;
        check_target(&target)?;
        // The lock goes with the descriptor, after the rename (`persist` hands the file back).
        let file = temp
            .persist(&target)
            .map_err(|e| Error::io(&target, e.error))?;
        drop(file);
        if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
            if let Ok(dir) = File::open(parent) {
                let _ = dir.sync_all();
            }
        }
        Ok(())
    }
}

/// The target's folder (`.` for a bare name) and file name.
fn split(target: &Path) -> Result<(PathBuf, &OsStr)> {
    let name = target.file_name().ok_or_else(|| {
        Error::usage(format!(
            "output path '{}' has no file name",
            target.display()
        ))
    })?;
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(Error::usage(format!(
            "output folder '{}' does not exist",
            dir.display()
        )));
    }
    Ok((dir, name))
}

/// A target may be absent or a regular file (replaced whole); anything else is refused: a
/// symbolic link (replacing it would surprise whoever made it, following it is the link
/// attack), a directory, a FIFO, a socket or a device.
pub fn check_target(target: &Path) -> Result<()> {
    match std::fs::symlink_metadata(target) {
        Ok(meta) if meta.is_file() => Ok(()),
        Ok(meta) => Err(Error::usage(format!(
            "output path '{}' is {}; refusing to replace it (give another path{})",
            target.display(),
            kind_name(&meta),
            if meta.file_type().is_symlink() {
                ", or the path the link points to"
            } else {
                ""
            }
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(target, e)),
    }
}

/// `.NAME.`: temporaries are hidden and name their target.
fn temp_prefix(name: &OsStr) -> OsString {
    let mut p = OsString::from(".");
    p.push(name);
    p.push(".");
    p
}

/// Whether `entry` is one of our temporaries for the target named `name`.
fn is_temp_for(entry: &OsStr, name: &OsStr) -> bool {
    let (entry, prefix) = (entry.as_encoded_bytes(), temp_prefix(name));
    let prefix = prefix.as_encoded_bytes();
    let suffix = TEMP_SUFFIX.as_bytes();
    entry.len() == prefix.len() + RANDOM_CHARS + suffix.len()
        && entry.starts_with(prefix)
        && entry.ends_with(suffix)
        && entry[prefix.len()..prefix.len() + RANDOM_CHARS]
            .iter()
            .all(u8::is_ascii_alphanumeric)
}

/// Removes the temporaries that killed runs left for this target: each one that is a regular
/// file of ours (opened without following links), older than a few seconds and not locked by
/// a live writer. Best effort: whatever cannot be checked is left alone.
pub fn sweep_leftovers(dir: &Path, name: &OsStr) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        if !is_temp_for(&file_name, name) {
            continue;
        }
        let path = entry.path();
        if let Some(_locked) = abandoned(&path) {
            // Removed while we hold its lock, so no writer can take it up in between.
            if std::fs::remove_file(&path).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

/// The leftover at `path`, opened and locked, when it is abandoned.
fn abandoned(path: &Path) -> Option<File> {
    let file = open_nofollow(path).ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || !owned_by_us(&meta) {
        return None;
    }
    let age = SystemTime::now()
        .duration_since(meta.modified().ok()?)
        .unwrap_or_default();
    if age < LEFTOVER_MIN_AGE {
        return None;
    }
    file.try_lock().ok()?;
    Some(file)
}

fn lock(file: &File) -> std::io::Result<()> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
        // A file created exclusively a moment ago cannot be locked by anyone else.
        Err(std::fs::TryLockError::WouldBlock) => Err(std::io::Error::other(
            "a new temporary is locked by another process",
        )),
    }
}

#[cfg(unix)]
fn open_nofollow(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
}

#[cfg(not(unix))]
fn open_nofollow(path: &Path) -> std::io::Result<File> {
    if std::fs::symlink_metadata(path)?.file_type().is_symlink() {
        return Err(std::io::Error::other("a symbolic link"));
    }
    File::open(path)
}

#[cfg(unix)]
fn owned_by_us(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    meta.uid() == unsafe { libc::geteuid() }
}

#[cfg(not(unix))]
fn owned_by_us(_: &std::fs::Metadata) -> bool {
    true
}

/// Outputs get what `File::create` would give them, 0666 less the umask (the kernel applies it
/// to an exclusive create's mode as to any other), not tempfile's private 0600.
fn builder(prefix: &OsString) -> tempfile::Builder<'_, 'static> {
    let mut b = tempfile::Builder::new();
    b.prefix(prefix)
        .suffix(TEMP_SUFFIX)
        .rand_bytes(RANDOM_CHARS);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        b.permissions(std::fs::Permissions::from_mode(0o666));
    }
    b
}

#[cfg(all(test, unix))]
mod tests;
