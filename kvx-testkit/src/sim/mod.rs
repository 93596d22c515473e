//! The engine simulator: [`SimEngine`] drives the connector exactly as an inference engine does,
//! over any [`TransferAgent`](kvx_core::TransferAgent) backend, and checks every byte it receives.
//!
//! - [`BlockPool`]: paged KV blocks with a prefix cache, reference counts, LRU reuse, and checks
//!   that nothing leaks ([`BlockPool::is_whole`]) and nothing still needed is freed.
//! - [`ModelSpec`]: the KV shape (standard attention token- or head-major, split or replicated
//!   over the ranks, or MLA; chunked local-attention windows per layer, or KV-cache groups of
//!   sliding windows and full attention as vLLM's hybrid allocator keeps them) and the
//!   deterministic bytes the "model" writes, per rank of any tensor-parallel size.
//! - [`SimEngine`]: requests that wait, load remote KV, run and finish; a scheduler, and per
//!   tensor-parallel rank a worker with its own agent and KV memory.
//! - [`Cluster`]: prefill engines, decode engines and the router between them, on the system
//!   clock or in simulated time ([`SimTime`]).
//! - Side channels: [`InProcessSideChannels`] for in-process tests, or real TCP ones
//!   ([`SideChannel::Tcp`]).

mod cluster;
mod config;
mod engine;
#[cfg(feature = "metrics")]
mod metrics;
mod model;
mod pool;
mod rng;
mod side_channel;

pub use cluster::{ClientHook, ClientRequest, Cluster, NextEvent, SimTime};
pub use config::{
    EndedRequest, EngineConfig, EngineStats, Exchanges, LoadFailurePolicy, RequestState, SideChannel,
    SimBackend,
};
pub use engine::SimEngine;
#[cfg(feature = "metrics")]
pub use metrics::EngineMetrics;
pub(crate) use model::mix;
pub use model::{HeadLayout, KvShape, ModelSpec, VOCAB};
pub use pool::{BlockHash, BlockPool, PoolError};
pub use rng::SimRng;
pub use side_channel::{
    BoundSideChannels, HandshakeFaultCounts, HandshakeFaults, InProcessSideChannels, bind_tcp,
};
