//! The ZeroMQ side channel (a [`MetadataExchange`]) and a [`ParallelGroup`] across processes,
//! over the pure-Rust `zeromq` crate. Both need a multi-threaded tokio runtime: their sockets are
//! served by tasks on it.

use async_trait::async_trait;
use std::fmt;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tracing::{debug, warn};
use zeromq::{PullSocket, PushSocket, ReqSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::error::{Error, ErrorKind, Result};
use crate::exchange::MetadataExchange;
use crate::group::{GatherInbox, ParallelGroup};
use crate::meta::{Finished, RankReport};
use crate::wire;

/// What a client sends to ask for the payload.
const GET_METADATA: &[u8] = b"kvx/get-metadata/1";

fn zmq_error(what: &str, e: zeromq::ZmqError) -> Error {
    let kind = match &e {
        zeromq::ZmqError::Network(io) if io.kind() == std::io::ErrorKind::TimedOut => ErrorKind::Timeout,
        zeromq::ZmqError::Network(_) => ErrorKind::Io,
        _ => ErrorKind::Handshake,
    };
    Error::new(kind, format!("{what}: {e}")).with_backend("zeromq").with_source(e)
}

fn endpoint(host: &str, port: u16) -> String {
    if host.contains(':') { format!("tcp://[{host}]:{port}") } else { format!("tcp://{host}:{port}") }
}

/// A worker's side channel: a ROUTER socket that answers every metadata request with the
/// published payload, and a REQ client (one socket per fetch) bounded by a timeout.
pub struct ZmqSideChannel {
    port: u16,
    payload: Arc<RwLock<Option<Vec<u8>>>>,
    server: JoinHandle<()>,
}

impl fmt::Debug for ZmqSideChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZmqSideChannel").field("port", &self.port).finish()
    }
}

impl ZmqSideChannel {
    /// Binds the listener on `host:port` (port 0 picks a free port). A port in use is an error,
    /// at once. Must run inside a multi-threaded tokio runtime, which then serves the socket.
    pub async fn bind(host: &str, port: u16) -> Result<Self> {
        let mut socket = RouterSocket::new();
        let bound = socket.bind(&endpoint(host, port)).await.map_err(|e| {
            let err = zmq_error(&format!("binding side channel {host}:{port}"), e);
            Error::new(ErrorKind::Io, err.to_string())
        })?;
        let port = match bound {
            zeromq::Endpoint::Tcp(_, p) => p,
            _ => port,
        };
        let payload: Arc<RwLock<Option<Vec<u8>>>> = Arc::default();
        let served = Arc::clone(&payload);
        let server = tokio::spawn(async move {
            loop {
                let msg = match socket.recv().await {
                    Ok(m) => m,
                    Err(e) => {
                        debug!(error = %e, "side channel receive failed");
                        continue;
                    }
                };
                let mut frames = msg.into_vec();
                let Some(request) = frames.pop() else { continue };
                if request.as_ref() != GET_METADATA {
                    warn!(len = request.len(), "side channel got an unexpected message");
                }
                let body = served.read().map(|p| p.clone().unwrap_or_default()).unwrap_or_default();
                frames.push(body.into());
                let Ok(reply) = ZmqMessage::try_from(frames) else { continue };
                if let Err(e) = socket.send(reply).await {
                    debug!(error = %e, "side channel reply failed");
                }
            }
        });
        Ok(ZmqSideChannel { port, payload, server })
    }

    /// The port the listener is bound to.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for ZmqSideChannel {
    fn drop(&mut self) {
        self.server.abort();
    }
}

#[async_trait]
impl MetadataExchange for ZmqSideChannel {
    async fn publish(&self, payload: Vec<u8>) -> Result<()> {
        let mut slot =
            self.payload.write().map_err(|_| Error::new(ErrorKind::State, "payload lock poisoned"))?;
        *slot = Some(payload);
        Ok(())
    }

    async fn fetch(&self, host: &str, port: u16, timeout: Duration) -> Result<Vec<u8>> {
        let ep = endpoint(host, port);
        let fetch = async {
            // A refused connection fails now, with the reason: zeromq's connect would retry it
            // until the timeout (a decode engine would hold a request for a prefill engine that
            // is gone).
            tokio::net::TcpStream::connect((host, port))
                .await
                .map_err(|e| Error::new(ErrorKind::Handshake, format!("connecting to {ep}: {e}")))?;
            let mut socket = ReqSocket::new();
            socket.connect(&ep).await.map_err(|e| zmq_error(&format!("connecting to {ep}"), e))?;
            socket.send(GET_METADATA.to_vec().into()).await.map_err(|e| zmq_error("sending request", e))?;
            let reply = socket.recv().await.map_err(|e| zmq_error("receiving metadata", e))?;
            Ok::<_, Error>(reply.into_vec().pop().map(|b| b.to_vec()).unwrap_or_default())
        };
        match tokio::time::timeout(timeout, fetch).await {
            Ok(Ok(body)) if body.is_empty() => {
                Err(Error::new(ErrorKind::Handshake, format!("{ep} has no metadata published yet")))
            }
            Ok(result) => result,
            Err(_) => {
                Err(Error::new(ErrorKind::Timeout, format!("no metadata from {ep} within {timeout:?}")))
            }
        }
    }
}

enum GroupEnd {
    Rank0 { socket: PullSocket, inbox: GatherInbox },
    Other { socket: PushSocket, unsent: Finished },
}

/// A tensor-parallel group across processes: rank 0 binds a PULL socket on `host:port`, the other
/// ranks PUSH their reports to it. Owns a small tokio runtime for its sockets. Reports that could
/// not be sent are merged into the next one, never dropped.
pub struct ZmqGroup {
    rank: u32,
    world_size: u32,
    timeout: Duration,
    end: Mutex<GroupEnd>,
    runtime: Runtime,
}

impl fmt::Debug for ZmqGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZmqGroup").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

impl ZmqGroup {
    /// Joins the group as `rank` of `world_size`; rank 0 listens on `host:port`, the others
    /// connect to it (within `timeout`). Each gather waits at most `timeout`.
    pub fn join(rank: u32, world_size: u32, host: &str, port: u16, timeout: Duration) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid_argument(format!("rank {rank} of {world_size}")));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvx-group")
            .enable_all()
            .build()?;
        let ep = endpoint(host, port);
        let end = runtime.block_on(async {
            if rank == 0 {
                let mut socket = PullSocket::new();
                socket.bind(&ep).await.map_err(|e| zmq_error(&format!("binding group socket {ep}"), e))?;
                Ok::<_, Error>(GroupEnd::Rank0 { socket, inbox: GatherInbox::new(world_size, timeout) })
            } else {
                let mut socket = PushSocket::new();
                tokio::time::timeout(timeout, socket.connect(&ep))
                    .await
                    .map_err(|_| Error::new(ErrorKind::Timeout, format!("rank 0 at {ep} unreachable")))?
                    .map_err(|e| zmq_error(&format!("connecting to rank 0 at {ep}"), e))?;
                Ok(GroupEnd::Other { socket, unsent: Finished::default() })
            }
        })?;
        Ok(ZmqGroup { rank, world_size, timeout, end: Mutex::new(end), runtime })
    }
}

impl ParallelGroup for ZmqGroup {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world_size
    }

    fn gather_finished(&self, report: Finished) -> Result<Option<Vec<Finished>>> {
        let mut end = self.end.lock().map_err(|_| Error::new(ErrorKind::State, "group lock poisoned"))?;
        match &mut *end {
            GroupEnd::Other { socket, unsent } => {
                unsent.extend(report);
                let msg = wire::encode(&RankReport { rank: self.rank, finished: unsent.clone() })?;
                let sent = self
                    .runtime
                    .block_on(async { tokio::time::timeout(self.timeout, socket.send(msg.into())).await });
                match sent {
                    Ok(Ok(())) => *unsent = Finished::default(),
                    Ok(Err(e)) => warn!(error = %e, "report to rank 0 not sent; retrying next step"),
                    Err(_) => warn!("report to rank 0 timed out; retrying next step"),
                }
                Ok(None)
            }
            GroupEnd::Rank0 { socket, inbox } => {
                let reports = inbox.gather(report, |deadline| {
                    let wait = deadline.saturating_duration_since(Instant::now());
                    let got =
                        self.runtime.block_on(async { tokio::time::timeout(wait, socket.recv()).await });
                    match got {
                        Err(_) => Ok(None),
                        Ok(Err(e)) => Err(zmq_error("receiving a rank report", e)),
                        Ok(Ok(msg)) => {
                            let bytes = msg.into_vec().pop().unwrap_or_default();
                            match wire::decode::<RankReport>(&bytes) {
                                Ok(r) => Ok(Some((r.rank, r.finished))),
                                Err(e) => {
                                    warn!(error = %e, "malformed rank report dropped");
                                    Ok(Some((u32::MAX, Finished::default())))
                                }
                            }
                        }
                    }
                })?;
                Ok(Some(reports))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RequestId;

    fn runtime() -> Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
    }

    #[test]
    fn fetch_returns_the_published_payload() {
        let rt = runtime();
        rt.block_on(async {
            let server = ZmqSideChannel::bind("127.0.0.1", 0).await.unwrap();
            let e = server.fetch("127.0.0.1", server.port(), Duration::from_secs(5)).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Handshake, "nothing published yet: {e}");
            server.publish(b"payload-1".to_vec()).await.unwrap();
            let client = ZmqSideChannel::bind("127.0.0.1", 0).await.unwrap();
            for _ in 0..3 {
                let got = client.fetch("127.0.0.1", server.port(), Duration::from_secs(5)).await.unwrap();
                assert_eq!(got, b"payload-1");
            }
        });
    }

    #[test]
    fn fetch_from_a_port_where_nothing_listens_fails_at_once() {
        let rt = runtime();
        let free_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        rt.block_on(async {
            let client = ZmqSideChannel::bind("127.0.0.1", 0).await.unwrap();
            let start = Instant::now();
            let e = client.fetch("127.0.0.1", free_port, Duration::from_secs(30)).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Handshake, "{e}");
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "refused, not waited for: {:?}",
                start.elapsed()
            );
        });
    }

    #[test]
    fn fetch_from_a_peer_that_never_answers_fails_within_its_timeout() {
        let rt = runtime();
        // Accepts connections (the kernel's backlog) but never speaks ZMTP.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = silent.local_addr().unwrap().port();
        rt.block_on(async {
            let client = ZmqSideChannel::bind("127.0.0.1", 0).await.unwrap();
            let start = Instant::now();
            let e = client.fetch("127.0.0.1", port, Duration::from_millis(300)).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
            assert!(start.elapsed() < Duration::from_secs(3), "bounded by the timeout");
        });
        drop(silent);
    }

    #[test]
    fn binding_a_taken_port_fails_instead_of_hanging() {
        let rt = runtime();
        rt.block_on(async {
            let first = ZmqSideChannel::bind("127.0.0.1", 0).await.unwrap();
            let e = ZmqSideChannel::bind("127.0.0.1", first.port()).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Io);
        });
    }

    #[test]
    fn zmq_group_gathers_reports_of_other_ranks() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let r0 = ZmqGroup::join(0, 2, "127.0.0.1", port, Duration::from_secs(5)).unwrap();
        let r1 = ZmqGroup::join(1, 2, "127.0.0.1", port, Duration::from_secs(5)).unwrap();
        let rep = |s: &str| Finished { sending: vec![RequestId::new(s)], ..Default::default() };
        assert_eq!(r1.gather_finished(rep("b")).unwrap(), None);
        let got = r0.gather_finished(rep("a")).unwrap().unwrap();
        assert_eq!(got, vec![rep("a"), rep("b")]);
        assert!(ZmqGroup::join(2, 2, "127.0.0.1", port, Duration::from_secs(1)).is_err());
    }
}
