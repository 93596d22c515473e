//! The agent's state behind its lock ([`Inner`]): registrations, peers, descriptor lists and
//! transfers; progress; teardown.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::sync::{Arc, PoisonError, Weak};
use std::time::{Duration, Instant};

use kvx_core::post::DlistView;
use kvx_core::{AgentName, BlockList, DlistOwner, Error, ErrorKind, KvMemory, MemRegion, Result, XferId};
use kvx_ucx_sys as sys;

use crate::context::{Context, ReadPath};
use crate::memory::PoolMapping;
use crate::status::{check, error, ucx_error};

use super::am_read::{AM_READ_DATA, AM_READ_REQUEST, Answers, Reads, Serve, on_read_data, on_read_request};
use super::inbox::{Inbox, on_notification};
use super::request::{Completions, PendingSend, Request, reap};
use super::xfer::Xfer;
use super::{AM_NOTIFY, PROGRESS_BURST, TEARDOWN_BOUND};

/// All worker state; only touched with [`Shared::inner`] locked.
///
/// [`Shared::inner`]: super::Shared::inner
pub(super) struct Inner {
    pub(super) name: AgentName,
    pub(super) context: Arc<Context>,
    pub(super) worker: NonNull<sys::ucp_worker>,
    pub(super) address: Vec<u8>,
    pub(super) inbox: Box<Inbox>,
    /// Endpoints are created with `UCP_ERR_HANDLING_MODE_PEER` (see `UcxConfig`).
    pub(super) peer_failure: bool,
    pub(super) read_path: ReadPath,
    /// READs in flight by active messages (the reader's side).
    pub(super) reads: Box<Reads>,
    /// READ requests received (the target's side), and the answers on their way out.
    pub(super) serve: Box<Serve>,
    pub(super) answers: HashMap<u64, Answers>,
    pub(super) regs: HashMap<u64, LocalReg>,
    pub(super) peers: HashMap<u64, Peer>,
    pub(super) peer_ids: HashMap<AgentName, u64>,
    pub(super) dlists: HashMap<u64, Dlist>,
    /// Posted transfers: those not released, and those released while running (dropped once
    /// UCX is done with them).
    pub(super) xfers: HashMap<u64, Xfer>,
    /// The transfers whose requests all completed: what a progress pass advances.
    pub(super) moved: Arc<Completions>,
    /// The posted transfers that became `Done` or `Failed` and that `drain_completions` has not
    /// reported yet. A released one is skipped when they are drained.
    pub(super) completed: Vec<u64>,
    pub(super) sends: Vec<PendingSend>,
    pub(super) closing: Vec<Request>,
    pub(super) pools: Vec<Weak<PoolMapping>>,
    pub(super) next_id: u64,
}

// SAFETY: the worker is created with UCS_THREAD_MODE_SERIALIZED, so UCX allows calls on it (and on
// its endpoints, rkeys and requests) from any thread as long as they never overlap; Inner is only
// reachable through a Mutex, which guarantees that.
unsafe impl Send for Inner {}

pub(super) struct LocalReg {
    pub(super) memory: Arc<dyn KvMemory>,
    pub(super) region: MemRegion,
    pub(super) memh: LocalMemh,
    pub(super) rkey: Vec<u8>,
    /// Posted transfers that use this registration.
    pub(super) inflight: usize,
    /// Deregistered; unmapped once `inflight` drops to zero.
    pub(super) retired: bool,
}

pub(super) enum LocalMemh {
    /// Our `ucp_mem_map` of the caller's memory: unmapped with the registration.
    Mapped(NonNull<sys::ucp_mem>),
    /// A [`UcxMemory`](crate::UcxMemory) pool of this context: UCX's own mapping, reused.
    Pool(Arc<PoolMapping>),
}

impl LocalMemh {
    pub(super) fn raw(&self) -> sys::ucp_mem_h {
        match self {
            LocalMemh::Mapped(m) => m.as_ptr(),
            LocalMemh::Pool(p) => p.memh(),
        }
    }
}

pub(super) struct Peer {
    pub(super) name: AgentName,
    pub(super) ep: NonNull<sys::ucp_ep>,
    pub(super) regions: Vec<RemoteRegion>,
    pub(super) inflight: usize,
    pub(super) forgotten: bool,
    /// READs go by active messages (see [`ReadPath`]).
    pub(super) am_reads: bool,
    /// Why UCX reported the endpoint failed: nothing more is posted on it, and it is closed
    /// without a flush.
    pub(super) failed: Option<Error>,
}

pub(super) struct RemoteRegion {
    pub(super) region: MemRegion,
    pub(super) rkey: NonNull<sys::ucp_rkey>,
    /// Where the region's first byte is mapped in this process, when UCX mapped it here
    /// (`ucp_rkey_ptr`: memory a peer on this host allocated through UCX, reached over shared
    /// memory); transfers then copy it directly instead of one get or put per range.
    pub(super) mapped: Option<NonNull<u8>>,
}

impl RemoteRegion {
    /// The region of `rkey`, with its mapping in this process if UCX has one.
    pub(super) fn new(region: MemRegion, rkey: NonNull<sys::ucp_rkey>) -> Self {
        let mut addr: *mut c_void = ptr::null_mut();
        // SAFETY: a live rkey; UCX only writes the out-pointer.
        let status = unsafe { sys::ucp_rkey_ptr(rkey.as_ptr(), region.addr, &mut addr) };
        let mapped = if status == sys::UCS_OK { NonNull::new(addr.cast()) } else { None };
        RemoteRegion { region, rkey, mapped }
    }

    /// The address in this process of the `len` bytes at `raddr` of the region, when it is mapped
    /// here and holds them.
    pub(super) fn local_ptr(&self, raddr: u64, len: usize) -> Option<*mut u8> {
        let base = self.mapped?;
        if !self.region.contains(&MemRegion::dram(raddr, len as u64)) {
            return None;
        }
        let offset = usize::try_from(raddr - self.region.addr).ok()?;
        // SAFETY: the offset lies inside the mapped region (checked above).
        Some(unsafe { base.as_ptr().add(offset) })
    }
}

impl Drop for RemoteRegion {
    fn drop(&mut self) {
        // SAFETY: the rkey was unpacked on a live endpoint of our live worker (peers are destroyed
        // before the worker) and is destroyed once.
        unsafe { sys::ucp_rkey_destroy(self.rkey.as_ptr()) };
    }
}

pub(super) struct Dlist {
    pub(super) owner: DlistOwner,
    pub(super) blocks: BlockList,
    pub(super) target: DlistTarget,
}

impl Dlist {
    pub(super) fn view(&self) -> DlistView<'_> {
        DlistView { owner: &self.owner, blocks: &self.blocks }
    }
}

pub(super) enum DlistTarget {
    /// The registration holding each region of the list.
    Local(Vec<u64>),
    /// The peer, and the index of its remote region holding each region of the list.
    Remote { peer: u64, regions: Vec<usize> },
}

impl Inner {
    pub(super) fn new(
        name: AgentName,
        context: Arc<Context>,
        peer_failure: bool,
        read_path: ReadPath,
    ) -> Result<Self> {
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
            read_path,
            reads: Reads::new(worker.as_ptr()),
            serve: Serve::new(),
            answers: HashMap::new(),
            regs: HashMap::new(),
            peers: HashMap::new(),
            peer_ids: HashMap::new(),
            dlists: HashMap::new(),
            xfers: HashMap::new(),
            moved: Arc::default(),
            completed: Vec::new(),
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
        am.flags = sys::UCP_AM_FLAG_WHOLE_MSG;
        let handlers: [(u32, sys::ucp_am_recv_callback_t, *mut c_void); 3] = [
            (AM_NOTIFY, Some(on_notification), ptr::from_ref::<Inbox>(&inner.inbox).cast_mut().cast()),
            (AM_READ_REQUEST, Some(on_read_request), ptr::from_ref::<Serve>(&inner.serve).cast_mut().cast()),
            (AM_READ_DATA, Some(on_read_data), ptr::from_ref::<Reads>(&inner.reads).cast_mut().cast()),
        ];
        for (id, cb, arg) in handlers {
            (am.id, am.cb, am.arg) = (id, cb, arg);
            // SAFETY: live worker; the callback's argument (a boxed field, which never moves)
            // lives until after the worker is destroyed (Inner::drop destroys the worker before
            // fields drop).
            let status = unsafe { sys::ucp_worker_set_am_recv_handler(worker.as_ptr(), &am) };
            check(status, "ucp_worker_set_am_recv_handler")?;
        }
        Ok(inner)
    }

    pub(super) fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Progresses the worker until idle (bounded); returns the number of events.
    pub(super) fn progress_worker(&mut self) -> u32 {
        let mut total = 0u32;
        for _ in 0..PROGRESS_BURST {
            // SAFETY: live worker, accessed under the lock (serialized mode).
            let n = unsafe { sys::ucp_worker_progress(self.worker.as_ptr()) };
            self.serve_reads();
            if n == 0 {
                break;
            }
            total = total.saturating_add(n);
        }
        total
    }

    /// Progresses the worker and settles background work (released transfers, standalone
    /// notifications, endpoint closes). Returns the number of worker events.
    pub(super) fn progress_all(&mut self) -> u32 {
        let events = self.progress_worker();
        self.settle_failed_endpoints();
        // Posted transfers move on too (their flushes and notifications go out) even when the
        // owner only calls progress(): those whose requests completed since the last pass.
        let moved = std::mem::take(&mut *self.moved.lock().unwrap_or_else(PoisonError::into_inner));
        for id in moved {
            match self.answers.remove(&id) {
                Some(answers) => self.finish_answers(answers),
                None => self.settle(id),
            }
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

    /// The transfer `id`, unless unknown or released (`NotFound`).
    pub(super) fn live_xfer(&self, id: XferId) -> Result<&Xfer> {
        self.xfers
            .get(&id.0)
            .filter(|x| !x.released)
            .ok_or_else(|| error(ErrorKind::NotFound, format!("{id} unknown")))
    }

    /// Advances transfer `id` after its requests completed; a transfer that becomes final is
    /// kept for `drain_completions`, or dropped if its owner released it.
    pub(super) fn settle(&mut self, id: u64) {
        let Some(mut xfer) = self.xfers.remove(&id) else { return };
        if !xfer.is_terminal() {
            self.advance(&mut xfer);
            if xfer.is_terminal() && !xfer.released {
                self.completed.push(id);
                // A caller that releases without draining leaves released ids behind: drop them
                // once they outnumber the live transfers (amortised constant time per transfer).
                if self.completed.len() > 2 * self.xfers.len() + 64 {
                    let xfers = &self.xfers;
                    self.completed.retain(|id| xfers.contains_key(id));
                }
            }
        }
        if !(xfer.released && xfer.is_terminal()) {
            self.xfers.insert(id, xfer);
        }
    }

    /// Marks the peers whose endpoints UCX reported failed: later posts and notifications to them
    /// fail at once (their running requests complete with the error on their own).
    pub(super) fn settle_failed_endpoints(&mut self) {
        let failed =
            std::mem::take(&mut *self.inbox.failed_eps.lock().unwrap_or_else(PoisonError::into_inner));
        for (ep, status) in failed {
            if let Some((key, peer)) = self.peers.iter_mut().find(|(_, p)| p.ep.as_ptr() as usize == ep) {
                let why = ucx_error(ErrorKind::Transfer, &format!("agent {} is gone", peer.name), status);
                tracing::warn!("UCX endpoint failed: {why}");
                peer.failed.get_or_insert(why);
                // Its READs by active messages will get no more answers.
                self.reads.fail_peer(*key, status);
            }
        }
    }
}

impl Inner {
    pub(super) fn destroy_peer(&mut self, key: u64) {
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
    pub(super) fn close_ep(&mut self, ep: NonNull<sys::ucp_ep>, force: bool) {
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

    pub(super) fn destroy_reg(&mut self, id: u64) {
        let Some(reg) = self.regs.remove(&id) else { return };
        unmap_reg(&self.context, reg);
    }

    pub(super) fn progress_for(&mut self, bound: Duration, mut done: impl FnMut(&mut Self) -> bool) -> bool {
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

pub(super) fn unmap_reg(context: &Context, reg: LocalReg) {
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

impl Inner {
    /// Forgets every UCX handle and everything UCX may still reference (see `Drop`).
    pub(super) fn leak_all(&mut self) {
        std::mem::forget(std::mem::take(&mut self.closing));
        std::mem::forget(std::mem::take(&mut self.xfers));
        std::mem::forget(std::mem::take(&mut self.sends));
        std::mem::forget(std::mem::take(&mut self.peers));
        std::mem::forget(std::mem::take(&mut self.regs));
        std::mem::forget(std::mem::take(&mut self.answers));
        std::mem::forget(std::mem::replace(&mut self.reads, Reads::new(ptr::null_mut())));
        std::mem::forget(std::mem::replace(&mut self.serve, Serve::new()));
        let empty = Inbox::new();
        std::mem::forget(std::mem::replace(&mut self.inbox, empty));
        std::mem::forget(Arc::clone(&self.context));
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Give running transfers a bounded chance to finish (no new notifications are sent).
        for x in self.xfers.values_mut() {
            x.notify = None;
            x.released = true;
        }
        self.reads.cancel_all();
        self.xfers.retain(|_, x| !x.is_terminal());
        let drained = self.progress_for(TEARDOWN_BOUND, |s| {
            s.xfers.is_empty() && s.sends.is_empty() && s.answers.is_empty()
        });
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

pub(super) fn pack_rkey(context: &Context, memh: sys::ucp_mem_h) -> Result<Vec<u8>> {
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
