//! [`SimEngine`]: one inference engine (a scheduler and one worker per tensor-parallel rank) that
//! drives the connector exactly as a real engine does, step by step.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

use kvx_core::net::NetConfig;
use kvx_core::{
    BlockId, ConnectorMetadata, ConnectorScheduler, ConnectorWorker, EngineId, Error, ErrorKind,
    FinishReason, Finished, InProcessGroup, LayerCache, NonceSource, RemoteCoordinates, RequestId, Result,
    SchedulerConfig, TransferParams, WorkerConfig, WorkerDriver, WorkerStats, wire,
};

use super::config::{
    EndedRequest, EngineConfig, EngineStats, LoadFailurePolicy, RequestState, SideChannel, SimBackend,
};
use super::model;
use super::pool::{BlockHash, BlockPool, PoolError};
use super::side_channel::{BoundSideChannels, bind_tcp};
use crate::conformance::TestBuffer;

#[derive(Debug, Clone, Copy)]
struct Load {
    /// Index of the first loaded block in the request's blocks.
    first: usize,
    count: usize,
}

#[derive(Debug)]
struct Request {
    prompt_len: usize,
    max_new_tokens: usize,
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    /// Prefix hash at every token.
    prefixes: Vec<u64>,
    params: Option<TransferParams>,
    state: RequestState,
    blocks: Vec<BlockId>,
    /// Chained hashes of the full blocks computed so far (those in the prefix cache).
    block_hashes: Vec<BlockHash>,
    num_computed: usize,
    load: Option<Load>,
    /// Blocks marked in flight in the pool for this request.
    in_flight: Vec<BlockId>,
    /// Why its load failed, when it computes its prompt instead.
    load_failure: Option<Error>,
}

impl Request {
    fn push_token(&mut self, token: u32) {
        let prefix = model::prefix_hash(self.prefixes.last().copied(), token);
        self.tokens.push(token);
        self.prefixes.push(prefix);
    }
}

/// Blocks kept after their request finished, until the workers report them done.
#[derive(Debug)]
struct Delayed {
    blocks: Vec<BlockId>,
    in_flight: Vec<BlockId>,
}

#[derive(Debug)]
struct Rank {
    driver: WorkerDriver,
    layers: Vec<TestBuffer>,
}

/// A simulated inference engine: a paged block pool with a prefix cache, requests that wait,
/// load, run and finish, a [`ConnectorScheduler`], and per tensor-parallel rank a
/// [`WorkerDriver`] with its own transfer agent and KV memory.
///
/// Each [`step`](Self::step) calls the connector as an engine does: the scheduler calls for
/// waiting and finished requests, [`ConnectorScheduler::build_connector_meta`], the metadata to
/// every worker as bytes (as across a process boundary), the workers' `get_finished` (ranks N-1
/// to 1, then rank 0, whose bounded gather finds their reports), and the result back to the
/// scheduler. The "model" writes deterministic KV bytes (see [`ModelSpec::rows`](super::ModelSpec::rows)); every block a
/// load brings in is checked byte for byte when the load completes.
///
/// A request with `do_remote_decode` params stops after one token and hands back the params a
/// decode engine needs ([`take_transfer_params`](Self::take_transfer_params)); a request with
/// `do_remote_prefill` params loads its prompt's KV from the engine they name.
pub struct SimEngine {
    config: EngineConfig,
    scheduler: ConnectorScheduler,
    ranks: Vec<Rank>,
    pool: BlockPool,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    delayed: HashMap<RequestId, Delayed>,
    outputs: Vec<(RequestId, TransferParams)>,
    stats: EngineStats,
    errors: Vec<String>,
    side_channel_port: u16,
    /// Requests that finished or failed since [`take_ended`](Self::take_ended) last took them.
    ended: Vec<RequestId>,
    /// Runs the drivers' handshakes and the side channels; dropped last.
    _runtime: Runtime,
}

impl fmt::Debug for SimEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimEngine")
            .field("engine_id", &self.config.engine_id)
            .field("requests", &self.requests.len())
            .field("free_blocks", &self.pool.num_free())
            .finish_non_exhaustive()
    }
}

impl SimEngine {
    /// Starts an engine: binds its side channels, creates one agent and the KV memory per rank,
    /// and registers the caches (publishing each rank's handshake payload).
    pub fn new(config: EngineConfig, backend: &SimBackend) -> Result<Self> {
        let model = &config.model;
        model.check(config.tp)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(format!("{}-rt", config.engine_id))
            .enable_all()
            .build()?;
        let host = match &config.side_channel {
            SideChannel::InProcess(_) => "in-process".to_owned(),
            SideChannel::Tcp { host, .. } => host.clone(),
        };
        let BoundSideChannels { base_port, ranks: exchanges } =
            match (&config.side_channel, config.side_channel_port) {
                (SideChannel::InProcess(net), None) => net.bind(&host, config.tp)?,
                (SideChannel::InProcess(net), Some(base)) => net.bind_at(&host, base, config.tp)?,
                (SideChannel::Tcp { host, port }, None) => bind_tcp(
                    runtime.handle(),
                    host,
                    *port,
                    config.tp,
                    &NetConfig::with_key(config.auth_key.clone()),
                )?,
                (SideChannel::Tcp { .. }, Some(_)) => {
                    return Err(Error::invalid_argument(
                        "TCP side channels take their port in SideChannel::Tcp, not side_channel_port",
                    ));
                }
            };
        // One instance for the scheduler and the workers: the params name the one the workers
        // publish, so a decode engine never reads them through a connection to an earlier start.
        let instance = match config.seed {
            Some(seed) => model::mix(seed, 0x696e_7374_616e_6365),
            None => u64::from_le_bytes(kvx_core::auth::random_bytes()?),
        };
        let scheduler_config = SchedulerConfig {
            engine_id: config.engine_id.clone(),
            block_size: model.block_size,
            side_channel_host: host.clone(),
            side_channel_port: base_port,
            auth_key: config.auth_key.clone(),
            lease_duration: config.lease_duration,
            instance: Some(instance),
        };
        let scheduler = match config.seed {
            Some(seed) => {
                ConnectorScheduler::with_nonces(scheduler_config, NonceSource::from_seed(seed_bytes(seed)))
            }
            None => ConnectorScheduler::new(scheduler_config),
        }?;
        let own_side_channel =
            RemoteCoordinates { engine_id: config.engine_id.clone(), host, port: base_port };
        let groups = InProcessGroup::new_group(config.tp, Duration::from_secs(10));
        let shape = model.layer_shape(config.num_blocks, config.tp);
        let regions = model.kind().regions_per_layer() as usize;
        let layer_len = regions * config.num_blocks as usize * model.block_len(config.tp);
        let mut ranks = Vec::with_capacity(config.tp as usize);
        for ((rank, exchange), group) in (0..config.tp).zip(exchanges).zip(groups) {
            let agent = backend.agent(&config.engine_id, rank)?;
            let worker = ConnectorWorker::new(
                WorkerConfig {
                    compat_tag: model.compat_tag(),
                    handshake_timeout: config.handshake_timeout,
                    lease_duration: config.lease_duration,
                    side_channel: Some(own_side_channel.clone()),
                    instance: Some(instance),
                    auth_key: config.auth_key.clone(),
                    ..WorkerConfig::new(config.engine_id.clone(), rank, config.tp, model.block_size)
                },
                agent,
            )?;
            let layers = (0..model.num_layers())
                .map(|_| backend.memory(&config.engine_id, rank, layer_len))
                .collect::<Result<Vec<_>>>()?;
            let caches: Vec<LayerCache> = layers
                .iter()
                .zip(&model.windows)
                .map(|(buf, &window)| LayerCache {
                    memory: buf.memory(),
                    shape: shape.clone(),
                    elem_size: u64::from(model.elem_size),
                    window,
                })
                .collect();
            let mut driver = WorkerDriver::new(worker, exchange, group, runtime.handle().clone())
                .with_clock(config.clock.clone())
                .with_handshakes(config.handshakes);
            driver.register_kv_caches(&caches)?;
            ranks.push(Rank { driver, layers });
        }
        Ok(SimEngine {
            pool: BlockPool::new(config.num_blocks),
            config,
            scheduler,
            ranks,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            delayed: HashMap::new(),
            outputs: Vec::new(),
            stats: EngineStats::default(),
            errors: Vec::new(),
            side_channel_port: base_port,
            ended: Vec::new(),
            _runtime: runtime,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The engine's id.
    pub fn engine_id(&self) -> &EngineId {
        &self.config.engine_id
    }

    /// The base port of the engine's side channel.
    pub fn side_channel_port(&self) -> u16 {
        self.side_channel_port
    }

    /// The block pool.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Each rank's worker counters.
    pub fn worker_stats(&self) -> Vec<WorkerStats> {
        self.ranks.iter().map(|r| r.driver.worker().stats().clone()).collect()
    }

    /// What went wrong that is a bug, not a request's failure: wrong bytes received, a pool misuse,
    /// a scheduler error. Empty in a correct run.
    pub fn errors(&self) -> &[String] {
        &self.errors
    }

    /// Where a request stands (`None` for an unknown request).
    pub fn state(&self, id: &RequestId) -> Option<&RequestState> {
        self.requests.get(id).map(|r| &r.state)
    }

    /// The tokens a request generated so far.
    pub fn output_tokens(&self, id: &RequestId) -> Option<&[u32]> {
        self.requests.get(id).map(|r| &r.tokens[r.prompt_len..])
    }

    /// Params of finished `do_remote_decode` requests, for the router to hand to a decode engine.
    pub fn take_transfer_params(&mut self) -> Vec<(RequestId, TransferParams)> {
        std::mem::take(&mut self.outputs)
    }

    /// Whether nothing is waiting, running, held or in flight, in the engine, its scheduler and
    /// its workers.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty()
            && self.running.is_empty()
            && self.delayed.is_empty()
            && !self.requests.values().any(|r| r.state == RequestState::WaitingForRemoteKv)
            && self.scheduler.is_idle()
            && self.ranks.iter().all(|r| r.driver.is_idle())
    }

    /// What keeps the engine from being [idle](Self::is_idle), in words (empty when it is).
    pub fn not_idle_reasons(&self) -> Vec<String> {
        let loading = self.requests.values().filter(|r| r.state == RequestState::WaitingForRemoteKv).count();
        let mut out: Vec<String> = [
            ("requests waiting", self.waiting.len()),
            ("requests running", self.running.len()),
            ("requests loading", loading),
            ("finished requests keeping blocks", self.delayed.len()),
            ("loads the scheduler awaits", self.scheduler.num_recving()),
            ("holds the scheduler awaits", self.scheduler.num_sending()),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(what, n)| format!("{n} {what}"))
        .collect();
        for (rank, r) in self.ranks.iter().enumerate() {
            let (worker, partial) = (r.driver.worker(), r.driver.num_partial_reports());
            if !worker.is_idle() {
                let timers =
                    if worker.next_deadline().is_some() { ", holds or handshakes pending" } else { "" };
                out.push(format!("rank {rank}: {} READs in flight{timers}", worker.num_in_flight()));
            }
            if partial > 0 {
                out.push(format!("rank {rank}: {partial} ids reported by some ranks only"));
            }
        }
        out
    }

    /// Whether the engine has work for its next step: requests waiting, running or loading, or
    /// READs in flight. An engine that is not busy only waits for time to pass (holds, handshakes,
    /// early releases: see [`next_deadline`](Self::next_deadline)).
    pub fn is_busy(&self) -> bool {
        !self.waiting.is_empty()
            || !self.running.is_empty()
            || self.requests.values().any(|r| r.state == RequestState::WaitingForRemoteKv)
            || self.ranks.iter().any(|r| r.driver.worker().num_in_flight() > 0)
    }

    /// The earliest time at which a worker has something to expire (a hold, a handshake, an early
    /// release), for simulations that jump their clock to it.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.ranks.iter().filter_map(|r| r.driver.worker().next_deadline()).min()
    }

    /// The requests that finished or failed since the last call, in the order they ended; the
    /// engine forgets them (a long run keeps no more than its live requests).
    pub fn take_ended(&mut self) -> Vec<EndedRequest> {
        let mut out = Vec::with_capacity(self.ended.len());
        for id in std::mem::take(&mut self.ended) {
            if let Some(r) = self.requests.remove(&id) {
                out.push(EndedRequest { id, state: r.state, load_failure: r.load_failure });
            }
        }
        out
    }

    /// Adds a request: a non-empty prompt and the tokens to generate (at least 1).
    pub fn add_request(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        max_new_tokens: usize,
        params: Option<TransferParams>,
    ) -> Result<()> {
        if prompt.is_empty() || max_new_tokens == 0 {
            return Err(Error::invalid_argument(format!(
                "request {id}: empty prompt or no tokens to generate"
            )));
        }
        if self.requests.contains_key(&id) {
            return Err(Error::invalid_argument(format!("request {id} already exists")));
        }
        let mut req = Request {
            prompt_len: prompt.len(),
            max_new_tokens,
            tokens: Vec::with_capacity(prompt.len() + max_new_tokens),
            prefixes: Vec::with_capacity(prompt.len() + max_new_tokens),
            params,
            state: RequestState::Waiting,
            blocks: Vec::new(),
            block_hashes: Vec::new(),
            num_computed: 0,
            load: None,
            in_flight: Vec::new(),
            load_failure: None,
        };
        for &t in prompt {
            req.push_token(t);
        }
        self.scheduler.on_new_request(&id, req.params.as_ref());
        self.requests.insert(id.clone(), req);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Aborts a request (as a client disconnect does). Blocks a READ is still writing stay
    /// allocated until the workers report the load ended.
    pub fn abort(&mut self, id: &RequestId) {
        let Some(state) = self.state(id).cloned() else { return };
        match state {
            RequestState::Waiting => {
                self.waiting.retain(|w| w != id);
                self.finish(id, FinishReason::Aborted);
            }
            RequestState::WaitingForRemoteKv | RequestState::Running => {
                self.finish(id, FinishReason::Aborted)
            }
            RequestState::Finished(_) | RequestState::Failed(_) => {}
        }
    }

    /// One engine step.
    pub fn step(&mut self) -> Result<()> {
        self.stats.steps += 1;
        self.schedule_waiting();
        self.run_model();
        let meta = self.scheduler.build_connector_meta(self.config.clock.now());
        for recv in &meta.reqs_to_recv {
            if recv.local_block_ids.is_empty() {
                continue;
            }
            match self.pool.begin_transfer(&recv.local_block_ids) {
                Ok(()) => {
                    if let Some(r) = self.requests.get_mut(&recv.request_id) {
                        r.in_flight = recv.local_block_ids.clone();
                    }
                }
                Err(e) => {
                    self.error(format!("request {}: load targets unusable blocks: {e}", recv.request_id))
                }
            }
        }
        let bytes = wire::encode(&meta)?;
        for rank in &mut self.ranks {
            let meta: ConnectorMetadata = wire::decode(&bytes)?;
            rank.driver.start_load_kv(&meta);
        }
        let mut finished = Finished::default();
        for rank in self.ranks.iter_mut().rev() {
            finished = rank.driver.get_finished()?;
        }
        self.scheduler.update_finished(&finished);
        self.handle_finished(finished);
        Ok(())
    }

    fn error(&mut self, msg: String) {
        tracing::error!(engine = %self.config.engine_id, "{msg}");
        self.errors.push(msg);
    }

    fn pool_result(&mut self, what: &str, id: &RequestId, r: Result<(), PoolError>) {
        if let Err(e) = r {
            self.error(format!("{what} of request {id}: {e}"));
        }
    }

    /// Admits waiting requests in arrival order while their blocks fit.
    fn schedule_waiting(&mut self) {
        let bs = self.config.model.block_size as usize;
        while let Some(id) = self.waiting.front().cloned() {
            let Some(r) = self.requests.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let hashes = full_block_hashes(&r.tokens[..r.prompt_len], bs);
            // At least one prompt token is always computed, so the last one yields logits.
            let hit = self.pool.lookup(&hashes[..hashes.len().min((r.prompt_len - 1) / bs)]);
            let total = (r.prompt_len + r.max_new_tokens).div_ceil(bs);
            let new = total - hit.len();
            if self.pool.num_free() < new + hit.len() {
                break;
            }
            self.waiting.pop_front();
            if let Err(e) = self.admit(&id, hit, new, hashes) {
                self.error(format!("admitting request {id}: {e}"));
                self.fail(&id, e);
            }
        }
    }

    fn admit(&mut self, id: &RequestId, hit: Vec<BlockId>, new: usize, hashes: Vec<BlockHash>) -> Result<()> {
        let bs = self.config.model.block_size as usize;
        let Some(r) = self.requests.get_mut(id) else { return Ok(()) };
        let computed = hit.len() * bs;
        let matched =
            self.scheduler.get_num_new_matched_tokens(id, r.prompt_len, r.params.as_ref(), computed)?;
        let pool_err = |e: PoolError| Error::new(ErrorKind::State, e.to_string());
        self.pool.touch(&hit).map_err(pool_err)?;
        r.block_hashes = hashes[..hit.len()].to_vec();
        r.blocks = hit;
        let new_blocks = self.pool.allocate(new).map_err(pool_err)?;
        r.blocks.extend_from_slice(&new_blocks);
        r.num_computed = computed;
        self.stats.tokens_cached += computed as u64;
        self.scheduler.update_state_after_alloc(
            id,
            r.prompt_len,
            r.params.as_mut(),
            &new_blocks,
            computed,
            matched.count,
        )?;
        if matched.load_async && matched.count > 0 {
            r.load = Some(Load { first: r.block_hashes.len(), count: matched.count / bs });
            r.state = RequestState::WaitingForRemoteKv;
        } else {
            r.state = RequestState::Running;
            self.running.push(id.clone());
        }
        Ok(())
    }

    /// One forward pass: each running request computes its prompt (the part not cached or
    /// loaded) or its latest token, and samples the next token.
    fn run_model(&mut self) {
        let mut done = Vec::new();
        for id in &self.running {
            let Some(r) = self.requests.get_mut(id) else { continue };
            let end = if r.num_computed < r.prompt_len { r.prompt_len } else { r.num_computed + 1 };
            if let Err(e) = write_kv(&self.ranks, &self.config, r, r.num_computed, end) {
                self.errors.push(format!("request {id}: writing KV: {e}"));
            }
            r.num_computed = end;
            let token = model::next_token(r.prefixes[end - 1]);
            r.push_token(token);
            let bs = self.config.model.block_size as usize;
            while (r.block_hashes.len() + 1) * bs <= r.num_computed {
                let i = r.block_hashes.len();
                let h = model::block_hash(r.block_hashes.last().copied(), &r.tokens[i * bs..(i + 1) * bs]);
                r.block_hashes.push(h);
                if let Err(e) = self.pool.cache(r.blocks[i], h) {
                    self.errors.push(format!("request {id}: caching block {i}: {e}"));
                }
            }
            if r.tokens.len() - r.prompt_len >= r.max_new_tokens {
                done.push(id.clone());
            }
        }
        for id in done {
            self.finish(&id, FinishReason::LengthCapped);
        }
    }

    /// Ends a request: tells the scheduler, hands back its params, frees or keeps its blocks.
    fn finish(&mut self, id: &RequestId, reason: FinishReason) {
        let Some(r) = self.requests.get_mut(id) else { return };
        self.running.retain(|x| x != id);
        r.state = match reason {
            FinishReason::Error => r.state.clone(),
            other => RequestState::Finished(other),
        };
        if reason == FinishReason::Error {
            self.stats.failed += 1;
        } else {
            self.stats.finished += 1;
        }
        self.ended.push(id.clone());
        let outcome =
            self.scheduler.request_finished(id, r.params.as_ref(), reason, r.num_computed, &r.blocks);
        let blocks = std::mem::take(&mut r.blocks);
        let mut in_flight = std::mem::take(&mut r.in_flight);
        if let Some(params) = outcome.params {
            if outcome.delay_free {
                // Held for the reader: exactly the blocks the params offer.
                in_flight = params.remote_blocks().to_vec();
                let held = self.pool.begin_transfer(&in_flight);
                self.pool_result("holding the blocks", id, held);
            }
            self.outputs.push((id.clone(), params));
        }
        if outcome.delay_free {
            self.delayed.insert(id.clone(), Delayed { blocks, in_flight });
        } else {
            let freed = self.pool.free(&blocks);
            self.pool_result("freeing the blocks", id, freed);
        }
    }

    fn fail(&mut self, id: &RequestId, error: Error) {
        if let Some(r) = self.requests.get_mut(id) {
            r.state = RequestState::Failed(error);
        }
        self.finish(id, FinishReason::Error);
    }

    /// Releases blocks of requests whose transfers ended; starts or fails loaded requests.
    fn handle_finished(&mut self, mut finished: Finished) {
        // In id order: the workers' reports come in hash-map order, and the order blocks go back
        // to the pool decides which blocks later requests get (a run must replay exactly).
        finished.sending.sort();
        finished.recving.sort();
        finished.failed_recving.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        for id in finished.sending {
            self.release_delayed(&id, "a finished send");
        }
        let failed = finished.failed_recving.into_iter().map(|f| (f.request_id, Some(f.error)));
        for (id, failure) in finished.recving.into_iter().map(|id| (id, None)).chain(failed) {
            if self.delayed.contains_key(&id) {
                // Aborted while its READ was in flight: only now may its blocks go.
                self.release_delayed(&id, "a finished load");
                continue;
            }
            let Some(r) = self.requests.get_mut(&id) else {
                self.error(format!("load of unknown request {id} finished"));
                continue;
            };
            if r.state != RequestState::WaitingForRemoteKv {
                let state = r.state.clone();
                self.error(format!("load of request {id} finished in state {state:?}"));
                continue;
            }
            let in_flight = std::mem::take(&mut r.in_flight);
            let ended = self.pool.end_transfer(&in_flight);
            self.pool_result("ending the load", &id, ended);
            match failure {
                Some(error) if self.config.load_failure == LoadFailurePolicy::Recompute => {
                    self.recompute(&id, error)
                }
                Some(error) => self.fail(&id, error),
                None => self.complete_load(&id),
            }
        }
    }

    /// A load failed: the request computes its prompt itself, from what its prefix cache held,
    /// into the blocks the load was to fill.
    fn recompute(&mut self, id: &RequestId, error: Error) {
        let Some(r) = self.requests.get_mut(id) else { return };
        r.load = None;
        r.load_failure = Some(error);
        r.state = RequestState::Running;
        self.stats.recomputed += 1;
        self.running.push(id.clone());
    }

    fn release_delayed(&mut self, id: &RequestId, what: &str) {
        let Some(d) = self.delayed.remove(id) else {
            self.error(format!("{what} names request {id}, which holds no blocks"));
            return;
        };
        let ended = self.pool.end_transfer(&d.in_flight);
        self.pool_result("ending the transfer", id, ended);
        let freed = self.pool.free(&d.blocks);
        self.pool_result("freeing the blocks", id, freed);
    }

    /// A load completed: checks every received byte, caches the blocks and lets the request run.
    fn complete_load(&mut self, id: &RequestId) {
        let bs = self.config.model.block_size as usize;
        let Some(r) = self.requests.get(id) else { return };
        let checked = verify_load(&self.ranks, &self.config, r);
        self.stats.blocks_verified += checked.blocks;
        self.stats.bytes_verified += checked.bytes;
        let mismatches = checked.wrong;
        if !mismatches.is_empty() {
            self.stats.blocks_mismatched += mismatches.len() as u64;
            let first = mismatches[0].clone();
            self.error(format!(
                "request {id}: {} received blocks are wrong, first: {first}",
                mismatches.len()
            ));
            self.fail(id, Error::new(ErrorKind::Transfer, format!("received KV is wrong: {first}")));
            return;
        }
        let Some(r) = self.requests.get_mut(id) else { return };
        let Some(load) = r.load else { return };
        self.stats.tokens_loaded += (load.count * bs) as u64;
        let loaded_end = load.first + load.count;
        for i in r.block_hashes.len()..loaded_end {
            let h = model::block_hash(r.block_hashes.last().copied(), &r.tokens[i * bs..(i + 1) * bs]);
            r.block_hashes.push(h);
            if let Err(e) = self.pool.cache(r.blocks[i], h) {
                self.errors.push(format!("request {id}: caching loaded block {i}: {e}"));
            }
        }
        // As vLLM does: with the whole prompt in place, the last prompt token is computed again
        // to produce the first output token.
        r.num_computed = (loaded_end * bs).min(r.prompt_len - 1);
        r.state = RequestState::Running;
        self.running.push(id.clone());
    }
}

#[derive(Debug, Default)]
struct Verified {
    blocks: u64,
    bytes: u64,
    /// A description of each wrong block.
    wrong: Vec<String>,
}

/// Compares every block the load brought in (for windowed layers, only their last `window`
/// loaded blocks) with what the model computes.
fn verify_load(ranks: &[Rank], config: &EngineConfig, r: &Request) -> Verified {
    let mut out = Verified::default();
    let Some(load) = r.load else { return out };
    let model = &config.model;
    let (bs, tp) = (model.block_size as usize, config.tp);
    let block_len = model.block_len(tp);
    let regions = model.kind().regions_per_layer();
    let region_len = config.num_blocks as usize * block_len;
    let mut expected = Vec::with_capacity(block_len);
    let mut actual = vec![0u8; block_len];
    for (rank, ranked) in ranks.iter().enumerate() {
        for (layer, buf) in ranked.layers.iter().enumerate() {
            let skip = model.windows[layer].map_or(0, |w| load.count.saturating_sub(w as usize));
            for i in load.first + skip..load.first + load.count {
                let block = r.blocks[i] as usize;
                for region in 0..regions {
                    expected.clear();
                    model.rows(
                        &r.prefixes[i * bs..(i + 1) * bs],
                        layer,
                        region,
                        rank as u32,
                        tp,
                        &mut expected,
                    );
                    let offset = region as usize * region_len + block * block_len;
                    let read = buf.read(offset, &mut actual);
                    out.blocks += 1;
                    out.bytes += block_len as u64;
                    if read.is_err() || actual != expected {
                        out.wrong.push(format!(
                            "rank {rank} layer {layer} region {region} block {i} (id {block})"
                        ));
                    }
                }
            }
        }
    }
    out
}

/// Writes the KV of positions `from..to` of `r` into its blocks, on every rank, layer and region.
fn write_kv(ranks: &[Rank], config: &EngineConfig, r: &Request, from: usize, to: usize) -> Result<()> {
    let model = &config.model;
    let (bs, tp) = (model.block_size as usize, config.tp);
    let (row_len, block_len) = (model.row_len(tp), model.block_len(tp));
    let region_len = config.num_blocks as usize * block_len;
    let mut rows = Vec::new();
    let mut pos = from;
    while pos < to {
        let (i, slot) = (pos / bs, pos % bs);
        let end = to.min((i + 1) * bs);
        let block = *r
            .blocks
            .get(i)
            .ok_or_else(|| Error::new(ErrorKind::State, "position beyond the request's blocks"))?;
        for (rank, ranked) in ranks.iter().enumerate() {
            for (layer, buf) in ranked.layers.iter().enumerate() {
                for region in 0..model.kind().regions_per_layer() {
                    rows.clear();
                    model.rows(&r.prefixes[pos..end], layer, region, rank as u32, tp, &mut rows);
                    let offset = region as usize * region_len + block as usize * block_len + slot * row_len;
                    buf.write(offset, &rows)?;
                }
            }
        }
        pos = end;
    }
    Ok(())
}

/// The 32-byte nonce seed of a 64-bit one.
fn seed_bytes(seed: u64) -> [u8; 32] {
    let mut bytes = [0u8; 32];
    for (i, chunk) in bytes.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&model::mix(seed, i as u64).to_le_bytes());
    }
    bytes
}

/// Chained hashes of the full blocks of `tokens`.
fn full_block_hashes(tokens: &[u32], bs: usize) -> Vec<BlockHash> {
    let mut out: Vec<BlockHash> = Vec::with_capacity(tokens.len() / bs);
    for chunk in tokens.chunks_exact(bs) {
        out.push(model::block_hash(out.last().copied(), chunk));
    }
    out
}
