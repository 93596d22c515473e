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

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvx_core::post::{DlistView, check_notification};
use kvx_core::wire::agent_metadata::{self, MAX_AGENT_NAME};
use kvx_core::{
    AgentName, BlockList, Capabilities, DlistId, DlistOwner, Error, ErrorKind, KvMemory,
    MAX_NOTIFICATION_LEN, MemKind, MemRegion, Notification, PostPlan, PostRequest, RegistrationId, Result,
    TransferAgent, XferId, XferOp, XferState,
};
use kvx_ucx_sys as sys;

use crate::context::{Context, ProgressThreadConfig, UcxConfig};
use crate::memory::{PoolMapping, UcxMemory};
use crate::status::{BACKEND, check, check_as, error, ucx_error};
use crate::wire::{AgentMetadata, RegionMetadata};

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
        let inner = Inner::new(name.clone(), context, config.peer_failure_detection())?;
        let shared = Arc::new(Shared { name, inner: Mutex::new(inner) });
        let progress_thread = match config.progress_thread() {
            Some(cfg) => Some(ProgressThread::start(Arc::clone(&shared), *cfg)?),
            None => None,
        };
        Ok(UcxAgent { shared, progress_thread })
    }

    /// Allocates `len` bytes of zeroed host memory through UCX (`UCP_MEM_MAP_ALLOCATE`), to be
    /// [registered](TransferAgent::register) with this agent: peers on this machine then read and
    /// write it truly one-sidedly over shared memory, without this agent progressing.
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

// ---------------------------------------------------------------------------------------------
// Progress thread

struct ProgressThread {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<()>,
}

impl ProgressThread {
    fn start(shared: Arc<Shared>, config: ProgressThreadConfig) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name(format!("kvx-ucx-progress-{}", shared.name))
            .spawn(move || progress_loop(&shared, &thread_stop, config))
            .map_err(|e| error(ErrorKind::Backend, format!("spawning the UCX progress thread: {e}")))?;
        Ok(ProgressThread { stop, handle })
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Release);
        self.handle.thread().unpark();
        if self.handle.join().is_err() {
            tracing::error!("the UCX progress thread panicked");
        }
    }
}

/// Progresses the worker while it has work; yields, then sleeps at most `idle_sleep`, when idle.
/// Every round re-checks `stop`, so stopping takes at most one sleep.
fn progress_loop(shared: &Shared, stop: &AtomicBool, config: ProgressThreadConfig) {
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

// ---------------------------------------------------------------------------------------------
// Notification inbox (filled by the active-message callback)

struct Inbox {
    queue: Mutex<Vec<Notification>>,
    rejected: AtomicU64,
    /// Endpoints UCX reported failed (peer gone, connection reset, keepalive timeout), with the
    /// status: filled by [`on_endpoint_error`] during progress, settled by `Inner::progress_all`.
    failed_eps: Mutex<Vec<(usize, sys::ucs_status_t)>>,
    /// Endpoints UCX reported failed, ever.
    failures: AtomicU64,
}

impl Inbox {
    fn new() -> Box<Self> {
        Box::new(Inbox {
            queue: Mutex::new(Vec::new()),
            rejected: AtomicU64::new(0),
            failed_eps: Mutex::default(),
            failures: AtomicU64::new(0),
        })
    }

    fn reject(&self, why: &str) -> sys::ucs_status_t {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("dropping a malformed UCX notification: {why}");
        sys::UCS_OK
    }

    fn accept(&self, header: &[u8], data: &[u8]) -> sys::ucs_status_t {
        if header.is_empty() || header.len() > MAX_AGENT_NAME {
            return self.reject("bad sender name length");
        }
        let Ok(from) = std::str::from_utf8(header) else {
            return self.reject("sender name is not UTF-8");
        };
        if data.len() > MAX_NOTIFICATION_LEN {
            return self.reject("payload too large");
        }
        let note = Notification { from: AgentName::new(from), msg: data.to_vec() };
        self.queue.lock().unwrap_or_else(PoisonError::into_inner).push(note);
        sys::UCS_OK
    }
}

/// The active-message handler of [`AM_NOTIFY`]: header = sender's name, data = payload.
unsafe extern "C" fn on_notification(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // A panic must not unwind into C: catch it, drop the message.
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `arg` is the Box<Inbox> registered with this handler; it is freed only after the
        // worker (the only caller) is destroyed.
        let inbox = unsafe { &*arg.cast::<Inbox>() };
        // SAFETY: UCX passes a valid parameter struct for the duration of the call.
        let recv_attr = unsafe { param.as_ref() }.map_or(0, |p| p.recv_attr);
        if recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 {
            // kvx senders always use eager; a rendezvous message is not ours. The sender's
            // request completes with this status.
            inbox.reject("rendezvous message");
            return sys::UCS_ERR_UNSUPPORTED;
        }
        let header = if header_length == 0 || header.is_null() {
            &[][..]
        } else {
            // SAFETY: UCX guarantees `header_length` readable bytes at `header` during the call.
            unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }
        };
        let data = if length == 0 || data.is_null() {
            &[][..]
        } else {
            // SAFETY: not rendezvous, so `data` holds `length` readable bytes during the call.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }
        };
        inbox.accept(header, data)
    }));
    result.unwrap_or(sys::UCS_OK)
}

/// The endpoints' error handler (`UCP_ERR_HANDLING_MODE_PEER`): UCX calls it from
/// `ucp_worker_progress` when a peer fails; the endpoint is unusable from then on and its
/// outstanding requests complete with the error.
unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `arg` is the Box<Inbox> of the endpoint's worker; it is freed only after the
        // worker (whose progress is the only caller) is destroyed.
        let inbox = unsafe { &*arg.cast::<Inbox>() };
        inbox.failures.fetch_add(1, Ordering::Relaxed);
        inbox.failed_eps.lock().unwrap_or_else(PoisonError::into_inner).push((ep as usize, status));
    }));
}

// ---------------------------------------------------------------------------------------------
// Requests

/// An outstanding UCX request, freed on drop (UCX releases a still-running one when it
/// completes). Dropped only while the worker is alive.
struct Request(NonNull<c_void>);

impl Request {
    /// Interprets the status pointer of a `*_nbx` call: `None` when it completed at once.
    fn from_status_ptr(ptr: sys::ucs_status_ptr_t, kind: ErrorKind, what: &str) -> Result<Option<Self>> {
        if sys::UCS_PTR_IS_ERR(ptr) {
            return Err(ucx_error(kind, what, sys::UCS_PTR_RAW_STATUS(ptr)));
        }
        Ok(NonNull::new(ptr).map(Request))
    }

    fn status(&self) -> sys::ucs_status_t {
        // SAFETY: the request is live (freed only in drop).
        unsafe { sys::ucp_request_check_status(self.0.as_ptr()) }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: the request came from a *_nbx call of a live worker and is freed once.
        unsafe { sys::ucp_request_free(self.0.as_ptr()) };
    }
}

/// Removes finished requests; returns the first failure, of kind `Transfer` with UCX's status.
fn reap(requests: &mut Vec<Request>) -> Option<Error> {
    let mut failure = None;
    requests.retain(|r| match r.status() {
        sys::UCS_INPROGRESS => true,
        sys::UCS_OK => false,
        status => {
            failure
                .get_or_insert_with(|| ucx_error(ErrorKind::Transfer, "a request of the transfer", status));
            false
        }
    });
    failure
}

/// A notification on its way out: UCX reads the buffers until the request completes.
struct PendingSend {
    request: Option<Request>,
    _header: Box<[u8]>,
    _payload: Box<[u8]>,
}

impl PendingSend {
    fn post(ep: NonNull<sys::ucp_ep>, from: &AgentName, msg: &[u8]) -> Result<Self> {
        let header: Box<[u8]> = from.as_str().as_bytes().into();
        let payload: Box<[u8]> = msg.into();
        // SAFETY: all-zero is "no fields set" for this plain C struct.
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = sys::UCP_AM_SEND_FLAG_EAGER;
        // SAFETY: the endpoint is live; header and payload are heap buffers owned by the returned
        // PendingSend, which lives until the request completes (or the worker is destroyed).
        let status_ptr = unsafe {
            sys::ucp_am_send_nbx(
                ep.as_ptr(),
                AM_NOTIFY,
                header.as_ptr().cast(),
                header.len(),
                payload.as_ptr().cast(),
                payload.len(),
                &param,
            )
        };
        let request = Request::from_status_ptr(status_ptr, ErrorKind::Transfer, "ucp_am_send_nbx")?;
        Ok(PendingSend { request, _header: header, _payload: payload })
    }

    /// `None` while in flight, then the outcome.
    fn outcome(&self) -> Option<Result<()>> {
        let Some(request) = &self.request else { return Some(Ok(())) };
        match request.status() {
            sys::UCS_INPROGRESS => None,
            sys::UCS_OK => Some(Ok(())),
            s => Some(Err(ucx_error(ErrorKind::Transfer, "sending a notification", s))),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Agent state

/// All worker state; only touched with [`Shared::inner`] locked.
struct Inner {
    name: AgentName,
    context: Arc<Context>,
    worker: NonNull<sys::ucp_worker>,
    address: Vec<u8>,
    inbox: Box<Inbox>,
    /// Endpoints are created with `UCP_ERR_HANDLING_MODE_PEER` (see `UcxConfig`).
    peer_failure: bool,
    regs: HashMap<u64, LocalReg>,
    peers: HashMap<u64, Peer>,
    peer_ids: HashMap<AgentName, u64>,
    dlists: HashMap<u64, Dlist>,
    xfers: HashMap<u64, Xfer>,
    /// The posted transfers not yet `Done` or `Failed`: what a progress pass advances.
    pending: HashSet<u64>,
    /// The posted transfers that became `Done` or `Failed` and that `drain_completions` has not
    /// reported yet. A released one is skipped when they are drained.
    completed: Vec<u64>,
    /// Transfers released while still running: progressed until UCX is done with them.
    orphans: Vec<Xfer>,
    sends: Vec<PendingSend>,
    closing: Vec<Request>,
    pools: Vec<Weak<PoolMapping>>,
    next_id: u64,
}

// SAFETY: the worker is created with UCS_THREAD_MODE_SERIALIZED, so UCX allows calls on it (and on
// its endpoints, rkeys and requests) from any thread as long as they never overlap; Inner is only
// reachable through a Mutex, which guarantees that.
unsafe impl Send for Inner {}

struct LocalReg {
    memory: Arc<dyn KvMemory>,
    region: MemRegion,
    memh: LocalMemh,
    rkey: Vec<u8>,
    /// Posted transfers that use this registration.
    inflight: usize,
    /// Deregistered; unmapped once `inflight` drops to zero.
    retired: bool,
}

enum LocalMemh {
    /// Our `ucp_mem_map` of the caller's memory: unmapped with the registration.
    Mapped(NonNull<sys::ucp_mem>),
    /// A [`UcxMemory`] pool of this context: UCX's own mapping, reused.
    Pool(Arc<PoolMapping>),
}

impl LocalMemh {
    fn raw(&self) -> sys::ucp_mem_h {
        match self {
            LocalMemh::Mapped(m) => m.as_ptr(),
            LocalMemh::Pool(p) => p.memh(),
        }
    }
}

struct Peer {
    name: AgentName,
    ep: NonNull<sys::ucp_ep>,
    regions: Vec<RemoteRegion>,
    inflight: usize,
    forgotten: bool,
    /// Why UCX reported the endpoint failed: nothing more is posted on it, and it is closed
    /// without a flush.
    failed: Option<Error>,
}

struct RemoteRegion {
    region: MemRegion,
    rkey: NonNull<sys::ucp_rkey>,
}

impl Drop for RemoteRegion {
    fn drop(&mut self) {
        // SAFETY: the rkey was unpacked on a live endpoint of our live worker (peers are destroyed
        // before the worker) and is destroyed once.
        unsafe { sys::ucp_rkey_destroy(self.rkey.as_ptr()) };
    }
}

struct Dlist {
    owner: DlistOwner,
    blocks: BlockList,
    target: DlistTarget,
}

impl Dlist {
    fn view(&self) -> DlistView<'_> {
        DlistView { owner: &self.owner, blocks: &self.blocks }
    }
}

enum DlistTarget {
    /// The registration holding each region of the list.
    Local(Vec<u64>),
    /// The peer, and the index of its remote region holding each region of the list.
    Remote { peer: u64, regions: Vec<usize> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    /// Gets or puts in flight.
    Data,
    /// The endpoint flush after puts in flight (a WRITE is complete only when remotely visible).
    Flush,
    /// The notification in flight.
    Notify,
    Done,
    Failed(Error),
}

struct Xfer {
    op: XferOp,
    peer: u64,
    regs: Vec<u64>,
    requests: Vec<Request>,
    notify: Option<Vec<u8>>,
    send: Option<PendingSend>,
    stage: Stage,
    failure: Option<Error>,
    holds_refs: bool,
}

impl Inner {
    fn new(name: AgentName, context: Arc<Context>, peer_failure: bool) -> Result<Self> {
        // SAFETY: all-zero is "no fields set" for this plain C struct.
        let mut params: sys::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE);
        params.thread_mode = sys::UCS_THREAD_MODE_SERIALIZED;
        let mut raw: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: the context is live; params valid; out-pointer valid.
        check(unsafe { sys::ucp_worker_create(context.raw(), &params, &mut raw) }, "ucp_worker_create")?;
        let worker =
            NonNull::new(raw).ok_or_else(|| error(ErrorKind::Backend, "ucp_worker_create returned null"))?;
        // From here `inner` owns the worker: an error below destroys it in Drop.
        let mut inner = Inner {
            name,
            context,
            worker,
            address: Vec::new(),
            inbox: Inbox::new(),
            peer_failure,
            regs: HashMap::new(),
            peers: HashMap::new(),
            peer_ids: HashMap::new(),
            dlists: HashMap::new(),
            xfers: HashMap::new(),
            pending: HashSet::new(),
            completed: Vec::new(),
            orphans: Vec::new(),
            sends: Vec::new(),
            closing: Vec::new(),
            pools: Vec::new(),
            next_id: 1,
        };

        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut addr_len = 0usize;
        // SAFETY: live worker; out-pointers valid.
        let status = unsafe { sys::ucp_worker_get_address(worker.as_ptr(), &mut addr, &mut addr_len) };
        check(status, "ucp_worker_get_address")?;
        // SAFETY: UCX returned `addr_len` readable bytes at `addr`; copied, then released once.
        inner.address = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), addr_len) }.to_vec();
        // SAFETY: the address came from this worker and is released once.
        unsafe { sys::ucp_worker_release_address(worker.as_ptr(), addr) };

        // SAFETY: all-zero is "no fields set" for this plain C struct.
        let mut am: sys::ucp_am_handler_param_t = unsafe { std::mem::zeroed() };
        am.field_mask = u64::from(
            sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG
                | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        );
        am.id = AM_NOTIFY;
        am.flags = sys::UCP_AM_FLAG_WHOLE_MSG;
        am.cb = Some(on_notification);
        am.arg = ptr::from_ref::<Inbox>(&inner.inbox).cast_mut().cast();
        // SAFETY: live worker; the callback's argument (the boxed inbox, which never moves) lives
        // until after the worker is destroyed (Inner::drop destroys the worker before fields drop).
        let status = unsafe { sys::ucp_worker_set_am_recv_handler(worker.as_ptr(), &am) };
        check(status, "ucp_worker_set_am_recv_handler")?;
        Ok(inner)
    }

    fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Progresses the worker until idle (bounded); returns the number of events.
    fn progress_worker(&mut self) -> u32 {
        let mut total = 0u32;
        for _ in 0..PROGRESS_BURST {
            // SAFETY: live worker, accessed under the lock (serialized mode).
            let n = unsafe { sys::ucp_worker_progress(self.worker.as_ptr()) };
            if n == 0 {
                break;
            }
            total = total.saturating_add(n);
        }
        total
    }

    /// Progresses the worker and settles background work (released transfers, standalone
    /// notifications, endpoint closes). Returns the number of worker events.
    fn progress_all(&mut self) -> u32 {
        let events = self.progress_worker();
        self.settle_failed_endpoints();
        // Posted transfers move on too (their flushes and notifications go out) even when the
        // owner only calls progress(). One pass over those not yet final.
        if !self.pending.is_empty() {
            let mut xfers = std::mem::take(&mut self.xfers);
            let mut pending = std::mem::take(&mut self.pending);
            pending.retain(|&id| {
                let Some(xfer) = xfers.get_mut(&id) else { return false };
                self.advance(xfer);
                if xfer.is_terminal() {
                    self.completed.push(id);
                }
                !xfer.is_terminal()
            });
            self.xfers = xfers;
            self.pending = pending;
            // A caller that releases without draining leaves released ids behind: drop them once
            // they outnumber the live transfers (amortised constant time per transfer).
            if self.completed.len() > 2 * self.xfers.len() + 64 {
                let xfers = &self.xfers;
                self.completed.retain(|id| xfers.contains_key(id));
            }
        }
        if !self.orphans.is_empty() {
            let mut orphans = std::mem::take(&mut self.orphans);
            for xfer in &mut orphans {
                self.advance(xfer);
            }
            orphans.retain(|x| !x.is_terminal());
            self.orphans.append(&mut orphans);
        }
        self.sends.retain(|s| match s.outcome() {
            None => true,
            Some(Ok(())) => false,
            Some(Err(e)) => {
                tracing::warn!("UCX notification failed: {e}");
                false
            }
        });
        if !self.closing.is_empty() {
            let _ = reap(&mut self.closing);
        }
        events
    }

    /// Marks the peers whose endpoints UCX reported failed: later posts and notifications to them
    /// fail at once (their running requests complete with the error on their own).
    fn settle_failed_endpoints(&mut self) {
        let failed =
            std::mem::take(&mut *self.inbox.failed_eps.lock().unwrap_or_else(PoisonError::into_inner));
        for (ep, status) in failed {
            if let Some(peer) = self.peers.values_mut().find(|p| p.ep.as_ptr() as usize == ep) {
                let why = ucx_error(ErrorKind::Transfer, &format!("agent {} is gone", peer.name), status);
                tracing::warn!("UCX endpoint failed: {why}");
                peer.failed.get_or_insert(why);
            }
        }
    }

    /// Moves a transfer through its stages as far as UCX allows.
    fn advance(&mut self, xfer: &mut Xfer) {
        loop {
            if let Some(failure) = reap(&mut xfer.requests) {
                xfer.failure.get_or_insert(failure);
            }
            if !xfer.requests.is_empty() {
                return;
            }
            let next = match (&xfer.stage, &xfer.failure) {
                (Stage::Done | Stage::Failed(_), _) => break,
                (Stage::Data | Stage::Flush | Stage::Notify, Some(failure)) => Stage::Failed(failure.clone()),
                (Stage::Data, None) => {
                    if xfer.op == XferOp::Write {
                        self.post_flush(xfer);
                    }
                    Stage::Flush
                }
                (Stage::Flush, None) => {
                    if let Some(msg) = xfer.notify.take() {
                        self.post_notification(xfer, &msg);
                    }
                    Stage::Notify
                }
                (Stage::Notify, None) => match xfer.send.as_ref().and_then(PendingSend::outcome) {
                    _ if xfer.send.is_none() => Stage::Done,
                    None => return,
                    Some(Ok(())) => {
                        xfer.send = None;
                        Stage::Done
                    }
                    Some(Err(e)) => {
                        xfer.send = None;
                        Stage::Failed(e)
                    }
                },
            };
            xfer.stage = next;
        }
        self.drop_refs(xfer);
    }

    fn post_flush(&mut self, xfer: &mut Xfer) {
        let Some(peer) = self.peers.get(&xfer.peer) else {
            xfer.failure = Some(error(ErrorKind::Backend, "the transfer's peer vanished"));
            return;
        };
        // SAFETY: all-zero is "no fields set" for this plain C struct.
        let param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        // SAFETY: the endpoint is live (the transfer holds a reference on the peer).
        let status_ptr = unsafe { sys::ucp_ep_flush_nbx(peer.ep.as_ptr(), &param) };
        match Request::from_status_ptr(status_ptr, ErrorKind::Transfer, "ucp_ep_flush_nbx") {
            Ok(request) => xfer.requests.extend(request),
            Err(e) => xfer.failure = Some(e),
        }
    }

    fn post_notification(&mut self, xfer: &mut Xfer, msg: &[u8]) {
        let Some(peer) = self.peers.get(&xfer.peer) else {
            xfer.failure = Some(error(ErrorKind::Backend, "the transfer's peer vanished"));
            return;
        };
        match PendingSend::post(peer.ep, &self.name, msg) {
            Ok(send) => xfer.send = Some(send),
            Err(e) => xfer.failure = Some(e),
        }
    }

    /// Releases the transfer's hold on its peer and registrations (once, when it is terminal).
    fn drop_refs(&mut self, xfer: &mut Xfer) {
        if !xfer.holds_refs {
            return;
        }
        xfer.holds_refs = false;
        if let Some(peer) = self.peers.get_mut(&xfer.peer) {
            peer.inflight -= 1;
            if peer.forgotten && peer.inflight == 0 {
                self.destroy_peer(xfer.peer);
            }
        }
        for id in &xfer.regs {
            if let Some(reg) = self.regs.get_mut(id) {
                reg.inflight -= 1;
                if reg.retired && reg.inflight == 0 {
                    self.destroy_reg(*id);
                }
            }
        }
    }

    fn destroy_peer(&mut self, key: u64) {
        let Some(peer) = self.peers.remove(&key) else { return };
        if self.peer_ids.get(&peer.name) == Some(&key) {
            self.peer_ids.remove(&peer.name);
        }
        let Peer { ep, regions, failed, .. } = peer;
        drop(regions); // rkeys before their endpoint
        self.close_ep(ep, failed.is_some());
    }

    /// Closes an endpoint: flushed when healthy, forced when UCX reported it failed (a flush would
    /// only wait for the error).
    fn close_ep(&mut self, ep: NonNull<sys::ucp_ep>, force: bool) {
        // SAFETY: all-zero is "no fields set": close in flush mode.
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        if force {
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: the endpoint is live and closed once; its rkeys are destroyed.
        let status_ptr = unsafe { sys::ucp_ep_close_nbx(ep.as_ptr(), &param) };
        match Request::from_status_ptr(status_ptr, ErrorKind::Backend, "ucp_ep_close_nbx") {
            Ok(request) => self.closing.extend(request),
            Err(e) => tracing::warn!("closing a UCX endpoint: {e}"),
        }
    }

    fn destroy_reg(&mut self, id: u64) {
        let Some(reg) = self.regs.remove(&id) else { return };
        unmap_reg(&self.context, reg);
    }

    fn progress_for(&mut self, bound: Duration, mut done: impl FnMut(&mut Self) -> bool) -> bool {
        let deadline = Instant::now() + bound;
        loop {
            if done(self) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            self.progress_all();
        }
    }
}

fn unmap_reg(context: &Context, reg: LocalReg) {
    if let LocalMemh::Mapped(memh) = reg.memh {
        // SAFETY: our own mapping of live memory (`reg.memory` still holds it), unmapped once,
        // with no transfer using it.
        let status = unsafe { sys::ucp_mem_unmap(context.raw(), memh.as_ptr()) };
        if let Err(e) = check(status, "ucp_mem_unmap") {
            tracing::error!("deregistering {:?}: {e}", reg.region);
        }
    }
    drop(reg.memory); // only now may the memory go
}

impl Xfer {
    fn is_terminal(&self) -> bool {
        matches!(self.stage, Stage::Done | Stage::Failed(_))
    }

    fn state(&self) -> XferState {
        match &self.stage {
            Stage::Done => XferState::Done,
            Stage::Failed(e) => XferState::Failed(e.clone()),
            _ => XferState::Pending,
        }
    }
}

impl Inner {
    /// Forgets every UCX handle and everything UCX may still reference (see `Drop`).
    fn leak_all(&mut self) {
        std::mem::forget(std::mem::take(&mut self.closing));
        std::mem::forget(std::mem::take(&mut self.orphans));
        std::mem::forget(std::mem::take(&mut self.sends));
        std::mem::forget(std::mem::take(&mut self.peers));
        std::mem::forget(std::mem::take(&mut self.regs));
        let empty = Inbox::new();
        std::mem::forget(std::mem::replace(&mut self.inbox, empty));
        std::mem::forget(Arc::clone(&self.context));
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Give running transfers a bounded chance to finish (no new notifications are sent).
        let mut xfers: Vec<Xfer> = self.xfers.drain().map(|(_, x)| x).collect();
        for x in &mut xfers {
            x.notify = None;
        }
        self.orphans.append(&mut xfers);
        let drained = self.progress_for(TEARDOWN_BOUND, |s| s.orphans.is_empty() && s.sends.is_empty());
        let closed = drained && {
            // Endpoints, each after its rkeys; then a bounded wait for the closes.
            self.dlists.clear();
            let keys: Vec<u64> = self.peers.keys().copied().collect();
            for key in keys {
                self.destroy_peer(key);
            }
            self.progress_for(TEARDOWN_BOUND, |s| s.closing.is_empty())
        };
        if !closed {
            // A peer that never answers (dead, or never progressing) leaves transfers running and
            // connection-setup messages queued, and UCX 1.13 aborts the process when
            // ucp_worker_destroy purges those (assertion in ucp_request_send_state_ff). Leak
            // instead: the worker, the context, and everything UCX may still reference.
            tracing::error!(
                "UCX agent {}: peers did not answer within {TEARDOWN_BOUND:?}; leaking its UCX worker, \
                 context and registered memory rather than letting UCX abort the process",
                self.name
            );
            self.leak_all();
            return;
        }
        self.closing.clear();

        // SAFETY: every request, rkey and endpoint of the worker is gone; destroyed once. The AM
        // handler's argument (self.inbox) is freed only after this.
        unsafe { sys::ucp_worker_destroy(self.worker.as_ptr()) };

        // Deregister: unmap our mappings, then let the memory go.
        for (_, reg) in self.regs.drain() {
            unmap_reg(&self.context, reg);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// TransferAgent

impl TransferAgent for UcxAgent {
    fn name(&self) -> &AgentName {
        &self.shared.name
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            backend: BACKEND,
            dram: true,
            vram: false,
            read: true,
            write: true,
            notifications: true,
        }
    }

    fn register(&self, memory: Arc<dyn KvMemory>) -> Result<RegistrationId> {
        let region = memory.region();
        if region.kind != MemKind::Dram {
            return Err(error(ErrorKind::Unsupported, format!("cannot register {:?} memory", region.kind)));
        }
        let len = usize::try_from(region.len).ok().filter(|&l| l > 0);
        let (Some(len), Some(_)) = (len, region.end()) else {
            return Err(error(ErrorKind::InvalidArgument, format!("cannot register {region:?}")));
        };
        let mut inner = self.shared.lock()?;
        // A pool this agent allocated: reuse UCX's mapping (it is what makes reads one-sided). A live
        // pool with exactly this region is this very memory: live allocations cannot overlap.
        let pool = inner.pools.iter().filter_map(Weak::upgrade).find(|p| p.region() == region);
        let memh = match pool {
            Some(pool) if Arc::ptr_eq(pool.context(), &inner.context) => LocalMemh::Pool(pool),
            _ => {
                // SAFETY: all-zero is "no fields set" for this plain C struct.
                let mut params: sys::ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
                params.field_mask =
                    u64::from(sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH);
                params.address = region.addr as *mut c_void;
                params.length = len;
                let mut memh: sys::ucp_mem_h = ptr::null_mut();
                // SAFETY: KvMemory guarantees the region is allocated and stays so while `memory`
                // lives; the registration keeps it until after ucp_mem_unmap.
                let status = unsafe { sys::ucp_mem_map(inner.context.raw(), &params, &mut memh) };
                check(status, "ucp_mem_map")?;
                let memh = NonNull::new(memh)
                    .ok_or_else(|| error(ErrorKind::Backend, "ucp_mem_map returned null"))?;
                LocalMemh::Mapped(memh)
            }
        };
        let mut reg = LocalReg { memory, region, memh, rkey: Vec::new(), inflight: 0, retired: false };
        match pack_rkey(&inner.context, reg.memh.raw()) {
            Ok(rkey) => reg.rkey = rkey,
            Err(e) => {
                unmap_reg(&inner.context, reg);
                return Err(e);
            }
        }
        let id = inner.next_id();
        inner.regs.insert(id, reg);
        Ok(RegistrationId(id))
    }

    fn deregister(&self, registration: RegistrationId) -> Result<()> {
        let mut inner = self.shared.lock()?;
        let reg = match inner.regs.get_mut(&registration.0) {
            Some(reg) if !reg.retired => reg,
            _ => return Err(error(ErrorKind::NotFound, format!("{registration} is not registered"))),
        };
        reg.retired = true;
        if reg.inflight == 0 {
            inner.destroy_reg(registration.0);
        }
        // Transfers in flight keep the registration (see `drop_refs`); the lists over it go now.
        inner
            .dlists
            .retain(|_, d| !matches!(&d.target, DlistTarget::Local(regs) if regs.contains(&registration.0)));
        Ok(())
    }

    fn local_metadata(&self) -> Result<Vec<u8>> {
        let inner = self.shared.lock()?;
        let mut regs: Vec<(&u64, &LocalReg)> = inner.regs.iter().filter(|(_, r)| !r.retired).collect();
        regs.sort_by_key(|(id, _)| **id);
        let regions = regs
            .into_iter()
            .map(|(_, r)| RegionMetadata { addr: r.region.addr, len: r.region.len, rkey: r.rkey.clone() })
            .collect();
        agent_metadata::seal(
            BACKEND,
            &inner.name,
            &AgentMetadata { worker_address: inner.address.clone(), regions },
        )
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<AgentName> {
        let (name, meta) = AgentMetadata::open(metadata)?;
        let mut inner = self.shared.lock()?;
        if name == inner.name {
            return Err(error(
                ErrorKind::InvalidPeerData,
                format!("peer metadata carries our own name {name}"),
            ));
        }
        if inner.peer_ids.contains_key(&name) {
            return Err(error(ErrorKind::State, format!("agent {name} is already loaded")));
        }
        // SAFETY: all-zero is "no fields set" for this plain C struct.
        let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
        params.address = meta.worker_address.as_ptr().cast();
        if inner.peer_failure {
            params.field_mask |=
                u64::from(sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER);
            params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler.cb = Some(on_endpoint_error);
            params.err_handler.arg = ptr::from_ref::<Inbox>(&inner.inbox).cast_mut().cast();
        }
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: live worker; the address buffer outlives the call (UCX copies what it needs); the
        // error handler's argument (the boxed inbox) lives until after the worker is destroyed.
        let status = unsafe { sys::ucp_ep_create(inner.worker.as_ptr(), &params, &mut ep) };
        let kind = if status == sys::UCS_ERR_UNREACHABLE {
            ErrorKind::Handshake
        } else {
            ErrorKind::InvalidPeerData
        };
        check_as(kind, status, &format!("ucp_ep_create to {name}"))?;
        let ep = NonNull::new(ep).ok_or_else(|| error(ErrorKind::Backend, "ucp_ep_create returned null"))?;

        let mut regions = Vec::with_capacity(meta.regions.len());
        for (i, r) in meta.regions.iter().enumerate() {
            let mut rkey: sys::ucp_rkey_h = ptr::null_mut();
            // SAFETY: live endpoint; the packed buffer is valid for its whole length.
            let status = unsafe { sys::ucp_ep_rkey_unpack(ep.as_ptr(), r.rkey.as_ptr().cast(), &mut rkey) };
            let unpacked =
                check_as(ErrorKind::InvalidPeerData, status, &format!("ucp_ep_rkey_unpack of region {i}"))
                    .and_then(|()| NonNull::new(rkey).ok_or_else(|| error(ErrorKind::Backend, "null rkey")));
            match unpacked {
                Ok(rkey) => regions.push(RemoteRegion { region: MemRegion::dram(r.addr, r.len), rkey }),
                Err(e) => {
                    drop(regions);
                    inner.close_ep(ep, false);
                    return Err(e);
                }
            }
        }
        let key = inner.next_id();
        inner.peers.insert(
            key,
            Peer { name: name.clone(), ep, regions, inflight: 0, forgotten: false, failed: None },
        );
        inner.peer_ids.insert(name.clone(), key);
        Ok(name)
    }

    fn forget_remote(&self, agent: &AgentName) -> Result<()> {
        let mut inner = self.shared.lock()?;
        let key = inner
            .peer_ids
            .remove(agent)
            .ok_or_else(|| error(ErrorKind::NotFound, format!("agent {agent} is not loaded")))?;
        inner.dlists.retain(|_, d| !matches!(d.target, DlistTarget::Remote { peer, .. } if peer == key));
        if let Some(peer) = inner.peers.get_mut(&key) {
            peer.forgotten = true;
            if peer.inflight == 0 {
                inner.destroy_peer(key);
            }
        }
        Ok(())
    }

    fn prep_dlist(&self, owner: &DlistOwner, blocks: &BlockList) -> Result<DlistId> {
        let mut inner = self.shared.lock()?;
        let target = match owner {
            DlistOwner::Local => {
                let mut regs = Vec::with_capacity(blocks.bases.len());
                for (i, region) in blocks.regions().enumerate() {
                    let found = region.and_then(|region| {
                        inner
                            .regs
                            .iter()
                            .filter(|(_, r)| !r.retired && r.region.contains(&region))
                            .map(|(id, _)| *id)
                            .min()
                    });
                    let id = found.ok_or_else(|| {
                        error(
                            ErrorKind::InvalidArgument,
                            format!("region {i} of the list is not inside a registration"),
                        )
                    })?;
                    regs.push(id);
                }
                DlistTarget::Local(regs)
            }
            DlistOwner::Remote(agent) => {
                let key = *inner
                    .peer_ids
                    .get(agent)
                    .ok_or_else(|| error(ErrorKind::NotFound, format!("agent {agent} is not loaded")))?;
                let peer =
                    inner.peers.get(&key).ok_or_else(|| error(ErrorKind::NotFound, "peer vanished"))?;
                let mut regions = Vec::with_capacity(blocks.bases.len());
                for (i, region) in blocks.regions().enumerate() {
                    let found = region
                        .and_then(|region| peer.regions.iter().position(|r| r.region.contains(&region)));
                    let idx = found.ok_or_else(|| {
                        error(
                            ErrorKind::InvalidPeerData,
                            format!("region {i} of the list is not inside a registration of {agent}"),
                        )
                    })?;
                    regions.push(idx);
                }
                DlistTarget::Remote { peer: key, regions }
            }
        };
        let id = inner.next_id();
        inner.dlists.insert(id, Dlist { owner: owner.clone(), blocks: blocks.clone(), target });
        Ok(DlistId(id))
    }

    fn release_dlist(&self, dlist: DlistId) -> Result<()> {
        let mut inner = self.shared.lock()?;
        inner
            .dlists
            .remove(&dlist.0)
            .map(|_| ())
            .ok_or_else(|| error(ErrorKind::NotFound, format!("{dlist} unknown")))
    }

    fn post(
        &self,
        op: XferOp,
        local: DlistId,
        local_descs: &[u32],
        remote: DlistId,
        remote_descs: &[u32],
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        let mut guard = self.shared.lock()?;
        let inner = &mut *guard;
        let request = PostRequest { op, local, local_descs, remote, remote_descs, notify };
        let checked = request.check(&self.capabilities(), |id| inner.dlists.get(&id.0).map(Dlist::view))?;
        let ops = plan(inner, &checked, local, remote)?;

        let peer = inner
            .peers
            .get(&ops.peer)
            .ok_or_else(|| error(ErrorKind::Backend, "the list's peer vanished"))?;
        if let Some(why) = &peer.failed {
            return Err(why.clone());
        }
        let mut requests = Vec::new();
        let mut failure = None;
        for (laddr, memh, raddr, region) in &ops.descs {
            // SAFETY: all-zero is "no fields set" for this plain C struct.
            let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_MEMH;
            param.memh = *memh;
            let rkey = peer.regions[*region].rkey.as_ptr();
            let (status_ptr, what) = match op {
                // SAFETY: the local range lies in a live registration (checked by `plan`), the
                // remote range in the peer's region whose rkey this is; both stay alive until the
                // transfer settles (it holds references on the registrations and the peer).
                XferOp::Read => (
                    unsafe {
                        sys::ucp_get_nbx(
                            peer.ep.as_ptr(),
                            *laddr as *mut c_void,
                            ops.len,
                            *raddr,
                            rkey,
                            &param,
                        )
                    },
                    "ucp_get_nbx",
                ),
                // SAFETY: as for the read.
                XferOp::Write => (
                    unsafe {
                        sys::ucp_put_nbx(
                            peer.ep.as_ptr(),
                            *laddr as *const c_void,
                            ops.len,
                            *raddr,
                            rkey,
                            &param,
                        )
                    },
                    "ucp_put_nbx",
                ),
            };
            match Request::from_status_ptr(status_ptr, ErrorKind::Transfer, what) {
                Ok(request) => requests.extend(request),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }

        // The transfer holds its peer and registrations until UCX is done with it.
        if let Some(peer) = inner.peers.get_mut(&ops.peer) {
            peer.inflight += 1;
        }
        for id in &ops.regs {
            if let Some(reg) = inner.regs.get_mut(id) {
                reg.inflight += 1;
            }
        }
        let mut xfer = Xfer {
            op,
            peer: ops.peer,
            regs: ops.regs,
            requests,
            notify: notify.map(<[u8]>::to_vec),
            send: None,
            stage: Stage::Data,
            failure: None,
            holds_refs: true,
        };
        if let Some(e) = failure {
            // What was posted still runs: settle it in the background, without notification.
            xfer.notify = None;
            xfer.failure = Some(e.clone());
            inner.advance(&mut xfer);
            if !xfer.is_terminal() {
                inner.orphans.push(xfer);
            }
            return Err(e);
        }
        inner.advance(&mut xfer);
        let id = inner.next_id();
        if xfer.is_terminal() {
            inner.completed.push(id);
        } else {
            inner.pending.insert(id);
        }
        inner.xfers.insert(id, xfer);
        Ok(XferId(id))
    }

    /// Drives the worker and advances every transfer not yet final (as `progress`) unless this
    /// one is final already.
    fn poll(&self, xfer: XferId) -> Result<XferState> {
        let mut inner = self.shared.lock()?;
        let unknown = || error(ErrorKind::NotFound, format!("{xfer} unknown"));
        if !inner.xfers.get(&xfer.0).ok_or_else(unknown)?.is_terminal() {
            inner.progress_all();
        }
        Ok(inner.xfers.get(&xfer.0).ok_or_else(unknown)?.state())
    }

    /// Drives the worker once and advances the transfers not yet final (one pass over them),
    /// then reports those that became final: linear in the transfers in flight.
    fn drain_completions(&self, out: &mut Vec<XferId>) -> Result<()> {
        let mut inner = self.shared.lock()?;
        inner.progress_all();
        let Inner { xfers, completed, .. } = &mut *inner;
        out.extend(completed.drain(..).filter(|id| xfers.contains_key(id)).map(XferId));
        Ok(())
    }

    fn release(&self, xfer: XferId) -> Result<()> {
        let mut inner = self.shared.lock()?;
        let mut x = inner
            .xfers
            .remove(&xfer.0)
            .ok_or_else(|| error(ErrorKind::NotFound, format!("{xfer} unknown")))?;
        inner.pending.remove(&xfer.0);
        if !x.is_terminal() {
            // UCX cannot cancel RMA: let it finish in the background, but send no notification.
            x.notify = None;
            inner.orphans.push(x);
        }
        Ok(())
    }

    fn notify(&self, agent: &AgentName, msg: &[u8]) -> Result<()> {
        check_notification(&self.capabilities(), msg)?;
        let mut inner = self.shared.lock()?;
        let key = *inner
            .peer_ids
            .get(agent)
            .ok_or_else(|| error(ErrorKind::NotFound, format!("agent {agent} is not loaded")))?;
        let peer =
            inner.peers.get(&key).ok_or_else(|| error(ErrorKind::Backend, "a loaded peer vanished"))?;
        if let Some(why) = &peer.failed {
            return Err(why.clone());
        }
        let send = PendingSend::post(peer.ep, &inner.name, msg)?;
        if send.request.is_some() {
            inner.sends.push(send);
        }
        Ok(())
    }

    fn drain_notifications(&self, out: &mut Vec<Notification>) -> Result<()> {
        let mut inner = self.shared.lock()?;
        inner.progress_all();
        out.append(&mut inner.inbox.queue.lock().unwrap_or_else(PoisonError::into_inner));
        Ok(())
    }

    fn progress(&self) -> Result<()> {
        self.shared.lock()?.progress_all();
        Ok(())
    }
}

/// A checked transfer mapped to UCX: every descriptor resolved, nothing posted yet.
struct Plan {
    peer: u64,
    len: usize,
    /// Distinct local registrations used.
    regs: Vec<u64>,
    /// (local address, local memh, remote address, remote region index) per descriptor.
    descs: Vec<(u64, sys::ucp_mem_h, u64, usize)>,
}

/// Maps a post that passed kvx-core's checks to this agent's memory handles and rkeys.
fn plan(inner: &Inner, checked: &PostPlan<'_>, local: DlistId, remote: DlistId) -> Result<Plan> {
    let target = |id: DlistId| inner.dlists.get(&id.0).map(|d| &d.target);
    let (Some(DlistTarget::Local(lregs)), Some(DlistTarget::Remote { peer, regions })) =
        (target(local), target(remote))
    else {
        return Err(error(ErrorKind::Backend, "a checked list has no UCX target of its kind"));
    };
    let len = usize::try_from(checked.block_len())
        .map_err(|_| error(ErrorKind::InvalidArgument, "block length exceeds the address space"))?;
    let mut descs = Vec::with_capacity(checked.pairs().len());
    let mut regs = Vec::new();
    for (l, r) in checked.pairs() {
        // The list has one registration per region, and deregistering releases the lists over
        // it: the registration is live.
        let (Some(&reg_id), Some(&region)) = (lregs.get(l.region), regions.get(r.region)) else {
            return Err(error(ErrorKind::Backend, "a descriptor outside its list's regions"));
        };
        let reg = inner.regs.get(&reg_id).filter(|r| !r.retired).ok_or_else(|| {
            error(ErrorKind::Backend, format!("{local} lies in memory that was deregistered"))
        })?;
        regs.push(reg_id);
        descs.push((l.addr, reg.memh.raw(), r.addr, region));
    }
    regs.sort_unstable();
    regs.dedup();
    Ok(Plan { peer: *peer, len, regs, descs })
}

fn pack_rkey(context: &Context, memh: sys::ucp_mem_h) -> Result<Vec<u8>> {
    let mut buf: *mut c_void = ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: live context and memh; out-pointers valid.
    check(unsafe { sys::ucp_rkey_pack(context.raw(), memh, &mut buf, &mut len) }, "ucp_rkey_pack")?;
    // SAFETY: UCX returned `len` readable bytes at `buf`; copied, then released once.
    let packed = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) }.to_vec();
    // SAFETY: the buffer came from ucp_rkey_pack and is released once.
    unsafe { sys::ucp_rkey_buffer_release(buf) };
    Ok(packed)
}
