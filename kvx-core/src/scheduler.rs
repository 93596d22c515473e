//! The scheduler side of the connector: which requests load KV remotely, which prefill requests
//! keep their blocks, the leases to renew, and the per-step [`ConnectorMetadata`]. Pure logic: no
//! I/O; time comes in as `now`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};
use tracing::{debug, warn};

use crate::auth::{AuthKey, MacTag, Nonce, NonceSource};
use crate::error::{Error, Result};
use crate::ids::{EngineId, GroupBlocks, RequestId};
#[cfg(test)]
use crate::meta::FailedRecv;
use crate::meta::{ConnectorMetadata, Finished, Heartbeat, HeldRequest, RecvRequest};
use crate::params::{Endpoint, InstanceId, Offer, RemoteCoordinates, TransferParams};

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

/// The first block position a load ending before position `end` needs of a group with `window`
/// (tokens), from `from` on: every one for full attention; for a sliding window, only those the
/// window of the first token computed after the load reaches (vLLM keeps the blocks from token
/// `n - window + 1` on once `n` tokens are computed).
fn needed_from(window: Option<u32>, from: u64, end: u64, block_size: u64) -> u64 {
    match window {
        None => from,
        Some(w) => from
            .max(end.saturating_mul(block_size).saturating_add(1).saturating_sub(u64::from(w)) / block_size),
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
}

impl PendingRecv {
    fn new(remote: RemoteCoordinates, params: &TransferParams, groups: Vec<GroupBlocks>) -> Self {
        PendingRecv {
            remote,
            remote_request_id: params.remote_request_id.clone(),
            remote_block_ids: groups,
            local_block_ids: Vec::new(),
            nonce: params.kvx_hold_nonce,
            mac: params.kvx_offer_mac,
            instance: params.kvx_instance,
            tp_size: params.tp_size,
        }
    }
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
    /// Prefill side: each hold's nonce.
    nonces: NonceSource,
    /// Decode side: requests waiting for their KV (queued, loading), whose leases are renewed.
    awaiting: HashMap<RequestId, (RemoteCoordinates, Option<u32>, HeldRequest)>,
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

    /// The prefill engine and hold whose lease a request's params name, if they check.
    fn lease_of(&self, params: &TransferParams) -> Option<(RemoteCoordinates, Option<u32>, HeldRequest)> {
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
        Some((remote, params.tp_size, HeldRequest { request_id, nonce }))
    }

    /// How many of the prompt's tokens, beyond the `num_computed_tokens` the local prefix cache
    /// holds, load from the remote engine.
    ///
    /// Only requests with `do_remote_prefill` and complete remote coordinates load anything. The
    /// remote engine sends full blocks only: the count is the prompt rounded down to a block,
    /// capped by the blocks every group offers, minus the computed tokens. It is 0 when a
    /// sliding-window group no longer holds a block the window needs (the prefill engine dropped
    /// it), or when the offer's groups are not this engine's. Free of side effects (vLLM may
    /// ask again for a request it could not schedule): what to load, or only to notify, is recorded
    /// by [`update_state_after_alloc`](Self::update_state_after_alloc).
    pub fn get_num_new_matched_tokens(
        &self,
        request_id: &RequestId,
        prompt_len: usize,
        params: Option<&TransferParams>,
        num_computed_tokens: usize,
    ) -> Result<MatchedTokens> {
        let Some(params) = params.filter(|p| p.do_remote_prefill) else {
            return Ok(MatchedTokens::default());
        };
        let bs = self.block_size();
        if num_computed_tokens % bs != 0 {
            return Err(Error::invalid_argument(format!(
                "request {request_id}: {num_computed_tokens} computed tokens is not a multiple of block size {bs}"
            )));
        }
        let Some((_, groups)) = self.offered(request_id, params) else {
            return Ok(MatchedTokens::default());
        };
        let first = (num_computed_tokens / bs) as u64;
        let Some(end) = self.load_end(request_id, &groups, prompt_len, first) else {
            return Ok(MatchedTokens::default());
        };
        let count = (end.saturating_sub(first) as usize).saturating_mul(bs);
        Ok(MatchedTokens { count, load_async: count > 0 })
    }

    /// The coordinates and groups of an offer, or `None` (with a warning) when they are
    /// incomplete or do not check.
    fn offered(
        &self,
        request_id: &RequestId,
        params: &TransferParams,
    ) -> Option<(RemoteCoordinates, Vec<GroupBlocks>)> {
        let Some(remote) = params.coordinates() else {
            warn!(%request_id, "do_remote_prefill without complete remote coordinates: computing locally");
            return None;
        };
        match params.remote_groups() {
            Ok(groups) => Some((remote, groups)),
            Err(e) => {
                warn!(%request_id, error = %e, "kv_transfer_params ignored: computing locally");
                None
            }
        }
    }

    /// The block position where a load from `first` ends: the prompt's full blocks, capped by
    /// every group's offer. `None` when nothing past `first` can load: the offer's groups are not
    /// this engine's, a full-attention group misses a block from `first` on, or a sliding-window
    /// group misses one its window needs.
    fn load_end(
        &self,
        request_id: &RequestId,
        groups: &[GroupBlocks],
        prompt_len: usize,
        first: u64,
    ) -> Option<u64> {
        let windows = self.config.windows();
        if groups.len() != windows.len() {
            if groups.iter().any(|g| !g.ids.is_empty()) {
                warn!(%request_id, offered = groups.len(), here = windows.len(), "the offer's KV-cache groups are not this engine's: computing locally");
            }
            return None;
        }
        let bs = self.block_size() as u64;
        let end = groups.iter().map(GroupBlocks::end).fold((prompt_len as u64) / bs, u64::min);
        let covered =
            groups.iter().zip(windows).all(|(g, &w)| u64::from(g.first) <= needed_from(w, first, end, bs));
        if end <= first {
            return None;
        }
        if !covered {
            debug!(%request_id, "the prefill engine no longer holds every block a window needs: computing locally");
            return None;
        }
        Some(end)
    }

    /// Records the blocks allocated for a request's remote tokens. `new_blocks` are, per KV-cache
    /// group, the blocks newly allocated for it (not prefix-cached) at their block positions; the
    /// positions from the one after the `num_computed_tokens` the local prefix cache holds up to
    /// `num_computed_tokens + num_external_tokens` receive the remote blocks at the same
    /// positions (of a sliding-window group, only those its window needs).
    ///
    /// A request triggers at most one load: `do_remote_prefill` is turned off here, so a second
    /// call for the same request (vLLM makes one when an async load completes) does nothing. With
    /// `num_external_tokens == 0` while the remote holds blocks (a full local prefix hit), the
    /// request is recorded as notify-only, so that the prefill engine is still told to free.
    pub fn update_state_after_alloc(
        &mut self,
        request_id: &RequestId,
        prompt_len: usize,
        params: Option<&mut TransferParams>,
        new_blocks: &[GroupBlocks],
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> Result<()> {
        let Some(params) = params.filter(|p| p.do_remote_prefill) else {
            return Ok(());
        };
        params.do_remote_prefill = false;
        let Some((remote, groups)) = self.offered(request_id, params) else {
            self.awaiting.remove(request_id);
            return Ok(());
        };
        if num_external_tokens == 0 {
            self.awaiting.remove(request_id);
            if params.has_remote_blocks() {
                debug!(%request_id, "nothing to load: notify the prefill engine only");
                self.pending_recv.insert(request_id.clone(), PendingRecv::new(remote, params, groups));
            }
            return Ok(());
        }
        let local = match self.local_blocks(
            &groups,
            new_blocks,
            prompt_len,
            num_computed_tokens,
            num_external_tokens,
        ) {
            Ok(local) => local,
            Err(misfit) => {
                // The prefill engine is still told to free: the load never happens.
                self.pending_recv.insert(request_id.clone(), PendingRecv::new(remote, params, groups));
                self.awaiting.remove(request_id);
                return Err(Error::invalid_argument(format!("request {request_id}: {misfit}")));
            }
        };
        if !self.awaiting.contains_key(request_id) {
            if let Some(entry) = self.lease_of(params) {
                self.awaiting.insert(request_id.clone(), entry);
            }
        }
        let pending = PendingRecv { local_block_ids: local, ..PendingRecv::new(remote, params, groups) };
        self.pending_recv.insert(request_id.clone(), pending);
        Ok(())
    }

    /// The local blocks a load fills, per group, or what does not fit: positions past the
    /// computed tokens up to the external ones, of a sliding-window group only those its window
    /// needs, each allocated locally and offered remotely.
    fn local_blocks(
        &self,
        groups: &[GroupBlocks],
        new_blocks: &[GroupBlocks],
        prompt_len: usize,
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> std::result::Result<Vec<GroupBlocks>, String> {
        let bs = self.block_size();
        if num_external_tokens % bs != 0 || num_computed_tokens % bs != 0 {
            return Err("computed and external tokens must be whole blocks".to_owned());
        }
        let windows = self.config.windows();
        if groups.len() != windows.len() || new_blocks.len() != windows.len() {
            return Err(format!(
                "{} KV-cache groups offered and {} allocated, but this engine has {}",
                groups.len(),
                new_blocks.len(),
                windows.len()
            ));
        }
        let (first, needed) = ((num_computed_tokens / bs) as u64, (num_external_tokens / bs) as u64);
        let end = first.saturating_add(needed);
        if end > (prompt_len / bs) as u64 {
            return Err(format!(
                "{num_computed_tokens} computed and {num_external_tokens} external tokens exceed the \
                 {prompt_len}-token prompt's full blocks"
            ));
        }
        let mut local = Vec::with_capacity(groups.len());
        for (g, ((offered, allocated), &window)) in groups.iter().zip(new_blocks).zip(windows).enumerate() {
            let from = needed_from(window, first, end, bs as u64);
            let Some(ids) = allocated.at(from, end) else {
                return Err(format!(
                    "group {g}: block positions {from}..{end} to load but {}..{} allocated",
                    allocated.first,
                    allocated.end()
                ));
            };
            if offered.at(from, end).is_none() {
                return Err(format!(
                    "group {g}: block positions {from}..{end} to load but the remote offers {}..{}",
                    offered.first,
                    offered.end()
                ));
            }
            // `from <= end <= prompt_len / bs`, so `from` fits a block position.
            local.push(GroupBlocks::new(from as u32, ids.to_vec()));
        }
        Ok(local)
    }

    /// The metadata for this step's workers; clears what it hands over. `now` paces the
    /// heartbeats: the leases of requests waiting for their KV are renewed every sixth of a lease.
    pub fn build_connector_meta(&mut self, now: Instant) -> ConnectorMetadata {
        let mut reqs_to_recv: Vec<RecvRequest> = self
            .pending_recv
            .drain()
            .map(|(request_id, p)| RecvRequest {
                request_id,
                remote_request_id: p.remote_request_id,
                local_block_ids: p.local_block_ids,
                remote_block_ids: p.remote_block_ids,
                remote: p.remote,
                nonce: p.nonce,
                mac: p.mac,
                remote_instance: p.instance,
                remote_tp_size: p.tp_size,
            })
            .collect();
        reqs_to_recv.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        for r in &reqs_to_recv {
            if !r.is_notify_only() {
                self.recving.insert(r.request_id.clone());
            }
        }
        ConnectorMetadata {
            reqs_to_recv,
            reqs_to_send: std::mem::take(&mut self.new_sending),
            heartbeats: self.heartbeats(now),
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
        for (remote, tp_size, held) in self.awaiting.values() {
            by_engine
                .entry((remote, *tp_size))
                .or_insert_with(|| Heartbeat {
                    remote: remote.clone(),
                    remote_tp_size: *tp_size,
                    holds: Vec::new(),
                })
                .holds
                .push(held.clone());
        }
        let mut beats: Vec<Heartbeat> = by_engine.into_values().collect();
        for beat in &mut beats {
            beat.holds.sort_by(|a, b| a.request_id.cmp(&b.request_id));
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
            if let Some((remote, groups)) =
                self.offered(request_id, params).filter(|_| params.has_remote_blocks())
            {
                debug!(%request_id, "finished before its load: notify the prefill engine only");
                self.pending_recv.insert(request_id.clone(), PendingRecv::new(remote, params, groups));
            }
            return FinishOutcome::default();
        }
        let keeps = matches!(reason, FinishReason::LengthCapped | FinishReason::Stopped);
        if !params.is_some_and(|p| p.do_remote_decode) || !keeps {
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
            self.new_sending.push(HeldRequest { request_id: request_id.clone(), nonce });
        }
        let remote = RemoteCoordinates {
            engine_id: self.config.engine_id.clone(),
            endpoint: self.config.side_channel.clone(),
        };
        let instance = self.config.instance.map(|i| crate::auth::HexBytes(i.to_le_bytes()));
        let tp_size = Some(self.config.tp_size);
        let offer = Offer {
            remote: &remote,
            request_id,
            groups: &computed,
            nonce: &nonce,
            instance: instance.as_ref(),
            tp_size,
        };
        let kvx_offer_mac = self.config.auth_key.as_ref().map(|key| offer.tag(key));
        let mut params = TransferParams::for_decode(computed, remote);
        params.remote_request_id = Some(request_id.clone());
        params.kvx_hold_nonce = Some(nonce);
        params.kvx_offer_mac = kvx_offer_mac;
        params.kvx_instance = instance;
        params.tp_size = tp_size;
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
mod tests {
    use super::*;
    use crate::ids::BlockId;

    const BS: usize = 16;

    fn sched() -> ConnectorScheduler {
        ConnectorScheduler::new(SchedulerConfig {
            engine_id: "prefill".into(),
            block_size: BS as u32,
            side_channel: Some(Endpoint::new("10.0.0.1", 5600)),
            auth_key: None,
            lease_duration: Duration::from_secs(30),
            instance: None,
            tp_size: 1,
            group_windows: Vec::new(),
        })
        .unwrap()
    }

    fn decode_params(blocks: Vec<BlockId>) -> TransferParams {
        TransferParams::for_decode(
            vec![GroupBlocks::whole(blocks)],
            RemoteCoordinates::at("prefill", "10.0.0.1", 5600),
        )
    }

    /// One group's blocks from position 0.
    fn whole(ids: &[BlockId]) -> Vec<GroupBlocks> {
        vec![GroupBlocks::whole(ids.to_vec())]
    }

    /// One group's new blocks, from the position after `computed` tokens.
    fn new_at(computed: usize, ids: &[BlockId]) -> Vec<GroupBlocks> {
        vec![GroupBlocks::new((computed / BS) as u32, ids.to_vec())]
    }

    fn id(s: &str) -> RequestId {
        RequestId::new(s)
    }

    #[test]
    fn remote_prefill_counts_full_blocks_minus_computed() {
        let mut s = sched();
        let p = decode_params(vec![10, 11, 12]);
        let m = s.get_num_new_matched_tokens(&id("r"), 3 * BS + 5, Some(&p), 0).unwrap();
        assert_eq!(m, MatchedTokens { count: 3 * BS, load_async: true });
        let m = s.get_num_new_matched_tokens(&id("r"), 3 * BS + 5, Some(&p), BS).unwrap();
        assert_eq!(m, MatchedTokens { count: 2 * BS, load_async: true });
        // Capped by the blocks the remote offers, not only by the prompt.
        let m = s.get_num_new_matched_tokens(&id("r"), 10 * BS, Some(&p), 0).unwrap();
        assert_eq!(m.count, 3 * BS);
        assert!(s.build_connector_meta(Instant::now()).is_empty());
    }

    #[test]
    fn params_without_host_or_port_load_from_the_engine_found_by_id() {
        let mut prefill =
            ConnectorScheduler::new(SchedulerConfig { side_channel: None, ..sched().config }).unwrap();
        let asked = TransferParams { do_remote_decode: true, ..Default::default() };
        let out = prefill.request_finished(
            &id("p"),
            Some(&asked),
            FinishReason::LengthCapped,
            2 * BS,
            &whole(&[4, 5]),
        );
        let mut p = out.params.unwrap();
        assert_eq!((&p.remote_host, p.remote_port), (&None, None));
        let mut s = sched();
        let m = s.get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&p), 0).unwrap();
        assert_eq!(m, MatchedTokens { count: 2 * BS, load_async: true });
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[7, 8]), 0, m.count).unwrap();
        let meta = s.build_connector_meta(Instant::now());
        assert_eq!(meta.reqs_to_recv[0].remote, RemoteCoordinates::by_id("prefill"));
    }

    #[test]
    fn no_remote_prefill_or_no_params_loads_nothing() {
        let s = sched();
        assert_eq!(s.get_num_new_matched_tokens(&id("r"), 100, None, 0).unwrap(), MatchedTokens::default());
        let p = TransferParams { do_remote_decode: true, ..Default::default() };
        assert_eq!(
            s.get_num_new_matched_tokens(&id("r"), 100, Some(&p), 0).unwrap(),
            MatchedTokens::default()
        );
    }

    #[test]
    fn unaligned_computed_tokens_is_an_error_not_a_panic() {
        let s = sched();
        let p = decode_params(vec![1, 2]);
        let e = s.get_num_new_matched_tokens(&id("r"), 40, Some(&p), 3).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
    }

    #[test]
    fn incomplete_coordinates_promise_no_load_and_transfer_nothing() {
        for strip in 0..3 {
            let mut s = sched();
            let mut p = decode_params(vec![1, 2]);
            match strip {
                0 => p.remote_host = None,
                1 => p.remote_engine_id = None,
                _ => p.remote_port = None,
            }
            let m = s.get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&p), 0).unwrap();
            assert_eq!(m, MatchedTokens::default(), "case {strip}");
            s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[7, 8]), 0, 2 * BS)
                .unwrap();
            assert!(!p.do_remote_prefill, "at most one transfer");
            assert!(s.build_connector_meta(Instant::now()).reqs_to_recv.is_empty());
        }
    }

    #[test]
    fn alloc_records_new_blocks_and_turns_remote_prefill_off() {
        let mut s = sched();
        let mut p = decode_params(vec![10, 11, 12]);
        s.get_num_new_matched_tokens(&id("r"), 3 * BS + 1, Some(&p), BS).unwrap();
        s.update_state_after_alloc(&id("r"), 3 * BS + 1, Some(&mut p), &new_at(BS, &[5, 6, 99]), BS, 2 * BS)
            .unwrap();
        assert!(!p.do_remote_prefill);
        // A second allocation for the same request triggers nothing.
        s.update_state_after_alloc(&id("r"), 3 * BS + 1, Some(&mut p), &new_at(0, &[5, 6]), 0, 2 * BS)
            .unwrap();
        let meta = s.build_connector_meta(Instant::now());
        assert_eq!(meta.reqs_to_recv.len(), 1);
        let r = &meta.reqs_to_recv[0];
        assert_eq!(r.local_block_ids, new_at(BS, &[5, 6]), "the first block hit the local prefix cache");
        assert_eq!(r.remote_block_ids, whole(&[10, 11, 12]), "as offered");
        assert_eq!(r.remote.engine_id, "prefill".into());
        assert_eq!(s.num_recving(), 1);
        assert!(s.build_connector_meta(Instant::now()).is_empty(), "the record is cleared");
    }

    #[test]
    fn full_prefix_hit_is_notify_only_and_survives_allocation() {
        let mut s = sched();
        let mut p = decode_params(vec![10, 11]);
        let m = s.get_num_new_matched_tokens(&id("r"), 2 * BS + 3, Some(&p), 2 * BS).unwrap();
        assert_eq!(m, MatchedTokens::default());
        // The engine allocates a block for its own computation of the tail: not a load target.
        s.update_state_after_alloc(&id("r"), 2 * BS + 3, Some(&mut p), &new_at(0, &[42]), 0, 0).unwrap();
        let meta = s.build_connector_meta(Instant::now());
        assert_eq!(meta.reqs_to_recv.len(), 1);
        assert!(meta.reqs_to_recv[0].is_notify_only());
        assert_eq!(s.num_recving(), 0, "a notify-only request does not wait");
    }

    #[test]
    fn empty_remote_blocks_with_a_long_prompt_loads_nothing() {
        let mut s = sched();
        let mut p = decode_params(vec![]);
        let m = s.get_num_new_matched_tokens(&id("r"), 5 * BS, Some(&p), 0).unwrap();
        assert_eq!(m, MatchedTokens::default());
        s.update_state_after_alloc(&id("r"), 5 * BS, Some(&mut p), &new_at(0, &[1, 2, 3, 4, 5]), 0, 0)
            .unwrap();
        assert!(s.build_connector_meta(Instant::now()).is_empty(), "nothing held remotely: nothing to free");
    }

    #[test]
    fn alloc_with_too_few_blocks_is_an_error() {
        let mut s = sched();
        let mut p = decode_params(vec![1, 2]);
        let e = s
            .update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[7]), 0, 2 * BS)
            .unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        let mut p = decode_params(vec![1]);
        assert!(
            s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[7, 8]), 0, 2 * BS)
                .is_err()
        );
    }

    #[test]
    fn prefill_keeps_only_full_computed_blocks() {
        let mut s = sched();
        let p = TransferParams { do_remote_decode: true, ..Default::default() };
        // 2 full blocks and a partial one: the partial block is not offered.
        let out = s.request_finished(
            &id("a"),
            Some(&p),
            FinishReason::LengthCapped,
            2 * BS + 5,
            &whole(&[3, 4, 5]),
        );
        assert!(out.delay_free);
        let params = out.params.unwrap();
        let nonce_a = params.kvx_hold_nonce.unwrap();
        assert_eq!(
            params,
            TransferParams {
                remote_request_id: Some(id("a")),
                kvx_hold_nonce: Some(nonce_a),
                tp_size: Some(1),
                ..decode_params(vec![3, 4])
            }
        );
        assert_eq!(params.kvx_offer_mac, None, "no key, no MAC");
        // Exactly 2 full blocks, a third allocated for the next token: only 2 offered.
        let out =
            s.request_finished(&id("b"), Some(&p), FinishReason::LengthCapped, 2 * BS, &whole(&[6, 7, 8]));
        let params_b = out.params.unwrap();
        assert_eq!(params_b.remote_block_ids, Some(vec![vec![6, 7]]));
        let nonce_b = params_b.kvx_hold_nonce.unwrap();
        assert_ne!(nonce_a, nonce_b, "every hold has its own nonce");
        // Zero computed tokens is not "all full".
        let out = s.request_finished(&id("c"), Some(&p), FinishReason::LengthCapped, 0, &whole(&[9]));
        assert!(!out.delay_free);
        assert_eq!(out.params.unwrap().remote_block_ids, Some(vec![vec![]]));
        // Shorter than a block: free now.
        let out = s.request_finished(&id("d"), Some(&p), FinishReason::LengthCapped, 5, &whole(&[9]));
        assert!(!out.delay_free);
        let meta = s.build_connector_meta(Instant::now());
        assert_eq!(
            meta.reqs_to_send,
            vec![
                HeldRequest { request_id: id("a"), nonce: nonce_a },
                HeldRequest { request_id: id("b"), nonce: nonce_b }
            ]
        );
        assert_eq!(s.num_sending(), 2);
        s.update_finished(&Finished { sending: vec![id("a"), id("b")], ..Default::default() });
        assert!(s.is_idle());
    }

    #[test]
    fn remote_decode_requests_that_stopped_or_hit_their_cap_are_held_and_no_others() {
        let mut s = sched();
        let p = TransferParams { do_remote_decode: true, ..Default::default() };
        for reason in [FinishReason::LengthCapped, FinishReason::Stopped] {
            assert!(
                s.request_finished(&id("a"), Some(&p), reason, 64, &whole(&[1, 2, 3, 4])).delay_free,
                "{reason:?}"
            );
        }
        s.update_finished(&Finished { sending: vec![id("a")], ..Default::default() });
        for reason in [FinishReason::Aborted, FinishReason::Error] {
            assert_eq!(
                s.request_finished(&id("a"), Some(&p), reason, 64, &whole(&[1, 2, 3, 4])),
                FinishOutcome::default()
            );
        }
        assert_eq!(
            s.request_finished(&id("a"), None, FinishReason::LengthCapped, 64, &whole(&[1, 2, 3, 4])),
            FinishOutcome::default()
        );
        assert!(s.is_idle());
    }

    #[test]
    fn abort_before_metadata_drops_the_read_but_still_notifies() {
        let mut s = sched();
        let mut p = decode_params(vec![10, 11]);
        s.get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&p), 0).unwrap();
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[5, 6]), 0, 2 * BS).unwrap();
        let out = s.request_finished(&id("r"), Some(&p), FinishReason::Aborted, 0, &whole(&[5, 6]));
        assert!(!out.delay_free, "no READ will target the blocks: free them now");
        let meta = s.build_connector_meta(Instant::now());
        assert_eq!(meta.reqs_to_recv.len(), 1);
        assert!(meta.reqs_to_recv[0].is_notify_only());
        assert!(s.is_idle());
    }

    #[test]
    fn abort_during_read_delays_freeing_until_the_load_ends() {
        let mut s = sched();
        let mut p = decode_params(vec![10]);
        s.get_num_new_matched_tokens(&id("r"), BS, Some(&p), 0).unwrap();
        s.update_state_after_alloc(&id("r"), BS, Some(&mut p), &new_at(0, &[5]), 0, BS).unwrap();
        s.build_connector_meta(Instant::now());
        let out = s.request_finished(&id("r"), Some(&p), FinishReason::Aborted, 0, &whole(&[5]));
        assert!(out.delay_free);
        s.update_finished(&Finished {
            failed_recving: vec![FailedRecv {
                request_id: id("r"),
                error: crate::Error::new(crate::ErrorKind::Transfer, "x"),
            }],
            ..Default::default()
        });
        assert!(s.is_idle());
    }

    #[test]
    fn asking_for_matched_tokens_records_nothing() {
        // vLLM may ask again for a request it could not schedule: only the allocation records.
        let mut s = sched();
        for (blocks, computed) in [(vec![10, 11], 0), (vec![10, 11], 2 * BS)] {
            let p = decode_params(blocks);
            for _ in 0..3 {
                s.get_num_new_matched_tokens(&id("r"), 2 * BS + 3, Some(&p), computed).unwrap();
            }
        }
        assert!(s.build_connector_meta(Instant::now()).is_empty());
        assert!(s.is_idle());
        assert_eq!(s.num_recving(), 0);
    }

    #[test]
    fn the_second_allocation_of_an_async_load_records_nothing() {
        // vLLM calls update_state_after_alloc again once the load completes, with no external
        // tokens: neither a second load nor a notify-only message may follow.
        let mut s = sched();
        let mut p = decode_params(vec![10, 11]);
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[5, 6]), 0, 2 * BS).unwrap();
        assert_eq!(s.build_connector_meta(Instant::now()).reqs_to_recv.len(), 1);
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[7]), 0, 0).unwrap();
        assert!(s.build_connector_meta(Instant::now()).is_empty());
        // Notify-only, twice: one message.
        let mut p = decode_params(vec![10, 11]);
        s.update_state_after_alloc(&id("n"), 2 * BS + 3, Some(&mut p), &new_at(0, &[42]), 0, 0).unwrap();
        s.update_state_after_alloc(&id("n"), 2 * BS + 3, Some(&mut p), &new_at(0, &[42]), 0, 0).unwrap();
        let meta = s.build_connector_meta(Instant::now());
        assert_eq!(meta.reqs_to_recv.len(), 1);
        assert!(meta.reqs_to_recv[0].is_notify_only());
    }

    #[test]
    fn the_prefill_engines_request_id_travels_to_the_decode_workers() {
        // Prefill: request_finished names its own request in the params it returns.
        let mut prefill = sched();
        let held = TransferParams { do_remote_decode: true, ..Default::default() };
        let out = prefill.request_finished(
            &id("cmpl-p"),
            Some(&held),
            FinishReason::LengthCapped,
            2 * BS,
            &whole(&[3, 4]),
        );
        // The params cross to the decode engine as JSON (through the proxy), per-group block ids.
        let json = out.params.unwrap().to_json();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["remote_request_id"], "cmpl-p");
        assert_eq!(v["remote_block_ids"], serde_json::json!([[3, 4]]));
        let mut p = TransferParams::from_json(&json).unwrap();
        // Decode: a load and a notify-only request both carry the prefill engine's id.
        let mut decode = sched();
        decode
            .update_state_after_alloc(
                &id("cmpl-d"),
                2 * BS,
                Some(&mut p.clone()),
                &new_at(0, &[5, 6]),
                0,
                2 * BS,
            )
            .unwrap();
        decode.update_state_after_alloc(&id("cmpl-d2"), 2 * BS, Some(&mut p), &new_at(0, &[]), 0, 0).unwrap();
        let mut reqs = decode.build_connector_meta(Instant::now()).reqs_to_recv;
        reqs.sort_by(|a, b| a.request_id.as_str().cmp(b.request_id.as_str()));
        assert_eq!(reqs.len(), 2);
        for r in &reqs {
            assert_eq!(r.remote_request_id, Some(id("cmpl-p")));
            assert_eq!(r.prefill_request_id(), &id("cmpl-p"));
        }
        assert!(!reqs[0].is_notify_only() && reqs[1].is_notify_only());
        // Without it (an older peer), the notification names the decode engine's own id.
        let mut old = decode_params(vec![1]);
        decode.update_state_after_alloc(&id("same"), BS, Some(&mut old), &new_at(0, &[9]), 0, BS).unwrap();
        let meta = decode.build_connector_meta(Instant::now());
        assert_eq!(meta.reqs_to_recv[0].prefill_request_id(), &id("same"));
        // And it survives the wire encoding to the workers.
        let back: ConnectorMetadata = crate::wire::decode(&crate::wire::encode(&meta).unwrap()).unwrap();
        assert_eq!(back, meta);
    }

    #[test]
    fn zero_block_size_is_rejected() {
        let cfg = SchedulerConfig { block_size: 0, ..sched().config().clone() };
        assert!(ConnectorScheduler::new(cfg).is_err());
    }

    #[test]
    fn a_keyed_prefill_engine_signs_its_offer_and_the_decode_side_carries_it() {
        let key = AuthKey::new("deployment secret 0123").unwrap();
        let mut prefill =
            ConnectorScheduler::new(SchedulerConfig { auth_key: Some(key.clone()), ..sched().config })
                .unwrap();
        let held = TransferParams { do_remote_decode: true, ..Default::default() };
        let out = prefill.request_finished(
            &id("p1"),
            Some(&held),
            FinishReason::LengthCapped,
            3 * BS,
            &whole(&[7, 8, 9]),
        );
        let mut params = TransferParams::from_json(&out.params.unwrap().to_json()).unwrap();
        let mut decode = sched();
        decode
            .update_state_after_alloc(
                &id("d1"),
                2 * BS + 1,
                Some(&mut params),
                &new_at(0, &[1, 2]),
                0,
                2 * BS,
            )
            .unwrap();
        let r = decode.build_connector_meta(Instant::now()).reqs_to_recv.remove(0);
        assert_eq!(r.remote_block_ids, whole(&[7, 8, 9]));
        r.offer().unwrap().verify(&key, r.mac.as_ref()).unwrap();
        let mut forged = r.clone();
        forged.remote_block_ids[0].ids[2] = 3;
        assert!(forged.offer().unwrap().verify(&key, forged.mac.as_ref()).is_err());
        let other_tp = RecvRequest { remote_tp_size: Some(2), ..r };
        assert!(other_tp.offer().unwrap().verify(&key, other_tp.mac.as_ref()).is_err(), "tp_size is covered");
    }

    #[test]
    fn seeded_nonces_are_reproducible() {
        let nonces = |seed| {
            let mut s =
                ConnectorScheduler::with_nonces(sched().config, NonceSource::from_seed(seed)).unwrap();
            let held = TransferParams { do_remote_decode: true, ..Default::default() };
            s.request_finished(&id("a"), Some(&held), FinishReason::LengthCapped, BS, &whole(&[1]))
                .params
                .unwrap()
                .kvx_hold_nonce
        };
        assert_eq!(nonces([1; 32]), nonces([1; 32]));
        assert_ne!(nonces([1; 32]), nonces([2; 32]));
    }

    fn offered(prefill: &mut ConnectorScheduler, id_: &str) -> TransferParams {
        let held = TransferParams { do_remote_decode: true, ..Default::default() };
        let out = prefill.request_finished(
            &id(id_),
            Some(&held),
            FinishReason::LengthCapped,
            2 * BS,
            &whole(&[3, 4]),
        );
        out.params.unwrap()
    }

    #[test]
    fn waiting_requests_have_their_leases_renewed_every_sixth_of_a_lease() {
        let mut prefill = sched();
        let (mut a, b) = (offered(&mut prefill, "pa"), offered(&mut prefill, "pb"));
        let mut s = sched();
        let t0 = Instant::now();
        s.on_new_request(&id("a"), Some(&a));
        s.on_new_request(&id("b"), Some(&b));
        s.on_new_request(&id("plain"), None);
        assert!(s.build_connector_meta(t0).heartbeats.is_empty(), "a new hold needs no renewal yet");
        let sixth = Duration::from_secs(5);
        assert_eq!(s.next_deadline(), Some(t0 + sixth));
        let beats = s.build_connector_meta(t0 + sixth).heartbeats;
        assert_eq!(beats.len(), 1, "one per prefill engine");
        let ids: Vec<&str> = beats[0].holds.iter().map(|h| h.request_id.as_str()).collect();
        assert_eq!(ids, ["pa", "pb"], "named as the prefill engine knows them, with their nonces");
        assert_eq!(beats[0].holds[0].nonce, a.kvx_hold_nonce.unwrap());
        assert!(s.build_connector_meta(t0 + sixth + sixth / 2).heartbeats.is_empty());
        // "a" is loading: still renewed until its load is reported; "b" finishes while queued.
        s.update_state_after_alloc(&id("a"), 2 * BS, Some(&mut a), &new_at(0, &[1, 2]), 0, 2 * BS).unwrap();
        s.request_finished(&id("b"), Some(&b), FinishReason::Aborted, 0, &whole(&[]));
        let meta = s.build_connector_meta(t0 + 2 * sixth);
        assert_eq!(meta.heartbeats[0].holds.len(), 1);
        assert_eq!(meta.reqs_to_recv.len(), 2, "a's load, and b's release though it never ran");
        assert!(meta.reqs_to_recv.iter().any(|r| r.request_id == id("b") && r.is_notify_only()));
        s.update_finished(&Finished { recving: vec![id("a")], ..Default::default() });
        assert!(s.build_connector_meta(t0 + 3 * sixth).heartbeats.is_empty());
        assert!(s.is_idle());
    }

    #[test]
    fn a_keyed_decode_engine_renews_only_offers_that_verify() {
        let key = AuthKey::new("deployment secret 0123").unwrap();
        let keyed = |c: SchedulerConfig| {
            ConnectorScheduler::new(SchedulerConfig { auth_key: Some(key.clone()), ..c })
        };
        let mut prefill = keyed(sched().config).unwrap();
        let good = offered(&mut prefill, "p1");
        let mut forged = good.clone();
        forged.remote_host = Some("evil".into());
        // Another TP size would renew other prefill ranks (other ports).
        let other_tp = TransferParams { tp_size: Some(4), ..good.clone() };
        let mut s = keyed(sched().config).unwrap();
        s.on_new_request(&id("good"), Some(&good));
        s.on_new_request(&id("forged"), Some(&forged));
        s.on_new_request(&id("other-tp"), Some(&other_tp));
        let t0 = Instant::now();
        s.build_connector_meta(t0);
        let beats = s.build_connector_meta(t0 + Duration::from_secs(5)).heartbeats;
        assert_eq!(beats.len(), 1);
        assert_eq!(beats[0].remote, RemoteCoordinates::at("prefill", "10.0.0.1", 5600));
        assert_eq!((beats[0].remote_tp_size, beats[0].holds.len()), (Some(1), 1));
    }

    #[test]
    fn the_alloc_check_counts_the_local_prefix() {
        let mut s = sched();
        // 3 blocks offered, 1 cached locally: at most 2 may load, from the second remote block.
        let mut p = decode_params(vec![10, 11, 12]);
        let e = s
            .update_state_after_alloc(&id("r"), 3 * BS, Some(&mut p), &new_at(BS, &[5, 6, 7]), BS, 3 * BS)
            .unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        let meta = s.build_connector_meta(Instant::now());
        assert!(meta.reqs_to_recv[0].is_notify_only(), "the prefill engine is still told to free");
        let mut p = decode_params(vec![10, 11, 12]);
        s.update_state_after_alloc(&id("q"), 3 * BS, Some(&mut p), &new_at(2 * BS, &[5]), 2 * BS, BS)
            .unwrap();
        let r = s.build_connector_meta(Instant::now()).reqs_to_recv.remove(0);
        assert_eq!(r.local_block_ids, new_at(2 * BS, &[5]), "read from the third remote block");
    }

    /// A scheduler for a model with a sliding-window group of two blocks and a full-attention group.
    fn hybrid() -> ConnectorScheduler {
        ConnectorScheduler::new(SchedulerConfig {
            group_windows: vec![Some(2 * BS as u32), None],
            ..sched().config
        })
        .unwrap()
    }

    /// What a hybrid prefill engine offers after computing `tokens`, holding the blocks `sliding`
    /// (from position `first`) and `full`.
    fn hybrid_offer(tokens: usize, first: u32, sliding: &[BlockId], full: &[BlockId]) -> TransferParams {
        let held = TransferParams { do_remote_decode: true, ..Default::default() };
        let blocks = [GroupBlocks::new(first, sliding.to_vec()), GroupBlocks::whole(full.to_vec())];
        hybrid()
            .request_finished(&id("p"), Some(&held), FinishReason::LengthCapped, tokens, &blocks)
            .params
            .unwrap()
    }

    #[test]
    fn a_hybrid_model_offers_each_group_and_loads_only_the_window_of_a_sliding_group() {
        // 4 full blocks and a partial one; the sliding group dropped positions 0 and 1.
        let mut p = hybrid_offer(4 * BS + 3, 2, &[20, 21, 22], &[1, 2, 3, 4, 5]);
        let v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
        assert_eq!(v["remote_block_ids"], serde_json::json!([[20, 21], [1, 2, 3, 4]]), "full blocks only");
        assert_eq!(v["kvx_group_first"], serde_json::json!([2, 0]));
        let mut s = hybrid();
        let m = s.get_num_new_matched_tokens(&id("r"), 4 * BS + 3, Some(&p), 0).unwrap();
        assert_eq!(m, MatchedTokens { count: 4 * BS, load_async: true });
        // The engine allocated the sliding group from position 2 (its window), the full one whole.
        let new = [GroupBlocks::new(2, vec![50, 51, 52]), GroupBlocks::whole(vec![60, 61, 62, 63, 64])];
        s.update_state_after_alloc(&id("r"), 4 * BS + 3, Some(&mut p), &new, 0, m.count).unwrap();
        let r = s.build_connector_meta(Instant::now()).reqs_to_recv.remove(0);
        assert_eq!(
            r.local_block_ids,
            [GroupBlocks::new(2, vec![50, 51]), GroupBlocks::whole(vec![60, 61, 62, 63])]
        );
        let (local, remote) = r.read_pairs().unwrap();
        assert_eq!((&local[..], &remote[..]), (&[50, 51, 60, 61, 62, 63][..], &[20, 21, 1, 2, 3, 4][..]));
        // With a local prefix hit of 3 blocks, one block of each group loads.
        let mut p = hybrid_offer(4 * BS + 3, 2, &[20, 21], &[1, 2, 3, 4]);
        let m = s.get_num_new_matched_tokens(&id("q"), 4 * BS + 3, Some(&p), 3 * BS).unwrap();
        assert_eq!(m.count, BS);
        let new = [GroupBlocks::new(3, vec![53, 54]), GroupBlocks::new(3, vec![65, 66])];
        s.update_state_after_alloc(&id("q"), 4 * BS + 3, Some(&mut p), &new, 3 * BS, m.count).unwrap();
        let r = s.build_connector_meta(Instant::now()).reqs_to_recv.remove(0);
        assert_eq!(r.read_pairs().unwrap().1.as_ref(), [21, 4]);
    }

    #[test]
    fn a_window_block_the_prefill_engine_dropped_is_computed_locally_not_loaded() {
        // 79 tokens computed: the window of the next token starts at token 48 (position 3), so
        // the prefill engine dropped position 2; a decode engine loading 4 blocks recomputes
        // token 64 first, whose window reaches back to position 2.
        let p = hybrid_offer(5 * BS - 1, 3, &[23], &[1, 2, 3, 4]);
        let s = hybrid();
        assert_eq!(
            s.get_num_new_matched_tokens(&id("r"), 5 * BS - 1, Some(&p), 0).unwrap(),
            MatchedTokens::default()
        );
        // One token more and it fits again: 80 tokens keep positions 3 and 4; 5 blocks load.
        let p = hybrid_offer(5 * BS, 3, &[23, 24], &[1, 2, 3, 4, 5]);
        assert_eq!(s.get_num_new_matched_tokens(&id("r"), 5 * BS, Some(&p), 0).unwrap().count, 5 * BS);
    }

    #[test]
    fn groups_that_are_not_this_engines_load_nothing_and_a_misfit_allocation_still_frees() {
        // A one-group offer to a hybrid engine, and a hybrid offer to a one-group engine.
        let one = decode_params(vec![1, 2]);
        assert_eq!(hybrid().get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&one), 0).unwrap().count, 0);
        let two = hybrid_offer(2 * BS, 0, &[7, 8], &[1, 2]);
        assert_eq!(sched().get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&two), 0).unwrap().count, 0);
        // An allocation that misses a block the window needs, or a group: refused, and the prefill
        // engine is told to free.
        for new in [
            vec![GroupBlocks::new(1, vec![50]), GroupBlocks::whole(vec![60, 61])],
            vec![GroupBlocks::whole(vec![60, 61])],
        ] {
            let mut s = hybrid();
            let mut p = two.clone();
            let e = s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new, 0, 2 * BS).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument, "{new:?}");
            assert!(s.build_connector_meta(Instant::now()).reqs_to_recv[0].is_notify_only());
        }
    }
}
