//! [`ParallelGroup`]: one engine's tensor-parallel group, and the collective the workers need.

use std::collections::VecDeque;
use std::fmt;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::warn;

use crate::error::{Error, ErrorKind, Result};
use crate::meta::{Finished, RankReport};

/// One engine's tensor-parallel group, as the connector workers see it.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait ParallelGroup: Send + Sync + fmt::Debug {
    /// This worker's rank.
    fn rank(&self) -> u32;

    /// The number of ranks.
    fn world_size(&self) -> u32;

    /// The finished-ids collective, called by every rank once per step.
    ///
    /// Ranks other than 0 send `report` to rank 0 and get `None`. Rank 0 gets `Some` of its own
    /// report (first, as rank 0's) and those of the other ranks, each with the rank that sent it,
    /// waiting a bounded time for one from each: reports that arrive later are returned by a later
    /// call, never lost. A rank's report is only ever returned as that rank's: the aggregation
    /// counts each rank once per id ([`FinishedAggregator`](crate::FinishedAggregator)).
    fn gather_finished(&self, report: Finished) -> Result<Option<Vec<RankReport>>>;
}

/// The group of an engine with one rank.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleRank;

impl ParallelGroup for SingleRank {
    fn rank(&self) -> u32 {
        0
    }

    fn world_size(&self) -> u32 {
        1
    }

    fn gather_finished(&self, report: Finished) -> Result<Option<Vec<RankReport>>> {
        Ok(Some(vec![RankReport { rank: 0, finished: report }]))
    }
}

/// Rank 0's end of a gather: reports from the other ranks, one per rank per gather. The
/// in-process group and kvx-net's `TcpGroup` both gather through it.
#[derive(Debug)]
pub struct GatherInbox {
    world_size: u32,
    timeout: Duration,
    /// Reports that arrived beyond one per rank, kept for the next gather: at most one per rank
    /// (a rank's later reports are merged into it), so a rank that floods costs bounded entries.
    backlog: VecDeque<(u32, Finished)>,
}

impl GatherInbox {
    /// An inbox for a group of `world_size` ranks whose gathers wait at most `timeout`.
    pub fn new(world_size: u32, timeout: Duration) -> Self {
        GatherInbox { world_size, timeout, backlog: VecDeque::new() }
    }

    /// Collects at most one report per other rank, waiting until `timeout` for missing ones, and
    /// returns them with their ranks, rank 0's (`own`) first. `recv` waits for the next report
    /// until a deadline (`Ok(None)` when it passes).
    pub fn gather(
        &mut self,
        own: Finished,
        mut recv: impl FnMut(Instant) -> Result<Option<(u32, Finished)>>,
    ) -> Result<Vec<RankReport>> {
        let mut have = vec![false; self.world_size as usize];
        have[0] = true;
        let mut out = vec![RankReport { rank: 0, finished: own }];
        let mut keep = VecDeque::new();
        while let Some((rank, report)) = self.backlog.pop_front() {
            Self::place(&mut have, &mut out, &mut keep, rank, report);
        }
        let deadline = Instant::now() + self.timeout;
        while have.iter().any(|h| !h) {
            match recv(deadline)? {
                Some((rank, report)) => Self::place(&mut have, &mut out, &mut keep, rank, report),
                None => {
                    let missing: Vec<usize> = (0..have.len()).filter(|&r| !have[r]).collect();
                    warn!(?missing, timeout = ?self.timeout, "ranks did not report this step");
                    break;
                }
            }
        }
        self.backlog = keep;
        Ok(out)
    }

    fn place(
        have: &mut [bool],
        out: &mut Vec<RankReport>,
        keep: &mut VecDeque<(u32, Finished)>,
        rank: u32,
        report: Finished,
    ) {
        match have.get_mut(rank as usize) {
            Some(h) if !*h => {
                *h = true;
                out.push(RankReport { rank, finished: report });
            }
            Some(_) => match keep.iter_mut().find(|(r, _)| *r == rank) {
                Some((_, kept)) => kept.extend(report),
                None => keep.push_back((rank, report)),
            },
            None => warn!(rank, "report from a rank outside the group dropped"),
        }
    }
}

type Rank0Inbox = (Receiver<(u32, Finished)>, GatherInbox);

/// A group of threads in one process (for tests and the in-process demo). Create all ranks with
/// [`InProcessGroup::new_group`].
pub struct InProcessGroup {
    rank: u32,
    world_size: u32,
    to_rank0: Sender<(u32, Finished)>,
    inbox: Option<Mutex<Rank0Inbox>>,
}

impl fmt::Debug for InProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

impl InProcessGroup {
    /// All ranks of a group of `world_size`; rank 0 waits at most `timeout` per gather.
    pub fn new_group(world_size: u32, timeout: Duration) -> Vec<Arc<InProcessGroup>> {
        let world_size = world_size.max(1);
        let (tx, rx) = mpsc::channel();
        let mut rx = Some(rx);
        (0..world_size)
            .map(|rank| {
                let inbox = if rank == 0 {
                    rx.take().map(|rx| Mutex::new((rx, GatherInbox::new(world_size, timeout))))
                } else {
                    None
                };
                Arc::new(InProcessGroup { rank, world_size, to_rank0: tx.clone(), inbox })
            })
            .collect()
    }
}

impl ParallelGroup for InProcessGroup {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world_size
    }

    fn gather_finished(&self, report: Finished) -> Result<Option<Vec<RankReport>>> {
        let Some(inbox) = &self.inbox else {
            self.to_rank0
                .send((self.rank, report))
                .map_err(|_| Error::new(ErrorKind::State, "rank 0 of the group is gone"))?;
            return Ok(None);
        };
        let mut guard = inbox.lock().map_err(|_| Error::new(ErrorKind::State, "group lock poisoned"))?;
        let (rx, gather) = &mut *guard;
        let reports = gather.gather(report, |deadline| {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(m) => Ok(Some(m)),
                Err(RecvTimeoutError::Timeout) => Ok(None),
                Err(RecvTimeoutError::Disconnected) => Ok(None),
            }
        })?;
        Ok(Some(reports))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RequestId;

    fn report(id: &str) -> Finished {
        Finished { recving: vec![RequestId::new(id)], ..Default::default() }
    }

    /// `reports`, each as its rank's (rank 0's first, then 1, 2, ...).
    fn ranked(reports: impl IntoIterator<Item = Finished>) -> Vec<RankReport> {
        (0..).zip(reports).map(|(rank, finished)| RankReport { rank, finished }).collect()
    }

    #[test]
    fn rank0_gathers_one_report_per_rank_and_keeps_extras() {
        let g = InProcessGroup::new_group(3, Duration::from_secs(5));
        assert_eq!(g[1].gather_finished(report("a1")).unwrap(), None);
        assert_eq!(g[1].gather_finished(report("b1")).unwrap(), None);
        assert_eq!(g[2].gather_finished(report("a2")).unwrap(), None);
        let got = g[0].gather_finished(report("a0")).unwrap().unwrap();
        assert_eq!(got, ranked([report("a0"), report("a1"), report("a2")]));
        g[2].gather_finished(report("b2")).unwrap();
        let got = g[0].gather_finished(report("b0")).unwrap().unwrap();
        assert_eq!(got, ranked([report("b0"), report("b1"), report("b2")]));
    }

    #[test]
    fn a_rank_that_floods_reports_is_kept_as_one_merged_report() {
        // Rank 1 sends 10 000 reports while rank 0 waits for rank 2's.
        let mut inbox = GatherInbox::new(3, Duration::from_secs(5));
        let mut flood = (0..10_000).map(|i| (1, report(&format!("f{i}")))).chain([(2, report("two"))]);
        let out = inbox.gather(report("own"), |_| Ok(flood.next())).unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(inbox.backlog.len(), 1, "the rest merged into one entry");
        assert_eq!(inbox.backlog[0].1.recving.len(), 9_999);
        let next = inbox.gather(report("own2"), |_| Ok(None)).unwrap();
        assert_eq!((next[1].rank, next[1].finished.recving.len()), (1, 9_999), "nothing lost");
    }

    #[test]
    fn rank0_gives_up_after_its_timeout_and_later_reports_arrive_next_time() {
        let g = InProcessGroup::new_group(2, Duration::from_millis(20));
        let got = g[0].gather_finished(report("x0")).unwrap().unwrap();
        assert_eq!(got, ranked([report("x0")]));
        g[1].gather_finished(report("x1")).unwrap();
        let got = g[0].gather_finished(Finished::default()).unwrap().unwrap();
        assert_eq!(got, ranked([Finished::default(), report("x1")]));
    }
}
