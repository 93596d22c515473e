//! Releases that came before their hold, kept per sender.
//!
//! A decode worker may finish its READ before the prefill worker has seen the hold in its
//! metadata, so a release that names no hold yet is kept until the hold arrives (or it expires,
//! after `early_release_ttl`). Anyone who can send notifications can also send releases for
//! holds that never come, so what is kept is bounded per sender, the agent the transport names
//! as the notification's sender:
//!
//! - each sender has its own budget of `early_releases_per_sender` releases, its oldest pushed out
//!   first: a flood pushes out only the flooder's own releases;
//! - at most `max_early_senders` senders are kept: a new sender that finds the table full evicts
//!   the sender that holds the most releases (of those, the one heard from least recently), so
//!   the few releases of a real decode worker go last;
//! - at most [`MAX_EARLY_READERS`] releases of one hold from one sender (a decode engine up to that
//!   many times wider than the prefill engine).
//!
//! In all at most `early_releases_per_sender * max_early_senders` releases. Each release dropped
//! to keep these bounds is counted stray and `early_notifications_dropped`.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::WorkerConfig;
use super::ttl::{Key, TtlMap};
use crate::ids::AgentName;
use crate::meta::ReplyTo;

/// At most this many releases of one hold from one sender are kept before the hold comes.
pub(super) const MAX_EARLY_READERS: usize = 32;

/// A release that came before its hold: its reader, readers and whom to answer.
#[derive(Debug)]
pub(super) struct Early {
    pub(super) reader: u32,
    pub(super) readers: u32,
    pub(super) reply_to: Option<ReplyTo>,
    /// Answered "held" when it came (its hold had not been handed to the worker yet): the hold
    /// that comes frees it without answering again.
    pub(super) answered: bool,
}

/// An entry kept per sender before its hold comes: each reader of a hold has one.
pub(super) trait Reader {
    /// Whether `later`, from the same sender for the same hold, stands for this entry (the same
    /// reader again): it takes its place.
    fn replaced_by(&self, later: &Self) -> bool;
}

impl Reader for Early {
    fn replaced_by(&self, later: &Self) -> bool {
        self.reader == later.reader
    }
}

/// What keeping one release cost, in releases: `stray` were not kept (a reader's earlier release
/// it replaced, the release itself past [`MAX_EARLY_READERS`], releases pushed out), and of them
/// `dropped` were dropped to keep the bounds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Kept {
    pub(super) stray: u64,
    pub(super) dropped: u64,
}

impl Kept {
    /// `n` releases dropped to keep the bounds.
    fn dropped(n: u64) -> Self {
        Kept { stray: n, dropped: n }
    }
}

#[derive(Debug)]
struct Sender<E> {
    releases: TtlMap<Vec<E>>,
    /// When it was last heard from (see [`EarlyReleases::heard`]).
    last: u64,
}

/// The releases that came before their hold, per sender (see the module's documentation).
#[derive(Debug)]
pub(super) struct EarlyReleases<E = Early> {
    per_sender: usize,
    max_senders: usize,
    ttl: Duration,
    /// Ordered by name, so that a hold takes its releases in the same order every run.
    senders: BTreeMap<AgentName, Sender<E>>,
    /// Releases kept so far: tells which sender was heard from least recently.
    heard: u64,
}

impl<E: Reader> EarlyReleases<E> {
    pub(super) fn new(config: &WorkerConfig) -> Self {
        EarlyReleases {
            per_sender: config.early_releases_per_sender,
            max_senders: config.max_early_senders,
            ttl: config.early_release_ttl,
            senders: BTreeMap::new(),
            heard: 0,
        }
    }

    /// Keeps `early`, from `from`, for the hold `key`. A reader's second release replaces its
    /// first.
    pub(super) fn insert(&mut self, now: Instant, from: &AgentName, key: Key, early: E) -> Kept {
        if self.max_senders == 0 {
            return Kept::dropped(1);
        }
        let mut evicted = 0;
        if !self.senders.contains_key(from) && self.senders.len() >= self.max_senders {
            evicted = self.evict();
        }
        self.heard += 1;
        let (per_sender, ttl) = (self.per_sender, self.ttl);
        let sender = self.senders.entry(from.clone()).or_insert_with(|| Sender {
            releases: TtlMap::weighted(per_sender, ttl, |e| e.len() as u64),
            last: 0,
        });
        sender.last = self.heard;
        let mut kept = Kept::dropped(evicted);
        if !sender.releases.contains(&key) {
            let pushed_out = sender.releases.insert(now, key, vec![early]);
            kept.stray += pushed_out;
            kept.dropped += pushed_out;
        } else {
            let (mut replaced, mut past_readers) = (0, 0);
            let pushed_out = sender.releases.update(&key, |list| {
                if let Some(e) = list.iter_mut().find(|e| e.replaced_by(&early)) {
                    *e = early;
                    replaced = 1;
                } else if list.len() < MAX_EARLY_READERS {
                    list.push(early);
                } else {
                    past_readers = 1;
                }
            });
            kept.stray += replaced + past_readers + pushed_out;
            kept.dropped += past_readers + pushed_out;
        }
        if sender.releases.is_empty() {
            self.senders.remove(from);
        }
        kept
    }

    /// Evicts the sender with the most releases (of those, the one heard from least recently);
    /// returns how many releases it held.
    fn evict(&mut self) -> u64 {
        let most = self.senders.iter().max_by_key(|(_, s)| (s.releases.weight(), Reverse(s.last)));
        let Some(name) = most.map(|(name, _)| name.clone()) else { return 0 };
        self.senders.remove(&name).map_or(0, |s| s.releases.weight())
    }

    /// Takes every sender's releases of the hold `key`, senders by name.
    pub(super) fn take(&mut self, key: &Key) -> Vec<E> {
        if self.senders.is_empty() {
            return Vec::new();
        }
        let mut taken = Vec::new();
        for sender in self.senders.values_mut() {
            taken.extend(sender.releases.take(key).into_iter().flatten());
        }
        self.senders.retain(|_, s| !s.releases.is_empty());
        taken
    }

    /// Whether some sender's entry for `key` satisfies `f`.
    pub(super) fn any(&self, key: &Key, f: impl Fn(&E) -> bool) -> bool {
        self.senders.values().any(|s| s.releases.get(key).is_some_and(|list| list.iter().any(&f)))
    }

    /// Whether nothing is kept.
    pub(super) fn is_empty(&self) -> bool {
        self.senders.is_empty()
    }

    /// Drops the releases whose time is up; returns how many.
    pub(super) fn expire(&mut self, now: Instant) -> u64 {
        self.expire_into(now, &mut Vec::new())
    }

    /// Drops the entries whose time is up into `out`; returns how many.
    pub(super) fn expire_into(&mut self, now: Instant, out: &mut Vec<E>) -> u64 {
        let mut lists = Vec::new();
        let expired = self.senders.values_mut().map(|s| s.releases.expire_into(now, &mut lists)).sum();
        out.extend(lists.into_iter().flatten());
        self.senders.retain(|_, s| !s.releases.is_empty());
        expired
    }

    /// The earliest expiry.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.senders.values().filter_map(|s| s.releases.next_deadline()).min()
    }

    /// The releases kept, and from how many senders.
    #[cfg(test)]
    pub(super) fn len(&self) -> (u64, usize) {
        (self.senders.values().map(|s| s.releases.weight()).sum(), self.senders.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::HexBytes;
    use crate::ids::RequestId;

    fn key(id: &str) -> Key {
        (RequestId::new(id), HexBytes([1; 16]))
    }

    fn early(reader: u32) -> Early {
        Early { reader, readers: 2, reply_to: None, answered: false }
    }

    fn releases(per_sender: usize, max_senders: usize) -> EarlyReleases<Early> {
        EarlyReleases::new(&WorkerConfig {
            early_releases_per_sender: per_sender,
            max_early_senders: max_senders,
            ..WorkerConfig::new("prefill".into(), 0, 1, 4)
        })
    }

    #[test]
    fn a_flooding_sender_pushes_out_only_its_own_releases() {
        let now = Instant::now();
        let mut e = releases(100, 4);
        let (real, flood) = (AgentName::new("decode"), AgentName::new("mallory"));
        assert_eq!(e.insert(now, &real, key("real"), early(0)), Kept::default());
        let mut kept = Kept::default();
        for i in 0..100_000 {
            let k = e.insert(now, &flood, key(&format!("ghost-{i}")), early(0));
            kept.stray += k.stray;
            kept.dropped += k.dropped;
        }
        assert_eq!(kept, Kept::dropped(100_000 - 100));
        assert_eq!(e.len(), (101, 2), "the flood at its cap, the real release kept");
        assert_eq!(e.take(&key("real")).len(), 1);
        assert_eq!(e.take(&key("ghost-99999")).len(), 1, "the flood's newest kept");
        assert!(e.take(&key("ghost-0")).is_empty(), "its oldest went first");
    }

    #[test]
    fn a_new_sender_evicts_the_one_with_the_most_releases_then_the_least_recent() {
        let now = Instant::now();
        let mut e = releases(8, 2);
        let name = AgentName::new;
        e.insert(now, &name("quiet"), key("q"), early(0));
        for i in 0..5 {
            e.insert(now, &name("loud"), key(&format!("l{i}")), early(0));
        }
        assert_eq!(e.insert(now, &name("new"), key("n"), early(0)), Kept::dropped(5), "loud evicted");
        assert_eq!(e.len(), (2, 2));
        // "quiet" and "new" hold one each: "quiet" was heard from least recently.
        assert_eq!(e.insert(now, &name("newer"), key("m"), early(0)), Kept::dropped(1));
        assert!(e.take(&key("q")).is_empty());
        assert_eq!(e.take(&key("n")).len(), 1);
        assert_eq!(e.len(), (1, 1), "a sender with nothing left is forgotten");
        assert_eq!(releases(8, 0).insert(now, &name("any"), key("a"), early(0)), Kept::dropped(1));
    }

    #[test]
    fn releases_of_one_hold_are_kept_per_reader_and_taken_from_every_sender() {
        let now = Instant::now();
        let mut e = releases(64, 4);
        let (a, b) = (AgentName::new("rank-a"), AgentName::new("rank-b"));
        e.insert(now, &a, key("h"), early(0));
        assert_eq!(e.insert(now, &a, key("h"), early(0)), Kept { stray: 1, dropped: 0 }, "a duplicate");
        e.insert(now, &b, key("h"), early(1));
        for reader in 2..MAX_EARLY_READERS as u32 + 1 {
            e.insert(now, &a, key("h"), early(reader));
        }
        assert_eq!(e.insert(now, &a, key("h"), early(99)), Kept::dropped(1), "past the readers of a hold");
        assert_eq!(e.take(&key("h")).len(), MAX_EARLY_READERS + 1);
        assert_eq!(e.len(), (0, 0));
        e.insert(now, &a, key("x"), early(0));
        assert_eq!(e.next_deadline(), Some(now + WorkerConfig::new("p".into(), 0, 1, 4).early_release_ttl));
        assert_eq!(e.expire(now + Duration::from_secs(3600)), 1);
        assert_eq!((e.len(), e.next_deadline()), ((0, 0), None));
    }
}
