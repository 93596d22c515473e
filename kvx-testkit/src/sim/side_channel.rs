//! Side channels for simulated engines: an in-process registry, and real TCP side channels
//! (`kvx_core::net::SideChannel`) on consecutive ports.
//!
//! A scheduler hands decode engines one base port; rank `r` of the prefill engine serves its
//! payload on `base + r`. Both kinds bind all of an engine's ranks at once on consecutive ports.

use async_trait::async_trait;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::runtime::Handle;

use kvx_core::net::{NetConfig, SideChannel};
use kvx_core::{Error, ErrorKind, MetadataExchange, Result};

/// One side channel per rank of an engine, on `base_port + rank`.
#[derive(Debug)]
pub struct BoundSideChannels {
    /// The port of rank 0.
    pub base_port: u16,
    /// One side channel per rank.
    pub ranks: Vec<Arc<dyn MetadataExchange>>,
}

/// An in-process side-channel "network": a map from `host:port` to the payload served there.
/// Engines of one test share it (cheap to clone; clones are the same registry).
#[derive(Debug, Clone, Default)]
pub struct InProcessSideChannels {
    registry: Arc<Mutex<Registry>>,
}

#[derive(Debug, Default)]
struct Registry {
    /// The payload served at each bound address (`None` until published).
    served: HashMap<(String, u16), Option<Vec<u8>>>,
    next_port: u16,
}

impl InProcessSideChannels {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Binds `ranks` consecutive ports on `host`.
    pub fn bind(&self, host: &str, ranks: u32) -> Result<BoundSideChannels> {
        let mut reg = self.lock()?;
        let base = reg.next_port.max(1);
        let end = u32::from(base) + ranks;
        let next = u16::try_from(end).map_err(|_| Error::new(ErrorKind::Io, "in-process ports exhausted"))?;
        reg.next_port = next;
        let mut out = Vec::with_capacity(ranks as usize);
        for port in base..next {
            reg.served.insert((host.to_owned(), port), None);
            out.push(Arc::new(InProcessSideChannel { channels: self.clone(), host: host.to_owned(), port })
                as Arc<dyn MetadataExchange>);
        }
        Ok(BoundSideChannels { base_port: base, ranks: out })
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Registry>> {
        self.registry.lock().map_err(|_| Error::new(ErrorKind::State, "side-channel registry lock poisoned"))
    }
}

/// One rank's end of [`InProcessSideChannels`].
#[derive(Debug)]
struct InProcessSideChannel {
    channels: InProcessSideChannels,
    host: String,
    port: u16,
}

#[async_trait]
impl MetadataExchange for InProcessSideChannel {
    async fn publish(&self, payload: Vec<u8>) -> Result<()> {
        self.channels.lock()?.served.insert((self.host.clone(), self.port), Some(payload));
        Ok(())
    }

    async fn fetch(&self, host: &str, port: u16, _timeout: Duration) -> Result<Vec<u8>> {
        match self.channels.lock()?.served.get(&(host.to_owned(), port)) {
            Some(Some(payload)) => Ok(payload.clone()),
            Some(None) => {
                Err(Error::new(ErrorKind::Handshake, format!("{host}:{port} has published nothing yet")))
            }
            None => Err(Error::new(ErrorKind::Handshake, format!("nothing listens at {host}:{port}"))),
        }
    }
}

/// Binds real TCP side channels for `ranks` ranks on consecutive ports of `host` from `base_port`,
/// with `config`'s limits and key, served by `runtime` (multi-threaded). With `base_port` 0, rank 0
/// takes a free port from the OS; when a port after it is taken, all are dropped and another base
/// is tried (a bounded number of times). A given `base_port` is tried once (a restarted engine
/// binds the ports it had).
pub fn bind_tcp(
    runtime: &Handle,
    host: &str,
    base_port: u16,
    ranks: u32,
    config: &NetConfig,
) -> Result<BoundSideChannels> {
    let attempts = if base_port == 0 { 32 } else { 1 };
    let mut last = None;
    for _ in 0..attempts {
        let attempt = runtime.block_on(async {
            let first = SideChannel::bind_with(host, base_port, config.clone()).await?;
            let base = first.port();
            let mut bound = vec![Arc::new(first) as Arc<dyn MetadataExchange>];
            for r in 1..ranks {
                let port = u16::try_from(u32::from(base) + r)
                    .map_err(|_| Error::new(ErrorKind::Io, format!("port {base} + {r} overflows")))?;
                bound.push(Arc::new(SideChannel::bind_with(host, port, config.clone()).await?));
            }
            Ok::<_, Error>(BoundSideChannels { base_port: base, ranks: bound })
        });
        match attempt {
            Ok(b) => return Ok(b),
            Err(e) if e.kind() == ErrorKind::Io => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| Error::new(ErrorKind::Io, "no side-channel ports")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_process_channels_serve_what_each_rank_published() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let net = InProcessSideChannels::new();
        let a = net.bind("h", 2).unwrap();
        let b = net.bind("h", 1).unwrap();
        assert_eq!(b.base_port, a.base_port + 2);
        rt.block_on(async {
            let t = Duration::from_secs(1);
            let e = b.ranks[0].fetch("h", a.base_port + 1, t).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Handshake);
            a.ranks[1].publish(b"one".to_vec()).await.unwrap();
            assert_eq!(b.ranks[0].fetch("h", a.base_port + 1, t).await.unwrap(), b"one");
            assert!(b.ranks[0].fetch("other", a.base_port + 1, t).await.is_err());
        });
    }

    #[test]
    fn tcp_channels_bind_consecutive_ports() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let bound = bind_tcp(rt.handle(), "127.0.0.1", 0, 3, &NetConfig::default()).unwrap();
        assert_eq!(bound.ranks.len(), 3);
        rt.block_on(async {
            bound.ranks[2].publish(b"r2".to_vec()).await.unwrap();
            let got = bound.ranks[0].fetch("127.0.0.1", bound.base_port + 2, Duration::from_secs(5)).await;
            assert_eq!(got.unwrap(), b"r2");
        });
    }

    #[test]
    fn tcp_channels_rebind_a_given_base_port() {
        let rt =
            || tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let first = rt();
        let base = bind_tcp(first.handle(), "127.0.0.1", 0, 2, &NetConfig::default()).unwrap().base_port;
        // The runtime's shutdown drops the servers and their listeners.
        drop(first);
        let again = rt();
        let bound = bind_tcp(again.handle(), "127.0.0.1", base, 2, &NetConfig::default()).unwrap();
        assert_eq!(bound.base_port, base);
        let taken = bind_tcp(again.handle(), "127.0.0.1", base, 2, &NetConfig::default()).unwrap_err();
        assert_eq!(taken.kind(), ErrorKind::Io, "{taken}");
    }
}
