//! [`TcpAgent`] and its [`TransferAgent`] implementation.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvx_core::auth::random_bytes;
use kvx_core::post::{BlockPostRequest, DlistView, check_notification, place_dlist};
use kvx_core::wire::agent_metadata::{self, check_agent_name};
use kvx_core::{
    AgentName, BlockList, BlockPost, Capabilities, DlistId, DlistOwner, ErrorKind, KvMemory, MemRegion,
    Notification, NotificationWaker, PostRequest, RegistrationId, Result, TransferAgent, XferId, XferOp,
    XferState,
};

use crate::BACKEND;
use crate::config::TcpConfig;
use crate::error::err;
use crate::frame::{Header, Kind, MAX_RANGES, encode_ranges};
use crate::inner::{Chunk, Dlist, Inner, Piece, Registration, Stage, State, Xfer, remote_regions};
use crate::link::{Command, Expect, Peer};
use crate::listener::accept_loop;
use crate::memio::Pinned;
use crate::metadata::{AgentMetadata, RemoteRegion};

const CAPABILITIES: Capabilities =
    Capabilities { backend: BACKEND, dram: true, vram: false, read: true, write: true, notifications: true };

/// How long dropping an agent waits for its transfers in flight.
const DROP_WAIT: Duration = Duration::from_secs(2);

/// A [`TransferAgent`] over plain TCP: READ and WRITE of host memory between processes (or
/// hosts), with notifications, and nothing to install.
///
/// The agent owns a small tokio runtime (`io_threads` threads) that listens for peers and runs
/// its connections; every [`TransferAgent`] call is synchronous and returns at once, and transfers
/// move on their own (`progress` does nothing). See the crate documentation for the wire format
/// and its checks.
pub struct TcpAgent {
    inner: Arc<Inner>,
    addr: SocketAddr,
    advertise: String,
    runtime: Option<tokio::runtime::Runtime>,
}

/// What an agent refused and dropped, and the connections it opened and took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Connections this agent opened to peers (session opened).
    pub connections_opened: u64,
    /// Connections peers opened to this agent (accepted, before admission).
    pub connections_accepted: u64,
    /// Connections dropped for a malformed, oversize or unexpected frame, a socket error or a
    /// failed session opening, on either side.
    pub connections_dropped: u64,
    /// Connections parked by the listener's admission policy.
    pub connections_parked: u64,
    /// Established connections the listener closed after `idle_timeout` without a request.
    pub connections_idle: u64,
    /// Answers that were not the one their connection waited for (the connection was dropped).
    pub answers_refused: u64,
    /// Answers to transfers that take nothing more (released or failed): read and thrown away.
    pub answers_discarded: u64,
    /// Requests refused for a range outside this agent's live registrations.
    pub requests_refused: u64,
    /// Notifications received.
    pub notifications_received: u64,
}

impl TcpAgent {
    /// An agent with the default configuration: listening on a free port of 127.0.0.1.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        Self::with_config(name, &TcpConfig::default())
    }

    /// An agent listening as `config` says. A name that is not valid for metadata, a listen
    /// host of every interface without an advertised host, or no connection per peer is
    /// `InvalidArgument`; a port in use is `Io`.
    pub fn with_config(name: impl Into<String>, config: &TcpConfig) -> Result<Self> {
        let name = AgentName::new(name);
        check_agent_name(&name).map_err(|e| e.with_backend(BACKEND))?;
        if config.connections == 0 || config.chunk_bytes == 0 {
            return Err(err(ErrorKind::InvalidArgument, "connections and chunk_bytes must be at least 1"));
        }
        let every_interface = config.host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified());
        let advertise = match &config.advertise_host {
            Some(host) => host.clone(),
            None if every_interface => {
                return Err(err(
                    ErrorKind::InvalidArgument,
                    format!("listening on {} needs an advertised host peers can reach", config.host),
                ));
            }
            None => config.host.clone(),
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.io_threads.max(1))
            .thread_name("kvx-tcp-io")
            .enable_all()
            .build()
            .map_err(|e| err(ErrorKind::Io, format!("starting the I/O runtime: {e}")).with_source(e))?;
        // Bound on the runtime's own threads: the caller may be inside another runtime.
        let (tx, rx) = std::sync::mpsc::channel();
        let (host, port) = (config.host.clone(), config.port);
        runtime.spawn(async move {
            let _ = tx.send(kvx_net::listen(&host, port).await);
        });
        let listener =
            rx.recv().map_err(|_| err(ErrorKind::Io, "the I/O runtime stopped"))?.map_err(|e| {
                err(ErrorKind::Io, format!("listening on {}:{}: {e}", config.host, config.port))
                    .with_source(e)
            })?;
        let addr = listener.local_addr()?;
        let instance = u64::from_le_bytes(random_bytes::<8>()?);
        let inner = Arc::new(Inner::new(name, instance, config.clone(), runtime.handle().clone()));
        runtime.spawn(accept_loop(Arc::clone(&inner), listener));
        Ok(TcpAgent { inner, addr, advertise, runtime: Some(runtime) })
    }

    /// The address the agent listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The counters now.
    pub fn stats(&self) -> TcpStats {
        let s = &self.inner.stats;
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        TcpStats {
            connections_opened: get(&s.connections_opened),
            connections_accepted: get(&s.connections_accepted),
            connections_dropped: get(&s.connections_dropped),
            connections_parked: get(&s.connections_parked),
            connections_idle: get(&s.connections_idle),
            answers_refused: get(&s.answers_refused),
            answers_discarded: get(&s.answers_discarded),
            requests_refused: get(&s.requests_refused),
            notifications_received: get(&s.notifications_received),
        }
    }

    /// Blocks until transfer `xfer` is no longer pending, or for at most `timeout`, and returns
    /// its state as [`poll`](TransferAgent::poll) does (`Pending` when the time ran out).
    ///
    /// For a caller with nothing to do until the transfer ends: it moves on the agent's I/O
    /// threads, and a caller that polls in a loop takes a CPU from them (on 2 cores, up to a
    /// third of the bandwidth). This sleeps until the transfer ends and wakes at once then.
    pub fn wait(&self, xfer: XferId, timeout: Duration) -> Result<XferState> {
        let deadline = Instant::now().checked_add(timeout);
        let mut st = self.inner.state()?;
        loop {
            let state = stage(&st, xfer)?;
            let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()));
            if state != XferState::Pending || left.is_zero() {
                return Ok(state);
            }
            st = self.inner.wait_change(st, left)?;
        }
    }

    /// Records a checked transfer and hands its chunks to the peer's connections.
    fn start(
        &self,
        mut st: std::sync::MutexGuard<'_, State>,
        op: XferOp,
        peer: &AgentName,
        pieces: impl Iterator<Item = Piece>,
        used: Vec<u64>,
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        // Lists of a forgotten peer are released with it, so a remote list's peer is loaded.
        let peer =
            st.remotes.get(peer).cloned().ok_or_else(|| {
                err(ErrorKind::State, format!("a list of agent {peer}, which is not loaded"))
            })?;
        let memory: Vec<Arc<dyn KvMemory>> =
            used.iter().filter_map(|id| st.registrations.get(id)).map(|r| r.memory.clone()).collect();
        let chunks = chunk(pieces, self.inner.config.chunk_bytes as u64);
        let id = st.next_id();
        let nonce = self.inner.nonce(id);
        let mut commands = Vec::with_capacity(chunks.len());
        let mut first = 0u32;
        for (k, pieces) in chunks.iter().enumerate() {
            let count = pieces.len() as u32; // at most MAX_RANGES
            let len: u64 = pieces.iter().map(|p| p.len).sum();
            let (kind, answer, data_len) = match op {
                XferOp::Read => (Kind::ReadRequest, Kind::ReadData, 0),
                XferOp::Write => (Kind::WriteRequest, Kind::WriteAck, len),
            };
            let meta = encode_ranges(pieces.iter().map(|p| (p.remote, p.len)));
            let header = Header {
                meta_len: meta.len() as u32,
                data_len,
                ..Header::new(kind, id, nonce, first, count)
            };
            let mut head = header.encode().to_vec();
            head.extend_from_slice(&meta);
            let data = match op {
                XferOp::Read => None,
                XferOp::Write => {
                    let ranges: Vec<(u64, u64)> = pieces.iter().map(|p| (p.local, p.len)).collect();
                    Some(Pinned::new(&ranges, memory.clone()).ok_or_else(|| {
                        err(
                            ErrorKind::Backend,
                            "a local range outside the registrations its list was placed in",
                        )
                    })?)
                }
            };
            let expect = Expect { kind: answer, xfer: id, nonce, chunk: k, first, count, len };
            commands.push(Command::Request { head, data, expect });
            first = first.checked_add(count).ok_or_else(|| {
                err(
                    ErrorKind::InvalidArgument,
                    "a transfer of more than 2^32 ranges after cutting into chunks",
                )
            })?;
        }
        let chunks = chunks.into_iter().map(Chunk::new).collect();
        let notify = notify.map(<[u8]>::to_vec);
        st.xfers.insert(id, Xfer::new(op, nonce, Arc::clone(&peer), chunks, memory, notify));
        drop(st);
        let base = peer.spread(commands.len());
        for (k, cmd) in commands.into_iter().enumerate() {
            peer.send(&self.inner, base + k, cmd);
        }
        Ok(XferId(id))
    }
}

/// Cuts `pieces` into chunks of at most `max_bytes` bytes and [`MAX_RANGES`] pieces, cutting
/// pieces longer than a chunk; a piece that continues the one before it on both sides joins it
/// (what `post` names block by block travels as ranges).
pub(crate) fn chunk(pieces: impl Iterator<Item = Piece>, max_bytes: u64) -> Vec<Vec<Piece>> {
    let mut chunks = Vec::new();
    let (mut current, mut bytes): (Vec<Piece>, u64) = (Vec::new(), 0);
    for mut piece in pieces {
        while piece.len > 0 {
            let take = piece.len.min(max_bytes - bytes);
            match current.last_mut() {
                Some(last)
                    if last.local.checked_add(last.len) == Some(piece.local)
                        && last.remote.checked_add(last.len) == Some(piece.remote) =>
                {
                    last.len += take
                }
                _ => current.push(Piece { len: take, ..piece }),
            }
            bytes += take;
            piece = Piece { local: piece.local + take, remote: piece.remote + take, len: piece.len - take };
            if bytes == max_bytes || current.len() == MAX_RANGES {
                chunks.push(std::mem::take(&mut current));
                bytes = 0;
            }
        }
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// The registrations that the regions `regions` of list `local` lie in, once each.
fn used_registrations(st: &State, local: DlistId, regions: impl Iterator<Item = usize>) -> Vec<u64> {
    let list = st.dlists.get(&local.0).map(|d| d.registrations.as_slice()).unwrap_or_default();
    let mut used: Vec<u64> = regions.filter_map(|r| list.get(r).copied()).collect();
    used.sort_unstable();
    used.dedup();
    used
}

/// The state of transfer `xfer` (not released).
fn stage(st: &State, xfer: XferId) -> Result<XferState> {
    let x = st.xfers.get(&xfer.0).filter(|x| !x.released);
    let x = x.ok_or_else(|| err(ErrorKind::NotFound, format!("no transfer {xfer}")))?;
    Ok(match &x.stage {
        Stage::Pending => XferState::Pending,
        Stage::Done => XferState::Done,
        Stage::Failed(e) => XferState::Failed(e.clone()),
    })
}

fn view(d: &Dlist) -> DlistView<'_> {
    DlistView { owner: &d.owner, blocks: &d.blocks }
}

impl TransferAgent for TcpAgent {
    fn name(&self) -> &AgentName {
        &self.inner.name
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn register(&self, memory: Arc<dyn KvMemory>) -> Result<RegistrationId> {
        let region = memory.region();
        CAPABILITIES.check_registration(&region)?;
        let mut st = self.inner.state()?;
        let id = st.next_id();
        st.registrations.insert(id, Registration { region, memory });
        Ok(RegistrationId(id))
    }

    fn deregister(&self, registration: RegistrationId) -> Result<()> {
        let mut st = self.inner.state()?;
        let removed = st.registrations.remove(&registration.0);
        if removed.is_some() {
            st.dlists
                .retain(|_, d| d.owner != DlistOwner::Local || !d.registrations.contains(&registration.0));
        }
        drop(st);
        // The memory's Arc drops here, outside the lock: transfers in flight hold their own.
        match removed {
            Some(_) => Ok(()),
            None => Err(err(ErrorKind::NotFound, format!("no registration {registration}"))),
        }
    }

    fn local_metadata(&self) -> Result<Vec<u8>> {
        let mut regions: Vec<RemoteRegion> = (self.inner.state()?.registrations.iter())
            .map(|(&id, r)| RemoteRegion { id, addr: r.region.addr, len: r.region.len })
            .collect();
        regions.sort_by_key(|r| r.id);
        let md = AgentMetadata {
            instance: self.inner.instance,
            host: self.advertise.clone(),
            port: self.addr.port(),
            regions,
        };
        agent_metadata::seal(BACKEND, &self.inner.name, &md)
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<AgentName> {
        let (name, md) = AgentMetadata::open(metadata)?;
        let mut st = self.inner.state()?;
        if st.remotes.contains_key(&name) {
            return Err(err(ErrorKind::State, format!("agent {name} is already loaded: forget it first")));
        }
        let peer =
            Peer::new(name.clone(), md.instance, md.host, md.port, self.inner.config.connections, md.regions);
        let peer = Arc::new(peer);
        st.remotes.insert(name.clone(), Arc::clone(&peer));
        drop(st);
        peer.connect_all(&self.inner);
        Ok(name)
    }

    fn forget_remote(&self, agent: &AgentName) -> Result<()> {
        let mut st = self.inner.state()?;
        if st.remotes.remove(agent).is_none() {
            return Err(err(ErrorKind::NotFound, format!("agent {agent} is not loaded")));
        }
        // Transfers to it keep its connections (their `Arc<Peer>`) until they settle.
        st.dlists.retain(|_, d| !matches!(&d.owner, DlistOwner::Remote(a) if a == agent));
        Ok(())
    }

    fn prep_dlist(&self, owner: &DlistOwner, blocks: &BlockList) -> Result<DlistId> {
        let mut st = self.inner.state()?;
        let registered: Vec<(u64, MemRegion)> = match owner {
            DlistOwner::Local => st.registrations.iter().map(|(&id, r)| (id, r.region)).collect(),
            DlistOwner::Remote(agent) => remote_regions(
                &st.remotes
                    .get(agent)
                    .ok_or_else(|| err(ErrorKind::NotFound, format!("agent {agent} is not loaded")))?
                    .regions,
            ),
        };
        let registrations = place_dlist(&CAPABILITIES, owner, blocks, &registered)?;
        let id = st.next_id();
        st.dlists.insert(id, Dlist { owner: owner.clone(), blocks: blocks.clone(), registrations });
        Ok(DlistId(id))
    }

    fn release_dlist(&self, dlist: DlistId) -> Result<()> {
        match self.inner.state()?.dlists.remove(&dlist.0) {
            Some(_) => Ok(()),
            None => Err(err(ErrorKind::NotFound, format!("no descriptor list {dlist}"))),
        }
    }

    fn post(
        &self,
        op: XferOp,
        local: DlistId,
        local_descs: &[u32],
        remote: DlistId,
        remote_descs: &[u32],
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        let st = self.inner.state()?;
        let request = PostRequest { op, local, local_descs, remote, remote_descs, notify };
        let plan = request.check(&CAPABILITIES, |id| st.dlists.get(&id.0).map(view))?;
        let used = used_registrations(&st, local, plan.pairs().iter().map(|(l, _)| l.region));
        let len = plan.block_len();
        let pieces: Vec<Piece> =
            plan.pairs().iter().map(|(l, r)| Piece { local: l.addr, remote: r.addr, len }).collect();
        let peer = plan.peer().clone();
        self.start(st, op, &peer, pieces.into_iter(), used, notify)
    }

    /// Checks and plans with kvx-core ([`BlockPostRequest::check`]): one piece per coalesced
    /// range, so contiguous blocks travel as one range.
    fn post_blocks(
        &self,
        op: XferOp,
        local: DlistId,
        remote: DlistId,
        blocks: &BlockPost<'_>,
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        let st = self.inner.state()?;
        let request = BlockPostRequest { op, local, remote, blocks: *blocks, notify };
        let joinable = |id: DlistId, region: usize| {
            let holders = st.dlists.get(&id.0).map(|d| d.registrations.as_slice()).unwrap_or_default();
            matches!(holders.get(region..region + 2), Some([a, b]) if a == b)
        };
        let plan = request.check(&CAPABILITIES, |id| st.dlists.get(&id.0).map(view), joinable)?;
        let used = used_registrations(&st, local, plan.runs().regions());
        let peer = plan.peer().clone();
        let pieces: Vec<Piece> =
            plan.runs().iter().map(|r| Piece { local: r.local, remote: r.remote, len: r.len }).collect();
        self.start(st, op, &peer, pieces.into_iter(), used, notify)
    }

    /// A lookup: transfers move on the agent's I/O threads.
    fn poll(&self, xfer: XferId) -> Result<XferState> {
        stage(&*self.inner.state()?, xfer)
    }

    /// A pending transfer is not cancelled: its chunks already went to the peer. It completes in
    /// the background, and its answers are thrown away.
    fn release(&self, xfer: XferId) -> Result<()> {
        let mut st = self.inner.state()?;
        let x = st.xfers.get_mut(&xfer.0).filter(|x| !x.released);
        let x = x.ok_or_else(|| err(ErrorKind::NotFound, format!("no transfer {xfer}")))?;
        if matches!(x.stage, Stage::Pending) {
            x.released = true;
        } else {
            st.xfers.remove(&xfer.0);
        }
        Ok(())
    }

    /// The transfers that ended since the last call: linear in them.
    fn drain_completions(&self, out: &mut Vec<XferId>) -> Result<()> {
        let mut st = self.inner.state()?;
        let State { xfers, completed, .. } = &mut *st;
        out.extend(completed.drain(..).filter(|id| xfers.get(id).is_some_and(|x| !x.released)).map(XferId));
        Ok(())
    }

    fn notify(&self, agent: &AgentName, msg: &[u8]) -> Result<()> {
        check_notification(&CAPABILITIES, msg)?;
        let peer = self.inner.state()?.remotes.get(agent).cloned();
        let peer = peer.ok_or_else(|| err(ErrorKind::NotFound, format!("agent {agent} is not loaded")))?;
        // Opens a connection if none is (the notification then waits for it).
        peer.link(&self.inner, peer.spread(0));
        peer.notify(&self.inner, msg.to_vec())
    }

    fn drain_notifications(&self, out: &mut Vec<Notification>) -> Result<()> {
        self.inner.drain_inbox(out)
    }

    /// Notifications arrive on the agent's I/O threads: `wake` is called for each.
    fn wake_on_notification(&self, wake: NotificationWaker) -> bool {
        self.inner.set_waker(wake).is_ok()
    }
}

impl Drop for TcpAgent {
    fn drop(&mut self) {
        self.inner.wait_settled(DROP_WAIT);
        if let Some(runtime) = self.runtime.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                // Inside another runtime, which must not block: the tasks end in the background.
                runtime.shutdown_background();
            } else {
                runtime.shutdown_timeout(Duration::from_secs(1));
            }
        }
    }
}

impl fmt::Debug for TcpAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpAgent")
            .field("name", &self.inner.name)
            .field("addr", &self.addr)
            .field("advertise", &self.advertise)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(local: u64, len: u64) -> Piece {
        Piece { local, remote: local + 0x10_0000, len }
    }

    #[test]
    fn chunks_hold_at_most_their_bytes_and_ranges_and_cut_long_pieces() {
        let chunks = chunk([piece(0, 10), piece(100, 25), piece(200, 3)].into_iter(), 16);
        let lens: Vec<Vec<u64>> = chunks.iter().map(|c| c.iter().map(|p| p.len).collect()).collect();
        assert_eq!(lens, [vec![10, 6], vec![16], vec![3, 3]]);
        let joined = chunk([piece(0, 8), piece(8, 8), piece(24, 8), piece(32, 8)].into_iter(), 12);
        let lens: Vec<Vec<u64>> = joined.iter().map(|c| c.iter().map(|p| p.len).collect()).collect();
        assert_eq!(lens, [vec![12], vec![4, 8], vec![8]], "contiguous pieces join, up to a chunk");
        assert_eq!(chunks[1][0], Piece { local: 106, remote: 0x10_0000 + 106, len: 16 });
        let many = chunk((0..MAX_RANGES as u64 + 1).map(|i| piece(i * 8, 4)), 1 << 20);
        assert_eq!(many.iter().map(Vec::len).collect::<Vec<_>>(), [MAX_RANGES, 1]);
        let total: u64 = chunk([piece(0, 1 << 20)].into_iter(), 4096).iter().flatten().map(|p| p.len).sum();
        assert_eq!(total, 1 << 20);
    }
}
