//! Connections: the accept loop, the cap on open connections, the per-connection timeouts and
//! the bounded drain at shutdown.
//!
//! Written by hand over hyper's connection API because `axum::serve` has no timeouts at all (a
//! client that stops halfway through its headers holds its connection, and its file descriptor,
//! forever) and hyper's own header timeout starts when hyper begins waiting for a request, so it
//! cannot tell an idle keep-alive connection from a stalled request. Here a watchdog per
//! connection follows it through its states ([`tracker::Tracker::watch`]):
//!
//! - **idle** (just opened, or after a response): closed after `idle`;
//! - **a request begun** (bytes arrived, headers not complete): closed after `headers` from the
//!   first byte;
//! - **a request in flight**: its body must arrive within `body` (enforced where the body is
//!   read, `super::body`, which answers 408); the answer is not timed, as generation may be
//!   slow, but a client that stops reading it (writes refused) for `idle` is disconnected.
//!   Bytes of a pipelined next request that arrive meanwhile are timed only once it is idle.
//!
//! At the cap (`max_connections`) a new connection takes the place of the connection that has
//! waited longest with nothing in flight or with a request whose body is still coming; only
//! when every connection has a request being answered is it answered 503, except `GET /health`,
//! which a few connections over the cap may still ask (monitoring keeps working while the
//! server is saturated). At shutdown, connections with nothing in flight or a body still coming are
//! closed at once; the others are told to close after their response, which must end by the
//! drain deadline.

mod canned;
mod io;
mod tracker;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep_until, timeout, Instant};
use tower::ServiceExt;

use self::io::{InFlight, TrackedBody, WatchedIo};
pub use self::tracker::BodyWatch;
use self::tracker::Tracker;

/// The connection limits (`refusion serve`'s `--*-timeout` and `--max-connections`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// From a request's first byte until hyper has its headers.
    pub headers: Duration,
    /// From the headers until the whole body has arrived.
    pub body: Duration,
    /// A keep-alive connection with no request in flight, or a client not reading its answer.
    pub idle: Duration,
    /// How long responses in flight may take to finish once shutdown starts.
    pub grace: Duration,
    /// Open connections at most; beyond it idle ones make room, else 503.
    pub max_connections: usize,
}

/// Bytes of send buffer asked of the kernel per connection (Linux doubles it for bookkeeping).
const SEND_BUFFER: usize = 16 << 10;

/// Sleeps until `deadline`, or forever without one.
async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Serves one connection until it ends, times out, is evicted or shutdown closes it. The
/// shutdown channel carries the drain deadline.
async fn serve_connection(
    stream: TcpStream,
    tracker: Arc<Tracker>,
    app: Router,
    limits: ConnLimits,
    mut shutdown: watch::Receiver<Option<Instant>>,
) {
    let _ = stream.set_nodelay(true);
    // The kernel would grow a socket's send buffer to megabytes for a client that does not
    // read; a fixed one bounds that memory and lets a stalled reader show soon. Answers here
    // are text: 32 KiB in flight carries ~160 KB/s even at 200 ms of round trip.
    let _ = socket2::SockRef::from(&stream).set_send_buffer_size(SEND_BUFFER);
    let io = TokioIo::new(WatchedIo::new(stream, tracker.clone()));
    let t = tracker.clone();
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        t.request_started();
        req.extensions_mut().insert(BodyWatch(t.clone()));
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
        // Per connection at most 64 KiB of headers read and of answer queued (hyper's default
        // is ~400 KiB): many connections cannot pin much memory.
        .max_buf_size(tracker::MAX_HEAD_BYTES)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut drain: Option<Instant> = None;
    let mut closing = false;
    loop {
        let w = tracker.watch(&limits);
        if (drain.is_some() || tracker.evicted()) && !closing {
            if w.closable {
                return; // dropping the connection closes the socket
            }
            // Finish the answer in flight, then close (no keep-alive).
            conn.as_mut().graceful_shutdown();
            closing = true;
        }
        let deadline = match (w.deadline, drain) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = tracker.changed.notified() => {}
            _ = shutdown.changed(), if drain.is_none() => {
                drain = Some((*shutdown.borrow()).unwrap_or_else(Instant::now));
            }
            _ = until(deadline) => {
                let drained = drain.is_some_and(|d| Instant::now() >= d);
                if drained || tracker.epoch() == w.epoch {
                    return;
                }
            }
        }
    }
}

/// The 503 body for a connection over the cap.
fn busy_body(max: usize) -> String {
    super::api::ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "server_busy",
        format!("too many open connections (the limit is {max}); retry later"),
    )
    .body()
    .to_string()
}

/// Over the cap: a 503 in the API's error format, then a lingering close.
async fn refuse(mut stream: TcpStream, max: usize) {
    let body = busy_body(max);
    let msg = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = timeout(Duration::from_secs(1), async {
        stream.write_all(msg.as_bytes()).await?;
        linger(&mut stream).await
    })
    .await;
}

/// Shuts the write side and reads what the client still sends, for a moment and up to 1 MiB,
/// so that it reads the answer instead of a reset.
async fn linger(stream: &mut TcpStream) -> std::io::Result<()> {
    stream.shutdown().await?;
    let mut sink = [0u8; 16 << 10];
    let mut left = 1usize << 20;
    while left > 0 {
        match stream.read(&mut sink).await? {
            0 => break,
            n => left = left.saturating_sub(n),
        }
    }
    Ok(())
}

/// Connections over the cap answered at once (`GET /health` served, anything else 503).
const OVERFLOW: usize = 8;

/// Over the cap with every place answering a request: one request is read (2 s at most) and
/// answered without keep-alive: `GET /health` by the app, anything else 503. At most
/// [`OVERFLOW`] at a time; beyond, a plain 503.
async fn overflow(stream: TcpStream, app: Router, max: usize, places: Arc<Semaphore>) {
    let Ok(_place) = places.try_acquire_owned() else {
        return refuse(stream, max).await;
    };
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let app = app.clone();
        async move {
            if req.method() == axum::http::Method::GET && req.uri().path() == "/health" {
                return app.oneshot(req.map(Body::new)).await;
            }
            Ok(axum::http::Response::builder()
                .status(axum::http::StatusCode::SERVICE_UNAVAILABLE)
                .header("content-type", "application/json")
                .header("retry-after", "1")
                .body(Body::from(busy_body(max)))
                .unwrap_or_default())
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .max_buf_size(16 << 10)
        .serve_connection(TokioIo::new(stream), service)
        .without_shutdown();
    let _ = timeout(Duration::from_secs(2), async {
        if let Ok(parts) = conn.await {
            let mut stream = parts.io.into_inner();
            let _ = linger(&mut stream).await;
        }
    })
    .await;
}

/// At the cap, picks the connection that has waited longest with nothing being answered (idle,
/// a request's headers or body still coming) and tells it to close and hand its place over; `None` when
/// every one is busy. So silent connections cannot lock out real clients: only requests in
/// flight fill the cap.
fn evict_idlest(live: &mut Vec<Arc<Tracker>>) -> Option<oneshot::Receiver<OwnedSemaphorePermit>> {
    // A tracker only the accept loop holds belongs to a connection that has ended.
    live.retain(|t| Arc::strong_count(t) > 1);
    let idlest = live
        .iter()
        .filter_map(|t| t.evictable_since().map(|since| (since, t)))
        .min_by_key(|(since, _)| *since);
    let (_, victim) = idlest?;
    let (heir, place) = oneshot::channel();
    victim.evict(heir);
    Some(place)
}

/// Accepts connections until `stop` resolves, then drains until `limits.grace` after that:
/// connections with nothing in flight close at once, responses in flight may finish. Returns
/// the drain deadline and how many connections were still open at it (closed by dropping them).
pub async fn run(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    stop: impl Future<Output = ()>,
) -> (Instant, usize) {
    let max = limits.max_connections.max(1);
    let slots = Arc::new(Semaphore::new(max));
    let spare = Arc::new(Semaphore::new(OVERFLOW));
    let (shutdown_tx, shutdown_rx) = watch::channel(None);
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
        let place = match slots.clone().try_acquire_owned() {
            Ok(p) => Ok(p),
            Err(_) => match evict_idlest(&mut live) {
                Some(inherited) => Err(inherited),
                None => {
                    conns.spawn(overflow(stream, app.clone(), max, spare.clone()));
                    continue;
                }
            },
        };
        let tracker = Tracker::new();
        live.push(tracker.clone());
        let (app, rx) = (app.clone(), shutdown_rx.clone());
        conns.spawn(async move {
            // An evicted connection hands its place over as soon as it has closed.
            let place = match place {
                Ok(p) => p,
                Err(inherited) => match timeout(Duration::from_secs(1), inherited).await {
                    Ok(Ok(p)) => p,
                    _ => return refuse(stream, max).await,
                },
            };
            tracker.admit();
            serve_connection(stream, tracker.clone(), app, limits, rx).await;
            tracker.release(place);
        });
    }
    drop(listener);
    let deadline = Instant::now() + limits.grace;
    let _ = shutdown_tx.send(Some(deadline));
    while let Ok(Some(_)) = tokio::time::timeout_at(deadline, conns.join_next()).await {}
    let left = conns.len();
    conns.abort_all();
    (deadline, left)
}
