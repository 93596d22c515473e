//! A bounded request/response server: the side channel, the group's rank 0 and the `kvx` request
//! API all run on it.
//!
//! Each connection is its own task and holds one request at a time: it reads a frame (bounded by
//! `max_frame`; its first byte within `handshake_timeout` of the accept while the connection is not
//! proven, within `idle_timeout` after, and the rest within `exchange_timeout`), runs the session
//! step and the [`Service`], writes the answer (within `exchange_timeout`), and only then reads the
//! next frame. A peer that pipelines requests and never reads fills its own socket buffers and is
//! dropped when its reply cannot be written; nothing is queued for it. Connection slots are shared
//! out by the [`admission`](crate::admission) policy: a newcomer evicts the oldest unproven
//! connection, or on proving itself the idlest established one, instead of being refused; the
//! connection that makes way is parked in the server's [`Lot`], not closed. A connection older
//! than `max_lifetime` is closed when it next waits. A failed `accept` (out of file descriptors)
//! closes the oldest parked connections, or when there are none pauses the accept loop 1 ms,
//! doubling up to `max_accept_backoff`, so it does not spin. Every connection's end is counted in
//! [`ServerStats`] by reason and logged.

use async_trait::async_trait;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::admission::{Gate, GateStats, Lot, Phase, Promotion, Ticket};
use crate::frame::{FrameError, read_frame, write_frame};
use crate::session::{Refusal, ServerSession, SessionReply, Step, served_reply};
use crate::{NetConfig, ServeLimits, endpoint};
use kvx_core::auth::AuthKey;
use kvx_core::error::{Error, ErrorKind, Result};
use kvx_core::wire;

/// Who sent a request: what a [`Service`] may hold a request's sender to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// The connection, unique within the server for its lifetime: a service that binds state to
    /// a connection (a rank that joined on it) checks later requests against this.
    pub connection: u64,
    /// The peer's address.
    pub peer: SocketAddr,
    /// Whether the connection proved the deployment's key (never, on a server without one).
    pub authenticated: bool,
}

/// What a server does with each request.
#[async_trait]
pub trait Service: Send + Sync + 'static {
    /// Answers one request from `caller`. An error is sent to the client as a refusal and closes
    /// the connection: `Unauthenticated` counts as such, `Wire`, `InvalidPeerData` and
    /// `Incompatible` as malformed, any other kind as rejected.
    async fn call(&self, caller: &Caller, request: Vec<u8>) -> Result<Vec<u8>>;
}

/// A server's counters. Every accepted connection is counted in exactly one of `refused`,
/// `closed`, `idle`, `slow`, `unproven`, `expired`, `evicted`, `full`, `oversize`, `truncated`,
/// `malformed`, `unauthenticated`, `rejected`, `io` and `shutdown` when it ends or is parked (for
/// the first three), and in `active` while it is open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections parked at once, unserved: every unproven connection that could have made way
    /// was being served.
    pub refused: u64,
    /// Failed `accept` calls (each followed by closing parked connections, or a pause).
    pub accept_errors: u64,
    /// Connections open now, parked ones included.
    pub active: u64,
    /// Connections parked now: dismissed for room (`refused`, `evicted` or `full`) and held open,
    /// unserved, until their peer closes them or the lot needs their place.
    pub parked: u64,
    /// Requests answered.
    pub requests: u64,
    /// Connections the peer closed between requests.
    pub closed: u64,
    /// Connections dropped after `idle_timeout` without a request.
    pub idle: u64,
    /// Connections dropped for not proving themselves within `handshake_timeout`.
    pub unproven: u64,
    /// Connections closed at `max_lifetime`.
    pub expired: u64,
    /// Connections evicted (and parked) to make room for another.
    pub evicted: u64,
    /// Connections parked on proving themselves because every established connection that could
    /// have made way was being served.
    pub full: u64,
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
    Refused,
    Closed,
    Idle,
    Unproven,
    Expired,
    Evicted,
    Full,
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
            End::Refused => &mut s.refused,
            End::Closed => &mut s.closed,
            End::Idle => &mut s.idle,
            End::Unproven => &mut s.unproven,
            End::Expired => &mut s.expired,
            End::Evicted => &mut s.evicted,
            End::Full => &mut s.full,
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

    /// Whether the server dismissed the connection without a last word (a refusal it wrote must
    /// reach the peer, so those close gracefully).
    fn is_dismissal(self) -> bool {
        self.is_for_room()
            || matches!(self, End::Idle | End::Unproven | End::Expired | End::Slow | End::Oversize)
    }

    /// Whether the connection made way for another: it is parked, not closed.
    fn is_for_room(self) -> bool {
        matches!(self, End::Refused | End::Evicted | End::Full)
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
    gate: Gate,
    lot: Lot,
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
    gate: Gate,
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
        let listener = crate::listen(host, port).await.map_err(|e| {
            Error::new(ErrorKind::Io, format!("binding {name} on {}: {e}", endpoint(host, port)))
                .with_source(e)
        })?;
        let addr = listener.local_addr()?;
        let (stats, _) = watch::channel(ServerStats::default());
        let (shutdown, shutdown_rx) = watch::channel(false);
        let gate = Gate::new(config.limits.budgets());
        let shared = Arc::new(Shared {
            service,
            key: config.auth_key.clone(),
            limits: config.limits,
            name,
            stats: stats.clone(),
            shutdown: shutdown_rx,
            warnings: Warnings::default(),
            gate: gate.clone(),
            lot: Lot::new(config.limits.max_parked),
        });
        let accept = tokio::spawn(accept_loop(listener, shared));
        debug!(name, %addr, "serving");
        Ok(Server { addr, name, gate, stats, shutdown, accept })
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

    /// The connections its admission policy holds now, pending and established.
    pub fn connections(&self) -> GateStats {
        self.gate.stats()
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

/// Connections the accept loop takes before it lets the others run.
const ACCEPTS_PER_TURN: u32 = 32;

async fn accept_loop<S: Service>(listener: TcpListener, shared: Arc<Shared<S>>) {
    let min_backoff = Duration::from_millis(1);
    let mut backoff = min_backoff;
    let mut accepted_in_turn = 0;
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                backoff = min_backoff;
                let ticket = shared.gate.admit(peer);
                shared.stats.send_modify(|s| {
                    s.accepted += 1;
                    s.active += 1;
                });
                let shared = Arc::clone(&shared);
                tokio::spawn(async move {
                    let mut stream = stream;
                    let end = match ticket {
                        Some(ticket) => serve_connection(&mut stream, peer, ticket, &shared).await,
                        None => End::Refused,
                    };
                    shared.stats.send_modify(|s| end.count(s));
                    if end.is_for_room() {
                        park(&mut stream, &shared).await;
                    }
                    if end.is_dismissal() {
                        // Closed with a reset: a flood of dismissed connections leaves no
                        // TIME_WAIT behind to use up the 4-tuples its peers connect on.
                        let _ = stream.set_zero_linger();
                    }
                    drop(stream);
                    match end {
                        End::Closed | End::Shutdown => {
                            debug!(name = shared.name, %peer, ?end, "connection ended")
                        }
                        _ => shared
                            .warnings
                            .warn(shared.name, format_args!("connection from {peer} dropped: {end:?}")),
                    }
                    shared.stats.send_modify(|s| s.active -= 1);
                });
                // Let the connections just accepted read what they were sent before many more
                // come: a peer whose request is already in proves itself ahead of a flood of
                // newer connections (well within `max_pending` of them), while a backlog of
                // connections still drains in few turns of the runtime.
                accepted_in_turn += 1;
                if accepted_in_turn == ACCEPTS_PER_TURN {
                    accepted_in_turn = 0;
                    tokio::task::yield_now().await;
                }
            }
            Err(e) => {
                // EMFILE, ENFILE, ENOBUFS, a connection reset before it was accepted: the
                // listener stays. Parked connections give their descriptors back first; with
                // none left, pause so that a lasting condition does not spin this loop.
                shared.stats.send_modify(|s| s.accept_errors += 1);
                let shed = shared.lot.shed(ACCEPTS_PER_TURN as usize);
                let pause = if shed > 0 { min_backoff } else { backoff };
                shared.warnings.warn(
                    shared.name,
                    format_args!("accept failed ({e}); closed {shed} parked connections, pausing {pause:?}"),
                );
                tokio::time::sleep(pause).await;
                if shed == 0 {
                    backoff = (backoff * 2).min(shared.limits.max_accept_backoff.max(min_backoff));
                }
            }
        }
    }
}

/// Holds a connection that made way for another open and unserved, counted as parked, until the
/// lot lets it go (see [`Lot::hold`]) or the server shuts down.
async fn park<S: Service>(stream: &mut TcpStream, shared: &Shared<S>) {
    shared.stats.send_modify(|s| s.parked += 1);
    let mut shutdown = shared.shutdown.clone();
    tokio::select! {
        () = shared.lot.hold(stream, shared.limits.idle_timeout) => {}
        _ = shutdown.wait_for(|stop| *stop) => {}
    }
    shared.stats.send_modify(|s| s.parked -= 1);
}

/// Reads the next request frame, keeping the gate told of the connection's phase. Its first byte
/// must come within `handshake_timeout` of the accept while the connection is not proven, within
/// `idle_timeout` (and before `max_lifetime`) once it is; the rest within `exchange_timeout` (and,
/// unproven, still before the handshake deadline).
async fn next_frame(
    stream: &mut TcpStream,
    ticket: &mut Ticket,
    proven: bool,
    limits: &ServeLimits,
    shutdown: &mut watch::Receiver<bool>,
) -> std::result::Result<Vec<u8>, End> {
    let (first, late) = if proven {
        let left = limits.max_lifetime.saturating_sub(ticket.age());
        if left < limits.idle_timeout { (left, End::Expired) } else { (limits.idle_timeout, End::Idle) }
    } else {
        (limits.handshake_timeout.saturating_sub(ticket.age()), End::Unproven)
    };
    let mut byte = [0u8; 1];
    tokio::select! {
        peeked = tokio::time::timeout(first, stream.peek(&mut byte)) => match peeked {
            Err(_) => return Err(late),
            Ok(Err(_)) => return Err(End::Io),
            Ok(Ok(_)) => {}
        },
        _ = shutdown.wait_for(|stop| *stop) => return Err(End::Shutdown),
        () = ticket.evicted() => return Err(End::Evicted),
    }
    ticket.set(Phase::Reading);
    let rest = if proven {
        limits.exchange_timeout
    } else {
        limits.exchange_timeout.min(limits.handshake_timeout.saturating_sub(ticket.age()))
    };
    let frame = tokio::select! {
        frame = read_frame(stream, limits.max_frame, rest, rest) => frame,
        _ = shutdown.wait_for(|stop| *stop) => return Err(End::Shutdown),
        () = ticket.evicted() => return Err(End::Evicted),
    };
    frame.map_err(|e| match e {
        FrameError::Idle | FrameError::Slow if !proven => End::Unproven,
        e => End::of_frame(&e),
    })
}

async fn serve_connection<S: Service>(
    stream: &mut TcpStream,
    peer: SocketAddr,
    mut ticket: Ticket,
    shared: &Shared<S>,
) -> End {
    let _ = stream.set_nodelay(true);
    let limits = &shared.limits;
    let mut session = ServerSession::new(shared.key.clone());
    let mut shutdown = shared.shutdown.clone();
    let mut proven = false;
    loop {
        let frame = match next_frame(stream, &mut ticket, proven, limits, &mut shutdown).await {
            Ok(f) => f,
            Err(end) => {
                debug!(name = shared.name, ?end, "reading a request");
                return end;
            }
        };
        // Served from here until its answer is written: never evicted meanwhile.
        ticket.set(Phase::Busy);
        let (reply, end) = match session.on_frame(&frame) {
            Step::Send(reply) => (reply, None),
            Step::Refuse(refusal, reason) => {
                (SessionReply::Refused { refusal, reason }, Some(End::of_refusal(refusal)))
            }
            Step::Call { body, tag_with } => {
                if !proven {
                    match ticket.promote() {
                        Promotion::Established => proven = true,
                        Promotion::Full => return End::Full,
                        Promotion::Gone => return End::Evicted,
                    }
                }
                let caller = Caller { connection: ticket.id(), peer, authenticated: shared.key.is_some() };
                match shared.service.call(&caller, body).await {
                    Ok(body) => (served_reply(shared.key.as_ref(), body, tag_with), None),
                    Err(e) => {
                        let refusal = Refusal::of(e.kind());
                        debug!(name = shared.name, error = %e, "request refused");
                        let reason = e.message().to_owned();
                        (SessionReply::Refused { refusal, reason }, Some(End::of_refusal(refusal)))
                    }
                }
            }
        };
        let answered = matches!(reply, SessionReply::Reply { .. });
        let bytes = match wire::encode(&reply) {
            Ok(b) => b,
            Err(e) => {
                warn!(name = shared.name, error = %e, "encoding a reply");
                return End::Rejected;
            }
        };
        if let Err(e) = write_frame(stream, &bytes, limits.exchange_timeout).await {
            debug!(name = shared.name, error = %e, "writing a reply");
            return End::of_frame(&e);
        }
        ticket.set(Phase::Waiting);
        if answered {
            shared.stats.send_modify(|s| s.requests += 1);
        }
        if let Some(end) = end {
            return end;
        }
        // One request per turn: a peer that always has its next request in gets served in turn
        // with every other connection and the accept loop, not dozens of requests at a time.
        tokio::task::yield_now().await;
    }
}
