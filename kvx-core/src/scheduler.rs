//! The scheduler side of the connector: which requests load KV remotely, which prefill requests
//! keep their blocks, the leases to renew, and the per-step [`ConnectorMetadata`]. Pure logic: no
//! I/O; time comes in as `now`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};
use tracing::{debug, warn};

use crate::auth::{AuthKey, MacTag, Nonce, NonceSource};
use crate::error::{Error, Result};
use crate::ids::{BlockId, EngineId, RequestId};
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
        }
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
    /// The remote blocks as offered.
    remote_block_ids: Vec<BlockId>,
    /// Where in them the READ starts.
    remote_read_from: u32,
    /// Empty until blocks are allocated; stays empty for notify-only requests.
    local_block_ids: Vec<BlockId>,
    nonce: Option<Nonce>,
    mac: Option<MacTag>,
    instance: Option<InstanceId>,
    tp_size: Option<u32>,
}

impl PendingRecv {
    fn new(remote: RemoteCoordinates, params: &TransferParams) -> Self {
        PendingRecv {
            remote,
            remote_request_id: params.remote_request_id.clone(),
            remote_block_ids: params.remote_blocks().to_vec(),
            remote_read_from: 0,
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
        if params.remote_blocks().is_empty() {
            return None;
        }
        let remote = params.coordinates()?;
        let nonce = params.kvx_hold_nonce?;
        let request_id = params.remote_request_id.clone()?;
        let offer = Offer {
            remote: &remote,
            request_id: &request_id,
            block_ids: params.remote_blocks(),
            nonce: &nonce,
            instance: params.kvx_instance.as_ref(),
        };
        offer.check(self.config.auth_key.as_ref(), params.kvx_offer_mac.as_ref()).ok()?;
        Some((remote, params.tp_size, HeldRequest { request_id, nonce }))
    }

    /// How many of the prompt's tokens, beyond the `num_computed_tokens` the local prefix cache
    /// holds, load from the remote engine.
    ///
    /// Only requests with `do_remote_prefill` and complete remote coordinates load anything. The
    /// remote engine sends full blocks only: the count is the prompt rounded down to a block,
    /// capped by the blocks it offers, minus the computed tokens. Free of side effects (vLLM may
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
        if params.coordinates().is_none() {
            warn!(%request_id, "do_remote_prefill without complete remote coordinates: computing locally");
            return Ok(MatchedTokens::default());
        }
        let loadable_blocks = (prompt_len / bs).min(params.remote_blocks().len());
        let count = (loadable_blocks * bs).saturating_sub(num_computed_tokens);
        Ok(MatchedTokens { count, load_async: count > 0 })
    }

    /// Records the blocks allocated for a request's remote tokens. `new_block_ids` are the blocks
    /// newly allocated for it (not prefix-cached), in token order; the first
    /// `num_external_tokens / block_size` of them receive the remote blocks from the one after the
    /// `num_computed_tokens` the local prefix cache holds.
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
        new_block_ids: &[BlockId],
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> Result<()> {
        let Some(params) = params.filter(|p| p.do_remote_prefill) else {
            return Ok(());
        };
        params.do_remote_prefill = false;
        let Some(remote) = params.coordinates() else {
            warn!(%request_id, "invalid kv_transfer_params (incomplete remote coordinates): no transfer");
            self.awaiting.remove(request_id);
            return Ok(());
        };
        if num_external_tokens == 0 {
            self.awaiting.remove(request_id);
            if !params.remote_blocks().is_empty() {
                debug!(%request_id, "nothing to load: notify the prefill engine only");
                self.pending_recv.insert(request_id.clone(), PendingRecv::new(remote, params));
            }
            return Ok(());
        }
        let bs = self.block_size();
        let needed = num_external_tokens / bs;
        let first = num_computed_tokens / bs;
        let loadable = (prompt_len / bs).min(params.remote_blocks().len());
        let misfit = if num_external_tokens % bs != 0 || num_computed_tokens % bs != 0 {
            Some("computed and external tokens must be whole blocks".to_owned())
        } else if needed > new_block_ids.len() {
            Some(format!("{needed} blocks to load but {} allocated", new_block_ids.len()))
        } else if first.checked_add(needed).is_none_or(|end| end > loadable) {
            Some(format!(
                "{num_computed_tokens} computed and {num_external_tokens} external tokens exceed the {loadable} blocks \
                 the remote offers for a {prompt_len}-token prompt"
            ))
        } else {
            None
        };
        if let Some(misfit) = misfit {
            // The prefill engine is still told to free: the load never happens.
            self.pending_recv.insert(request_id.clone(), PendingRecv::new(remote, params));
            self.awaiting.remove(request_id);
            return Err(Error::invalid_argument(format!("request {request_id}: {misfit}")));
        }
        let remote_read_from = u32::try_from(first).map_err(|_| {
            Error::invalid_argument(format!(
                "request {request_id}: {first} computed blocks overflow a block id"
            ))
        })?;
        if !self.awaiting.contains_key(request_id) {
            if let Some(entry) = self.lease_of(params) {
                self.awaiting.insert(request_id.clone(), entry);
            }
        }
        let pending = PendingRecv {
            remote_read_from,
            local_block_ids: new_block_ids[..needed].to_vec(),
            ..PendingRecv::new(remote, params)
        };
        self.pending_recv.insert(request_id.clone(), pending);
        Ok(())
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
                remote_read_from: p.remote_read_from,
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

    /// A request finished or was aborted. `block_ids` are its blocks in token order.
    ///
    /// - Prefill side (`do_remote_decode`, finished by the length cap or a stop, as vLLM keeps
    ///   both): keep the full computed blocks for the decode engine (a trailing partial block is
    ///   not sent) and return the params it needs.
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
        block_ids: &[BlockId],
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
            if let Some(remote) = params.coordinates().filter(|_| !params.remote_blocks().is_empty()) {
                debug!(%request_id, "finished before its load: notify the prefill engine only");
                self.pending_recv.insert(request_id.clone(), PendingRecv::new(remote, params));
            }
            return FinishOutcome::default();
        }
        let keeps = matches!(reason, FinishReason::LengthCapped | FinishReason::Stopped);
        if !params.is_some_and(|p| p.do_remote_decode) || !keeps {
            return FinishOutcome::default();
        }
        let full_blocks = (num_computed_tokens / self.block_size()).min(block_ids.len());
        let computed = block_ids[..full_blocks].to_vec();
        let delay_free = !computed.is_empty();
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
        let offer = Offer {
            remote: &remote,
            request_id,
            block_ids: &computed,
            nonce: &nonce,
            instance: instance.as_ref(),
        };
        let kvx_offer_mac = self.config.auth_key.as_ref().map(|key| offer.tag(key));
        let mut params = TransferParams::for_decode(computed, remote);
        params.remote_request_id = Some(request_id.clone());
        params.kvx_hold_nonce = Some(nonce);
        params.kvx_offer_mac = kvx_offer_mac;
        params.kvx_instance = instance;
        params.tp_size = Some(self.config.tp_size);
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
        })
        .unwrap()
    }

    fn decode_params(blocks: Vec<BlockId>) -> TransferParams {
        TransferParams::for_decode(blocks, RemoteCoordinates::at("prefill", "10.0.0.1", 5600))
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
        let out =
            prefill.request_finished(&id("p"), Some(&asked), FinishReason::LengthCapped, 2 * BS, &[4, 5]);
        let mut p = out.params.unwrap();
        assert_eq!((&p.remote_host, p.remote_port), (&None, None));
        let mut s = sched();
        let m = s.get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&p), 0).unwrap();
        assert_eq!(m, MatchedTokens { count: 2 * BS, load_async: true });
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &[7, 8], 0, m.count).unwrap();
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
            s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &[7, 8], 0, 2 * BS).unwrap();
            assert!(!p.do_remote_prefill, "at most one transfer");
            assert!(s.build_connector_meta(Instant::now()).reqs_to_recv.is_empty());
        }
    }

    #[test]
    fn alloc_records_new_blocks_and_turns_remote_prefill_off() {
        let mut s = sched();
        let mut p = decode_params(vec![10, 11, 12]);
        s.get_num_new_matched_tokens(&id("r"), 3 * BS + 1, Some(&p), BS).unwrap();
        s.update_state_after_alloc(&id("r"), 3 * BS + 1, Some(&mut p), &[5, 6, 99], BS, 2 * BS).unwrap();
        assert!(!p.do_remote_prefill);
        // A second allocation for the same request triggers nothing.
        s.update_state_after_alloc(&id("r"), 3 * BS + 1, Some(&mut p), &[5, 6], 0, 2 * BS).unwrap();
        let meta = s.build_connector_meta(Instant::now());
        assert_eq!(meta.reqs_to_recv.len(), 1);
        let r = &meta.reqs_to_recv[0];
        assert_eq!(r.local_block_ids, vec![5, 6]);
        assert_eq!(r.remote_block_ids, vec![10, 11, 12], "as offered");
        assert_eq!(r.remote_read_from, 1, "the first block hit the local prefix cache");
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
        s.update_state_after_alloc(&id("r"), 2 * BS + 3, Some(&mut p), &[42], 0, 0).unwrap();
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
        s.update_state_after_alloc(&id("r"), 5 * BS, Some(&mut p), &[1, 2, 3, 4, 5], 0, 0).unwrap();
        assert!(s.build_connector_meta(Instant::now()).is_empty(), "nothing held remotely: nothing to free");
    }

    #[test]
    fn alloc_with_too_few_blocks_is_an_error() {
        let mut s = sched();
        let mut p = decode_params(vec![1, 2]);
        let e = s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &[7], 0, 2 * BS).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        let mut p = decode_params(vec![1]);
        assert!(s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &[7, 8], 0, 2 * BS).is_err());
    }

    #[test]
    fn prefill_keeps_only_full_computed_blocks() {
        let mut s = sched();
        let p = TransferParams { do_remote_decode: true, ..Default::default() };
        // 2 full blocks and a partial one: the partial block is not offered.
        let out = s.request_finished(&id("a"), Some(&p), FinishReason::LengthCapped, 2 * BS + 5, &[3, 4, 5]);
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
        let out = s.request_finished(&id("b"), Some(&p), FinishReason::LengthCapped, 2 * BS, &[6, 7, 8]);
        let params_b = out.params.unwrap();
        assert_eq!(params_b.remote_block_ids, Some(vec![6, 7]));
        let nonce_b = params_b.kvx_hold_nonce.unwrap();
        assert_ne!(nonce_a, nonce_b, "every hold has its own nonce");
        // Zero computed tokens is not "all full".
        let out = s.request_finished(&id("c"), Some(&p), FinishReason::LengthCapped, 0, &[9]);
        assert!(!out.delay_free);
        assert_eq!(out.params.unwrap().remote_block_ids, Some(vec![]));
        // Shorter than a block: free now.
        let out = s.request_finished(&id("d"), Some(&p), FinishReason::LengthCapped, 5, &[9]);
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
                s.request_finished(&id("a"), Some(&p), reason, 64, &[1, 2, 3, 4]).delay_free,
                "{reason:?}"
            );
        }
        s.update_finished(&Finished { sending: vec![id("a")], ..Default::default() });
        for reason in [FinishReason::Aborted, FinishReason::Error] {
            assert_eq!(
                s.request_finished(&id("a"), Some(&p), reason, 64, &[1, 2, 3, 4]),
                FinishOutcome::default()
            );
        }
        assert_eq!(
            s.request_finished(&id("a"), None, FinishReason::LengthCapped, 64, &[1, 2, 3, 4]),
            FinishOutcome::default()
        );
        assert!(s.is_idle());
    }

    #[test]
    fn abort_before_metadata_drops_the_read_but_still_notifies() {
        let mut s = sched();
        let mut p = decode_params(vec![10, 11]);
        s.get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&p), 0).unwrap();
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &[5, 6], 0, 2 * BS).unwrap();
        let out = s.request_finished(&id("r"), Some(&p), FinishReason::Aborted, 0, &[5, 6]);
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
        s.update_state_after_alloc(&id("r"), BS, Some(&mut p), &[5], 0, BS).unwrap();
        s.build_connector_meta(Instant::now());
        let out = s.request_finished(&id("r"), Some(&p), FinishReason::Aborted, 0, &[5]);
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
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &[5, 6], 0, 2 * BS).unwrap();
        assert_eq!(s.build_connector_meta(Instant::now()).reqs_to_recv.len(), 1);
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &[7], 0, 0).unwrap();
        assert!(s.build_connector_meta(Instant::now()).is_empty());
        // Notify-only, twice: one message.
        let mut p = decode_params(vec![10, 11]);
        s.update_state_after_alloc(&id("n"), 2 * BS + 3, Some(&mut p), &[42], 0, 0).unwrap();
        s.update_state_after_alloc(&id("n"), 2 * BS + 3, Some(&mut p), &[42], 0, 0).unwrap();
        let meta = s.build_connector_meta(Instant::now());
        assert_eq!(meta.reqs_to_recv.len(), 1);
        assert!(meta.reqs_to_recv[0].is_notify_only());
    }

    #[test]
    fn the_prefill_engines_request_id_travels_to_the_decode_workers() {
        // Prefill: request_finished names its own request in the params it returns.
        let mut prefill = sched();
        let held = TransferParams { do_remote_decode: true, ..Default::default() };
        let out =
            prefill.request_finished(&id("cmpl-p"), Some(&held), FinishReason::LengthCapped, 2 * BS, &[3, 4]);
        // The params cross to the decode engine as JSON (through the proxy), per-group block ids.
        let json = out.params.unwrap().to_json();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["remote_request_id"], "cmpl-p");
        assert_eq!(v["remote_block_ids"], serde_json::json!([[3, 4]]));
        let mut p = TransferParams::from_json(&json).unwrap();
        // Decode: a load and a notify-only request both carry the prefill engine's id.
        let mut decode = sched();
        decode
            .update_state_after_alloc(&id("cmpl-d"), 2 * BS, Some(&mut p.clone()), &[5, 6], 0, 2 * BS)
            .unwrap();
        decode.update_state_after_alloc(&id("cmpl-d2"), 2 * BS, Some(&mut p), &[], 0, 0).unwrap();
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
        decode.update_state_after_alloc(&id("same"), BS, Some(&mut old), &[9], 0, BS).unwrap();
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
        let out =
            prefill.request_finished(&id("p1"), Some(&held), FinishReason::LengthCapped, 3 * BS, &[7, 8, 9]);
        let mut params = TransferParams::from_json(&out.params.unwrap().to_json()).unwrap();
        let mut decode = sched();
        decode
            .update_state_after_alloc(&id("d1"), 2 * BS + 1, Some(&mut params), &[1, 2], 0, 2 * BS)
            .unwrap();
        let r = decode.build_connector_meta(Instant::now()).reqs_to_recv.remove(0);
        assert_eq!((r.remote_block_ids.as_slice(), r.remote_read_from), (&[7, 8, 9][..], 0));
        r.offer().unwrap().verify(&key, r.mac.as_ref()).unwrap();
        let mut forged = r.clone();
        forged.remote_block_ids[2] = 3;
        assert!(forged.offer().unwrap().verify(&key, forged.mac.as_ref()).is_err());
    }

    #[test]
    fn seeded_nonces_are_reproducible() {
        let nonces = |seed| {
            let mut s =
                ConnectorScheduler::with_nonces(sched().config, NonceSource::from_seed(seed)).unwrap();
            let held = TransferParams { do_remote_decode: true, ..Default::default() };
            s.request_finished(&id("a"), Some(&held), FinishReason::LengthCapped, BS, &[1])
                .params
                .unwrap()
                .kvx_hold_nonce
        };
        assert_eq!(nonces([1; 32]), nonces([1; 32]));
        assert_ne!(nonces([1; 32]), nonces([2; 32]));
    }

    fn offered(prefill: &mut ConnectorScheduler, id_: &str) -> TransferParams {
        let held = TransferParams { do_remote_decode: true, ..Default::default() };
        let out =
            prefill.request_finished(&id(id_), Some(&held), FinishReason::LengthCapped, 2 * BS, &[3, 4]);
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
        s.update_state_after_alloc(&id("a"), 2 * BS, Some(&mut a), &[1, 2], 0, 2 * BS).unwrap();
        s.request_finished(&id("b"), Some(&b), FinishReason::Aborted, 0, &[]);
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
        let mut s = keyed(sched().config).unwrap();
        s.on_new_request(&id("good"), Some(&good));
        s.on_new_request(&id("forged"), Some(&forged));
        let t0 = Instant::now();
        s.build_connector_meta(t0);
        let beats = s.build_connector_meta(t0 + Duration::from_secs(5)).heartbeats;
        assert_eq!(beats.len(), 1);
        assert_eq!(beats[0].remote, RemoteCoordinates::at("prefill", "10.0.0.1", 5600));
    }

    #[test]
    fn the_alloc_check_counts_the_local_prefix() {
        let mut s = sched();
        // 3 blocks offered, 1 cached locally: at most 2 may load, from the second remote block.
        let mut p = decode_params(vec![10, 11, 12]);
        let e =
            s.update_state_after_alloc(&id("r"), 3 * BS, Some(&mut p), &[5, 6, 7], BS, 3 * BS).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        let meta = s.build_connector_meta(Instant::now());
        assert!(meta.reqs_to_recv[0].is_notify_only(), "the prefill engine is still told to free");
        let mut p = decode_params(vec![10, 11, 12]);
        s.update_state_after_alloc(&id("q"), 3 * BS, Some(&mut p), &[5], 2 * BS, BS).unwrap();
        let r = s.build_connector_meta(Instant::now()).reqs_to_recv.remove(0);
        assert_eq!((r.local_block_ids, r.remote_read_from), (vec![5], 2));
    }
}
