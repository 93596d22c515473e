//! [`MetadataExchange`]: how workers publish their handshake payload and fetch a peer's.

use async_trait::async_trait;
use std::fmt;
use std::time::Duration;

use crate::error::Result;

/// Publishes this worker's handshake payload and fetches peers'. The default implementation is
/// the TCP side channel (`net::SideChannel`, feature `net`).
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait MetadataExchange: Send + Sync + fmt::Debug {
    /// Serves `payload` to every peer that asks, from now on (replacing an earlier payload).
    async fn publish(&self, payload: Vec<u8>) -> Result<()>;

    /// Fetches the payload served at `host:port`, failing with `ErrorKind::Timeout` after
    /// `timeout` (an unreachable or silent peer never blocks longer).
    async fn fetch(&self, host: &str, port: u16, timeout: Duration) -> Result<Vec<u8>>;
}
