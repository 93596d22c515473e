//! [`MetadataExchange`]: how workers publish their handshake payload and fetch a peer's.

use async_trait::async_trait;
use std::fmt;
use std::time::Duration;

use crate::error::Result;
use crate::ids::EngineId;
use crate::params::Endpoint;

/// The peer worker whose handshake payload a fetch asks for: the worker of rank `rank` of engine
/// `engine_id`, and that rank's side channel when the params named the engine's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerLocator {
    /// The peer engine.
    pub engine_id: EngineId,
    /// The peer worker's rank: with equal TP sizes the fetching worker's own; otherwise each
    /// prefill rank that holds heads the worker reads, or that it releases (`kvx_core::tp`).
    pub rank: u32,
    /// The rank's side channel (the engine's base port plus `rank`); `None`: the params named
    /// none, and only an exchange that finds peers by id can fetch.
    pub endpoint: Option<Endpoint>,
}

/// Publishes this worker's handshake payload and fetches peers'. The default implementation is
/// the TCP side channel (kvx-net's `SideChannel`), which fetches from the locator's
/// endpoint; an exchange over a registry (kvx-etcd) finds peers by engine id and rank.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait MetadataExchange: Send + Sync + fmt::Debug {
    /// Serves `payload` to every peer that asks, from now on (replacing an earlier payload).
    async fn publish(&self, payload: Vec<u8>) -> Result<()>;

    /// Fetches the payload of the worker `peer` names, failing with `ErrorKind::Timeout` after
    /// `timeout` (an unreachable or silent peer never blocks longer), and with
    /// `ErrorKind::InvalidArgument` when the exchange needs an endpoint and `peer` has none.
    async fn fetch(&self, peer: &PeerLocator, timeout: Duration) -> Result<Vec<u8>>;
}
