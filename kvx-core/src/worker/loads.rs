//! The decode side: admit a load, READ the blocks, and report it done only once the prefill
//! engine confirms its hold lived through the READ; renew the leases of requests still waiting.
//!
//! A load goes `Waiting` (for the handshake) → `Reading` (READ posted, its notification the
//! release with `reply_to`) → `Confirming` (READ done, waiting for [`HoldStatus`]) → reported.
//! Every stage has a deadline. A load that fails after its offer checked tells the prefill
//! engine to free at once.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;
use tracing::{debug, warn};

use super::peers::{Peer, PeerKey, Waiter};
use super::{ConnectorWorker, LOAD_TIMES_KEPT, LoadTimes, TRANSFERS_KEPT, TransferRecord};
use crate::auth::Nonce;
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{AgentName, BlockId, RequestId};
use crate::layout::KvCacheLayout;
use crate::meta::{FailedRecv, Heartbeat, HoldRelease, HoldStatus, RecvRequest, RenewLeases, ReplyTo};
use crate::tp::{self, HeadSplit, MAX_TP, Slice, Target};
use crate::transfer::{BlockList, BlockPost, DlistId, DlistOwner, RegionBlocks, XferId, XferOp, XferState};
use crate::wire;

/// At most this many holds per heartbeat message (a notification stays small).
const RENEWALS_PER_MESSAGE: usize = 128;

/// A request's READ from one prefill rank.
pub(super) type LoadKey = (RequestId, u32);

/// A request whose load is not reported yet: its READs (one per prefill rank it reads from) end
/// one by one; the request is reported when the last has, failed if any failed.
#[derive(Debug)]
pub(super) struct Pending {
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
pub(super) struct Load {
    req: Arc<RecvRequest>,
    /// The prefill rank's heads it reads, and how many decode ranks release that rank.
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
    /// Waiting for the peer's handshake. After a failed READ, `retry` holds its error and the
    /// instance it was posted to: the READ is posted again only if the handshake finds a new
    /// instance (the engine restarted and the offer may be the new one's); otherwise it fails.
    Waiting { retry: Option<(Error, u64)> },
    /// READ posted; `answer` holds a [`HoldStatus`] that came before the READ was seen done.
    Reading { xfer: XferId, read: Read, answer: Option<bool> },
    /// READ done; waiting for the prefill engine's answer (by the new deadline).
    Confirming(Read),
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

/// What posting a READ gave: the transfer, the peer's agent, the token its release carries, and
/// what it moves.
struct Posted {
    xfer: XferId,
    peer: AgentName,
    token: Nonce,
    bytes: u64,
    descriptors: u64,
}

impl Load {
    pub(super) fn deadline(&self) -> Option<Instant> {
        match &self.stage {
            Stage::Waiting { .. } => None,
            Stage::Reading { read, .. } | Stage::Confirming(read) => Some(read.deadline),
        }
    }

    /// Whether a READ from `agent` is in flight for this load.
    pub(super) fn reads_from(&self, agent: &AgentName) -> bool {
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
}

/// How a load's check failed: the error, and whether the prefill engine is told to free (only
/// once the offer itself checked and no other load uses it).
type Refusal = (Error, bool);

/// The lists a READ posts on: whole blocks (`heads` is `None`), or single heads with the heads of
/// a local and of a remote block.
struct ReadLists {
    local: DlistId,
    remote: DlistId,
    heads: Option<(u32, u32)>,
}

impl ConnectorWorker {
    pub(super) fn admit(&mut self, now: Instant, req: &RecvRequest) {
        let plan = self.targets(req);
        if let Err((e, release)) = self.check_load(req, &plan) {
            if release {
                self.release_all(now, req, &plan);
            }
            return self.fail(&req.request_id, e);
        }
        if req.is_notify_only() {
            self.stats.notify_only += 1;
            return self.release_all(now, req, &plan);
        }
        let Ok(targets) = plan else { return };
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
        for t in &targets {
            if let Some(slice) = t.read {
                let load = Load {
                    req: Arc::clone(&req),
                    slice,
                    readers: t.readers,
                    stage: Stage::Waiting { retry: None },
                    retried: false,
                    rehandshaken: false,
                };
                self.loads.insert((id.clone(), t.rank), load);
            }
        }
        for t in targets {
            match t.read {
                // Nobody reads that rank's copy: released now.
                None => self.release_rank(now, &req, t.rank, t.readers),
                Some(_) => {
                    let key = (id.clone(), t.rank);
                    match self.when_ready(now, &req.remote, t.rank, Waiter::Load(key.clone())) {
                        Ok(Some(_)) => self.issue(now, &key),
                        Ok(None) => {}
                        Err(e) => {
                            self.end_load(now, &key, Err(e), true);
                        }
                    }
                }
            }
        }
    }

    /// The prefill ranks this rank reads `req`'s heads from and releases: refused as
    /// `Incompatible` when the heads do not split over the prefill engine's ranks or must be
    /// sliced out of a layout that cannot be (NHD).
    fn targets(&self, req: &RecvRequest) -> Result<Vec<Target>> {
        let Some(registered) = &self.registered else {
            return Err(Error::new(ErrorKind::State, "load requested before KV caches were registered"));
        };
        let prefill_tp = req.remote_tp_size.unwrap_or(self.config.world_size);
        if prefill_tp == 0 || prefill_tp > MAX_TP {
            return Err(Error::invalid_peer_data(format!("prefill tensor-parallel size {prefill_tp}")));
        }
        let prefill = HeadSplit::new(registered.split.heads(), prefill_tp)?;
        let targets = tp::targets(prefill, registered.split, self.config.rank);
        let (remote_heads, local_heads) = (prefill.per_rank(), registered.split.per_rank());
        let sliced =
            targets.iter().filter_map(|t| t.read).any(|s| !tp::whole_blocks(&s, remote_heads, local_heads));
        if sliced && !registered.layout.kind.head_sliceable() {
            return Err(Error::new(
                ErrorKind::Incompatible,
                format!(
                    "prefill TP {prefill_tp} and decode TP {} need blocks split by head, which a {:?} \
                     (NHD) cache cannot be: use a head-major layout",
                    self.config.world_size, registered.layout.kind
                ),
            ));
        }
        Ok(targets)
    }

    /// Checks what came from the client's params before anything touches the network, then the
    /// local side of the load.
    fn check_load(&self, req: &RecvRequest, plan: &Result<Vec<Target>>) -> std::result::Result<(), Refusal> {
        let Some(registered) = &self.registered else {
            return Err((
                Error::new(ErrorKind::State, "load requested before KV caches were registered"),
                false,
            ));
        };
        let Some(offer) = req.offer() else {
            let e = "kv_transfer_params carry no kvx_hold_nonce: not an offer of a kvx prefill engine";
            return Err((Error::invalid_peer_data(e), false));
        };
        offer.check(self.config.auth_key.as_ref(), req.mac.as_ref()).map_err(|e| (e, false))?;
        if req.remote.engine_id == self.config.engine_id {
            let e = format!("remote engine {} is this engine", req.remote.engine_id);
            return Err((Error::invalid_peer_data(e), false));
        }
        if self.requests.contains_key(&req.request_id)
            || req.nonce.is_some_and(|n| self.offers.contains_key(&n))
        {
            let e = "a load for this request or this offer is already in flight";
            return Err((Error::invalid_argument(e), false));
        }
        if req.is_notify_only() {
            return Ok(());
        }
        plan.as_ref().map_err(|e| (e.clone(), true))?;
        if self.config.side_channel.is_none() {
            let e = "a decode worker needs WorkerConfig::side_channel: the prefill engine answers there";
            return Err((Error::new(ErrorKind::State, e), true));
        }
        let local = |e| (e, true);
        if registered.region_windows.is_some() && req.local_block_ids.len() > 1 {
            let e = "layers with their own windows take one KV-cache group, not several";
            return Err(local(Error::new(ErrorKind::Incompatible, e)));
        }
        let (local_ids, _) = req.read_pairs().map_err(local)?;
        KvCacheLayout::check_block_ids(&local_ids, registered.layout.num_blocks, "local").map_err(local)?;
        let mut seen = HashSet::with_capacity(local_ids.len());
        if let Some(dup) = local_ids.iter().find(|b| !seen.insert(**b)) {
            return Err(local(Error::invalid_argument(format!("local block {dup} appears twice"))));
        }
        Ok(())
    }

    /// Tells every prefill rank this rank releases for `req` to free (no answer wanted): the
    /// plan's ranks, or, without a plan, ranks `rank, rank + world_size, ..` of the prefill
    /// engine, each as its only reader.
    fn release_all(&mut self, now: Instant, req: &RecvRequest, plan: &Result<Vec<Target>>) {
        let targets = match plan {
            Ok(targets) => targets.iter().map(|t| (t.rank, t.readers)).collect(),
            Err(_) => self.round_robin(req.remote_tp_size).map(|p| (p, 1)).collect::<Vec<_>>(),
        };
        for (rank, readers) in targets {
            self.release_rank(now, req, rank, readers);
        }
    }

    /// The prefill ranks `rank, rank + world_size, ..` of an engine of `prefill_tp` ranks (this
    /// worker's size when `None`): one decode rank for each prefill rank.
    fn round_robin(&self, prefill_tp: Option<u32>) -> impl Iterator<Item = u32> + use<> {
        let prefill_tp = prefill_tp.unwrap_or(self.config.world_size).min(MAX_TP);
        (self.config.rank..prefill_tp).step_by(self.config.world_size as usize)
    }

    /// Tells prefill rank `rank` to free the hold of `req` (no answer wanted).
    fn release_rank(&mut self, now: Instant, req: &RecvRequest, rank: u32, readers: u32) {
        if let Some(msg) = free_at_once(req, self.config.rank, readers) {
            self.send_to(now, &req.remote, rank, msg);
        }
    }

    /// Posts the READ of a load whose peer is ready.
    pub(super) fn issue(&mut self, now: Instant, key: &LoadKey) {
        let Some(mut load) = self.loads.remove(key) else { return };
        let peer = (load.req.remote.engine_id.clone(), key.1);
        let Some(Peer::Ready(conn)) = self.peers.get(&peer) else {
            // Another load waiting on the same handshake dropped the peer again (its offer named
            // a newer instance, or its post was refused): wait for the next handshake.
            self.loads.insert(key.clone(), load);
            self.requeue(now, key);
            return;
        };
        let instance = conn.instance;
        if let Stage::Waiting { retry: Some((e, old)) } = &load.stage {
            if instance == *old {
                let e = e.clone();
                self.loads.insert(key.clone(), load);
                self.end_load(now, key, Err(e), true);
                return;
            }
            debug!(request_id = %key.0, "the engine restarted: posting the READ again to its new instance");
        }
        if let Some(want) = load.req.remote_instance.map(|i| u64::from_le_bytes(*i.as_bytes())) {
            if want != instance {
                let engine_id = &peer.0;
                if load.rehandshaken {
                    // The instance that made the offer is gone: its hold went with it.
                    let e = Error::new(
                        ErrorKind::Expired,
                        format!("engine {engine_id} restarted: the instance that held these blocks is gone"),
                    );
                    self.loads.insert(key.clone(), load);
                    self.end_load(now, key, Err(e), false);
                } else {
                    debug!(request_id = %key.0, %engine_id, "the offer names another instance: handshaking again");
                    load.rehandshaken = true;
                    self.loads.insert(key.clone(), load);
                    self.invalidate(&peer);
                    self.requeue(now, key);
                }
                return;
            }
        }
        match self.post_read(&peer, &load) {
            Ok(Posted { xfer, peer, token, bytes, descriptors }) => {
                let deadline = now + self.config.transfer_timeout;
                self.load_deadlines.push(deadline, key.clone());
                let read =
                    Read { peer, instance, token, posted: now, done: None, deadline, bytes, descriptors };
                load.stage = Stage::Reading { xfer, read, answer: None };
                self.loads.insert(key.clone(), load);
                self.reading.insert(xfer, key.clone());
                if let Some(p) = self.requests.get_mut(&key.0) {
                    p.posted = Some(now);
                }
            }
            Err(e)
                if load.retried
                    || matches!(
                        e.kind(),
                        ErrorKind::InvalidPeerData | ErrorKind::InvalidArgument | ErrorKind::Incompatible
                    ) =>
            {
                self.loads.insert(key.clone(), load);
                self.end_load(now, key, Err(e), true);
            }
            Err(e) => {
                // The transport refused the post (a peer that went away, say): as a failed READ.
                debug!(request_id = %key.0, error = %e, "post failed: handshaking with the engine again");
                load.retried = true;
                load.stage = Stage::Waiting { retry: Some((e, instance)) };
                self.loads.insert(key.clone(), load);
                self.invalidate(&peer);
                self.requeue(now, key);
            }
        }
    }

    /// Queues a load on its peer's (new) handshake, or issues it if the peer is ready.
    fn requeue(&mut self, now: Instant, key: &LoadKey) {
        let Some(remote) = self.loads.get(key).map(|l| l.req.remote.clone()) else { return };
        match self.when_ready(now, &remote, key.1, Waiter::Load(key.clone())) {
            Ok(Some(_)) => self.issue(now, key),
            Ok(None) => {}
            Err(e) => {
                self.end_load(now, key, Err(e), false);
            }
        }
    }

    /// A restarted engine answers nothing for its earlier instance: the loads waiting for the
    /// old instance's confirmation fail now.
    pub(super) fn fail_confirmations_of(&mut self, now: Instant, peer: &PeerKey, old: u64) {
        let stale: Vec<LoadKey> = self
            .loads
            .iter()
            .filter(|(k, l)| k.1 == peer.1 && l.req.remote.engine_id == peer.0)
            .filter(|(_, l)| matches!(&l.stage, Stage::Confirming(read) if read.instance == old))
            .map(|(k, _)| k.clone())
            .collect();
        for key in stale {
            self.stats.lease_failures += 1;
            let e = Error::new(
                ErrorKind::Expired,
                format!("engine {} restarted before it confirmed the hold", peer.0),
            );
            self.end_load(now, &key, Err(e), false);
        }
    }

    /// The lists a READ of `slice` from `peer` posts on: whole blocks when it takes every head of
    /// the blocks on both sides, else single heads (both lists prepared at the first such READ).
    /// The peer must be of the tensor-parallel size the plan was made for (`prefill_tp`).
    fn read_lists(&mut self, peer: &PeerKey, prefill_tp: u32, slice: &Slice) -> Result<ReadLists> {
        let (Some(registered), Some(Peer::Ready(conn))) = (&mut self.registered, self.peers.get_mut(peer))
        else {
            return Err(Error::new(ErrorKind::State, "peer not ready"));
        };
        if conn.split.tp() != prefill_tp {
            return Err(Error::new(
                ErrorKind::Incompatible,
                format!("engine {} has {} ranks, its params said {prefill_tp}", peer.0, conn.split.tp()),
            ));
        }
        let (local_heads, remote_heads) = (registered.split.per_rank(), conn.split.per_rank());
        if tp::whole_blocks(slice, remote_heads, local_heads) {
            return Ok(ReadLists { local: registered.local_dlist, remote: conn.dlist, heads: None });
        }
        let local = match registered.head_dlist {
            Some(d) => d,
            None => {
                let list = per_head(&registered.local_list, local_heads);
                *registered.head_dlist.insert(self.agent.prep_dlist(&DlistOwner::Local, &list)?)
            }
        };
        let remote = match conn.head_dlist {
            Some(d) => d,
            None => {
                let owner = DlistOwner::Remote(conn.agent.clone());
                *conn.head_dlist.insert(self.agent.prep_dlist(&owner, &per_head(&conn.list, remote_heads))?)
            }
        };
        Ok(ReadLists { local, remote, heads: Some((local_heads, remote_heads)) })
    }

    fn post_read(&mut self, peer: &PeerKey, load: &Load) -> Result<Posted> {
        let req = &load.req;
        let (Some(nonce), Some(me)) = (req.nonce, &self.config.side_channel) else {
            return Err(Error::new(ErrorKind::State, "no nonce or no side channel to answer on"));
        };
        let token = self.tokens.next_nonce();
        let (rank, instance) = (self.config.rank, self.instance);
        let reply_to = Some(ReplyTo { engine: me.clone(), rank, instance, token });
        let release = wire::encode(&HoldRelease {
            request_id: req.prefill_request_id().clone(),
            nonce,
            reply_to,
            reader: rank,
            readers: load.readers,
        })?;
        let (local, remote) = req.read_pairs()?;
        let prefill_tp = req.remote_tp_size.unwrap_or(self.config.world_size);
        let lists = self.read_lists(peer, prefill_tp, &load.slice)?;
        let (Some(registered), Some(Peer::Ready(conn))) = (&self.registered, self.peers.get(peer)) else {
            return Err(Error::new(ErrorKind::State, "peer not ready"));
        };
        KvCacheLayout::check_block_ids(&remote, conn.list.num_blocks, "remote")?;
        let layout = &registered.layout;
        // In single-head lists block `b` is heads `b * heads ..`: the slice's heads of each block.
        let (local_blocks, remote_blocks, windows, unit_len, (local_heads, remote_heads)) = match lists.heads
        {
            None => (
                local,
                remote,
                registered.region_windows.as_deref().map(Cow::Borrowed),
                layout.block_len,
                (1, 1),
            ),
            Some((local_heads, remote_heads)) => {
                let s = &load.slice;
                let windows = registered.region_windows.as_ref().map(|windows| {
                    windows.iter().map(|w| w.map(|w| w.saturating_mul(s.heads))).collect::<Vec<_>>()
                });
                (
                    Cow::Owned(head_units(&local, local_heads, s.local_head, s.heads)),
                    Cow::Owned(head_units(&remote, remote_heads, s.remote_head, s.heads)),
                    windows.map(Cow::Owned),
                    layout.head_len(),
                    (local_heads, remote_heads),
                )
            }
        };
        let blocks = BlockPost {
            local_blocks: &local_blocks,
            local_num_blocks: layout.num_blocks * local_heads,
            remote_blocks: &remote_blocks,
            remote_num_blocks: conn.list.num_blocks * remote_heads,
            regions: match &windows {
                Some(w) => RegionBlocks::Windows(w),
                None => RegionBlocks::All(layout.num_regions()),
            },
        };
        let xfer =
            self.agent.post_blocks(XferOp::Read, lists.local, lists.remote, &blocks, Some(&release))?;
        let descriptors = blocks.coalesced_len();
        self.stats.reads_posted += 1;
        self.stats.descriptors += descriptors;
        let block_descriptors = blocks.block_descriptors();
        self.stats.block_descriptors += block_descriptors;
        let bytes = block_descriptors.saturating_mul(unit_len);
        Ok(Posted { xfer, peer: conn.agent.clone(), token, bytes, descriptors })
    }

    /// Ends one READ of a load: done, or failed. The first failure of a request's READs fails
    /// the request, and ends its READs that are not in flight (waiting ones release their
    /// prefill rank); the request is reported once its last READ ended. With `release`, a failed
    /// READ tells its prefill rank to free; without, the encoded release is returned for the
    /// caller to send.
    pub(super) fn end_load(
        &mut self,
        now: Instant,
        key: &LoadKey,
        outcome: Result<()>,
        release: bool,
    ) -> Option<Vec<u8>> {
        let load = self.loads.remove(key)?;
        if let Stage::Reading { xfer, .. } = &load.stage {
            self.reading.remove(xfer);
        }
        let mut msg = None;
        match outcome {
            Ok(()) => {
                if let Stage::Confirming(Read { posted, done, bytes, descriptors, .. }) = load.stage {
                    let took = now.saturating_duration_since(posted);
                    debug!(request_id = %key.0, rank = key.1, ?took, bytes, "READ done and confirmed");
                    self.stats.bytes_read += bytes;
                    self.stats.transfer_latencies.push(took);
                    if self.transfers.len() == TRANSFERS_KEPT {
                        self.transfers.pop_front();
                    }
                    let duration = done.unwrap_or(now).saturating_duration_since(posted);
                    self.transfers.push_back(TransferRecord { duration, bytes, descriptors });
                }
            }
            Err(e) => {
                let first = match self.requests.get_mut(&key.0) {
                    Some(p) if p.error.is_none() => {
                        p.error = Some(e.clone());
                        true
                    }
                    _ => false,
                };
                if release {
                    self.release_rank(now, &load.req, key.1, load.readers);
                } else {
                    msg = free_at_once(&load.req, self.config.rank, load.readers);
                }
                if first {
                    self.end_siblings(now, &key.0, &e);
                }
            }
        }
        self.load_part_ended(now, key);
        msg
    }

    /// After a READ of request `id` failed: its other READs that wait for a handshake or a
    /// confirmation end now; those in flight end when their transfers do.
    fn end_siblings(&mut self, now: Instant, id: &RequestId, cause: &Error) {
        let Some(p) = self.requests.get(id) else { return };
        let siblings: Vec<(LoadKey, bool)> = p
            .ranks
            .iter()
            .map(|&r| (id.clone(), r))
            .filter_map(|k| match self.loads.get(&k).map(|l| &l.stage) {
                Some(Stage::Waiting { .. }) => Some((k, true)),
                Some(Stage::Confirming(_)) => Some((k, false)),
                _ => None,
            })
            .collect();
        for (key, waiting) in siblings {
            // A confirming READ's release went with it; a waiting one's prefill rank is released.
            self.end_load(now, &key, Err(cause.clone()), waiting);
        }
    }

    /// Counts a request's READ ended; reports the request when it was the last.
    fn load_part_ended(&mut self, now: Instant, key: &LoadKey) {
        let Some(p) = self.requests.get_mut(&key.0) else { return };
        p.ranks.retain(|&r| r != key.1);
        if !p.ranks.is_empty() {
            return;
        }
        let Some(p) = self.requests.remove(&key.0) else { return };
        if let Some(nonce) = p.nonce {
            self.offers.remove(&nonce);
        }
        let id = key.0.clone();
        if let Some(e) = p.error {
            return self.fail(&id, e);
        }
        let posted = p.posted.unwrap_or(now);
        let read_done = p.read_done.unwrap_or(now);
        self.stats.post_waits.push(posted.saturating_duration_since(p.admitted));
        self.stats.confirm_waits.push(now.saturating_duration_since(read_done));
        if self.load_times.len() == LOAD_TIMES_KEPT {
            self.load_times.pop_front();
        }
        let admitted = p.admitted;
        self.load_times.push_back(LoadTimes {
            request_id: id.clone(),
            admitted,
            posted,
            read_done,
            confirmed: now,
        });
        self.finished.recving.push(id);
    }

    pub(super) fn fail(&mut self, request_id: &RequestId, error: Error) {
        warn!(%request_id, %error, "KV load failed");
        self.stats.failed_loads += 1;
        self.finished.failed_recving.push(FailedRecv { request_id: request_id.clone(), error });
    }

    /// Collects the READs that ended since the last step (the agent's completions: the step
    /// costs what completed, not what is in flight): a done READ waits for its confirmation; a
    /// failed one fails its load, tells the prefill engine to free, and drops the peer (it may
    /// have restarted).
    pub(super) fn collect_transfers(&mut self, now: Instant) {
        let mut completions = std::mem::take(&mut self.completions);
        completions.clear();
        if let Err(e) = self.agent.drain_completions(&mut completions) {
            warn!(error = %e, "draining transfer completions failed");
        }
        let mut ended = Vec::with_capacity(completions.len());
        for &xfer in &completions {
            // Not a READ of a load (the agent reports whatever was posted on it).
            let Some(key) = self.reading.remove(&xfer) else { continue };
            let outcome = match self.agent.poll(xfer) {
                Ok(XferState::Done) => Ok(()),
                Ok(XferState::Failed(e)) | Err(e) => Err(e),
                Ok(XferState::Pending) => Err(Error::new(
                    ErrorKind::Backend,
                    format!("the agent reported transfer {xfer} complete, but it is pending"),
                )),
            };
            ended.push((key, outcome));
        }
        self.completions = completions;
        for (key, outcome) in ended {
            let Some(load) = self.loads.get_mut(&key) else { continue };
            let Stage::Reading { xfer, read, answer } = &load.stage else { continue };
            if let Err(e) = self.agent.release(*xfer) {
                debug!(request_id = %key.0, error = %e, "releasing a finished transfer failed");
            }
            let (mut read, answer) = (read.clone(), *answer);
            let peer = (load.req.remote.engine_id.clone(), key.1);
            let failed = self.requests.get(&key.0).and_then(|p| p.error.clone());
            match outcome {
                Ok(()) => {
                    self.stats.read_latencies.push(now.saturating_duration_since(read.posted));
                    if let Some(p) = self.requests.get_mut(&key.0) {
                        p.read_done = Some(now);
                    }
                    read.done = Some(now);
                    read.deadline = now + self.config.confirm_timeout;
                    self.load_deadlines.push(read.deadline, key.clone());
                    load.stage = Stage::Confirming(read);
                    if let Some(e) = failed {
                        // Another READ of the request failed: no confirmation is waited for.
                        self.end_load(now, &key, Err(e), false);
                    } else if let Some(held) = answer {
                        self.confirm(now, &key, held);
                    }
                }
                Err(e) if load.retried || failed.is_some() => {
                    self.stats.reads_failed += 1;
                    self.invalidate_connection(&peer, &read.peer);
                    self.end_load(now, &key, Err(e), true);
                }
                Err(e) => {
                    // The engine may have restarted: handshake again, and post again only if it
                    // has (see `Stage::Waiting`). The READ's notification was not sent.
                    debug!(request_id = %key.0, error = %e, "READ failed: handshaking with the engine again");
                    self.stats.reads_failed += 1;
                    load.retried = true;
                    load.stage = Stage::Waiting { retry: Some((e, read.instance)) };
                    self.invalidate_connection(&peer, &read.peer);
                    self.requeue(now, &key);
                }
            }
        }
        self.forget_retired();
    }

    /// Drops the peer if it is still the connection `agent`.
    fn invalidate_connection(&mut self, peer: &PeerKey, agent: &AgentName) {
        if matches!(self.peers.get(peer), Some(Peer::Ready(c)) if &c.agent == agent) {
            self.invalidate(peer);
        }
    }

    /// A prefill rank's answer for one of this worker's READs.
    pub(super) fn on_hold_status(&mut self, now: Instant, from: &AgentName, status: HoldStatus) {
        let Some(id) = self.offers.get(&status.nonce) else {
            self.stats.stray_notifications += 1;
            return;
        };
        // Only the answer to the release a READ carried (its token) confirms that READ.
        let key = self.requests.get(id).and_then(|p| {
            p.ranks
                .iter()
                .map(|&r| (id.clone(), r))
                .find(|k| self.loads.get(k).is_some_and(|l| l.answered_by(from, &status.token)))
        });
        let Some(load) = key.as_ref().and_then(|k| self.loads.get_mut(k)) else {
            self.stats.stray_notifications += 1;
            return;
        };
        if load.req.prefill_request_id() != &status.request_id {
            self.stats.stray_notifications += 1;
            return;
        }
        match &mut load.stage {
            Stage::Reading { answer, .. } => *answer = Some(status.held),
            _ => {
                if let Some(key) = key {
                    self.confirm(now, &key, status.held);
                }
            }
        }
    }

    fn confirm(&mut self, now: Instant, key: &LoadKey, held: bool) {
        if held {
            self.end_load(now, key, Ok(()), false);
        } else {
            self.stats.lease_failures += 1;
            let e = Error::new(
                ErrorKind::Expired,
                "the prefill engine's hold ended before the READ's release reached it: the blocks read may have been reused",
            );
            self.end_load(now, key, Err(e), false);
        }
    }

    /// Fails READs and confirmations past their deadlines. A READ whose transfer cannot be
    /// cancelled keeps its blocks until it ends.
    /// Looks only at the loads whose deadline entries came due: O(what is due), not O(loads).
    pub(super) fn expire_loads(&mut self, now: Instant) {
        let mut due = Vec::new();
        self.load_deadlines.take_due(now, &mut due);
        due.sort_unstable();
        due.dedup();
        for key in due {
            // An entry whose load ended, or whose deadline moved on, is stale.
            let Some(load) = self.loads.get(&key).filter(|l| l.deadline().is_some_and(|d| d <= now)) else {
                continue;
            };
            let peer = (load.req.remote.engine_id.clone(), key.1);
            let (e, agent) = match &load.stage {
                Stage::Reading { xfer, read, .. } => {
                    if let Err(e) = self.agent.release(*xfer) {
                        debug!(request_id = %key.0, error = %e, "an overdue READ cannot be cancelled yet");
                        self.load_deadlines.push(now, key);
                        continue;
                    }
                    let timeout = self.config.transfer_timeout;
                    self.stats.reads_failed += 1;
                    (
                        Error::new(ErrorKind::Timeout, format!("the READ took over {timeout:?}")),
                        read.peer.clone(),
                    )
                }
                Stage::Confirming(read) => {
                    // Released again (no answer wanted): a hold the release never reached is
                    // freed now, not at the end of its lease.
                    self.stats.lease_failures += 1;
                    let e = "no answer from the prefill engine whether its hold lived through the READ";
                    (Error::new(ErrorKind::Timeout, e), read.peer.clone())
                }
                Stage::Waiting { .. } => continue,
            };
            // Dropped first: the release goes out on a fresh connection.
            self.invalidate_connection(&peer, &agent);
            self.end_load(now, &key, Err(e), true);
        }
    }

    /// At close: fails every load; collects the READs in flight into `transfers` (to be
    /// cancelled or released), and tells each prefill rank whose peer is ready to free the hold
    /// of a READ that has not completed (a completed READ's release went with it).
    pub(super) fn close_loads(&mut self, transfers: &mut Vec<XferId>) {
        let mut loads: Vec<(LoadKey, Load)> = self.loads.drain().collect();
        self.load_deadlines.clear();
        loads.sort_by(|a, b| a.0.cmp(&b.0));
        self.offers.clear();
        self.reading.clear();
        for (key, load) in loads {
            match load.stage {
                Stage::Reading { xfer, .. } => {
                    self.stats.reads_failed += 1;
                    transfers.push(xfer);
                    self.release_if_ready(&load.req, key.1, load.readers);
                }
                Stage::Waiting { .. } => self.release_if_ready(&load.req, key.1, load.readers),
                Stage::Confirming(_) => {}
            }
        }
        let mut ids: Vec<RequestId> = self.requests.drain().map(|(id, _)| id).collect();
        ids.sort();
        for id in ids {
            self.fail(&id, super::close::closed());
        }
    }

    /// Tells prefill rank `rank` of `req` to free its hold (no answer wanted), if its peer is
    /// ready: nothing is handshaken for it.
    fn release_if_ready(&mut self, req: &RecvRequest, rank: u32, readers: u32) {
        let peer = (req.remote.engine_id.clone(), rank);
        if matches!(self.peers.get(&peer), Some(Peer::Ready(_))) {
            if let Some(msg) = free_at_once(req, self.config.rank, readers) {
                self.notify_peer(&peer, &msg);
            }
        }
    }

    /// Renews the leases of requests still waiting for their KV on this rank's share of the
    /// prefill ranks (`rank, rank + world_size, ..`: every prefill rank is renewed by one).
    pub(super) fn send_heartbeat(&mut self, now: Instant, beat: &Heartbeat) {
        if beat.remote.check().is_err() || beat.remote.engine_id == self.config.engine_id {
            return;
        }
        let ranks: Vec<u32> = self.round_robin(beat.remote_tp_size).collect();
        for chunk in beat.holds.chunks(RENEWALS_PER_MESSAGE) {
            match wire::encode(&RenewLeases { holds: chunk.to_vec() }) {
                Ok(msg) => {
                    for &rank in &ranks {
                        self.stats.renewals_sent += chunk.len() as u64;
                        self.send_to(now, &beat.remote, rank, msg.clone());
                    }
                }
                Err(e) => debug!(error = %e, "encoding a heartbeat failed"),
            }
        }
    }
}

/// The release from decode rank `reader` of `readers` that frees the hold of `req` at once (no
/// answer wanted), encoded; `None` for a request without a nonce.
fn free_at_once(req: &RecvRequest, reader: u32, readers: u32) -> Option<Vec<u8>> {
    let nonce = req.nonce?;
    let request_id = req.prefill_request_id().clone();
    let release = HoldRelease { request_id, nonce, reply_to: None, reader, readers };
    wire::encode(&release).map_err(|e| debug!(error = %e, "encoding a release failed")).ok()
}

/// `list` one head at a time: block `b`'s head `h` is block `b * heads + h` (a head of a block is
/// contiguous in the layouts that allow slicing).
fn per_head(list: &BlockList, heads: u32) -> BlockList {
    BlockList {
        num_blocks: list.num_blocks * heads,
        block_len: list.block_len / u64::from(heads),
        ..list.clone()
    }
}

/// Heads `first .. first + count` of each of `blocks`, in a list of `per_block` heads a block.
fn head_units(blocks: &[BlockId], per_block: u32, first: u32, count: u32) -> Vec<BlockId> {
    blocks.iter().flat_map(|&b| (0..count).map(move |h| b * per_block + first + h)).collect()
}
