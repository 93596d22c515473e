//! [`TcpGroup`]: a tensor-parallel group across processes over kvx's bounded framing.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;
use tracing::warn;

use super::server::{Caller, Server, ServerStats, Service};
use super::session::Connection;
use super::{NetConfig, endpoint};
use crate::auth::random_bytes;
use crate::error::{Error, ErrorKind, Result};
use crate::group::{GatherInbox, ParallelGroup};
use crate::meta::{Finished, RankReport};
use crate::wire::{self, MessageKind, WireMessage};

/// What a rank sends rank 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum GroupMessage {
    /// A rank joins (checks that rank 0 takes it, and authenticates the connection).
    Join { rank: u32, world_size: u32 },
    /// A rank's report. `seq` grows by one per new report of the rank's process (`epoch`, random
    /// per join, so a restarted rank starts afresh); a report re-sent after a lost
    /// acknowledgement carries its old `seq`, and rank 0 takes it as an empty report.
    Report { rank: u32, epoch: u64, seq: u64, finished: Finished },
}

impl WireMessage for GroupMessage {
    const KIND: MessageKind = MessageKind::GroupReport;
}

/// Rank 0's service: checks each message and hands reports to the gather.
struct Inbox {
    world_size: u32,
    reports: SyncSender<(u32, Finished)>,
    /// The epoch and last `seq` taken from each rank.
    last: Mutex<HashMap<u32, (u64, u64)>>,
}

#[async_trait::async_trait]
impl Service for Inbox {
    async fn call(&self, _caller: &Caller, request: Vec<u8>) -> Result<Vec<u8>> {
        let check = |rank: u32| {
            if rank == 0 || rank >= self.world_size {
                Err(Error::invalid_peer_data(format!("rank {rank} is not in a group of {}", self.world_size)))
            } else {
                Ok(())
            }
        };
        match wire::decode::<GroupMessage>(&request)? {
            GroupMessage::Join { rank, world_size } => {
                check(rank)?;
                if world_size != self.world_size {
                    return Err(Error::new(
                        ErrorKind::Incompatible,
                        format!("rank {rank} has world size {world_size}, rank 0 {}", self.world_size),
                    ));
                }
            }
            GroupMessage::Report { rank, epoch, seq, finished } => {
                check(rank)?;
                let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
                let seen = last.get(&rank).is_some_and(|&(e, l)| e == epoch && seq <= l);
                let finished = if seen { Finished::default() } else { finished };
                match self.reports.try_send((rank, finished)) {
                    Ok(()) => {
                        if !seen {
                            last.insert(rank, (epoch, seq));
                        }
                    }
                    Err(TrySendError::Full(_)) => {
                        return Err(Error::new(ErrorKind::Timeout, "rank 0 is behind; report again"));
                    }
                    Err(TrySendError::Disconnected(_)) => {
                        return Err(Error::new(ErrorKind::State, "rank 0 has left the group"));
                    }
                }
            }
        }
        Ok(Vec::new())
    }
}

enum GroupEnd {
    Rank0 { server: Server, reports: Receiver<(u32, Finished)>, inbox: GatherInbox },
    Other(Box<Sender>),
}

/// A rank's link to rank 0: one connection, re-made when it breaks, and the report that rank 0
/// has not acknowledged yet.
struct Sender {
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
    /// Sends `msg` on the connection (connecting first when there is none), re-connecting once if
    /// a kept connection broke (rank 0 drops idle connections).
    async fn send(&mut self, msg: &GroupMessage) -> Result<()> {
        let body = wire::encode(msg)?;
        let reused = self.conn.is_some();
        for attempt in 0..2 {
            let mut conn = match self.conn.take() {
                Some(c) => c,
                None => Connection::connect(&self.host, self.port, &self.config).await?,
            };
            match conn.request(body.clone()).await {
                Ok(_) => {
                    self.conn = Some(conn);
                    return Ok(());
                }
                Err(e) if attempt == 0 && reused && e.kind() == ErrorKind::Handshake => {
                    tracing::debug!(error = %e, "connection to rank 0 broke; reconnecting");
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::new(ErrorKind::Handshake, "rank 0 unreachable"))
    }
}

/// A tensor-parallel group across processes: rank 0 serves on `host:port` (kvx's bounded server,
/// [`super::server`]); the other ranks connect to it, authenticated when the config has a key, and
/// send each step's report, which rank 0 acknowledges. A report that is not acknowledged is kept
/// and sent again (rank 0 drops the duplicate when the first copy did arrive); reports of the
/// steps in between are merged into the next one, never dropped. Owns a small tokio runtime.
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
                let inbox = Inbox { world_size, reports: tx, last: Mutex::default() };
                let server = Server::bind("group", host, port, &config, inbox).await?;
                return Ok(GroupEnd::Rank0 { server, reports, inbox: GatherInbox::new(world_size, timeout) });
            }
            let mut sender = Sender {
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
                loop {
                    match Connection::connect(host, port, &sender.config).await {
                        Ok(conn) => break sender.conn = Some(conn),
                        Err(e) => tracing::debug!(error = %e, "rank 0 not reachable yet"),
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                sender.send(&GroupMessage::Join { rank, world_size }).await
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
mod tests {
    use super::*;
    use crate::RequestId;
    use crate::auth::AuthKey;

    fn rep(s: &str) -> Finished {
        Finished { sending: vec![RequestId::new(s)], ..Default::default() }
    }

    /// `reports`, each as its rank's (rank 0's first, then 1, 2, ...).
    fn ranked(reports: impl IntoIterator<Item = Finished>) -> Vec<RankReport> {
        (0..).zip(reports).map(|(rank, finished)| RankReport { rank, finished }).collect()
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn tcp_group_gathers_reports_of_other_ranks() {
        let port = free_port();
        let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, T).unwrap();
        let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, T).unwrap();
        assert_eq!(r1.gather_finished(rep("b")).unwrap(), None);
        let got = r0.gather_finished(rep("a")).unwrap().unwrap();
        assert_eq!(got, ranked([rep("a"), rep("b")]));
        assert!(TcpGroup::join(2, 2, "127.0.0.1", port, Duration::from_secs(1)).is_err());
        assert_eq!(r0.port(), Some(port));
        assert_eq!(r1.stats(), None);
    }

    #[test]
    fn unacknowledged_reports_are_sent_again_and_merged_never_lost() {
        let port = free_port();
        let short = Duration::from_millis(300);
        let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, short).unwrap();
        let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, short).unwrap();
        // Rank 0 goes away: rank 1's reports cannot be delivered.
        drop(r0);
        assert_eq!(r1.gather_finished(rep("a")).unwrap(), None);
        assert_eq!(r1.gather_finished(rep("b")).unwrap(), None);
        // A new rank 0 on the same port gets them all: "a" first, then "b".
        let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, T).unwrap();
        assert_eq!(r1.gather_finished(Finished::default()).unwrap(), None);
        assert_eq!(r1.gather_finished(rep("c")).unwrap(), None);
        let mut all = Vec::new();
        for _ in 0..2 {
            all.extend(r0.gather_finished(Finished::default()).unwrap().unwrap()[1].finished.sending.clone());
        }
        assert_eq!(all, vec![RequestId::new("a"), RequestId::new("b"), RequestId::new("c")]);
    }

    #[test]
    fn a_restarted_rank_is_heard_and_a_mismatched_one_refused_at_once() {
        let port = free_port();
        let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, T).unwrap();
        let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, T).unwrap();
        assert_eq!(r1.gather_finished(rep("before")).unwrap(), None);
        drop(r1);
        // The new process numbers its reports from 1 again: not taken for duplicates.
        let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, T).unwrap();
        assert_eq!(r1.gather_finished(rep("after")).unwrap(), None);
        assert_eq!(r0.gather_finished(Finished::default()).unwrap().unwrap()[1].finished, rep("before"));
        assert_eq!(r0.gather_finished(Finished::default()).unwrap().unwrap()[1].finished, rep("after"));
        // `Incompatible`, not the `Timeout` of a join retried until `T`: refused at once.
        let e = TcpGroup::join(1, 3, "127.0.0.1", port, T).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Incompatible, "{e}");
    }

    #[test]
    fn a_keyed_group_refuses_ranks_without_the_key() {
        let port = free_port();
        let keyed = |k: &str| NetConfig::with_key(Some(AuthKey::new(k).unwrap()));
        let r0 = TcpGroup::join_with(0, 2, "127.0.0.1", port, T, keyed("group-key-0123456")).unwrap();
        for config in [keyed("other-key-01234567"), NetConfig::default()] {
            let e = TcpGroup::join_with(1, 2, "127.0.0.1", port, T, config).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Unauthenticated, "{e}");
        }
        let r1 = TcpGroup::join_with(1, 2, "127.0.0.1", port, T, keyed("group-key-0123456")).unwrap();
        assert_eq!(r1.gather_finished(rep("x")).unwrap(), None);
        assert_eq!(r0.gather_finished(rep("y")).unwrap().unwrap(), ranked([rep("y"), rep("x")]));
        assert_eq!(r0.stats().unwrap().unauthenticated, 2);
    }
}
