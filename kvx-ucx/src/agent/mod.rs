//! [`UcxAgent`]: a [`TransferAgent`] over one UCP context and worker.
//!
//! # Threading
//! The worker is created with `UCS_THREAD_MODE_SERIALIZED`: UCX may be called from any thread, one
//! at a time. All worker state (the worker, endpoints, rkeys, requests, descriptor lists) lives in
//! one [`Inner`] behind a `Mutex`, so every UCX worker call is made with that lock held. This is
//! cheaper than `UCS_THREAD_MODE_MULTI` (which takes UCX's own lock on every call *and* still leaves
//! our tables to protect) and keeps one obvious rule. The optional progress thread takes the same
//! lock for each progress round.
//!
//! # Teardown order
//! Progress thread stopped and joined; outstanding requests drained (bounded) and freed; rkeys
//! destroyed; endpoints closed (bounded); worker destroyed; memory unmapped (UCX-allocated pools
//! last, when their last `Arc` goes); context cleaned up when its last `Arc` goes.
//!
//! [`TransferAgent`]: kvx_core::TransferAgent

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvx_core::wire::agent_metadata;
use kvx_core::{AgentName, ErrorKind, Result};

use crate::context::{Context, ReadPath, UcxConfig};
use crate::memory::{PoolMapping, UcxMemory};
use crate::status::{BACKEND, error};

/// Defines an `unsafe extern "C"` active-message handler (`ucp_am_recv_callback_t`) whose `arg` is
/// the boxed `$target` registered with it and whose body is `$handle`, a
/// `FnOnce(&$target, inbox::Message) -> ucs_status_t` run by [`inbox::on_message`].
macro_rules! am_handler {
    ($(#[$doc:meta])* $vis:vis fn $name:ident(&$target:ty) $handle:expr) => {
        $(#[$doc])*
        $vis unsafe extern "C" fn $name(
            arg: *mut ::std::ffi::c_void,
            header: *const ::std::ffi::c_void,
            header_length: usize,
            data: *mut ::std::ffi::c_void,
            length: usize,
            param: *const ::kvx_ucx_sys::ucp_am_recv_param_t,
        ) -> ::kvx_ucx_sys::ucs_status_t {
            // SAFETY: UCX calls the handler as registered: `arg` is the live boxed target, the
            // buffers and parameters are valid for the call.
            unsafe {
                super::inbox::on_message::<$target>(arg, (header, header_length), (data, length), param, $handle)
            }
        }
    };
}

mod am_read;
mod inbox;
mod progress;
mod request;
mod state;
mod transfer;
mod xfer;

use progress::ProgressThread;
use state::Inner;

/// Active-message id of kvx notifications.
const AM_NOTIFY: u32 = 0x6b76;
/// `ucp_worker_progress` calls per progress round, at most (stops early when idle).
const PROGRESS_BURST: usize = 64;
/// How long teardown waits for outstanding requests and endpoint closes.
const TEARDOWN_BOUND: Duration = Duration::from_secs(2);

/// A [`TransferAgent`] over UCX's UCP API: one-sided `ucp_get_nbx`/`ucp_put_nbx` of scattered
/// blocks, notifications as active messages.
///
/// See the crate documentation for an example, and [`ProgressThreadConfig`] for when a target
/// needs progress.
///
/// [`TransferAgent`]: kvx_core::TransferAgent
/// [`ProgressThreadConfig`]: crate::ProgressThreadConfig
pub struct UcxAgent {
    shared: Arc<Shared>,
    progress_thread: Option<ProgressThread>,
}

struct Shared {
    name: AgentName,
    inner: Mutex<Inner>,
}

impl UcxAgent {
    /// Creates an agent with UCX's defaults (environment `UCX_*` variables apply).
    pub fn new(name: impl Into<AgentName>) -> Result<Self> {
        Self::with_config(name, &UcxConfig::default())
    }

    /// Creates an agent: a UCP context and worker, an active-message handler for notifications
    /// and, if configured, a progress thread. A name that agent metadata cannot carry
    /// (`agent_metadata::check_agent_name`) is an `InvalidArgument` error.
    pub fn with_config(name: impl Into<AgentName>, config: &UcxConfig) -> Result<Self> {
        let name = name.into();
        agent_metadata::check_agent_name(&name).map_err(|e| e.with_backend(BACKEND))?;
        let context = Arc::new(Context::new(config, name.as_str())?);
        let inner = Inner::new(name.clone(), context, config.peer_failure_detection(), config.read_path())?;
        let shared = Arc::new(Shared { name, inner: Mutex::new(inner) });
        let progress_thread = match config.progress_thread() {
            Some(cfg) => Some(ProgressThread::start(Arc::clone(&shared), *cfg)?),
            None => None,
        };
        Ok(UcxAgent { shared, progress_thread })
    }

    /// Allocates `len` bytes of zeroed host memory through UCX (`UCP_MEM_MAP_ALLOCATE`), to be
    /// [registered][`TransferAgent::register`] with this agent: peers on this machine then read and
    /// write it truly one-sidedly over shared memory, without this agent progressing.
    ///
    /// [`TransferAgent::register`]: kvx_core::TransferAgent::register
    pub fn alloc_memory(&self, len: usize) -> Result<Arc<UcxMemory>> {
        let mut inner = self.shared.lock()?;
        let mapping = Arc::new(PoolMapping::allocate(Arc::clone(&inner.context), len)?);
        inner.pools.retain(|w| w.strong_count() > 0);
        inner.pools.push(Arc::downgrade(&mapping));
        Ok(Arc::new(UcxMemory::new(mapping)))
    }

    /// Whether a progress thread runs for this agent.
    pub fn has_progress_thread(&self) -> bool {
        self.progress_thread.is_some()
    }

    /// Endpoints that UCX reported failed (a dead or restarted peer, a reset connection, a
    /// keepalive timeout); counted only with
    /// [`UcxConfig::with_peer_failure_detection`](crate::UcxConfig::with_peer_failure_detection).
    pub fn failed_endpoints(&self) -> u64 {
        match self.shared.lock() {
            Ok(inner) => inner.inbox.failures.load(Ordering::Relaxed),
            Err(_) => 0,
        }
    }

    /// How READs from `agent`'s memory go ([`ReadPath::Get`] or [`ReadPath::ActiveMessages`]),
    /// as chosen when it was loaded; `NotFound` when it is not loaded.
    pub fn read_path(&self, agent: &AgentName) -> Result<ReadPath> {
        let inner = self.shared.lock()?;
        let peer = inner.peer_ids.get(agent).and_then(|key| inner.peers.get(key));
        let peer = peer.ok_or_else(|| error(ErrorKind::NotFound, format!("agent {agent} is not loaded")))?;
        Ok(if peer.am_reads { ReadPath::ActiveMessages } else { ReadPath::Get })
    }

    /// READ messages dropped because they were malformed or answered no READ in flight: requests
    /// this agent was sent and answers it received (a peer bug or a forgery), counted rather
    /// than failing anything. Ranges a target refused because they were not in its registered
    /// memory are counted there too; the READ that asked for them fails.
    pub fn refused_read_messages(&self) -> u64 {
        match self.shared.lock() {
            Ok(inner) => {
                inner.reads.refused.load(Ordering::Relaxed) + inner.serve.refused.load(Ordering::Relaxed)
            }
            Err(_) => 0,
        }
    }

    /// Notifications dropped because they were malformed (not a UTF-8 sender name, too large, or
    /// sent by rendezvous): a peer bug, counted rather than failing the receiver.
    pub fn rejected_notifications(&self) -> u64 {
        match self.shared.lock() {
            Ok(inner) => inner.inbox.rejected.load(Ordering::Relaxed),
            Err(_) => 0,
        }
    }
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        self.inner.lock().map_err(|_| error(ErrorKind::State, "UCX agent state poisoned by an earlier panic"))
    }
}

impl fmt::Debug for UcxAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UcxAgent")
            .field("name", &self.shared.name)
            .field("progress_thread", &self.progress_thread.is_some())
            .finish_non_exhaustive()
    }
}

impl Drop for UcxAgent {
    fn drop(&mut self) {
        // The thread holds a clone of `shared`: stop it first, so that Inner's teardown (when the
        // last Arc goes, just below) runs on this thread with nobody else touching the worker.
        if let Some(thread) = self.progress_thread.take() {
            thread.stop();
        }
    }
}
