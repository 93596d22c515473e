//! [`TcpConfig`]: where an agent listens, how many connections it opens per peer, and the
//! deployment's key and limits.

use kvx_core::AuthKey;
use kvx_net::{NetConfig, ServeLimits};

/// How a [`TcpAgent`](crate::TcpAgent) listens and connects.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// The host to listen on. Default `127.0.0.1`; `0.0.0.0` (or `::`) listens on every
    /// interface and needs [`advertise_host`](Self::advertise_host).
    pub host: String,
    /// The port to listen on; 0 (the default) takes a free one.
    pub port: u16,
    /// The host peers connect to, put into the agent's metadata. Default: `host`.
    pub advertise_host: Option<String>,
    /// Connections opened to each peer (at least 1); a transfer's chunks are spread over them.
    /// Default 4.
    pub connections: usize,
    /// The most bytes of one chunk (one request frame and its answer): a transfer is cut into
    /// chunks of at most this many bytes and [`MAX_RANGES`](crate::MAX_RANGES) ranges. At most
    /// the peer's `max_frame`. Default 1 MiB.
    pub chunk_bytes: usize,
    /// Threads of the agent's I/O runtime (at least 1). Default 2.
    pub io_threads: usize,
    /// The deployment's key (`None`: no authentication) and the limits: the listener's
    /// connection budgets, timeouts and `max_frame`, the most bytes a request may move.
    pub net: NetConfig,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            host: "127.0.0.1".to_owned(),
            port: 0,
            advertise_host: None,
            connections: 4,
            chunk_bytes: 1 << 20,
            io_threads: 2,
            net: NetConfig::default(),
        }
    }
}

impl TcpConfig {
    /// This configuration with the deployment's key.
    pub fn with_auth_key(mut self, key: Option<AuthKey>) -> Self {
        self.net.auth_key = key;
        self
    }

    /// This configuration listening on `host` (port 0), advertised as `advertise` (default `host`).
    pub fn with_host(mut self, host: impl Into<String>, advertise: Option<String>) -> Self {
        self.host = host.into();
        self.advertise_host = advertise;
        self
    }

    /// This configuration with `n` connections per peer.
    pub fn with_connections(mut self, n: usize) -> Self {
        self.connections = n;
        self
    }

    pub(crate) fn limits(&self) -> &ServeLimits {
        &self.net.limits
    }
}
