//! The socket and the response body, wrapped to report to the connection's [`Tracker`].

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use hyper::body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::tracker::Tracker;

/// The socket: reports bytes arriving, and writes refused or going through; hyper's own
/// error answers go out with the API's error body ([`super::canned`]).
pub struct WatchedIo {
    pub inner: TcpStream,
    pub tracker: Arc<Tracker>,
    /// An answer sent in place of hyper's: its bytes, how many are written, and the length of
    /// hyper's write that it stands for (reported once all of it is out).
    pub replacing: Option<(Vec<u8>, usize, usize)>,
}

impl WatchedIo {
    pub fn new(inner: TcpStream, tracker: Arc<Tracker>) -> WatchedIo {
        WatchedIo {
            inner,
            tracker,
            replacing: None,
        }
    }

    /// Writes the replacement of hyper's answer `buf` (started when `buf` is one), and reports
    /// `buf` written once all of it is; `None` when `buf` is an ordinary write.
    fn poll_replace(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Option<Poll<io::Result<usize>>> {
        if self.replacing.is_none() {
            // The cheap test first: most writes are answers' bodies.
            let error_head = buf.starts_with(b"HTTP/1.1 4") || buf.starts_with(b"HTTP/1.1 5");
            if !error_head || self.tracker.in_flight() {
                return None;
            }
            let bytes = super::canned::with_error_body(buf)?;
            self.replacing = Some((bytes, 0, buf.len()));
        }
        let (bytes, done, stands_for) = self.replacing.as_mut()?;
        while *done < bytes.len() {
            let r = Pin::new(&mut self.inner).poll_write(cx, &bytes[*done..]);
            let n = match r {
                Poll::Ready(Ok(n)) => n,
                other => return Some(other),
            };
            if n == 0 {
                return Some(Poll::Ready(Ok(0)));
            }
            *done += n;
        }
        let n = *stands_for;
        self.replacing = None;
        Some(Poll::Ready(Ok(n)))
    }

    fn wrote(&self, r: &Poll<io::Result<usize>>) {
        match r {
            Poll::Pending => self.tracker.on_write_blocked(),
            Poll::Ready(Ok(n)) if *n > 0 => self.tracker.on_write(),
            _ => {}
        }
    }
}

impl AsyncRead for WatchedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // A request's head is given to hyper only up to its cap (see `MAX_HEAD_BYTES`).
        let room = self.tracker.head_room().filter(|&r| r > 0);
        let n = match room {
            Some(r) if r < buf.remaining() => {
                let mut part = buf.take(r);
                std::task::ready!(Pin::new(&mut self.inner).poll_read(cx, &mut part))?;
                let n = part.filled().len();
                // SAFETY: `part` is the start of `buf`'s unfilled space; its first `n` bytes
                // were just filled.
                unsafe { buf.assume_init(n) };
                buf.advance(n);
                n
            }
            _ => {
                let before = buf.filled().len();
                std::task::ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
                buf.filled().len() - before
            }
        };
        if n > 0 {
            self.tracker.on_read(n);
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = match self.poll_replace(cx, buf) {
            Some(r) => r,
            None => Pin::new(&mut self.inner).poll_write(cx, buf),
        };
        self.wrote(&r);
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // hyper's answer is a head alone: one slice.
        let mut nonempty = bufs.iter().filter(|b| !b.is_empty());
        if let (Some(only), None) = (nonempty.next(), nonempty.next()) {
            if let Some(r) = self.poll_replace(cx, only) {
                self.wrote(&r);
                return r;
            }
        }
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Marks its request finished when dropped: the response body was sent, or abandoned.
pub struct InFlight(pub Arc<Tracker>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A response body that holds its request's [`InFlight`] until hyper is done with it.
pub struct TrackedBody {
    pub inner: Body,
    pub _in_flight: InFlight,
}

impl http_body::Body for TrackedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
