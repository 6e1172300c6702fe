//! What one connection is doing, as its watchdog needs to know: is a request in flight, has
//! the next one begun, is its body still coming, is the client reading what we write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit};
use tokio::time::Instant;

use super::ConnLimits;

/// The most bytes a request's head (request line and headers) may have: hyper's read buffer
/// is capped at this, and reads are cut so that it is never overshot (hyper alone checks the
/// cap only after a read, which let about 114 KB through), so a longer head gets 431 exactly
/// beyond this many bytes.
pub const MAX_HEAD_BYTES: usize = 64 << 10;

struct State {
    /// Requests handed to the service whose response body hyper has not dropped yet.
    in_flight: usize,
    /// With nothing in flight: the first bytes of the next request have arrived.
    started: bool,
    /// The request in flight has not been read whole yet.
    receiving: bool,
    /// Since when writes have been refused (the client is not reading), if they are.
    blocked: Option<Instant>,
    /// When `in_flight` or `started` last changed.
    since: Instant,
    /// Bumped on every change, so a deadline computed before one is never applied after it.
    epoch: u64,
    /// With nothing in flight: bytes of the next request read so far (its head, as far as
    /// hyper has been given it).
    head_bytes: usize,
}

/// Shared by a connection's socket wrapper, its service, the body reader and its watchdog.
pub struct Tracker {
    state: Mutex<State>,
    /// Woken on every change (a permit is kept when nobody waits: no change is lost).
    pub changed: Notify,
    /// Set by the accept loop to make room under the cap.
    evicted: AtomicBool,
    /// Who gets this connection's place under the cap when it closes (after an eviction).
    heir: Mutex<Option<oneshot::Sender<OwnedSemaphorePermit>>>,
    /// The connection holds a place under the cap (a waiting one frees none when evicted).
    admitted: AtomicBool,
    /// Mirrors `state.blocked.is_some()`, so writes that go through take no lock.
    write_blocked: AtomicBool,
}

/// What the watchdog does next.
pub struct Watch {
    /// The tracker's epoch when this was computed: the deadline holds only while unchanged.
    pub epoch: u64,
    /// When the connection times out in its current state (`None`: not timed).
    pub deadline: Option<Instant>,
    /// Nothing would be lost by closing now: no request in flight, or one whose body is
    /// still coming (shutdown and eviction close these at once).
    pub closable: bool,
}

impl Tracker {
    pub fn new() -> Arc<Tracker> {
        Arc::new(Tracker {
            state: Mutex::new(State {
                in_flight: 0,
                started: false,
                receiving: false,
                blocked: None,
                since: Instant::now(),
                epoch: 0,
                head_bytes: 0,
            }),
            changed: Notify::new(),
            evicted: AtomicBool::new(false),
            heir: Mutex::new(None),
            admitted: AtomicBool::new(false),
            write_blocked: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies `f`; when it reports a change, bumps the epoch and wakes the watchdog.
    fn update(&self, f: impl FnOnce(&mut State) -> bool) {
        let mut s = self.lock();
        if f(&mut s) {
            s.epoch += 1;
            drop(s);
            self.changed.notify_one();
        }
    }

    /// `n` bytes arrived: with nothing in flight, a request has begun (its headers are timed,
    /// and counted against [`MAX_HEAD_BYTES`]).
    pub fn on_read(&self, n: usize) {
        self.update(|s| {
            if s.in_flight == 0 {
                s.head_bytes = s.head_bytes.saturating_add(n);
            }
            let begins = s.in_flight == 0 && !s.started;
            if begins {
                s.started = true;
                s.since = Instant::now();
            }
            begins
        });
    }

    /// How many more bytes the head of the next request may have, while nothing is in flight
    /// (`None` while a request is: its body is limited elsewhere).
    pub fn head_room(&self) -> Option<usize> {
        let s = self.lock();
        (s.in_flight == 0).then(|| MAX_HEAD_BYTES.saturating_sub(s.head_bytes))
    }

    /// hyper handed a request (its headers complete) to the service.
    pub fn request_started(&self) {
        self.update(|s| {
            s.head_bytes = 0;
            s.in_flight += 1;
            s.started = false;
            s.receiving = true;
            s.since = Instant::now();
            true
        });
    }

    /// A request is with the service, or its answer is being sent.
    pub fn in_flight(&self) -> bool {
        self.lock().in_flight > 0
    }

    /// The request's body was read whole (or given up on).
    pub fn body_received(&self) {
        self.update(|s| std::mem::replace(&mut s.receiving, false));
    }

    /// hyper dropped the response body: sent, or abandoned.
    pub fn request_finished(&self) {
        self.update(|s| {
            s.in_flight = s.in_flight.saturating_sub(1);
            s.receiving = false;
            s.since = Instant::now();
            true
        });
    }

    /// A write was refused: the socket's buffer is full.
    pub fn on_write_blocked(&self) {
        if !self.write_blocked.swap(true, Ordering::SeqCst) {
            self.update(|s| {
                s.blocked = Some(Instant::now());
                true
            });
        }
    }

    /// A write went through.
    pub fn on_write(&self) {
        if self.write_blocked.swap(false, Ordering::SeqCst) {
            self.update(|s| s.blocked.take().is_some());
        }
    }

    /// The state's epoch, deadline and whether closing it now loses nothing.
    ///
    /// Idle: `idle` after the last response (or the opening). A request begun: `headers` from
    /// its first byte. In flight: its body is timed where it is read; the answer is not timed
    /// (generation may be slow), unless the client stops reading it for `idle`.
    pub fn watch(&self, limits: &ConnLimits) -> Watch {
        let s = self.lock();
        let after = |t: Instant, d: Duration| Some(t + d);
        let deadline = match (s.in_flight, s.started, s.blocked) {
            (0, false, _) => after(s.since, limits.idle),
            (0, true, _) => after(s.since, limits.headers),
            (_, _, Some(t)) => after(t, limits.idle),
            (_, _, None) => None,
        };
        Watch {
            epoch: s.epoch,
            deadline,
            closable: s.in_flight == 0 || s.receiving,
        }
    }

    /// The count of changes so far (see [`Watch::epoch`]).
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// The connection got its place under the cap and is being served.
    pub fn admit(&self) {
        self.admitted.store(true, Ordering::SeqCst);
    }

    /// Since when it has had nothing in flight, or a request whose body is still coming, if
    /// so, admitted and not already evicted. Both lose nothing by closing (no answer is under
    /// way), so a client that stalls after its headers cannot hold a place any more than one
    /// that stalls in them.
    pub fn evictable_since(&self) -> Option<Instant> {
        let s = self.lock();
        let candidate =
            self.admitted.load(Ordering::SeqCst) && !self.evicted.load(Ordering::SeqCst);
        let waiting = s.in_flight == 0 || (s.in_flight == 1 && s.receiving);
        (candidate && waiting).then_some(s.since)
    }

    /// Asks the connection to close as soon as nothing is in flight and hand its place to
    /// `heir` (directly: a newcomer taking a free place first cannot leave the heir without).
    pub fn evict(&self, heir: oneshot::Sender<OwnedSemaphorePermit>) {
        *self.heir.lock().unwrap_or_else(|e| e.into_inner()) = Some(heir);
        self.evicted.store(true, Ordering::SeqCst);
        self.changed.notify_one();
    }

    /// The closed connection's place: to its heir if it was evicted, else back to the pool.
    pub fn release(&self, place: OwnedSemaphorePermit) {
        let heir = self.heir.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(heir) = heir {
            // An heir that gave up waiting returns the place to the pool (dropped here).
            let _ = heir.send(place);
        }
    }

    /// Whether [`Tracker::evict`] was called.
    pub fn evicted(&self) -> bool {
        self.evicted.load(Ordering::SeqCst)
    }
}

/// A handle the body reader finds in a request's extensions, to say the body is in.
#[derive(Clone)]
pub struct BodyWatch(pub(super) Arc<Tracker>);

impl BodyWatch {
    /// The body has been read whole, or given up on.
    pub fn received(&self) {
        self.0.body_received();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnLimits {
        ConnLimits {
            headers: Duration::from_secs(1),
            body: Duration::from_secs(2),
            idle: Duration::from_secs(3),
            grace: Duration::from_secs(4),
            max_connections: 1,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_follow_the_connection_through_a_request() {
        let (t, l) = (Tracker::new(), limits());
        let start = Instant::now();
        let w = t.watch(&l);
        assert_eq!(w.deadline, Some(start + l.idle));
        assert!(
            w.closable && t.evictable_since().is_none(),
            "not admitted yet"
        );
        t.admit();
        assert!(t.evictable_since().is_some());
        tokio::time::advance(Duration::from_millis(500)).await;
        t.on_read(10);
        let w2 = t.watch(&l);
        assert!(w2.epoch > w.epoch);
        assert_eq!(
            w2.deadline,
            Some(start + Duration::from_millis(500) + l.headers)
        );
        t.on_read(10); // more header bytes do not restart the clock
        assert_eq!(t.head_room(), Some(MAX_HEAD_BYTES - 20));
        assert_eq!(t.watch(&l).epoch, w2.epoch);
        t.request_started();
        let w = t.watch(&l);
        assert_eq!(w.deadline, None);
        assert!(w.closable, "a body still coming may be cut at shutdown");
        assert!(
            t.evictable_since().is_some(),
            "a body still coming may be evicted"
        );
        t.body_received();
        assert!(
            t.evictable_since().is_none(),
            "a request being answered is not evicted"
        );
        assert!(!t.watch(&l).closable);
        t.on_read(5); // bytes of a pipelined request while one is in flight
        assert_eq!(t.head_room(), None);
        t.on_write_blocked();
        let blocked_at = Instant::now();
        tokio::time::advance(Duration::from_secs(1)).await;
        t.on_write_blocked();
        assert_eq!(t.watch(&l).deadline, Some(blocked_at + l.idle));
        t.on_write();
        assert_eq!(t.watch(&l).deadline, None);
        t.request_finished();
        let w = t.watch(&l);
        assert_eq!(w.deadline, Some(Instant::now() + l.idle));
        assert!(w.closable);
        let (heir, _) = oneshot::channel();
        t.evict(heir);
        assert!(t.evicted() && t.evictable_since().is_none());
    }
}
