//! Everything behind a [`NixlAgent`](super::NixlAgent)'s mutex ([`State`]): transfers,
//! descriptor lists, remotes and registrations, the uses that keep them alive, and the teardown.

use std::collections::{BTreeMap, HashMap};
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::Instant;

use kvx_core::post::DlistView;
use kvx_core::{
    AgentName, BlockList, DlistId, DlistOwner, ErrorKind, KvMemory, MAX_NOTIFICATION_LEN, MemRegion,
    Notification, RegistrationId, Result, XferId, XferState,
};
use nixl_sys as nixl;

use crate::error::{NixlResultExt, error, nixl_error};
use crate::library::lifecycle_lock;

use super::convert::{mem_type, to_usize};
use super::{LOCAL_AGENT, TEARDOWN_WAIT};

/// Everything behind the agent's mutex. nixl-sys marks its agent and request handles `Send` and
/// `Sync` without saying why; kvx-nixl does not rely on that for correctness: every NIXL call and
/// every drop of a NIXL handle happens with this mutex held (or, in `Drop`, with exclusive
/// access). Field order is drop order; [`State`]'s `Drop` first empties the tables in dependency
/// order, and the NIXL agent itself goes last.
pub(super) struct State {
    pub(super) next_id: u64,
    pub(super) xfers: HashMap<XferId, Xfer>,
    /// Released while in flight: completed in the background, then dropped.
    pub(super) detached: Vec<Xfer>,
    pub(super) dlists: HashMap<DlistId, Dlist>,
    /// Loaded remotes, and remotes forgotten while transfers to them are in flight.
    pub(super) remotes: HashMap<AgentName, Remote>,
    /// Registrations, and registrations deregistered while transfers over them are in flight.
    pub(super) registrations: BTreeMap<RegistrationId, Registration>,
    /// Notifications fetched by `progress` and not yet drained.
    pub(super) received: Vec<Notification>,
    pub(super) nixl: NixlHandle,
}

impl State {
    pub(super) fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// A loaded remote (not one forgotten while transfers to it are in flight); `NotFound` if none.
    pub(super) fn loaded(&self, name: &AgentName) -> Result<&Remote> {
        self.remotes
            .get(name)
            .filter(|r| !r.forgotten)
            .ok_or_else(|| error(ErrorKind::NotFound, format!("remote {name} is not loaded")))
    }

    /// A posted transfer's state, brought up to date; `NotFound` for an unknown id.
    pub(super) fn refreshed(&mut self, xfer: XferId) -> Result<XferState> {
        let entry = self
            .xfers
            .get_mut(&xfer)
            .ok_or_else(|| error(ErrorKind::NotFound, format!("{xfer} is not posted")))?;
        let settled = entry.refresh(&self.nixl.agent);
        let state = entry.state.clone();
        if let Some(uses) = settled {
            self.release_uses(uses);
        }
        Ok(state)
    }

    /// Updates every transfer still pending, and drops detached ones that have settled.
    pub(super) fn refresh_pending(&mut self) {
        let agent = &self.nixl.agent;
        let mut settled: Vec<Uses> = self.xfers.values_mut().filter_map(|x| x.refresh(agent)).collect();
        self.detached.retain_mut(|x| match x.refresh(agent) {
            Some(uses) => {
                settled.push(uses);
                false
            }
            None => x.state == XferState::Pending,
        });
        for uses in settled {
            self.release_uses(uses);
        }
    }

    /// Counts a new transfer as using its registrations and remote.
    pub(super) fn take_uses(&mut self, uses: &Uses) {
        for id in &uses.registrations {
            if let Some(reg) = self.registrations.get_mut(id) {
                reg.users += 1;
            }
        }
        if let Some(remote) = self.remotes.get_mut(&uses.remote) {
            remote.users += 1;
        }
    }

    /// A transfer settled: it no longer uses its registrations and remote. Deregistrations and
    /// forgets that waited for it happen now.
    pub(super) fn release_uses(&mut self, uses: Uses) {
        for id in uses.registrations {
            let Some(reg) = self.registrations.get_mut(&id) else { continue };
            reg.users -= 1;
            if reg.retired && reg.users == 0 {
                if let Some(mut reg) = self.registrations.remove(&id) {
                    if let Err(e) = reg.handle.deregister() {
                        tracing::warn!(registration = %id, error = %e, "deferred deregistration failed");
                    }
                }
            }
        }
        let Some(remote) = self.remotes.get_mut(&uses.remote) else { return };
        remote.users -= 1;
        if remote.forgotten && remote.users == 0 {
            self.remotes.remove(&uses.remote);
            if let Err(e) = self.nixl.agent.invalidate_remote_md(uses.remote.as_str()) {
                tracing::warn!(remote = %uses.remote, error = %e, "deferred invalidation of a remote failed");
            }
        }
    }

    /// Posts a transfer request NIXL has made, counts it as using `uses` until it settles, and
    /// records it (`Done` at once when NIXL completed it inside the post).
    pub(super) fn submit(&mut self, request: nixl::XferRequest, uses: Uses) -> Result<XferId> {
        let in_flight =
            self.nixl.agent.post_xfer_req(&request, None).nixl(ErrorKind::Transfer, "posting a transfer")?;
        self.take_uses(&uses);
        let mut xfer =
            Xfer { state: XferState::Pending, request: Some(request), uses: Some(uses), reported: false };
        if !in_flight {
            xfer.state = XferState::Done;
            if let Some(uses) = xfer.settle() {
                self.release_uses(uses);
            }
        }
        let id = XferId(self.next_id());
        self.xfers.insert(id, xfer);
        Ok(id)
    }

    /// Prepares list `id`'s per-block NIXL list (region by region, block by block: descriptor
    /// `region * num_blocks + block`) unless it is already. `prep_dlist` checked the list against
    /// the owner's registrations, so a failure here is NIXL's own (`Backend`).
    pub(super) fn prepare_blocks(&mut self, id: DlistId) -> Result<()> {
        let Some(list) = self.dlists.get_mut(&id) else {
            return Err(error(ErrorKind::NotFound, format!("{id} is not prepared")));
        };
        if list.prepared.is_some() {
            return Ok(());
        }
        let blocks = &list.blocks;
        let mut descs = nixl::XferDescList::new(mem_type(blocks.kind))
            .nixl(ErrorKind::Backend, "creating a descriptor list")?;
        let (len, device) = (to_usize(blocks.block_len)?, u64::from(blocks.device));
        for &base in &blocks.bases {
            for block in 0..u64::from(blocks.num_blocks) {
                // In range: `prep_dlist` checked the whole region, so this cannot overflow.
                descs.add_desc(to_usize(base + block * blocks.block_len)?, len, device);
            }
        }
        let owner = match &list.owner {
            DlistOwner::Local => LOCAL_AGENT,
            DlistOwner::Remote(name) => name.as_str(),
        };
        let handle = self
            .nixl
            .agent
            .prepare_xfer_dlist(owner, &descs, None)
            .nixl(ErrorKind::Backend, "preparing a list's per-block descriptors")?;
        list.prepared = Some(PreparedDlist(handle));
        Ok(())
    }

    /// Whether one descriptor of list `id` may run from region `region` into the next: both lie
    /// in one registration (a local list) or one registered region of the remote (a remote list),
    /// as a NIXL descriptor must.
    pub(super) fn joinable(&self, id: DlistId, region: usize) -> bool {
        let Some(list) = self.dlists.get(&id) else { return false };
        match &list.owner {
            DlistOwner::Local => {
                matches!((list.registrations.get(region), list.registrations.get(region + 1)), (Some(a), Some(b)) if a == b)
            }
            DlistOwner::Remote(name) => {
                let Some(remote) = self.remotes.get(name) else { return false };
                let blocks = &list.blocks;
                let (Some(&first), Some(&next)) = (blocks.bases.get(region), blocks.bases.get(region + 1))
                else {
                    return false;
                };
                let end = u64::from(blocks.num_blocks)
                    .checked_mul(blocks.block_len)
                    .and_then(|n| next.checked_add(n));
                end.is_some_and(|end| {
                    remote.regions.iter().any(|m| m.addr <= first && m.end().is_some_and(|e| end <= e))
                })
            }
        }
    }

    pub(super) fn any_in_flight(&self) -> bool {
        !self.detached.is_empty() || self.xfers.values().any(|x| x.state == XferState::Pending)
    }
}

impl Drop for State {
    fn drop(&mut self) {
        // Transfers in flight read or write registered memory: give them a bounded time to finish.
        let deadline = Instant::now() + TEARDOWN_WAIT;
        loop {
            self.refresh_pending();
            if !self.any_in_flight() || Instant::now() >= deadline {
                break;
            }
            let mut ignored = Vec::new();
            if let Err(e) = fetch_notifications(&self.nixl.agent, &mut ignored) {
                tracing::debug!(error = %e, "progress during teardown failed");
            }
            std::thread::yield_now();
        }
        if self.any_in_flight() {
            tracing::warn!("dropping a NIXL agent with transfers still in flight after {TEARDOWN_WAIT:?}");
        }
        self.xfers.clear();
        self.detached.clear();
        self.dlists.clear();
        for name in self.remotes.keys() {
            if let Err(e) = self.nixl.agent.invalidate_remote_md(name.as_str()) {
                tracing::warn!(remote = %name, error = %e, "invalidating remote metadata at teardown failed");
            }
        }
        self.remotes.clear();
        for (id, mut reg) in std::mem::take(&mut self.registrations) {
            if let Err(e) = reg.handle.deregister() {
                tracing::warn!(registration = %id, error = %e, "deregistering at teardown failed");
            }
        }
    }
}

/// The NIXL agent, destroyed under the process-wide lifecycle lock.
pub(super) struct NixlHandle {
    pub(super) agent: ManuallyDrop<nixl::Agent>,
}

impl Drop for NixlHandle {
    fn drop(&mut self) {
        let _guard = lifecycle_lock();
        // SAFETY: dropped exactly once, here, and never used afterwards. By now `State::drop` has
        // dropped every registration, prepared list and request, so this is the last reference
        // to the NIXL agent and its destruction happens under the lock.
        unsafe { ManuallyDrop::drop(&mut self.agent) };
    }
}

/// A memory registration: the NIXL handle and the memory it covers. `handle` is declared before
/// `_memory`, so even without an explicit deregistration the memory outlives the registration.
pub(super) struct Registration {
    pub(super) handle: nixl::RegistrationHandle,
    pub(super) region: MemRegion,
    pub(super) _memory: Arc<dyn KvMemory>,
    /// Transfers in flight over it.
    pub(super) users: usize,
    /// Deregistered: gone for new calls, deregistered from NIXL when `users` drops to zero.
    pub(super) retired: bool,
}

/// A remote agent whose metadata is loaded.
pub(super) struct Remote {
    /// Its registered memory, from its metadata: remote descriptor lists must lie inside.
    pub(super) regions: Vec<MemRegion>,
    /// NIXL's part of its metadata, as loaded.
    pub(super) nixl_md: Vec<u8>,
    /// Transfers in flight to it.
    pub(super) users: usize,
    /// Forgotten: gone for new calls, its NIXL metadata invalidated when `users` drops to zero.
    pub(super) forgotten: bool,
}

/// A prepared descriptor list (`nixlDlistH`).
pub(super) struct PreparedDlist(pub(super) nixl::XferDlistHandle);

// SAFETY: the handle points to a NIXL-owned list with no thread affinity; NIXL only requires that
// calls on one agent do not run concurrently. The handle is used, and released (in its Drop), only
// by methods of `State`, that is with the owning agent's mutex held, and always before the NIXL
// agent is destroyed (see `State`'s Drop).
unsafe impl Send for PreparedDlist {}

pub(super) struct Dlist {
    /// NIXL's list of one descriptor per block per region, which `post` indexes: prepared when
    /// a `post` first uses the list (`post_blocks` needs none).
    pub(super) prepared: Option<PreparedDlist>,
    pub(super) owner: DlistOwner,
    pub(super) blocks: BlockList,
    /// A local list: the registration holding each of its regions (empty for a remote list).
    pub(super) registrations: Vec<RegistrationId>,
}

impl Dlist {
    pub(super) fn view(&self) -> DlistView<'_> {
        DlistView { owner: &self.owner, blocks: &self.blocks }
    }
}

/// What a transfer in flight uses: its local registrations and its remote.
pub(super) struct Uses {
    pub(super) registrations: Vec<RegistrationId>,
    pub(super) remote: AgentName,
}

pub(super) struct Xfer {
    /// `Pending` until NIXL reports completion or failure; then fixed.
    pub(super) state: XferState,
    /// Released (and cancelled if in flight) when dropped; dropped when the transfer settles.
    pub(super) request: Option<nixl::XferRequest>,
    /// Until the transfer settles.
    pub(super) uses: Option<Uses>,
    /// `drain_completions` has reported it (once settled).
    pub(super) reported: bool,
}

impl Xfer {
    /// Asks NIXL where the transfer stands; returns what it used once it has just settled.
    pub(super) fn refresh(&mut self, agent: &nixl::Agent) -> Option<Uses> {
        let request = self.request.as_ref().filter(|_| self.state == XferState::Pending)?;
        self.state = match agent.get_xfer_status(request) {
            Ok(nixl::XferStatus::Success) => XferState::Done,
            Ok(nixl::XferStatus::InProgress) => return None,
            Err(e) => XferState::Failed(nixl_error(ErrorKind::Transfer, "the NIXL transfer failed", e)),
        };
        self.settle()
    }

    /// Lets the request go once the transfer has settled; returns what it used.
    pub(super) fn settle(&mut self) -> Option<Uses> {
        self.request = None;
        self.uses.take()
    }
}

/// Moves the notifications NIXL has received into `out`, with their senders.
pub(super) fn fetch_notifications(agent: &nixl::Agent, out: &mut Vec<Notification>) -> Result<()> {
    // A fresh map per call: nixl-sys offers no way to clear one without converting every payload
    // to a String, and NIXL appends to the map it is given.
    let mut map = nixl::NotificationMap::new().nixl(ErrorKind::Backend, "creating a notification map")?;
    agent.get_notifications(&mut map, None).nixl(ErrorKind::Backend, "getting notifications")?;
    if map.is_empty().nixl(ErrorKind::Backend, "reading notifications")? {
        return Ok(());
    }
    let senders: Vec<String> = map
        .agents()
        .map(|sender| sender.map(str::to_owned))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| nixl_error(ErrorKind::InvalidPeerData, "a notification's sender name", e))?;
    for sender in senders {
        let from = AgentName::new(sender.as_str());
        for msg in map.get_notifications(&sender).nixl(ErrorKind::Backend, "reading notifications")? {
            let msg = msg.nixl(ErrorKind::Backend, "reading a notification")?;
            if msg.len() > MAX_NOTIFICATION_LEN {
                // No kvx agent sends one: a peer's bug, dropped rather than failing the receiver.
                tracing::warn!(from = %from, len = msg.len(), "dropping a notification over the limit");
                continue;
            }
            out.push(Notification { from: from.clone(), msg });
        }
    }
    Ok(())
}
