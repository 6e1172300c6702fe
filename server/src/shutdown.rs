//! Shutdown as the worker sees it: the generations in progress and the jobs still queued.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;

use crate::api::ApiError;

/// Shutdown as the worker sees it: once requested, the generations in progress are cancelled
/// and every job still queued is answered 503.
#[derive(Default)]
pub struct Shutdown {
    requested: AtomicBool,
    /// The cancel flags of the jobs the scheduler holds.
    current: Mutex<Vec<Arc<AtomicBool>>>,
}

impl Shutdown {
    /// Starts shutting down; true when generations were in progress (they are cancelled).
    pub fn request(&self) -> bool {
        self.requested.store(true, Ordering::SeqCst);
        let current = std::mem::take(&mut *self.slot());
        for cancel in &current {
            cancel.store(true, Ordering::SeqCst);
        }
        !current.is_empty()
    }

    /// Whether shutdown has begun.
    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Vec<Arc<AtomicBool>>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a job handed to the scheduler; false when shutdown was requested (it must not
    /// run). The job is registered before the flag is read and `request` sets the flag before
    /// it looks, so one of the two always sees the other.
    pub(crate) fn begin(&self, cancel: &Arc<AtomicBool>) -> bool {
        self.slot().push(cancel.clone());
        !self.requested()
    }

    /// A registered job has finished.
    pub(crate) fn end(&self, cancel: &Arc<AtomicBool>) {
        self.slot().retain(|c| !Arc::ptr_eq(c, cancel));
    }
}

/// The answer to a job cancelled, or never started, because of shutdown.
pub(crate) fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_shutting_down",
        "the server is shutting down; the request was cancelled",
    )
}
