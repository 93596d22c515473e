#![doc = include_str!("../README.md")]
//! kvx's own networking on tokio TCP: bounded, length-prefixed frames ([`frame`]), a session
//! layer with an optional challenge-response handshake ([`session`]), a bounded request/response
//! [`Server`], and on top of them the side channel ([`SideChannel`], a [`MetadataExchange`]) and
//! a [`ParallelGroup`] across processes ([`TcpGroup`]). The `kvx` command's request API runs on
//! the same server.
//!
//! Every socket kvx serves or reads is bounded ([`ServeLimits`]): a frame's length is checked
//! before anything is allocated (by servers for requests and by clients for replies, so neither a
//! hostile client nor a hostile server can make kvx allocate what it claims), a server shares its
//! connection slots out by [`admission`] (a small budget with a short deadline for connections not
//! proven yet, per-source budgets, the idlest evicted for a newcomer rather than the newcomer
//! refused), answers one request per connection at a time (a peer that does not read its replies
//! is dropped after `exchange_timeout`, nothing is queued for it), drops connections idle for
//! `idle_timeout` or older than `max_lifetime`, and backs off when `accept` fails (out of file
//! descriptors) instead of spinning. What it drops it counts ([`ServerStats`]) and logs.
//!
//! Why not ZeroMQ: kvx only ever talks to kvx, so ZMTP's interoperability buys nothing, while the
//! `zeromq` crate's codec trusted a peer's frame length (73 bytes made it reserve a terabyte and
//! abort), accepted replies of any size, queued replies without bound behind a client that does
//! not read, and gave no hook for per-connection limits, idle timeouts or accept back-off. A
//! length-prefixed frame over TCP is a few dozen lines that kvx can bound completely.
//!
//! [`MetadataExchange`]: kvx_core::MetadataExchange
//! [`ParallelGroup`]: kvx_core::ParallelGroup

use std::time::Duration;

use kvx_core::auth::AuthKey;

pub mod admission;
pub mod driver;
pub mod frame;
mod group;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod server;
pub mod session;
mod side_channel;

pub use driver::{Handshakes, WorkerDriver};
pub use group::{GroupStats, TcpGroup};
pub use server::{Caller, Server, ServerStats, Service};
pub use session::Connection;
pub use side_channel::{MetadataRequest, SideChannel, max_payload};

/// What a kvx server or client accepts from a peer, and how long it waits. The defaults suit a
/// side channel, a group and the `kvx` request API alike; [`admission`] says how the connection
/// budgets are shared out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// The largest frame read from a peer, in bytes: requests on a server, replies on a client.
    /// A longer frame is refused from its 4-byte header, before anything is allocated, and the
    /// connection dropped. Default 16 MiB: a handshake payload (agent metadata with a remote
    /// key per registered region, and the region addresses) takes kilobytes to a few hundred
    /// kilobytes, so this leaves ample headroom while bounding what a peer can make kvx hold.
    pub max_frame: usize,
    /// The most established connections (proven: authenticated with a key, a first request
    /// answered without one) a server holds. A connection proven when they are all taken evicts
    /// the idlest one. Default 512.
    pub max_connections: usize,
    /// The most established connections from one source (IPv4 address, IPv6 /64). Default 128.
    pub max_per_source: usize,
    /// The most connections not proven yet. A newcomer when they are all taken evicts the oldest
    /// of the source with the most. Default 256: a peer's proof arrives well before 256 newer
    /// connections could push it out, even when they come as fast as this host accepts them.
    pub max_pending: usize,
    /// A connection must prove itself (its proof of the key, or without a key its first request,
    /// complete) within this of its accept. Default 5 s.
    pub handshake_timeout: Duration,
    /// An established connection on which no request starts for this long is closed. Default 60 s.
    pub idle_timeout: Duration,
    /// Once a request's first byte arrived, the rest must arrive within this, and its reply must
    /// be taken by the peer within this (each). A peer that does not read its replies is dropped.
    /// Default 10 s.
    pub exchange_timeout: Duration,
    /// A connection is closed once it is this old, when it next waits for a request (the peer
    /// connects again). Default 10 minutes.
    pub max_lifetime: Duration,
    /// The most connections a server keeps parked: dismissed for room but held open, unserved,
    /// so that their peers do not connect again at once (see [`admission`]). When it is full the
    /// oldest is closed, and when `accept` runs out of file descriptors the oldest are closed to
    /// make them. A parked connection is closed once its peer closes it, sends more than 64 KiB, or
    /// has waited `idle_timeout`. Default 16,384 (a socket and about a kilobyte each).
    pub max_parked: usize,
    /// The longest pause after a failed `accept` (file descriptors exhausted, say): the pause
    /// starts at 1 ms and doubles up to this, so a server out of descriptors does not spin.
    /// Default 100 ms.
    pub max_accept_backoff: Duration,
}

impl ServeLimits {
    /// The default `max_frame`: 16 MiB.
    pub const DEFAULT_MAX_FRAME: usize = 16 << 20;

    /// The budgets of the admission policy.
    pub fn budgets(&self) -> admission::Budgets {
        admission::Budgets {
            max_pending: self.max_pending,
            max_connections: self.max_connections,
            max_per_source: self.max_per_source,
        }
    }
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_frame: Self::DEFAULT_MAX_FRAME,
            max_connections: 512,
            max_per_source: 128,
            max_pending: 256,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            exchange_timeout: Duration::from_secs(10),
            max_lifetime: Duration::from_secs(600),
            max_parked: 16_384,
            max_accept_backoff: Duration::from_millis(100),
        }
    }
}

/// How a kvx server or client runs: its limits, and the deployment's shared key, if any.
///
/// With a key, every connection starts with a challenge-response in both directions (see
/// [`session`]); a peer without the key gets nothing, and a client whose server cannot prove the
/// key fails with `ErrorKind::Unauthenticated`.
#[derive(Debug, Clone, Default)]
pub struct NetConfig {
    /// The shared key; `None` serves and fetches without authentication.
    pub auth_key: Option<AuthKey>,
    /// The limits.
    pub limits: ServeLimits,
}

impl NetConfig {
    /// The default limits with `auth_key`.
    pub fn with_key(auth_key: Option<AuthKey>) -> Self {
        NetConfig { auth_key, limits: ServeLimits::default() }
    }
}

/// The backlog of every socket kvx listens on: room for a burst of connections while the accept
/// loop works through a flood. A short one (tokio's default is 1024, many servers' 128) fills under
/// a flood of connects, and the kernel then drops a legitimate client's SYN, which it sends again
/// only a second later. The kernel caps it at `net.core.somaxconn`.
pub const BACKLOG: u32 = 4096;

/// Binds `host:port` (the first address it resolves to that binds) and listens with [`BACKLOG`]:
/// how kvx's servers, `/metrics` and `kvx router` listen.
pub async fn listen(host: &str, port: u16) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        let socket =
            if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        match socket.bind(addr).and_then(|()| socket.listen(BACKLOG)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other(format!("{host} resolves to no address"))))
}

/// `host:port` (IPv6 hosts in brackets), as [`parse_endpoint`] reads it.
pub fn endpoint(host: &str, port: u16) -> String {
    if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// Splits `tcp://host:port`, `host:port` or `[v6]:port` into host and port.
pub fn parse_endpoint(endpoint: &str) -> kvx_core::Result<(String, u16)> {
    let bad = |why: &str| {
        kvx_core::Error::invalid_argument(format!("endpoint {}: {why}", kvx_core::error::quote(endpoint)))
    };
    let rest = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("expected host:port"))?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let port = port.parse::<u16>().map_err(|_| bad("the port is not a number below 65536"))?;
    if host.is_empty() {
        return Err(bad("no host"));
    }
    Ok((host.to_owned(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_with_or_without_scheme() {
        assert_eq!(parse_endpoint("tcp://127.0.0.1:5600").unwrap(), ("127.0.0.1".into(), 5600));
        assert_eq!(parse_endpoint("localhost:1").unwrap(), ("localhost".into(), 1));
        assert_eq!(parse_endpoint("tcp://[::1]:7").unwrap(), ("::1".into(), 7));
        for bad in ["", "host", "tcp://:5", "h:99999", "h:x"] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
        assert_eq!(endpoint("::1", 7), "[::1]:7");
    }
}
