//! [`TcpGroup`]: a tensor-parallel group across processes over kvx's bounded framing.
//!
//! Rank 0 serves; every other rank joins on a connection and reports on it. A report counts only
//! from the connection that last joined as its rank (authenticated, when the group has a key):
//! reports from any other connection (a forger that never joined, or one the rank has since left
//! by joining again) are refused with an error reply and counted ([`GroupStats`]), as are reports
//! whose epoch is not the one their rank joined with. Without a key, whoever joins as a rank is
//! believed to be it: a group on a network that others can reach needs a key.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;
use tracing::{debug, warn};

use crate::server::{Caller, Server, ServerStats, Service};
use crate::session::Connection;
use crate::{NetConfig, endpoint};
use kvx_core::auth::random_bytes;
use kvx_core::clock::Every;
use kvx_core::error::{Error, ErrorKind, Result};
use kvx_core::group::{GatherInbox, ParallelGroup};
use kvx_core::meta::{Finished, RankReport};
use kvx_core::wire::{self, MessageKind, WireMessage};

/// What a rank sends rank 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum GroupMessage {
    /// A rank joins on this connection: rank 0 checks that it takes the rank (and, with a key,
    /// the connection is authenticated) and from now on takes the rank's reports from this
    /// connection only. `epoch` is the rank's process's (random per process).
    Join { rank: u32, world_size: u32, epoch: u64 },
    /// A rank's report. `seq` grows by one per new report of the rank's process (`epoch`), so a
    /// restarted rank starts afresh; a report re-sent after a lost acknowledgement carries its old
    /// `seq`, and rank 0 takes it as an empty report.
    Report { rank: u32, epoch: u64, seq: u64, finished: Finished },
}

impl WireMessage for GroupMessage {
    const KIND: MessageKind = MessageKind::GroupReport;
}

/// Rank 0's counters of what its ranks sent ([`TcpGroup::group_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// Joins taken: each rank's first, and each re-join (a sender that reconnected, a restarted
    /// rank).
    pub joins: u64,
    /// Joins that moved a rank to another connection (the rank's earlier connection is no longer
    /// heard).
    pub rejoins: u64,
    /// Reports taken.
    pub reports: u64,
    /// Reports sent again after a lost acknowledgement: acknowledged and taken as empty.
    pub duplicates: u64,
    /// Joins refused: a rank outside the group, another world size, or (keyed) a connection that
    /// is not authenticated.
    pub refused_joins: u64,
    /// Reports refused because their connection is not the one that joined as their rank: a
    /// connection that never joined (a forger), or one its rank has since left.
    pub refused_not_member: u64,
    /// Reports refused, from the rank's own connection, whose epoch is not the one it joined with.
    pub refused_epoch: u64,
    /// Reports refused because rank 0 was behind (the rank sends them again).
    pub refused_busy: u64,
}

/// A rank's membership: the connection that joined as it and its process's last report.
#[derive(Debug)]
struct Member {
    connection: u64,
    epoch: u64,
    /// The last `seq` taken from `epoch` (0: none yet).
    seq: u64,
}

#[derive(Debug)]
struct InboxState {
    members: HashMap<u32, Member>,
    stats: GroupStats,
    log: Every,
}

/// How often refusals are logged at most.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Rank 0's service: checks each message and hands reports to the gather.
struct Inbox {
    world_size: u32,
    /// Whether the server has a key (then every caller is authenticated).
    keyed: bool,
    reports: SyncSender<(u32, Finished)>,
    state: Arc<Mutex<InboxState>>,
}

impl Inbox {
    fn join(&self, caller: &Caller, rank: u32, world_size: u32, epoch: u64) -> Result<()> {
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let state = &mut *guard;
        let refused = if self.keyed && !caller.authenticated {
            Some(Error::new(ErrorKind::Unauthenticated, "the group has a key; authenticate first"))
        } else if rank == 0 || rank >= self.world_size {
            Some(Error::invalid_peer_data(format!("rank {rank} is not in a group of {}", self.world_size)))
        } else if world_size != self.world_size {
            Some(Error::new(
                ErrorKind::Incompatible,
                format!("rank {rank} has world size {world_size}, rank 0 {}", self.world_size),
            ))
        } else {
            None
        };
        if let Some(e) = refused {
            state.stats.refused_joins += 1;
            return Err(e);
        }
        state.stats.joins += 1;
        match state.members.get_mut(&rank) {
            Some(m) => {
                if m.connection != caller.connection {
                    debug!(rank, peer = %caller.peer, "rank joined again on another connection");
                    m.connection = caller.connection;
                    state.stats.rejoins += 1;
                }
                if m.epoch != epoch {
                    // A new process: its reports are numbered afresh.
                    *m = Member { connection: caller.connection, epoch, seq: 0 };
                }
            }
            None => {
                state.members.insert(rank, Member { connection: caller.connection, epoch, seq: 0 });
            }
        }
        Ok(())
    }

    fn report(&self, caller: &Caller, rank: u32, epoch: u64, seq: u64, finished: Finished) -> Result<()> {
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let state = &mut *guard;
        let member = match state.members.get_mut(&rank) {
            Some(m) if m.connection == caller.connection => m,
            _ => {
                state.stats.refused_not_member += 1;
                Self::log_refusal(state, caller, rank, "its connection has not joined as the rank");
                return Err(Error::new(
                    ErrorKind::State,
                    format!("rank {rank} has not joined on this connection"),
                ));
            }
        };
        if member.epoch != epoch {
            state.stats.refused_epoch += 1;
            Self::log_refusal(state, caller, rank, "its epoch is not the one the rank joined with");
            return Err(Error::new(ErrorKind::State, format!("rank {rank} joined with another epoch")));
        }
        let seen = seq <= member.seq;
        let finished = if seen { Finished::default() } else { finished };
        match self.reports.try_send((rank, finished)) {
            Ok(()) => {
                if seen {
                    state.stats.duplicates += 1;
                } else {
                    member.seq = seq;
                    state.stats.reports += 1;
                }
                Ok(())
            }
            Err(TrySendError::Full(_)) => {
                state.stats.refused_busy += 1;
                Err(Error::new(ErrorKind::Timeout, "rank 0 is behind; report again"))
            }
            Err(TrySendError::Disconnected(_)) => {
                Err(Error::new(ErrorKind::State, "rank 0 has left the group"))
            }
        }
    }

    fn log_refusal(state: &mut InboxState, caller: &Caller, rank: u32, why: &str) {
        if state.log.due(Instant::now()) {
            let s = &state.stats;
            warn!(
                rank,
                peer = %caller.peer,
                why,
                refused_not_member = s.refused_not_member,
                refused_epoch = s.refused_epoch,
                "rank 0 refused a report (totals so far; logged at most every 10 s)"
            );
        }
    }
}

#[async_trait::async_trait]
impl Service for Inbox {
    async fn call(&self, caller: &Caller, request: Vec<u8>) -> Result<Vec<u8>> {
        match wire::decode::<GroupMessage>(&request)? {
            GroupMessage::Join { rank, world_size, epoch } => self.join(caller, rank, world_size, epoch)?,
            GroupMessage::Report { rank, epoch, seq, finished } => {
                self.report(caller, rank, epoch, seq, finished)?
            }
        }
        Ok(Vec::new())
    }
}

enum GroupEnd {
    Rank0 {
        server: Server,
        reports: Receiver<(u32, Finished)>,
        inbox: GatherInbox,
        state: Arc<Mutex<InboxState>>,
    },
    Other(Box<Sender>),
}

/// A rank's link to rank 0: one connection, joined as the rank, re-made (and joined again) when it
/// breaks, and the report that rank 0 has not acknowledged yet.
struct Sender {
    rank: u32,
    world_size: u32,
    host: String,
    port: u16,
    config: NetConfig,
    conn: Option<Connection>,
    pending: Option<GroupMessage>,
    unsent: Finished,
    epoch: u64,
    seq: u64,
}

impl Sender {
    /// Joins as this rank on `conn`: rank 0 takes a rank's reports only from the connection
    /// that last joined as it.
    async fn join_on(&self, conn: &mut Connection) -> Result<()> {
        let join = GroupMessage::Join { rank: self.rank, world_size: self.world_size, epoch: self.epoch };
        conn.request(wire::encode(&join)?).await.map(drop)
    }

    /// Sends `msg` on the connection (connecting and joining first when there is none),
    /// re-connecting once if a kept connection broke (rank 0 drops idle connections) or was
    /// refused (rank 0 restarted, or another connection joined as this rank).
    async fn send(&mut self, msg: &GroupMessage) -> Result<()> {
        let body = wire::encode(msg)?;
        let reused = self.conn.is_some();
        for attempt in 0..2 {
            let mut conn = match self.conn.take() {
                Some(c) => c,
                None => {
                    let mut conn = Connection::connect(&self.host, self.port, &self.config).await?;
                    self.join_on(&mut conn).await?;
                    conn
                }
            };
            match conn.request(body.clone()).await {
                Ok(_) => {
                    self.conn = Some(conn);
                    return Ok(());
                }
                Err(e) if attempt == 0 && reused && e.kind() == ErrorKind::Handshake => {
                    debug!(error = %e, "connection to rank 0 broke or was refused; reconnecting");
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::new(ErrorKind::Handshake, "rank 0 unreachable"))
    }
}

/// A tensor-parallel group across processes: rank 0 serves on `host:port` (kvx's bounded server,
/// [`crate::server`]); the other ranks connect to it, authenticated when the config has a key,
/// join, and send each step's report on the connection they joined on, which rank 0 acknowledges.
/// Rank 0 takes a rank's reports only from the connection that last joined as it, with the epoch
/// it joined with: reports from any other connection (a forger that never joined, or one the rank
/// has since left) are refused with an error reply and counted ([`group_stats`](Self::group_stats)).
/// A rank that reconnects joins again first. Without a key, whoever joins as a rank is taken for
/// it: a group on a network that others can reach needs a key. A report that is not acknowledged
/// is kept and sent again (rank 0 drops the duplicate when the first copy did arrive); reports of
/// the steps in between are merged into the next one, never dropped. Owns a small tokio runtime.
pub struct TcpGroup {
    rank: u32,
    world_size: u32,
    timeout: Duration,
    end: Mutex<GroupEnd>,
    runtime: Runtime,
}

impl fmt::Debug for TcpGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpGroup").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

impl TcpGroup {
    /// [`join_with`](Self::join_with) with the default limits and no key.
    pub fn join(rank: u32, world_size: u32, host: &str, port: u16, timeout: Duration) -> Result<Self> {
        Self::join_with(rank, world_size, host, port, timeout, NetConfig::default())
    }

    /// Joins the group as `rank` of `world_size`. Rank 0 binds `host:port` (a port in use is an
    /// `Io` error); the others connect to it and join, retrying a refused connection until
    /// `timeout`. Each gather waits at most `timeout`.
    pub fn join_with(
        rank: u32,
        world_size: u32,
        host: &str,
        port: u16,
        timeout: Duration,
        config: NetConfig,
    ) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid_argument(format!("rank {rank} of {world_size}")));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvx-group")
            .enable_all()
            .build()?;
        let end = runtime.block_on(async {
            if rank == 0 {
                // Room for a few steps of every rank's reports; a rank whose report does not fit
                // is told to send it again.
                let (tx, reports) = mpsc::sync_channel(8 * world_size as usize);
                let state = Arc::new(Mutex::new(InboxState {
                    members: HashMap::new(),
                    stats: GroupStats::default(),
                    log: Every::new(LOG_EVERY),
                }));
                let keyed = config.auth_key.is_some();
                let inbox = Inbox { world_size, keyed, reports: tx, state: Arc::clone(&state) };
                let server = Server::bind("group", host, port, &config, inbox).await?;
                let inbox = GatherInbox::new(world_size, timeout);
                return Ok(GroupEnd::Rank0 { server, reports, inbox, state });
            }
            let mut sender = Sender {
                rank,
                world_size,
                host: host.to_owned(),
                port,
                config,
                conn: None,
                pending: None,
                unsent: Finished::default(),
                epoch: u64::from_le_bytes(random_bytes::<8>()?),
                seq: 0,
            };
            let at = endpoint(host, port);
            let join = async {
                // Rank 0 may start a moment after this rank: retry a refused connection.
                let mut pause = Duration::from_millis(10);
                let mut conn = loop {
                    match Connection::connect(host, port, &sender.config).await {
                        Ok(conn) => break conn,
                        Err(e) => debug!(error = %e, "rank 0 not reachable yet"),
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                };
                sender.join_on(&mut conn).await?;
                sender.conn = Some(conn);
                Ok::<_, Error>(())
            };
            match tokio::time::timeout(timeout, join).await {
                Ok(Ok(())) => Ok(GroupEnd::Other(Box::new(sender))),
                Ok(Err(e)) => Err(e.context(format!("joining rank 0 at {at}"))),
                Err(_) => Err(Error::new(
                    ErrorKind::Timeout,
                    format!("rank 0 at {at} did not take rank {rank} within {timeout:?}"),
                )),
            }
        })?;
        Ok(TcpGroup { rank, world_size, timeout, end: Mutex::new(end), runtime })
    }

    /// Rank 0's server counters (`None` on other ranks).
    pub fn stats(&self) -> Option<ServerStats> {
        match &*self.end.lock().unwrap_or_else(PoisonError::into_inner) {
            GroupEnd::Rank0 { server, .. } => Some(server.stats()),
            GroupEnd::Other(_) => None,
        }
    }

    /// Rank 0's counters of joins and reports, and of what it refused (`None` on other ranks).
    pub fn group_stats(&self) -> Option<GroupStats> {
        match &*self.end.lock().unwrap_or_else(PoisonError::into_inner) {
            GroupEnd::Rank0 { state, .. } => Some(state.lock().unwrap_or_else(PoisonError::into_inner).stats),
            GroupEnd::Other(_) => None,
        }
    }

    /// Rank 0's bound port (`None` on other ranks).
    pub fn port(&self) -> Option<u16> {
        match &*self.end.lock().unwrap_or_else(PoisonError::into_inner) {
            GroupEnd::Rank0 { server, .. } => Some(server.port()),
            GroupEnd::Other(_) => None,
        }
    }
}

impl ParallelGroup for TcpGroup {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world_size
    }

    fn gather_finished(&self, report: Finished) -> Result<Option<Vec<RankReport>>> {
        let mut end = self.end.lock().map_err(|_| Error::new(ErrorKind::State, "group lock poisoned"))?;
        match &mut *end {
            GroupEnd::Other(sender) => {
                sender.unsent.extend(report);
                let msg = match sender.pending.take() {
                    Some(msg) => msg,
                    None => {
                        sender.seq += 1;
                        let finished = std::mem::take(&mut sender.unsent);
                        GroupMessage::Report {
                            rank: self.rank,
                            epoch: sender.epoch,
                            seq: sender.seq,
                            finished,
                        }
                    }
                };
                let sent = self
                    .runtime
                    .block_on(async { tokio::time::timeout(self.timeout, sender.send(&msg)).await });
                let failure = match sent {
                    Ok(Ok(())) => return Ok(None),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => format!("no acknowledgement within {:?}", self.timeout),
                };
                warn!(error = %failure, "report to rank 0 not acknowledged; sending it again next step");
                sender.conn = None;
                sender.pending = Some(msg);
                Ok(None)
            }
            GroupEnd::Rank0 { reports, inbox, .. } => {
                let gathered = inbox.gather(report, |deadline| {
                    match reports.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                        Ok(r) => Ok(Some(r)),
                        Err(RecvTimeoutError::Timeout) => Ok(None),
                        Err(RecvTimeoutError::Disconnected) => {
                            Err(Error::new(ErrorKind::State, "the group's server stopped"))
                        }
                    }
                })?;
                Ok(Some(gathered))
            }
        }
    }
}

#[cfg(test)]
mod tests;
