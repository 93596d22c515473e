//! The decode side's driver: checks each load before anything touches the network, posts the
//! READs [`Loads`] asks for, and carries out its other effects (releases, dropped peers,
//! reports); renews the leases of requests still waiting for their KV.
//!
//! [`Loads`]: super::loads::Loads

use std::borrow::Cow;
use std::collections::HashSet;
use std::time::Instant;
use tracing::{debug, warn};

use super::loads::{LoadEffect, LoadKey, PeerRelease, PostRead, Posted, free_at_once};
use super::peers::{PeerKey, Waiter};
use super::{ConnectorWorker, Registered, carry_out};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{AgentName, BlockId, RequestId};
use crate::layout::KvCacheLayout;
use crate::meta::{FailedRecv, Heartbeat, HoldRelease, HoldStatus, RecvRequest, RenewLeases};
use crate::tp::{self, HeadSplit, MAX_TP, Slice, Target};
use crate::transfer::{BlockList, BlockPost, DlistId, DlistOwner, RegionBlocks, XferId, XferOp, XferState};
use crate::wire;

/// At most this many holds per heartbeat message (a notification stays small).
const RENEWALS_PER_MESSAGE: usize = 128;

/// Why a load was refused before anything touched the network, and whether the prefill engine
/// is told to free (only once the offer itself checked).
struct Refusal {
    error: Error,
    free: bool,
}

impl Refusal {
    /// Refused without telling the prefill engine (the offer did not check).
    fn quietly(error: Error) -> Self {
        Refusal { error, free: false }
    }

    /// Refused, the prefill engine told to free.
    fn freeing(error: Error) -> Self {
        Refusal { error, free: true }
    }
}

/// What [`ConnectorWorker::post_pairs`] posts: local and remote blocks, index by index, of the
/// heads `slice` names (`local_head` in this rank's blocks).
pub(super) struct Pairs<'a> {
    pub(super) local: &'a [BlockId],
    pub(super) remote: &'a [BlockId],
    pub(super) slice: &'a Slice,
}

/// What [`ConnectorWorker::post_pairs`] posted.
pub(super) struct PostedPairs {
    pub(super) xfer: XferId,
    /// The peer's agent.
    pub(super) agent: AgentName,
    pub(super) bytes: u64,
    /// Descriptors after coalescing.
    pub(super) descriptors: u64,
    /// Descriptors before coalescing (block x region).
    pub(super) block_descriptors: u64,
}

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
        if let Err(Refusal { error, free }) = self.check_load(req, &plan) {
            if free {
                self.release_all(now, req, &plan);
            }
            return self.fail(&req.request_id, error);
        }
        if req.is_notify_only() {
            self.stats.notify_only += 1;
            return self.release_all(now, req, &plan);
        }
        let Ok(targets) = plan else { return };
        let effects = self.loads.admit(now, req, &targets);
        self.apply(now, effects);
    }

    /// Carries out what `Loads` asked for, in order; what an effect leads to (a READ posted, a
    /// load failed) is carried out before the effects after it.
    pub(super) fn apply(&mut self, now: Instant, effects: Vec<LoadEffect>) {
        carry_out(effects, |effect| match effect {
            LoadEffect::AwaitPeer { key, remote, free } => {
                match self.peers.when_ready(now, &remote, key.rank, Waiter::Load(key.clone())) {
                    Ok(Some(_)) => self.issue_effects(now, &key),
                    Ok(None) => Vec::new(),
                    Err(e) => self.loads.fail(now, &key, e, free),
                }
            }
            LoadEffect::Post(post) => {
                let peer = (post.req.remote.engine_id.clone(), post.key.rank);
                let outcome = self.post_read(&peer, &post);
                self.loads.posted(now, &post.key, post.instance, outcome)
            }
            LoadEffect::ReleaseTransfer(xfer) => {
                if let Err(e) = self.agent.release(xfer) {
                    debug!(%xfer, error = %e, "releasing a finished transfer failed");
                }
                Vec::new()
            }
            LoadEffect::FreeHold { remote, rank, release } => {
                self.send_to(now, &remote, rank, release);
                Vec::new()
            }
            LoadEffect::DropPeer { peer, agent: Some(agent) } => {
                self.invalidate_connection(&peer, &agent);
                Vec::new()
            }
            LoadEffect::DropPeer { peer, agent: None } => {
                self.invalidate(&peer);
                Vec::new()
            }
            LoadEffect::Loaded(id) => {
                self.finished.recving.push(id);
                Vec::new()
            }
            LoadEffect::Failed { request_id, error } => {
                self.fail(&request_id, error);
                Vec::new()
            }
        });
    }

    /// Posts the READ of a load whose peer is ready (see `Loads::issue`).
    pub(super) fn issue(&mut self, now: Instant, key: &LoadKey) {
        let effects = self.issue_effects(now, key);
        self.apply(now, effects);
    }

    fn issue_effects(&mut self, now: Instant, key: &LoadKey) -> Vec<LoadEffect> {
        let instance = (self.loads.engine_of(key))
            .and_then(|engine_id| self.peers.ready(&(engine_id.clone(), key.rank)))
            .map(|conn| conn.instance);
        self.loads.issue(now, key, instance)
    }

    /// The prefill ranks this rank reads `req`'s heads from and releases: refused as
    /// `Incompatible` when the heads do not split over the prefill engine's ranks or must be
    /// sliced out of a layout that cannot be (NHD).
    pub(super) fn targets(&self, req: &RecvRequest) -> Result<Vec<Target>> {
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
            let e = Error::new(ErrorKind::State, "load requested before KV caches were registered");
            return Err(Refusal::quietly(e));
        };
        let Some(offer) = req.offer() else {
            let e = "kv_transfer_params carry no kvx_hold_nonce: not an offer of a kvx prefill engine";
            return Err(Refusal::quietly(Error::invalid_peer_data(e)));
        };
        offer.check(self.config.auth_key.as_ref(), req.mac.as_ref()).map_err(Refusal::quietly)?;
        if req.remote.engine_id == self.config.engine_id {
            let e = format!("remote engine {} is this engine", req.remote.engine_id);
            return Err(Refusal::quietly(Error::invalid_peer_data(e)));
        }
        if self.loads.is_loading(&req.request_id, req.nonce) {
            let e = "a load for this request or this offer is already in flight";
            return Err(Refusal::quietly(Error::invalid_argument(e)));
        }
        if req.is_notify_only() {
            return Ok(());
        }
        plan.as_ref().map_err(|e| Refusal::freeing(e.clone()))?;
        let (local_ids, _) = req.read_pairs().map_err(Refusal::freeing)?;
        self.check_local_blocks(registered, req.local_block_ids.len(), &local_ids).map_err(Refusal::freeing)
    }

    /// What a load's own side must be, pull or push: a side channel (the prefill engine answers,
    /// and for a push connects back, there), one group for layers with their own windows, and
    /// `local_ids` (of `groups` groups) in range, none twice.
    pub(super) fn check_local_blocks(
        &self,
        registered: &Registered,
        groups: usize,
        local_ids: &[BlockId],
    ) -> Result<()> {
        if self.config.side_channel.is_none() {
            let e = "a decode worker needs WorkerConfig::side_channel: the prefill engine answers there";
            return Err(Error::new(ErrorKind::State, e));
        }
        if registered.region_windows.is_some() && groups > 1 {
            let e = "layers with their own windows take one KV-cache group, not several";
            return Err(Error::new(ErrorKind::Incompatible, e));
        }
        KvCacheLayout::check_block_ids(local_ids, registered.layout.num_blocks, "local")?;
        let mut seen = HashSet::with_capacity(local_ids.len());
        if let Some(dup) = local_ids.iter().find(|b| !seen.insert(**b)) {
            return Err(Error::invalid_argument(format!("local block {dup} appears twice")));
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

    pub(super) fn fail(&mut self, request_id: &RequestId, error: Error) {
        warn!(%request_id, %error, "KV load failed");
        self.stats.failed_loads += 1;
        self.finished.failed_recving.push(FailedRecv { request_id: request_id.clone(), error });
    }

    /// Collects the READs that ended since the last step (the agent's completions: the step
    /// costs what completed, not what is in flight) and hands each to `Loads::read_ended`.
    pub(super) fn collect_transfers(&mut self, now: Instant) {
        let mut completions = std::mem::take(&mut self.completions);
        completions.clear();
        if let Err(e) = self.agent.drain_completions(&mut completions) {
            warn!(error = %e, "draining transfer completions failed");
        }
        let (mut ended, mut written) = (Vec::with_capacity(completions.len()), Vec::new());
        for &xfer in &completions {
            if let Some(key) = self.pushes.take_write(xfer) {
                written.push((xfer, key, self.outcome(xfer)));
                continue;
            }
            // Not a READ of a load (the agent reports whatever was posted on it).
            let Some(key) = self.loads.take_completed(xfer) else { continue };
            ended.push((key, self.outcome(xfer)));
        }
        self.completions = completions;
        for (key, outcome) in ended {
            let effects = self.loads.read_ended(now, &key, outcome, &mut self.stats);
            self.apply(now, effects);
        }
        for (xfer, key, outcome) in written {
            self.push_write_ended(now, xfer, &key, outcome);
        }
        self.forget_retired();
    }

    /// How a transfer the agent reported complete ended.
    fn outcome(&self, xfer: XferId) -> Result<()> {
        match self.agent.poll(xfer) {
            Ok(XferState::Done) => Ok(()),
            Ok(XferState::Failed(e)) | Err(e) => Err(e),
            Ok(XferState::Pending) => Err(Error::new(
                ErrorKind::Backend,
                format!("the agent reported transfer {xfer} complete, but it is pending"),
            )),
        }
    }

    /// Drops the peer if it is still the connection `agent`.
    pub(super) fn invalidate_connection(&mut self, peer: &PeerKey, agent: &AgentName) {
        if self.peers.ready(peer).is_some_and(|c| &c.agent == agent) {
            self.invalidate(peer);
        }
    }

    /// A prefill rank's answer for one of this worker's READs.
    pub(super) fn on_hold_status(&mut self, now: Instant, from: &AgentName, status: HoldStatus) {
        let effects = self.loads.answer(now, from, &status, &mut self.stats);
        self.apply(now, effects);
    }

    /// Fails READs and confirmations past their deadlines; a READ's transfer is cancelled first
    /// (one that cannot be yet keeps its blocks until it ends), and its peer dropped, so that the
    /// release goes out on a fresh connection.
    pub(super) fn expire_loads(&mut self, now: Instant) {
        for key in self.loads.take_due(now) {
            let Some(overdue) = self.loads.overdue(now, &key) else { continue };
            if let Some(xfer) = overdue.transfer {
                if let Err(e) = self.agent.release(xfer) {
                    debug!(request_id = %key.request_id, error = %e, "an overdue READ cannot be cancelled yet");
                    self.loads.recheck(now, key);
                    continue;
                }
            }
            self.invalidate_connection(&overdue.peer, &overdue.agent);
            let effects = self.loads.time_out(now, &key, &mut self.stats);
            self.apply(now, effects);
        }
    }

    /// At close: fails every load and tells each prefill rank whose peer is ready to free the
    /// hold of a READ that has not completed; returns the READs in flight (to be cancelled or
    /// released).
    pub(super) fn close_loads(&mut self) -> Vec<XferId> {
        let closed = self.loads.close(&mut self.stats);
        for PeerRelease { peer, release } in closed.releases {
            if self.peers.ready(&peer).is_some() {
                self.notify_peer(&peer, &release);
            }
        }
        for id in closed.failed {
            self.fail(&id, super::close::closed());
        }
        closed.transfers
    }

    /// The lists a transfer of `slice` with `peer` posts on: whole blocks when it takes every
    /// head of the blocks on both sides, else single heads (both lists prepared at the first such
    /// transfer). The peer must be of the tensor-parallel size the plan was made for (`peer_tp`),
    /// when one is expected.
    fn read_lists(&mut self, peer: &PeerKey, peer_tp: Option<u32>, slice: &Slice) -> Result<ReadLists> {
        let (Some(registered), Some(conn)) = (&mut self.registered, self.peers.ready_mut(peer)) else {
            return Err(Error::new(ErrorKind::State, "peer not ready"));
        };
        if let Some(tp) = peer_tp.filter(|&tp| tp != conn.split.tp()) {
            return Err(Error::new(
                ErrorKind::Incompatible,
                format!("engine {} has {} ranks, its params said {tp}", peer.0, conn.split.tp()),
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

    /// Posts a READ for `Loads`: its release asks the prefill rank to answer on this engine's
    /// side channel whether the hold lived through the READ.
    fn post_read(&mut self, peer: &PeerKey, load: &PostRead) -> Result<Posted> {
        let req = &load.req;
        let Some(nonce) = req.nonce.filter(|_| self.config.side_channel.is_some()) else {
            return Err(Error::new(ErrorKind::State, "no nonce or no side channel to answer on"));
        };
        let token = self.tokens.next_nonce();
        let release = wire::encode(&HoldRelease {
            request_id: req.prefill_request_id().clone(),
            nonce,
            reply_to: self.reply_to(token),
            reader: self.config.rank,
            readers: load.readers,
            instance: req.prefill_instance(),
        })?;
        let (local, remote) = req.read_pairs()?;
        let prefill_tp = req.remote_tp_size.unwrap_or(self.config.world_size);
        let pairs = Pairs { local: &local, remote: &remote, slice: &load.slice };
        let posted = self.post_pairs(XferOp::Read, peer, Some(prefill_tp), pairs, &release)?;
        self.stats.reads_posted += 1;
        self.stats.descriptors += posted.descriptors;
        self.stats.block_descriptors += posted.block_descriptors;
        Ok(Posted {
            xfer: posted.xfer,
            peer: posted.agent,
            token,
            bytes: posted.bytes,
            descriptors: posted.descriptors,
        })
    }

    /// Posts `op` between this rank's blocks and the ready peer's (`pairs`), with
    /// `notification`. The peer must be of the tensor-parallel size `peer_tp`, when one is
    /// expected.
    pub(super) fn post_pairs(
        &mut self,
        op: XferOp,
        peer: &PeerKey,
        peer_tp: Option<u32>,
        Pairs { local, remote, slice }: Pairs<'_>,
        notification: &[u8],
    ) -> Result<PostedPairs> {
        let lists = self.read_lists(peer, peer_tp, slice)?;
        let (Some(registered), Some(conn)) = (&self.registered, self.peers.ready(peer)) else {
            return Err(Error::new(ErrorKind::State, "peer not ready"));
        };
        KvCacheLayout::check_block_ids(remote, conn.list.num_blocks, "remote")?;
        let layout = &registered.layout;
        // In single-head lists block `b` is heads `b * heads ..`: the slice's heads of each block.
        let (local_blocks, remote_blocks, windows, unit_len, (local_heads, remote_heads)) = match lists.heads
        {
            None => (
                Cow::Borrowed(local),
                Cow::Borrowed(remote),
                registered.region_windows.as_deref().map(Cow::Borrowed),
                layout.block_len,
                (1, 1),
            ),
            Some((local_heads, remote_heads)) => {
                let s = slice;
                let windows = registered.region_windows.as_ref().map(|windows| {
                    windows.iter().map(|w| w.map(|w| w.saturating_mul(s.heads))).collect::<Vec<_>>()
                });
                (
                    Cow::Owned(head_units(local, local_heads, s.local_head, s.heads)),
                    Cow::Owned(head_units(remote, remote_heads, s.remote_head, s.heads)),
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
        let xfer = self.agent.post_blocks(op, lists.local, lists.remote, &blocks, Some(notification))?;
        let block_descriptors = blocks.block_descriptors();
        Ok(PostedPairs {
            xfer,
            agent: conn.agent.clone(),
            bytes: block_descriptors.saturating_mul(unit_len),
            descriptors: blocks.coalesced_len(),
            block_descriptors,
        })
    }

    /// Renews the leases of requests still waiting for their KV on this rank's share of the
    /// prefill ranks (`rank, rank + world_size, ..`: every prefill rank is renewed by one).
    pub(super) fn send_heartbeat(&mut self, now: Instant, beat: &Heartbeat) {
        if beat.remote.check().is_err() || beat.remote.engine_id == self.config.engine_id {
            return;
        }
        let ranks: Vec<u32> = self.round_robin(beat.remote_tp_size).collect();
        let holds = beat
            .holds
            .chunks(RENEWALS_PER_MESSAGE)
            .map(|c| RenewLeases { holds: c.to_vec(), pushes: Vec::new() });
        let pushes = beat
            .pushes
            .chunks(RENEWALS_PER_MESSAGE)
            .map(|c| RenewLeases { holds: Vec::new(), pushes: c.to_vec() });
        for renew in holds.chain(pushes) {
            let n = (renew.holds.len() + renew.pushes.len()) as u64;
            match wire::encode(&renew) {
                Ok(msg) => {
                    for &rank in &ranks {
                        self.stats.renewals_sent += n;
                        self.send_to(now, &beat.remote, rank, msg.clone());
                    }
                }
                Err(e) => debug!(error = %e, "encoding a heartbeat failed"),
            }
        }
    }
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
