//! The worker pool that runs our kernels' parallel loops (the products, the attention, the
//! host path's element-wise passes): the caller and `threads - 1` workers take chunks of a
//! range from a shared cursor.
//!
//! Written here rather than taken from candle (`candle_core::utils::BarrierPool`, which this
//! replaced) or rayon, because of how a loop ends on a busy machine. candle's caller waits for
//! every worker to report, spinning without bound: when another process holds one of the
//! cores, the worker it waits for is not running and the caller burns the very core that
//! worker needs (a 2-core machine with one core busy kept 14 % of its speed; llama.cpp, whose
//! threads yield, 31 %). rayon's pool parks its threads between loops (a wake-up per loop, tens
//! of microseconds, at hundreds of loops per forward). Here:
//! - a loop ends when its *chunks* are done, not when every worker has checked in: a worker the
//!   OS has not scheduled yet finds the job closed when it wakes and goes back to waiting, so
//!   the caller never waits for it;
//! - every wait spins briefly (loops follow each other within microseconds in a forward), then
//!   yields the CPU (`sched_yield`, so a descheduled thread of ours can run), and a worker idle
//!   for longer parks (no CPU at all between forwards, as llama.cpp's threadpool does).
//!
//! Each item of a loop is run exactly once, by one thread, so results do not depend on the
//! thread count or the timing (the kernels write disjoint outputs per item).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a waiting thread spins before it yields, and a worker waits before it parks.
const SPIN: Duration = Duration::from_micros(50);
const PARK_AFTER: Duration = Duration::from_millis(2);

/// The loop body behind a type-erased pointer: `call(data, range)`.
#[derive(Clone, Copy)]
struct Job {
    call: unsafe fn(*const (), std::ops::Range<usize>),
    data: *const (),
    n_items: usize,
    chunk: usize,
}

/// State shared by the caller and the workers.
struct Shared {
    /// Bumped (Release) for each new job, after it is written.
    generation: AtomicUsize,
    /// The current job, written only while `open` is false and no worker is `inside`.
    job: Mutex<Option<Job>>,
    /// Whether the current job may still be joined.
    open: AtomicBool,
    /// Workers that joined the current job and have not left it.
    inside: AtomicUsize,
    /// The next item to hand out, and the items finished.
    cursor: AtomicUsize,
    finished: AtomicUsize,
    /// Workers parked (or about to park), to be woken by the next job.
    parked: AtomicUsize,
    /// A loop body panicked on a worker: the caller panics too once the job is closed.
    panicked: AtomicBool,
    threads: OnceLock<Vec<Thread>>,
}

// SAFETY: `Job::data` points at the caller's closure, which is `Sync`, and is dereferenced only
// between a job's opening and the moment the caller has seen every joined worker leave.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

pub struct WorkerPool {
    shared: &'static Shared,
    workers: usize,
    /// One caller at a time (a loop from a second thread waits its turn).
    turn: Mutex<()>,
}

thread_local! {
    /// Set on the pool's own threads, and on a caller while its loop runs: a loop started from
    /// inside a loop runs inline.
    static IN_LOOP: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` over `range` (the monomorphized entry behind [`Job::call`]).
///
/// # Safety
///
/// `data` must point at a live `F` (of this very type: the one `call::<F>` was stored with),
/// for the whole call; other threads may call it at the same time (`F: Sync`).
unsafe fn call<F: Fn(std::ops::Range<usize>) + Sync>(
    data: *const (),
    range: std::ops::Range<usize>,
) {
    // SAFETY: the caller guarantees `data` points at a live `F`.
    unsafe { (*(data as *const F))(range) }
}

impl WorkerPool {
    /// The process's pool: one thread per thread of the forward (`-t`, via candle's count,
    /// which follows `RAYON_NUM_THREADS`), the caller being one of them.
    pub fn global() -> &'static WorkerPool {
        static POOL: OnceLock<WorkerPool> = OnceLock::new();
        POOL.get_or_init(|| WorkerPool::new(candle_core::utils::get_num_threads().max(1)))
    }

    fn new(threads: usize) -> WorkerPool {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            generation: AtomicUsize::new(0),
            job: Mutex::new(None),
            open: AtomicBool::new(false),
            inside: AtomicUsize::new(0),
            cursor: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            threads: OnceLock::new(),
        }));
        let workers = threads - 1;
        let handles: Vec<Thread> = (0..workers)
            .filter_map(|i| {
                std::thread::Builder::new()
                    .name(format!("refusion-worker-{i}"))
                    .spawn(move || worker(shared))
                    .ok()
                    .map(|h| h.thread().clone())
            })
            .collect();
        let workers = handles.len();
        let _ = shared.threads.set(handles);
        WorkerPool {
            shared,
            workers,
            turn: Mutex::new(()),
        }
    }

    /// Threads that run a loop: the workers and the caller.
    pub fn threads(&self) -> usize {
        self.workers + 1
    }

    /// Runs `f` over `0..n_items` in chunks, on the workers and the calling thread; returns
    /// when every item is done.
    pub fn execute_chunked<F: Fn(std::ops::Range<usize>) + Sync>(&self, n_items: usize, f: F) {
        if n_items == 0 {
            return;
        }
        if self.workers == 0 || IN_LOOP.with(Cell::get) {
            f(0..n_items);
            return;
        }
        // About eight chunks per thread: a late thread's share is taken by the others.
        let chunk = n_items.div_ceil(self.threads() * 8).max(1);
        let n_chunks = n_items.div_ceil(chunk);
        if n_chunks == 1 {
            f(0..n_items);
            return;
        }
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        let s = self.shared;
        *s.job.lock().unwrap_or_else(|p| p.into_inner()) = Some(Job {
            call: call::<F>,
            data: &f as *const F as *const (),
            n_items,
            chunk,
        });
        s.cursor.store(0, Ordering::Relaxed);
        s.finished.store(0, Ordering::Relaxed);
        s.open.store(true, Ordering::SeqCst);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.parked.load(Ordering::SeqCst) > 0 {
            for t in s.threads.get().into_iter().flatten() {
                t.unpark();
            }
        }
        // Closing waits for every chunk, then for the workers inside to leave. A panic in `f`
        // on this thread closes too (the rest of the chunks withdrawn), so no worker is left
        // inside a job whose closure is gone.
        struct Close<'a>(&'a Shared, usize);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                let s = self.0;
                if std::thread::panicking() {
                    s.cursor.fetch_max(self.1, Ordering::Relaxed);
                } else {
                    wait_until(|| s.finished.load(Ordering::Acquire) >= self.1);
                }
                s.open.store(false, Ordering::SeqCst);
                wait_until(|| s.inside.load(Ordering::SeqCst) == 0);
                IN_LOOP.with(|l| l.set(false));
            }
        }
        IN_LOOP.with(|l| l.set(true));
        {
            let _close = Close(s, n_items);
            run_chunks(s, &|r| f(r), n_items, chunk);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a parallel loop's body panicked on a worker thread");
        }
    }
}

/// Takes chunks from the cursor until none are left.
fn run_chunks(s: &Shared, f: &dyn Fn(std::ops::Range<usize>), n_items: usize, chunk: usize) {
    loop {
        let start = s.cursor.fetch_add(chunk, Ordering::Relaxed);
        if start >= n_items {
            return;
        }
        let end = n_items.min(start + chunk);
        f(start..end);
        s.finished.fetch_add(end - start, Ordering::Release);
    }
}

/// Spins for [`SPIN`], then yields the CPU between checks.
fn wait_until(done: impl Fn() -> bool) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !done() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) && start.elapsed() > SPIN {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

fn worker(s: &'static Shared) {
    IN_LOOP.with(|w| w.set(true));
    let mut seen = 0usize;
    loop {
        seen = wait_for_job(s, seen);
        // Join, then check the job is still open: the caller closes it and then waits for
        // `inside` to drop to zero, so either it sees us inside or we see it closed.
        s.inside.fetch_add(1, Ordering::SeqCst);
        if s.open.load(Ordering::SeqCst) {
            let job = *s.job.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(job) = job {
                // SAFETY: the job is open, so its closure is alive until we leave (`inside`).
                let f = |r: std::ops::Range<usize>| unsafe { (job.call)(job.data, r) };
                // A panic in a loop body on a worker: the rest is withdrawn, the caller is
                // released and panics in turn, and the worker carries on.
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run_chunks(s, &f, job.n_items, job.chunk)
                }));
                if run.is_err() {
                    s.panicked.store(true, Ordering::SeqCst);
                    s.cursor.fetch_max(job.n_items, Ordering::Relaxed);
                    s.finished.fetch_add(job.n_items, Ordering::Release);
                }
            }
        }
        s.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits for a generation other than `seen`: spins, then yields, then parks.
fn wait_for_job(s: &Shared, seen: usize) -> usize {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let g = s.generation.load(Ordering::Acquire);
        if g != seen {
            return g;
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(64) {
            std::hint::spin_loop();
            continue;
        }
        let idle = start.elapsed();
        if idle < SPIN {
            std::hint::spin_loop();
        } else if idle < PARK_AFTER {
            std::thread::yield_now();
        } else {
            s.parked.fetch_add(1, Ordering::SeqCst);
            // Checked again after announcing the park: a job posted before the caller read
            // `parked` is seen here; one posted after it unparks us (a token park keeps).
            if s.generation.load(Ordering::SeqCst) == seen {
                std::thread::park_timeout(Duration::from_millis(100));
            }
            s.parked.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_once_whatever_the_timing() {
        let pool = WorkerPool::new(4);
        for n in [1usize, 2, 7, 31, 32, 33, 1000, 4096] {
            for round in 0..50 {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.execute_chunked(n, |r| {
                    for i in r {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
                if round % 10 == 0 {
                    // Long enough apart that the workers park.
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
    }

    #[test]
    fn loops_from_several_threads_and_nested_loops_complete() {
        let pool = std::sync::Arc::new(WorkerPool::new(3));
        std::thread::scope(|scope| {
            for _ in 0..3 {
                let pool = pool.clone();
                scope.spawn(move || {
                    for _ in 0..200 {
                        let sum = AtomicUsize::new(0);
                        pool.execute_chunked(100, |r| {
                            // Nested: runs inline on a worker, on the pool from the caller.
                            let inner = AtomicUsize::new(0);
                            pool.execute_chunked(10, |q| {
                                inner.fetch_add(q.len(), Ordering::Relaxed);
                            });
                            assert_eq!(inner.load(Ordering::Relaxed), 10);
                            sum.fetch_add(r.len(), Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 100);
                    }
                });
            }
        });
    }

    #[test]
    fn a_panic_in_a_body_reaches_the_caller_and_the_pool_carries_on() {
        let pool = WorkerPool::new(3);
        for on_item in [0usize, 999] {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.execute_chunked(1000, |r| {
                    if r.contains(&on_item) {
                        panic!("boom");
                    }
                })
            }));
            assert!(r.is_err());
            let sum = AtomicUsize::new(0);
            pool.execute_chunked(1000, |r| {
                sum.fetch_add(r.len(), Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 1000);
        }
    }
}
