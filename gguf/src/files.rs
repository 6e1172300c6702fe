//! Opening a file the user named, for reading, without ever blocking or reading from something
//! that is not a file: a FIFO would block `open` until a writer came (forever), a device such
//! as /dev/zero would feed endless bytes, a directory reads as an error deep in a parser.
//!
//! The path is opened with `O_NONBLOCK` (which a regular file ignores and which makes opening a
//! FIFO return at once) and its type is taken from the open descriptor (`fstat`), so a file
//! swapped for a FIFO between a check and the open is caught too. std has no portable
//! spelling of `O_NONBLOCK`; it comes from libc.

use std::fs::{File, Metadata, OpenOptions};

use memmap2::{Mmap, UncheckedAdvice};
use std::path::Path;

use crate::error::{Error, Result};

/// What a path that is not a regular file holds, in words ("a FIFO", "a directory").
pub fn kind_name(meta: &Metadata) -> &'static str {
    let ft = meta.file_type();
    if ft.is_dir() {
        return "a directory";
    }
    if ft.is_symlink() {
        return "a symbolic link";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if ft.is_socket() {
            return "a socket";
        }
        if ft.is_char_device() || ft.is_block_device() {
            return "a device";
        }
    }
    if ft.is_file() {
        "a file"
    } else {
        "not a regular file"
    }
}

/// Refuses anything but a regular file: "PATH is a FIFO (named pipe), not a file".
pub fn require_regular(path: &Path, meta: &Metadata) -> Result<()> {
    if meta.is_file() {
        Ok(())
    } else {
        Err(Error::bad(
            path,
            format!("is {}, not a regular file", kind_name(meta)),
        ))
    }
}

/// Opens `path` read-only if it is a regular file; anything else (FIFO, socket, device,
/// directory) is refused in one line without blocking.
pub fn open_regular(path: &Path) -> Result<File> {
    let mut opts = OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let file = opts.open(path).map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    require_regular(path, &meta)?;
    Ok(file)
}

/// Reads a whole regular file as text (configs, tokenizers, indexes).
pub fn read_to_string_regular(path: &Path) -> Result<String> {
    use std::io::Read;
    let mut text = String::new();
    open_regular(path)?
        .read_to_string(&mut text)
        .map_err(|e| Error::io(path, e))?;
    Ok(text)
}

/// Drops the pages of `mmap[start..start+len]` from this process, so that streaming through a
/// file larger than memory keeps the resident set near one tensor. Best effort.
pub fn release_pages(mmap: &Mmap, start: usize, len: usize) {
    if len == 0 || start >= mmap.len() {
        return;
    }
    let len = len.min(mmap.len() - start);
    // SAFETY: the map is a read-only, file-backed mapping: after MADV_DONTNEED the next access
    // reads the same bytes back from the file, so no reference observes a change.
    let _ = unsafe { mmap.unchecked_advise_range(UncheckedAdvice::DontNeed, start, len) };
}

/// Whether two paths name the same file (device and inode), following links.
pub fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata(a), std::fs::metadata(b)) {
            (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        match (a.canonicalize(), b.canonicalize()) {
            (Ok(x), Ok(y)) => x == y,
            _ => false,
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("f.gguf");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open_regular(&fifo).unwrap_err().to_string();
        assert!(
            e.contains("is a FIFO (named pipe), not a regular file"),
            "{e}"
        );
    }

    #[test]
    fn directories_and_devices_are_refused_and_files_open() {
        let dir = tempfile::tempdir().unwrap();
        let e = open_regular(dir.path()).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = open_regular(Path::new("/dev/zero"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("is a device"), "{e}");
        let f = dir.path().join("x");
        std::fs::write(&f, b"abc").unwrap();
        assert!(open_regular(&f).is_ok());
        let link = dir.path().join("y");
        std::fs::hard_link(&f, &link).unwrap();
        assert!(same_file(&f, &link));
        assert!(!same_file(&f, dir.path()));
    }
}
