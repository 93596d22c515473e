//! The part of an agent that its peers and its progress thread reach ([`AgentShared`]): its state
//! and inbox, and the progress pass that runs its transfers.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};

use kvx_core::post::{BlockRuns, DlistView};
use kvx_core::{
    AgentName, BlockList, DlistOwner, Error, ErrorKind, KvMemory, MemRegion, Notification, NotificationWaker,
    Result, XferOp,
};

use crate::copy::{Pinned, PinnedSet, copy_checked};
use crate::fabric::FabricInner;
use crate::lock;
use crate::metadata::RemoteRegion;

use super::err;

/// The part of an agent that its peers (through the fabric) and its progress thread reach.
pub(crate) struct AgentShared {
    pub(super) name: AgentName,
    pub(super) instance: u64,
    pub(super) fabric: Arc<FabricInner>,
    pub(super) state: Mutex<AgentState>,
    /// Notifications that reached the agent, in arrival order.
    pub(super) inbox: Mutex<Vec<Notification>>,
    /// Called after each notification that reached the agent (`wake_on_notification`).
    pub(super) waker: Mutex<Option<NotificationWaker>>,
}

#[derive(Debug, Default)]
pub(super) struct AgentState {
    pub(super) next_id: u64,
    pub(super) registrations: HashMap<u64, Registration>,
    pub(super) remotes: HashMap<AgentName, Remote>,
    pub(super) dlists: HashMap<u64, Dlist>,
    pub(super) xfers: HashMap<u64, Xfer>,
    /// The transfers in [`Stage::Queued`], ordered by id: what a pass looks at, in post order (so
    /// it runs transfers, and sends their notifications, in post order).
    pub(super) queued: BTreeSet<u64>,
    /// The transfers that became `Done` or `Failed` and that `drain_completions` has not reported
    /// yet, in the order they did. A released one is skipped when they are drained.
    pub(super) completed: Vec<u64>,
}

#[derive(Debug)]
pub(super) struct Registration {
    pub(super) region: MemRegion,
    pub(super) memory: Arc<dyn KvMemory>,
}

#[derive(Debug)]
pub(super) struct Remote {
    pub(super) instance: u64,
    pub(super) regions: Vec<RemoteRegion>,
}

#[derive(Debug)]
pub(super) struct Dlist {
    pub(super) owner: DlistOwner,
    pub(super) blocks: BlockList,
    /// The registration holding each of its regions: this agent's for a local list, the peer's
    /// (as its metadata names them) for a remote list.
    pub(super) registrations: Vec<u64>,
}

impl Dlist {
    pub(super) fn view(&self) -> DlistView<'_> {
        DlistView { owner: &self.owner, blocks: &self.blocks }
    }
}

#[derive(Debug)]
pub(super) struct Xfer {
    pub(super) stage: Stage,
    pub(super) job: Option<Job>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Stage {
    /// Waiting for a progress pass.
    Queued,
    /// A pass has taken the job and is copying.
    Copying,
    Done,
    Failed(Error),
}

/// The memory a transfer copies, resolved and validated at post time.
#[derive(Debug)]
pub(super) enum Copies {
    /// (local address, remote address) of each block of `post`, blocks of `block_len` bytes.
    Blocks { spans: Vec<(u64, u64)>, block_len: u64 },
    /// The coalesced ranges of `post_blocks`.
    Runs(BlockRuns),
}

impl Copies {
    /// (local address, remote address, length) of each copy.
    pub(super) fn ranges(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let (blocks, runs) = match self {
            Copies::Blocks { spans, block_len } => (Some((spans, *block_len)), None),
            Copies::Runs(runs) => (None, Some(runs)),
        };
        let blocks = blocks.into_iter().flat_map(|(spans, len)| spans.iter().map(move |&(l, r)| (l, r, len)));
        blocks.chain(runs.into_iter().flat_map(|runs| runs.iter().map(|r| (r.local, r.remote, r.len))))
    }
}

/// What a transfer does, resolved and validated at post time.
#[derive(Debug)]
pub(super) struct Job {
    pub(super) op: XferOp,
    pub(super) peer: AgentName,
    pub(super) peer_instance: u64,
    /// The local registrations the blocks lie in, captured at post time: the transfer keeps them
    /// (and so the memory) until it settles, whatever is deregistered meanwhile.
    pub(super) local: PinnedSet,
    /// What to copy.
    pub(super) copies: Copies,
    pub(super) notify: Option<Vec<u8>>,
}

impl AgentShared {
    pub(crate) fn new(name: AgentName, instance: u64, fabric: Arc<FabricInner>) -> Self {
        AgentShared {
            name,
            instance,
            fabric,
            state: Mutex::new(AgentState::default()),
            inbox: Mutex::new(Vec::new()),
            waker: Mutex::new(None),
        }
    }

    pub(super) fn state(&self) -> Result<std::sync::MutexGuard<'_, AgentState>> {
        lock(&self.state, "agent state")
    }

    /// One progress pass: runs every queued transfer, and queues the ids of those that ended for
    /// `drain_completions`. Looks at the queued transfers only, so its cost is linear in them.
    pub(super) fn pass(&self) -> Result<()> {
        let jobs = {
            let mut st = self.state()?;
            let AgentState { xfers, queued, .. } = &mut *st;
            let mut jobs = Vec::new();
            for id in std::mem::take(queued) {
                let Some(xfer) = xfers.get_mut(&id).filter(|x| x.stage == Stage::Queued) else { continue };
                if let Some(job) = xfer.job.take() {
                    xfer.stage = Stage::Copying;
                    jobs.push((id, job));
                }
            }
            jobs
        };
        if jobs.is_empty() {
            return Ok(());
        }
        // Each job, and with it its hold on the local memory, is dropped once it has run.
        let outcomes: Vec<(u64, Stage)> = jobs.into_iter().map(|(id, job)| (id, self.run(job))).collect();
        let mut st = self.state()?;
        for (id, stage) in outcomes {
            // A transfer released while it was copying is simply gone.
            if let Some(xfer) = st.xfers.get_mut(&id) {
                xfer.stage = stage;
                st.completed.push(id);
            }
        }
        // A caller that releases without draining leaves released ids behind: drop them once
        // they outnumber the live transfers (amortised constant time per transfer).
        if st.completed.len() > 2 * st.xfers.len() + 64 {
            let AgentState { xfers, completed, .. } = &mut *st;
            completed.retain(|id| xfers.contains_key(id));
        }
        Ok(())
    }

    /// Performs one transfer: checks that the peer still serves the remote blocks, copies every
    /// block, then delivers the notification. Holds no lock of this agent.
    pub(super) fn run(&self, job: Job) -> Stage {
        let failed = |msg: String| Stage::Failed(err(ErrorKind::Transfer, msg));
        let peer = match self.fabric.lookup(&job.peer, job.peer_instance) {
            Ok(Some(peer)) => peer,
            Ok(None) => return failed(format!("peer {} is gone (dropped or restarted)", job.peer)),
            Err(e) => return Stage::Failed(e),
        };
        // Pin the peer's registrations as they are now: a range the peer deregistered since the
        // post fails the transfer (as a transport's access to unmapped memory would), and the
        // pinned `Arc`s keep the memory alive while we copy.
        let remote = match peer.state() {
            Ok(st) => pin(&st.registrations),
            Err(e) => return Stage::Failed(e),
        };
        if job.copies.ranges().any(|(_, ra, len)| !remote.holds(ra, len)) {
            return failed(format!("agent {} no longer serves the memory of the transfer", job.peer));
        }
        for (la, ra, len) in job.copies.ranges() {
            let copied = match job.op {
                XferOp::Read => copy_checked(&remote, ra, &job.local, la, len),
                XferOp::Write => copy_checked(&job.local, la, &remote, ra, len),
            };
            if !copied {
                // Unreachable: the local side is pinned since the post and the remote side was
                // checked above. Kept so that a bug fails the transfer, not memory.
                return Stage::Failed(err(
                    ErrorKind::Backend,
                    "a block left registered memory during the copy",
                ));
            }
        }
        if let Some(msg) = job.notify {
            if let Err(e) = self.deliver(&peer, msg) {
                return Stage::Failed(e.context("data copied, notification failed"));
            }
        }
        Stage::Done
    }

    /// Puts a notification from this agent into `peer`'s inbox, and wakes whoever waits for it.
    pub(super) fn deliver(&self, peer: &AgentShared, msg: Vec<u8>) -> Result<()> {
        lock(&peer.inbox, "agent inbox")?.push(Notification { from: self.name.clone(), msg });
        // The notification is delivered: a waker that cannot be reached fails nothing.
        let waker = lock(&peer.waker, "agent waker").ok().and_then(|w| w.clone());
        if let Some(wake) = waker {
            wake.wake();
        }
        Ok(())
    }
}

pub(super) fn pin(registrations: &HashMap<u64, Registration>) -> PinnedSet {
    PinnedSet::new(
        registrations.values().map(|r| Pinned { region: r.region, memory: r.memory.clone() }).collect(),
    )
}

impl Drop for AgentShared {
    fn drop(&mut self) {
        self.fabric.remove(&self.name, self.instance);
    }
}

impl fmt::Debug for AgentShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentShared").field("name", &self.name).field("instance", &self.instance).finish()
    }
}
