//! [`LoopbackAgent`]: a [`TransferAgent`] whose transport is a memcpy between agents of one
//! [`Fabric`](crate::Fabric).
//!
//! Locking: an agent's `state`, its `inbox`, its `faults`, the fabric's table and the fabric's
//! faults are separate mutexes. A thread holds at most one agent's `state` at a time (a progress
//! pass releases its own before taking a peer's), and takes a faults or inbox lock only briefly,
//! never while holding a peer's lock: no lock-order cycle, so no deadlock, also with two agents
//! transferring to each other from two threads.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvx_core::post::{DlistView, check_notification};
use kvx_core::wire::agent_metadata;
use kvx_core::{
    AgentName, BlockList, Capabilities, DlistId, DlistOwner, Error, ErrorKind, KvMemory, MemKind, MemRegion,
    Notification, PostRequest, RegistrationId, Result, TransferAgent, XferId, XferOp, XferState,
};

use crate::copy::{Pinned, PinnedSet, copy_checked};
use crate::fabric::FabricInner;
use crate::faults::{FaultPlan, Faults, TransferFate, message_key, stray_message};
use crate::metadata::{AgentMetadata, RemoteRegion};
use crate::{BACKEND, lock};

const CAPABILITIES: Capabilities =
    Capabilities { backend: BACKEND, dram: true, vram: false, read: true, write: true, notifications: true };

/// How an agent is progressed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentOptions {
    progress_thread: Option<Duration>,
}

impl AgentOptions {
    /// Explicit progress (the default): transfers move only inside `progress`,
    /// `drain_completions` and `drain_notifications`, one pass per call (`poll` is a lookup).
    /// Deterministic.
    pub fn explicit() -> Self {
        AgentOptions { progress_thread: None }
    }

    /// A background thread performs the transfers: it runs a pass as soon as a transfer is posted
    /// and, while delayed transfers wait, every `retry` (bounded below by 10 µs). `progress`,
    /// `drain_completions` and `drain_notifications` then only wake it. The thread is stopped and joined when the
    /// agent is dropped.
    pub fn progress_thread(retry: Duration) -> Self {
        AgentOptions { progress_thread: Some(retry.max(Duration::from_micros(10))) }
    }
}

/// An in-process [`TransferAgent`] over real host memory: READ and WRITE copy the bytes between
/// the registered memory of two agents of one [`Fabric`](crate::Fabric).
///
/// Create it with [`Fabric::agent`](crate::Fabric::agent). See the crate documentation for the
/// progress model and [`Faults`] for fault injection.
pub struct LoopbackAgent {
    // Dropped first: the progress thread is stopped and joined before the agent goes away.
    thread: Option<ProgressThread>,
    shared: Arc<AgentShared>,
}

/// The part of an agent that its peers (through the fabric) and its progress thread reach.
pub(crate) struct AgentShared {
    name: AgentName,
    instance: u64,
    fabric: Arc<FabricInner>,
    state: Mutex<AgentState>,
    inbox: Mutex<Inbox>,
    faults: Mutex<FaultPlan>,
}

/// Notifications that reached an agent: ready to drain, or delayed by a fault until a time of
/// the fabric's clock (with their event key, which orders those due at the same time).
#[derive(Debug, Default)]
struct Inbox {
    ready: Vec<Notification>,
    delayed: Vec<(Instant, u64, Notification)>,
}

#[derive(Debug, Default)]
struct AgentState {
    next_id: u64,
    registrations: HashMap<u64, Registration>,
    remotes: HashMap<AgentName, Remote>,
    dlists: HashMap<u64, Dlist>,
    xfers: HashMap<u64, Xfer>,
    /// The transfers in [`Stage::Queued`], ordered by id: what a pass looks at, in post order (so
    /// it runs transfers, and sends their notifications, in post order).
    queued: BTreeSet<u64>,
    /// The transfers that became `Done` or `Failed` and that `drain_completions` has not reported
    /// yet, in the order they did. A released one is skipped when they are drained.
    completed: Vec<u64>,
}

#[derive(Debug)]
struct Registration {
    region: MemRegion,
    memory: Arc<dyn KvMemory>,
}

#[derive(Debug)]
struct Remote {
    instance: u64,
    regions: Vec<RemoteRegion>,
}

#[derive(Debug)]
struct Dlist {
    owner: DlistOwner,
    blocks: BlockList,
    /// A local list: the registration holding each of its regions (empty for a remote list).
    registrations: Vec<u64>,
}

impl Dlist {
    fn view(&self) -> DlistView<'_> {
        DlistView { owner: &self.owner, blocks: &self.blocks }
    }
}

#[derive(Debug)]
struct Xfer {
    stage: Stage,
    job: Option<Job>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
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

/// What a transfer does, resolved and validated at post time.
#[derive(Debug)]
struct Job {
    op: XferOp,
    peer: AgentName,
    peer_instance: u64,
    /// The local registrations the blocks lie in, captured at post time: the transfer keeps them
    /// (and so the memory) until it settles, whatever is deregistered meanwhile.
    local: PinnedSet,
    /// (local address, remote address) of each block.
    spans: Vec<(u64, u64)>,
    block_len: u64,
    notify: Option<Vec<u8>>,
    /// Injected failure: what the fault says.
    fail: Option<String>,
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

    fn state(&self) -> Result<std::sync::MutexGuard<'_, AgentState>> {
        lock(&self.state, "agent state")
    }

    fn refuses_handshakes(&self) -> Result<bool> {
        Ok(lock(&self.faults, "agent faults")?.refuses_handshakes())
    }

    /// One progress pass: runs every queued transfer whose delay is over, and queues the ids of
    /// those that ended for `drain_completions`. Looks at the queued transfers only, so its cost
    /// is linear in them. Returns how many transfers are still queued (delayed) afterwards.
    fn pass(&self) -> Result<usize> {
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
    fn run(&self, job: Job) -> Stage {
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
        let len = job.block_len;
        if job.spans.iter().any(|&(_, ra)| !remote.holds(ra, len)) {
            return failed(format!("agent {} no longer serves the memory of the transfer", job.peer));
        }
        for &(la, ra) in &job.spans {
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
    fn deliver(&self, peer: &AgentShared, msg: Vec<u8>) -> Result<()> {
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

fn pin(registrations: &HashMap<u64, Registration>) -> PinnedSet {
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

fn err(kind: ErrorKind, msg: impl Into<String>) -> Error {
    Error::new(kind, msg).with_backend(BACKEND)
}

impl LoopbackAgent {
    pub(crate) fn start(shared: Arc<AgentShared>, options: AgentOptions) -> Result<Self> {
        let thread = match options.progress_thread {
            Some(retry) => Some(ProgressThread::spawn(shared.clone(), retry)?),
            None => None,
        };
        Ok(LoopbackAgent { thread, shared })
    }

    /// Sets faults for this agent, replacing earlier ones and restarting their counts.
    /// [`Faults::none`] clears them.
    pub fn set_faults(&self, faults: Faults) -> Result<()> {
        lock(&self.shared.faults, "agent faults")?.set(faults);
        Ok(())
    }

    /// Whether a background thread progresses this agent.
    pub fn has_progress_thread(&self) -> bool {
        self.thread.is_some()
    }

    /// Drives transfers: one pass now, or a wake-up of the progress thread.
    fn drive(&self) -> Result<()> {
        match &self.thread {
            Some(t) => t.wake(),
            None => self.shared.pass().map(|_| ()),
        }
    }

    fn next_id(st: &mut AgentState) -> u64 {
        // One id space for registrations, lists and transfers; 2^64 ids do not run out.
        st.next_id = st.next_id.wrapping_add(1);
        st.next_id
    }
}

impl TransferAgent for LoopbackAgent {
    fn name(&self) -> &AgentName {
        &self.shared.name
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn register(&self, memory: Arc<dyn KvMemory>) -> Result<RegistrationId> {
        let region = memory.region();
        if region.kind != MemKind::Dram {
            return Err(err(
                ErrorKind::Unsupported,
                format!("loopback registers host memory only, not {region:?}"),
            ));
        }
        if region.len == 0 || region.end().is_none() {
            return Err(err(
                ErrorKind::InvalidArgument,
                format!("invalid region {:#x}+{}", region.addr, region.len),
            ));
        }
        let mut st = self.shared.state()?;
        let id = Self::next_id(&mut st);
        st.registrations.insert(id, Registration { region, memory });
        Ok(RegistrationId(id))
    }

    fn deregister(&self, registration: RegistrationId) -> Result<()> {
        let mut st = self.shared.state()?;
        let removed = st.registrations.remove(&registration.0);
        if removed.is_some() {
            st.dlists.retain(|_, d| !d.registrations.contains(&registration.0));
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
        if self.shared.refuses_handshakes()?
            || lock(&self.shared.fabric.faults, "fabric faults")?.refuses_handshakes()
        {
            return Err(handshake(format!("injected fault: {} refuses handshakes", self.shared.name)));
        }
        let (name, md) = AgentMetadata::open(metadata)?;
        if md.fabric != self.shared.fabric.id {
            return Err(handshake(format!("agent {name} lives on another fabric: unreachable")));
        }
        let peer = self.shared.fabric.lookup(&name, md.instance)?.ok_or_else(|| {
            handshake(format!("agent {name} is gone (dropped or restarted): stale metadata"))
        })?;
        if peer.refuses_handshakes()? {
            return Err(handshake(format!("injected fault: {name} refuses handshakes")));
        }
        drop(peer);
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
        let bad_kind = match owner {
            DlistOwner::Local => ErrorKind::InvalidArgument,
            DlistOwner::Remote(_) => ErrorKind::InvalidPeerData,
        };
        if blocks.block_len == 0 {
            return Err(err(bad_kind, "descriptor list with zero-length blocks"));
        }
        let mut st = self.shared.state()?;
        // (registration id, region); remote regions carry no id of this agent.
        let registered: Vec<(Option<u64>, MemRegion)> = match owner {
            DlistOwner::Local => st.registrations.iter().map(|(&id, r)| (Some(id), r.region)).collect(),
            DlistOwner::Remote(agent) => st
                .remotes
                .get(agent)
                .ok_or_else(|| err(ErrorKind::NotFound, format!("agent {agent} is not loaded")))?
                .regions
                .iter()
                .map(|r| (None, r.region()))
                .collect(),
        };
        let mut registrations = Vec::new();
        for (i, region) in blocks.regions().enumerate() {
            // The oldest registration that holds the region, for a deterministic choice.
            let holder = region.and_then(|region| {
                registered.iter().filter(|(_, r)| r.contains(&region)).map(|(id, _)| *id).min()
            });
            let Some(holder) = holder else {
                return Err(err(
                    bad_kind,
                    format!(
                        "region {i} of the list ({:?} {:#x}, {} blocks of {} bytes) is not inside one registration of {}",
                        blocks.kind,
                        blocks.bases.get(i).copied().unwrap_or_default(),
                        blocks.num_blocks,
                        blocks.block_len,
                        match owner {
                            DlistOwner::Local => "this agent".to_owned(),
                            DlistOwner::Remote(a) => format!("agent {a}"),
                        }
                    ),
                ));
            };
            registrations.extend(holder);
        }
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
        let mut st = self.shared.state()?;
        let request = PostRequest { op, local, local_descs, remote, remote_descs, notify };
        let plan = request.check(&CAPABILITIES, |id| st.dlists.get(&id.0).map(Dlist::view))?;
        let peer = plan.peer().clone();
        // Lists of a forgotten peer are released with it, so a remote list's peer is loaded.
        let peer_instance = st
            .remotes
            .get(&peer)
            .ok_or_else(|| err(ErrorKind::State, format!("a list of agent {peer}, which is not loaded")))?
            .instance;
        // The registrations the local blocks lie in, once each. Deregistering releases the lists
        // over the memory, so all of them are registered (a bug would fail the copy, see `run`).
        let list_regs = st.dlists.get(&local.0).map(|d| d.registrations.as_slice()).unwrap_or_default();
        let mut used: Vec<u64> =
            plan.pairs().iter().filter_map(|(l, _)| list_regs.get(l.region).copied()).collect();
        used.sort_unstable();
        used.dedup();
        let pinned = used
            .iter()
            .filter_map(|id| st.registrations.get(id))
            .map(|r| Pinned { region: r.region, memory: r.memory.clone() })
            .collect();
        let spans: Vec<(u64, u64)> = plan.pairs().iter().map(|(l, r)| (l.addr, r.addr)).collect();
        // Everything is valid: count the transfer for the faults and queue it. Its notification
        // names it for the seeded faults.
        let key = notify.map(|m| message_key(self.shared.name.as_str(), peer.as_str(), m));
        let mine = lock(&self.shared.faults, "agent faults")?.next_transfer(key);
        let fabric = lock(&self.shared.fabric.faults, "fabric faults")?.next_transfer(key);
        let fate = mine.combine(fabric);
        lock(&self.shared.fabric.injected, "fabric fault counts")?.count_transfer(&fate);
        let TransferFate { fail, delay_passes, delay } = fate;
        let not_before = (!delay.is_zero()).then(|| self.shared.fabric.clock.now() + delay);
        let job = Job {
            op,
            peer,
            peer_instance,
            local: PinnedSet::new(pinned),
            spans,
            block_len: plan.block_len(),
            notify: notify.map(<[u8]>::to_vec),
            fail,
        };
        let id = Self::next_id(&mut st);
        st.xfers.insert(
            id,
            Xfer { stage: Stage::Queued { passes_left: delay_passes, not_before }, job: Some(job) },
        );
        st.queued.insert(id);
        drop(st);
        if let Some(t) = &self.thread {
            t.wake()?;
        }
        Ok(XferId(id))
    }

    /// A lookup: moves nothing (see [`drain_completions`](TransferAgent::drain_completions)).
    fn poll(&self, xfer: XferId) -> Result<XferState> {
        let st = self.shared.state()?;
        let x =
            st.xfers.get(&xfer.0).ok_or_else(|| err(ErrorKind::NotFound, format!("no transfer {xfer}")))?;
        Ok(match &x.stage {
            Stage::Queued { .. } | Stage::Copying => XferState::Pending,
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
        let mut inbox = lock(&self.shared.inbox, "agent inbox")?;
        out.append(&mut inbox.ready);
        if !inbox.delayed.is_empty() {
            let now = self.shared.fabric.clock.now();
            let (mut due, later): (Vec<_>, Vec<_>) =
                std::mem::take(&mut inbox.delayed).into_iter().partition(|(t, ..)| *t <= now);
            inbox.delayed = later;
            due.sort_by_key(|(t, key, _)| (*t, *key));
            out.extend(due.into_iter().map(|(.., n)| n));
        }
        Ok(())
    }

    fn progress(&self) -> Result<()> {
        self.drive()
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

/// The optional background progress thread of one agent.
#[derive(Debug)]
struct ProgressThread {
    wake: Arc<Wake>,
    handle: Option<JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct Wake {
    flags: Mutex<WakeFlags>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct WakeFlags {
    stop: bool,
    kicked: bool,
}

/// How long an idle progress thread sleeps between checks when nothing wakes it.
const IDLE_WAIT: Duration = Duration::from_millis(100);

impl ProgressThread {
    fn spawn(shared: Arc<AgentShared>, retry: Duration) -> Result<Self> {
        let wake = Arc::new(Wake::default());
        let thread_wake = wake.clone();
        let handle = std::thread::Builder::new()
            .name(format!("kvx-loopback-{}", shared.name))
            .spawn(move || progress_loop(&shared, &thread_wake, retry))
            .map_err(|e| err(ErrorKind::Io, format!("spawning the progress thread: {e}")).with_source(e))?;
        Ok(ProgressThread { wake, handle: Some(handle) })
    }

    fn wake(&self) -> Result<()> {
        lock(&self.wake.flags, "progress thread flags")?.kicked = true;
        self.wake.cv.notify_one();
        Ok(())
    }
}

fn progress_loop(shared: &AgentShared, wake: &Wake, retry: Duration) {
    let mut queued = 0;
    loop {
        {
            let Ok(mut flags) = wake.flags.lock() else { return };
            if !flags.stop && !flags.kicked {
                let wait = if queued > 0 { retry } else { IDLE_WAIT };
                flags = match wake.cv.wait_timeout(flags, wait) {
                    Ok((flags, _)) => flags,
                    Err(_) => return,
                };
            }
            if flags.stop {
                return;
            }
            flags.kicked = false;
        }
        match shared.pass() {
            Ok(n) => queued = n,
            Err(e) => {
                // Only a poisoned lock fails a pass, and it stays poisoned: stop rather than spin.
                tracing::error!(agent = %shared.name, error = %e, "loopback progress thread stops");
                return;
            }
        }
    }
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        let mut flags = self.wake.flags.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        flags.stop = true;
        drop(flags);
        self.wake.cv.notify_one();
        if let Some(handle) = self.handle.take() {
            // The thread never panics by design; if it did, there is nothing left to clean up.
            let _ = handle.join();
        }
    }
}
