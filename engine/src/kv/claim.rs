//! Claiming a path for one of our cache files before anything is written there: the live
//! KV cache (`--kv-file`) and a saved prefix (`--prompt-cache`, chat's `/save`).
//!
//! A path is ours to write only when it is absent, empty, or a file that already carries that
//! kind's magic (a cache we wrote, perhaps for another model or shape, which may be rebuilt).
//! Anything else, above all the model itself or another GGUF, is refused in one line that
//! says what the file holds. Nothing here writes: [`claim`] answers before any work, and the
//! writers ([`super::host::HostStore::new`], [`super::KvCache::save_prefix`]) ask again at the
//! moment they open the file.

use std::io::Read;
use std::path::Path;

use refusion_gguf::files;

use crate::error::{Error, Result};

/// The live cache's magic (`--kv-file`), at the start of its header page.
pub const LIVE_MAGIC: &[u8; 4] = b"RFKC";
/// A saved prefix's magic (`--prompt-cache`, `/save`).
pub const PREFIX_MAGIC: &[u8; 4] = b"RFKV";

/// Which of our cache files a path is claimed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheFile {
    /// The live KV cache, `--kv-file`.
    Live,
    /// A saved prefix, `--prompt-cache` or chat's `/save`.
    Prefix,
}

impl CacheFile {
    pub fn magic(self) -> &'static [u8; 4] {
        match self {
            CacheFile::Live => LIVE_MAGIC,
            CacheFile::Prefix => PREFIX_MAGIC,
        }
    }

    fn name(self) -> &'static str {
        match self {
            CacheFile::Live => "a refusion KV cache (--kv-file)",
            CacheFile::Prefix => "a refusion prompt cache",
        }
    }

    fn other(self) -> CacheFile {
        match self {
            CacheFile::Live => CacheFile::Prefix,
            CacheFile::Prefix => CacheFile::Live,
        }
    }
}

/// What a claimed path holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    Absent,
    Empty,
    /// A file of this kind that we wrote.
    Ours,
}

/// Whether `path` may be written as a `kind` cache file, without writing anything. `model` is
/// the model file, never accepted (same device and inode) whatever it holds.
pub fn claim(path: &Path, kind: CacheFile, model: Option<&Path>) -> Result<Claim> {
    // A path the user gave that cannot be written: their mistake, not a broken file.
    let refuse = |what: &str| {
        Error::File(refusion_gguf::Error::usage(format!(
            "{}: {what}; refusing to overwrite it (give a new path, an empty file, or {} written \
             by refusion)",
            path.display(),
            kind.name(),
        )))
    };
    // Links are not followed: the rename of a saved prefix would replace the link, and the live
    // cache is written in place, where a link is the classic way to aim a writer elsewhere.
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            check_parent(path)?;
            return Ok(Claim::Absent);
        }
        Err(e) => return Err(Error::File(refusion_gguf::Error::io(path, e))),
    };
    if !meta.is_file() {
        return Err(refuse(&format!("is {}", files::kind_name(&meta))));
    }
    if model.is_some_and(|m| files::same_file(path, m)) {
        return Err(refuse("is the model file itself"));
    }
    if kind == CacheFile::Live && links(&meta) > 1 {
        return Err(refuse(
            "has other hard links (written in place, it would change them too)",
        ));
    }
    if meta.len() == 0 {
        return Ok(Claim::Empty);
    }
    let mut head = [0u8; 4];
    let n = files::open_regular(path)
        .and_then(|mut f| {
            read_up_to(&mut f, &mut head).map_err(|e| refusion_gguf::Error::io(path, e))
        })
        .map_err(Error::File)?;
    let head = &head[..n];
    if head == kind.magic() {
        Ok(Claim::Ours)
    } else {
        Err(refuse(&format!("holds {}", describe(head, kind))))
    }
}

/// How many names the file has.
pub fn links(meta: &std::fs::Metadata) -> u64 {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        meta.nlink()
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        1
    }
}

/// The first bytes of a file that is not ours, in words.
fn describe(head: &[u8], kind: CacheFile) -> &'static str {
    if head == b"GGUF" {
        "a GGUF model"
    } else if head == kind.other().magic() {
        kind.other().name()
    } else {
        "something else (not a refusion cache)"
    }
}

/// Reads until `buf` is full or the file ends; the count read.
fn read_up_to(f: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn check_parent(path: &Path) -> Result<()> {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() && !p.is_dir() => {
            Err(Error::File(refusion_gguf::Error::usage(format!(
                "{}: its folder '{}' does not exist",
                path.display(),
                p.display()
            ))))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_absent_empty_or_own_files_are_claimed() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        assert_eq!(
            claim(&p("new"), CacheFile::Live, None).unwrap(),
            Claim::Absent
        );
        std::fs::write(p("empty"), b"").unwrap();
        assert_eq!(
            claim(&p("empty"), CacheFile::Prefix, None).unwrap(),
            Claim::Empty
        );
        std::fs::write(p("ours"), b"RFKC and more").unwrap();
        assert_eq!(
            claim(&p("ours"), CacheFile::Live, None).unwrap(),
            Claim::Ours
        );

        std::fs::write(p("m.gguf"), b"GGUF\x03\0\0\0").unwrap();
        let e = claim(&p("m.gguf"), CacheFile::Live, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("m.gguf: holds a GGUF model; refusing to overwrite it"),
            "{e}"
        );
        let e = claim(&p("ours"), CacheFile::Prefix, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds a refusion KV cache (--kv-file)"), "{e}");
        std::fs::write(p("notes.txt"), b"hi").unwrap();
        let e = claim(&p("notes.txt"), CacheFile::Prefix, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a refusion cache"), "{e}");
        let e = claim(dir.path(), CacheFile::Live, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = claim(&p("no/such"), CacheFile::Live, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
    }

    #[test]
    fn the_model_file_is_never_claimed_even_when_it_looks_like_ours() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.gguf");
        std::fs::write(&model, b"RFKC").unwrap();
        let link = dir.path().join("kv.bin");
        std::fs::hard_link(&model, &link).unwrap();
        let e = claim(&link, CacheFile::Live, Some(&model))
            .unwrap_err()
            .to_string();
        assert!(e.contains("is the model file itself"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn links_are_never_claimed() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        std::fs::write(p("notes.txt"), b"").unwrap();
        std::os::unix::fs::symlink(p("notes.txt"), p("kv.bin")).unwrap();
        for kind in [CacheFile::Live, CacheFile::Prefix] {
            let e = claim(&p("kv.bin"), kind, None).unwrap_err().to_string();
            assert!(e.contains("kv.bin: is a symbolic link; refusing"), "{e}");
        }
        std::os::unix::fs::symlink(p("nowhere"), p("dangling")).unwrap();
        assert!(claim(&p("dangling"), CacheFile::Live, None).is_err());
        // An empty file of someone else's, hard-linked where the live cache would go.
        std::fs::hard_link(p("notes.txt"), p("live.bin")).unwrap();
        let e = claim(&p("live.bin"), CacheFile::Live, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("has other hard links"), "{e}");
        // A saved prefix replaces its path (a rename), so the other name keeps its bytes.
        assert_eq!(
            claim(&p("live.bin"), CacheFile::Prefix, None).unwrap(),
            Claim::Empty
        );
    }
}
