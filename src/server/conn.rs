//! Connections: the accept loop, the cap on open connections, the per-connection timeouts and
//! the bounded drain at shutdown.
//!
//! Written by hand over hyper's connection API because `axum::serve` has no timeouts at all (a
//! client that stops halfway through its headers holds its connection, and its file descriptor,
//! forever) and hyper's own header timeout starts when hyper begins waiting for a request, so it
//! cannot tell an idle keep-alive connection from a stalled request. Here a small watchdog per
//! connection knows which phase the connection is in:
//!
//! - **idle**: no request in flight and no byte of the next one yet (just opened, or after a
//!   response): closed after `idle` (the keep-alive timeout);
//! - **headers**: the first bytes of a request arrived but hyper has not handed it over yet:
//!   closed after `headers` from the first byte;
//! - **busy**: a request is being answered. Its body must arrive within `body` (enforced where
//!   the body is read, [`super::read_body`], which answers 408); generation itself is not timed.
//!
//! At the cap (`max_connections`) a new connection takes the place of the connection that has
//! waited longest with nothing in flight (idle or half-sent); only when every connection has a
//! request in flight is it answered 503. At shutdown, idle and half-sent connections are closed
//! at once and busy ones are told to close after their response, which must end within `grace`.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep_until, timeout, Instant};
use tower::ServiceExt;

/// The connection limits (`refusion serve`'s `--*-timeout` and `--max-connections`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// From a request's first byte until hyper has its headers.
    pub headers: Duration,
    /// From the headers until the whole body has arrived.
    pub body: Duration,
    /// A keep-alive connection with no request in flight.
    pub idle: Duration,
    /// How long in-flight responses may take to finish once shutdown starts.
    pub grace: Duration,
    /// Open connections at most; beyond it idle ones make room, else 503.
    pub max_connections: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Idle,
    Headers,
    Busy(usize),
}

struct PhaseState {
    phase: Phase,
    since: Instant,
    /// Bumped on every change, so a deadline computed for an earlier phase is never applied.
    epoch: u64,
}

/// What one connection is doing, shared by its IO, its service and its watchdog.
struct Tracker {
    state: Mutex<PhaseState>,
    changed: Notify,
    /// Chosen to make room under the cap: close as soon as nothing is in flight.
    evicted: AtomicBool,
}

impl Tracker {
    fn new() -> Arc<Tracker> {
        Arc::new(Tracker {
            state: Mutex::new(PhaseState {
                phase: Phase::Idle,
                since: Instant::now(),
                epoch: 0,
            }),
            changed: Notify::new(),
            evicted: AtomicBool::new(false),
        })
    }

    fn update(&self, f: impl FnOnce(Phase) -> Option<Phase>) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(next) = f(s.phase) {
            s.phase = next;
            s.since = Instant::now();
            s.epoch += 1;
            drop(s);
            // `notify_one` keeps a permit when the watchdog is not waiting yet: no lost change.
            self.changed.notify_one();
        }
    }

    /// Bytes arrived: an idle connection starts a request.
    fn on_read(&self) {
        self.update(|p| (p == Phase::Idle).then_some(Phase::Headers));
    }

    fn request_started(&self) {
        self.update(|p| match p {
            Phase::Busy(n) => Some(Phase::Busy(n + 1)),
            _ => Some(Phase::Busy(1)),
        });
    }

    fn request_finished(&self) {
        self.update(|p| match p {
            Phase::Busy(n) if n > 1 => Some(Phase::Busy(n - 1)),
            _ => Some(Phase::Idle),
        });
    }

    /// The current phase, its epoch, and when it times out (`None`: not timed).
    fn deadline(&self, limits: &ConnLimits) -> (Phase, u64, Option<Instant>) {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let limit = match s.phase {
            Phase::Idle => Some(limits.idle),
            Phase::Headers => Some(limits.headers),
            Phase::Busy(_) => None,
        };
        (s.phase, s.epoch, limit.map(|d| s.since + d))
    }

    fn epoch(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).epoch
    }

    /// When it last changed phase, if nothing is in flight (it may be evicted).
    fn idle_since(&self) -> Option<Instant> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        (!matches!(s.phase, Phase::Busy(_)) && !self.evicted.load(Ordering::SeqCst))
            .then_some(s.since)
    }

    fn evict(&self) {
        self.evicted.store(true, Ordering::SeqCst);
        self.changed.notify_one();
    }
}

/// At the cap, picks the connection that has been waiting longest with nothing in flight (idle,
/// or a request's headers still coming) and tells it to close; false when every one is busy.
/// So silent connections cannot lock out real clients; only requests in flight count against
/// the cap for good.
fn evict_idlest(live: &mut Vec<Arc<Tracker>>) -> bool {
    // A tracker only the accept loop holds belongs to a connection that has ended.
    live.retain(|t| Arc::strong_count(t) > 1);
    let idlest = live
        .iter()
        .filter_map(|t| t.idle_since().map(|since| (since, t)))
        .min_by_key(|(since, _)| *since);
    match idlest {
        Some((_, t)) => {
            t.evict();
            true
        }
        None => false,
    }
}

/// The socket, reporting to the watchdog when bytes arrive.
struct WatchedIo {
    inner: TcpStream,
    tracker: Arc<Tracker>,
}

impl AsyncRead for WatchedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.tracker.on_read();
        }
        r
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Marks its request finished when dropped: the response body was sent, or abandoned.
struct InFlight(Arc<Tracker>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A response body that holds its request's [`InFlight`] until hyper is done with it.
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
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

/// Serves one connection until it ends, times out, or shutdown closes it.
async fn serve_connection(
    stream: TcpStream,
    tracker: Arc<Tracker>,
    app: Router,
    limits: ConnLimits,
    mut shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(WatchedIo {
        inner: stream,
        tracker: tracker.clone(),
    });
    let t = tracker.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        t.request_started();
        let in_flight = InFlight(t.clone());
        let app = app.clone();
        async move {
            let resp = app.oneshot(req.map(Body::new)).await?;
            Ok::<_, Infallible>(resp.map(|inner| TrackedBody {
                inner,
                _in_flight: in_flight,
            }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .header_read_timeout(None)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut drain_until: Option<Instant> = None;
    loop {
        let (phase, epoch, deadline) = tracker.deadline(&limits);
        let closing = drain_until.is_some() || tracker.evicted.load(Ordering::SeqCst);
        if closing && !matches!(phase, Phase::Busy(_)) {
            return; // shutting down or evicted, and nothing in flight: close now
        }
        let deadline = match (deadline, drain_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let timer = async move {
            match deadline {
                Some(d) => sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = tracker.changed.notified() => {}
            _ = shutdown.changed(), if drain_until.is_none() => {
                conn.as_mut().graceful_shutdown();
                drain_until = Some(Instant::now() + limits.grace);
            }
            _ = timer => {
                let drained = drain_until.is_some_and(|d| Instant::now() >= d);
                if drained || tracker.epoch() == epoch {
                    return; // dropping the connection closes the socket
                }
            }
        }
    }
}

/// Over the cap: a 503 in the API's error format, then close. Bounded in time, so a client that
/// never reads cannot hold the task.
async fn refuse(mut stream: TcpStream, max: usize) {
    let body = super::api::ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "server_busy",
        format!("too many open connections (the limit is {max}); retry later"),
    )
    .body()
    .to_string();
    let msg = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = timeout(Duration::from_secs(1), async {
        stream.write_all(msg.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

/// Accepts connections until `stop` resolves, then drains: idle and half-sent connections close
/// at once, responses in flight get `limits.grace` to finish. Returns how many connections were
/// still open when the grace ran out (they are closed by dropping them).
pub async fn run(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    stop: impl Future<Output = ()>,
) -> usize {
    let max = limits.max_connections.max(1);
    let slots = Arc::new(Semaphore::new(max));
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    let mut live: Vec<Arc<Tracker>> = Vec::new();
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            _ = &mut stop => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors and the like: wait instead of spinning.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let ready = slots.clone().try_acquire_owned().ok();
        if ready.is_none() && !evict_idlest(&mut live) {
            conns.spawn(refuse(stream, max));
            continue;
        }
        let tracker = Tracker::new();
        live.push(tracker.clone());
        let (slots, app, rx) = (slots.clone(), app.clone(), shutdown_rx.clone());
        conns.spawn(async move {
            // After an eviction the slot frees as soon as that connection closes.
            let permit = match ready {
                Some(p) => p,
                None => match timeout(Duration::from_secs(1), slots.acquire_owned()).await {
                    Ok(Ok(p)) => p,
                    _ => return refuse(stream, max).await,
                },
            };
            serve_connection(stream, tracker, app, limits, rx).await;
            drop(permit);
        });
    }
    drop(listener);
    let _ = shutdown_tx.send(true);
    let deadline = Instant::now() + limits.grace + Duration::from_millis(500);
    while !conns.is_empty() {
        match tokio::time::timeout_at(deadline, conns.join_next()).await {
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let left = conns.len();
    conns.abort_all();
    left
}
