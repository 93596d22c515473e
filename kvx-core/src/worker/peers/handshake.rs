//! The worker's side of its peers: checking a fetched payload and loading the peer's agent,
//! sending to a peer once it is ready, and forgetting the connections [`Peers`](super::Peers) retired.

use std::time::Instant;
use tracing::{debug, info};

use super::{Connected, Deferred, PeerKey, Waiter};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::EngineId;
use crate::meta::HoldRelease;
use crate::params::RemoteCoordinates;
use crate::tp::{HeadSplit, MAX_TP};
use crate::transfer::{BlockList, DlistOwner};
use crate::wire::{self, HandshakePayload};
use crate::worker::ConnectorWorker;

impl ConnectorWorker {
    /// Sends an encoded notification to rank `rank` of `remote`, now or once it is ready.
    pub(in crate::worker) fn send_to(
        &mut self,
        now: Instant,
        remote: &RemoteCoordinates,
        rank: u32,
        msg: Vec<u8>,
    ) {
        match self.peers.when_ready(now, remote, rank, Waiter::Message(msg)) {
            Ok(Some(Waiter::Message(msg))) => self.notify_peer(&(remote.engine_id.clone(), rank), &msg),
            Ok(_) => {}
            Err(e) => {
                debug!(engine_id = %remote.engine_id, rank, error = %e, "message not sent");
                self.stats.unsent_messages += 1;
            }
        }
    }

    /// Sends to a ready peer; a failed send invalidates it.
    pub(in crate::worker) fn notify_peer(&mut self, key: &PeerKey, msg: &[u8]) {
        let (engine_id, rank) = key;
        let Some(conn) = self.peers.ready(key) else {
            debug!(%engine_id, rank, "notification not sent: the peer was dropped");
            self.stats.unsent_messages += 1;
            return;
        };
        if let Err(e) = self.agent.notify(&conn.agent, msg) {
            debug!(%engine_id, rank, error = %e, "notification not sent: the peer is dropped");
            self.stats.unsent_messages += 1;
            self.invalidate(key);
        }
    }

    /// Drops a ready peer (the next request handshakes again); its connection is forgotten once
    /// no READ of it is in flight.
    pub(in crate::worker) fn invalidate(&mut self, key: &PeerKey) {
        if let Some(agent) = self.peers.retire(key) {
            let (engine_id, rank) = key;
            debug!(%engine_id, rank, %agent, "peer invalidated");
            self.stats.peers_invalidated += 1;
            self.forget_retired();
        }
    }

    /// Forgets the dropped connections that no READ uses any more.
    pub(in crate::worker) fn forget_retired(&mut self) {
        let (loads, pushes) = (&self.loads, &self.pushes);
        for conn in self.peers.take_unused(|agent| loads.reads_from(agent) || pushes.writes_to(agent)) {
            self.forget(&conn);
        }
    }

    fn forget(&self, conn: &Connected) {
        for dlist in std::iter::once(conn.dlist).chain(conn.head_dlist) {
            if let Err(e) = self.agent.release_dlist(dlist) {
                debug!(agent = %conn.agent, error = %e, "releasing a dropped peer's list failed");
            }
        }
        if let Err(e) = self.agent.forget_remote(&conn.agent) {
            debug!(agent = %conn.agent, error = %e, "forgetting a dropped peer failed");
        }
    }

    /// The result of a [`WorkerCommand::FetchHandshake`] for rank `rank` of `engine_id` (the
    /// locator's): the peer's encoded payload, or why the fetch failed. Validates the payload,
    /// loads the peer's agent and prepares its descriptor list, then posts the waiting loads and
    /// sends the waiting messages; on any failure the loads fail (the prefill engine is told to
    /// free where it can be reached) and the next request for that peer handshakes again.
    pub fn handle_handshake(
        &mut self,
        now: Instant,
        engine_id: &EngineId,
        rank: u32,
        result: Result<Vec<u8>>,
    ) {
        let key = (engine_id.clone(), rank);
        if !self.peers.is_handshaking(&key) {
            debug!(%engine_id, rank, "late or unexpected handshake result ignored");
            return;
        }
        let bytes = match result {
            Ok(bytes) => bytes,
            Err(e) => return self.handshake_failed(now, &key, e, None),
        };
        match self.connect(&key, &bytes) {
            Ok(Some(conn)) => self.handshake_done(now, &key, conn),
            Ok(None) => self.peers.defer(&key, bytes),
            Err(e) => self.handshake_failed(now, &key, e, Some(&bytes)),
        }
    }

    fn handshake_done(&mut self, now: Instant, key: &PeerKey, conn: Connected) {
        let Some(connection) = self.peers.connected(now, key, conn) else { return };
        let (engine_id, rank) = key;
        if let Some(old) = connection.restarted_from {
            info!(%engine_id, rank, "peer engine restarted: connected to its new instance");
            self.stats.peer_restarts += 1;
            let effects = self.loads.peer_restarted(now, key, old, &mut self.stats);
            self.apply(now, effects);
            let effects = self.registrations.peer_restarted(now, key, old);
            self.apply_registrations(now, effects);
        }
        let took = connection.took;
        debug!(%engine_id, rank, ?took, "handshake done");
        self.stats.handshakes += 1;
        self.stats.handshake_times.push(took);
        // Messages first: a load may drop the peer again (an offer of a newer instance, a refused
        // post), and the loads after it wait for the next handshake, but a message would be lost.
        let (loads, messages): (Vec<Waiter>, Vec<Waiter>) =
            connection.waiting.into_iter().partition(|w| matches!(w, Waiter::Load(_)));
        for waiter in messages.into_iter().chain(loads) {
            match waiter {
                Waiter::Load(id) => self.issue(now, &id),
                Waiter::Message(msg) => self.notify_peer(key, &msg),
                Waiter::Register(id) => self.send_registration(now, &id),
                Waiter::Resend(id) => self.resend_registration(now, &id),
                Waiter::Write(id) => self.post_write(now, &id),
            }
        }
    }

    fn handshake_failed(&mut self, now: Instant, key: &PeerKey, e: Error, payload: Option<&[u8]>) {
        let Some(waiting) = self.peers.failed(key) else { return };
        let (engine_id, rank) = key;
        self.stats.handshake_failures += 1;
        // Refusals keep their kind (timeout, incompatible, unauthenticated, ...); a malformed
        // payload is the handshake's failure.
        let e = match e.kind() {
            ErrorKind::Wire | ErrorKind::InvalidPeerData => Error::new(ErrorKind::Handshake, e.message())
                .context(format!("with engine {engine_id} rank {rank}")),
            _ => e.context(format!("with engine {engine_id} rank {rank}")),
        };
        let mut releases = Vec::new();
        for waiter in waiting {
            match waiter {
                Waiter::Load(id) => {
                    let failed = self.loads.handshake_failed(now, &id, e.clone());
                    releases.extend(failed.release);
                    self.apply(now, failed.effects);
                }
                // A notify-only request's release: a refused peer can still be told below.
                Waiter::Message(msg) if wire::decode::<HoldRelease>(&msg).is_ok() => releases.push(msg),
                Waiter::Message(_) => self.stats.unsent_messages += 1,
                Waiter::Register(id) => {
                    let effects = self.registrations.sent(now, &id, Err(e.clone()), &mut self.stats);
                    self.apply_registrations(now, effects);
                }
                Waiter::Write(id) => self.push_unreachable(now, &id),
                // Its wait and cancel settle it.
                Waiter::Resend(_) => {}
            }
        }
        // A peer refused for its layout or model can still be told to free its blocks.
        if let Some(payload) = payload.filter(|_| e.kind() == ErrorKind::Incompatible && !releases.is_empty())
        {
            self.release_through(payload, &releases);
        }
    }

    /// Best effort: loads the agent of a refused peer's payload only to send it `releases`.
    fn release_through(&self, payload: &[u8], releases: &[Vec<u8>]) {
        let Ok(p) = wire::decode::<HandshakePayload>(payload) else { return };
        let Ok(agent) = self.agent.load_remote(&p.agent_metadata) else { return };
        for release in releases {
            if let Err(e) = self.agent.notify(&agent, release) {
                debug!(%agent, error = %e, "release to a refused peer not sent");
            }
        }
        let _ = self.agent.forget_remote(&agent);
    }

    pub(in crate::worker) fn expire_handshakes(&mut self, now: Instant) {
        for key in self.peers.expired(now) {
            let timeout = self.config.handshake_timeout;
            let e = Error::new(ErrorKind::Timeout, format!("handshake took over {timeout:?}"));
            self.handshake_failed(now, &key, e, None);
        }
    }

    /// Connects the payloads that waited for an old connection's READs to end.
    pub(in crate::worker) fn retry_deferred_handshakes(&mut self, now: Instant) {
        for Deferred { peer: (engine_id, rank), payload } in self.peers.take_deferred() {
            self.handle_handshake(now, &engine_id, rank, Ok(payload));
        }
    }

    /// Checks a peer's payload and connects to it (again, when a dropped connection is to the same
    /// instance); `None` while READs of an earlier connection to the same agent are in flight
    /// (loading its new metadata would first forget the old).
    ///
    /// The peer may have another tensor-parallel size: its layout must be the same per head (the
    /// compatibility hash), of the same model's heads, and its blocks must hold its rank's share
    /// of them; an engine that cannot split the heads is refused as `Incompatible`.
    fn connect(&mut self, key: &PeerKey, bytes: &[u8]) -> Result<Option<Connected>> {
        let Some(registered) = &self.registered else {
            return Err(Error::new(ErrorKind::State, "not registered"));
        };
        let (engine_id, rank) = key;
        let layout = &registered.layout;
        let p: HandshakePayload = wire::decode(bytes)?;
        if &p.engine_id != engine_id || p.engine_id == self.config.engine_id || p.rank != *rank {
            return Err(Error::invalid_peer_data(format!(
                "payload of engine {} rank {} where {engine_id} rank {rank} was expected",
                p.engine_id, p.rank
            )));
        }
        if p.world_size == 0 || p.world_size > MAX_TP || p.rank >= p.world_size {
            return Err(Error::invalid_peer_data(format!("peer is rank {} of {}", p.rank, p.world_size)));
        }
        if p.compat_hash != layout.compat_hash(&self.config.compat_tag) {
            return Err(Error::new(
                ErrorKind::Incompatible,
                format!(
                    "engine {engine_id} has an incompatible KV layout or model (head size, dtype, layers, block size or windows differ)"
                ),
            ));
        }
        if p.kv_heads != registered.split.heads() {
            return Err(Error::new(
                ErrorKind::Incompatible,
                format!(
                    "engine {engine_id} has {} KV heads, this engine {}",
                    p.kv_heads,
                    registered.split.heads()
                ),
            ));
        }
        let split = HeadSplit::new(p.kv_heads, p.world_size)?;
        if Some(p.block_len) != u64::from(split.per_rank()).checked_mul(layout.head_len()) {
            return Err(Error::new(
                ErrorKind::Incompatible,
                format!(
                    "engine {engine_id} rank {rank} has blocks of {} bytes, not {} heads of {} bytes",
                    p.block_len,
                    split.per_rank(),
                    layout.head_len()
                ),
            ));
        }
        // Descriptor ids are u32 (`region * num_blocks * heads + ..`): a pool too large for them
        // is refused here rather than wrapping later.
        let num_descs =
            u64::from(layout.num_regions()) * u64::from(p.num_blocks) * u64::from(split.per_rank());
        if p.region_bases.len() != layout.num_regions() as usize
            || p.num_blocks == 0
            || num_descs > u64::from(u32::MAX)
        {
            return Err(Error::invalid_peer_data(format!(
                "{} regions of {} blocks, expected {} regions",
                p.region_bases.len(),
                p.num_blocks,
                layout.num_regions()
            )));
        }
        // The same instance under the same name: it did not restart; the connection stands.
        if let Some(conn) = self.peers.reuse_retired(&p.agent_name, p.instance) {
            return Ok(Some(conn));
        }
        if self.loads.reads_from(&p.agent_name) || self.pushes.writes_to(&p.agent_name) {
            return Ok(None);
        }
        if let Some(old) = self.peers.take_retired(&p.agent_name) {
            self.forget(&old);
        }
        let list = BlockList {
            num_blocks: p.num_blocks,
            block_len: p.block_len,
            ..layout.block_list(p.region_bases)
        };
        let agent = match self.agent.load_remote(&p.agent_metadata) {
            Ok(name) if name != p.agent_name => {
                let _ = self.agent.forget_remote(&name);
                return Err(Error::invalid_peer_data(format!(
                    "agent metadata names {name}, the payload {}",
                    p.agent_name
                )));
            }
            Err(e) if e.kind() == ErrorKind::State => {
                // A restarted peer reusing its agent name: its old metadata is stale.
                self.agent.forget_remote(&p.agent_name)?;
                self.agent.load_remote(&p.agent_metadata)?
            }
            other => other?,
        };
        let dlist = match self.agent.prep_dlist(&DlistOwner::Remote(agent.clone()), &list) {
            Ok(d) => d,
            Err(e) => {
                let _ = self.agent.forget_remote(&agent);
                return Err(e);
            }
        };
        Ok(Some(Connected { agent, dlist, head_dlist: None, list, split, instance: p.instance }))
    }
}
