//! Reading what a user pipes or names as text (a prompt file, a batch file, standard input,
//! chat lines from a pipe) with a bound on every read, refused by name before the bound is
//! passed: `/dev/zero`, `yes |` or a runaway producer never grows memory until the kernel's OOM
//! killer acts. Files are opened as the model is (`refusion_gguf::files::open_regular`): a FIFO,
//! device or directory is refused at once, never read or waited on.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

/// The most prompt text read from `-f` (a file or `-`), unless `-c` asks for a context that
/// could hold more: 40,960 tokens (the trained context) of Qwen3's longest token (128 bytes)
/// are 5 MiB, so no prompt that fits a context within the trained one is refused.
pub const PROMPT_BYTES: u64 = 8 << 20;
/// The longest token of Qwen3's vocabulary, in bytes: a context of `c` tokens holds at most
/// `c` times this much text.
const LONGEST_TOKEN_BYTES: u64 = 128;
// The trained context's worth of text is within the fixed bound.
const _: () = assert!(40_960 * LONGEST_TOKEN_BYTES <= PROMPT_BYTES);
/// The longest line of a batch file (one request) or of chat input from a pipe.
pub const LINE_BYTES: usize = PROMPT_BYTES as usize;
/// The most requests in one batch, and the most text in all.
pub const BATCH_REQUESTS: usize = 1_000_000;
pub const BATCH_BYTES: u64 = 1 << 30;

/// The bound on a prompt for a context of `context` tokens (`-c`; none: the default).
pub fn prompt_limit(context: Option<usize>) -> u64 {
    let held = (context.unwrap_or(0) as u64).saturating_mul(LONGEST_TOKEN_BYTES);
    held.max(PROMPT_BYTES)
}

/// Opens `path` for reading text, `-` being standard input; anything but a regular file (or
/// standard input) is refused in one line without blocking.
pub fn open_text(path: &Path, what: &str) -> Result<Box<dyn BufRead>> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(BufReader::new(std::io::stdin())));
    }
    let file = refusion_gguf::files::open_regular(path).map_err(|e| {
        let hint = if path.starts_with("/dev") || path.starts_with("/proc") {
            " (to read standard input, give -)"
        } else {
            ""
        };
        anyhow!("{e}{hint}; not read as {what}")
    })?;
    Ok(Box::new(BufReader::new(file)))
}

/// The whole text of `path` (`-`: standard input), refused once it passes `limit` bytes.
pub fn read_text(path: &Path, what: &str, limit: u64) -> Result<String> {
    let name = display(path);
    let mut bytes = Vec::new();
    open_text(path, what)?
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {what} from {name}"))?;
    if bytes.len() as u64 > limit {
        bail!(
            "{name}: more than {} of {what}; refusing to read further (the limit: {})",
            size(limit),
            if limit > PROMPT_BYTES {
                "the context given by -c, at the longest token's bytes"
            } else {
                "more than a context of 40,960 tokens can hold"
            }
        );
    }
    String::from_utf8(bytes).map_err(|_| anyhow!("{name}: {what} is not valid UTF-8 text"))
}

/// Lines of at most `limit` bytes, read one at a time into one buffer.
pub struct Lines<R> {
    inner: R,
    limit: usize,
    buf: Vec<u8>,
    /// Bytes read so far.
    pub bytes: u64,
}

/// A line longer than the bound: refused, and the rest of it is not read.
#[derive(Debug)]
pub struct LineTooLong(pub usize);

impl std::fmt::Display for LineTooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a line is longer than {}", size(self.0 as u64))
    }
}

impl std::error::Error for LineTooLong {}

impl<R: BufRead> Lines<R> {
    pub fn new(inner: R, limit: usize) -> Lines<R> {
        Lines {
            inner,
            limit,
            buf: Vec::new(),
            bytes: 0,
        }
    }

    /// The next line without its line ending, or `None` at the end; bytes that are not UTF-8
    /// are replaced (a JSON parser then names the line).
    pub fn next_line(&mut self) -> std::io::Result<Option<String>> {
        self.buf.clear();
        let n = (&mut self.inner)
            .take(self.limit as u64 + 1)
            .read_until(b'\n', &mut self.buf)?;
        if n == 0 {
            return Ok(None);
        }
        self.bytes += n as u64;
        if self.buf.last() == Some(&b'\n') {
            self.buf.pop();
        } else if n > self.limit {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                LineTooLong(self.limit),
            ));
        }
        if self.buf.last() == Some(&b'\r') {
            self.buf.pop();
        }
        Ok(Some(String::from_utf8_lossy(&self.buf).into_owned()))
    }
}

fn display(path: &Path) -> String {
    if path.as_os_str() == "-" {
        "standard input".to_string()
    } else {
        path.display().to_string()
    }
}

/// `8 MiB`, `1 GiB`.
pub fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} bytes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_bounded_and_the_rest_is_not_read() {
        let text = b"one\r\ntwo\n\nthree-is-long\nfour";
        let mut lines = Lines::new(&text[..], 8);
        assert_eq!(lines.next_line().unwrap().as_deref(), Some("one"));
        assert_eq!(lines.next_line().unwrap().as_deref(), Some("two"));
        assert_eq!(lines.next_line().unwrap().as_deref(), Some(""));
        let e = lines.next_line().unwrap_err();
        assert!(e.to_string().contains("longer than 8 bytes"), "{e}");
        // An endless line (a /dev/zero) stops at the bound.
        let mut zeros = Lines::new(BufReader::new(std::io::repeat(0)), 1 << 16);
        assert!(zeros.next_line().is_err());
        assert!(zeros.bytes <= 1 << 17);
        // The last line needs no newline, and a line of exactly the bound passes.
        let mut exact = Lines::new(&b"12345678\n12345678"[..], 8);
        assert_eq!(exact.next_line().unwrap().as_deref(), Some("12345678"));
        assert_eq!(exact.next_line().unwrap().as_deref(), Some("12345678"));
        assert_eq!(exact.next_line().unwrap(), None);
    }

    #[test]
    fn the_prompt_bound_covers_the_context_asked_for() {
        assert_eq!(prompt_limit(None), PROMPT_BYTES);
        assert_eq!(prompt_limit(Some(40_960)), PROMPT_BYTES);
        assert_eq!(prompt_limit(Some(1 << 20)), 128 << 20);
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(size(8 << 20), "8 MiB");
        assert_eq!(size(1 << 30), "1 GiB");
        assert_eq!(size(512), "512 bytes");
    }
}
