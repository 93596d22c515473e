//! The worker side of the connector, one per tensor-parallel rank: registers the KV caches,
//! handshakes with peers, posts the READs, and reports what finished. Sans-IO: time comes in as
//! `now`, network work goes out as [`WorkerCommand`]s and comes back through
//! [`ConnectorWorker::handle_handshake`]; the engine's step never waits on the network.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

use crate::auth::{AuthKey, Nonce};
use crate::error::{Error, ErrorKind, Result, quote};
use crate::ids::{AgentName, EngineId, RequestId};
use crate::layout::{KvCacheLayout, LayerCache};
use crate::meta::{ConnectorMetadata, FailedRecv, Finished, HoldRelease, RecvRequest};
use crate::params::RemoteCoordinates;
use crate::transfer::{
    DlistId, DlistOwner, Notification, RegistrationId, TransferAgent, XferId, XferOp, XferState,
};
use crate::wire::{self, HandshakePayload};

mod early;
use early::EarlyReleases;

/// The longest request or engine id kvx accepts from a peer or a client, in bytes.
pub const MAX_ID_LEN: usize = 1024;

/// The longest side-channel host kvx accepts from a client (a DNS name is at most 253).
pub const MAX_HOST_LEN: usize = 255;

/// Configuration of one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// This engine.
    pub engine_id: EngineId,
    /// This worker's tensor-parallel rank.
    pub rank: u32,
    /// The engine's tensor-parallel size.
    pub world_size: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// What else peers must agree on: model name and dtype, say. Part of the compatibility hash.
    pub compat_tag: String,
    /// How long a handshake may take before the requests waiting on it fail.
    pub handshake_timeout: Duration,
    /// Prefill side: how long blocks are held for a reader that never comes.
    pub hold_timeout: Duration,
    /// Prefill side: at most this many releases that name no hold yet are kept (the oldest go
    /// first), each for at most `early_release_ttl`.
    pub max_early_releases: usize,
    /// Prefill side: how long a release that names no hold yet is kept.
    pub early_release_ttl: Duration,
    /// The deployment's shared key. Decode side: params whose offer MAC does not verify under it
    /// are refused before any handshake or READ. (The side channel takes the same key.)
    pub auth_key: Option<AuthKey>,
}

impl WorkerConfig {
    /// A configuration with the usual timeouts (5 s handshake, 120 s hold, early releases kept
    /// 30 s, at most 4096 of them) and no key.
    pub fn new(engine_id: EngineId, rank: u32, world_size: u32, block_size: u32) -> Self {
        WorkerConfig {
            engine_id,
            rank,
            world_size,
            block_size,
            compat_tag: String::new(),
            handshake_timeout: Duration::from_secs(5),
            hold_timeout: Duration::from_secs(120),
            max_early_releases: 4096,
            early_release_ttl: Duration::from_secs(30),
            auth_key: None,
        }
    }
}

/// Network work the worker asks its driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerCommand {
    /// Fetch the handshake payload served at `host:port` (already offset by this rank) and hand
    /// the result to [`ConnectorWorker::handle_handshake`].
    FetchHandshake {
        /// The engine whose payload it is.
        engine_id: EngineId,
        /// Side-channel host.
        host: String,
        /// Side-channel port of the matching rank.
        port: u16,
    },
}

/// Counters of one worker, for metrics and the demo's summary.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerStats {
    /// Handshakes that completed.
    pub handshakes: u64,
    /// Handshakes that failed or timed out.
    pub handshake_failures: u64,
    /// Time from a handshake's start to the peer being ready, for each completed handshake.
    pub handshake_times: Vec<Duration>,
    /// READs posted.
    pub reads_posted: u64,
    /// Descriptors (block × region) in posted READs.
    pub descriptors: u64,
    /// Bytes read by completed READs.
    pub bytes_read: u64,
    /// Loads that failed (validation, post, transfer or handshake).
    pub failed_loads: u64,
    /// Notify-only requests (full local prefix hit).
    pub notify_only: u64,
    /// From posting to the report of completion, for each completed READ.
    pub transfer_latencies: Vec<Duration>,
    /// Notifications received for requests this worker holds.
    pub notifications: u64,
    /// Notifications that did not decode, were duplicated, or never matched a hold (expired or
    /// pushed out of the early buffer).
    pub stray_notifications: u64,
    /// Notifications that named a held request with the wrong nonce: forged or replayed. The
    /// hold stays.
    pub rejected_notifications: u64,
    /// Holds released because no reader came in time.
    pub expired_holds: u64,
}

#[derive(Debug)]
struct Registered {
    layout: KvCacheLayout,
    local_dlist: DlistId,
    payload: Vec<u8>,
    _registrations: Vec<RegistrationId>,
}

#[derive(Debug)]
enum Peer {
    Handshaking { started: Instant, deadline: Instant, waiting: Vec<RecvRequest> },
    Ready { agent: AgentName, dlist: DlistId, num_blocks: u32 },
}

#[derive(Debug)]
struct InFlight {
    xfer: XferId,
    /// The prefill agent, told to free its blocks if the READ fails.
    peer: AgentName,
    /// The encoded [`HoldRelease`]: the READ's notification, sent alone if the READ fails.
    release: Vec<u8>,
    posted: Instant,
    bytes: u64,
}

/// Prefill side: a request's blocks held for a reader.
#[derive(Debug)]
struct Hold {
    until: Instant,
    nonce: Nonce,
}

/// The worker side of the connector, one per tensor-parallel rank. See `docs/CONTRACT.md`.
///
/// # Calling order
/// 1. [`register_kv_caches`](Self::register_kv_caches) once; publish the payload it returns.
/// 2. Each step: [`start_load_kv`](Self::start_load_kv) with the scheduler's metadata, then
///    [`poll_command`](Self::poll_command) until `None` (the driver runs the fetches and feeds
///    results to [`handle_handshake`](Self::handle_handshake) whenever they arrive), then
///    [`get_finished`](Self::get_finished).
#[derive(Debug)]
pub struct ConnectorWorker {
    config: WorkerConfig,
    agent: Arc<dyn TransferAgent>,
    registered: Option<Registered>,
    peers: HashMap<EngineId, Peer>,
    in_flight: HashMap<RequestId, InFlight>,
    /// Requests waiting for a handshake (with `in_flight`: every load not yet reported).
    waiting_ids: HashSet<RequestId>,
    finished: Finished,
    /// Prefill side: held requests.
    holds: HashMap<RequestId, Hold>,
    /// Releases that arrived before their hold.
    early: EarlyReleases,
    commands: VecDeque<WorkerCommand>,
    notifications: Vec<Notification>,
    descs_local: Vec<u32>,
    descs_remote: Vec<u32>,
    stats: WorkerStats,
}

impl ConnectorWorker {
    /// A worker over `agent`, which must support READ and notifications.
    pub fn new(config: WorkerConfig, agent: Arc<dyn TransferAgent>) -> Result<Self> {
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
        let early = EarlyReleases::new(config.max_early_releases, config.early_release_ttl);
        Ok(ConnectorWorker {
            config,
            agent,
            registered: None,
            peers: HashMap::new(),
            in_flight: HashMap::new(),
            waiting_ids: HashSet::new(),
            finished: Finished::default(),
            holds: HashMap::new(),
            early,
            commands: VecDeque::new(),
            notifications: Vec::new(),
            descs_local: Vec::new(),
            descs_remote: Vec::new(),
            stats: WorkerStats::default(),
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

    /// The layout, once registered.
    pub fn layout(&self) -> Option<&KvCacheLayout> {
        self.registered.as_ref().map(|r| &r.layout)
    }

    /// The counters.
    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    /// Takes the latency samples collected so far (the counters stay).
    pub fn take_latencies(&mut self) -> (Vec<Duration>, Vec<Duration>) {
        (std::mem::take(&mut self.stats.transfer_latencies), std::mem::take(&mut self.stats.handshake_times))
    }

    /// Whether nothing is in flight, held, or waiting for a handshake.
    pub fn is_idle(&self) -> bool {
        self.in_flight.is_empty()
            && self.holds.is_empty()
            && self.peers.values().all(|p| matches!(p, Peer::Ready { .. }))
            && self.finished.is_empty()
    }

    /// Detects the layout, registers every layer's memory with the agent, prepares the local
    /// descriptor list, and returns the encoded handshake payload to publish on the side channel
    /// (at `base_port + rank`).
    pub fn register_kv_caches(&mut self, caches: &[LayerCache]) -> Result<Vec<u8>> {
        if self.registered.is_some() {
            return Err(Error::new(ErrorKind::State, "KV caches are already registered"));
        }
        let (layout, bases) = KvCacheLayout::detect(caches, self.config.block_size)?;
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
        let local_dlist = self.agent.prep_dlist(&DlistOwner::Local, &layout.block_list(bases.clone()))?;
        let payload = wire::encode(&HandshakePayload {
            engine_id: self.config.engine_id.clone(),
            rank: self.config.rank,
            world_size: self.config.world_size,
            agent_name: self.agent.name().clone(),
            agent_metadata: self.agent.local_metadata()?,
            region_bases: bases,
            num_blocks: layout.num_blocks,
            block_len: layout.block_len,
            compat_hash: layout.compat_hash(&self.config.compat_tag),
        })?;
        self.registered =
            Some(Registered { layout, local_dlist, payload: payload.clone(), _registrations: registrations });
        Ok(payload)
    }

    /// The encoded handshake payload, once registered.
    pub fn handshake_payload(&self) -> Option<&[u8]> {
        self.registered.as_ref().map(|r| r.payload.as_slice())
    }

    /// Starts this step's loads and holds. Never blocks: requests for a peer not yet handshaken
    /// wait for it (and a [`WorkerCommand::FetchHandshake`] is queued); invalid requests fail.
    pub fn start_load_kv(&mut self, now: Instant, meta: &ConnectorMetadata) {
        for held in &meta.reqs_to_send {
            if self.early.take(&(held.request_id.clone(), held.nonce)) {
                self.stats.notifications += 1;
                self.finished.sending.push(held.request_id.clone());
            } else {
                let hold = Hold { until: now + self.config.hold_timeout, nonce: held.nonce };
                self.holds.insert(held.request_id.clone(), hold);
            }
        }
        for req in &meta.reqs_to_recv {
            if let Err(e) = self.admit(now, req) {
                self.fail(&req.request_id, e);
            }
        }
    }

    /// Checks what came from the client's params before anything touches the network: the
    /// offer's MAC (with a key), the nonce, the sizes, and the READ's window in the offer.
    fn check_offer(&self, req: &RecvRequest) -> Result<()> {
        let Some(offer) = req.offer() else {
            return Err(Error::invalid_peer_data(
                "kv_transfer_params carry no kvx_hold_nonce: not an offer of a kvx prefill engine",
            ));
        };
        if let Some(key) = &self.config.auth_key {
            offer.verify(key, req.mac.as_ref())?;
        }
        for (what, id) in [
            ("remote request id", req.prefill_request_id().as_str()),
            ("remote engine id", req.remote.engine_id.as_str()),
        ] {
            if id.len() > MAX_ID_LEN {
                return Err(Error::invalid_peer_data(format!(
                    "{what} {} is over {MAX_ID_LEN} bytes",
                    quote(id)
                )));
            }
        }
        if req.remote.host.len() > MAX_HOST_LEN {
            return Err(Error::invalid_peer_data(format!(
                "remote host {} is over {MAX_HOST_LEN} bytes",
                quote(&req.remote.host)
            )));
        }
        self.remote_read(req).map(|_| ())
    }

    /// The offered blocks the READ takes: `local_block_ids.len()` from `remote_read_from`.
    fn remote_read<'r>(&self, req: &'r RecvRequest) -> Result<&'r [u32]> {
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

    fn admit(&mut self, now: Instant, req: &RecvRequest) -> Result<()> {
        let Some(registered) = &self.registered else {
            return Err(Error::new(ErrorKind::State, "load requested before KV caches were registered"));
        };
        self.check_offer(req)?;
        if req.remote.engine_id == self.config.engine_id {
            return Err(Error::invalid_peer_data(format!(
                "remote engine {} is this engine",
                req.remote.engine_id
            )));
        }
        KvCacheLayout::check_block_ids(&req.local_block_ids, registered.layout.num_blocks, "local")?;
        let mut seen = HashSet::with_capacity(req.local_block_ids.len());
        if let Some(dup) = req.local_block_ids.iter().find(|b| !seen.insert(**b)) {
            return Err(Error::invalid_argument(format!("local block {dup} appears twice")));
        }
        if self.in_flight.contains_key(&req.request_id) || self.waiting_ids.contains(&req.request_id) {
            return Err(Error::invalid_argument("a load for this request is already in flight"));
        }
        match self.peers.entry(req.remote.engine_id.clone()) {
            Entry::Occupied(mut e) => match e.get_mut() {
                Peer::Handshaking { waiting, .. } => {
                    waiting.push(req.clone());
                    self.waiting_ids.insert(req.request_id.clone());
                }
                Peer::Ready { .. } => return self.issue(now, req),
            },
            Entry::Vacant(e) => {
                let RemoteCoordinates { engine_id, host, port } = &req.remote;
                let port = u16::try_from(u32::from(*port) + self.config.rank).map_err(|_| {
                    Error::invalid_peer_data(format!(
                        "side-channel port {port} + rank {} overflows",
                        self.config.rank
                    ))
                })?;
                debug!(%engine_id, %host, port, "handshake queued");
                self.commands.push_back(WorkerCommand::FetchHandshake {
                    engine_id: engine_id.clone(),
                    host: host.clone(),
                    port,
                });
                e.insert(Peer::Handshaking {
                    started: now,
                    deadline: now + self.config.handshake_timeout,
                    waiting: vec![req.clone()],
                });
                self.waiting_ids.insert(req.request_id.clone());
            }
        }
        Ok(())
    }

    /// Posts the READ (or the notification alone) for a request whose peer is ready.
    fn issue(&mut self, now: Instant, req: &RecvRequest) -> Result<()> {
        let (Some(registered), Some(Peer::Ready { agent, dlist, num_blocks })) =
            (&self.registered, self.peers.get(&req.remote.engine_id))
        else {
            return Err(Error::new(ErrorKind::State, "peer not ready"));
        };
        let nonce = req.nonce.ok_or_else(|| Error::invalid_peer_data("the offer carries no nonce"))?;
        let release = wire::encode(&HoldRelease { request_id: req.prefill_request_id().clone(), nonce })?;
        if req.is_notify_only() {
            self.stats.notify_only += 1;
            if let Err(e) = self.agent.notify(agent, &release) {
                // Not the request's failure: it runs from the local cache. The prefill engine's
                // hold expires instead.
                warn!(request_id = %req.request_id, error = %e, "notify-only message not sent");
            }
            return Ok(());
        }
        let local = &req.local_block_ids;
        let remote = self.remote_read(req)?;
        KvCacheLayout::check_block_ids(remote, *num_blocks, "remote")?;
        let layout = &registered.layout;
        self.descs_local.clear();
        self.descs_remote.clear();
        layout.descriptor_ids(layout.num_blocks, local, &mut self.descs_local);
        layout.descriptor_ids(*num_blocks, remote, &mut self.descs_remote);
        let xfer = self.agent.post(
            XferOp::Read,
            registered.local_dlist,
            &self.descs_local,
            *dlist,
            &self.descs_remote,
            Some(&release),
        )?;
        self.stats.reads_posted += 1;
        self.stats.descriptors += self.descs_local.len() as u64;
        let bytes = (self.descs_local.len() as u64).saturating_mul(layout.block_len);
        let peer = agent.clone();
        self.in_flight.insert(req.request_id.clone(), InFlight { xfer, peer, release, posted: now, bytes });
        Ok(())
    }

    fn fail(&mut self, request_id: &RequestId, error: Error) {
        warn!(%request_id, %error, "KV load failed");
        self.stats.failed_loads += 1;
        self.finished
            .failed_recving
            .push(FailedRecv { request_id: request_id.clone(), reason: error.to_string() });
    }

    /// The next network command for the driver.
    pub fn poll_command(&mut self) -> Option<WorkerCommand> {
        self.commands.pop_front()
    }

    /// The result of a [`WorkerCommand::FetchHandshake`]: the peer's encoded payload, or why the
    /// fetch failed. Validates the payload, loads the peer's agent and prepares its descriptor
    /// list, then posts the waiting requests; on any failure those requests fail and the next
    /// request for that engine handshakes again.
    pub fn handle_handshake(&mut self, now: Instant, engine_id: &EngineId, result: Result<Vec<u8>>) {
        let Some(Peer::Handshaking { started, waiting, .. }) = self.peers.get_mut(engine_id) else {
            debug!(%engine_id, "late or unexpected handshake result ignored");
            return;
        };
        let (started, waiting) = (*started, std::mem::take(waiting));
        for req in &waiting {
            self.waiting_ids.remove(&req.request_id);
        }
        match result.and_then(|bytes| self.connect(engine_id, &bytes)) {
            Ok(peer) => {
                let took = now.saturating_duration_since(started);
                debug!(%engine_id, ?took, "handshake done");
                self.stats.handshakes += 1;
                self.stats.handshake_times.push(took);
                self.peers.insert(engine_id.clone(), peer);
                for req in waiting {
                    if let Err(e) = self.issue(now, &req) {
                        self.fail(&req.request_id, e);
                    }
                }
            }
            Err(e) => {
                self.peers.remove(engine_id);
                self.stats.handshake_failures += 1;
                // Refusals keep their kind (timeout, incompatible, unauthenticated, ...); a
                // malformed payload is the handshake's failure.
                let e = match e.kind() {
                    ErrorKind::Wire | ErrorKind::InvalidPeerData => {
                        Error::new(ErrorKind::Handshake, e.message())
                            .context(format!("with engine {engine_id}"))
                    }
                    _ => e.context(format!("with engine {engine_id}")),
                };
                for req in waiting {
                    self.fail(&req.request_id, e.detached());
                }
            }
        }
    }

    fn connect(&self, engine_id: &EngineId, bytes: &[u8]) -> Result<Peer> {
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
        let list =
            crate::transfer::BlockList { num_blocks: p.num_blocks, ..layout.block_list(p.region_bases) };
        let dlist = match self.agent.prep_dlist(&DlistOwner::Remote(agent.clone()), &list) {
            Ok(d) => d,
            Err(e) => {
                let _ = self.agent.forget_remote(&agent);
                return Err(e);
            }
        };
        Ok(Peer::Ready { agent, dlist, num_blocks: p.num_blocks })
    }

    /// What finished since the last call: held requests whose reader notified (or whose hold
    /// expired), completed loads, and failed loads. Also times out handshakes.
    pub fn get_finished(&mut self, now: Instant) -> Finished {
        self.expire_handshakes(now);
        self.collect_notifications(now);
        self.collect_transfers(now);
        self.expire_holds(now);
        std::mem::take(&mut self.finished)
    }

    fn expire_handshakes(&mut self, now: Instant) {
        let expired: Vec<EngineId> = self
            .peers
            .iter()
            .filter(|(_, p)| matches!(p, Peer::Handshaking { deadline, .. } if *deadline <= now))
            .map(|(e, _)| e.clone())
            .collect();
        for engine_id in expired {
            let timeout = self.config.handshake_timeout;
            self.handle_handshake(
                now,
                &engine_id,
                Err(Error::new(
                    ErrorKind::Timeout,
                    format!("handshake with engine {engine_id} took over {timeout:?}"),
                )),
            );
        }
    }

    /// Frees the holds whose releases came, when their nonces match; keeps releases for holds not
    /// seen yet (bounded); counts the rest.
    fn collect_notifications(&mut self, now: Instant) {
        self.notifications.clear();
        if let Err(e) = self.agent.drain_notifications(&mut self.notifications) {
            warn!(error = %e, "draining notifications failed");
        }
        for n in std::mem::take(&mut self.notifications) {
            let release = match wire::decode::<HoldRelease>(&n.msg) {
                Ok(r) if r.request_id.as_str().len() <= MAX_ID_LEN => r,
                Ok(_) | Err(_) => {
                    debug!(from = %n.from, len = n.msg.len(), "undecodable notification dropped");
                    self.stats.stray_notifications += 1;
                    continue;
                }
            };
            match self.holds.get(&release.request_id) {
                Some(hold) if hold.nonce == release.nonce => {
                    self.holds.remove(&release.request_id);
                    self.stats.notifications += 1;
                    self.finished.sending.push(release.request_id);
                }
                Some(_) => {
                    // Counted, and logged at debug only: a flood of forged releases must not
                    // flood the log.
                    debug!(request_id = %release.request_id, from = %n.from, "release with a wrong nonce refused: the hold stays");
                    self.stats.rejected_notifications += 1;
                }
                None => {
                    self.stats.stray_notifications +=
                        self.early.insert(now, (release.request_id, release.nonce));
                }
            }
        }
        self.stats.stray_notifications += self.early.expire(now);
    }

    fn collect_transfers(&mut self, now: Instant) {
        let mut ended = Vec::new();
        for (id, f) in &self.in_flight {
            match self.agent.poll(f.xfer) {
                Ok(XferState::Pending) => {}
                Ok(XferState::Done) => ended.push((id.clone(), Ok(()))),
                Ok(XferState::Failed(reason)) => {
                    ended.push((id.clone(), Err(Error::new(ErrorKind::Transfer, reason))));
                }
                Err(e) => ended.push((id.clone(), Err(e))),
            }
        }
        for (id, outcome) in ended {
            let Some(f) = self.in_flight.remove(&id) else { continue };
            if let Err(e) = self.agent.release(f.xfer) {
                debug!(request_id = %id, error = %e, "releasing a finished transfer failed");
            }
            match outcome {
                Ok(()) => {
                    debug!(request_id = %id, took = ?now.saturating_duration_since(f.posted), bytes = f.bytes, "READ done");
                    self.stats.bytes_read += f.bytes;
                    self.stats.transfer_latencies.push(now.saturating_duration_since(f.posted));
                    self.finished.recving.push(id);
                }
                Err(e) => {
                    // The request fails (or recomputes) here: the prefill engine's blocks are no
                    // longer needed, so it is told now instead of holding them until its hold
                    // expires. The READ notification was not sent: the transfer did not complete.
                    if let Err(notify_error) = self.agent.notify(&f.peer, &f.release) {
                        debug!(request_id = %id, error = %notify_error, "prefill not told of the failed load");
                    }
                    self.fail(&id, e)
                }
            }
        }
    }

    fn expire_holds(&mut self, now: Instant) {
        let expired: Vec<RequestId> =
            self.holds.iter().filter(|(_, hold)| hold.until <= now).map(|(id, _)| id.clone()).collect();
        for id in expired {
            warn!(request_id = %id, "no reader came for held blocks: releasing them");
            self.holds.remove(&id);
            self.stats.expired_holds += 1;
            self.finished.sending.push(id);
        }
    }

    /// Blocks of requests that have a READ in flight (the engine must not reuse them).
    pub fn num_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The earliest time at which [`get_finished`](Self::get_finished) has something to expire, for
    /// drivers that sleep between steps.
    pub fn next_deadline(&self) -> Option<Instant> {
        let handshakes = self.peers.values().filter_map(|p| match p {
            Peer::Handshaking { deadline, .. } => Some(*deadline),
            Peer::Ready { .. } => None,
        });
        handshakes.chain(self.holds.values().map(|h| h.until)).chain(self.early.next_deadline()).min()
    }
}

/// Rank 0's view of the whole tensor-parallel group: an id is reported once every rank reported
/// it. A load that failed on any rank is reported failed (once all ranks are done with it).
#[derive(Debug)]
pub struct FinishedAggregator {
    world_size: u32,
    sending: HashMap<RequestId, u32>,
    recving: HashMap<RequestId, (u32, Option<String>)>,
}

impl FinishedAggregator {
    /// An aggregator for `world_size` ranks.
    pub fn new(world_size: u32) -> Self {
        FinishedAggregator { world_size: world_size.max(1), sending: HashMap::new(), recving: HashMap::new() }
    }

    /// Adds the reports of some ranks and returns the ids that every rank has now reported. An id
    /// a report names twice counts once for that rank.
    pub fn aggregate(&mut self, reports: impl IntoIterator<Item = Finished>) -> Finished {
        let mut out = Finished::default();
        for report in reports {
            let mut seen = HashSet::new();
            for id in report.sending {
                if !seen.insert(id.clone()) {
                    continue;
                }
                let n = self.sending.entry(id.clone()).or_insert(0);
                *n = n.saturating_add(1);
                if *n >= self.world_size {
                    self.sending.remove(&id);
                    out.sending.push(id);
                }
            }
            let recvs = report.recving.into_iter().map(|id| (id, None));
            let fails = report.failed_recving.into_iter().map(|f| (f.request_id, Some(f.reason)));
            seen.clear();
            for (id, failure) in recvs.chain(fails) {
                if !seen.insert(id.clone()) {
                    continue;
                }
                let entry = self.recving.entry(id.clone()).or_insert((0, None));
                entry.0 = entry.0.saturating_add(1);
                if entry.1.is_none() {
                    entry.1 = failure;
                }
                if entry.0 >= self.world_size {
                    match self.recving.remove(&id).and_then(|(_, f)| f) {
                        Some(reason) => out.failed_recving.push(FailedRecv { request_id: id, reason }),
                        None => out.recving.push(id),
                    }
                }
            }
        }
        out
    }

    /// Ids some but not all ranks have reported.
    pub fn num_partial(&self) -> usize {
        self.sending.len() + self.recving.len()
    }
}

#[cfg(test)]
mod tests;
