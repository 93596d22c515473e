//! The target's side: the agent's listener and the connections peers open to it.
//!
//! Connections are admitted as every kvx server admits them ([`kvx_net::admission`]): a
//! [`Gate`] with the configured budgets, pending until the session's opening proves the peer
//! (its key, and that it means this agent and instance), then established; a connection that
//! makes way for another is parked in the [`Lot`]. An established connection serves its
//! requests one at a time, in order: a READ is answered from this agent's live registrations
//! straight from the memory, a WRITE's data is received straight into them, and a notification
//! is queued for `drain_notifications`. A frame it does not take drops the connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

use kvx_core::wire::agent_metadata::check_agent_name;
use kvx_core::{AgentName, Error, ErrorKind};
use kvx_net::admission::{Gate, Lot, Phase, Promotion, Ticket};
use kvx_net::session::accept_opening;

use crate::error::{TcpError, err};
use crate::frame::{HEADER_LEN, Header, Kind, Limits, OK, REFUSED, decode_ranges};
use crate::inner::{Counters, Inner};
use crate::link::{Opening, discard};

/// Connections the accept loop takes before it lets the others run.
const ACCEPTS_PER_TURN: usize = 32;

/// Accepts connections until the runtime shuts down.
pub(crate) async fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    let limits = *inner.config.limits();
    let gate = Gate::new(limits.budgets());
    let lot = Lot::new(limits.max_parked);
    let min_backoff = Duration::from_millis(1);
    let mut backoff = min_backoff;
    let mut turn = 0;
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                backoff = min_backoff;
                Counters::bump(&inner.stats.connections_accepted);
                let ticket = gate.admit(peer);
                inner.runtime.spawn(connection(Arc::clone(&inner), stream, peer, ticket, lot.clone()));
                turn += 1;
                if turn == ACCEPTS_PER_TURN {
                    turn = 0;
                    tokio::task::yield_now().await;
                }
            }
            Err(e) => {
                // Out of file descriptors, most likely: parked connections give theirs back
                // first; with none left, pause (doubling) so that this loop does not spin.
                let shed = lot.shed(ACCEPTS_PER_TURN);
                tracing::warn!(agent = %inner.name, "kvx-tcp: accept failed ({e}); closed {shed} parked connections");
                tokio::time::sleep(if shed > 0 { min_backoff } else { backoff }).await;
                if shed == 0 {
                    backoff = (backoff * 2).min(limits.max_accept_backoff.max(min_backoff));
                }
            }
        }
    }
}

/// How a connection ended.
#[derive(Debug)]
enum End {
    /// It made way for another: parked.
    MadeWay,
    /// The peer closed it between requests.
    Closed,
    /// It failed: closed with a reset.
    Failed(Error),
}

async fn connection(
    inner: Arc<Inner>,
    stream: TcpStream,
    peer: SocketAddr,
    ticket: Option<Ticket>,
    lot: Lot,
) {
    let _ = stream.set_nodelay(true);
    let (end, stream) = match ticket {
        Some(ticket) => serve(&inner, stream, ticket).await,
        None => (End::MadeWay, Some(stream)),
    };
    let Some(mut stream) = stream else { return };
    match end {
        End::MadeWay => {
            Counters::bump(&inner.stats.connections_parked);
            lot.hold(&mut stream, inner.config.limits().idle_timeout).await;
            let _ = stream.set_zero_linger();
        }
        End::Closed => {}
        End::Failed(e) => {
            Counters::bump(&inner.stats.connections_dropped);
            tracing::warn!(agent = %inner.name, %peer, "kvx-tcp: dropping a connection: {e}");
            let _ = stream.set_zero_linger();
        }
    }
}

/// Opens the session, then serves the connection; returns how it ended and the stream.
async fn serve(inner: &Inner, mut stream: TcpStream, mut ticket: Ticket) -> (End, Option<TcpStream>) {
    let limits = *inner.config.limits();
    let opening = accept_opening(
        &mut stream,
        inner.config.net.auth_key.clone(),
        limits.max_frame,
        limits.exchange_timeout,
        |body| check_opening(inner, &body).map(|from| (Vec::new(), from)),
    );
    let deadline = limits.handshake_timeout.saturating_sub(ticket.age());
    let opened = tokio::select! {
        opened = tokio::time::timeout(deadline, opening) => opened,
        () = ticket.evicted() => return (End::MadeWay, Some(stream)),
    };
    let from = match opened {
        Ok(Ok(from)) => from,
        Ok(Err(e)) => return (End::Failed(e), Some(stream)),
        Err(_) => {
            return (End::Failed(err(ErrorKind::Timeout, "the session opening timed out")), Some(stream));
        }
    };
    match ticket.promote() {
        Promotion::Established => {}
        Promotion::Full | Promotion::Gone => return (End::MadeWay, Some(stream)),
    }
    let (mut r, mut w) = stream.into_split();
    let end = serve_requests(inner, &from, &mut r, &mut w, &mut ticket).await;
    // The halves of one stream always reunite.
    (end, r.reunite(w).ok())
}

/// The peer's opening: it must mean this agent and instance, and name itself validly.
fn check_opening(inner: &Inner, body: &[u8]) -> kvx_core::Result<AgentName> {
    let opening: Opening = rmp_serde::from_slice(body)
        .map_err(|e| Error::invalid_peer_data(format!("a session opening that is not kvx-tcp's: {e}")))?;
    if opening.target != inner.name.as_str() || opening.instance != inner.instance {
        return Err(Error::new(
            ErrorKind::Handshake,
            format!("this is agent {} of another instance, or another agent: stale metadata", inner.name),
        ));
    }
    let from = AgentName::new(opening.agent);
    check_agent_name(&from).map_err(|e| Error::invalid_peer_data(e.message().to_owned()))?;
    Ok(from)
}

/// Serves requests until the connection ends.
async fn serve_requests(
    inner: &Inner,
    from: &AgentName,
    r: &mut OwnedReadHalf,
    w: &mut OwnedWriteHalf,
    ticket: &mut Ticket,
) -> End {
    let limits = inner.config.limits();
    loop {
        ticket.set(Phase::Waiting);
        let mut bytes = [0u8; HEADER_LEN];
        let read = tokio::select! {
            read = r.read_exact(&mut bytes) => read,
            () = ticket.evicted() => return End::MadeWay,
        };
        match read {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return End::Closed,
            Err(e) => return End::Failed(TcpError::Io(e).into()),
        }
        ticket.set(Phase::Busy);
        let served =
            tokio::time::timeout(limits.exchange_timeout, serve_one(inner, from, &bytes, r, w)).await;
        match served {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return End::Failed(e.into()),
            Err(_) => return End::Failed(TcpError::Timeout("serving a request").into()),
        }
    }
}

/// Serves the request whose header is `bytes`.
async fn serve_one(
    inner: &Inner,
    from: &AgentName,
    bytes: &[u8; HEADER_LEN],
    r: &mut OwnedReadHalf,
    w: &mut OwnedWriteHalf,
) -> Result<(), TcpError> {
    let max_data = inner.config.limits().max_frame as u64;
    let header = Header::decode(bytes, Limits { max_data })?;
    if !header.kind.to_target() {
        return Err(TcpError::Malformed(format!("a {:?} sent to the target", header.kind)));
    }
    let mut meta = vec![0u8; header.meta_len as usize];
    r.read_exact(&mut meta).await?;
    if header.kind == Kind::Notify {
        inner.deliver(from.clone(), meta);
        return Ok(());
    }
    let ranges = decode_ranges(&header, &meta)?;
    let total = ranges.iter().try_fold(0u64, |sum, &(_, len)| sum.checked_add(len));
    let total = total.filter(|&t| t <= max_data).ok_or(TcpError::Oversize {
        what: "ranges",
        len: u64::MAX,
        max: max_data,
    })?;
    let answer = |status, data_len| {
        let kind = if header.kind == Kind::ReadRequest { Kind::ReadData } else { Kind::WriteAck };
        Header {
            status,
            data_len,
            ..Header::new(kind, header.xfer, header.nonce, header.first, header.count)
        }
        .encode()
    };
    let memory = inner.pin_local(&ranges);
    if memory.is_none() {
        Counters::bump(&inner.stats.requests_refused);
    }
    match (header.kind, memory) {
        (Kind::ReadRequest, Some(memory)) => memory.send(&answer(OK, total), w).await?,
        (Kind::WriteRequest, memory) => {
            if header.data_len != total {
                return Err(TcpError::Malformed(format!(
                    "{} bytes of data for {total} bytes of ranges",
                    header.data_len
                )));
            }
            let status = match memory {
                Some(memory) => {
                    memory.receive(r).await?;
                    OK
                }
                None => {
                    discard(r, total).await?;
                    REFUSED
                }
            };
            w.write_all(&answer(status, 0)).await?;
        }
        _ => w.write_all(&answer(REFUSED, 0)).await?,
    }
    Ok(())
}
