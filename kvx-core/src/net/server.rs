//! A bounded request/response server: the side channel, the group's rank 0 and the `kvx` request
//! API all run on it.
//!
//! Each connection is its own task and holds one request at a time: it reads a frame (bounded by
//! `max_frame`, within `idle_timeout` for its first byte and `exchange_timeout` for the rest),
//! runs the session step and the [`Service`], writes the answer (within `exchange_timeout`), and
//! only then reads the next frame. A peer that pipelines requests and never reads fills its own
//! socket buffers and is dropped when its reply cannot be written; nothing is queued for it.
//! Connections beyond `max_connections` are closed at once. A failed `accept` (out of file
//! descriptors) pauses the accept loop 1 ms, doubling up to `max_accept_backoff`, so it does not
//! spin. Every connection's end is counted in [`ServerStats`] by reason and logged.

use async_trait::async_trait;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::frame::{FrameError, read_frame, write_frame};
use super::session::{Refusal, ServerSession, SessionReply, Step};
use super::{NetConfig, ServeLimits, endpoint};
use crate::auth::{AuthKey, Purpose};
use crate::error::{Error, ErrorKind, Result};
use crate::wire;

/// What a server does with each request.
#[async_trait]
pub trait Service: Send + Sync + 'static {
    /// Answers one request. An error is sent to the client as a refusal and closes the
    /// connection: `Unauthenticated` counts as such, `Wire`, `InvalidPeerData` and
    /// `Incompatible` as malformed, any other kind as rejected.
    async fn call(&self, request: Vec<u8>) -> Result<Vec<u8>>;
}

/// A server's counters. Every accepted connection ends in exactly one of `closed`, `idle`,
/// `slow`, `oversize`, `truncated`, `malformed`, `unauthenticated`, `rejected`, `io` and
/// `shutdown`, or is still `active`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Connections accepted and served.
    pub accepted: u64,
    /// Connections closed at once because `max_connections` were open.
    pub refused: u64,
    /// Failed `accept` calls (each followed by a pause).
    pub accept_errors: u64,
    /// Connections open now.
    pub active: u64,
    /// Requests answered.
    pub requests: u64,
    /// Connections the peer closed between requests.
    pub closed: u64,
    /// Connections dropped after `idle_timeout` without a request.
    pub idle: u64,
    /// Connections dropped because a request did not arrive, or a reply was not taken, within
    /// `exchange_timeout`.
    pub slow: u64,
    /// Connections dropped for a frame over `max_frame`.
    pub oversize: u64,
    /// Connections that ended in the middle of a frame.
    pub truncated: u64,
    /// Connections dropped for a frame that is not a kvx message the server expects.
    pub malformed: u64,
    /// Connections dropped for missing, unexpected or wrong authentication.
    pub unauthenticated: u64,
    /// Connections closed after the service refused a request.
    pub rejected: u64,
    /// Connections that ended in a socket error.
    pub io: u64,
    /// Connections closed because the server shut down.
    pub shutdown: u64,
}

/// How a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Closed,
    Idle,
    Slow,
    Oversize,
    Truncated,
    Malformed,
    Unauthenticated,
    Rejected,
    Io,
    Shutdown,
}

impl End {
    fn count(self, s: &mut ServerStats) {
        let counter = match self {
            End::Closed => &mut s.closed,
            End::Idle => &mut s.idle,
            End::Slow => &mut s.slow,
            End::Oversize => &mut s.oversize,
            End::Truncated => &mut s.truncated,
            End::Malformed => &mut s.malformed,
            End::Unauthenticated => &mut s.unauthenticated,
            End::Rejected => &mut s.rejected,
            End::Io => &mut s.io,
            End::Shutdown => &mut s.shutdown,
        };
        *counter += 1;
    }

    fn of_frame(e: &FrameError) -> End {
        match e {
            FrameError::Closed => End::Closed,
            FrameError::Idle => End::Idle,
            FrameError::Slow => End::Slow,
            FrameError::Oversize { .. } => End::Oversize,
            FrameError::Truncated { .. } => End::Truncated,
            FrameError::Io(_) => End::Io,
        }
    }

    fn of_refusal(r: Refusal) -> End {
        match r {
            Refusal::Unauthenticated => End::Unauthenticated,
            Refusal::Malformed => End::Malformed,
            Refusal::Rejected => End::Rejected,
        }
    }
}

struct Shared<S> {
    service: S,
    key: Option<AuthKey>,
    limits: ServeLimits,
    name: &'static str,
    stats: watch::Sender<ServerStats>,
    shutdown: watch::Receiver<bool>,
    warnings: Warnings,
}

/// Warnings at most once a second per server, so that a flood of hostile connections does not
/// flood the log as well; the ones in between go to `debug` and are counted in the next warning
/// (every one of them is in [`ServerStats`]).
#[derive(Default)]
struct Warnings {
    last: Mutex<Option<Instant>>,
    quiet: AtomicU64,
}

impl Warnings {
    fn warn(&self, name: &str, what: fmt::Arguments<'_>) {
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if last.is_some_and(|t| now.duration_since(t) < Duration::from_secs(1)) {
            self.quiet.fetch_add(1, Ordering::Relaxed);
            debug!(name, "{what}");
        } else {
            *last = Some(now);
            let quiet = self.quiet.swap(0, Ordering::Relaxed);
            warn!(name, more_since_last_warning = quiet, "{what}");
        }
    }
}

/// A bound, serving server. Dropping it stops accepting at once; each connection closes when it
/// next waits for a request.
pub struct Server {
    addr: SocketAddr,
    name: &'static str,
    stats: watch::Sender<ServerStats>,
    shutdown: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server").field("name", &self.name).field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl Server {
    /// Binds `host:port` (port 0: a free port) and serves `service` on the current tokio runtime
    /// (multi-threaded, or one that keeps running). `name` is for logs. A port in use is an `Io`
    /// error, at once.
    pub async fn bind(
        name: &'static str,
        host: &str,
        port: u16,
        config: &NetConfig,
        service: impl Service,
    ) -> Result<Server> {
        let listener = TcpListener::bind((host, port)).await.map_err(|e| {
            Error::new(ErrorKind::Io, format!("binding {name} on {}: {e}", endpoint(host, port)))
                .with_source(e)
        })?;
        let addr = listener.local_addr()?;
        let (stats, _) = watch::channel(ServerStats::default());
        let (shutdown, shutdown_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            service,
            key: config.auth_key.clone(),
            limits: config.limits,
            name,
            stats: stats.clone(),
            shutdown: shutdown_rx,
            warnings: Warnings::default(),
        });
        let accept = tokio::spawn(accept_loop(listener, shared));
        debug!(name, %addr, "serving");
        Ok(Server { addr, name, stats, shutdown, accept })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The counters now.
    pub fn stats(&self) -> ServerStats {
        *self.stats.borrow()
    }

    /// Waits until the counters satisfy `done`, at most `timeout`; `Timeout` (with the counters)
    /// when they do not.
    pub async fn wait_for_stats(
        &self,
        done: impl FnMut(&ServerStats) -> bool,
        timeout: Duration,
    ) -> Result<ServerStats> {
        wait_for_stats(self.stats.subscribe(), done, timeout).await
    }

    /// Stops accepting, lets every exchange in progress finish (a reply being computed or
    /// written), closes idle connections, and waits at most `timeout` for all of it.
    pub async fn shutdown(self, timeout: Duration) -> Result<ServerStats> {
        self.accept.abort();
        let _ = self.shutdown.send(true);
        self.wait_for_stats(|s| s.active == 0, timeout).await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.accept.abort();
        let _ = self.shutdown.send(true);
    }
}

async fn wait_for_stats(
    mut rx: watch::Receiver<ServerStats>,
    mut done: impl FnMut(&ServerStats) -> bool,
    timeout: Duration,
) -> Result<ServerStats> {
    let reached = tokio::time::timeout(timeout, async { rx.wait_for(|s| done(s)).await.map(|s| *s) }).await;
    match reached {
        Ok(Ok(s)) => Ok(s),
        _ => {
            let now = *rx.borrow();
            Err(Error::new(
                ErrorKind::Timeout,
                format!("server counters not reached in {timeout:?}: {now:?}"),
            ))
        }
    }
}

async fn accept_loop<S: Service>(listener: TcpListener, shared: Arc<Shared<S>>) {
    let permits = Arc::new(Semaphore::new(shared.limits.max_connections.min(Semaphore::MAX_PERMITS)));
    let min_backoff = Duration::from_millis(1);
    let mut backoff = min_backoff;
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                backoff = min_backoff;
                let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
                    drop(stream);
                    shared.stats.send_modify(|s| s.refused += 1);
                    let max = shared.limits.max_connections;
                    shared
                        .warnings
                        .warn(shared.name, format_args!("connection from {peer} refused: {max} open"));
                    continue;
                };
                shared.stats.send_modify(|s| {
                    s.accepted += 1;
                    s.active += 1;
                });
                let shared = Arc::clone(&shared);
                tokio::spawn(async move {
                    let end = serve_connection(stream, &shared).await;
                    match end {
                        End::Closed | End::Shutdown => {
                            debug!(name = shared.name, %peer, ?end, "connection ended")
                        }
                        _ => shared
                            .warnings
                            .warn(shared.name, format_args!("connection from {peer} dropped: {end:?}")),
                    }
                    shared.stats.send_modify(|s| {
                        s.active -= 1;
                        end.count(s);
                    });
                    drop(permit);
                });
            }
            Err(e) => {
                // EMFILE, ENFILE, ENOBUFS, a connection reset before it was accepted: the
                // listener stays; pause so that a lasting condition does not spin this loop.
                shared.stats.send_modify(|s| s.accept_errors += 1);
                shared.warnings.warn(shared.name, format_args!("accept failed ({e}); pausing {backoff:?}"));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(shared.limits.max_accept_backoff.max(min_backoff));
            }
        }
    }
}

async fn serve_connection<S: Service>(mut stream: TcpStream, shared: &Shared<S>) -> End {
    let _ = stream.set_nodelay(true);
    let limits = &shared.limits;
    let mut session = ServerSession::new(shared.key.clone());
    let mut shutdown = shared.shutdown.clone();
    loop {
        let frame = tokio::select! {
            frame = read_frame(&mut stream, limits.max_frame, limits.idle_timeout, limits.exchange_timeout) => frame,
            _ = shutdown.wait_for(|stop| *stop) => return End::Shutdown,
        };
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                debug!(name = shared.name, error = %e, "reading a request");
                return End::of_frame(&e);
            }
        };
        let (reply, end) = match session.on_frame(&frame) {
            Step::Send(reply) => (reply, None),
            Step::Refuse(refusal, reason) => {
                (SessionReply::Refused { refusal, reason }, Some(End::of_refusal(refusal)))
            }
            Step::Call { body, tag_with } => match shared.service.call(body).await {
                Ok(body) => {
                    let tag = match (&shared.key, tag_with) {
                        (Some(key), Some((c, s))) => {
                            Some(key.tag(Purpose::HandshakeReply, &[&c, &s, &body]).to_vec())
                        }
                        _ => None,
                    };
                    (SessionReply::Reply { body, tag }, None)
                }
                Err(e) => {
                    let refusal = match e.kind() {
                        ErrorKind::Unauthenticated => Refusal::Unauthenticated,
                        ErrorKind::Wire | ErrorKind::InvalidPeerData | ErrorKind::Incompatible => {
                            Refusal::Malformed
                        }
                        _ => Refusal::Rejected,
                    };
                    debug!(name = shared.name, error = %e, "request refused");
                    let reason = e.message().to_owned();
                    (SessionReply::Refused { refusal, reason }, Some(End::of_refusal(refusal)))
                }
            },
        };
        let answered = matches!(reply, SessionReply::Reply { .. });
        let bytes = match wire::encode(&reply) {
            Ok(b) => b,
            Err(e) => {
                warn!(name = shared.name, error = %e, "encoding a reply");
                return End::Rejected;
            }
        };
        if let Err(e) = write_frame(&mut stream, &bytes, limits.exchange_timeout).await {
            debug!(name = shared.name, error = %e, "writing a reply");
            return End::of_frame(&e);
        }
        if answered {
            shared.stats.send_modify(|s| s.requests += 1);
        }
        if let Some(end) = end {
            return end;
        }
    }
}
