//! The worker side of the connector, one per tensor-parallel rank: registers the KV caches,
//! handshakes with peers, posts the READs, keeps the prefill engine's holds under leases, and
//! reports what finished. Sans-IO: time comes in as `now`, network work goes out as
//! [`WorkerCommand`]s and comes back through [`ConnectorWorker::handle_handshake`]; the engine's
//! step never waits on the network. The transfer agent is called inline (register, post,
//! drain_completions, poll, notify): those calls never block. Each step drains the agent's
//! completions once and polls only the READs that ended, so it costs what completed, not what is
//! in flight.
//!
//! Each side's state is a type with no I/O that takes events and returns effects; the worker
//! routes events to it and carries the effects out (calling the agent, sending to peers):
//!
//! - `loads`: the decode side's state (`Loads`: admit, READ from each prefill rank that holds the
//!   heads, lease confirmation); `decode` checks loads, posts their READs, carries out their
//!   effects, and sends heartbeats.
//! - `holds`: the prefill side (`Holds`: leases, releases, their answers).
//! - Push mode: `registrations`, the decode side (`Registrations`: a registration per prefill
//!   rank, resent while unanswered, cancels); `pushes`, the prefill side (`Pushes`: push holds,
//!   registrations kept until their hold, WRITEs, answers); `pushing` carries out both.
//! - `peers`: handshakes, instance epochs, and messages waiting for a peer to be ready (`Peers`);
//!   `peers::handshake` checks payloads, loads and forgets peers' agents, and sends.
//! - `close`: the teardown that gives the agent back every registration, list and peer.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::debug;

use crate::auth::AuthKey;
use crate::error::{Error, ErrorKind, Result};
use crate::exchange::PeerLocator;
use crate::ids::{EngineId, RequestId};
use crate::layout::{AttentionKind, KvCacheLayout, LayerCache};
use crate::meta::{
    ConnectorMetadata, Finished, HoldRelease, HoldStatus, PushCancel, PushRegistration, PushResult,
    RenewLeases, ReplyTo,
};
use crate::params::RemoteCoordinates;
use crate::tp::HeadSplit;
use crate::transfer::{BlockList, DlistId, DlistOwner, Notification, RegistrationId, TransferAgent, XferId};
use crate::wire::{self, HandshakePayload, MessageKind};

mod aggregator;
mod close;
mod deadlines;
mod decode;
mod early;
mod holds;
mod loads;
mod peers;
mod pushes;
mod pushing;
mod registrations;
mod samples;
mod stats;
mod ttl;

pub use aggregator::{AggregatorLimits, AggregatorStats, FinishedAggregator};
pub use samples::{Histogram, Samples};
pub use stats::{CounterUnit, StatCounter, StatTiming, WorkerStats};

pub use crate::params::{MAX_HOST_LEN, MAX_ID_LEN};

use close::Leftovers;
use holds::Holds;
use loads::Loads;
use peers::Peers;
use pushes::Pushes;
use registrations::Registrations;

/// Configuration of one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// This engine.
    pub engine_id: EngineId,
    /// This worker's tensor-parallel rank.
    pub rank: u32,
    /// The engine's tensor-parallel size.
    pub world_size: u32,
    /// KV heads of the whole model (vLLM's total number of KV heads), which the ranks split or,
    /// when there are more ranks than heads, replicate. `None`: the heads in this rank's cache
    /// times `world_size`. MLA's latent counts as one head (`None` or `Some(1)`).
    pub kv_heads: Option<u32>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// What else peers must agree on: model name and dtype, say. Part of the compatibility hash.
    pub compat_tag: String,
    /// This engine's own side channel (its id, host and base port). Decode side: required for
    /// loads, because the prefill engine answers there whether its hold lived through the READ.
    pub side_channel: Option<RemoteCoordinates>,
    /// How long a handshake may take before the requests waiting on it fail.
    pub handshake_timeout: Duration,
    /// Prefill side: the lease of a hold (vLLM's `kv_lease_duration`): blocks are freed when no
    /// reader released them and no heartbeat renewed them for this long.
    pub lease_duration: Duration,
    /// Decode side: how long a posted READ may take before the load fails (its transfer is
    /// cancelled).
    pub transfer_timeout: Duration,
    /// Decode side: how long to wait, after a READ completed, for the prefill engine's answer
    /// whether its hold was still alive. Without the answer the load fails.
    pub confirm_timeout: Duration,
    /// Prefill side: at most this many releases that name no hold yet are kept for each sender
    /// (the agent the transport names as the notification's sender), its oldest pushed out first,
    /// so one sender's flood pushes out only its own releases.
    pub early_releases_per_sender: usize,
    /// Prefill side: releases that name no hold yet are kept for at most this many senders; a new
    /// sender evicts the sender that holds the most (of those, the one heard from least recently).
    /// In all at most `early_releases_per_sender * max_early_senders` releases are kept, and as
    /// many ended holds (to answer a late release "not held").
    pub max_early_senders: usize,
    /// Prefill side: how long a release that names no hold yet is kept.
    pub early_release_ttl: Duration,
    /// The deployment's shared key. Decode side: params whose offer MAC does not verify under it
    /// are refused before any handshake or READ. (The side channel takes the same key.)
    pub auth_key: Option<AuthKey>,
    /// This worker's instance, published in its handshake payload; the engine's scheduler names
    /// the same one in its params ([`SchedulerConfig::instance`](crate::SchedulerConfig::instance)).
    /// `None`: chosen at random.
    pub instance: Option<u64>,
}

impl WorkerConfig {
    /// A configuration with the usual timeouts (5 s handshake, 30 s lease, 60 s transfer, 10 s
    /// confirmation, early releases kept 30 s, at most 512 of each of at most 64 senders), no side
    /// channel and no key.
    pub fn new(engine_id: EngineId, rank: u32, world_size: u32, block_size: u32) -> Self {
        WorkerConfig {
            engine_id,
            rank,
            world_size,
            kv_heads: None,
            block_size,
            compat_tag: String::new(),
            side_channel: None,
            handshake_timeout: Duration::from_secs(5),
            lease_duration: Duration::from_secs(30),
            transfer_timeout: Duration::from_secs(60),
            confirm_timeout: Duration::from_secs(10),
            early_releases_per_sender: 512,
            max_early_senders: 64,
            early_release_ttl: Duration::from_secs(30),
            auth_key: None,
            instance: None,
        }
    }
}

/// Network work the worker asks its driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerCommand {
    /// Fetch the handshake payload of the peer worker (its endpoint already offset by the peer's
    /// rank) and hand the result to [`ConnectorWorker::handle_handshake`].
    FetchHandshake(PeerLocator),
}

/// When one completed load passed each stage (decode side), for attributing a request's latency:
/// [`ConnectorWorker::take_load_times`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadTimes {
    /// The decode engine's request.
    pub request_id: RequestId,
    /// The step that handed the load to the worker ([`ConnectorWorker::start_load_kv`]).
    pub admitted: Instant,
    /// Its READ's post (the last one, if a failed READ was posted again).
    pub posted: Instant,
    /// The step that found the READ done.
    pub read_done: Instant,
    /// The step that took the prefill engine's confirmation: the load was reported finished.
    pub confirmed: Instant,
}

/// One READ that completed and whose hold the prefill engine confirmed (decode side), as vLLM's
/// NixlConnector records each transfer: [`ConnectorWorker::take_transfers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferRecord {
    /// From its post to the step that found it done (as `read_latencies`).
    pub duration: Duration,
    /// Bytes it moved.
    pub bytes: u64,
    /// Descriptors it was posted with, after coalescing (as `descriptors`).
    pub descriptors: u64,
}

#[derive(Debug)]
struct Registered {
    layout: KvCacheLayout,
    /// How the model's heads lie on this engine's ranks.
    split: HeadSplit,
    /// Each region's block window, when a layer has one (see `KvCacheLayout::region_windows`).
    region_windows: Option<Vec<Option<u32>>>,
    /// The local blocks, whole.
    local_dlist: DlistId,
    /// The local blocks one head at a time, prepared at the first READ of part of a peer's heads
    /// (see `peers::Connected::head_dlist`).
    head_dlist: Option<DlistId>,
    /// The local blocks' list (what `local_dlist` was prepared from).
    local_list: BlockList,
    payload: Vec<u8>,
    registrations: Vec<RegistrationId>,
}

/// The worker side of the connector, one per tensor-parallel rank. See `docs/CONTRACT.md`.
///
/// # Calling order
/// 1. [`register_kv_caches`](Self::register_kv_caches) once; publish the payload it returns.
/// 2. Each step: [`start_load_kv`](Self::start_load_kv) with the scheduler's metadata, then
///    [`poll_command`](Self::poll_command) until `None` (the driver runs the fetches and feeds
///    results to [`handle_handshake`](Self::handle_handshake) whenever they arrive), then
///    [`get_finished`](Self::get_finished).
/// 3. [`close`](Self::close) before the KV memory is freed.
#[derive(Debug)]
pub struct ConnectorWorker {
    config: WorkerConfig,
    agent: Arc<dyn TransferAgent>,
    /// Chosen at start; published in the handshake payload.
    instance: u64,
    /// Decode side: each READ's token (see `ReplyTo::token`).
    tokens: crate::auth::NonceSource,
    registered: Option<Registered>,
    /// Handshakes, ready and retired connections.
    peers: Peers,
    /// Decode side: loads, their READs and confirmations.
    loads: Loads,
    /// Decode side: the buffer `drain_completions` fills each step.
    completions: Vec<XferId>,
    /// Prefill side: holds, early releases and ended holds.
    holds: Holds,
    /// Decode side: push loads and their registrations.
    registrations: Registrations,
    /// Prefill side: push holds, registrations and WRITEs.
    pushes: Pushes,
    finished: Finished,
    notifications: Vec<Notification>,
    stats: WorkerStats,
    /// Once closed: what the agent has not yet given back (retried by the next `close`).
    closed: Option<Leftovers>,
}

impl ConnectorWorker {
    /// A worker over `agent`, which must support READ and notifications. The worker takes the
    /// agent's completions and notifications: no one else drains them. Its tokens (the random
    /// value each READ's release carries) come from the operating system.
    pub fn new(config: WorkerConfig, agent: Arc<dyn TransferAgent>) -> Result<Self> {
        Self::with_nonces(config, agent, crate::auth::NonceSource::from_entropy()?)
    }

    /// As [`new`](Self::new), drawing the tokens from `tokens` (a seeded source replays a run, as
    /// [`ConnectorScheduler::with_nonces`](crate::ConnectorScheduler::with_nonces) does for the
    /// hold nonces). The instance, when the config names none, still comes from the system.
    pub fn with_nonces(
        config: WorkerConfig,
        agent: Arc<dyn TransferAgent>,
        tokens: crate::auth::NonceSource,
    ) -> Result<Self> {
        let caps = agent.capabilities();
        if !caps.read || !caps.notifications {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("backend {} lacks one-sided READ or notifications", caps.backend),
            ));
        }
        if config.block_size == 0 || config.world_size == 0 || config.rank >= config.world_size {
            return Err(Error::invalid_argument(format!(
                "invalid worker config: block_size {}, rank {} of {}",
                config.block_size, config.rank, config.world_size
            )));
        }
        let instance = match config.instance {
            Some(i) => i,
            None => u64::from_le_bytes(crate::auth::random_bytes()?),
        };
        let holds = Holds::new(&config, instance);
        let pushes = Pushes::new(&config, instance);
        let registrations = Registrations::new(&config);
        let loads = Loads::new(&config);
        let peers = Peers::new(&config);
        Ok(ConnectorWorker {
            config,
            agent,
            instance,
            tokens,
            registered: None,
            peers,
            loads,
            completions: Vec::new(),
            holds,
            registrations,
            pushes,
            finished: Finished::default(),
            notifications: Vec::new(),
            stats: WorkerStats::default(),
            closed: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// The transfer agent.
    pub fn agent(&self) -> &Arc<dyn TransferAgent> {
        &self.agent
    }

    /// This worker's instance id (published in its handshake payload).
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// The layout, once registered.
    pub fn layout(&self) -> Option<&KvCacheLayout> {
        self.registered.as_ref().map(|r| &r.layout)
    }

    /// The counters.
    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    /// The counters, to set (feature `mock`: for tests, such as kvx-net's metrics tests).
    #[cfg(any(test, feature = "mock"))]
    pub fn stats_mut(&mut self) -> &mut WorkerStats {
        &mut self.stats
    }

    /// Takes the latency samples collected so far (the counters stay): READ, transfer (READ
    /// confirmed), handshake, post-wait and confirmation times, in that order.
    pub fn take_latencies(&mut self) -> [Vec<Duration>; 5] {
        [
            self.stats.read_latencies.take(),
            self.stats.transfer_latencies.take(),
            self.stats.handshake_times.take(),
            self.stats.post_waits.take(),
            self.stats.confirm_waits.take(),
        ]
    }

    /// Decode side: the stage times of the loads completed since the last call, oldest first (at
    /// most the last 1024).
    pub fn take_load_times(&mut self) -> Vec<LoadTimes> {
        self.loads.take_times()
    }

    /// Decode side: the READs completed and confirmed since the last call, oldest first (at most
    /// the last 4096).
    pub fn take_transfers(&mut self) -> Vec<TransferRecord> {
        self.loads.take_transfers()
    }

    /// Prefill side: holds whose blocks are held now (neither released nor expired), for a pull
    /// or a push.
    pub fn num_holds(&self) -> usize {
        self.holds.len() + self.pushes.len()
    }

    /// Peers handshaken and ready for READs and notifications.
    pub fn num_peers(&self) -> usize {
        self.peers.num_ready()
    }

    /// Loads not yet reported: waiting for a handshake, reading, waiting for the prefill
    /// engine's confirmation, or registered for a push. Their local blocks must not be reused.
    pub fn num_in_flight(&self) -> usize {
        self.loads.len() + self.registrations.len()
    }

    /// Whether nothing is loading, held, or waiting for a handshake.
    pub fn is_idle(&self) -> bool {
        self.loads.is_empty()
            && self.registrations.is_empty()
            && self.holds.is_empty()
            && self.pushes.is_empty()
            && self.peers.all_ready()
            && self.finished.is_empty()
    }

    /// Detects the layout, registers every layer's memory with the agent, prepares the local
    /// descriptor list, and returns the encoded handshake payload to publish on the side channel
    /// (at `base_port + rank`).
    pub fn register_kv_caches(&mut self, caches: &[LayerCache]) -> Result<Vec<u8>> {
        self.check_open()?;
        if self.registered.is_some() {
            return Err(Error::new(ErrorKind::State, "KV caches are already registered"));
        }
        let (layout, bases) = KvCacheLayout::detect(caches, self.config.block_size)?;
        let split = self.head_split(&layout)?;
        let caps = self.agent.capabilities();
        if !caps.supports(layout.mem_kind) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("backend {} cannot register {:?} memory", caps.backend, layout.mem_kind),
            ));
        }
        let mut registrations = Vec::with_capacity(caches.len());
        for cache in caches {
            registrations.push(self.agent.register(Arc::clone(&cache.memory))?);
        }
        let local_list = layout.block_list(bases);
        let local_dlist = self.agent.prep_dlist(&DlistOwner::Local, &local_list)?;
        let payload = wire::encode(&HandshakePayload {
            engine_id: self.config.engine_id.clone(),
            rank: self.config.rank,
            world_size: self.config.world_size,
            kv_heads: split.heads(),
            agent_name: self.agent.name().clone(),
            agent_metadata: self.agent.local_metadata()?,
            region_bases: local_list.bases.clone(),
            num_blocks: layout.num_blocks,
            block_len: layout.block_len,
            compat_hash: layout.compat_hash(&self.config.compat_tag),
            instance: self.instance,
        })?;
        let region_windows = layout.region_windows();
        self.registered = Some(Registered {
            layout,
            split,
            region_windows,
            local_dlist,
            head_dlist: None,
            local_list,
            payload: payload.clone(),
            registrations,
        });
        Ok(payload)
    }

    /// How the model's heads lie on this engine's ranks, checked against the cache's heads.
    fn head_split(&self, layout: &KvCacheLayout) -> Result<HeadSplit> {
        let world = self.config.world_size;
        let heads = match (layout.kind, self.config.kv_heads) {
            (AttentionKind::Mla, None | Some(1)) => 1,
            (AttentionKind::Mla, Some(h)) => {
                return Err(Error::invalid_argument(format!(
                    "an MLA cache has one latent, not {h} KV heads"
                )));
            }
            (_, Some(h)) => h,
            (_, None) => layout.heads.saturating_mul(world),
        };
        let split = HeadSplit::new(heads, world)
            .map_err(|e| Error::invalid_argument(format!("worker config: {}", e.message())))?;
        if split.per_rank() != layout.heads {
            return Err(Error::invalid_argument(format!(
                "the cache holds {} KV heads a block; {heads} heads on {world} ranks give {} a rank",
                layout.heads,
                split.per_rank()
            )));
        }
        // Descriptor ids of the per-head list are u32.
        let descs = u64::from(layout.num_regions()) * u64::from(layout.num_blocks) * u64::from(layout.heads);
        if descs > u64::from(u32::MAX) {
            return Err(Error::invalid_argument(format!("{descs} head descriptors overflow u32 ids")));
        }
        Ok(split)
    }

    /// The encoded handshake payload, once registered.
    pub fn handshake_payload(&self) -> Option<&[u8]> {
        self.registered.as_ref().map(|r| r.payload.as_slice())
    }

    /// Starts this step's holds, loads and heartbeats. Never blocks: requests for a peer not yet
    /// handshaken wait for it (and a [`WorkerCommand::FetchHandshake`] is queued); invalid
    /// requests fail. Once [closed](Self::close), holds end at once and loads fail (`State`).
    pub fn start_load_kv(&mut self, now: Instant, meta: &ConnectorMetadata) {
        if self.closed.is_some() {
            return self.refuse(meta);
        }
        for held in &meta.reqs_to_send {
            let effects = self.holds.hold(now, held, &mut self.stats);
            self.apply_holds(now, effects);
            let effects = self.pushes.pull_held(now, &held.request_id, &mut self.stats);
            self.apply_pushes(now, effects);
        }
        for held in &meta.reqs_to_push {
            self.push_hold(now, held);
        }
        for req in &meta.reqs_to_recv {
            self.admit(now, req);
        }
        for req in &meta.reqs_to_register {
            self.admit_push(now, req);
        }
        for beat in &meta.heartbeats {
            self.send_heartbeat(now, beat);
        }
    }

    /// This worker as the one to answer (a release's or a registration's `reply_to`), with
    /// `token`; `None` without a side channel.
    fn reply_to(&self, token: crate::auth::Nonce) -> Option<ReplyTo> {
        let engine = self.config.side_channel.clone()?;
        Some(ReplyTo { engine, rank: self.config.rank, instance: self.instance, token })
    }

    /// The next network command for the driver.
    pub fn poll_command(&mut self) -> Option<WorkerCommand> {
        self.peers.poll_command()
    }

    /// What finished since the last call: held requests whose reader released them (or whose
    /// lease ran out), confirmed loads, and failed loads. Also times out handshakes, transfers
    /// and confirmations. Once [closed](Self::close), only hands out what ended without calling
    /// the agent.
    pub fn get_finished(&mut self, now: Instant) -> Finished {
        if self.closed.is_some() {
            return std::mem::take(&mut self.finished);
        }
        self.expire_handshakes(now);
        self.collect_notifications(now);
        self.collect_transfers(now);
        self.retry_deferred_handshakes(now);
        self.expire_loads(now);
        self.expire_pushes(now);
        let effects = self.holds.expire(now, &mut self.stats);
        self.apply_holds(now, effects);
        std::mem::take(&mut self.finished)
    }

    /// Routes each received notification by its kind: releases and heartbeats to the holds,
    /// answers to the loads.
    fn collect_notifications(&mut self, now: Instant) {
        self.notifications.clear();
        if let Err(e) = self.agent.drain_notifications(&mut self.notifications) {
            tracing::warn!(error = %e, "draining notifications failed");
        }
        for n in std::mem::take(&mut self.notifications) {
            let handled = match wire::open(&n.msg).map(|m| (m.kind(), m)) {
                Ok((MessageKind::HoldRelease, m)) => m
                    .decode::<HoldRelease>()
                    .map(|r| {
                        let peers = &self.peers;
                        let connected = |to: &ReplyTo| peers.connected_at(to);
                        let effects = self.holds.release(now, &n.from, r, connected, &mut self.stats);
                        self.apply_holds(now, effects);
                    })
                    .is_ok(),
                Ok((MessageKind::RenewLeases, m)) => m
                    .decode::<RenewLeases>()
                    .map(|r| {
                        self.pushes.renew(now, &r.pushes, &mut self.stats);
                        self.holds.renew(now, r, &mut self.stats);
                    })
                    .is_ok(),
                Ok((MessageKind::HoldStatus, m)) => {
                    m.decode::<HoldStatus>().map(|s| self.on_hold_status(now, &n.from, s)).is_ok()
                }
                Ok((MessageKind::PushRegistration, m)) => {
                    m.decode::<PushRegistration>().map(|r| self.on_push_registration(now, &n.from, r)).is_ok()
                }
                Ok((MessageKind::PushResult, m)) => {
                    m.decode::<PushResult>().map(|r| self.on_push_result(now, &n.from, r)).is_ok()
                }
                Ok((MessageKind::PushCancel, m)) => {
                    m.decode::<PushCancel>().map(|c| self.on_push_cancel(now, c)).is_ok()
                }
                Ok(_) | Err(_) => false,
            };
            if !handled {
                debug!(from = %n.from, len = n.msg.len(), "undecodable notification dropped");
                self.stats.stray_notifications += 1;
            }
        }
        self.holds.expire_buffers(now, &mut self.stats);
        let peers = &self.peers;
        let connected = |to: &ReplyTo| peers.connected_at(to);
        let effects = self.pushes.expire_buffers(now, connected, &mut self.stats);
        self.apply_pushes(now, effects);
    }

    /// The earliest time at which [`get_finished`](Self::get_finished) has something to expire,
    /// for drivers that sleep between steps.
    pub fn next_deadline(&self) -> Option<Instant> {
        [
            self.peers.next_deadline(),
            self.loads.next_deadline(),
            self.holds.next_deadline(),
            self.registrations.next_deadline(),
            self.pushes.next_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

/// Carries out `effects` in order with `one`, each effect's own effects (what `one` returns)
/// before the effects after it.
fn carry_out<E>(effects: Vec<E>, mut one: impl FnMut(E) -> Vec<E>) {
    let mut todo = effects;
    todo.reverse();
    while let Some(effect) = todo.pop() {
        todo.extend(one(effect).into_iter().rev());
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tp_tests;
