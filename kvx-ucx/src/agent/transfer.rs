//! The [`TransferAgent`] implementation of [`UcxAgent`].

use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::sync::{Arc, PoisonError, Weak};

use kvx_core::post::{BlockPostRequest, check_notification, place_dlist};
use kvx_core::wire::agent_metadata;
use kvx_core::{
    AgentName, BlockList, BlockPost, Capabilities, DlistId, DlistOwner, ErrorKind, KvMemory, MemRegion,
    Notification, NotificationWaker, PostRequest, RegistrationId, Result, TransferAgent, XferId, XferOp,
    XferState,
};
use kvx_ucx_sys as sys;

use crate::context::ReadPath;
use crate::status::{BACKEND, check, check_as, error, load};
use crate::wire::{AgentMetadata, RegionMetadata};

use super::UcxAgent;
use super::am_read::rma_lanes_are_tcp;
use super::inbox::{Inbox, on_endpoint_error};
use super::request::{PendingSend, Tracker};
use super::state::{
    Dlist, DlistTarget, Inner, LocalMemh, LocalReg, Peer, RemoteRegion, pack_rkey, unmap_reg,
};
use super::xfer::{Plan, Stage, Xfer, joinable, plan, plan_runs};

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
        self.capabilities().check_registration(&region)?;
        let len = usize::try_from(region.len)
            .map_err(|_| error(ErrorKind::InvalidArgument, format!("cannot register {region:?}")))?;
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
                Ok(rkey) => regions.push(RemoteRegion::new(MemRegion::dram(r.addr, r.len), rkey)),
                Err(e) => {
                    drop(regions);
                    inner.close_ep(ep, false);
                    return Err(e);
                }
            }
        }
        let am_reads = match inner.read_path {
            ReadPath::Get => false,
            ReadPath::ActiveMessages => true,
            ReadPath::Auto => {
                // SAFETY: a live endpoint of our worker, under the agent's lock.
                let info = unsafe { load()?.endpoint_info(ep.as_ptr()) };
                info.is_some_and(|info| rma_lanes_are_tcp(&info))
            }
        };
        let key = inner.next_id();
        inner.peers.insert(
            key,
            Peer { name: name.clone(), ep, regions, inflight: 0, forgotten: false, am_reads, failed: None },
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
                let held: Vec<(u64, MemRegion)> =
                    inner.regs.iter().filter(|(_, r)| !r.retired).map(|(id, r)| (*id, r.region)).collect();
                DlistTarget::Local(place_dlist(&self.capabilities(), owner, blocks, &held)?)
            }
            DlistOwner::Remote(agent) => {
                let key = *inner
                    .peer_ids
                    .get(agent)
                    .ok_or_else(|| error(ErrorKind::NotFound, format!("agent {agent} is not loaded")))?;
                let peer =
                    inner.peers.get(&key).ok_or_else(|| error(ErrorKind::NotFound, "peer vanished"))?;
                let held: Vec<(usize, MemRegion)> =
                    peer.regions.iter().map(|r| r.region).enumerate().collect();
                let regions = place_dlist(&self.capabilities(), owner, blocks, &held)?;
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
        submit(inner, op, ops, notify)
    }

    /// Checks and plans with kvx-core ([`BlockPostRequest::check`]): one get or put per
    /// coalesced range (per region and run of blocks contiguous on both sides).
    fn post_blocks(
        &self,
        op: XferOp,
        local: DlistId,
        remote: DlistId,
        blocks: &BlockPost<'_>,
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        let mut guard = self.shared.lock()?;
        let inner = &mut *guard;
        let request = BlockPostRequest { op, local, remote, blocks: *blocks, notify };
        let lists = |id: DlistId| inner.dlists.get(&id.0).map(Dlist::view);
        let checked = request.check(&self.capabilities(), lists, |id, r| joinable(inner, id, r))?;
        let ops = plan_runs(inner, checked.runs(), local, remote)?;
        submit(inner, op, ops, notify)
    }

    /// Drives the worker and advances the transfers whose requests completed (as `progress`)
    /// unless this one is final already.
    fn poll(&self, xfer: XferId) -> Result<XferState> {
        let mut inner = self.shared.lock()?;
        if !inner.live_xfer(xfer)?.is_terminal() {
            inner.progress_all();
        }
        Ok(inner.live_xfer(xfer)?.state())
    }

    /// Drives the worker once, advances the transfers whose requests completed, then reports
    /// those that became final: O(1) plus the transfers that moved, however many are in flight.
    fn drain_completions(&self, out: &mut Vec<XferId>) -> Result<()> {
        let mut inner = self.shared.lock()?;
        inner.progress_all();
        let Inner { xfers, completed, .. } = &mut *inner;
        out.extend(completed.drain(..).filter(|id| xfers.get(id).is_some_and(|x| !x.released)).map(XferId));
        Ok(())
    }

    fn release(&self, xfer: XferId) -> Result<()> {
        let mut inner = self.shared.lock()?;
        if inner.live_xfer(xfer)?.is_terminal() {
            inner.xfers.remove(&xfer.0);
        } else if let Some(x) = inner.xfers.get_mut(&xfer.0) {
            // UCX cannot cancel RMA: let it finish in the background, but send no notification.
            // A READ by active messages takes no range that has not arrived yet.
            x.notify = None;
            x.released = true;
            if x.op == XferOp::Read {
                inner.reads.cancel(xfer.0);
            }
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

    /// With a progress thread notifications arrive on it, and `wake` is called for each; without
    /// one they arrive only while the caller drives the agent (false, and nothing is called).
    fn wake_on_notification(&self, wake: NotificationWaker) -> bool {
        if !self.has_progress_thread() {
            return false;
        }
        match self.shared.lock() {
            Ok(inner) => {
                *inner.inbox.waker.lock().unwrap_or_else(PoisonError::into_inner) = Some(wake);
                true
            }
            Err(_) => false,
        }
    }
}

/// Posts a planned transfer: one get or put per range, then the transfer's stages.
fn submit(inner: &mut Inner, op: XferOp, ops: Plan, notify: Option<&[u8]>) -> Result<XferId> {
    let id = inner.next_id();
    let tracker = Tracker::new(id, &inner.moved);

    let peer =
        inner.peers.get(&ops.peer).ok_or_else(|| error(ErrorKind::Backend, "the list's peer vanished"))?;
    if let Some(why) = &peer.failed {
        return Err(why.clone());
    }
    let mut failure = None;
    tracker.begin();
    // A READ by active messages posts its requests; anything else one get or put per range.
    let by_messages = op == XferOp::Read && peer.am_reads;
    if by_messages {
        failure = inner.post_am_read(id, &tracker, (ops.peer, peer.ep.as_ptr()), &ops.descs).err();
    }
    let rma = if by_messages { &[][..] } else { &ops.descs[..] };
    for (laddr, memh, raddr, region, len) in rma {
        let remote = &peer.regions[*region];
        if let Some(mapped) = remote.local_ptr(*raddr, *len) {
            let local = *laddr as *mut u8;
            // The local range lies in a live registration (checked by `plan`), the remote range in
            // the peer's region, mapped here by UCX for as long as its rkey lives (the peer,
            // holding it, outlives this call). A peer's memory may change under a copy, as under
            // UCX's own get: the bytes are the peer's to vouch for, never a reference here.
            let (from, to) = match op {
                XferOp::Read => (mapped.cast_const(), local),
                XferOp::Write => (local.cast_const(), mapped),
            };
            // SAFETY: both ranges are live and `len` long (above); `ptr::copy` allows overlap.
            unsafe { ptr::copy(from, to, *len) };
            continue;
        }
        let mut param = tracker.param();
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
        param.memh = *memh;
        let rkey = remote.rkey.as_ptr();
        let (status_ptr, what) = match op {
            // SAFETY: the local range lies in a live registration (checked by `plan`), the
            // remote range in the peer's region whose rkey this is; both stay alive until the
            // transfer settles (it holds references on the registrations and the peer).
            XferOp::Read => (
                unsafe {
                    sys::ucp_get_nbx(peer.ep.as_ptr(), *laddr as *mut c_void, *len, *raddr, rkey, &param)
                },
                "ucp_get_nbx",
            ),
            // SAFETY: as for the read.
            XferOp::Write => (
                unsafe {
                    sys::ucp_put_nbx(peer.ep.as_ptr(), *laddr as *const c_void, *len, *raddr, rkey, &param)
                },
                "ucp_put_nbx",
            ),
        };
        if let Err(e) = tracker.record(status_ptr, what) {
            failure = Some(e);
            break;
        }
    }
    tracker.end();

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
        tracker,
        notify: notify.map(<[u8]>::to_vec),
        send: None,
        stage: Stage::Data,
        failure: None,
        holds_refs: true,
        released: false,
    };
    if let Some(e) = failure {
        // What was posted still runs: settle it in the background, without notification.
        xfer.notify = None;
        xfer.failure = Some(e.clone());
        xfer.released = true;
        inner.advance(&mut xfer);
        if !xfer.is_terminal() {
            inner.xfers.insert(id, xfer);
        }
        return Err(e);
    }
    inner.advance(&mut xfer);
    if xfer.is_terminal() {
        inner.completed.push(id);
    }
    inner.xfers.insert(id, xfer);
    Ok(XferId(id))
}
