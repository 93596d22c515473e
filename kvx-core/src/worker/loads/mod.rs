//! The decode side's state: every load not yet reported, its READs (one per prefill rank it reads
//! from), their deadlines and transfers, and what completed loads leave for the caller. No I/O:
//! each method takes an event and returns the [`LoadEffect`]s the worker carries out (posting a
//! READ, telling a prefill rank to free, dropping a peer, reporting a request), in order.
//!
//! A READ goes `Waiting` (for the handshake) → `Reading` (READ posted, its notification the
//! release with `reply_to`) → `Confirming` (READ done, waiting for [`HoldStatus`]) → ended. Every
//! stage after `Waiting` has a deadline. A request is reported once its last READ ended: loaded
//! if every READ was confirmed, failed with the first failure otherwise. A READ that fails after
//! its offer checked tells the prefill engine to free at once.
//!
//! Invariants kept here: a request is in `requests` exactly while one of its READs is in `reads`
//! (its `ranks` are those READs); a READ in `Reading` is the one entry of its transfer in
//! `in_flight`; an offer's nonce is in `offers` while its request is.
//!
//! [`HoldStatus`]: crate::meta::HoldStatus

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::debug;

use super::deadlines::Deadlines;
use super::peers::PeerKey;
use super::{LoadTimes, TransferRecord, WorkerConfig};
use crate::auth::Nonce;
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{AgentName, EngineId, RequestId};
use crate::meta::{HoldRelease, RecvRequest};
use crate::params::RemoteCoordinates;
use crate::tp::{Slice, Target};
use crate::transfer::XferId;
use crate::wire;

mod ending;
#[cfg(test)]
mod tests;

/// At most this many [`LoadTimes`] wait for [`Loads::take_times`] (the oldest go first).
const LOAD_TIMES_KEPT: usize = 1024;

/// At most this many [`TransferRecord`]s wait for [`Loads::take_transfers`] (the oldest go first;
/// each is in the counters and histograms regardless).
const TRANSFERS_KEPT: usize = 4096;

/// A request's READ from one prefill rank.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct LoadKey {
    pub(super) request_id: RequestId,
    /// The prefill rank read from.
    pub(super) rank: u32,
}

impl LoadKey {
    pub(super) fn new(request_id: RequestId, rank: u32) -> Self {
        LoadKey { request_id, rank }
    }
}

/// What the worker does for [`Loads`], in the order given: each effect may lead to more events
/// (a READ posted is handed back to [`Loads::posted`]).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum LoadEffect {
    /// Wait for rank `key.rank` of `remote` to be ready (starting a handshake if needed), then
    /// hand the load to [`Loads::issue`]. When the peer cannot be reached at all (its endpoint is
    /// invalid), fail the load ([`Loads::fail`]) with `free`.
    AwaitPeer { key: LoadKey, remote: RemoteCoordinates, free: Free },
    /// Post the READ (its peer is ready) and hand the outcome to [`Loads::posted`].
    Post(PostRead),
    /// Give a transfer that ended back to the agent.
    ReleaseTransfer(XferId),
    /// Tell prefill rank `rank` of `remote` to free its hold now (`release` wants no answer),
    /// handshaking first if needed.
    FreeHold { remote: RemoteCoordinates, rank: u32, release: Vec<u8> },
    /// Drop the peer (the next READ from it handshakes again): with `agent`, only if it is still
    /// that connection.
    DropPeer { peer: PeerKey, agent: Option<AgentName> },
    /// Report the request loaded.
    Loaded(RequestId),
    /// Report the request failed.
    Failed { request_id: RequestId, error: Error },
}

/// What becomes of the prefill engine's hold when a READ fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Free {
    /// Its prefill rank is told to free now ([`LoadEffect::FreeHold`]).
    Now,
    /// Nothing is sent: the READ's own release went (or the hold is gone, or the peer cannot be
    /// reached).
    No,
}

/// A READ to post: the load `key`, from its peer at `instance`.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PostRead {
    pub(super) key: LoadKey,
    pub(super) instance: u64,
    pub(super) req: Arc<RecvRequest>,
    /// The prefill rank's heads it reads, and how many decode ranks release that rank.
    pub(super) slice: Slice,
    pub(super) readers: u32,
}

/// A READ the agent took: the transfer, the peer's agent, the token its release carries, and what
/// it moves.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Posted {
    pub(super) xfer: XferId,
    pub(super) peer: AgentName,
    pub(super) token: Nonce,
    pub(super) bytes: u64,
    pub(super) descriptors: u64,
}

/// A READ or confirmation past its deadline ([`Loads::overdue`]): the connection it used, and the
/// transfer to cancel first when it is still reading.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Overdue {
    pub(super) peer: PeerKey,
    pub(super) agent: AgentName,
    pub(super) transfer: Option<XferId>,
}

/// What a load failed by its peer's handshake leaves ([`Loads::handshake_failed`]): its own
/// release, for the caller to send through the refused peer if it can, and the effects.
#[derive(Debug, Default, PartialEq)]
pub(super) struct HandshakeFailed {
    pub(super) release: Option<Vec<u8>>,
    pub(super) effects: Vec<LoadEffect>,
}

/// What closing the loads leaves for the worker ([`Loads::close`]).
#[derive(Debug, Default, PartialEq)]
pub(super) struct Closed {
    /// The transfers that were in flight, to cancel or release.
    pub(super) transfers: Vec<XferId>,
    /// A release for the prefill rank of each READ that did not complete, to send if its peer is
    /// ready (nothing is handshaken at close).
    pub(super) releases: Vec<PeerRelease>,
    /// Every request that was loading, in order.
    pub(super) failed: Vec<RequestId>,
}

/// A release (wanting no answer) for a peer.
#[derive(Debug, PartialEq)]
pub(super) struct PeerRelease {
    pub(super) peer: PeerKey,
    pub(super) release: Vec<u8>,
}

/// A request whose load is not reported yet: its READs (one per prefill rank it reads from) end
/// one by one; the request is reported when the last has, failed if any failed.
#[derive(Debug)]
struct Pending {
    /// The prefill ranks of the READs still running.
    ranks: Vec<u32>,
    /// The first failure of one of its READs.
    error: Option<Error>,
    /// The step that admitted it; the latest READ posted and done.
    admitted: Instant,
    posted: Option<Instant>,
    read_done: Option<Instant>,
    nonce: Option<Nonce>,
}

/// A request's READ from one prefill rank, through its confirmation.
#[derive(Debug)]
struct Load {
    req: Arc<RecvRequest>,
    slice: Slice,
    readers: u32,
    stage: Stage,
    /// A READ or a post of this load failed once: the next failure fails it.
    retried: bool,
    /// The peer was handshaken again because its instance was not the offer's.
    rehandshaken: bool,
}

#[derive(Debug)]
enum Stage {
    /// Waiting for the peer's handshake. After a failed READ, `retry` says why and which
    /// instance it was posted to: the READ is posted again only if the handshake finds a new
    /// instance (the engine restarted and the offer may be the new one's); otherwise it fails.
    Waiting { retry: Option<Retry> },
    /// READ posted; `answer` holds a [`HoldStatus`](crate::meta::HoldStatus) that came before the
    /// READ was seen done.
    Reading { xfer: XferId, read: Read, answer: Option<bool> },
    /// READ done; waiting for the prefill engine's answer (by the new deadline).
    Confirming(Read),
}

/// Why a READ waits to be posted again, and to which instance it went.
#[derive(Debug)]
struct Retry {
    error: Error,
    instance: u64,
}

/// A posted READ, through its confirmation: the connection (`peer` at `instance`), the token its
/// release carries, and its deadline.
#[derive(Debug, Clone)]
struct Read {
    peer: AgentName,
    instance: u64,
    token: Nonce,
    posted: Instant,
    /// The step that found it done.
    done: Option<Instant>,
    deadline: Instant,
    bytes: u64,
    descriptors: u64,
}

impl Load {
    fn deadline(&self) -> Option<Instant> {
        match &self.stage {
            Stage::Waiting { .. } => None,
            Stage::Reading { read, .. } | Stage::Confirming(read) => Some(read.deadline),
        }
    }

    /// The peer this load reads from.
    fn peer(&self, key: &LoadKey) -> PeerKey {
        (self.req.remote.engine_id.clone(), key.rank)
    }

    /// Whether a READ from `agent` is in flight for this load.
    fn reads_from(&self, agent: &AgentName) -> bool {
        matches!(&self.stage, Stage::Reading { read, .. } if read.peer == *agent)
    }

    /// Whether this is the READ `token` confirms, from `agent`.
    fn answered_by(&self, agent: &AgentName, token: &Nonce) -> bool {
        match &self.stage {
            Stage::Reading { read, .. } | Stage::Confirming(read) => {
                read.peer == *agent && read.token == *token
            }
            Stage::Waiting { .. } => false,
        }
    }

    /// The release from decode rank `reader` that frees this load's hold at once.
    fn free_at_once(&self, reader: u32) -> Option<Vec<u8>> {
        free_at_once(&self.req, reader, self.readers)
    }

    /// Tells its prefill rank to free now.
    fn free_hold(&self, key: &LoadKey, reader: u32) -> Option<LoadEffect> {
        let release = self.free_at_once(reader)?;
        Some(LoadEffect::FreeHold { remote: self.req.remote.clone(), rank: key.rank, release })
    }
}

/// The decode side's loads. See the module doc.
#[derive(Debug)]
pub(super) struct Loads {
    /// This worker's rank: the reader its releases name.
    rank: u32,
    transfer_timeout: Duration,
    confirm_timeout: Duration,
    /// Every request whose load is not yet reported.
    requests: HashMap<RequestId, Pending>,
    /// The READ of each request from each prefill rank, until it ends.
    reads: HashMap<LoadKey, Load>,
    /// When READs or confirmations are due.
    deadlines: Deadlines<LoadKey>,
    /// The READ of each transfer in flight (in `Stage::Reading`): what the agent's completions
    /// are matched to.
    in_flight: HashMap<XferId, LoadKey>,
    /// The nonce of each load's offer, to its request (one load per offer).
    offers: HashMap<Nonce, RequestId>,
    /// The stage times of the loads completed since the last `take_times`.
    times: VecDeque<LoadTimes>,
    /// The READs confirmed since the last `take_transfers`.
    transfers: VecDeque<TransferRecord>,
}

impl Loads {
    pub(super) fn new(config: &WorkerConfig) -> Self {
        Loads {
            rank: config.rank,
            transfer_timeout: config.transfer_timeout,
            confirm_timeout: config.confirm_timeout,
            requests: HashMap::new(),
            reads: HashMap::new(),
            deadlines: Deadlines::default(),
            in_flight: HashMap::new(),
            offers: HashMap::new(),
            times: VecDeque::new(),
            transfers: VecDeque::new(),
        }
    }

    /// Requests not yet reported.
    pub(super) fn len(&self) -> usize {
        self.requests.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Whether a load of `request_id`, or of the offer `nonce`, is in flight.
    pub(super) fn is_loading(&self, request_id: &RequestId, nonce: Option<Nonce>) -> bool {
        self.requests.contains_key(request_id) || nonce.is_some_and(|n| self.offers.contains_key(&n))
    }

    /// Whether a READ from `agent` is in flight.
    pub(super) fn reads_from(&self, agent: &AgentName) -> bool {
        self.reads.values().any(|l| l.reads_from(agent))
    }

    /// The engine READ `key` reads from, while it has not ended.
    pub(super) fn engine_of(&self, key: &LoadKey) -> Option<&EngineId> {
        self.reads.get(key).map(|l| &l.req.remote.engine_id)
    }

    /// The earliest READ or confirmation deadline.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.reads.values().filter_map(Load::deadline).min()
    }

    /// The stage times of the loads completed since the last call, oldest first.
    pub(super) fn take_times(&mut self) -> Vec<LoadTimes> {
        self.times.drain(..).collect()
    }

    /// The READs confirmed since the last call, oldest first.
    pub(super) fn take_transfers(&mut self) -> Vec<TransferRecord> {
        self.transfers.drain(..).collect()
    }

    /// Admits a checked request (not notify-only) with its plan: each prefill rank it reads from
    /// waits for its peer; each it only releases is told to free now.
    pub(super) fn admit(&mut self, now: Instant, req: &RecvRequest, targets: &[Target]) -> Vec<LoadEffect> {
        let id = req.request_id.clone();
        let req = Arc::new(req.clone());
        if let Some(nonce) = req.nonce {
            self.offers.insert(nonce, id.clone());
        }
        let ranks: Vec<u32> = targets.iter().filter(|t| t.read.is_some()).map(|t| t.rank).collect();
        let pending =
            Pending { ranks, error: None, admitted: now, posted: None, read_done: None, nonce: req.nonce };
        self.requests.insert(id.clone(), pending);
        // Every READ is recorded before any is posted: one may end (and end its siblings) at once.
        for t in targets {
            if let Some(slice) = t.read {
                let load = Load {
                    req: Arc::clone(&req),
                    slice,
                    readers: t.readers,
                    stage: Stage::Waiting { retry: None },
                    retried: false,
                    rehandshaken: false,
                };
                self.reads.insert(LoadKey::new(id.clone(), t.rank), load);
            }
        }
        let mut effects = Vec::with_capacity(targets.len());
        for t in targets {
            match t.read {
                // Nobody reads that rank's copy: released now.
                None => {
                    if let Some(release) = free_at_once(&req, self.rank, t.readers) {
                        effects.push(LoadEffect::FreeHold {
                            remote: req.remote.clone(),
                            rank: t.rank,
                            release,
                        });
                    }
                }
                Some(_) => effects.push(LoadEffect::AwaitPeer {
                    key: LoadKey::new(id.clone(), t.rank),
                    remote: req.remote.clone(),
                    free: Free::Now,
                }),
            }
        }
        effects
    }

    /// The peer of load `key` is ready at `instance` (`None`: it is not, any more): posts its
    /// READ, unless the READ failed on that instance before, or the offer names another instance.
    pub(super) fn issue(&mut self, now: Instant, key: &LoadKey, instance: Option<u64>) -> Vec<LoadEffect> {
        let Some(load) = self.reads.get_mut(key) else { return Vec::new() };
        let peer = load.peer(key);
        let Some(instance) = instance else {
            // Another load waiting on the same handshake dropped the peer again (its offer named
            // a newer instance, or its post was refused): wait for the next handshake.
            let remote = load.req.remote.clone();
            return vec![LoadEffect::AwaitPeer { key: key.clone(), remote, free: Free::No }];
        };
        if let Stage::Waiting { retry: Some(retry) } = &load.stage {
            if instance == retry.instance {
                let e = retry.error.clone();
                return self.fail(now, key, e, Free::Now);
            }
            debug!(request_id = %key.request_id, "the engine restarted: posting the READ again to its new instance");
        }
        if let Some(want) = load.req.prefill_instance() {
            if want != instance {
                let engine_id = &peer.0;
                if load.rehandshaken {
                    // The instance that made the offer is gone: its hold went with it.
                    let e = Error::new(
                        ErrorKind::Expired,
                        format!("engine {engine_id} restarted: the instance that held these blocks is gone"),
                    );
                    return self.fail(now, key, e, Free::No);
                }
                debug!(request_id = %key.request_id, %engine_id, "the offer names another instance: handshaking again");
                load.rehandshaken = true;
                let remote = load.req.remote.clone();
                return vec![
                    LoadEffect::DropPeer { peer, agent: None },
                    LoadEffect::AwaitPeer { key: key.clone(), remote, free: Free::No },
                ];
            }
        }
        vec![LoadEffect::Post(PostRead {
            key: key.clone(),
            instance,
            req: Arc::clone(&load.req),
            slice: load.slice,
            readers: load.readers,
        })]
    }

    /// The outcome of a [`LoadEffect::Post`]. A post the transport refused (a peer that went
    /// away, say) is as a failed READ: posted again after a new handshake, once.
    pub(super) fn posted(
        &mut self,
        now: Instant,
        key: &LoadKey,
        instance: u64,
        outcome: Result<Posted>,
    ) -> Vec<LoadEffect> {
        let Some(load) = self.reads.get_mut(key) else { return Vec::new() };
        match outcome {
            Ok(Posted { xfer, peer, token, bytes, descriptors }) => {
                let deadline = now + self.transfer_timeout;
                self.deadlines.push(deadline, key.clone());
                let read =
                    Read { peer, instance, token, posted: now, done: None, deadline, bytes, descriptors };
                load.stage = Stage::Reading { xfer, read, answer: None };
                self.in_flight.insert(xfer, key.clone());
                if let Some(p) = self.requests.get_mut(&key.request_id) {
                    p.posted = Some(now);
                }
                Vec::new()
            }
            Err(e)
                if load.retried
                    || matches!(
                        e.kind(),
                        ErrorKind::InvalidPeerData | ErrorKind::InvalidArgument | ErrorKind::Incompatible
                    ) =>
            {
                self.fail(now, key, e, Free::Now)
            }
            Err(e) => {
                debug!(request_id = %key.request_id, error = %e, "post failed: handshaking with the engine again");
                load.retried = true;
                load.stage = Stage::Waiting { retry: Some(Retry { error: e, instance }) };
                let (peer, remote) = (load.peer(key), load.req.remote.clone());
                vec![
                    LoadEffect::DropPeer { peer, agent: None },
                    LoadEffect::AwaitPeer { key: key.clone(), remote, free: Free::No },
                ]
            }
        }
    }
}

/// The release from decode rank `reader` of `readers` that frees the hold of `req` at once (no
/// answer wanted), encoded; `None` for a request without a nonce.
pub(super) fn free_at_once(req: &RecvRequest, reader: u32, readers: u32) -> Option<Vec<u8>> {
    let nonce = req.nonce?;
    let request_id = req.prefill_request_id().clone();
    let instance = req.prefill_instance();
    let release = HoldRelease { request_id, nonce, reply_to: None, reader, readers, instance };
    wire::encode(&release).map_err(|e| debug!(error = %e, "encoding a release failed")).ok()
}
