//! Peers: handshakes, instance epochs, and messages that wait for a peer to be ready.
//!
//! A peer is one rank of an engine this worker READs from (decode side) or answers (prefill
//! side); with tensor-parallel sizes that differ, a worker has several peers of one engine. It is
//! `Handshaking` until its payload is fetched and checked, then `Ready`. A failed READ,
//! notification or confirmation drops it: the next request for that engine handshakes again, so
//! a restarted engine (a new instance in its payload) is found again. The dropped connection is
//! retired, and forgotten once no READ of it is in flight.
//!
//! [`Peers`] keeps that state with no I/O: it queues the [`WorkerCommand`]s that fetch payloads
//! and hands back what waited for a peer; the worker (`handshake`) checks payloads, loads and
//! forgets the peers' agents, and sends.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};
use tracing::debug;

use super::loads::LoadKey;
use super::pushes::PushKey;
use super::{WorkerCommand, WorkerConfig};
use crate::error::{Error, Result};
use crate::exchange::PeerLocator;
use crate::ids::{AgentName, EngineId};
use crate::meta::ReplyTo;
use crate::params::{Endpoint, RemoteCoordinates};
use crate::tp::HeadSplit;
use crate::transfer::{BlockList, DlistId};

mod handshake;
#[cfg(test)]
mod tests;

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
#[derive(Debug, PartialEq)]
pub(super) enum Waiter {
    /// A load's READ from this peer, posted once the peer is ready.
    Load(LoadKey),
    /// An encoded notification, sent once the peer is ready.
    Message(Vec<u8>),
    /// A push load's registration with this (prefill) peer, sent once it is ready.
    Register(LoadKey),
    /// A push load's registration sent again once this peer is ready again (its connection was
    /// dropped while the registration waited).
    Resend(LoadKey),
    /// A push WRITE into this (decode) peer, posted once it is ready.
    Write(PushKey),
}

#[derive(Debug)]
struct Handshaking {
    started: Instant,
    deadline: Instant,
    waiting: Vec<Waiter>,
    /// A payload fetched while READs of the previous connection to the same agent were still in
    /// flight: connected once they end (or the deadline passes).
    fetched: Option<Vec<u8>>,
}

#[derive(Debug)]
enum Peer {
    Handshaking(Handshaking),
    Ready(Connected),
}

/// A handshake that connected ([`Peers::connected`]).
#[derive(Debug, PartialEq)]
pub(super) struct Connection {
    /// How long it took.
    pub(super) took: Duration,
    /// What waited for it, in the order it came.
    pub(super) waiting: Vec<Waiter>,
    /// The instance this peer had before, when it has another now: the engine restarted.
    pub(super) restarted_from: Option<u64>,
}

/// A payload fetched while READs of the previous connection were in flight, to connect now
/// ([`Peers::take_deferred`]).
#[derive(Debug, PartialEq)]
pub(super) struct Deferred {
    pub(super) peer: PeerKey,
    pub(super) payload: Vec<u8>,
}

/// What closing the peers leaves ([`Peers::close`]).
#[derive(Debug, Default)]
pub(super) struct ClosedPeers {
    /// Every connection, ready or retired, for the agent to release.
    pub(super) connections: Vec<Connected>,
    /// Messages that were waiting for a handshake: never sent.
    pub(super) unsent: u64,
}

/// The peers of one worker. See the module doc.
#[derive(Debug)]
pub(super) struct Peers {
    handshake_timeout: Duration,
    peers: HashMap<PeerKey, Peer>,
    /// Peers dropped while READs to them were still in flight: forgotten once those end.
    retired: Vec<Connected>,
    /// The last instance seen of each peer, to count restarts.
    instances: HashMap<PeerKey, u64>,
    /// Handshakes for the driver to fetch.
    commands: VecDeque<WorkerCommand>,
}

impl Peers {
    pub(super) fn new(config: &WorkerConfig) -> Self {
        Peers {
            handshake_timeout: config.handshake_timeout,
            peers: HashMap::new(),
            retired: Vec::new(),
            instances: HashMap::new(),
            commands: VecDeque::new(),
        }
    }

    /// The connection to `key`, if it is ready.
    pub(super) fn ready(&self, key: &PeerKey) -> Option<&Connected> {
        match self.peers.get(key) {
            Some(Peer::Ready(conn)) => Some(conn),
            _ => None,
        }
    }

    /// Whether the worker `to` names (its engine and rank) is ready at the instance it names:
    /// only such a worker is answered about what this worker does not have (no handshake for
    /// whatever a notification names).
    pub(super) fn connected_at(&self, to: &ReplyTo) -> bool {
        self.ready(&(to.engine.engine_id.clone(), to.rank)).is_some_and(|c| c.instance == to.instance)
    }

    pub(super) fn ready_mut(&mut self, key: &PeerKey) -> Option<&mut Connected> {
        match self.peers.get_mut(key) {
            Some(Peer::Ready(conn)) => Some(conn),
            _ => None,
        }
    }

    pub(super) fn is_handshaking(&self, key: &PeerKey) -> bool {
        matches!(self.peers.get(key), Some(Peer::Handshaking(_)))
    }

    /// Peers ready for READs and notifications.
    pub(super) fn num_ready(&self) -> usize {
        self.peers.values().filter(|p| matches!(p, Peer::Ready(_))).count()
    }

    /// Whether no handshake is running.
    pub(super) fn all_ready(&self) -> bool {
        self.peers.values().all(|p| matches!(p, Peer::Ready(_)))
    }

    /// The earliest handshake deadline.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.peers
            .values()
            .filter_map(|p| match p {
                Peer::Handshaking(h) => Some(h.deadline),
                Peer::Ready(_) => None,
            })
            .min()
    }

    /// The next handshake for the driver to fetch.
    pub(super) fn poll_command(&mut self) -> Option<WorkerCommand> {
        self.commands.pop_front()
    }

    /// Hands `waiter` back when rank `rank` of `remote` is ready (the caller acts now); otherwise
    /// queues it on the peer's handshake, starting one if needed. Fails when the peer's side
    /// channel port cannot be reached (the base port plus the rank overflows).
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
        let deadline = now + self.handshake_timeout;
        let h = Handshaking { started: now, deadline, waiting: vec![waiter], fetched: None };
        self.peers.insert(key, Peer::Handshaking(h));
        Ok(None)
    }

    /// Peer `key`'s handshake connected: it is ready; returns what waited for it, unless no
    /// handshake was running.
    pub(super) fn connected(&mut self, now: Instant, key: &PeerKey, conn: Connected) -> Option<Connection> {
        let instance = conn.instance;
        let Some(Peer::Handshaking(h)) = self.peers.insert(key.clone(), Peer::Ready(conn)) else {
            return None;
        };
        let restarted_from = self.instances.insert(key.clone(), instance).filter(|old| *old != instance);
        Some(Connection {
            took: now.saturating_duration_since(h.started),
            waiting: h.waiting,
            restarted_from,
        })
    }

    /// Keeps a payload fetched for `key` while READs of its previous connection run.
    pub(super) fn defer(&mut self, key: &PeerKey, payload: Vec<u8>) {
        if let Some(Peer::Handshaking(h)) = self.peers.get_mut(key) {
            h.fetched = Some(payload);
        }
    }

    /// The payloads deferred so far, to connect now.
    pub(super) fn take_deferred(&mut self) -> Vec<Deferred> {
        self.peers
            .iter_mut()
            .filter_map(|(k, p)| match p {
                Peer::Handshaking(h) => h.fetched.take().map(|payload| Deferred { peer: k.clone(), payload }),
                Peer::Ready(_) => None,
            })
            .collect()
    }

    /// Peer `key`'s handshake failed: the peer is forgotten (the next request handshakes again);
    /// returns what waited for it, unless no handshake was running.
    pub(super) fn failed(&mut self, key: &PeerKey) -> Option<Vec<Waiter>> {
        match self.peers.remove(key)? {
            Peer::Handshaking(h) => Some(h.waiting),
            Peer::Ready(_) => None,
        }
    }

    /// The peers whose handshakes are past their deadline.
    pub(super) fn expired(&self, now: Instant) -> Vec<PeerKey> {
        self.peers
            .iter()
            .filter(|(_, p)| matches!(p, Peer::Handshaking(h) if h.deadline <= now))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Drops peer `key` (the next request handshakes again). A ready peer's connection is
    /// retired; returns its agent.
    pub(super) fn retire(&mut self, key: &PeerKey) -> Option<AgentName> {
        match self.peers.remove(key)? {
            Peer::Ready(conn) => {
                let agent = conn.agent.clone();
                self.retired.push(conn);
                Some(agent)
            }
            Peer::Handshaking(_) => None,
        }
    }

    /// Takes the retired connections no READ uses any more (`reading` says which agents READs
    /// are in flight from), for the agent to forget.
    pub(super) fn take_unused(&mut self, reading: impl Fn(&AgentName) -> bool) -> Vec<Connected> {
        let (used, unused) = std::mem::take(&mut self.retired).into_iter().partition(|c| reading(&c.agent));
        self.retired = used;
        unused
    }

    /// A retired connection to `agent` at `instance`: the same peer, which did not restart, whose
    /// connection stands again.
    pub(super) fn reuse_retired(&mut self, agent: &AgentName, instance: u64) -> Option<Connected> {
        let i = self.retired.iter().position(|c| c.agent == *agent && c.instance == instance)?;
        Some(self.retired.swap_remove(i))
    }

    /// Takes a retired connection to `agent`, to forget before its name is loaded again.
    pub(super) fn take_retired(&mut self, agent: &AgentName) -> Option<Connected> {
        let i = self.retired.iter().position(|c| c.agent == *agent)?;
        Some(self.retired.swap_remove(i))
    }

    /// At close: takes every connection, retired or ready; handshakes and their waiters end (their
    /// messages are counted unsent), and so do the queued fetches and the instances seen.
    pub(super) fn close(&mut self) -> ClosedPeers {
        let mut closed = ClosedPeers { connections: std::mem::take(&mut self.retired), unsent: 0 };
        for (_, peer) in self.peers.drain() {
            match peer {
                Peer::Ready(conn) => closed.connections.push(conn),
                Peer::Handshaking(h) => {
                    closed.unsent +=
                        h.waiting.iter().filter(|w| matches!(w, Waiter::Message(_))).count() as u64;
                }
            }
        }
        self.commands.clear();
        self.instances.clear();
        closed
    }
}
