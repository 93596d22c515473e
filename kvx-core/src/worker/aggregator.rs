//! [`FinishedAggregator`]: rank 0 reports an id once every rank of the group reported it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::clock::Every;
use crate::error::Error;
use crate::ids::RequestId;
use crate::meta::{FailedRecv, Finished, RankReport};

/// How much an aggregator keeps of ids some but not all ranks have reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AggregatorLimits {
    /// The most partial ids kept (sending and receiving together); a new one beyond it evicts
    /// the oldest. Default [`DEFAULT_MAX_PARTIAL`](Self::DEFAULT_MAX_PARTIAL).
    pub max_partial: usize,
    /// A partial id not completed within this of its first report is dropped. Default
    /// [`DEFAULT_PARTIAL_TTL`](Self::DEFAULT_PARTIAL_TTL).
    pub partial_ttl: Duration,
}

impl AggregatorLimits {
    /// 65 536 partial ids (about 30 MB at the cap): far more than an engine has in flight, which
    /// is at most its running batch (vLLM's `max_num_seqs`, 256 to 1024 by default) plus the
    /// prefill holds it keeps for readers, a few thousand.
    pub const DEFAULT_MAX_PARTIAL: usize = 1 << 16;
    /// 10 minutes: far beyond the worker's own bounds on an id (a load fails within its handshake,
    /// transfer and confirmation timeouts, 75 s by default; a hold ends with its lease), so only
    /// ids that a rank will never report (forged, or of a rank that left) expire.
    pub const DEFAULT_PARTIAL_TTL: Duration = Duration::from_secs(600);
}

impl Default for AggregatorLimits {
    fn default() -> Self {
        AggregatorLimits { max_partial: Self::DEFAULT_MAX_PARTIAL, partial_ttl: Self::DEFAULT_PARTIAL_TTL }
    }
}

/// A [`FinishedAggregator`]'s counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AggregatorStats {
    /// Ids some but not all ranks have reported, now.
    pub partial: usize,
    /// Ids every rank reported (returned once each).
    pub completed: u64,
    /// Ids a rank reported again (in the same report or a later one) before every rank had:
    /// counted once for that rank.
    pub repeated: u64,
    /// Reports of a rank outside the group, dropped whole.
    pub foreign_reports: u64,
    /// Partial ids dropped after [`AggregatorLimits::partial_ttl`].
    pub expired: u64,
    /// Partial ids dropped, the oldest first, to keep [`AggregatorLimits::max_partial`].
    pub evicted: u64,
}

/// Which of a report's lists an id came in: the two are aggregated apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Side {
    Sending,
    /// `recving` and `failed_recving` together.
    Recving,
}

type Key = (Side, RequestId);

/// The ranks that reported an id.
#[derive(Debug)]
enum RankSet {
    /// Groups of at most 64 ranks (every tensor-parallel group in practice).
    Small(u64),
    Large(Box<[u64]>),
}

impl RankSet {
    fn new(world_size: u32) -> Self {
        if world_size <= 64 {
            RankSet::Small(0)
        } else {
            RankSet::Large(vec![0; world_size.div_ceil(64) as usize].into_boxed_slice())
        }
    }

    /// Adds `rank` (below the group's size); false if it was there.
    fn insert(&mut self, rank: u32) -> bool {
        let (word, bit) = match self {
            RankSet::Small(w) => (w, rank),
            RankSet::Large(words) => (&mut words[(rank / 64) as usize], rank % 64),
        };
        let had = *word & (1 << bit) != 0;
        *word |= 1 << bit;
        !had
    }

    fn len(&self) -> u32 {
        match self {
            RankSet::Small(w) => w.count_ones(),
            RankSet::Large(words) => words.iter().map(|w| w.count_ones()).sum(),
        }
    }
}

#[derive(Debug)]
struct Partial {
    ranks: RankSet,
    /// When the first rank reported it.
    since: Instant,
    /// Its place in [`FinishedAggregator::order`].
    order: u64,
    /// The first failure a rank reported for a load.
    failure: Option<Error>,
}

/// How often drops are logged at most.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Rank 0's view of the whole tensor-parallel group: an id is reported once every rank (of
/// `world_size`) reported it, each rank counted once however often it reports the id. A load that
/// failed on any rank is reported failed (once all ranks are done with it).
///
/// What it keeps is bounded: at most [`AggregatorLimits::max_partial`] partial ids (a new one
/// evicts the oldest), none older than [`AggregatorLimits::partial_ttl`]. A rank that floods
/// reports of ids the others never report (forged, or a buggy rank) costs bounded memory; what is
/// dropped is counted in [`stats`](Self::stats) and logged at most every 10 s.
#[derive(Debug)]
pub struct FinishedAggregator {
    world_size: u32,
    limits: AggregatorLimits,
    partial: HashMap<Key, Partial>,
    /// The partial ids, oldest first.
    order: BTreeMap<u64, Key>,
    next_order: u64,
    stats: AggregatorStats,
    log: Every,
}

impl FinishedAggregator {
    /// An aggregator for `world_size` ranks with the default limits.
    pub fn new(world_size: u32) -> Self {
        Self::with_limits(world_size, AggregatorLimits::default())
    }

    /// An aggregator for `world_size` ranks keeping partial ids within `limits`.
    pub fn with_limits(world_size: u32, limits: AggregatorLimits) -> Self {
        FinishedAggregator {
            world_size: world_size.max(1),
            limits: AggregatorLimits { max_partial: limits.max_partial.max(1), ..limits },
            partial: HashMap::new(),
            order: BTreeMap::new(),
            next_order: 0,
            stats: AggregatorStats::default(),
            log: Every::new(LOG_EVERY),
        }
    }

    /// The limits.
    pub fn limits(&self) -> AggregatorLimits {
        self.limits
    }

    /// Adds the reports of some ranks at `now` and returns the ids that every rank has now
    /// reported. First drops the partial ids older than the TTL. A rank's report of an id it
    /// already reported counts once; a report of a rank outside the group is dropped.
    pub fn aggregate(&mut self, now: Instant, reports: impl IntoIterator<Item = RankReport>) -> Finished {
        let before = self.stats;
        self.expire(now);
        let mut out = Finished::default();
        // Ids completed in this call: a repeat of one later in the call is not a new partial id.
        let mut done = HashSet::new();
        for RankReport { rank, finished } in reports {
            if rank >= self.world_size {
                self.stats.foreign_reports += 1;
                continue;
            }
            let recvs = finished.recving.into_iter().map(|id| (id, None));
            let fails = finished.failed_recving.into_iter().map(|f| (f.request_id, Some(f.error)));
            let sends = finished.sending.into_iter().map(|id| ((Side::Sending, id), None));
            let all = sends.chain(recvs.chain(fails).map(|(id, f)| ((Side::Recving, id), f)));
            for (key, failure) in all {
                if done.contains(&key) {
                    self.stats.repeated += 1;
                    continue;
                }
                if let Some((key, failure)) = self.add(now, rank, key, failure) {
                    done.insert(key.clone());
                    self.stats.completed += 1;
                    match (key, failure) {
                        ((Side::Sending, id), _) => out.sending.push(id),
                        ((Side::Recving, id), None) => out.recving.push(id),
                        ((Side::Recving, id), Some(error)) => {
                            out.failed_recving.push(FailedRecv { request_id: id, error })
                        }
                    }
                }
            }
        }
        self.log_drops(now, &before);
        out
    }

    /// Counts `rank`'s report of `key`; returns it (with the first failure reported) once every
    /// rank has.
    fn add(
        &mut self,
        now: Instant,
        rank: u32,
        key: Key,
        failure: Option<Error>,
    ) -> Option<(Key, Option<Error>)> {
        if let Some(p) = self.partial.get_mut(&key) {
            if !p.ranks.insert(rank) {
                self.stats.repeated += 1;
                return None;
            }
            if p.failure.is_none() {
                p.failure = failure;
            }
            if p.ranks.len() < self.world_size {
                return None;
            }
            let p = self.partial.remove(&key)?;
            self.order.remove(&p.order);
            return Some((key, p.failure));
        }
        let mut ranks = RankSet::new(self.world_size);
        ranks.insert(rank);
        if ranks.len() >= self.world_size {
            return Some((key, failure));
        }
        while self.partial.len() >= self.limits.max_partial {
            let Some((_, oldest)) = self.order.pop_first() else { break };
            self.partial.remove(&oldest);
            self.stats.evicted += 1;
        }
        let order = self.next_order;
        self.next_order += 1;
        self.order.insert(order, key.clone());
        self.partial.insert(key, Partial { ranks, since: now, order, failure });
        None
    }

    /// Drops the partial ids first reported `partial_ttl` or more before `now`.
    fn expire(&mut self, now: Instant) {
        while let Some((_, key)) = self.order.first_key_value() {
            match self.partial.get(key) {
                Some(p) if now.saturating_duration_since(p.since) < self.limits.partial_ttl => break,
                Some(_) => {
                    self.partial.remove(key);
                    self.stats.expired += 1;
                }
                None => {}
            }
            self.order.pop_first();
        }
    }

    fn log_drops(&mut self, now: Instant, before: &AggregatorStats) {
        let s = &self.stats;
        let dropped = (s.expired, s.evicted, s.foreign_reports)
            != (before.expired, before.evicted, before.foreign_reports);
        if dropped && self.log.due(now) {
            warn!(
                expired = s.expired,
                evicted = s.evicted,
                foreign_reports = s.foreign_reports,
                partial = self.partial.len(),
                max_partial = self.limits.max_partial,
                "rank 0 dropped reported ids that not every rank reported (totals so far)"
            );
        }
    }

    /// Ids some but not all ranks have reported.
    pub fn num_partial(&self) -> usize {
        self.partial.len()
    }

    /// The counters.
    pub fn stats(&self) -> AggregatorStats {
        AggregatorStats { partial: self.partial.len(), ..self.stats }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn sending(rank: u32, ids: &[&str]) -> RankReport {
        let finished =
            Finished { sending: ids.iter().map(|s| RequestId::new(*s)).collect(), ..Default::default() };
        RankReport { rank, finished }
    }

    fn ids(v: &[RequestId]) -> Vec<&str> {
        v.iter().map(|i| i.as_str()).collect()
    }

    #[test]
    fn a_rank_reporting_an_id_again_never_completes_it() {
        let now = Instant::now();
        let mut agg = FinishedAggregator::new(2);
        // Twice in one report, in two reports of one call, and across calls.
        assert!(agg.aggregate(now, [sending(1, &["a", "a"]), sending(1, &["a"])]).is_empty());
        assert!(agg.aggregate(now, [sending(1, &["a"])]).is_empty());
        assert_eq!(agg.stats().repeated, 3);
        assert_eq!(agg.num_partial(), 1);
        // Another rank completes it, once.
        let out = agg.aggregate(now, [sending(0, &["a"]), sending(0, &["a"]), sending(1, &["a"])]);
        assert_eq!(ids(&out.sending), ["a"]);
        assert_eq!(agg.num_partial(), 0);
        let s = agg.stats();
        assert_eq!((s.completed, s.repeated, s.partial), (1, 5, 0), "{s:?}");
    }

    #[test]
    fn distinct_ranks_complete_an_id_and_a_failure_on_any_rank_fails_it() {
        let now = Instant::now();
        let mut agg = FinishedAggregator::new(3);
        let failed = |rank| RankReport {
            rank,
            finished: Finished {
                failed_recving: vec![FailedRecv {
                    request_id: "r".into(),
                    error: Error::new(ErrorKind::Transfer, "down"),
                }],
                ..Default::default()
            },
        };
        let recv = |rank| RankReport {
            rank,
            finished: Finished { recving: vec!["r".into()], ..Default::default() },
        };
        assert!(agg.aggregate(now, [recv(0), failed(2)]).is_empty());
        let out = agg.aggregate(now, [recv(1), sending(1, &["r"])]);
        assert_eq!(out.failed_recving.len(), 1, "{out:?}");
        assert!(out.recving.is_empty() && out.sending.is_empty(), "sending is counted apart");
        assert_eq!(agg.num_partial(), 1);
    }

    #[test]
    fn one_rank_completes_at_once_and_an_id_twice_in_its_report_comes_out_once() {
        let mut agg = FinishedAggregator::new(1);
        let out = agg.aggregate(Instant::now(), [sending(0, &["a", "a", "b"])]);
        assert_eq!(ids(&out.sending), ["a", "b"]);
        assert_eq!(agg.num_partial(), 0);
    }

    #[test]
    fn reports_of_ranks_outside_the_group_are_dropped_and_counted() {
        let now = Instant::now();
        let mut agg = FinishedAggregator::new(2);
        assert!(
            agg.aggregate(now, [sending(2, &["a"]), sending(u32::MAX, &["a"]), sending(0, &["a"])])
                .is_empty()
        );
        let s = agg.stats();
        assert_eq!((s.foreign_reports, s.partial), (2, 1), "{s:?}");
    }

    #[test]
    fn partial_ids_beyond_the_cap_evict_the_oldest_and_are_counted() {
        let now = Instant::now();
        let limits = AggregatorLimits { max_partial: 100, ..Default::default() };
        let mut agg = FinishedAggregator::with_limits(2, limits);
        let flood: Vec<String> = (0..10_000).map(|i| format!("forged-{i}")).collect();
        let flood: Vec<&str> = flood.iter().map(String::as_str).collect();
        assert!(agg.aggregate(now, [sending(0, &["live"]), sending(1, &flood)]).is_empty());
        let s = agg.stats();
        assert_eq!((s.partial, s.evicted), (100, 9_901), "{s:?}");
        // The newest are kept: the last forged ids, not "live".
        let out = agg.aggregate(now, [sending(0, &["forged-9999"]), sending(1, &["live"])]);
        assert_eq!(ids(&out.sending), ["forged-9999"]);
        assert_eq!(agg.num_partial(), 100, "\"live\" was evicted: rank 1's report of it is a new partial id");
    }

    #[test]
    fn partial_ids_expire_after_their_ttl_and_are_counted() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(60);
        let mut agg =
            FinishedAggregator::with_limits(2, AggregatorLimits { partial_ttl: ttl, ..Default::default() });
        assert!(agg.aggregate(t0, [sending(1, &["old"])]).is_empty());
        assert!(agg.aggregate(t0 + Duration::from_secs(30), [sending(1, &["young", "done"])]).is_empty());
        // Completed ids leave nothing behind to expire.
        assert_eq!(
            ids(&agg.aggregate(t0 + Duration::from_secs(31), [sending(0, &["done"])]).sending),
            ["done"]
        );
        assert!(agg.aggregate(t0 + ttl - Duration::from_millis(1), []).is_empty());
        assert_eq!(agg.num_partial(), 2, "not yet");
        // "old" expires: rank 0's report of it now starts a new partial id instead of completing.
        assert!(agg.aggregate(t0 + ttl, [sending(0, &["old"])]).is_empty());
        let s = agg.stats();
        assert_eq!((s.expired, s.partial), (1, 2), "{s:?}");
        let out = agg.aggregate(t0 + ttl, [sending(0, &["young"])]);
        assert_eq!(ids(&out.sending), ["young"]);
        agg.aggregate(t0 + ttl * 3, []);
        let s = agg.stats();
        assert_eq!((s.expired, s.partial, s.completed), (2, 0, 2), "{s:?}");
    }

    #[test]
    fn groups_of_more_than_64_ranks_count_each_rank() {
        let now = Instant::now();
        let mut agg = FinishedAggregator::new(130);
        for rank in 0..129 {
            assert!(agg.aggregate(now, [sending(rank, &["a"]), sending(rank, &["a"])]).is_empty());
        }
        assert_eq!(agg.stats().repeated, 129);
        assert_eq!(ids(&agg.aggregate(now, [sending(129, &["a"])]).sending), ["a"]);
    }
}
