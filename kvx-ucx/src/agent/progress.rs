//! The optional progress thread: progresses the worker while it has work, sleeps when idle.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use kvx_core::{ErrorKind, Result};

use crate::context::ProgressThreadConfig;
use crate::status::error;

use super::Shared;

pub(super) struct ProgressThread {
    pub(super) stop: Arc<AtomicBool>,
    pub(super) handle: JoinHandle<()>,
}

impl ProgressThread {
    pub(super) fn start(shared: Arc<Shared>, config: ProgressThreadConfig) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name(format!("kvx-ucx-progress-{}", shared.name))
            .spawn(move || progress_loop(&shared, &thread_stop, config))
            .map_err(|e| error(ErrorKind::Backend, format!("spawning the UCX progress thread: {e}")))?;
        Ok(ProgressThread { stop, handle })
    }

    pub(super) fn stop(self) {
        self.stop.store(true, Ordering::Release);
        self.handle.thread().unpark();
        if self.handle.join().is_err() {
            tracing::error!("the UCX progress thread panicked");
        }
    }
}

/// Progresses the worker while it has work; yields, then sleeps at most `idle_sleep`, when idle.
/// Every round re-checks `stop`, so stopping takes at most one sleep.
pub(super) fn progress_loop(shared: &Shared, stop: &AtomicBool, config: ProgressThreadConfig) {
    let mut idle_rounds = 0u32;
    while !stop.load(Ordering::Acquire) {
        let events = match shared.lock() {
            Ok(mut inner) => inner.progress_all(),
            Err(_) => return,
        };
        if events > 0 {
            idle_rounds = 0;
        } else if idle_rounds < config.idle_spins {
            idle_rounds += 1;
            std::thread::yield_now();
        } else {
            std::thread::park_timeout(config.idle_sleep);
        }
    }
}
