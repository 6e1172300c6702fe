//! The worker: the model's thread. It owns the model and the scheduler, takes checked jobs
//! from the queue as room frees up, and steps the scheduler; each job's answer is assembled
//! by its [`crate::answer`] sink.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::jobs::{worker_failed, Job, Msg};
use crate::prepare::Prepared;
use crate::queue::{JobQueue, Phase, Pop, WorkerState};
use crate::shutdown::{shutting_down, Shutdown};
use refusion_engine::decode::DecodeParams;
use refusion_engine::error::Error;
use refusion_engine::load::runtime::Loaded;
use refusion_engine::sched::{Request, Scheduler, Stats};

/// Server-side limits and defaults.
pub struct Limits {
    pub base: DecodeParams,
    pub max_gen_length: u32,
    /// Requests decoded together (`--parallel`).
    pub parallel: usize,
}

/// What the worker shows of its load (`/metrics`, `/health`): the scheduler's counters as of
/// its last step, and the jobs in the queue not yet taken.
#[derive(Clone, Default)]
pub struct Load {
    pub stats: Arc<Mutex<Stats>>,
}

impl Load {
    pub fn stats(&self) -> Stats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The worker: owns the model and the scheduler, takes jobs from the queue as requests finish
/// (up to `parallel` in the scheduler; the rest wait in the bounded queue) and steps the
/// scheduler until the queue closes. `state` goes from loading to ready once the cache is set
/// up; an error there ends the worker (every queued job is answered 503 with it) and comes back
/// for the server to exit with.
pub fn run(
    loaded: Loaded,
    limits: Limits,
    jobs: &JobQueue,
    shutdown: &Shutdown,
    load: &Load,
    state: &WorkerState,
) -> Result<(), Error> {
    let parallel = limits.parallel.max(1);
    let cache = match loaded.new_cache(loaded.context + limits.max_gen_length as usize) {
        Ok(c) => c,
        Err(e) => {
            let reason = e.to_string();
            state.set(Phase::Failed(reason.clone()));
            for job in jobs.close_and_drain() {
                let _ = job.tx.send(Msg::Error(worker_failed(&reason)));
                let _ = job.tx.send(Msg::End);
            }
            return Err(e);
        }
    };
    state.set(Phase::Ready);
    let mut sched = Scheduler::new(&loaded.model, cache, parallel);
    // Scratch beyond the context is the cache's; a request may use the context.
    sched.limit_requests(loaded.context);
    let ctx = Ctx {
        loaded: &loaded,
        shutdown,
        jobs,
    };
    let mut open = true;
    loop {
        // Take jobs while the scheduler has room; wait for one only when it is idle.
        while open {
            let st = sched.stats();
            if st.running + st.waiting >= parallel {
                break;
            }
            match next_job(jobs, sched.is_idle(), shutdown) {
                Next::Job(job) => {
                    if let Some(req) = ctx.admit(*job) {
                        sched.submit(req);
                    }
                }
                Next::Later => continue,
                Next::None => break,
                Next::Closed => open = false,
            }
        }
        if sched.is_idle() && !open {
            break;
        }
        sched.step();
        *load.stats.lock().unwrap_or_else(|e| e.into_inner()) = sched.stats();
    }
    Ok(())
}

/// What the queue gave.
enum Next {
    Job(Box<Job>),
    /// Nothing yet (idle, waiting): ask again.
    Later,
    /// Nothing now (busy): get on with decoding.
    None,
    /// No more jobs will come (the server is shutting down).
    Closed,
}

/// The next job: waited for when the scheduler is idle (but the wait ends at shutdown even
/// while some other answer, a /tokenize say, still holds the queue's sender open), only taken
/// if there when it is busy.
fn next_job(jobs: &JobQueue, idle: bool, shutdown: &Shutdown) -> Next {
    let wait = idle.then_some(std::time::Duration::from_millis(50));
    match jobs.pop(wait) {
        Pop::Job(j) => Next::Job(j),
        Pop::Empty if idle && shutdown.requested() => Next::Closed,
        Pop::Empty if idle => Next::Later,
        Pop::Empty => Next::None,
        Pop::Closed => Next::Closed,
    }
}

/// What a job's request needs from the worker.
struct Ctx<'a> {
    loaded: &'a Loaded,
    shutdown: &'a Shutdown,
    jobs: &'a JobQueue,
}

impl<'a> Ctx<'a> {
    /// A job taken from the queue, as a scheduler request; `None` when it is answered already
    /// (cancelled while queued, or the server shutting down).
    fn admit(&self, job: Job) -> Option<Request<'a>> {
        if job.cancel.load(Ordering::SeqCst) {
            // Its client left between the take and now (else the job was withdrawn).
            self.jobs.note_cancelled();
            let _ = job.tx.send(Msg::End);
            return None;
        }
        if !self.shutdown.begin(&job.cancel) {
            self.shutdown.end(&job.cancel);
            let _ = job.tx.send(Msg::Error(shutting_down()));
            let _ = job.tx.send(Msg::End);
            return None;
        }
        let sink = crate::answer::sink(
            &job.request,
            &self.loaded.tokenizer,
            self.shutdown,
            job.cancel.clone(),
            job.tx,
        );
        let Prepared { prompt, params, .. } = job.request;
        let cancel = job.cancel;
        Some(Request {
            prompt,
            params,
            cancel,
            sink,
        })
    }
}
