//! What the agent's calls and its I/O tasks share ([`Inner`]): registrations, peers, descriptor
//! lists and the transfer table, with the rules by which a transfer's chunks settle.
//!
//! A transfer is cut into chunks; each chunk is one request on one of the peer's connections and
//! settles once two things happened: its request left (or could not), and its answer arrived (or
//! its connection was lost). The transfer is `Done` when every chunk was answered well (its
//! notification then goes out), `Failed` at the first chunk that was not; either way it keeps its
//! local memory until it is final, and its entry until every chunk settled, so that a late answer
//! finds it (and is thrown away) rather than writing into memory nobody holds.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvx_core::{
    AgentName, BlockList, DlistOwner, Error, ErrorKind, KvMemory, MemRegion, Notification, NotificationWaker,
    Result, XferOp,
};

use crate::config::TcpConfig;
use crate::error::err;
use crate::link::Peer;
use crate::memio::Pinned;
use crate::metadata::RemoteRegion;

/// The agent's shared part.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) name: AgentName,
    pub(crate) instance: u64,
    pub(crate) config: TcpConfig,
    pub(crate) runtime: tokio::runtime::Handle,
    state: Mutex<State>,
    /// Signalled whenever a transfer settles (dropping the agent waits for them).
    settled: Condvar,
    inbox: Mutex<Vec<Notification>>,
    /// Called after each notification queued (`TransferAgent::wake_on_notification`).
    waker: Mutex<Option<NotificationWaker>>,
    /// Notifications handed to a connection and not written yet (dropping the agent waits for
    /// them too: `notify` returns before the bytes leave).
    unsent: AtomicUsize,
    pub(crate) stats: Counters,
    nonces: RandomState,
}

#[derive(Debug, Default)]
pub(crate) struct State {
    next_id: u64,
    pub(crate) registrations: HashMap<u64, Registration>,
    pub(crate) remotes: HashMap<AgentName, Arc<Peer>>,
    pub(crate) dlists: HashMap<u64, Dlist>,
    pub(crate) xfers: HashMap<u64, Xfer>,
    /// Transfers that became final and that `drain_completions` has not reported yet.
    pub(crate) completed: Vec<u64>,
}

impl State {
    pub(crate) fn next_id(&mut self) -> u64 {
        // One id space for registrations, lists and transfers; 2^64 ids do not run out.
        self.next_id = self.next_id.wrapping_add(1);
        self.next_id
    }
}

#[derive(Debug)]
pub(crate) struct Registration {
    pub(crate) region: MemRegion,
    pub(crate) memory: Arc<dyn KvMemory>,
}

#[derive(Debug)]
pub(crate) struct Dlist {
    pub(crate) owner: DlistOwner,
    pub(crate) blocks: BlockList,
    /// The registration holding each region: this agent's, or the peer's as its metadata says.
    pub(crate) registrations: Vec<u64>,
}

/// One contiguous piece of a transfer: `len` bytes at `local` <-> `len` bytes at `remote`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
}

#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) pieces: Vec<Piece>,
    sent: bool,
    answered: bool,
    /// Its answer's data is being (or was) received into the slots: a second one is refused.
    taken: bool,
}

impl Chunk {
    pub(crate) fn new(pieces: Vec<Piece>) -> Chunk {
        Chunk { pieces, sent: false, answered: false, taken: false }
    }
}

#[derive(Debug)]
pub(crate) enum Stage {
    Pending,
    Done,
    Failed(Error),
}

#[derive(Debug)]
pub(crate) struct Xfer {
    pub(crate) nonce: u64,
    pub(crate) op: XferOp,
    pub(crate) peer: Arc<Peer>,
    pub(crate) stage: Stage,
    /// Released by its owner while pending: invisible, kept until its chunks settle.
    pub(crate) released: bool,
    pub(crate) chunks: Vec<Chunk>,
    unsettled: usize,
    /// The local registrations it uses, until it is final.
    memory: Vec<Arc<dyn KvMemory>>,
    notify: Option<Vec<u8>>,
}

impl Xfer {
    pub(crate) fn new(
        op: XferOp,
        nonce: u64,
        peer: Arc<Peer>,
        chunks: Vec<Chunk>,
        memory: Vec<Arc<dyn KvMemory>>,
        notify: Option<Vec<u8>>,
    ) -> Xfer {
        let unsettled = chunks.len();
        Xfer { nonce, op, peer, stage: Stage::Pending, released: false, chunks, unsettled, memory, notify }
    }

    /// The local ranges of chunk `k`, pinned.
    pub(crate) fn pin_chunk(&self, k: usize) -> Option<Pinned> {
        let chunk = self.chunks.get(k)?;
        let ranges: Vec<(u64, u64)> = chunk.pieces.iter().map(|p| (p.local, p.len)).collect();
        Pinned::new(&ranges, self.memory.clone())
    }
}

/// Which of a chunk's two events happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// Its request was written (or could not be).
    Sent,
    /// Its answer arrived (or its connection was lost).
    Answered,
}

/// Counters of what the agent refused and dropped, for tests and logs.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) connections_opened: AtomicU64,
    pub(crate) connections_accepted: AtomicU64,
    pub(crate) connections_dropped: AtomicU64,
    pub(crate) connections_parked: AtomicU64,
    pub(crate) connections_idle: AtomicU64,
    pub(crate) answers_refused: AtomicU64,
    pub(crate) answers_discarded: AtomicU64,
    pub(crate) requests_refused: AtomicU64,
    pub(crate) notifications_received: AtomicU64,
}

impl Counters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

impl Inner {
    pub(crate) fn new(
        name: AgentName,
        instance: u64,
        config: TcpConfig,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        Inner {
            name,
            instance,
            config,
            runtime,
            state: Mutex::default(),
            settled: Condvar::new(),
            inbox: Mutex::default(),
            waker: Mutex::new(None),
            unsent: AtomicUsize::new(0),
            stats: Counters::default(),
            nonces: RandomState::new(),
        }
    }

    pub(crate) fn state(&self) -> Result<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| poisoned("agent state"))
    }

    /// A transfer's nonce: unpredictable without the agent's random hasher keys.
    pub(crate) fn nonce(&self, id: u64) -> u64 {
        self.nonces.hash_one(id)
    }

    /// Records one event of chunk `k` of transfer `id`; `Err` fails the transfer (if it is still
    /// pending). Settles the transfer when its last chunk settles. Unknown ids (a transfer
    /// released once final) are ignored.
    pub(crate) fn chunk_event(&self, id: u64, k: usize, event: Event, outcome: Result<()>) {
        let Ok(mut st) = self.state() else { return };
        let Some(x) = st.xfers.get_mut(&id) else { return };
        let Some(chunk) = x.chunks.get_mut(k) else { return };
        let seen = match event {
            Event::Sent => std::mem::replace(&mut chunk.sent, true),
            Event::Answered => std::mem::replace(&mut chunk.answered, true),
        };
        if seen {
            return;
        }
        let settled = chunk.sent && chunk.answered;
        let mut ended = false;
        if let (Err(e), Stage::Pending) = (outcome, &x.stage) {
            x.stage = Stage::Failed(e);
            x.memory.clear();
            ended = true;
        }
        if settled {
            x.unsettled -= 1;
        }
        if x.unsettled == 0 {
            if matches!(x.stage, Stage::Pending) {
                if let Some(msg) = x.notify.take() {
                    if let Err(e) = x.peer.notify(self, msg) {
                        x.stage = Stage::Failed(e.context("data in place, notification failed"));
                    }
                }
                if matches!(x.stage, Stage::Pending) {
                    x.stage = Stage::Done;
                }
                x.memory.clear();
                ended = true;
            }
            if x.released {
                st.xfers.remove(&id);
                ended = false;
            }
            self.settled.notify_all();
        }
        if ended {
            st.completed.push(id);
            // `TcpAgent::wait` wakes for a transfer that became final before it settled, too.
            self.settled.notify_all();
        }
    }

    /// Waits on `st` at most `limit` for a transfer to become final or settle.
    pub(crate) fn wait_change<'a>(
        &self,
        st: MutexGuard<'a, State>,
        limit: Duration,
    ) -> Result<MutexGuard<'a, State>> {
        match self.settled.wait_timeout(st, limit) {
            Ok((st, _)) => Ok(st),
            Err(_) => Err(poisoned("agent state")),
        }
    }

    /// Takes chunk `k` of READ `id` for its answer's data: the local slots, pinned, if the READ is
    /// in flight (pending, not released), its nonce is `nonce` and the chunk was not taken.
    /// `None`: the data is to be thrown away.
    pub(crate) fn take_chunk(&self, id: u64, nonce: u64, k: usize) -> Option<Pinned> {
        let mut st = self.state().ok()?;
        let x = st.xfers.get_mut(&id).filter(|x| {
            x.nonce == nonce && x.op == XferOp::Read && !x.released && matches!(x.stage, Stage::Pending)
        })?;
        let pinned = x.pin_chunk(k)?;
        let chunk = x.chunks.get_mut(k).filter(|c| !c.taken)?;
        chunk.taken = true;
        Some(pinned)
    }

    /// `ranges` of this agent's live registrations, pinned; `None` when one does not lie inside
    /// one registration (the peer's request is refused).
    pub(crate) fn pin_local(&self, ranges: &[(u64, u64)]) -> Option<Pinned> {
        let st = self.state().ok()?;
        let mut memory: Vec<Arc<dyn KvMemory>> = Vec::new();
        for &(addr, len) in ranges {
            let range = MemRegion::dram(addr, len);
            let holder = st.registrations.values().find(|r| r.region.contains(&range))?;
            if !memory.iter().any(|m| Arc::ptr_eq(m, &holder.memory)) {
                memory.push(holder.memory.clone());
            }
        }
        Pinned::new(ranges, memory)
    }

    /// Queues a notification from `from` for `drain_notifications`.
    pub(crate) fn deliver(&self, from: AgentName, msg: Vec<u8>) {
        Counters::bump(&self.stats.notifications_received);
        if let Ok(mut inbox) = self.inbox.lock() {
            inbox.push(Notification { from, msg });
        }
        if let Some(wake) = self.waker.lock().ok().as_deref().and_then(Option::as_ref) {
            wake.wake();
        }
    }

    /// Calls `wake` after each notification queued from now on.
    pub(crate) fn set_waker(&self, wake: NotificationWaker) -> Result<()> {
        *self.waker.lock().map_err(|_| poisoned("waker"))? = Some(wake);
        Ok(())
    }

    pub(crate) fn drain_inbox(&self, out: &mut Vec<Notification>) -> Result<()> {
        out.append(&mut *self.inbox.lock().map_err(|_| poisoned("inbox"))?);
        Ok(())
    }

    /// A notification was handed to a connection.
    pub(crate) fn notification_queued(&self) {
        self.unsent.fetch_add(1, Ordering::AcqRel);
    }

    /// A notification handed to a connection was written, or will never be.
    pub(crate) fn notification_gone(&self) {
        self.unsent.fetch_sub(1, Ordering::AcqRel);
        self.settled.notify_all();
    }

    /// Waits at most `limit` for every transfer in flight to settle and every notification
    /// handed to a connection to be written.
    pub(crate) fn wait_settled(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let Ok(mut st) = self.state() else { return };
        while st.xfers.values().any(|x| x.unsettled > 0) || self.unsent.load(Ordering::Acquire) > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            // Notifications are counted outside the lock: look again at least every 10 ms.
            st = match self.settled.wait_timeout(st, left.min(Duration::from_millis(10))) {
                Ok((st, _)) => st,
                Err(_) => return,
            };
        }
    }
}

/// The remote regions of a peer, as `(id, region)`.
pub(crate) fn remote_regions(regions: &[RemoteRegion]) -> Vec<(u64, MemRegion)> {
    regions.iter().map(|r| (r.id, r.region())).collect()
}

/// A lock poisoned by a panicking thread: a `State` error, not a panic.
fn poisoned(what: &str) -> Error {
    err(ErrorKind::State, format!("the {what} lock is poisoned: a thread panicked holding it"))
}
