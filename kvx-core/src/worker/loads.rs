//! The decode side: admit a load, READ the blocks, and report it done only once the prefill
//! engine confirms its hold lived through the READ; renew the leases of requests still waiting.
//!
//! A load goes `Waiting` (for the handshake) → `Reading` (READ posted, its notification the
//! release with `reply_to`) → `Confirming` (READ done, waiting for [`HoldStatus`]) → reported.
//! Every stage has a deadline. A load that fails after its offer checked tells the prefill
//! engine to free at once.

use std::collections::HashSet;
use std::time::Instant;
use tracing::{debug, warn};

use super::ConnectorWorker;
use super::peers::{Peer, Waiter};
use crate::auth::Nonce;
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{AgentName, EngineId, RequestId};
use crate::layout::KvCacheLayout;
use crate::meta::{FailedRecv, Heartbeat, HoldRelease, HoldStatus, RecvRequest, RenewLeases, ReplyTo};
use crate::transfer::{BlockPost, XferId, XferOp, XferState};
use crate::wire;

/// At most this many holds per heartbeat message (a notification stays small).
const RENEWALS_PER_MESSAGE: usize = 128;

#[derive(Debug)]
pub(super) struct Load {
    req: RecvRequest,
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
    deadline: Instant,
    bytes: u64,
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
}

/// How a load's check failed: the error, and whether the prefill engine is told to free (only
/// once the offer itself checked and no other load uses it).
type Refusal = (Error, bool);

impl ConnectorWorker {
    pub(super) fn admit(&mut self, now: Instant, req: &RecvRequest) {
        if let Err((e, release)) = self.check_load(req) {
            if release {
                self.release_hold(now, req);
            }
            return self.fail(&req.request_id, e);
        }
        if req.is_notify_only() {
            self.stats.notify_only += 1;
            return self.release_hold(now, req);
        }
        let id = req.request_id.clone();
        if let Some(nonce) = req.nonce {
            self.offers.insert(nonce, id.clone());
        }
        self.loads.insert(
            id.clone(),
            Load {
                req: req.clone(),
                stage: Stage::Waiting { retry: None },
                retried: false,
                rehandshaken: false,
            },
        );
        match self.when_ready(now, &req.remote, Waiter::Load(id.clone())) {
            Ok(Some(_)) => self.issue(now, &id),
            Ok(None) => {}
            Err(e) => {
                self.end_load(now, &id, Err(e), true);
            }
        }
    }

    /// Checks what came from the client's params before anything touches the network, then the
    /// local side of the load.
    fn check_load(&self, req: &RecvRequest) -> std::result::Result<(), Refusal> {
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
        if self.loads.contains_key(&req.request_id) || req.nonce.is_some_and(|n| self.offers.contains_key(&n))
        {
            let e = "a load for this request or this offer is already in flight";
            return Err((Error::invalid_argument(e), false));
        }
        if req.is_notify_only() {
            return Ok(());
        }
        if self.config.side_channel.is_none() {
            let e = "a decode worker needs WorkerConfig::side_channel: the prefill engine answers there";
            return Err((Error::new(ErrorKind::State, e), true));
        }
        let local = |e| (e, true);
        KvCacheLayout::check_block_ids(&req.local_block_ids, registered.layout.num_blocks, "local")
            .map_err(local)?;
        let mut seen = HashSet::with_capacity(req.local_block_ids.len());
        if let Some(dup) = req.local_block_ids.iter().find(|b| !seen.insert(**b)) {
            return Err(local(Error::invalid_argument(format!("local block {dup} appears twice"))));
        }
        remote_read(req).map(|_| ()).map_err(local)
    }

    /// Tells the prefill engine to free the hold of `req` (no answer wanted).
    fn release_hold(&mut self, now: Instant, req: &RecvRequest) {
        if let Some(msg) = free_at_once(req) {
            self.send_to(now, &req.remote, msg);
        }
    }

    /// Posts the READ of a load whose peer is ready.
    pub(super) fn issue(&mut self, now: Instant, id: &RequestId) {
        let Some(mut load) = self.loads.remove(id) else { return };
        let engine_id = load.req.remote.engine_id.clone();
        let Some(Peer::Ready(conn)) = self.peers.get(&engine_id) else {
            // Another load waiting on the same handshake dropped the peer again (its offer named
            // a newer instance, or its post was refused): wait for the next handshake.
            self.loads.insert(id.clone(), load);
            self.requeue(now, id);
            return;
        };
        let instance = conn.instance;
        if let Stage::Waiting { retry: Some((e, old)) } = &load.stage {
            if instance == *old {
                let e = e.clone();
                self.loads.insert(id.clone(), load);
                self.end_load(now, id, Err(e), true);
                return;
            }
            debug!(request_id = %id, "the engine restarted: posting the READ again to its new instance");
        }
        if let Some(want) = load.req.remote_instance.map(|i| u64::from_le_bytes(*i.as_bytes())) {
            if want != instance {
                if load.rehandshaken {
                    // The instance that made the offer is gone: its hold went with it.
                    let e = Error::new(
                        ErrorKind::Expired,
                        format!("engine {engine_id} restarted: the instance that held these blocks is gone"),
                    );
                    self.loads.insert(id.clone(), load);
                    self.end_load(now, id, Err(e), false);
                } else {
                    debug!(request_id = %id, %engine_id, "the offer names another instance: handshaking again");
                    load.rehandshaken = true;
                    self.loads.insert(id.clone(), load);
                    self.invalidate(&engine_id);
                    self.requeue(now, id);
                }
                return;
            }
        }
        match self.post_read(&load.req) {
            Ok((xfer, peer, token, bytes)) => {
                let deadline = now + self.config.transfer_timeout;
                let read = Read { peer, instance, token, posted: now, deadline, bytes };
                load.stage = Stage::Reading { xfer, read, answer: None };
                self.loads.insert(id.clone(), load);
                self.reading.insert(xfer, id.clone());
            }
            Err(e)
                if load.retried
                    || matches!(e.kind(), ErrorKind::InvalidPeerData | ErrorKind::InvalidArgument) =>
            {
                self.loads.insert(id.clone(), load);
                self.end_load(now, id, Err(e), true);
            }
            Err(e) => {
                // The transport refused the post (a peer that went away, say): as a failed READ.
                debug!(request_id = %id, error = %e, "post failed: handshaking with the engine again");
                load.retried = true;
                load.stage = Stage::Waiting { retry: Some((e, instance)) };
                self.loads.insert(id.clone(), load);
                self.invalidate(&engine_id);
                self.requeue(now, id);
            }
        }
    }

    /// Queues a load on its peer's (new) handshake, or issues it if the peer is ready.
    fn requeue(&mut self, now: Instant, id: &RequestId) {
        let Some(remote) = self.loads.get(id).map(|l| l.req.remote.clone()) else { return };
        match self.when_ready(now, &remote, Waiter::Load(id.clone())) {
            Ok(Some(_)) => self.issue(now, id),
            Ok(None) => {}
            Err(e) => {
                self.end_load(now, id, Err(e), false);
            }
        }
    }

    /// A restarted engine answers nothing for its earlier instance: the loads waiting for the
    /// old instance's confirmation fail now.
    pub(super) fn fail_confirmations_of(&mut self, now: Instant, engine_id: &EngineId, old: u64) {
        let stale: Vec<RequestId> = self
            .loads
            .iter()
            .filter(|(_, l)| &l.req.remote.engine_id == engine_id)
            .filter(|(_, l)| matches!(&l.stage, Stage::Confirming(read) if read.instance == old))
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            self.stats.lease_failures += 1;
            let e = Error::new(
                ErrorKind::Expired,
                format!("engine {engine_id} restarted before it confirmed the hold"),
            );
            self.end_load(now, &id, Err(e), false);
        }
    }

    fn post_read(&mut self, req: &RecvRequest) -> Result<(XferId, AgentName, Nonce, u64)> {
        let (Some(registered), Some(Peer::Ready(conn))) =
            (&self.registered, self.peers.get(&req.remote.engine_id))
        else {
            return Err(Error::new(ErrorKind::State, "peer not ready"));
        };
        let (Some(nonce), Some(me)) = (req.nonce, &self.config.side_channel) else {
            return Err(Error::new(ErrorKind::State, "no nonce or no side channel to answer on"));
        };
        let token = self.tokens.next_nonce();
        let reply_to = Some(ReplyTo { engine: me.clone(), instance: self.instance, token });
        let release =
            wire::encode(&HoldRelease { request_id: req.prefill_request_id().clone(), nonce, reply_to })?;
        let remote = remote_read(req)?;
        KvCacheLayout::check_block_ids(remote, conn.num_blocks, "remote")?;
        let layout = &registered.layout;
        let blocks = BlockPost {
            local_blocks: &req.local_block_ids,
            local_num_blocks: layout.num_blocks,
            remote_blocks: remote,
            remote_num_blocks: conn.num_blocks,
            regions: layout.region_blocks(registered.region_windows.as_deref()),
        };
        let xfer = self.agent.post_blocks(
            XferOp::Read,
            registered.local_dlist,
            conn.dlist,
            &blocks,
            Some(&release),
        )?;
        self.stats.reads_posted += 1;
        self.stats.descriptors += blocks.coalesced_len();
        let block_descriptors = blocks.block_descriptors();
        self.stats.block_descriptors += block_descriptors;
        let bytes = block_descriptors.saturating_mul(layout.block_len);
        Ok((xfer, conn.agent.clone(), token, bytes))
    }

    /// Ends a load: reports it done or failed. With `release`, a failed load tells the prefill
    /// engine to free; without, the encoded release is returned for the caller to send.
    pub(super) fn end_load(
        &mut self,
        now: Instant,
        id: &RequestId,
        outcome: Result<()>,
        release: bool,
    ) -> Option<Vec<u8>> {
        let load = self.loads.remove(id)?;
        if let Stage::Reading { xfer, .. } = &load.stage {
            self.reading.remove(xfer);
        }
        if let Some(nonce) = load.req.nonce {
            self.offers.remove(&nonce);
        }
        match outcome {
            Ok(()) => {
                if let Stage::Confirming(Read { posted, bytes, .. }) = load.stage {
                    let took = now.saturating_duration_since(posted);
                    debug!(request_id = %id, ?took, bytes, "READ done and confirmed");
                    self.stats.bytes_read += bytes;
                    self.stats.transfer_latencies.push(took);
                }
                self.finished.recving.push(id.clone());
                None
            }
            Err(e) => {
                self.fail(id, e);
                if release {
                    self.release_hold(now, &load.req);
                    return None;
                }
                free_at_once(&load.req)
            }
        }
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
            let Some(id) = self.reading.remove(&xfer) else { continue };
            let outcome = match self.agent.poll(xfer) {
                Ok(XferState::Done) => Ok(()),
                Ok(XferState::Failed(e)) | Err(e) => Err(e),
                Ok(XferState::Pending) => Err(Error::new(
                    ErrorKind::Backend,
                    format!("the agent reported transfer {xfer} complete, but it is pending"),
                )),
            };
            ended.push((id, outcome));
        }
        self.completions = completions;
        for (id, outcome) in ended {
            let Some(load) = self.loads.get_mut(&id) else { continue };
            let Stage::Reading { xfer, read, answer } = &load.stage else { continue };
            if let Err(e) = self.agent.release(*xfer) {
                debug!(request_id = %id, error = %e, "releasing a finished transfer failed");
            }
            let (mut read, answer) = (read.clone(), *answer);
            let peer = read.peer.clone();
            let remote = load.req.remote.clone();
            match outcome {
                Ok(()) => {
                    self.stats.read_latencies.push(now.saturating_duration_since(read.posted));
                    read.deadline = now + self.config.confirm_timeout;
                    load.stage = Stage::Confirming(read);
                    if let Some(held) = answer {
                        self.confirm(now, &id, held);
                    }
                }
                Err(e) if load.retried => {
                    self.stats.reads_failed += 1;
                    self.invalidate_connection(&remote.engine_id, &peer);
                    self.end_load(now, &id, Err(e), true);
                }
                Err(e) => {
                    // The engine may have restarted: handshake again, and post again only if it
                    // has (see `Stage::Waiting`). The READ's notification was not sent.
                    debug!(request_id = %id, error = %e, "READ failed: handshaking with the engine again");
                    self.stats.reads_failed += 1;
                    load.retried = true;
                    load.stage = Stage::Waiting { retry: Some((e, read.instance)) };
                    self.invalidate_connection(&remote.engine_id, &peer);
                    self.requeue(now, &id);
                }
            }
        }
        self.forget_retired();
    }

    /// Drops the engine's peer if it is still the connection `agent`.
    fn invalidate_connection(&mut self, engine_id: &EngineId, agent: &AgentName) {
        if matches!(self.peers.get(engine_id), Some(Peer::Ready(c)) if &c.agent == agent) {
            self.invalidate(engine_id);
        }
    }

    /// The prefill engine's answer for one of this worker's loads.
    pub(super) fn on_hold_status(&mut self, now: Instant, from: &AgentName, status: HoldStatus) {
        let Some(id) = self.offers.get(&status.nonce).cloned() else {
            self.stats.stray_notifications += 1;
            return;
        };
        let Some(load) = self.loads.get_mut(&id) else { return };
        // Only the answer to the release this READ carried (its token) confirms it.
        let ours = match &load.stage {
            Stage::Reading { read, .. } | Stage::Confirming(read) => {
                read.peer == *from && read.token == status.token
            }
            Stage::Waiting { .. } => false,
        };
        if !ours || load.req.prefill_request_id() != &status.request_id {
            self.stats.stray_notifications += 1;
            return;
        }
        match &mut load.stage {
            Stage::Reading { answer, .. } => *answer = Some(status.held),
            _ => self.confirm(now, &id, status.held),
        }
    }

    fn confirm(&mut self, now: Instant, id: &RequestId, held: bool) {
        if held {
            self.end_load(now, id, Ok(()), false);
        } else {
            self.stats.lease_failures += 1;
            let e = Error::new(
                ErrorKind::Expired,
                "the prefill engine's hold ended before the READ's release reached it: the blocks read may have been reused",
            );
            self.end_load(now, id, Err(e), false);
        }
    }

    /// Fails READs and confirmations past their deadlines. A READ whose transfer cannot be
    /// cancelled keeps its blocks until it ends.
    pub(super) fn expire_loads(&mut self, now: Instant) {
        let expired: Vec<RequestId> = self
            .loads
            .iter()
            .filter(|(_, l)| l.deadline().is_some_and(|d| d <= now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            let Some(load) = self.loads.get(&id) else { continue };
            let engine_id = load.req.remote.engine_id.clone();
            let (e, release, peer) = match &load.stage {
                Stage::Reading { xfer, read, .. } => {
                    if let Err(e) = self.agent.release(*xfer) {
                        debug!(request_id = %id, error = %e, "an overdue READ cannot be cancelled yet");
                        continue;
                    }
                    let timeout = self.config.transfer_timeout;
                    self.stats.reads_failed += 1;
                    (
                        Error::new(ErrorKind::Timeout, format!("the READ took over {timeout:?}")),
                        true,
                        read.peer.clone(),
                    )
                }
                Stage::Confirming(read) => {
                    // Released again (no answer wanted): a hold the release never reached is
                    // freed now, not at the end of its lease.
                    self.stats.lease_failures += 1;
                    let e = "no answer from the prefill engine whether its hold lived through the READ";
                    (Error::new(ErrorKind::Timeout, e), true, read.peer.clone())
                }
                Stage::Waiting { .. } => continue,
            };
            // Dropped first: the release goes out on a fresh connection.
            self.invalidate_connection(&engine_id, &peer);
            self.end_load(now, &id, Err(e), release);
        }
    }

    /// At close: fails every load; collects the READs in flight into `transfers` (to be
    /// cancelled or released), and tells each prefill engine whose peer is ready to free the hold
    /// of a load whose READ has not completed (a completed READ's release went with it).
    pub(super) fn close_loads(&mut self, transfers: &mut Vec<XferId>) {
        let mut loads: Vec<(RequestId, Load)> = self.loads.drain().collect();
        loads.sort_by(|a, b| a.0.cmp(&b.0));
        self.offers.clear();
        self.reading.clear();
        for (id, load) in loads {
            match load.stage {
                Stage::Reading { xfer, .. } => {
                    self.stats.reads_failed += 1;
                    transfers.push(xfer);
                    self.release_if_ready(&load.req);
                }
                Stage::Waiting { .. } => self.release_if_ready(&load.req),
                Stage::Confirming(_) => {}
            }
            self.fail(&id, super::close::closed());
        }
    }

    /// Tells the prefill engine of `req` to free its hold (no answer wanted), if its peer is
    /// ready: nothing is handshaken for it.
    fn release_if_ready(&mut self, req: &RecvRequest) {
        let engine_id = &req.remote.engine_id;
        if matches!(self.peers.get(engine_id), Some(Peer::Ready(_))) {
            if let Some(msg) = free_at_once(req) {
                self.notify_peer(engine_id, &msg);
            }
        }
    }

    /// Renews the leases of requests still waiting for their KV on the matching prefill rank.
    pub(super) fn send_heartbeat(&mut self, now: Instant, beat: &Heartbeat) {
        if beat.remote.check().is_err() || beat.remote.engine_id == self.config.engine_id {
            return;
        }
        for chunk in beat.holds.chunks(RENEWALS_PER_MESSAGE) {
            match wire::encode(&RenewLeases { holds: chunk.to_vec() }) {
                Ok(msg) => {
                    self.stats.renewals_sent += chunk.len() as u64;
                    self.send_to(now, &beat.remote, msg);
                }
                Err(e) => debug!(error = %e, "encoding a heartbeat failed"),
            }
        }
    }
}

/// The release that frees the hold of `req` at once (no answer wanted), encoded; `None` for a
/// request without a nonce.
fn free_at_once(req: &RecvRequest) -> Option<Vec<u8>> {
    let nonce = req.nonce?;
    let release = HoldRelease { request_id: req.prefill_request_id().clone(), nonce, reply_to: None };
    wire::encode(&release).map_err(|e| debug!(error = %e, "encoding a release failed")).ok()
}

/// The offered blocks the READ takes: `local_block_ids.len()` from `remote_read_from`.
fn remote_read(req: &RecvRequest) -> Result<&[u32]> {
    let from = req.remote_read_from as usize;
    from.checked_add(req.local_block_ids.len())
        .and_then(|end| req.remote_block_ids.get(from..end))
        .ok_or_else(|| {
            Error::invalid_peer_data(format!(
                "{} local blocks from remote block {from}, but only {} remote blocks",
                req.local_block_ids.len(),
                req.remote_block_ids.len()
            ))
        })
}
