//! The router's HTTP server: its own accept loop in front of the axum routes, so that no number of
//! open, idle, half-sent or slow connections keeps a legitimate client out, and no number of
//! uploads makes it buffer more than a bounded total.
//!
//! - **Admission**: connection slots are shared out by kvx-core's policy
//!   ([`kvx_net::admission`]): a connection is pending from its accept until its first
//!   request's headers are complete, then established. Pending ones are at most
//!   `max_pending`, a newcomer evicting the oldest of the source with the most; each must complete
//!   its first request's headers within `header_timeout` of its accept. Established ones are at
//!   most `max_connections`, `max_per_source` from one source; a connection that proves itself
//!   when they are taken evicts the idlest one (one being served is never evicted; with every
//!   candidate served, it gets a 503 and is closed). A connection evicted or refused is parked (see
//!   the policy), not closed, for at most `idle_timeout`: a flood larger than the budgets does
//!   not turn over as fast as the router accepts, so the kernel's accept queue stays free for
//!   the clients it serves.
//! - **Timers**: a kept-alive connection is closed when its next request's headers are not
//!   complete within `idle_timeout` of its last answer, a request whose body is not complete within
//!   `body_timeout` of its headers gets a 408 and its connection is closed, and a connection older
//!   than `max_lifetime` is closed gracefully (after the answer in progress).
//! - **Bodies**: a body is read whole before its route runs, at most `max_body_bytes` (413 beyond,
//!   from its `Content-Length` before any of it is read). Each body's first [`FREE_BODY_BYTES`]
//!   are its own (bounded by the connection budgets); what it holds beyond them is drawn from one
//!   budget of `max_buffered_bytes` shared by all bodies, held until its route answered. A body that
//!   finds the budget spent gets a 503 at once and its connection is closed. So a flood of large
//!   uploads never keeps a small request out, nor grows the router beyond the budgets.
//!
//! Every connection dropped or refused is counted by reason in
//! `kvx_router_connections_dropped_total{reason}`.

use axum::body::Body;
use http_body_util::BodyExt;
use hyper::body::{Bytes, Frame, Incoming, SizeHint};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower_service::Service;

use kvx_net::admission::{Budgets, Gate, Lot, Phase, Promotion, Spare, Ticket, TicketHandle};

use super::metrics::{Metrics, ReasonLabels};

/// The bytes of each request body that do not count against the shared budget.
pub(crate) const FREE_BODY_BYTES: usize = 64 << 10;
/// The read buffer of a connection, which bounds a request's headers.
const MAX_BUF: usize = 64 << 10;
/// The longest pause after a failed `accept` (out of file descriptors); it starts at 1 ms.
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// How many connections the router holds, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The most established connections (their first request's headers complete).
    pub(crate) max_connections: usize,
    /// The most established connections from one source (IPv4 address, IPv6 /64).
    pub(crate) max_per_source: usize,
    /// The most connections whose first request's headers are not complete yet.
    pub(crate) max_pending: usize,
    /// A connection's first request's headers must be complete within this of its accept.
    pub(crate) header_timeout: Duration,
    /// A kept-alive connection's next request's headers must be complete within this of its last
    /// answer.
    pub(crate) idle_timeout: Duration,
    /// A request's body must be complete within this of its headers.
    pub(crate) body_timeout: Duration,
    /// A connection is closed gracefully once it is this old.
    pub(crate) max_lifetime: Duration,
    /// Bytes of request bodies buffered at once beyond each body's first [`FREE_BODY_BYTES`].
    pub(crate) max_buffered_bytes: usize,
    /// The most connections parked at once (the oldest is closed beyond).
    pub(crate) max_parked: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 1024,
            max_per_source: 512,
            max_pending: 128,
            header_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            max_lifetime: Duration::from_secs(600),
            max_buffered_bytes: 256 << 20,
            max_parked: 16_384,
        }
    }
}

impl Limits {
    fn budgets(&self) -> Budgets {
        Budgets {
            max_pending: self.max_pending,
            max_connections: self.max_connections,
            max_per_source: self.max_per_source,
        }
    }
}

/// Why a connection was dropped or refused, as `kvx_router_connections_dropped_total` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dropped {
    /// Closed at its accept: every pending connection was being served.
    Refused,
    /// Evicted to make room for another.
    Evicted,
    /// Closed with a 503 on proving itself: every established connection that could have made
    /// way was being served.
    Full,
    /// Its first request's headers were not complete within `header_timeout`.
    HeaderTimeout,
    /// Kept alive, its next request's headers were not complete within `idle_timeout`.
    IdleTimeout,
    /// A request's body was not complete within `body_timeout` (408).
    BodyTimeout,
    /// A request's body found the shared body budget spent (503).
    BodyBudget,
    /// A request's body was over `max_body_bytes` (413).
    BodyTooLarge,
    /// Closed gracefully at `max_lifetime`.
    Lifetime,
    /// Failed: a reset or broken connection, or bytes that are not HTTP/1.1.
    Error,
}

impl Dropped {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Dropped::Refused => "refused",
            Dropped::Evicted => "evicted",
            Dropped::Full => "full",
            Dropped::HeaderTimeout => "header_timeout",
            Dropped::IdleTimeout => "idle_timeout",
            Dropped::BodyTimeout => "body_timeout",
            Dropped::BodyBudget => "body_budget",
            Dropped::BodyTooLarge => "body_too_large",
            Dropped::Lifetime => "lifetime",
            Dropped::Error => "error",
        }
    }
}

/// What the router's servers share: limits, the body budget and their metrics.
#[derive(Debug)]
pub(crate) struct ServerState {
    limits: Limits,
    max_body_bytes: usize,
    /// How long an answer in progress may take once its connection is closing.
    grace: Duration,
    buffered: AtomicUsize,
    buffered_gauge: Gauge,
    dropped: Family<ReasonLabels, Counter>,
    open: Gauge,
}

impl ServerState {
    pub(crate) fn new(limits: Limits, max_body_bytes: usize, grace: Duration, metrics: &Metrics) -> Self {
        ServerState {
            limits,
            max_body_bytes,
            grace,
            buffered: AtomicUsize::new(0),
            buffered_gauge: metrics.buffered_body_bytes.clone(),
            dropped: metrics.connections_dropped.clone(),
            open: metrics.open_connections.clone(),
        }
    }

    fn count(&self, why: Dropped) {
        self.dropped.get_or_create(&ReasonLabels { reason: why.name() }).inc();
    }

    /// Takes `bytes` from the body budget, if it has them.
    fn take(&self, bytes: usize) -> bool {
        let limit = self.limits.max_buffered_bytes;
        let taken = self
            .buffered
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= limit)
            })
            .is_ok();
        if taken {
            self.buffered_gauge.inc_by(bytes as i64);
        }
        taken
    }

    fn give(&self, bytes: usize) {
        self.buffered.fetch_sub(bytes, Ordering::AcqRel);
        self.buffered_gauge.dec_by(bytes as i64);
    }
}

/// Bytes a body holds of the shared budget, given back when dropped.
struct Charge {
    state: Arc<ServerState>,
    bytes: usize,
}

impl Charge {
    fn add(&mut self, bytes: usize) -> bool {
        if bytes == 0 {
            return true;
        }
        let taken = self.state.take(bytes);
        if taken {
            self.bytes += bytes;
        }
        taken
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.state.give(self.bytes);
        }
    }
}

/// Serves `app` on `listener` until `stop` turns true, then closes every connection gracefully
/// and returns once they are closed (an answer in progress finishes first).
pub(crate) async fn serve(
    listener: TcpListener,
    app: axum::Router,
    state: Arc<ServerState>,
    mut stop: watch::Receiver<bool>,
) -> kvx_core::Result<()> {
    let gate = Gate::new(state.limits.budgets());
    let lot = Lot::new(state.limits.max_parked);
    let mut connections = JoinSet::new();
    let watch_stop = stop.clone();
    let mut backoff = Duration::ZERO;
    loop {
        tokio::select! {
            () = stopped(&mut stop) => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted.map(|(s, peer)| (Spare::of(s), peer)) {
                // Accepted, but its spare could not be made (descriptors short): dropped and
                // counted, and parked connections give their descriptors back.
                Ok((Err(_), _)) => {
                    state.count(Dropped::Error);
                    lot.shed(state.limits.max_pending.max(1));
                }
                Ok((Ok((stream, spare)), peer)) => {
                    backoff = Duration::ZERO;
                    let ticket = gate.admit(peer);
                    let (app, state, stop, lot) = (app.clone(), state.clone(), watch_stop.clone(), lot.clone());
                    connections.spawn(async move {
                        let served = match ticket {
                            Some(ticket) => connection(stream, ticket, app, state.clone(), stop).await,
                            None => {
                                state.count(Dropped::Refused);
                                drop(stream);
                                Served::MadeWay
                            }
                        };
                        if served == Served::MadeWay {
                            spare.park(&lot, state.limits.idle_timeout).await;
                        }
                    });
                }
                Err(e) => {
                    // Out of file descriptors, most likely: parked connections give theirs back
                    // first; with none, pause rather than spin.
                    if lot.shed(state.limits.max_pending.max(1)) > 0 {
                        continue;
                    }
                    backoff = (backoff * 2).clamp(Duration::from_millis(1), MAX_ACCEPT_BACKOFF);
                    if backoff == MAX_ACCEPT_BACKOFF {
                        eprintln!("kvx router: accept failed: {e}");
                    }
                    tokio::time::sleep(backoff).await;
                }
            },
        }
    }
    drop(listener);
    lot.close();
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// How a connection's service ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    /// It ended (the client, a timer, its lifetime, the router's stop): close it.
    Ended,
    /// It made way for another: park it.
    MadeWay,
}

/// Returns once the server is stopped or its handle is gone.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|&s| s).await;
}

/// Counts an open connection while it lives.
struct Open(Gauge);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Serves one connection until the client closes it, it is evicted or dropped by a timer, its
/// lifetime ends or the server stops.
async fn connection(
    stream: TcpStream,
    mut ticket: Ticket,
    app: axum::Router,
    state: Arc<ServerState>,
    mut stop: watch::Receiver<bool>,
) -> Served {
    state.open.inc();
    let _open = Open(state.open.clone());
    let limits = state.limits;
    // The requests promote the connection and tell the gate its phase themselves.
    let phases = ticket.handle();
    let service = {
        let state = state.clone();
        service_fn(move |request| handle(request, app.clone(), state.clone(), phases.clone()))
    };
    let _ = stream.set_nodelay(true);
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout)
        .max_buf_size(MAX_BUF)
        .serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    let accepted = Instant::now();
    let handshake = accepted + limits.header_timeout;
    let expiry = accepted + limits.max_lifetime;
    // Whether the handshake deadline is behind it (the connection was established by then).
    let mut proven = false;
    let mut closing: Option<Instant> = None;
    loop {
        tokio::select! {
            // An eviction first: a request that found its connection evicted answers and ends the
            // connection, which then counts as evicted.
            biased;
            () = ticket.evicted() => {
                state.count(Dropped::Evicted);
                return Served::MadeWay;
            }
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    state.count(match (e.is_timeout(), ticket.is_established()) {
                        (true, true) => Dropped::IdleTimeout,
                        (true, false) => Dropped::HeaderTimeout,
                        (false, _) => Dropped::Error,
                    });
                }
                return Served::Ended;
            }
            () = tokio::time::sleep_until(handshake), if !proven => {
                if !ticket.is_established() {
                    state.count(Dropped::HeaderTimeout);
                    return Served::Ended;
                }
                proven = true;
            }
            () = tokio::time::sleep_until(expiry), if closing.is_none() => {
                state.count(Dropped::Lifetime);
                conn.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + state.grace);
            }
            () = stopped(&mut stop), if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + state.grace);
            }
            () = tokio::time::sleep_until(closing.unwrap_or(expiry)), if closing.is_some() => return Served::Ended,
        }
    }
}

/// Why a request was answered by the server itself, before its route.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    Dropped(Dropped),
    /// The body broke off (the client went away or sent a malformed body).
    Broken,
}

impl Refusal {
    fn response(self, phases: &TicketHandle) -> Response<Tracked> {
        let (status, message) = match self {
            Refusal::Dropped(Dropped::Full) => {
                (StatusCode::SERVICE_UNAVAILABLE, "too many connections are being served")
            }
            Refusal::Dropped(Dropped::BodyBudget) => {
                (StatusCode::SERVICE_UNAVAILABLE, "too many request bodies are being received")
            }
            Refusal::Dropped(Dropped::BodyTooLarge) => {
                (StatusCode::PAYLOAD_TOO_LARGE, "request body too large")
            }
            Refusal::Dropped(Dropped::BodyTimeout) => {
                (StatusCode::REQUEST_TIMEOUT, "the request body did not arrive in time")
            }
            Refusal::Dropped(_) | Refusal::Broken => (StatusCode::BAD_REQUEST, "the request body broke off"),
        };
        let kind = if status.is_server_error() { "service_unavailable" } else { "invalid_request_error" };
        let error = serde_json::json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
        let mut response = Response::new(Body::from(error.to_string()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        // The body was not read whole: the connection cannot carry another request.
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response.map(|body| Tracked { body, phases: phases.clone() })
    }
}

/// Serves one request: promotes its connection, reads its body within the limits, runs its route.
async fn handle(
    request: Request<Incoming>,
    mut app: axum::Router,
    state: Arc<ServerState>,
    phases: TicketHandle,
) -> Result<Response<Tracked>, Infallible> {
    // Reading from now: its idleness counts from this request, not from its accept.
    phases.set(Phase::Reading);
    match phases.promote() {
        Promotion::Established => {}
        Promotion::Full => {
            state.count(Dropped::Full);
            return Ok(Refusal::Dropped(Dropped::Full).response(&phases));
        }
        // Evicted (counted by its connection, which closes).
        Promotion::Gone => return Ok(Refusal::Dropped(Dropped::Full).response(&phases)),
    }
    let (parts, body) = request.into_parts();
    let (body, charge) = match read_body(body, &parts.headers, &state).await {
        Ok(read) => read,
        Err(refusal) => {
            if let Refusal::Dropped(why) = refusal {
                state.count(why);
            }
            return Ok(refusal.response(&phases));
        }
    };
    phases.set(Phase::Busy);
    let response = match app.call(Request::from_parts(parts, Body::from(body))).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    drop(charge);
    Ok(response.map(|body| Tracked { body, phases }))
}

/// The request's `Content-Length`, when it has a valid one.
fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// Reads a request's body whole within `body_timeout`, at most `max_body_bytes`, drawing what its
/// buffer allocates beyond [`FREE_BODY_BYTES`] from the shared budget.
async fn read_body(
    mut body: Incoming,
    headers: &HeaderMap,
    state: &Arc<ServerState>,
) -> Result<(Bytes, Charge), Refusal> {
    let max = state.max_body_bytes;
    if content_length(headers).is_some_and(|n| n > max as u64) {
        return Err(Refusal::Dropped(Dropped::BodyTooLarge));
    }
    let deadline = Instant::now() + state.limits.body_timeout;
    let mut charge = Charge { state: state.clone(), bytes: 0 };
    let mut whole: Vec<u8> = Vec::new();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(Refusal::Dropped(Dropped::BodyTimeout)),
            Ok(None) => break,
            Ok(Some(Err(_))) => return Err(Refusal::Broken),
            Ok(Some(Ok(frame))) => frame,
        };
        // Trailers are ignored.
        let Ok(data) = frame.into_data() else { continue };
        let len = whole.len() + data.len();
        if len > max {
            return Err(Refusal::Dropped(Dropped::BodyTooLarge));
        }
        // The budget counts what the buffer allocates, which grows by doubling up to the limit.
        let held = whole.capacity();
        if len > held {
            let grown = len.max(held.saturating_mul(2)).min(max);
            let beyond = grown.saturating_sub(FREE_BODY_BYTES) - held.saturating_sub(FREE_BODY_BYTES);
            if !charge.add(beyond) {
                return Err(Refusal::Dropped(Dropped::BodyBudget));
            }
            whole.reserve_exact(grown - whole.len());
        }
        whole.extend_from_slice(&data);
    }
    Ok((whole.into(), charge))
}

/// An answer's body, which tells its connection when it is written (or dropped): the connection
/// then waits for its next request.
struct Tracked {
    body: Body,
    phases: TicketHandle,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.phases.set(Phase::Waiting);
    }
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
