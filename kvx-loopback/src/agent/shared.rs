//! The part of an agent that its peers and its progress thread reach ([`AgentShared`]): its state,
//! inbox and faults, and the progress pass that runs its transfers.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvx_core::post::{BlockRuns, DlistView};
use kvx_core::{
    AgentName, BlockList, DlistOwner, Error, ErrorKind, KvMemory, MemRegion, Notification, Result, XferOp,
};

use crate::copy::{Pinned, PinnedSet, copy_checked};
use crate::fabric::FabricInner;
use crate::faults::{FaultPlan, message_key, stray_message};
use crate::lock;
use crate::metadata::RemoteRegion;

use super::err;

/// The part of an agent that its peers (through the fabric) and its progress thread reach.
pub(crate) struct AgentShared {
    pub(super) name: AgentName,
    pub(super) instance: u64,
    pub(super) fabric: Arc<FabricInner>,
    pub(super) state: Mutex<AgentState>,
    pub(super) inbox: Mutex<Inbox>,
    pub(super) faults: Mutex<FaultPlan>,
}

/// Notifications that reached an agent: ready to drain, or delayed by a fault until a time of
/// the fabric's clock (with their event key, which orders those due at the same time).
#[derive(Debug, Default)]
pub(super) struct Inbox {
    pub(super) ready: Vec<Notification>,
    pub(super) delayed: Vec<(Instant, u64, Notification)>,
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
    /// Waiting for a progress pass; it is skipped while `passes_left > 0` or the fabric's clock
    /// is before `not_before`.
    Queued {
        passes_left: u32,
        not_before: Option<Instant>,
    },
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
    /// Injected failure: what the fault says.
    pub(super) fail: Option<String>,
}

impl AgentShared {
    pub(crate) fn new(name: AgentName, instance: u64, fabric: Arc<FabricInner>) -> Self {
        AgentShared {
            name,
            instance,
            fabric,
            state: Mutex::new(AgentState::default()),
            inbox: Mutex::new(Inbox::default()),
            faults: Mutex::new(FaultPlan::default()),
        }
    }

    pub(super) fn state(&self) -> Result<std::sync::MutexGuard<'_, AgentState>> {
        lock(&self.state, "agent state")
    }

    pub(super) fn refuses_handshakes(&self) -> Result<bool> {
        Ok(lock(&self.faults, "agent faults")?.refuses_handshakes())
    }

    /// One progress pass: runs every queued transfer whose delay is over, and queues the ids of
    /// those that ended for `drain_completions`. Looks at the queued transfers only, so its cost
    /// is linear in them. Returns how many transfers are still queued (delayed) afterwards.
    pub(super) fn pass(&self) -> Result<usize> {
        let (jobs, still_queued) = {
            let now = self.fabric.clock.now();
            let mut st = self.state()?;
            let AgentState { xfers, queued, .. } = &mut *st;
            let mut jobs = Vec::new();
            queued.retain(|id| {
                let Some(xfer) = xfers.get_mut(id) else { return false };
                let Stage::Queued { passes_left, not_before } = &mut xfer.stage else { return false };
                if *passes_left > 0 {
                    *passes_left -= 1;
                    true
                } else if not_before.is_some_and(|t| t > now) {
                    true
                } else if let Some(job) = xfer.job.take() {
                    xfer.stage = Stage::Copying;
                    jobs.push((*id, job));
                    false
                } else {
                    false
                }
            });
            (jobs, queued.len())
        };
        if jobs.is_empty() {
            return Ok(still_queued);
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
        Ok(still_queued)
    }

    /// Performs one transfer: checks that the peer still serves the remote blocks, copies every
    /// block, then delivers the notification. Holds no lock of this agent.
    pub(super) fn run(&self, job: Job) -> Stage {
        let failed = |msg: String| Stage::Failed(err(ErrorKind::Transfer, msg));
        if let Some(reason) = job.fail {
            return failed(reason);
        }
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

    /// Puts a notification from this agent into `peer`'s inbox, as the faults say.
    pub(super) fn deliver(&self, peer: &AgentShared, msg: Vec<u8>) -> Result<()> {
        let key = message_key(self.name.as_str(), peer.name.as_str(), &msg);
        let mine = lock(&self.faults, "agent faults")?.next_notification(key);
        let fabric = lock(&self.fabric.faults, "fabric faults")?.next_notification(key);
        let delivery = mine.combine(fabric);
        lock(&self.fabric.injected, "fabric fault counts")?.count_delivery(&delivery);
        if delivery.copies == 0 {
            tracing::debug!(from = %self.name, to = %peer.name, "loopback: injected fault drops a notification");
        }
        let stray = delivery.stray.map(|seed| stray_message(seed, &msg));
        let due = (!delivery.delay.is_zero()).then(|| self.fabric.clock.now() + delivery.delay);
        let mut inbox = lock(&peer.inbox, "agent inbox")?;
        for _ in 0..delivery.copies {
            let n = Notification { from: self.name.clone(), msg: msg.clone() };
            match due {
                Some(due) => inbox.delayed.push((due, key, n)),
                None => inbox.ready.push(n),
            }
        }
        if let Some(stray) = stray {
            inbox.ready.push(Notification { from: self.name.clone(), msg: stray });
        }
        Ok(())
    }

    /// When this agent next has something to do: `now` for a transfer a pass would run or a
    /// notification to drain, else the earliest time a delayed one is due.
    pub(crate) fn next_event(&self, now: Instant) -> Result<Option<Instant>> {
        let st = self.state()?;
        let transfers = st
            .queued
            .iter()
            .filter_map(|id| st.xfers.get(id))
            .filter_map(|x| match x.stage {
                Stage::Queued { passes_left: 0, not_before } => Some(not_before.unwrap_or(now).max(now)),
                Stage::Queued { .. } => Some(now),
                _ => None,
            })
            .min();
        drop(st);
        let inbox = lock(&self.inbox, "agent inbox")?;
        let notifications = if inbox.ready.is_empty() {
            inbox.delayed.iter().map(|(due, ..)| (*due).max(now)).min()
        } else {
            Some(now)
        };
        Ok(transfers.into_iter().chain(notifications).min())
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
