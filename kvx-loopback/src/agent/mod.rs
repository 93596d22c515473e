//! [`LoopbackAgent`]: a [`TransferAgent`] whose transport is a memcpy between agents of one
//! [`Fabric`](crate::Fabric).
//!
//! Locking: an agent's `state`, its `inbox` and the fabric's table are separate mutexes. A thread
//! holds at most one agent's `state` at a time (a progress pass releases its own before taking a
//! peer's), and takes an inbox lock only briefly,
//! never while holding a peer's lock: no lock-order cycle, so no deadlock, also with two agents
//! transferring to each other from two threads.
//!
//! [`TransferAgent`]: kvx_core::TransferAgent

use std::fmt;
use std::sync::Arc;

use kvx_core::{Capabilities, Error, ErrorKind, Result};

use crate::BACKEND;

mod progress;
mod shared;
mod transfer;

use progress::ProgressThread;
pub(crate) use shared::AgentShared;
use shared::AgentState;

const CAPABILITIES: Capabilities =
    Capabilities { backend: BACKEND, dram: true, vram: false, read: true, write: true, notifications: true };

/// How an agent is progressed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentOptions {
    progress_thread: bool,
}

impl AgentOptions {
    /// Explicit progress (the default): transfers move only inside `progress`,
    /// `drain_completions` and `drain_notifications`, one pass per call (`poll` is a lookup).
    /// Deterministic.
    pub fn explicit() -> Self {
        AgentOptions { progress_thread: false }
    }

    /// A background thread performs the transfers: it runs a pass as soon as a transfer is
    /// posted. `progress`, `drain_completions` and `drain_notifications` then only wake it. The
    /// thread is stopped and joined when the agent is dropped.
    pub fn progress_thread() -> Self {
        AgentOptions { progress_thread: true }
    }
}

/// An in-process [`TransferAgent`] over real host memory: READ and WRITE copy the bytes between
/// the registered memory of two agents of one [`Fabric`](crate::Fabric).
///
/// Create it with [`Fabric::agent`](crate::Fabric::agent). See the crate documentation for the
/// progress model.
///
/// [`TransferAgent`]: kvx_core::TransferAgent
pub struct LoopbackAgent {
    // Dropped first: the progress thread is stopped and joined before the agent goes away.
    thread: Option<ProgressThread>,
    shared: Arc<AgentShared>,
}

fn err(kind: ErrorKind, msg: impl Into<String>) -> Error {
    Error::new(kind, msg).with_backend(BACKEND)
}

impl LoopbackAgent {
    pub(crate) fn start(shared: Arc<AgentShared>, options: AgentOptions) -> Result<Self> {
        let thread =
            if options.progress_thread { Some(ProgressThread::spawn(shared.clone())?) } else { None };
        Ok(LoopbackAgent { thread, shared })
    }

    /// Whether a background thread progresses this agent.
    pub fn has_progress_thread(&self) -> bool {
        self.thread.is_some()
    }

    /// Drives transfers: one pass now, or a wake-up of the progress thread.
    fn drive(&self) -> Result<()> {
        match &self.thread {
            Some(t) => t.wake(),
            None => self.shared.pass(),
        }
    }

    fn next_id(st: &mut AgentState) -> u64 {
        // One id space for registrations, lists and transfers; 2^64 ids do not run out.
        st.next_id = st.next_id.wrapping_add(1);
        st.next_id
    }
}

impl fmt::Debug for LoopbackAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackAgent")
            .field("name", &self.shared.name)
            .field("instance", &self.shared.instance)
            .field("progress_thread", &self.thread.is_some())
            .finish()
    }
}
