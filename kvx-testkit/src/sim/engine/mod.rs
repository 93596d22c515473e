//! [`SimEngine`]: one inference engine (a scheduler and one worker per tensor-parallel rank) that
//! drives the connector exactly as a real engine does, step by step.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

use kvx_core::{
    BlockId, ConnectorMetadata, ConnectorScheduler, ConnectorWorker, Endpoint, EngineId, Error, FinishReason,
    Finished, GroupBlocks, InProcessGroup, LayerCache, NonceSource, RemoteCoordinates, RequestId, Result,
    SchedulerConfig, TransferParams, WorkerConfig, WorkerStats, wire,
};
use kvx_net::WorkerDriver;
use kvx_net::{NetConfig, ServerStats};

use super::config::{EndedRequest, EngineConfig, EngineStats, RequestState, SideChannel, SimBackend};
use super::model;
use super::pool::{BlockHash, BlockPool};
use super::side_channel::{BoundSideChannels, bind_tcp};
use crate::conformance::TestBuffer;

mod kv;
mod schedule;

use kv::*;

/// The block positions a load fills (of a sliding-window group, only those in its blocks).
#[derive(Debug, Clone, Copy)]
struct Load {
    /// The first loaded block position.
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
    /// Its blocks in each KV-cache group, by block position: a sliding-window group has none
    /// before its window (vLLM's null blocks).
    groups: Vec<GroupBlocks>,
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
/// scheduler. The "model" writes deterministic KV bytes (see [`ModelSpec::fill_block`](super::ModelSpec::fill_block)); every block a
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
    /// Where decode engines find this engine: its id and side channel.
    coordinates: RemoteCoordinates,
    /// The instance its scheduler and workers name.
    instance: u64,
    /// Each rank's side channel, over TCP (empty in-process).
    tcp_side_channels: Vec<Arc<kvx_net::SideChannel>>,
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
            SideChannel::InProcess(_) => "in-process",
            SideChannel::Tcp { host, advertise_host, .. } => advertise_host.as_deref().unwrap_or(host),
            SideChannel::ById(_) => "",
        };
        let bound = match (&config.side_channel, config.side_channel_port) {
            (SideChannel::InProcess(net), None) => net.bind(host, config.tp)?,
            (SideChannel::InProcess(net), Some(base)) => net.bind_at(host, base, config.tp)?,
            (SideChannel::Tcp { host, port, .. }, None) => bind_tcp(
                runtime.handle(),
                host,
                *port,
                config.tp,
                &NetConfig::with_key(config.auth_key.clone()),
            )?,
            (SideChannel::ById(exchanges), None) => BoundSideChannels {
                base_port: 0,
                ranks: (0..config.tp)
                    .map(|rank| exchanges.exchange(&config.engine_id, rank, runtime.handle()))
                    .collect::<Result<_>>()?,
                tcp: Vec::new(),
            },
            (SideChannel::Tcp { .. } | SideChannel::ById(_), Some(_)) => {
                return Err(Error::invalid_argument(
                    "only in-process side channels take side_channel_port (TCP ones take theirs in \
                     SideChannel::Tcp, exchanges by id have none)",
                ));
            }
        };
        // Exchanges by id hand out no endpoint: decode engines find this one by its id.
        let endpoint = match config.side_channel {
            SideChannel::ById(_) => None,
            _ => Some(Endpoint::new(host, bound.base_port)),
        };
        let BoundSideChannels { base_port, ranks: exchanges, tcp } = bound;
        // One instance for the scheduler and the workers: the params name the one the workers
        // publish, so a decode engine never reads them through a connection to an earlier start.
        let instance = match config.seed {
            Some(seed) => model::mix(seed, 0x696e_7374_616e_6365),
            None => u64::from_le_bytes(kvx_core::auth::random_bytes()?),
        };
        let scheduler_config = SchedulerConfig {
            auth_key: config.auth_key.clone(),
            lease_duration: config.lease_duration,
            instance: Some(instance),
            tp_size: config.tp,
            group_windows: model.groups.clone(),
            ..SchedulerConfig::new(config.engine_id.clone(), model.block_size, endpoint.clone())
        };
        let scheduler = match config.seed {
            Some(seed) => {
                ConnectorScheduler::with_nonces(scheduler_config, NonceSource::from_seed(seed_bytes(seed)))
            }
            None => ConnectorScheduler::new(scheduler_config),
        }?;
        let own_side_channel = RemoteCoordinates { engine_id: config.engine_id.clone(), endpoint };
        let groups = InProcessGroup::new_group(config.tp, Duration::from_secs(10));
        let shape = model.layer_shape(config.num_blocks, config.tp);
        let regions = model.kind().regions_per_layer() as usize;
        let layer_len = regions * config.num_blocks as usize * model.block_len(config.tp);
        let mut ranks = Vec::with_capacity(config.tp as usize);
        for ((rank, exchange), group) in (0..config.tp).zip(exchanges).zip(groups) {
            let agent = backend.agent(&config.engine_id, rank)?;
            let worker_config = WorkerConfig {
                compat_tag: model.compat_tag(),
                handshake_timeout: config.handshake_timeout,
                lease_duration: config.lease_duration,
                side_channel: Some(own_side_channel.clone()),
                instance: Some(instance),
                auth_key: config.auth_key.clone(),
                kv_heads: Some(model.kv_heads()),
                ..WorkerConfig::new(config.engine_id.clone(), rank, config.tp, model.block_size)
            };
            // Seeded, each rank's tokens are a stream of their own, apart from the scheduler's.
            let worker = match config.seed {
                Some(seed) => ConnectorWorker::with_nonces(
                    worker_config,
                    agent,
                    NonceSource::from_seed(seed_bytes(model::mix(seed, 1 + u64::from(rank)))),
                ),
                None => ConnectorWorker::new(worker_config, agent),
            }?;
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
        let stats = EngineStats { group_blocks_loaded: vec![0; model.groups.len()], ..Default::default() };
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
            stats,
            errors: Vec::new(),
            side_channel_port: base_port,
            coordinates: own_side_channel,
            instance,
            tcp_side_channels: tcp,
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

    /// Where other engines find this one: its id, and its side channel unless found by id (what
    /// a router hands a decode engine for a push to this engine).
    pub fn coordinates(&self) -> &RemoteCoordinates {
        &self.coordinates
    }

    /// The params a router hands a decode engine to push request `id` from this engine (its
    /// coordinates, tensor-parallel size and instance), as it sends this engine the prompt.
    pub fn push_params(&self, id: &RequestId) -> TransferParams {
        let mut params = TransferParams::for_push(self.coordinates.clone(), id.clone(), Some(self.config.tp));
        params.kvx_instance = Some(kvx_core::HexBytes(self.instance.to_le_bytes()));
        params
    }

    /// The base port of the engine's side channel (0 with [`SideChannel::ById`]).
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

    /// Each rank's worker, in rank order.
    pub fn workers(&self) -> impl Iterator<Item = &ConnectorWorker> {
        self.ranks.iter().map(|r| r.driver.worker())
    }

    /// Each rank's side-channel server counters, in rank order, over TCP; empty in-process.
    pub fn side_channel_stats(&self) -> impl Iterator<Item = ServerStats> + '_ {
        self.tcp_side_channels.iter().map(|s| s.stats())
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
            groups: Vec::new(),
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
        for recv in meta.reqs_to_recv.iter().chain(&meta.reqs_to_register) {
            if recv.is_notify_only() {
                continue;
            }
            let local: Vec<BlockId> =
                recv.local_block_ids.iter().flat_map(|g| g.ids.iter().copied()).collect();
            match self.pool.begin_transfer(&local) {
                Ok(()) => {
                    if let Some(r) = self.requests.get_mut(&recv.request_id) {
                        r.in_flight = local;
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
}
