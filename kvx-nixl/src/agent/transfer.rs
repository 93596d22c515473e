//! The [`TransferAgent`] implementation of [`NixlAgent`].

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use kvx_core::post::{BlockPostRequest, bad_dlist_kind, check_notification, place_dlist};
use kvx_core::wire::agent_metadata;
use kvx_core::{
    AgentName, BlockList, BlockPost, Capabilities, DlistId, DlistOwner, ErrorKind, KvMemory, MemRegion,
    Notification, PostRequest, RegistrationId, Result, TransferAgent, XferId, XferOp, XferState,
};
use nixl_sys as nixl;

use crate::BACKEND;
use crate::error::{NixlResultExt, error, nixl_error};
use crate::metadata::AgentMetadata;

use super::convert::{RegionDescriptor, mem_type, nixl_index, nixl_op, to_usize};
use super::state::{Dlist, Registration, Remote, Uses, fetch_notifications};
use super::{LOCAL_AGENT, NixlAgent};

impl TransferAgent for NixlAgent {
    fn name(&self) -> &AgentName {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    fn register(&self, memory: Arc<dyn KvMemory>) -> Result<RegistrationId> {
        let region = memory.region();
        self.capabilities.check_registration(&region)?;
        let descriptor = RegionDescriptor::new(region)?;
        let mut state = self.lock();
        let handle = state
            .nixl
            .agent
            .register_memory(&descriptor, None)
            .nixl(ErrorKind::Backend, "registering memory")?;
        let id = RegistrationId(state.next_id());
        state
            .registrations
            .insert(id, Registration { handle, region, _memory: memory, users: 0, retired: false });
        Ok(id)
    }

    fn deregister(&self, registration: RegistrationId) -> Result<()> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Some(reg) = state.registrations.get_mut(&registration).filter(|r| !r.retired) else {
            return Err(error(ErrorKind::NotFound, format!("{registration} is not registered")));
        };
        reg.retired = true;
        let in_use = reg.users > 0;
        state.dlists.retain(|_, d| !d.registrations.contains(&registration));
        if in_use {
            // The transfers over it keep it: the last to settle deregisters it (`release_uses`).
            return Ok(());
        }
        let Some(mut reg) = state.registrations.remove(&registration) else { return Ok(()) };
        // Deregister first; `reg` (and with it the memory) goes at the end of this scope.
        reg.handle.deregister().nixl(ErrorKind::Backend, "deregistering memory")
    }

    fn local_metadata(&self) -> Result<Vec<u8>> {
        let state = self.lock();
        let nixl_md = state.nixl.agent.get_local_md().nixl(ErrorKind::Backend, "getting local metadata")?;
        let regions = state.registrations.values().filter(|r| !r.retired).map(|r| r.region).collect();
        agent_metadata::seal(BACKEND, &self.name, &AgentMetadata { regions, nixl: nixl_md })
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<AgentName> {
        let (name, meta) = AgentMetadata::open(metadata)?;
        if name == self.name {
            return Err(error(
                ErrorKind::InvalidPeerData,
                format!("peer metadata carries this agent's own name {name}"),
            ));
        }
        let mut guard = self.lock();
        let state = &mut *guard;
        // A remote forgotten while transfers to it are in flight keeps its NIXL metadata until they
        // settle: the same metadata again just makes it loaded again.
        match state.remotes.get_mut(&name) {
            Some(remote) if !remote.forgotten => {
                return Err(error(
                    ErrorKind::State,
                    format!("remote {name} is already loaded; forget it first"),
                ));
            }
            Some(remote) if remote.nixl_md == meta.nixl => {
                remote.forgotten = false;
                remote.regions = meta.regions;
                return Ok(name);
            }
            _ => {}
        }
        let agent = &state.nixl.agent;
        // nixl-sys unwraps the UTF-8 conversion of the name NIXL parsed out of the blob: a peer's
        // bad bytes must not panic through us.
        let loaded = catch_unwind(AssertUnwindSafe(|| agent.load_remote_md(&meta.nixl)))
            .map_err(|_| error(ErrorKind::InvalidPeerData, "NIXL metadata carries a non-UTF-8 agent name"));
        let loaded = match (loaded, state.remotes.get_mut(&name)) {
            (Ok(Ok(loaded)), _) => loaded,
            // NIXL keeps one connection per remote name: a restarted peer cannot be loaded while
            // transfers to its previous instance are in flight.
            (Ok(Err(e)), Some(_)) => {
                return Err(nixl_error(
                    ErrorKind::State,
                    &format!("loading {name} while transfers posted before it was forgotten are in flight"),
                    e,
                ));
            }
            (Ok(Err(e)), None) => {
                return Err(nixl_error(ErrorKind::InvalidPeerData, "loading remote metadata", e));
            }
            (Err(e), _) => return Err(e),
        };
        if loaded != name.as_str() {
            if let Err(e) = agent.invalidate_remote_md(&loaded) {
                tracing::warn!(remote = %loaded, error = %e, "invalidating mislabelled remote metadata failed");
            }
            return Err(error(
                ErrorKind::InvalidPeerData,
                format!("metadata names agent {:?} but NIXL's part is for {loaded:?}", name.as_str()),
            ));
        }
        let AgentMetadata { regions, nixl: nixl_md } = meta;
        match state.remotes.get_mut(&name) {
            Some(remote) => {
                remote.forgotten = false;
                remote.regions = regions;
                remote.nixl_md = nixl_md;
            }
            None => {
                state.remotes.insert(name.clone(), Remote { regions, nixl_md, users: 0, forgotten: false });
            }
        }
        Ok(name)
    }

    fn forget_remote(&self, agent: &AgentName) -> Result<()> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Some(remote) = state.remotes.get_mut(agent).filter(|r| !r.forgotten) else {
            return Err(error(ErrorKind::NotFound, format!("remote {agent} is not loaded")));
        };
        remote.forgotten = true;
        let in_use = remote.users > 0;
        state.dlists.retain(|_, d| d.owner != DlistOwner::Remote(agent.clone()));
        if in_use {
            // A request in flight uses the remote's metadata (its keys) inside NIXL, and NIXL
            // cannot reliably cancel: the last transfer to settle invalidates it (`release_uses`).
            return Ok(());
        }
        state.remotes.remove(agent);
        state
            .nixl
            .agent
            .invalidate_remote_md(agent.as_str())
            .nixl(ErrorKind::Backend, "invalidating remote metadata")
    }

    fn prep_dlist(&self, owner: &DlistOwner, blocks: &BlockList) -> Result<DlistId> {
        let bad = bad_dlist_kind(owner);
        let kind_supported = self.capabilities.supports(blocks.kind);
        self.require(kind_supported, &format!("{:?} memory", blocks.kind))?;
        if u32::try_from(blocks.len()).ok().filter(|&n| i32::try_from(n).is_ok()).is_none() {
            return Err(error(bad, format!("{} descriptors is more than NIXL indexes", blocks.len())));
        }

        let mut state = self.lock();
        // Every region must lie inside one registration of the owner.
        let (owned, nixl_owner): (Vec<(Option<RegistrationId>, MemRegion)>, &str) = match owner {
            DlistOwner::Local => (
                state
                    .registrations
                    .iter()
                    .filter(|(_, r)| !r.retired)
                    .map(|(id, r)| (Some(*id), r.region))
                    .collect(),
                LOCAL_AGENT,
            ),
            DlistOwner::Remote(name) => {
                let remote = state.loaded(name)?;
                (remote.regions.iter().map(|r| (None, *r)).collect(), name.as_str())
            }
        };
        // A local list: the registration holding each region.
        let registrations =
            place_dlist(&self.capabilities, owner, blocks, &owned)?.into_iter().flatten().collect();

        // NIXL checks the list against the owner's registrations as it prepares it: one
        // descriptor per region checks what the blocks' descriptors would, in O(regions). The
        // per-block list that `post` indexes is prepared when a `post` first uses the list.
        let mut descs = nixl::XferDescList::new(mem_type(blocks.kind))
            .nixl(ErrorKind::Backend, "creating a descriptor list")?;
        let region_len = to_usize(u64::from(blocks.num_blocks) * blocks.block_len)?;
        for &base in &blocks.bases {
            descs.add_desc(to_usize(base)?, region_len, u64::from(blocks.device));
        }
        drop(
            state
                .nixl
                .agent
                .prepare_xfer_dlist(nixl_owner, &descs, None)
                .nixl(bad, "preparing a descriptor list")?,
        );
        let id = DlistId(state.next_id());
        state.dlists.insert(
            id,
            Dlist { prepared: None, owner: owner.clone(), blocks: blocks.clone(), registrations },
        );
        Ok(id)
    }

    fn release_dlist(&self, dlist: DlistId) -> Result<()> {
        let mut state = self.lock();
        match state.dlists.remove(&dlist) {
            Some(_) => Ok(()),
            None => Err(error(ErrorKind::NotFound, format!("{dlist} is not prepared"))),
        }
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
        let mut guard = self.lock();
        let state = &mut *guard;
        let request = PostRequest { op, local, local_descs, remote, remote_descs, notify };
        let plan = request.check(&self.capabilities, |id| state.dlists.get(&id).map(Dlist::view))?;
        let Some(local_list) = state.dlists.get(&local) else {
            return Err(error(ErrorKind::Backend, "a checked post's lists vanished"));
        };
        let mut local_indices = Vec::with_capacity(plan.pairs().len());
        let mut remote_indices = Vec::with_capacity(plan.pairs().len());
        let mut registrations = Vec::new();
        for (l, r) in plan.pairs() {
            local_indices.push(nixl_index(l.index)?);
            remote_indices.push(nixl_index(r.index)?);
            registrations.extend(local_list.registrations.get(l.region).copied());
        }
        registrations.sort_unstable();
        registrations.dedup();
        let peer = plan.peer().clone();

        state.prepare_blocks(local)?;
        state.prepare_blocks(remote)?;
        let (Some(local_prepared), Some(remote_prepared)) = (
            state.dlists.get(&local).and_then(|d| d.prepared.as_ref()),
            state.dlists.get(&remote).and_then(|d| d.prepared.as_ref()),
        ) else {
            return Err(error(ErrorKind::Backend, "a post's lists were not prepared"));
        };
        let options = notification(notify)?;
        let request = state
            .nixl
            .agent
            .make_xfer_req(
                nixl_op(op),
                &local_prepared.0,
                &local_indices,
                &remote_prepared.0,
                &remote_indices,
                options.as_ref(),
            )
            .nixl(ErrorKind::Backend, "making a transfer request")?;
        state.submit(request, Uses { registrations, remote: peer })
    }

    /// Builds the transfer's descriptor lists from the plan's coalesced ranges (one descriptor
    /// per run of blocks contiguous on both sides, per region) and hands them to NIXL's
    /// `createXferReq`: no prepared list is involved, so posting costs O(blocks + regions).
    fn post_blocks<'a>(
        &self,
        op: XferOp,
        local: DlistId,
        remote: DlistId,
        blocks: &BlockPost<'a>,
        notify: Option<&'a [u8]>,
    ) -> Result<XferId> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let request = BlockPostRequest { op, local, remote, blocks: *blocks, notify };
        let plan = request.check(
            &self.capabilities,
            |id| state.dlists.get(&id).map(Dlist::view),
            |id, region| state.joinable(id, region),
        )?;
        let (Some(local_list), Some(remote_list)) = (state.dlists.get(&local), state.dlists.get(&remote))
        else {
            return Err(error(ErrorKind::Backend, "a checked post's lists vanished"));
        };
        let runs = plan.runs();
        let mut local_descs = nixl::XferDescList::new(mem_type(local_list.blocks.kind))
            .nixl(ErrorKind::Backend, "creating a descriptor list")?;
        let mut remote_descs = nixl::XferDescList::new(mem_type(remote_list.blocks.kind))
            .nixl(ErrorKind::Backend, "creating a descriptor list")?;
        let (local_device, remote_device) =
            (u64::from(local_list.blocks.device), u64::from(remote_list.blocks.device));
        for range in runs {
            let len = to_usize(range.len)?;
            local_descs.add_desc(to_usize(range.local)?, len, local_device);
            remote_descs.add_desc(to_usize(range.remote)?, len, remote_device);
        }
        let mut registrations: Vec<RegistrationId> =
            runs.regions().filter_map(|r| local_list.registrations.get(r).copied()).collect();
        registrations.sort_unstable();
        registrations.dedup();

        let options = notification(notify)?;
        let peer = plan.peer().clone();
        let request = state
            .nixl
            .agent
            .create_xfer_req(nixl_op(op), &local_descs, &remote_descs, peer.as_str(), options.as_ref())
            .nixl(ErrorKind::Backend, "creating a transfer request")?;
        state.submit(request, Uses { registrations, remote: peer })
    }

    fn poll(&self, xfer: XferId) -> Result<XferState> {
        self.lock().refreshed(xfer)
    }

    fn release(&self, xfer: XferId) -> Result<()> {
        let mut state = self.lock();
        state.refreshed(xfer)?;
        let Some(entry) = state.xfers.remove(&xfer) else { return Ok(()) };
        // NIXL cannot reliably cancel a transfer in flight, and releasing its request early would
        // let the memory go while the transport still writes it: keep the request, complete it in
        // the background (every `progress` and `drain_notifications` checks it), and count it as
        // using its memory and its remote until then.
        if entry.state == XferState::Pending {
            state.detached.push(entry);
        }
        Ok(())
    }

    fn notify(&self, agent: &AgentName, msg: &[u8]) -> Result<()> {
        check_notification(&self.capabilities, msg)?;
        let state = self.lock();
        state.loaded(agent)?;
        state
            .nixl
            .agent
            .send_notification(agent.as_str(), msg, None)
            .nixl(ErrorKind::Backend, "sending a notification")
    }

    fn drain_notifications(&self, out: &mut Vec<Notification>) -> Result<()> {
        let mut guard = self.lock();
        let state = &mut *guard;
        state.refresh_pending();
        out.append(&mut state.received);
        fetch_notifications(&state.nixl.agent, out)
    }

    /// NIXL has no completion queue: one status check per transfer still pending (as
    /// `progress`), then the settled transfers not yet reported. Linear in the transfers posted
    /// and not yet released.
    fn drain_completions(&self, out: &mut Vec<XferId>) -> Result<()> {
        let mut guard = self.lock();
        let state = &mut *guard;
        state.refresh_pending();
        for (&id, xfer) in &mut state.xfers {
            if xfer.state != XferState::Pending && !xfer.reported {
                xfer.reported = true;
                out.push(id);
            }
        }
        fetch_notifications(&state.nixl.agent, &mut state.received)
    }

    fn progress(&self) -> Result<()> {
        // NIXL has no separate progress call. Checking a transfer's status progresses it (and
        // NIXL's UCX backend sends a transfer's notification from there once the data is in
        // place); fetching notifications progresses the rest. Keep what arrives for the next
        // `drain_notifications`.
        let mut guard = self.lock();
        let state = &mut *guard;
        state.refresh_pending();
        fetch_notifications(&state.nixl.agent, &mut state.received)
    }
}

/// NIXL's transfer options carrying `notify`, if any.
fn notification(notify: Option<&[u8]>) -> Result<Option<nixl::OptArgs>> {
    let Some(msg) = notify else { return Ok(None) };
    let mut options = nixl::OptArgs::new().nixl(ErrorKind::Backend, "creating transfer options")?;
    options.set_has_notification(true).nixl(ErrorKind::Backend, "attaching a notification")?;
    options.set_notification_message(msg).nixl(ErrorKind::Backend, "attaching a notification")?;
    Ok(Some(options))
}
