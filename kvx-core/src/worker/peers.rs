//! Peers: handshakes, instance epochs, and messages that wait for a peer to be ready.
//!
//! A peer is an engine this worker READs from (decode side) or answers (prefill side). It is
//! `Handshaking` until its payload is fetched and checked, then `Ready`. A failed READ,
//! notification or confirmation invalidates it: the next request for that engine handshakes
//! again, so a restarted engine (a new instance in its payload) is found again. The old
//! connection is forgotten once no READ of it is in flight.

use std::time::Instant;
use tracing::{debug, info};

use super::{ConnectorWorker, WorkerCommand};
use crate::error::{Error, ErrorKind, Result};
use crate::exchange::PeerLocator;
use crate::ids::{AgentName, EngineId, RequestId};
use crate::params::{Endpoint, RemoteCoordinates};
use crate::transfer::{BlockList, DlistId, DlistOwner};
use crate::wire::{self, HandshakePayload};

/// A peer's loaded agent and prepared descriptor list.
#[derive(Debug)]
pub(super) struct Connected {
    pub(super) agent: AgentName,
    pub(super) dlist: DlistId,
    pub(super) num_blocks: u32,
    pub(super) instance: u64,
}

/// What waits for a peer's handshake.
#[derive(Debug)]
pub(super) enum Waiter {
    /// A load, posted once the peer is ready.
    Load(RequestId),
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
    /// Hands `waiter` back when the peer is ready (the caller acts now); otherwise queues it on
    /// the peer's handshake, starting one if needed.
    pub(super) fn when_ready(
        &mut self,
        now: Instant,
        remote: &RemoteCoordinates,
        waiter: Waiter,
    ) -> Result<Option<Waiter>> {
        match self.peers.get_mut(&remote.engine_id) {
            Some(Peer::Ready(_)) => return Ok(Some(waiter)),
            Some(Peer::Handshaking(h)) => {
                h.waiting.push(waiter);
                return Ok(None);
            }
            None => {}
        }
        let rank = self.config.rank;
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
        debug!(%engine_id, ?endpoint, "handshake queued");
        self.commands.push_back(WorkerCommand::FetchHandshake(PeerLocator {
            engine_id: engine_id.clone(),
            rank,
            endpoint,
        }));
        let deadline = now + self.config.handshake_timeout;
        let h = Handshaking { started: now, deadline, waiting: vec![waiter], fetched: None };
        self.peers.insert(engine_id.clone(), Peer::Handshaking(h));
        Ok(None)
    }

    /// Sends an encoded notification to the matching rank of `remote`, now or once it is ready.
    pub(super) fn send_to(&mut self, now: Instant, remote: &RemoteCoordinates, msg: Vec<u8>) {
        match self.when_ready(now, remote, Waiter::Message(msg)) {
            Ok(Some(Waiter::Message(msg))) => self.notify_peer(&remote.engine_id, &msg),
            Ok(_) => {}
            Err(e) => {
                debug!(engine_id = %remote.engine_id, error = %e, "message not sent");
                self.stats.unsent_messages += 1;
            }
        }
    }

    /// Sends to a ready peer; a failed send invalidates it.
    pub(super) fn notify_peer(&mut self, engine_id: &EngineId, msg: &[u8]) {
        let Some(Peer::Ready(conn)) = self.peers.get(engine_id) else {
            debug!(%engine_id, "notification not sent: the peer was dropped");
            self.stats.unsent_messages += 1;
            return;
        };
        if let Err(e) = self.agent.notify(&conn.agent, msg) {
            debug!(%engine_id, error = %e, "notification not sent: the peer is dropped");
            self.stats.unsent_messages += 1;
            self.invalidate(engine_id);
        }
    }

    /// Drops a ready peer (the next request handshakes again); its connection is forgotten once
    /// no READ of it is in flight.
    pub(super) fn invalidate(&mut self, engine_id: &EngineId) {
        if let Some(Peer::Ready(conn)) = self.peers.remove(engine_id) {
            debug!(%engine_id, agent = %conn.agent, "peer invalidated");
            self.stats.peers_invalidated += 1;
            self.retired.push(conn);
            self.forget_retired();
        }
    }

    /// Forgets the dropped connections that no READ uses any more.
    pub(super) fn forget_retired(&mut self) {
        let retired = std::mem::take(&mut self.retired);
        for conn in retired {
            if self.loads.values().any(|l| l.reads_from(&conn.agent)) {
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
        if let Err(e) = self.agent.release_dlist(conn.dlist) {
            debug!(agent = %conn.agent, error = %e, "releasing a dropped peer's list failed");
        }
        if let Err(e) = self.agent.forget_remote(&conn.agent) {
            debug!(agent = %conn.agent, error = %e, "forgetting a dropped peer failed");
        }
    }

    /// The result of a [`WorkerCommand::FetchHandshake`]: the peer's encoded payload, or why the
    /// fetch failed. Validates the payload, loads the peer's agent and prepares its descriptor
    /// list, then posts the waiting loads and sends the waiting messages; on any failure the
    /// loads fail (the prefill engine is told to free where it can be reached) and the next
    /// request for that engine handshakes again.
    pub fn handle_handshake(&mut self, now: Instant, engine_id: &EngineId, result: Result<Vec<u8>>) {
        if !matches!(self.peers.get(engine_id), Some(Peer::Handshaking(_))) {
            debug!(%engine_id, "late or unexpected handshake result ignored");
            return;
        }
        let bytes = match result {
            Ok(bytes) => bytes,
            Err(e) => return self.handshake_failed(now, engine_id, e, None),
        };
        match self.connect(engine_id, &bytes) {
            Ok(Some(conn)) => self.handshake_done(now, engine_id, conn),
            Ok(None) => {
                if let Some(Peer::Handshaking(h)) = self.peers.get_mut(engine_id) {
                    h.fetched = Some(bytes);
                }
            }
            Err(e) => self.handshake_failed(now, engine_id, e, Some(&bytes)),
        }
    }

    fn handshake_done(&mut self, now: Instant, engine_id: &EngineId, conn: Connected) {
        let instance = conn.instance;
        let Some(Peer::Handshaking(h)) = self.peers.insert(engine_id.clone(), Peer::Ready(conn)) else {
            return;
        };
        if let Some(old) = self.instances.insert(engine_id.clone(), instance).filter(|old| *old != instance) {
            info!(%engine_id, "peer engine restarted: connected to its new instance");
            self.stats.peer_restarts += 1;
            self.fail_confirmations_of(now, engine_id, old);
        }
        let took = now.saturating_duration_since(h.started);
        debug!(%engine_id, ?took, "handshake done");
        self.stats.handshakes += 1;
        self.stats.handshake_times.push(took);
        // Messages first: a load may drop the peer again (an offer of a newer instance, a refused
        // post), and the loads after it wait for the next handshake, but a message would be lost.
        let (loads, messages): (Vec<Waiter>, Vec<Waiter>) =
            h.waiting.into_iter().partition(|w| matches!(w, Waiter::Load(_)));
        for waiter in messages.into_iter().chain(loads) {
            match waiter {
                Waiter::Load(id) => self.issue(now, &id),
                Waiter::Message(msg) => self.notify_peer(engine_id, &msg),
            }
        }
    }

    fn handshake_failed(&mut self, now: Instant, engine_id: &EngineId, e: Error, payload: Option<&[u8]>) {
        let Some(Peer::Handshaking(h)) = self.peers.remove(engine_id) else { return };
        self.stats.handshake_failures += 1;
        // Refusals keep their kind (timeout, incompatible, unauthenticated, ...); a malformed
        // payload is the handshake's failure.
        let e = match e.kind() {
            ErrorKind::Wire | ErrorKind::InvalidPeerData => {
                Error::new(ErrorKind::Handshake, e.message()).context(format!("with engine {engine_id}"))
            }
            _ => e.context(format!("with engine {engine_id}")),
        };
        let mut releases = Vec::new();
        for waiter in h.waiting {
            match waiter {
                Waiter::Load(id) => {
                    if let Some(release) = self.end_load(now, &id, Err(e.clone()), false) {
                        releases.push(release);
                    }
                }
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
        let expired: Vec<EngineId> = self
            .peers
            .iter()
            .filter(|(_, p)| matches!(p, Peer::Handshaking(h) if h.deadline <= now))
            .map(|(e, _)| e.clone())
            .collect();
        for engine_id in expired {
            let timeout = self.config.handshake_timeout;
            let e = Error::new(
                ErrorKind::Timeout,
                format!("handshake with engine {engine_id} took over {timeout:?}"),
            );
            self.handshake_failed(now, &engine_id, e, None);
        }
    }

    /// Connects the payloads that waited for an old connection's READs to end.
    pub(super) fn retry_deferred_handshakes(&mut self, now: Instant) {
        let deferred: Vec<(EngineId, Vec<u8>)> = self
            .peers
            .iter_mut()
            .filter_map(|(e, p)| match p {
                Peer::Handshaking(h) => h.fetched.take().map(|b| (e.clone(), b)),
                Peer::Ready(_) => None,
            })
            .collect();
        for (engine_id, bytes) in deferred {
            self.handle_handshake(now, &engine_id, Ok(bytes));
        }
    }

    /// Checks a peer's payload and connects to it (again, when a dropped connection is to the same
    /// instance); `None` while READs of an earlier connection to the same agent are in flight
    /// (loading its new metadata would first forget the old).
    fn connect(&mut self, engine_id: &EngineId, bytes: &[u8]) -> Result<Option<Connected>> {
        let Some(registered) = &self.registered else {
            return Err(Error::new(ErrorKind::State, "not registered"));
        };
        let layout = &registered.layout;
        let p: HandshakePayload = wire::decode(bytes)?;
        if &p.engine_id != engine_id || p.engine_id == self.config.engine_id {
            return Err(Error::invalid_peer_data(format!(
                "payload of engine {} where {engine_id} was expected",
                p.engine_id
            )));
        }
        if p.rank != self.config.rank || p.world_size != self.config.world_size {
            return Err(Error::new(
                ErrorKind::Incompatible,
                format!(
                    "peer is rank {} of {}, this worker rank {} of {}",
                    p.rank, p.world_size, self.config.rank, self.config.world_size
                ),
            ));
        }
        if p.compat_hash != layout.compat_hash(&self.config.compat_tag) || p.block_len != layout.block_len {
            return Err(Error::new(
                ErrorKind::Incompatible,
                format!(
                    "engine {engine_id} has an incompatible KV layout or model (block_len {})",
                    p.block_len
                ),
            ));
        }
        // Descriptor ids are u32 (`region * num_blocks + block`): a pool too large for them is
        // refused here rather than wrapping later.
        let num_descs = u64::from(layout.num_regions()) * u64::from(p.num_blocks);
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
        if self.loads.values().any(|l| l.reads_from(&p.agent_name)) {
            return Ok(None);
        }
        if let Some(i) = self.retired.iter().position(|c| c.agent == p.agent_name) {
            let old = self.retired.swap_remove(i);
            self.forget(&old);
        }
        let list = BlockList { num_blocks: p.num_blocks, ..layout.block_list(p.region_bases) };
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
        Ok(Some(Connected { agent, dlist, num_blocks: p.num_blocks, instance: p.instance }))
    }
}
