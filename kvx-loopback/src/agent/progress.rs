//! The optional background progress thread of an agent.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvx_core::{ErrorKind, Result};

use crate::lock;

use super::err;
use super::shared::AgentShared;

/// The optional background progress thread of one agent.
#[derive(Debug)]
pub(super) struct ProgressThread {
    pub(super) wake: Arc<Wake>,
    pub(super) handle: Option<JoinHandle<()>>,
}

#[derive(Debug, Default)]
pub(super) struct Wake {
    pub(super) flags: Mutex<WakeFlags>,
    pub(super) cv: Condvar,
}

#[derive(Debug, Default)]
pub(super) struct WakeFlags {
    pub(super) stop: bool,
    pub(super) kicked: bool,
}

/// How long an idle progress thread sleeps between checks when nothing wakes it.
pub(super) const IDLE_WAIT: Duration = Duration::from_millis(100);

impl ProgressThread {
    pub(super) fn spawn(shared: Arc<AgentShared>) -> Result<Self> {
        let wake = Arc::new(Wake::default());
        let thread_wake = wake.clone();
        let handle = std::thread::Builder::new()
            .name(format!("kvx-loopback-{}", shared.name))
            .spawn(move || progress_loop(&shared, &thread_wake))
            .map_err(|e| err(ErrorKind::Io, format!("spawning the progress thread: {e}")).with_source(e))?;
        Ok(ProgressThread { wake, handle: Some(handle) })
    }

    pub(super) fn wake(&self) -> Result<()> {
        lock(&self.wake.flags, "progress thread flags")?.kicked = true;
        self.wake.cv.notify_one();
        Ok(())
    }
}

pub(super) fn progress_loop(shared: &AgentShared, wake: &Wake) {
    loop {
        {
            let Ok(mut flags) = wake.flags.lock() else { return };
            if !flags.stop && !flags.kicked {
                flags = match wake.cv.wait_timeout(flags, IDLE_WAIT) {
                    Ok((flags, _)) => flags,
                    Err(_) => return,
                };
            }
            if flags.stop {
                return;
            }
            flags.kicked = false;
        }
        match shared.pass() {
            Ok(()) => {}
            Err(e) => {
                // Only a poisoned lock fails a pass, and it stays poisoned: stop rather than spin.
                tracing::error!(agent = %shared.name, error = %e, "loopback progress thread stops");
                return;
            }
        }
    }
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        let mut flags = self.wake.flags.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        flags.stop = true;
        drop(flags);
        self.wake.cv.notify_one();
        if let Some(handle) = self.handle.take() {
            // The thread never panics by design; if it did, there is nothing left to clean up.
            let _ = handle.join();
        }
    }
}
