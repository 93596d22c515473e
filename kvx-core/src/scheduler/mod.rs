//! The scheduler side of the connector: which requests load KV remotely, which prefill requests
//! keep their blocks, the leases to renew, and the per-step [`ConnectorMetadata`]. Pure logic: no
//! I/O; time comes in as `now`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};
use tracing::{debug, warn};

use crate::auth::{AuthKey, MacTag, Nonce, NonceSource, PromptDigest};
use crate::error::{Error, Result};
use crate::ids::{EngineId, GroupBlocks, RequestId};
#[cfg(test)]
use crate::meta::FailedRecv;
use crate::meta::{ConnectorMetadata, Finished, Heartbeat, HeldRequest, PushHold, RecvRequest};
use crate::params::{Endpoint, InstanceId, Offer, RemoteCoordinates, TransferMode, TransferParams};

mod alloc;

/// Configuration of one engine's scheduler-side connector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// This engine.
    pub engine_id: EngineId,
    /// Tokens per KV block.
    pub block_size: u32,
    /// This engine's side channel (base port: rank `r` listens on `port + r`), handed to decode
    /// engines in the params. `None`: the params name no host or port, and decode engines find
    /// this engine by its id (an exchange over a registry).
    pub side_channel: Option<Endpoint>,
    /// The deployment's shared key: with it, the params this engine hands out carry a MAC over
    /// the offer (engine, side channel, request id, blocks and nonce); a decode engine renews only
    /// the leases of offers whose MAC verifies.
    pub auth_key: Option<AuthKey>,
    /// The deployment's lease (vLLM's `kv_lease_duration`, 30 s by default): a decode engine
    /// renews the leases of the requests still waiting for their KV every sixth of it.
    pub lease_duration: Duration,
    /// Prefill side: this engine's instance, the one its workers publish
    /// ([`WorkerConfig::instance`](crate::WorkerConfig::instance)). With it, the params name it
    /// (under the MAC), so a decode engine never reads an offer through a connection to an earlier
    /// instance of this engine. `None`: params name no instance.
    pub instance: Option<u64>,
    /// Prefill side: this engine's tensor-parallel size, named in the params (vLLM's `tp_size`)
    /// so that a decode engine of another size knows which ranks hold which heads.
    pub tp_size: u32,
    /// The model's KV-cache groups (vLLM's hybrid allocator): each group's sliding window in
    /// tokens, `None` for full attention. Empty: one full-attention group. A decode engine loads
    /// of a sliding-window group only the blocks the window of its first computed token reaches,
    /// and computes locally a request whose prefill engine no longer holds them.
    pub group_windows: Vec<Option<u32>>,
}

impl SchedulerConfig {
    /// A configuration with no key, a 30 s lease and one tensor-parallel rank.
    pub fn new(engine_id: EngineId, block_size: u32, side_channel: Option<Endpoint>) -> Self {
        SchedulerConfig {
            engine_id,
            block_size,
            side_channel,
            auth_key: None,
            lease_duration: Duration::from_secs(30),
            instance: None,
            tp_size: 1,
            group_windows: Vec::new(),
        }
    }

    /// The window of each KV-cache group (one full-attention group when none is configured).
    fn windows(&self) -> &[Option<u32>] {
        if self.group_windows.is_empty() { &[None] } else { &self.group_windows }
    }
}

/// Why the engine finished a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// Stopped at its length cap (a prefill request for remote decode stops after one token).
    LengthCapped,
    /// Stopped on a stop token or string.
    Stopped,
    /// Aborted by the client or the engine.
    Aborted,
    /// Failed.
    Error,
}

/// What [`ConnectorScheduler::get_num_new_matched_tokens`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MatchedTokens {
    /// Tokens that will be loaded from the remote engine beyond those computed locally.
    pub count: usize,
    /// Whether they load asynchronously (the request waits for the workers' `recving` report).
    pub load_async: bool,
}

/// What [`ConnectorScheduler::request_finished`] answers.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FinishOutcome {
    /// Keep the request's blocks until a `Finished` report names it.
    pub delay_free: bool,
    /// Params to return to the client (prefill side: what the decode engine needs).
    pub params: Option<TransferParams>,
}

#[derive(Debug, Clone)]
struct PendingRecv {
    remote: RemoteCoordinates,
    /// The prefill engine's id of the request, when it differs from ours.
    remote_request_id: Option<RequestId>,
    /// The remote blocks as offered, per group.
    remote_block_ids: Vec<GroupBlocks>,
    /// The local blocks to fill, per group; empty until blocks are allocated, and for
    /// notify-only requests.
    local_block_ids: Vec<GroupBlocks>,
    nonce: Option<Nonce>,
    mac: Option<MacTag>,
    instance: Option<InstanceId>,
    tp_size: Option<u32>,
    mode: TransferMode,
    /// Push mode: the digest of the request's prompt its engine computed.
    prompt: Option<PromptDigest>,
}

impl PendingRecv {
    fn new(remote: RemoteCoordinates, params: &TransferParams, groups: Vec<GroupBlocks>) -> Self {
        PendingRecv {
            mode: params.mode(),
            remote,
            remote_request_id: params.remote_request_id.clone(),
            remote_block_ids: groups,
            local_block_ids: Vec::new(),
            nonce: params.kvx_hold_nonce,
            mac: params.kvx_offer_mac,
            instance: params.kvx_instance,
            tp_size: params.tp_size,
            prompt: params.kvx_prompt_digest,
        }
    }
}

/// What a decode request waiting for its KV renews at its prefill engine.
#[derive(Debug, Clone)]
enum Renewal {
    /// A pull's hold, by its request id and nonce.
    Hold(HeldRequest),
    /// A push's hold, by the prefill engine's request id.
    Push(RequestId),
}

/// The scheduler side of the connector, one per engine.
///
/// # Calling order, per engine step
/// 1. For each waiting request: [`get_num_new_matched_tokens`](Self::get_num_new_matched_tokens),
///    then, once its blocks are allocated, [`update_state_after_alloc`](Self::update_state_after_alloc).
/// 2. [`request_finished`](Self::request_finished) for each request that finished or was aborted.
/// 3. [`build_connector_meta`](Self::build_connector_meta) once, handed to every worker.
/// 4. [`update_finished`](Self::update_finished) with the workers' (rank 0's) report.
#[derive(Debug)]
pub struct ConnectorScheduler {
    config: SchedulerConfig,
    /// Decode side: recorded this step, sent with the next metadata.
    pending_recv: HashMap<RequestId, PendingRecv>,
    /// Decode side: handed to the workers, READ not yet reported finished.
    recving: HashSet<RequestId>,
    /// Prefill side: blocks held for a reader, not yet reported sent.
    sending: HashSet<RequestId>,
    /// Prefill side: held since the last metadata.
    new_sending: Vec<HeldRequest>,
    /// Prefill side: held for a push since the last metadata.
    new_pushing: Vec<PushHold>,
    /// Prefill side: each hold's nonce.
    nonces: NonceSource,
    /// Decode side: requests waiting for their KV (queued, loading), whose leases are renewed.
    awaiting: HashMap<RequestId, (RemoteCoordinates, Option<u32>, Renewal)>,
    /// Decode side: when the next heartbeat is due.
    next_heartbeat: Option<Instant>,
}

impl ConnectorScheduler {
    /// A scheduler-side connector. `block_size` must be non-zero. Hold nonces come from the
    /// operating system's random source.
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        Self::with_nonces(config, NonceSource::from_entropy()?)
    }

    /// A scheduler-side connector whose hold nonces come from `nonces` (a seeded source makes a
    /// simulation reproducible; an engine uses [`new`](Self::new)).
    pub fn with_nonces(config: SchedulerConfig, nonces: NonceSource) -> Result<Self> {
        if config.block_size == 0 {
            return Err(Error::invalid_argument("block_size must be non-zero"));
        }
        Ok(ConnectorScheduler {
            config,
            pending_recv: HashMap::new(),
            recving: HashSet::new(),
            sending: HashSet::new(),
            new_sending: Vec::new(),
            new_pushing: Vec::new(),
            nonces,
            awaiting: HashMap::new(),
            next_heartbeat: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Sets the instance the params name (see [`SchedulerConfig::instance`]): for engines whose
    /// scheduler learns its workers' instance after it starts (vLLM hands the workers' handshake
    /// metadata to the scheduler once they registered their caches).
    pub fn set_instance(&mut self, instance: Option<u64>) {
        self.config.instance = instance;
    }

    fn block_size(&self) -> usize {
        self.config.block_size as usize
    }

    /// A request arrived. Decode side: one whose params load KV from a prefill engine has its
    /// lease renewed from now on (at most every sixth of a lease) until its load is reported or
    /// it finishes, however long it queues. Offers that do not check (a MAC under this engine's
    /// key, kvx's size limits) are not renewed; their loads fail in the workers.
    pub fn on_new_request(&mut self, request_id: &RequestId, params: Option<&TransferParams>) {
        if let Some(entry) = params.filter(|p| p.do_remote_prefill).and_then(|p| self.lease_of(p)) {
            self.awaiting.insert(request_id.clone(), entry);
        }
    }

    /// The prefill engine and hold whose lease a request's params name, if they check (for a
    /// push: the prefill engine and its request id).
    fn lease_of(&self, params: &TransferParams) -> Option<(RemoteCoordinates, Option<u32>, Renewal)> {
        if params.mode() == TransferMode::Push {
            let remote = params.coordinates().filter(|r| r.check().is_ok())?;
            let id = params
                .remote_request_id
                .clone()
                .filter(|id| id.as_str().len() <= crate::params::MAX_ID_LEN)?;
            return Some((remote, params.tp_size, Renewal::Push(id)));
        }
        if !params.has_remote_blocks() {
            return None;
        }
        let remote = params.coordinates()?;
        let groups = params.remote_groups().ok()?;
        let nonce = params.kvx_hold_nonce?;
        let request_id = params.remote_request_id.clone()?;
        let offer = Offer {
            remote: &remote,
            request_id: &request_id,
            groups: &groups,
            nonce: &nonce,
            instance: params.kvx_instance.as_ref(),
            tp_size: params.tp_size,
        };
        offer.check(self.config.auth_key.as_ref(), params.kvx_offer_mac.as_ref()).ok()?;
        Some((remote, params.tp_size, Renewal::Hold(HeldRequest { request_id, nonce })))
    }
}

impl ConnectorScheduler {
    /// The metadata for this step's workers; clears what it hands over. `now` paces the
    /// heartbeats: the leases of requests waiting for their KV are renewed every sixth of a lease.
    pub fn build_connector_meta(&mut self, now: Instant) -> ConnectorMetadata {
        let (mut reqs_to_recv, mut reqs_to_register) = (Vec::new(), Vec::new());
        for (request_id, p) in self.pending_recv.drain() {
            let req = RecvRequest {
                request_id,
                remote_request_id: p.remote_request_id,
                local_block_ids: p.local_block_ids,
                remote_block_ids: p.remote_block_ids,
                remote: p.remote,
                nonce: p.nonce,
                mac: p.mac,
                remote_instance: p.instance,
                remote_tp_size: p.tp_size,
                prompt: p.prompt,
            };
            if !req.is_notify_only() {
                self.recving.insert(req.request_id.clone());
            }
            match p.mode {
                TransferMode::Pull => reqs_to_recv.push(req),
                TransferMode::Push => reqs_to_register.push(req),
            }
        }
        reqs_to_recv.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        reqs_to_register.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        ConnectorMetadata {
            reqs_to_recv,
            reqs_to_send: std::mem::take(&mut self.new_sending),
            heartbeats: self.heartbeats(now),
            reqs_to_register,
            reqs_to_push: std::mem::take(&mut self.new_pushing),
        }
    }

    /// The leases to renew now, grouped by prefill engine (in a stable order).
    fn heartbeats(&mut self, now: Instant) -> Vec<Heartbeat> {
        if self.awaiting.is_empty() {
            self.next_heartbeat = None;
            return Vec::new();
        }
        // The first request waits a sixth of a lease for its first renewal: its hold is new.
        let due = *self.next_heartbeat.get_or_insert(now + self.config.lease_duration / 6);
        if now < due {
            return Vec::new();
        }
        self.next_heartbeat = Some(now + self.config.lease_duration / 6);
        let mut by_engine: BTreeMap<(&RemoteCoordinates, Option<u32>), Heartbeat> = BTreeMap::new();
        for (remote, tp_size, renewal) in self.awaiting.values() {
            let beat = by_engine.entry((remote, *tp_size)).or_insert_with(|| Heartbeat {
                remote: remote.clone(),
                remote_tp_size: *tp_size,
                holds: Vec::new(),
                pushes: Vec::new(),
            });
            match renewal {
                Renewal::Hold(held) => beat.holds.push(held.clone()),
                Renewal::Push(id) => beat.pushes.push(id.clone()),
            }
        }
        let mut beats: Vec<Heartbeat> = by_engine.into_values().collect();
        for beat in &mut beats {
            beat.holds.sort_by(|a, b| a.request_id.cmp(&b.request_id));
            beat.pushes.sort();
        }
        beats
    }

    /// When [`build_connector_meta`](Self::build_connector_meta) next has a heartbeat to send,
    /// for engines that sleep between steps.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.next_heartbeat.filter(|_| !self.awaiting.is_empty())
    }

    /// A request finished or was aborted. `blocks` are its blocks of each KV-cache group at their
    /// block positions (a sliding-window group may have dropped those before its window).
    ///
    /// - Prefill side (`do_remote_decode`, finished by the length cap or a stop, as vLLM keeps
    ///   both): keep the full computed blocks of every group for the decode engine (a trailing
    ///   partial block is not sent) and return the params it needs.
    /// - Decode side, finished before its blocks were allocated, or aborted before its load was
    ///   handed to the workers: the load is dropped (no READ into freed blocks) but the prefill
    ///   engine is still told to free.
    /// - Decode side, aborted while its READ is in flight: keep the blocks until the workers report
    ///   the load finished or failed.
    pub fn request_finished(
        &mut self,
        request_id: &RequestId,
        params: Option<&TransferParams>,
        reason: FinishReason,
        num_computed_tokens: usize,
        blocks: &[GroupBlocks],
    ) -> FinishOutcome {
        self.awaiting.remove(request_id);
        if let Some(pending) = self.pending_recv.get_mut(request_id) {
            pending.local_block_ids.clear();
            return FinishOutcome::default();
        }
        if self.recving.contains(request_id) {
            return FinishOutcome { delay_free: true, params: None };
        }
        if let Some(params) = params.filter(|p| p.do_remote_prefill) {
            // Finished before its blocks were allocated (aborted while queued): nothing will be
            // read, but the prefill engine is told to free now rather than at the lease's end.
            let push = params.mode() == TransferMode::Push;
            if let Some((remote, groups)) =
                self.offered(request_id, params).filter(|_| push || params.has_remote_blocks())
            {
                debug!(%request_id, "finished before its load: notify the prefill engine only");
                self.pending_recv.insert(request_id.clone(), PendingRecv::new(remote, params, groups));
            }
            return FinishOutcome::default();
        }
        let keeps = matches!(reason, FinishReason::LengthCapped | FinishReason::Stopped);
        let Some(params) = params.filter(|p| p.do_remote_decode) else {
            return FinishOutcome::default();
        };
        let mode = params.mode();
        // The id the decode engines register under: the router's shared id for both legs, if it
        // gave one within kvx's limits, else this engine's.
        let shared =
            params.remote_request_id.clone().filter(|id| id.as_str().len() <= crate::params::MAX_ID_LEN);
        let registered_as = shared.unwrap_or_else(|| request_id.clone());
        let push_hold = |groups| PushHold {
            request_id: request_id.clone(),
            registered_as: registered_as.clone(),
            groups,
            prompt: params.kvx_prompt_digest,
        };
        if !keeps {
            if mode == TransferMode::Push {
                // The decode engine registered (or will) without waiting for this answer: an
                // empty hold tells the workers to refuse its registrations now.
                self.new_pushing.push(push_hold(Vec::new()));
            }
            return FinishOutcome::default();
        }
        // No block position past 2^32 - 1 (a block id's range).
        let full_blocks = ((num_computed_tokens / self.block_size()) as u64).min(u64::from(u32::MAX));
        let computed: Vec<GroupBlocks> = blocks
            .iter()
            .map(|g| {
                let held = full_blocks.saturating_sub(u64::from(g.first)).min(g.ids.len() as u64) as usize;
                GroupBlocks::new(g.first, g.ids[..held].to_vec())
            })
            .collect();
        let delay_free = computed.iter().any(|g| !g.ids.is_empty());
        let nonce = self.nonces.next_nonce();
        if delay_free {
            self.sending.insert(request_id.clone());
        }
        match mode {
            TransferMode::Pull if delay_free => {
                self.new_sending.push(HeldRequest { request_id: request_id.clone(), nonce })
            }
            TransferMode::Pull => {}
            // Without a full block the hold is empty: the registrations are refused at once.
            TransferMode::Push => {
                let groups = if delay_free { computed.clone() } else { Vec::new() };
                self.new_pushing.push(push_hold(groups))
            }
        }
        let remote = RemoteCoordinates {
            engine_id: self.config.engine_id.clone(),
            endpoint: self.config.side_channel.clone(),
        };
        let instance = self.config.instance.map(|i| crate::auth::HexBytes(i.to_le_bytes()));
        let tp_size = Some(self.config.tp_size);
        // A push is registered for by the id its hold is kept under; a pull READs by this engine's.
        let offered_id = if mode == TransferMode::Push { &registered_as } else { request_id };
        let offer = Offer {
            remote: &remote,
            request_id: offered_id,
            groups: &computed,
            nonce: &nonce,
            instance: instance.as_ref(),
            tp_size,
        };
        let kvx_offer_mac = self.config.auth_key.as_ref().map(|key| offer.tag(key));
        let mut params = TransferParams::for_decode(computed, remote);
        params.remote_request_id = Some(offered_id.clone());
        params.kvx_hold_nonce = Some(nonce);
        params.kvx_offer_mac = kvx_offer_mac;
        params.kvx_instance = instance;
        params.tp_size = tp_size;
        if mode == TransferMode::Push {
            // A decode engine dispatched after this answer registers as one dispatched before it.
            params.transfer_mode = Some(TransferMode::Push);
        }
        FinishOutcome { delay_free, params: Some(params) }
    }

    /// Takes the workers' report: loads that ended, holds that were released.
    pub fn update_finished(&mut self, finished: &Finished) {
        for id in &finished.sending {
            self.sending.remove(id);
        }
        for id in finished.recving.iter().chain(finished.failed_recving.iter().map(|f| &f.request_id)) {
            self.recving.remove(id);
            self.awaiting.remove(id);
        }
    }

    /// Whether the scheduler tracks nothing (every load reported, every hold released, no lease to
    /// renew).
    pub fn is_idle(&self) -> bool {
        self.pending_recv.is_empty()
            && self.recving.is_empty()
            && self.sending.is_empty()
            && self.awaiting.is_empty()
    }

    /// Requests whose loads are in flight.
    pub fn num_recving(&self) -> usize {
        self.recving.len()
    }

    /// Requests whose blocks are held for a reader.
    pub fn num_sending(&self) -> usize {
        self.sending.len()
    }
}

#[cfg(test)]
mod tests;
