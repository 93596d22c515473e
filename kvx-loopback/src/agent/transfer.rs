//! The [`TransferAgent`] implementation of [`LoopbackAgent`].
//!
//! [`TransferAgent`]: kvx_core::TransferAgent

use std::sync::{Arc, MutexGuard};

use kvx_core::post::{BlockPostRequest, check_notification, place_dlist};
use kvx_core::wire::agent_metadata;
use kvx_core::{
    AgentName, BlockList, BlockPost, Capabilities, DlistId, DlistOwner, ErrorKind, KvMemory, MemRegion,
    Notification, NotificationWaker, PostRequest, RegistrationId, Result, TransferAgent, XferId, XferOp,
    XferState,
};

use crate::copy::{Pinned, PinnedSet};
use crate::metadata::{AgentMetadata, RemoteRegion};
use crate::{BACKEND, lock};

use super::shared::{AgentState, Copies, Dlist, Job, Registration, Remote, Stage, Xfer};
use super::{CAPABILITIES, LoopbackAgent, err};

impl TransferAgent for LoopbackAgent {
    fn name(&self) -> &AgentName {
        &self.shared.name
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn register(&self, memory: Arc<dyn KvMemory>) -> Result<RegistrationId> {
        let region = memory.region();
        CAPABILITIES.check_registration(&region)?;
        let mut st = self.shared.state()?;
        let id = Self::next_id(&mut st);
        st.registrations.insert(id, Registration { region, memory });
        Ok(RegistrationId(id))
    }

    fn deregister(&self, registration: RegistrationId) -> Result<()> {
        let mut st = self.shared.state()?;
        let removed = st.registrations.remove(&registration.0);
        if removed.is_some() {
            // Remote lists name the peer's registrations: not this agent's.
            st.dlists
                .retain(|_, d| d.owner != DlistOwner::Local || !d.registrations.contains(&registration.0));
        }
        drop(st);
        // The memory's Arc drops here, outside the lock: transfers in flight hold their own.
        match removed {
            Some(_) => Ok(()),
            None => Err(err(ErrorKind::NotFound, format!("no registration {registration}"))),
        }
    }

    fn local_metadata(&self) -> Result<Vec<u8>> {
        let mut regions: Vec<RemoteRegion> = self
            .shared
            .state()?
            .registrations
            .iter()
            .map(|(&id, r)| RemoteRegion { id, addr: r.region.addr, len: r.region.len })
            .collect();
        regions.sort_by_key(|r| r.id);
        let md = AgentMetadata { fabric: self.shared.fabric.id, instance: self.shared.instance, regions };
        agent_metadata::seal(BACKEND, &self.shared.name, &md)
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<AgentName> {
        let handshake = |msg: String| err(ErrorKind::Handshake, msg);
        let (name, md) = AgentMetadata::open(metadata)?;
        if md.fabric != self.shared.fabric.id {
            return Err(handshake(format!("agent {name} lives on another fabric: unreachable")));
        }
        if self.shared.fabric.lookup(&name, md.instance)?.is_none() {
            return Err(handshake(format!("agent {name} is gone (dropped or restarted): stale metadata")));
        }
        let mut st = self.shared.state()?;
        if st.remotes.contains_key(&name) {
            return Err(err(ErrorKind::State, format!("agent {name} is already loaded: forget it first")));
        }
        st.remotes.insert(name.clone(), Remote { instance: md.instance, regions: md.regions });
        Ok(name)
    }

    fn forget_remote(&self, agent: &AgentName) -> Result<()> {
        let mut st = self.shared.state()?;
        if st.remotes.remove(agent).is_none() {
            return Err(err(ErrorKind::NotFound, format!("agent {agent} is not loaded")));
        }
        // Transfers posted to it keep its name and instance: they run as if it were still loaded.
        st.dlists.retain(|_, d| !matches!(&d.owner, DlistOwner::Remote(a) if a == agent));
        Ok(())
    }

    fn prep_dlist(&self, owner: &DlistOwner, blocks: &BlockList) -> Result<DlistId> {
        let mut st = self.shared.state()?;
        // (registration id, region): this agent's, or the peer's as its metadata names them.
        let registered: Vec<(u64, MemRegion)> = match owner {
            DlistOwner::Local => st.registrations.iter().map(|(&id, r)| (id, r.region)).collect(),
            DlistOwner::Remote(agent) => st
                .remotes
                .get(agent)
                .ok_or_else(|| err(ErrorKind::NotFound, format!("agent {agent} is not loaded")))?
                .regions
                .iter()
                .map(|r| (r.id, r.region()))
                .collect(),
        };
        let registrations = place_dlist(&CAPABILITIES, owner, blocks, &registered)?;
        let id = Self::next_id(&mut st);
        st.dlists.insert(id, Dlist { owner: owner.clone(), blocks: blocks.clone(), registrations });
        Ok(DlistId(id))
    }

    fn release_dlist(&self, dlist: DlistId) -> Result<()> {
        match self.shared.state()?.dlists.remove(&dlist.0) {
            Some(_) => Ok(()),
            None => Err(err(ErrorKind::NotFound, format!("no descriptor list {dlist}"))),
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
        let st = self.shared.state()?;
        let request = PostRequest { op, local, local_descs, remote, remote_descs, notify };
        let plan = request.check(&CAPABILITIES, |id| st.dlists.get(&id.0).map(Dlist::view))?;
        let used = used_registrations(&st, local, plan.pairs().iter().map(|(l, _)| l.region));
        let spans: Vec<(u64, u64)> = plan.pairs().iter().map(|(l, r)| (l.addr, r.addr)).collect();
        let copies = Copies::Blocks { spans, block_len: plan.block_len() };
        let peer = plan.peer().clone();
        self.queue(st, op, peer, &used, copies, notify)
    }

    /// Checks and plans with kvx-core ([`BlockPostRequest::check`]) and keeps the plan's runs:
    /// O(blocks + regions) to post, one copy per range when the transfer runs.
    fn post_blocks(
        &self,
        op: XferOp,
        local: DlistId,
        remote: DlistId,
        blocks: &BlockPost<'_>,
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        let st = self.shared.state()?;
        let request = BlockPostRequest { op, local, remote, blocks: *blocks, notify };
        let joinable = |id: DlistId, region: usize| {
            let holders = st.dlists.get(&id.0).map(|d| d.registrations.as_slice()).unwrap_or_default();
            matches!(holders.get(region..region + 2), Some([a, b]) if a == b)
        };
        let plan = request.check(&CAPABILITIES, |id| st.dlists.get(&id.0).map(Dlist::view), joinable)?;
        let used = used_registrations(&st, local, plan.runs().regions());
        let peer = plan.peer().clone();
        let runs = plan.into_runs();
        self.queue(st, op, peer, &used, Copies::Runs(runs), notify)
    }

    /// A lookup: moves nothing (see [`drain_completions`](TransferAgent::drain_completions)).
    fn poll(&self, xfer: XferId) -> Result<XferState> {
        let st = self.shared.state()?;
        let x =
            st.xfers.get(&xfer.0).ok_or_else(|| err(ErrorKind::NotFound, format!("no transfer {xfer}")))?;
        Ok(match &x.stage {
            Stage::Queued | Stage::Copying => XferState::Pending,
            Stage::Done => XferState::Done,
            Stage::Failed(e) => XferState::Failed(e.clone()),
        })
    }

    fn release(&self, xfer: XferId) -> Result<()> {
        let mut st = self.shared.state()?;
        match st.xfers.remove(&xfer.0) {
            Some(_) => {
                // Still queued: cancelled. Its id in `completed`, if any, is skipped when drained.
                st.queued.remove(&xfer.0);
                Ok(())
            }
            None => Err(err(ErrorKind::NotFound, format!("no transfer {xfer}"))),
        }
    }

    /// One pass (or a wake-up of the progress thread), then the ids of the transfers that ended
    /// since the last call: linear in the transfers that ran and those that ended.
    fn drain_completions(&self, out: &mut Vec<XferId>) -> Result<()> {
        self.drive()?;
        let mut st = self.shared.state()?;
        let AgentState { xfers, completed, .. } = &mut *st;
        out.extend(completed.drain(..).filter(|id| xfers.contains_key(id)).map(XferId));
        Ok(())
    }

    fn notify(&self, agent: &AgentName, msg: &[u8]) -> Result<()> {
        check_notification(&CAPABILITIES, msg)?;
        let instance = self
            .shared
            .state()?
            .remotes
            .get(agent)
            .ok_or_else(|| err(ErrorKind::NotFound, format!("agent {agent} is not loaded")))?
            .instance;
        let peer = self.shared.fabric.lookup(agent, instance)?.ok_or_else(|| {
            err(ErrorKind::Transfer, format!("agent {agent} is gone (dropped or restarted)"))
        })?;
        self.shared.deliver(&peer, msg.to_vec())
    }

    fn drain_notifications(&self, out: &mut Vec<Notification>) -> Result<()> {
        self.drive()?;
        out.append(&mut *lock(&self.shared.inbox, "agent inbox")?);
        Ok(())
    }

    fn progress(&self) -> Result<()> {
        self.drive()
    }

    /// A notification reaches this agent on its sender's thread (whoever drives the sender, or
    /// the sender's progress thread): `wake` is called there, for each.
    fn wake_on_notification(&self, wake: NotificationWaker) -> bool {
        lock(&self.shared.waker, "agent waker").map(|mut w| *w = Some(wake)).is_ok()
    }
}

impl LoopbackAgent {
    /// Queues a checked transfer: pins the local registrations `used`, and wakes the progress
    /// thread.
    fn queue(
        &self,
        mut st: MutexGuard<'_, AgentState>,
        op: XferOp,
        peer: AgentName,
        used: &[u64],
        copies: Copies,
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        // Lists of a forgotten peer are released with it, so a remote list's peer is loaded.
        let peer_instance = st
            .remotes
            .get(&peer)
            .ok_or_else(|| err(ErrorKind::State, format!("a list of agent {peer}, which is not loaded")))?
            .instance;
        let pinned = used
            .iter()
            .filter_map(|id| st.registrations.get(id))
            .map(|r| Pinned { region: r.region, memory: r.memory.clone() })
            .collect();
        let job = Job {
            op,
            peer,
            peer_instance,
            local: PinnedSet::new(pinned),
            copies,
            notify: notify.map(<[u8]>::to_vec),
        };
        let id = Self::next_id(&mut st);
        st.xfers.insert(id, Xfer { stage: Stage::Queued, job: Some(job) });
        st.queued.insert(id);
        drop(st);
        if let Some(t) = &self.thread {
            t.wake()?;
        }
        Ok(XferId(id))
    }
}

/// The registrations the local blocks of `regions` (of list `local`) lie in, once each.
/// Deregistering releases the lists over the memory, so all of them are registered (a bug would
/// fail the copy, see `AgentShared::run`).
fn used_registrations(st: &AgentState, local: DlistId, regions: impl Iterator<Item = usize>) -> Vec<u64> {
    let list_regs = st.dlists.get(&local.0).map(|d| d.registrations.as_slice()).unwrap_or_default();
    let mut used: Vec<u64> = regions.filter_map(|r| list_regs.get(r).copied()).collect();
    used.sort_unstable();
    used.dedup();
    used
}
