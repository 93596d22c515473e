//! The `/metrics` endpoint: a small HTTP/1.1 server (hyper) on the caller's tokio runtime, meant
//! to be reachable from the network. Its connections are admitted by kvx's
//! [`admission`](crate::admission) policy with [`BUDGETS`]: a connection is established once
//! its first request's headers are in (within [`HEADER_TIMEOUT`]), a newcomer evicts the oldest
//! connection that has not sent one or, once it has, the idlest established one, so idle or
//! half-sent connections cannot keep a scraper out; the connection that makes way is parked (at
//! most [`MAX_PARKED`], for [`CONNECTION_LIFETIME`]), not closed, so that a flood does not turn over
//! as fast as the server accepts. Each connection lasts [`CONNECTION_LIFETIME`] at most, headers
//! bounded to [`MAX_BUF`] bytes. `GET /metrics` answers the registry in the
//! OpenMetrics text format; other paths 404, other methods 405.

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::admission::{Budgets, Gate, Lot, Phase, Promotion, Spare, Ticket};
use kvx_core::error::{Error, ErrorKind, Result};

/// The content type of the answer: OpenMetrics text 1.0.0.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The connection budgets: a few scrapers, each from its own address.
pub(super) const BUDGETS: Budgets = Budgets { max_pending: 32, max_connections: 16, max_per_source: 8 };
/// The most connections parked at once (see [`admission`](crate::admission)).
const MAX_PARKED: usize = 16_384;
/// A request's headers must arrive within this.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection (kept alive across requests) is closed after this, gracefully; a parked one too.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);
/// How long a response being written may take once the server closes its connection.
const GRACE: Duration = Duration::from_secs(5);
/// The read buffer, which bounds a request's headers.
const MAX_BUF: usize = 16 * 1024;
/// The pause after a failed `accept` (out of file descriptors), so that the loop does not spin.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// A running `/metrics` server. Dropping it stops it at once; [`shutdown`](Self::shutdown) lets
/// the answers being written finish first.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    scrapes: watch::Receiver<u64>,
    task: Option<JoinHandle<()>>,
}

/// Binds `host:port` (0: any free port, see [`MetricsServer::local_addr`]) and serves `registry`
/// on the current tokio runtime.
pub async fn serve(host: &str, port: u16, registry: Arc<Registry>) -> Result<MetricsServer> {
    let listener = crate::listen(host, port)
        .await
        .map_err(|e| Error::new(ErrorKind::Io, format!("metrics server: binding {host}:{port}: {e}")))?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = watch::channel(false);
    let (scraped, scrapes) = watch::channel(0);
    let task = tokio::spawn(accept_loop(listener, registry, stopped, Arc::new(scraped)));
    tracing::info!(%addr, "serving /metrics");
    Ok(MetricsServer { addr, stop, scrapes, task: Some(task) })
}

impl MetricsServer {
    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many `/metrics` requests it has taken (each is counted before the registry is read:
    /// one counted after a look at this number sees every update made before that look).
    pub fn scrapes(&self) -> u64 {
        *self.scrapes.borrow()
    }

    /// Waits until it has taken more than `scrapes` `/metrics` requests, at most `timeout`;
    /// returns how many it has taken. With [`shutdown`](Self::shutdown) after it, the last one
    /// still gets its answer.
    pub async fn wait_for_scrape(&self, scrapes: u64, timeout: Duration) -> Result<u64> {
        let mut rx = self.scrapes.clone();
        match tokio::time::timeout(timeout, rx.wait_for(|&n| n > scrapes)).await {
            Ok(Ok(n)) => Ok(*n),
            Ok(Err(_)) => Err(Error::new(ErrorKind::State, "the metrics server stopped")),
            Err(_) => {
                Err(Error::new(ErrorKind::Timeout, format!("no scrape of /metrics within {timeout:?}")))
            }
        }
    }

    /// Stops accepting, lets the answers being written finish, and waits for every connection to
    /// close, at most `timeout` (then they are dropped).
    pub async fn shutdown(mut self, timeout: Duration) -> Result<()> {
        self.stop.send_replace(true);
        let Some(mut task) = self.task.take() else { return Ok(()) };
        match tokio::time::timeout(timeout, &mut task).await {
            Ok(_) => Ok(()),
            Err(_) => {
                task.abort();
                Err(Error::new(ErrorKind::Timeout, "metrics server: connections still open at shutdown"))
            }
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            // Its connections are in its JoinSet: they go with it.
            task.abort();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    registry: Arc<Registry>,
    mut stop: watch::Receiver<bool>,
    scraped: Arc<watch::Sender<u64>>,
) {
    let gate = Gate::new(BUDGETS);
    let lot = Lot::new(MAX_PARKED);
    let mut connections = JoinSet::new();
    // What each connection watches (the loop's own receiver is borrowed by its wait).
    let watch_stop = stop.clone();
    loop {
        tokio::select! {
            // Stopped, or the server handle is gone.
            () = stopped(&mut stop) => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted.and_then(|(s, peer)| Ok((Spare::of(s)?, peer))) {
                Ok(((stream, spare), peer)) => {
                    let (registry, scraped, stop, lot) =
                        (Arc::clone(&registry), Arc::clone(&scraped), watch_stop.clone(), lot.clone());
                    let ticket = gate.admit(peer);
                    connections.spawn(async move {
                        let served = match ticket {
                            Some(ticket) => connection(stream, registry, scraped, stop, ticket).await,
                            None => {
                                tracing::debug!(%peer, "metrics server: no room, parking a connection");
                                drop(stream);
                                Served::MadeWay
                            }
                        };
                        if served == Served::MadeWay {
                            spare.park(&lot, CONNECTION_LIFETIME).await;
                        }
                    });
                }
                Err(e) => {
                    // Out of descriptors, most likely: parked connections give theirs back first.
                    tracing::warn!(error = %e, "metrics server: accept failed");
                    if lot.shed(BUDGETS.max_pending) == 0 {
                        tokio::time::sleep(ACCEPT_PAUSE).await;
                    }
                }
            },
        }
    }
    drop(listener);
    lot.close();
    while connections.join_next().await.is_some() {}
}

/// How a connection's service ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    /// It ended (the client, its lifetime, a timeout, the server's stop): close it.
    Ended,
    /// It made way for another: park it.
    MadeWay,
}

/// Returns once the server is stopped or its handle is gone.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    // The guard it returns is dropped here, before any other await.
    let _ = stop.wait_for(|&s| s).await;
}

/// Serves one connection until the client closes it, its lifetime ends, it is evicted or the
/// server stops.
async fn connection(
    stream: TcpStream,
    registry: Arc<Registry>,
    scraped: Arc<watch::Sender<u64>>,
    mut stop: watch::Receiver<bool>,
    mut ticket: Ticket,
) -> Served {
    let phases = ticket.handle();
    let service = service_fn(move |req| {
        // Established by its first complete request headers; the answer is written at once.
        let response = match phases.promote() {
            Promotion::Established => respond(&req, &registry, &scraped),
            Promotion::Full | Promotion::Gone => status(StatusCode::SERVICE_UNAVAILABLE),
        };
        phases.set(Phase::Waiting);
        async move { Ok::<_, Infallible>(response) }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_BUF)
        .serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        ended = conn.as_mut() => {
            if let Err(e) = ended {
                tracing::debug!(error = %e, "metrics server: connection ended");
            }
            return Served::Ended;
        }
        () = stopped(&mut stop) => {}
        () = tokio::time::sleep(CONNECTION_LIFETIME) => {}
        () = ticket.evicted() => return Served::MadeWay,
    }
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(GRACE, conn).await;
    Served::Ended
}

fn respond(
    req: &Request<Incoming>,
    registry: &Registry,
    scraped: &watch::Sender<u64>,
) -> Response<Full<Bytes>> {
    if req.uri().path() != "/metrics" {
        return status(StatusCode::NOT_FOUND);
    }
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        let mut response = status(StatusCode::METHOD_NOT_ALLOWED);
        response.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    // Counted before the registry is read: a scrape counted after a caller looked at the count
    // reads what the caller had recorded by then.
    scraped.send_modify(|n| *n += 1);
    let mut response = Response::new(Full::new(Bytes::from(super::encode(registry))));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    response
}

fn status(code: StatusCode) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = code;
    response
}
