//! What a [`SimEngine`](super::SimEngine) is made of and reports: its backend, configuration,
//! request states and counters.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use kvx_core::{
    AuthKey, Clock, EngineId, Error, FinishReason, MetadataExchange, RequestId, Result, SystemClock,
    TransferAgent,
};
use kvx_net::Handshakes;
use tokio::runtime::Handle;

use super::model::ModelSpec;
use super::side_channel::InProcessSideChannels;
use crate::conformance::TestBuffer;

type AgentFactory = dyn Fn(&EngineId, u32) -> Result<Arc<dyn TransferAgent>> + Send + Sync;
type MemoryFactory = dyn Fn(&EngineId, u32, usize) -> Result<TestBuffer> + Send + Sync;

/// What a simulated engine runs on: a transfer agent per (engine, rank), and the memory of each
/// layer's KV cache (host memory unless the backend supplies its own).
#[derive(Clone)]
pub struct SimBackend {
    agents: Arc<AgentFactory>,
    memory: Arc<MemoryFactory>,
}

impl SimBackend {
    /// A backend whose agents `agents(engine, rank)` creates, over host memory.
    pub fn new(
        agents: impl Fn(&EngineId, u32) -> Result<Arc<dyn TransferAgent>> + Send + Sync + 'static,
    ) -> Self {
        SimBackend {
            agents: Arc::new(agents),
            memory: Arc::new(|_: &EngineId, _, len| TestBuffer::host(len)),
        }
    }

    /// The same backend with the KV memory of `rank` of `engine`, `len` bytes a layer, allocated
    /// by `memory(engine, rank, len)` (transport-allocated or GPU memory, say). It is called after
    /// that rank's agent was created.
    pub fn with_memory(
        mut self,
        memory: impl Fn(&EngineId, u32, usize) -> Result<TestBuffer> + Send + Sync + 'static,
    ) -> Self {
        self.memory = Arc::new(memory);
        self
    }

    /// A new agent for `rank` of `engine`.
    pub fn agent(&self, engine: &EngineId, rank: u32) -> Result<Arc<dyn TransferAgent>> {
        (self.agents)(engine, rank)
    }

    /// `len` bytes of KV memory for `rank` of `engine`, of this backend's kind.
    pub fn memory(&self, engine: &EngineId, rank: u32, len: usize) -> Result<TestBuffer> {
        (self.memory)(engine, rank, len)
    }
}

impl fmt::Debug for SimBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimBackend").finish_non_exhaustive()
    }
}

type ExchangeFactory = dyn Fn(&EngineId, u32, &Handle) -> Result<Arc<dyn MetadataExchange>> + Send + Sync;

/// Creates the exchange of each rank of an engine that finds its peers by id.
#[derive(Clone)]
pub struct Exchanges(Arc<ExchangeFactory>);

impl Exchanges {
    /// Exchanges that `exchange(engine, rank, runtime)` creates; `runtime` is the engine's (it
    /// runs the driver's fetches and may run the exchange's background tasks).
    pub fn new(
        exchange: impl Fn(&EngineId, u32, &Handle) -> Result<Arc<dyn MetadataExchange>> + Send + Sync + 'static,
    ) -> Self {
        Exchanges(Arc::new(exchange))
    }

    /// The exchange of `rank` of `engine`.
    pub fn exchange(
        &self,
        engine: &EngineId,
        rank: u32,
        runtime: &Handle,
    ) -> Result<Arc<dyn MetadataExchange>> {
        (self.0)(engine, rank, runtime)
    }
}

impl fmt::Debug for Exchanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exchanges").finish_non_exhaustive()
    }
}

/// How an engine's ranks serve their handshake payloads.
#[derive(Debug, Clone)]
pub enum SideChannel {
    /// In-process (a registry shared by the engines of one test).
    InProcess(InProcessSideChannels),
    /// Real TCP side channels (`kvx_net::SideChannel`) on consecutive ports of `host`.
    Tcp {
        /// The host to bind (and to hand to decode engines, unless `advertise_host` is given).
        host: String,
        /// The port of rank 0 (rank r binds `port + r`); 0: free ports from the OS.
        port: u16,
        /// The host decode engines reach the side channels at, when it is not `host` (a host
        /// bound on every interface, `0.0.0.0`, is reached at one of its addresses).
        advertise_host: Option<String>,
    },
    /// Exchanges that find engines by id (over a registry such as etcd, kvx-etcd): the engine's
    /// params name no host or port, and its decode workers fetch peers by engine id and rank.
    ById(Exchanges),
}

/// Configuration of a [`SimEngine`](super::SimEngine).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The engine's id (unique among the engines that talk to each other).
    pub engine_id: EngineId,
    /// Tensor-parallel ranks.
    pub tp: u32,
    /// Blocks in the KV pool (of every rank).
    pub num_blocks: u32,
    /// The model.
    pub model: ModelSpec,
    /// The side channel.
    pub side_channel: SideChannel,
    /// The deployment's shared key: TCP side channels authenticate with it (and refuse peers
    /// without it), the scheduler signs its offers and the workers read only signed ones. `None`:
    /// no authentication.
    pub auth_key: Option<AuthKey>,
    /// Handshake timeout of the workers.
    pub handshake_timeout: Duration,
    /// The lease of a prefill engine's hold (renewed by the decode engine's heartbeats while its
    /// request waits for the KV).
    pub lease_duration: Duration,
    /// Where the workers take the time from: the system's, or a simulation's manual clock.
    pub clock: Arc<dyn Clock>,
    /// Where the workers' handshake fetches run: [`Handshakes::OnStepThread`] with an
    /// in-process side channel and a manual clock makes a run replay exactly.
    pub handshakes: Handshakes,
    /// The seed of the engine's random choices, its hold nonces and its instance id (the same
    /// seed, the same choices); `None`: the operating system's random source.
    pub seed: Option<u64>,
    /// What a request whose KV load failed does.
    pub load_failure: LoadFailurePolicy,
    /// In-process side channels only (TCP ones take theirs in [`SideChannel::Tcp`], exchanges by id
    /// have none): the base port
    /// to bind (a restarted engine takes its predecessor's); `None`: the next free one.
    pub side_channel_port: Option<u16>,
}

/// What a request whose remote KV load failed does (vLLM's `kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFailurePolicy {
    /// The request fails.
    #[default]
    Fail,
    /// The request computes its prompt locally instead.
    Recompute,
}

impl EngineConfig {
    /// A configuration with an in-process side channel and the usual timeouts (5 s handshake,
    /// 30 s lease), on the system clock, failing requests whose load failed.
    pub fn new(
        engine_id: &str,
        tp: u32,
        num_blocks: u32,
        model: ModelSpec,
        net: &InProcessSideChannels,
    ) -> Self {
        EngineConfig {
            engine_id: engine_id.into(),
            tp,
            num_blocks,
            model,
            side_channel: SideChannel::InProcess(net.clone()),
            auth_key: None,
            handshake_timeout: Duration::from_secs(5),
            lease_duration: Duration::from_secs(30),
            clock: Arc::new(SystemClock),
            handshakes: Handshakes::Background,
            seed: None,
            load_failure: LoadFailurePolicy::Fail,
            side_channel_port: None,
        }
    }
}

/// Where a request stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestState {
    /// Not yet scheduled (no blocks).
    Waiting,
    /// Blocks allocated; waiting for the workers to load its KV from a remote engine.
    WaitingForRemoteKv,
    /// Computing its prompt or generating tokens.
    Running,
    /// Finished (its blocks may still be held for a remote reader).
    Finished(FinishReason),
    /// Failed (its KV load failed, or its received KV was wrong), with the error that says why.
    Failed(Error),
}

/// A request that finished or failed, as [`SimEngine::take_ended`](super::SimEngine::take_ended)
/// hands it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedRequest {
    /// The request.
    pub id: RequestId,
    /// How it ended: [`RequestState::Finished`] or [`RequestState::Failed`].
    pub state: RequestState,
    /// Why its KV load failed, when it computed its prompt instead
    /// ([`LoadFailurePolicy::Recompute`]).
    pub load_failure: Option<Error>,
}

/// Counters of one engine.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Requests finished (any reason but failure).
    pub finished: u64,
    /// Requests failed.
    pub failed: u64,
    /// Requests whose KV load failed and that computed their prompt instead
    /// ([`LoadFailurePolicy::Recompute`]).
    pub recomputed: u64,
    /// Prompt tokens whose KV was loaded from a remote engine.
    pub tokens_loaded: u64,
    /// Prompt tokens found in the local prefix cache.
    pub tokens_cached: u64,
    /// Received blocks checked byte for byte, counted once per rank and region (a layer's K or V
    /// block on one rank).
    pub blocks_verified: u64,
    /// Bytes checked.
    pub bytes_verified: u64,
    /// Received blocks whose bytes were wrong.
    pub blocks_mismatched: u64,
    /// Block positions loaded from a remote engine, per KV-cache group (of a sliding-window group
    /// only those its window needs), counted once whatever the ranks, layers and regions.
    pub group_blocks_loaded: Vec<u64>,
    /// Blocks sliding-window groups gave back to the pool as their windows moved past them.
    pub blocks_dropped: u64,
}
