//! [`SideChannel`]: a worker's handshake payload, served on a TCP port and fetched from peers'.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::server::{Caller, Server, ServerStats, Service};
use crate::session::Connection;
use crate::{NetConfig, endpoint};
use kvx_core::error::{Error, ErrorKind, Result};
use kvx_core::exchange::{MetadataExchange, PeerLocator};
use kvx_core::params::Endpoint;
use kvx_core::wire::{self, MessageKind, WireMessage};

/// Room in a reply frame for the envelopes around a payload.
const FRAME_HEADROOM: usize = 1024;
/// The first pause before a fetch dropped unanswered is sent again; it doubles up to
/// [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(1);
const RETRY_MAX: Duration = Duration::from_millis(50);

/// A client's request for the published payload: the body of the session request a
/// [`SideChannel`] fetch sends (`wire::encode(&MetadataRequest {})`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetadataRequest {}

impl WireMessage for MetadataRequest {
    const KIND: MessageKind = MessageKind::MetadataRequest;
}

type Slot = Arc<RwLock<Option<Vec<u8>>>>;

struct Publisher {
    payload: Slot,
}

#[async_trait]
impl Service for Publisher {
    async fn call(&self, _caller: &Caller, request: Vec<u8>) -> Result<Vec<u8>> {
        wire::decode::<MetadataRequest>(&request)?;
        let slot = self.payload.read().map_err(|_| Error::new(ErrorKind::State, "payload lock poisoned"))?;
        slot.clone().ok_or_else(|| Error::new(ErrorKind::Handshake, "no metadata published yet"))
    }
}

/// The largest payload a side channel with `config` publishes: its frame limit less room for the
/// envelopes around the payload.
pub fn max_payload(config: &NetConfig) -> usize {
    config.limits.max_frame.saturating_sub(FRAME_HEADROOM)
}

/// A worker's side channel over kvx's bounded framing ([`crate::server`]): serves the published
/// payload to every peer that asks, and fetches peers' payloads, one connection per fetch, with
/// the same limits and key; a fetch the server drops unanswered (evicted to make room) is sent
/// again on a new connection until its timeout. Needs a tokio runtime that keeps running (multi-threaded) to serve.
pub struct SideChannel {
    server: Server,
    payload: Slot,
    config: NetConfig,
}

impl fmt::Debug for SideChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SideChannel").field("port", &self.port()).finish_non_exhaustive()
    }
}

impl SideChannel {
    /// Binds `host:port` (port 0: a free port) with the default limits and no key. A port in use
    /// is an `Io` error, at once.
    pub async fn bind(host: &str, port: u16) -> Result<Self> {
        Self::bind_with(host, port, NetConfig::default()).await
    }

    /// Binds `host:port` with `config`'s limits and key (used for serving and for fetching).
    pub async fn bind_with(host: &str, port: u16, config: NetConfig) -> Result<Self> {
        let payload = Slot::default();
        let publisher = Publisher { payload: Arc::clone(&payload) };
        let server = Server::bind("side channel", host, port, &config, publisher).await?;
        Ok(SideChannel { server, payload, config })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.server.port()
    }

    /// The server (its counters, for monitoring and tests).
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// The server's counters now.
    pub fn stats(&self) -> ServerStats {
        self.server.stats()
    }
}

#[async_trait]
impl MetadataExchange for SideChannel {
    async fn publish(&self, payload: Vec<u8>) -> Result<()> {
        let max = max_payload(&self.config);
        if payload.len() > max {
            return Err(Error::invalid_argument(format!(
                "a payload of {} bytes is over the side channel's frame limit ({max} bytes)",
                payload.len()
            )));
        }
        let mut slot =
            self.payload.write().map_err(|_| Error::new(ErrorKind::State, "payload lock poisoned"))?;
        *slot = Some(payload);
        Ok(())
    }

    async fn fetch(&self, peer: &PeerLocator, timeout: Duration) -> Result<Vec<u8>> {
        let Some(Endpoint { host, port }) = &peer.endpoint else {
            return Err(Error::invalid_argument(format!(
                "the TCP side channel fetches from a host and port, and none was given for engine {} \
                 (params without remote_host and remote_port need an exchange that finds engines by id)",
                kvx_core::error::quote(peer.engine_id.as_str())
            )));
        };
        let (host, port) = (host.as_str(), *port);
        let request = wire::encode(&MetadataRequest {})?;
        // A server making room evicts connections that have not been served yet; a fetch is safe
        // to repeat, so it connects again (after a short, growing pause) until its timeout.
        let fetch = async {
            let mut pause = RETRY_FIRST;
            loop {
                let mut conn = Connection::connect(host, port, &self.config).await?;
                match conn.request(request.clone()).await {
                    Err(e) if Connection::dropped_unanswered(&e) => {
                        tracing::debug!(error = %e, "side channel dropped the fetch unanswered; again");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(RETRY_MAX);
                    }
                    result => return result,
                }
            }
        };
        match tokio::time::timeout(timeout, fetch).await {
            Ok(result) => result,
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                format!("no metadata from {} within {timeout:?}", endpoint(host, port)),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::auth::AuthKey;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
    }

    const T: Duration = Duration::from_secs(5);

    /// The worker served at `127.0.0.1:port`.
    fn at(port: u16) -> PeerLocator {
        PeerLocator { engine_id: "peer".into(), rank: 0, endpoint: Some(Endpoint::new("127.0.0.1", port)) }
    }

    #[test]
    fn fetch_returns_the_published_payload() {
        runtime().block_on(async {
            let server = SideChannel::bind("127.0.0.1", 0).await.unwrap();
            let e = server.fetch(&at(server.port()), T).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Handshake, "nothing published yet: {e}");
            assert!(e.to_string().contains("no metadata published yet"), "{e}");
            server.publish(b"payload-1".to_vec()).await.unwrap();
            let client = SideChannel::bind("127.0.0.1", 0).await.unwrap();
            for _ in 0..3 {
                assert_eq!(client.fetch(&at(server.port()), T).await.unwrap(), b"payload-1");
            }
            let s = server.server().wait_for_stats(|s| s.active == 0, T).await.unwrap();
            assert_eq!((s.accepted, s.requests, s.rejected, s.closed), (4, 3, 1, 3), "{s:?}");
        });
    }

    #[test]
    fn fetch_from_a_port_where_nothing_listens_fails_at_once() {
        let free_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        runtime().block_on(async {
            let client = SideChannel::bind("127.0.0.1", 0).await.unwrap();
            // `Handshake`, not the `Timeout` its 30 s bound would give: refused, not waited for.
            let e = client.fetch(&at(free_port), Duration::from_secs(30)).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Handshake, "{e}");
        });
    }

    #[test]
    fn fetch_from_a_peer_that_never_answers_fails_within_its_timeout() {
        // Accepts connections (the kernel's backlog) but never answers.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = silent.local_addr().unwrap().port();
        runtime().block_on(async {
            let client = SideChannel::bind("127.0.0.1", 0).await.unwrap();
            let silent_peer = at(port);
            let fetch = client.fetch(&silent_peer, Duration::from_millis(300));
            let e = tokio::time::timeout(T, fetch).await.expect("the fetch hung").unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
            assert!(e.to_string().contains("within 300ms"), "its own timeout ended it: {e}");
        });
        drop(silent);
    }

    #[test]
    fn fetch_without_an_endpoint_is_refused_at_once() {
        runtime().block_on(async {
            let client = SideChannel::bind("127.0.0.1", 0).await.unwrap();
            let by_id = PeerLocator { endpoint: None, ..at(1) };
            let e = client.fetch(&by_id, Duration::from_secs(30)).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            assert!(e.to_string().contains("engine \"peer\""), "{e}");
        });
    }

    #[test]
    fn binding_a_taken_port_fails_instead_of_hanging() {
        runtime().block_on(async {
            let first = SideChannel::bind("127.0.0.1", 0).await.unwrap();
            let e = SideChannel::bind("127.0.0.1", first.port()).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Io);
        });
    }

    #[test]
    fn payloads_over_the_frame_limit_are_not_published() {
        runtime().block_on(async {
            let mut config = NetConfig::default();
            config.limits.max_frame = 4096;
            let server = SideChannel::bind_with("127.0.0.1", 0, config).await.unwrap();
            let e = server.publish(vec![0; 4096]).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            server.publish(vec![7; 3000]).await.unwrap();
        });
    }

    #[test]
    fn keyed_side_channels_serve_only_peers_with_the_same_key() {
        let key = |k: &str| NetConfig::with_key(Some(AuthKey::new(k).unwrap()));
        runtime().block_on(async {
            let server = SideChannel::bind_with("127.0.0.1", 0, key("the-deployment-key")).await.unwrap();
            server.publish(b"secret".to_vec()).await.unwrap();
            let friend = SideChannel::bind_with("127.0.0.1", 0, key("the-deployment-key")).await.unwrap();
            assert_eq!(friend.fetch(&at(server.port()), T).await.unwrap(), b"secret");
            let stranger = SideChannel::bind_with("127.0.0.1", 0, key("another-key-entirely")).await.unwrap();
            let open = SideChannel::bind("127.0.0.1", 0).await.unwrap();
            for client in [&stranger, &open] {
                let e = client.fetch(&at(server.port()), T).await.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Unauthenticated, "{e}");
            }
            open.publish(b"public".to_vec()).await.unwrap();
            let e = friend.fetch(&at(open.port()), T).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Unauthenticated, "a keyed client refuses an open server: {e}");
            let s = server.server().wait_for_stats(|s| s.active == 0, T).await.unwrap();
            assert_eq!((s.requests, s.unauthenticated), (1, 2), "{s:?}");
        });
    }
}
