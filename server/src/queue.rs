//! The bounded queue between the handlers and the worker, and the worker's state as `/health`
//! tells it.
//!
//! Written by hand rather than as a `sync_channel` because a channel cannot give a place back:
//! a request whose client left while it waited kept its place until the worker took it, so new
//! clients were refused 503 while only dead requests waited. Here the handler's
//! [`super::jobs::CancelOnDrop`] takes its job out of the queue the moment the response goes
//! away ([`JobQueue::withdraw`]), and counts it cancelled.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::jobs::Job;

pub struct JobQueue {
    state: Mutex<State>,
    arrived: Condvar,
    capacity: usize,
    /// Requests cancelled before they were decoded: withdrawn from the queue, or found
    /// cancelled when the worker took them.
    cancelled: AtomicU64,
}

struct State {
    jobs: VecDeque<(Ticket, Job)>,
    next: u64,
    closed: bool,
}

/// A queued job's place, to withdraw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

pub enum PushError {
    /// The queue holds `capacity` live jobs.
    Full,
    /// The worker has stopped taking jobs.
    Closed,
}

/// What the worker's take gave.
pub enum Pop {
    Job(Box<Job>),
    /// Nothing there (or nothing before the wait ended).
    Empty,
    /// Closed and empty: no job will come.
    Closed,
}

impl JobQueue {
    pub fn new(capacity: usize) -> JobQueue {
        JobQueue {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                next: 0,
                closed: false,
            }),
            arrived: Condvar::new(),
            capacity,
            cancelled: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `job`, unless `capacity` jobs wait or the queue is closed.
    pub fn push(&self, job: Job) -> Result<Ticket, PushError> {
        let mut st = self.lock();
        if st.closed {
            return Err(PushError::Closed);
        }
        if st.jobs.len() >= self.capacity {
            return Err(PushError::Full);
        }
        let ticket = Ticket(st.next);
        st.next += 1;
        st.jobs.push_back((ticket, job));
        drop(st);
        self.arrived.notify_one();
        Ok(ticket)
    }

    /// Takes the job out of the queue if it still waits there (its client left); it is
    /// counted cancelled. False when the worker has it already.
    pub fn withdraw(&self, ticket: Ticket) -> bool {
        let mut st = self.lock();
        let Some(i) = st.jobs.iter().position(|(t, _)| *t == ticket) else {
            return false;
        };
        let job = st.jobs.remove(i);
        drop(st);
        drop(job);
        self.cancelled.fetch_add(1, Ordering::SeqCst);
        true
    }

    /// The worker found a job it took already cancelled.
    pub fn note_cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::SeqCst);
    }

    /// The next job, waiting up to `wait` for one (none: not at all).
    pub fn pop(&self, wait: Option<Duration>) -> Pop {
        let mut st = self.lock();
        if st.jobs.is_empty() && !st.closed {
            if let Some(wait) = wait {
                st = self
                    .arrived
                    .wait_timeout(st, wait)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        }
        match st.jobs.pop_front() {
            Some((_, job)) => Pop::Job(Box::new(job)),
            None if st.closed => Pop::Closed,
            None => Pop::Empty,
        }
    }

    /// No more jobs are taken; those queued are still handed out (to be answered).
    pub fn close(&self) {
        self.lock().closed = true;
        self.arrived.notify_all();
    }

    /// Closes the queue and hands back every job in it (a worker that cannot run answers them).
    pub fn close_and_drain(&self) -> Vec<Job> {
        let mut st = self.lock();
        st.closed = true;
        st.jobs.drain(..).map(|(_, j)| j).collect()
    }

    /// Jobs waiting.
    pub fn len(&self) -> usize {
        self.lock().jobs.len()
    }

    pub fn cancelled(&self) -> u64 {
        self.cancelled.load(Ordering::SeqCst)
    }
}

/// The worker as `/health` tells it: loading (setting up its cache), ready, or failed (it
/// stopped with an error and the server is shutting down).
#[derive(Default)]
pub struct WorkerState {
    state: Mutex<Phase>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Phase {
    #[default]
    Loading,
    Ready,
    /// Stopped with this reason.
    Failed(String),
    /// Stopped after the queue closed (shutdown).
    Stopped,
}

impl WorkerState {
    pub fn get(&self) -> Phase {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set(&self, phase: Phase) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = phase;
    }

    /// Records the end of the worker's thread: a failure keeps its reason.
    pub fn finish(&self, outcome: Result<(), String>) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        *st = match outcome {
            Ok(()) => Phase::Stopped,
            Err(reason) => Phase::Failed(reason),
        };
    }
}

/// Counts the worker's thread ended by a panic as a failure (a drop during unwinding).
pub struct FailOnPanic<'a>(pub &'a WorkerState);

impl Drop for FailOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0
                .set(Phase::Failed("the model worker panicked".to_string()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn job() -> Job {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        Job {
            request: crate::prepare::Prepared {
                prompt: vec![1],
                params: refusion_engine::decode::DecodeParams::new(
                    refusion_gguf::DecodingDefaults::default(),
                    2,
                    1,
                ),
                stops: Vec::new(),
                decode_events: false,
            },
            cancel: Arc::new(AtomicBool::new(false)),
            tx,
        }
    }

    #[test]
    fn a_withdrawn_job_frees_its_place_at_once_and_is_counted() {
        let q = JobQueue::new(2);
        let a = q.push(job()).ok().unwrap();
        let _b = q.push(job()).ok().unwrap();
        assert!(matches!(q.push(job()), Err(PushError::Full)));
        assert!(q.withdraw(a));
        assert!(!q.withdraw(a), "withdrawn once");
        assert_eq!(q.cancelled(), 1);
        assert_eq!(q.len(), 1);
        assert!(q.push(job()).is_ok(), "the place is free again");
        // A job the worker took is not withdrawn (the worker answers it).
        let Pop::Job(_) = q.pop(None) else {
            panic!("a job was queued")
        };
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn a_closed_queue_refuses_and_hands_out_what_it_holds() {
        let q = JobQueue::new(4);
        q.push(job()).ok().unwrap();
        q.close();
        assert!(matches!(q.push(job()), Err(PushError::Closed)));
        assert!(matches!(q.pop(Some(Duration::from_secs(5))), Pop::Job(_)));
        assert!(matches!(q.pop(Some(Duration::from_secs(5))), Pop::Closed));
    }

    #[test]
    fn a_waiting_worker_wakes_for_a_job() {
        let q = Arc::new(JobQueue::new(1));
        let q2 = q.clone();
        let t = std::thread::spawn(move || q2.pop(Some(Duration::from_secs(30))));
        std::thread::sleep(Duration::from_millis(50));
        q.push(job()).ok().unwrap();
        assert!(matches!(t.join().unwrap(), Pop::Job(_)));
    }
}
