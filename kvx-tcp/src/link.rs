//! The initiator's side: a loaded peer ([`Peer`]) and its connections ([`Link`]s), each a task
//! that connects and opens the session, writes the requests it is handed in order, and a task
//! that reads their answers, checks each against the request it waits for next on that
//! connection, and receives READ data straight into the transfer's slots.
//!
//! A connection that fails (the socket, or a frame the peer should not have sent) is dropped: the
//! chunks waiting on it fail their transfers with `Transfer`, and the peer's next request opens a
//! new one in its place.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, watch};

use kvx_core::{AgentName, Error, ErrorKind, Result};
use kvx_net::Connection;

use crate::error::{TcpError, err};
use crate::frame::{HEADER_LEN, Header, Kind, Limits, REFUSED};
use crate::inner::{Counters, Event, Inner};
use crate::memio::Pinned;
use crate::metadata::RemoteRegion;

/// What a client sends in the session's first request: who it is and whom it means to reach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Opening {
    /// The connecting agent (the sender of the notifications that come over the connection).
    pub(crate) agent: String,
    /// The agent it means to reach, and that agent's instance, from its metadata.
    pub(crate) target: String,
    pub(crate) instance: u64,
}

/// A loaded peer: where it listens and its connections, opened as they are first needed.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) name: AgentName,
    instance: u64,
    host: String,
    port: u16,
    /// Its registrations, as its metadata describes them.
    pub(crate) regions: Vec<RemoteRegion>,
    links: Mutex<Vec<Option<Arc<Link>>>>,
    next: AtomicUsize,
}

/// One connection's handle: its requests go to its writer task in order.
#[derive(Debug)]
pub(crate) struct Link {
    tx: mpsc::UnboundedSender<Command>,
    dead: watch::Sender<bool>,
}

/// What a connection's writer sends.
#[derive(Debug)]
pub(crate) enum Command {
    /// Chunk `expect.chunk` of a transfer: header and ranges, then (a WRITE) the local data.
    Request { head: Vec<u8>, data: Option<Pinned>, expect: Expect },
    /// A notification frame.
    Notify(Vec<u8>),
}

/// The answer a request waits for: the connection takes answers in the order of its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Expect {
    pub(crate) kind: Kind,
    pub(crate) xfer: u64,
    pub(crate) nonce: u64,
    pub(crate) chunk: usize,
    pub(crate) first: u32,
    pub(crate) count: u32,
    /// Bytes of data a READ's answer carries.
    pub(crate) len: u64,
}

impl Expect {
    /// Whether `h` is this answer (a READ's data of exactly the length asked, or a refusal).
    fn matches(&self, h: &Header) -> bool {
        let len = if h.status == REFUSED || self.kind == Kind::WriteAck { 0 } else { self.len };
        (h.kind, h.xfer, h.nonce, h.first, h.count, h.data_len)
            == (self.kind, self.xfer, self.nonce, self.first, self.count, len)
    }
}

impl Command {
    /// Fails a command that never reached the wire: both events of its chunk.
    fn fail(self, inner: &Inner, why: &Error) {
        match self {
            Command::Request { expect, .. } => {
                for event in [Event::Sent, Event::Answered] {
                    inner.chunk_event(expect.xfer, expect.chunk, event, Err(why.clone()));
                }
            }
            Command::Notify(_) => {
                tracing::debug!("kvx-tcp: a notification is lost: {why}");
                inner.notification_gone();
            }
        }
    }
}

impl Peer {
    pub(crate) fn new(
        name: AgentName,
        instance: u64,
        host: String,
        port: u16,
        connections: usize,
        regions: Vec<RemoteRegion>,
    ) -> Peer {
        Peer {
            name,
            instance,
            host,
            port,
            regions,
            links: Mutex::new(vec![None; connections.max(1)]),
            next: AtomicUsize::new(0),
        }
    }

    /// Opens every connection now (in the background), so that the first transfer finds them.
    pub(crate) fn connect_all(self: &Arc<Self>, inner: &Arc<Inner>) {
        let n = self.links.lock().unwrap_or_else(PoisonError::into_inner).len();
        for i in 0..n {
            self.link(inner, i);
        }
    }

    /// Where to send `count` chunks: the first connection to use (connections are taken in turn).
    pub(crate) fn spread(&self, count: usize) -> usize {
        self.next.fetch_add(count, Ordering::Relaxed)
    }

    /// Connection `i` (modulo their number), opened again if it was lost.
    pub(crate) fn link(self: &Arc<Self>, inner: &Arc<Inner>, i: usize) -> Arc<Link> {
        let mut links = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        let n = links.len();
        let slot = &mut links[i % n];
        if let Some(link) = slot.as_ref().filter(|l| !*l.dead.borrow()) {
            return Arc::clone(link);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let (dead, _) = watch::channel(false);
        let link = Arc::new(Link { tx, dead });
        *slot = Some(Arc::clone(&link));
        inner.runtime.spawn(run(Arc::clone(inner), Arc::clone(self), Arc::clone(&link), rx));
        link
    }

    /// Sends `cmd` on connection `i`; a command its connection cannot take fails its chunk.
    pub(crate) fn send(self: &Arc<Self>, inner: &Arc<Inner>, i: usize, cmd: Command) {
        if let Err(mpsc::error::SendError(cmd)) = self.link(inner, i).tx.send(cmd) {
            cmd.fail(inner, &lost(&self.name, "its connection closed"));
        }
    }

    /// Sends a notification on the next connection in turn.
    pub(crate) fn notify(&self, inner: &Inner, msg: Vec<u8>) -> Result<()> {
        let header = Header { meta_len: msg.len() as u32, ..Header::new(Kind::Notify, 0, 0, 0, 0) };
        let mut frame = header.encode().to_vec();
        frame.extend_from_slice(&msg);
        let i = self.spread(1);
        // A notification of a transfer settling comes from an I/O task holding `inner` by
        // reference: the link is looked up, and opened only from the agent's calls.
        let links = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        let n = links.len();
        let live = (0..n).filter_map(|k| links[(i + k) % n].as_ref()).find(|l| !*l.dead.borrow());
        inner.notification_queued();
        match live.map(|l| l.tx.send(Command::Notify(frame))) {
            Some(Ok(())) => Ok(()),
            _ => {
                inner.notification_gone();
                Err(lost(&self.name, "no connection is open"))
            }
        }
    }
}

fn lost(peer: &AgentName, why: &str) -> Error {
    err(ErrorKind::Transfer, format!("agent {peer}: {why}"))
}

/// One connection's life: connect and open the session, then write requests while a reader task
/// takes the answers; when either fails, the chunks it still has fail and the connection closes.
async fn run(inner: Arc<Inner>, peer: Arc<Peer>, link: Arc<Link>, mut rx: mpsc::UnboundedReceiver<Command>) {
    let why = match connect(&inner, &peer).await {
        Ok(stream) => {
            Counters::bump(&inner.stats.connections_opened);
            let (r, w) = stream.into_split();
            let fifo = Arc::new(Mutex::new(Fifo::default()));
            let reader = inner.runtime.spawn(read_answers(
                Arc::clone(&inner),
                Arc::clone(&peer),
                r,
                Arc::clone(&fifo),
                Arc::clone(&link),
            ));
            let why = write_requests(&inner, w, &mut rx, &fifo, link.dead.subscribe()).await;
            link.dead.send_replace(true);
            let _ = reader.await;
            why
        }
        Err(e) => e,
    };
    link.dead.send_replace(true);
    rx.close();
    while let Ok(cmd) = rx.try_recv() {
        cmd.fail(&inner, &why);
    }
}

/// Connects to the peer and opens the session (with the key, if any), within the handshake
/// timeout.
async fn connect(inner: &Inner, peer: &Peer) -> std::result::Result<TcpStream, Error> {
    let opening = Opening {
        agent: inner.name.as_str().to_owned(),
        target: peer.name.as_str().to_owned(),
        instance: peer.instance,
    };
    let body = rmp_serde::to_vec_named(&opening).map_err(|e| err(ErrorKind::Wire, e.to_string()))?;
    let open = async {
        let mut conn = Connection::connect(&peer.host, peer.port, &inner.config.net).await?;
        conn.request(body).await?;
        Ok::<_, Error>(conn.into_stream())
    };
    match tokio::time::timeout(inner.config.limits().handshake_timeout, open).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(e)) => Err(lost(&peer.name, &format!("connecting: {e}")).with_source(e)),
        Err(_) => Err(lost(&peer.name, "connecting timed out")),
    }
}

/// The answers a connection waits for, in order; `closed` once the reader gave up on it.
#[derive(Debug, Default)]
struct Fifo {
    waiting: VecDeque<Expect>,
    closed: Option<Error>,
}

async fn write_requests(
    inner: &Arc<Inner>,
    mut w: OwnedWriteHalf,
    rx: &mut mpsc::UnboundedReceiver<Command>,
    fifo: &Mutex<Fifo>,
    mut dead: watch::Receiver<bool>,
) -> Error {
    let limit = inner.config.limits().exchange_timeout;
    loop {
        let cmd = tokio::select! {
            cmd = rx.recv() => cmd,
            _ = dead.wait_for(|d| *d) => None,
        };
        let Some(cmd) = cmd else {
            let closed = fifo.lock().unwrap_or_else(PoisonError::into_inner).closed.clone();
            return closed.unwrap_or_else(|| err(ErrorKind::Transfer, "the connection closed"));
        };
        let (head, data, expect) = match cmd {
            Command::Request { head, data, expect } => (head, data, Some(expect)),
            Command::Notify(frame) => (frame, None, None),
        };
        if let Some(expect) = expect {
            let mut f = fifo.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(why) = f.closed.clone() {
                drop(f);
                Command::Request { head, data, expect }.fail(inner, &why);
                continue;
            }
            f.waiting.push_back(expect);
        }
        let write = async {
            match &data {
                Some(data) => data.send(&head, &mut w).await,
                None => w.write_all(&head).await,
            }
        };
        let written = tokio::select! {
            r = tokio::time::timeout(limit, write) => match r {
                Ok(r) => r.map_err(TcpError::Io),
                Err(_) => Err(TcpError::Timeout("writing a request")),
            },
            _ = dead.wait_for(|d| *d) => Err(TcpError::Io(std::io::ErrorKind::ConnectionAborted.into())),
        };
        // The data's memory is let go before the chunk can settle.
        drop(data);
        let outcome = written.map_err(|e| Error::from(e).context("sending a request"));
        match expect {
            Some(expect) => inner.chunk_event(
                expect.xfer,
                expect.chunk,
                Event::Sent,
                outcome.clone().map_err(as_transfer),
            ),
            None => inner.notification_gone(),
        }
        if let Err(e) = outcome {
            return e;
        }
    }
}

/// A connection's failure as the transfers that waited on it see it.
fn as_transfer(e: Error) -> Error {
    Error::new(ErrorKind::Transfer, e.message().to_owned()).with_backend(crate::BACKEND).with_source(e)
}

async fn read_answers(
    inner: Arc<Inner>,
    peer: Arc<Peer>,
    mut r: OwnedReadHalf,
    fifo: Arc<Mutex<Fifo>>,
    link: Arc<Link>,
) {
    let mut dead = link.dead.subscribe();
    let failure = tokio::select! {
        e = take_answers(&inner, &mut r, &fifo) => Some(e),
        _ = dead.wait_for(|d| *d) => None,
    };
    let why = match failure {
        Some(e) => {
            Counters::bump(&inner.stats.connections_dropped);
            tracing::warn!(peer = %peer.name, "kvx-tcp: dropping a connection: {e}");
            as_transfer(Error::from(e))
        }
        None => err(ErrorKind::Transfer, format!("agent {}: the connection closed", peer.name)),
    };
    let waiting = {
        let mut f = fifo.lock().unwrap_or_else(PoisonError::into_inner);
        f.closed = Some(why.clone());
        std::mem::take(&mut f.waiting)
    };
    // The writer stops, and the peer's next request opens a connection in this one's place.
    link.dead.send_replace(true);
    for expect in waiting {
        inner.chunk_event(expect.xfer, expect.chunk, Event::Answered, Err(why.clone()));
    }
}

/// Takes answers until the connection fails; returns why.
async fn take_answers(inner: &Inner, r: &mut OwnedReadHalf, fifo: &Mutex<Fifo>) -> TcpError {
    let limits = Limits { max_data: inner.config.chunk_bytes as u64 };
    loop {
        let mut bytes = [0u8; HEADER_LEN];
        if let Err(e) = r.read_exact(&mut bytes).await {
            return e.into();
        }
        let header = match Header::decode(&bytes, limits) {
            Ok(h) if !h.kind.to_target() => h,
            Ok(h) => return TcpError::Malformed(format!("a {:?} sent to the initiator", h.kind)),
            Err(e) => return e,
        };
        let expect = {
            let mut f = fifo.lock().unwrap_or_else(PoisonError::into_inner);
            match f.waiting.front() {
                Some(e) if e.matches(&header) => f.waiting.pop_front(),
                next => {
                    Counters::bump(&inner.stats.answers_refused);
                    return TcpError::Unexpected(format!("{header:?}, waiting for {next:?}"));
                }
            }
        };
        let Some(expect) = expect else { continue };
        let outcome = if header.status == REFUSED {
            Err(err(
                ErrorKind::Transfer,
                "the target refused the request: a range outside its registered memory (deregistered?)",
            ))
        } else if header.kind == Kind::ReadData {
            match inner.take_chunk(expect.xfer, expect.nonce, expect.chunk) {
                Some(slots) => {
                    let received = slots.receive(r).await;
                    drop(slots);
                    if let Err(e) = received {
                        return e.into();
                    }
                }
                None => {
                    Counters::bump(&inner.stats.answers_discarded);
                    if let Err(e) = discard(r, header.data_len).await {
                        return e.into();
                    }
                }
            }
            Ok(())
        } else {
            Ok(())
        };
        inner.chunk_event(expect.xfer, expect.chunk, Event::Answered, outcome);
    }
}

/// Reads and throws away `len` bytes (an answer to a transfer that takes nothing more).
pub(crate) async fn discard(r: &mut OwnedReadHalf, mut len: u64) -> std::io::Result<()> {
    let mut sink = vec![0u8; (64 << 10).min(len as usize)];
    while len > 0 {
        let n = (sink.len() as u64).min(len) as usize;
        r.read_exact(&mut sink[..n]).await?;
        len -= n as u64;
    }
    Ok(())
}
