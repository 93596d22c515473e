//! Peers: handshakes, instance epochs, and messages that wait for a peer to be ready.
//!
//! A peer is one rank of an engine this worker READs from (decode side) or answers (prefill
//! side); with tensor-parallel sizes that differ, a worker has several peers of one engine. It is
//! `Handshaking` until its payload is fetched and checked, then `Ready`. A failed READ,
//! notification or confirmation invalidates it: the next request for that engine handshakes
//! again, so a restarted engine (a new instance in its payload) is found again. The old
//! connection is forgotten once no READ of it is in flight.

use std::time::Instant;
use tracing::{debug, info};

use super::{ConnectorWorker, WorkerCommand};
use crate::error::{Error, ErrorKind, Result};
use crate::exchange::PeerLocator;
use crate::ids::{AgentName, EngineId};
use crate::meta::HoldRelease;
use crate::params::{Endpoint, RemoteCoordinates};
use crate::tp::{HeadSplit, MAX_TP};
use crate::transfer::{BlockList, DlistId, DlistOwner};
use crate::wire::{self, HandshakePayload};

use super::loads::LoadKey;

/// A peer: one rank of an engine.
pub(super) type PeerKey = (EngineId, u32);

/// A peer's loaded agent and prepared descriptor lists.
#[derive(Debug)]
pub(super) struct Connected {
    pub(super) agent: AgentName,
    /// The peer's blocks, whole.
    pub(super) dlist: DlistId,
    /// The peer's blocks one head at a time (descriptor `region * num_blocks * heads + block *
    /// heads + head`), prepared at the first READ of part of its heads.
    pub(super) head_dlist: Option<DlistId>,
    /// The peer's blocks' list (what `dlist` was prepared from).
    pub(super) list: BlockList,
    /// The peer engine's tensor-parallel size, and the heads of each of its ranks.
    pub(super) split: HeadSplit,
    pub(super) instance: u64,
}

/// What waits for a peer's handshake.
#[derive(Debug)]
pub(super) enum Waiter {
    /// A load's READ from this peer, posted once the peer is ready.
    Load(LoadKey),
    /// An encoded notification, sent once the peer is ready.
    Message(Vec<u8>),
}

#[derive(Debug)]
pub(super) struct Handshaking {
    started: Instant,
    pub(super) deadline: Instant,
    waiting: Vec<Waiter>,
    /// A payload fetched while READs of the previous connection to the same agent were still in
    /// flight: connected once they end (or the deadline passes).
    fetched: Option<Vec<u8>>,
}

#[derive(Debug)]
pub(super) enum Peer {
    Handshaking(Handshaking),
    Ready(Connected),
}

impl ConnectorWorker {
    /// Hands `waiter` back when rank `rank` of `remote` is ready (the caller acts now); otherwise
    /// queues it on the peer's handshake, starting one if needed.
    pub(super) fn when_ready(
        &mut self,
        now: Instant,
        remote: &RemoteCoordinates,
        rank: u32,
        waiter: Waiter,
    ) -> Result<Option<Waiter>> {
        let key = (remote.engine_id.clone(), rank);
        match self.peers.get_mut(&key) {
            Some(Peer::Ready(_)) => return Ok(Some(waiter)),
            Some(Peer::Handshaking(h)) => {
                h.waiting.push(waiter);
                return Ok(None);
            }
            None => {}
        }
        let endpoint = match &remote.endpoint {
            Some(Endpoint { host, port }) => {
                let port = u16::try_from(u32::from(*port) + rank).map_err(|_| {
                    Error::invalid_peer_data(format!("side-channel port {port} + rank {rank} overflows"))
                })?;
                Some(Endpoint::new(host.clone(), port))
            }
            None => None,
        };
        let engine_id = &remote.engine_id;
        debug!(%engine_id, rank, ?endpoint, "handshake queued");
        self.commands.push_back(WorkerCommand::FetchHandshake(PeerLocator {
            engine_id: engine_id.clone(),
            rank,
            endpoint,
        }));
        let deadline = now + self.config.handshake_timeout;
        let h = Handshaking { started: now, deadline, waiting: vec![waiter], fetched: None };
        self.peers.insert(key, Peer::Handshaking(h));
        Ok(None)
    }

    /// Sends an encoded notification to rank `rank` of `remote`, now or once it is ready.
    pub(super) fn send_to(&mut self, now: Instant, remote: &RemoteCoordinates, rank: u32, msg: Vec<u8>) {
        match self.when_ready(now, remote, rank, Waiter::Message(msg)) {
            Ok(Some(Waiter::Message(msg))) => self.notify_peer(&(remote.engine_id.clone(), rank), &msg),
            Ok(_) => {}
            Err(e) => {
                debug!(engine_id = %remote.engine_id, rank, error = %e, "message not sent");
                self.stats.unsent_messages += 1;
            }
        }
    }

    /// Sends to a ready peer; a failed send invalidates it.
    pub(super) fn notify_peer(&mut self, key: &PeerKey, msg: &[u8]) {
        let (engine_id, rank) = key;
        let Some(Peer::Ready(conn)) = self.peers.get(key) else {
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
    pub(super) fn invalidate(&mut self, key: &PeerKey) {
        if let Some(Peer::Ready(conn)) = self.peers.remove(key) {
            let (engine_id, rank) = key;
            debug!(%engine_id, rank, agent = %conn.agent, "peer invalidated");
            self.stats.peers_invalidated += 1;
            self.retired.push(conn);
            self.forget_retired();
        }
    }

    /// Forgets the dropped connections that no READ uses any more.
    pub(super) fn forget_retired(&mut self) {
        let retired = std::mem::take(&mut self.retired);
        for conn in retired {
            if self.loads.reads_from(&conn.agent) {
                self.retired.push(conn);
            } else {
                self.forget(&conn);
            }
        }
    }

    /// At close: takes every connection, ready or dropped, for the agent to release; messages
    /// still waiting for a handshake are dropped (counted unsent).
    pub(super) fn take_connections(&mut self) -> Vec<Connected> {
        let mut conns = std::mem::take(&mut self.retired);
        for (_, peer) in self.peers.drain() {
            match peer {
                Peer::Ready(conn) => conns.push(conn),
                Peer::Handshaking(h) => {
                    let messages = h.waiting.iter().filter(|w| matches!(w, Waiter::Message(_))).count();
                    self.stats.unsent_messages += messages as u64;
                }
            }
        }
        conns
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
        if !matches!(self.peers.get(&key), Some(Peer::Handshaking(_))) {
            debug!(%engine_id, rank, "late or unexpected handshake result ignored");
            return;
        }
        let bytes = match result {
            Ok(bytes) => bytes,
            Err(e) => return self.handshake_failed(now, &key, e, None),
        };
        match self.connect(&key, &bytes) {
            Ok(Some(conn)) => self.handshake_done(now, &key, conn),
            Ok(None) => {
                if let Some(Peer::Handshaking(h)) = self.peers.get_mut(&key) {
                    h.fetched = Some(bytes);
                }
            }
            Err(e) => self.handshake_failed(now, &key, e, Some(&bytes)),
        }
    }

    fn handshake_done(&mut self, now: Instant, key: &PeerKey, conn: Connected) {
        let instance = conn.instance;
        let Some(Peer::Handshaking(h)) = self.peers.insert(key.clone(), Peer::Ready(conn)) else {
            return;
        };
        let (engine_id, rank) = key;
        if let Some(old) = self.instances.insert(key.clone(), instance).filter(|old| *old != instance) {
            info!(%engine_id, rank, "peer engine restarted: connected to its new instance");
            self.stats.peer_restarts += 1;
            let effects = self.loads.peer_restarted(now, key, old, &mut self.stats);
            self.apply(now, effects);
        }
        let took = now.saturating_duration_since(h.started);
        debug!(%engine_id, rank, ?took, "handshake done");
        self.stats.handshakes += 1;
        self.stats.handshake_times.push(took);
        // Messages first: a load may drop the peer again (an offer of a newer instance, a refused
        // post), and the loads after it wait for the next handshake, but a message would be lost.
        let (loads, messages): (Vec<Waiter>, Vec<Waiter>) =
            h.waiting.into_iter().partition(|w| matches!(w, Waiter::Load(_)));
        for waiter in messages.into_iter().chain(loads) {
            match waiter {
                Waiter::Load(id) => self.issue(now, &id),
                Waiter::Message(msg) => self.notify_peer(key, &msg),
            }
        }
    }

    fn handshake_failed(&mut self, now: Instant, key: &PeerKey, e: Error, payload: Option<&[u8]>) {
        let Some(Peer::Handshaking(h)) = self.peers.remove(key) else { return };
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
        for waiter in h.waiting {
            match waiter {
                Waiter::Load(id) => {
                    let failed = self.loads.handshake_failed(now, &id, e.clone());
                    releases.extend(failed.release);
                    self.apply(now, failed.effects);
                }
                // A notify-only request's release: a refused peer can still be told below.
                Waiter::Message(msg) if wire::decode::<HoldRelease>(&msg).is_ok() => releases.push(msg),
                Waiter::Message(_) => self.stats.unsent_messages += 1,
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

    pub(super) fn expire_handshakes(&mut self, now: Instant) {
        let expired: Vec<PeerKey> = self
            .peers
            .iter()
            .filter(|(_, p)| matches!(p, Peer::Handshaking(h) if h.deadline <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for key in expired {
            let timeout = self.config.handshake_timeout;
            let e = Error::new(ErrorKind::Timeout, format!("handshake took over {timeout:?}"));
            self.handshake_failed(now, &key, e, None);
        }
    }

    /// Connects the payloads that waited for an old connection's READs to end.
    pub(super) fn retry_deferred_handshakes(&mut self, now: Instant) {
        let deferred: Vec<(PeerKey, Vec<u8>)> = self
            .peers
            .iter_mut()
            .filter_map(|(k, p)| match p {
                Peer::Handshaking(h) => h.fetched.take().map(|b| (k.clone(), b)),
                Peer::Ready(_) => None,
            })
            .collect();
        for ((engine_id, rank), bytes) in deferred {
            self.handle_handshake(now, &engine_id, rank, Ok(bytes));
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
        if let Some(i) = self.retired.iter().position(|c| c.agent == p.agent_name && c.instance == p.instance)
        {
            return Ok(Some(self.retired.swap_remove(i)));
        }
        if self.loads.reads_from(&p.agent_name) {
            return Ok(None);
        }
        if let Some(i) = self.retired.iter().position(|c| c.agent == p.agent_name) {
            let old = self.retired.swap_remove(i);
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
