//! A bounded map whose entries expire: the prefill worker's memory of releases and holds.
//!
//! - Early releases: a decode worker may finish its READ before the prefill worker has seen the
//!   hold in its metadata, so a release that names no hold yet is kept until the hold arrives.
//! - Ended holds: a release that comes after its hold expired or was released is answered "not
//!   held" at once (not kept as early).
//!
//! Anyone who can send notifications can also send releases for holds that will never exist: the
//! map holds at most `capacity` entries (the oldest goes first) and each expires after `ttl`, so a
//! flood costs bounded memory and time. Entries are keyed by request id and nonce together: a
//! forged release for a real request id never displaces or matches the real one.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::auth::Nonce;
use crate::ids::RequestId;

/// A hold's key: the prefill engine's request id and the hold's nonce.
pub(super) type Key = (RequestId, Nonce);

#[derive(Debug)]
pub(super) struct TtlMap<V> {
    capacity: usize,
    ttl: Duration,
    /// How many notifications an entry stands for (what dropping it adds to the stray counter).
    weight: fn(&V) -> u64,
    entries: HashMap<Key, (Instant, V)>,
    /// Keys in arrival order (with their expiry, so a re-inserted key is told apart).
    order: VecDeque<(Key, Instant)>,
}

impl<V> TtlMap<V> {
    /// A map of at most `capacity` entries kept `ttl` each, each standing for one notification.
    pub(super) fn new(capacity: usize, ttl: Duration) -> Self {
        Self::weighted(capacity, ttl, |_| 1)
    }

    /// The same, each entry standing for `weight(entry)` notifications.
    pub(super) fn weighted(capacity: usize, ttl: Duration, weight: fn(&V) -> u64) -> Self {
        TtlMap { capacity, ttl, weight, entries: HashMap::new(), order: VecDeque::new() }
    }

    /// Keeps `value` until `now + ttl`. Returns how many notifications it pushed out (a replaced
    /// entry and evictions, by weight), for the stray counter.
    pub(super) fn insert(&mut self, now: Instant, key: Key, value: V) -> u64 {
        if self.capacity == 0 {
            return (self.weight)(&value);
        }
        let until = now + self.ttl;
        let mut dropped =
            self.entries.insert(key.clone(), (until, value)).map_or(0, |(_, v)| (self.weight)(&v));
        self.order.push_back((key, until));
        // `order` also keeps the keys of taken entries until they reach the front: bound it too.
        while self.entries.len() > self.capacity || self.order.len() > 2 * self.capacity {
            dropped += self.pop_front();
        }
        dropped
    }

    /// Takes the entry of `key`, if it is there.
    pub(super) fn take(&mut self, key: &Key) -> Option<V> {
        // Its entry in `order` is skipped when it reaches the front.
        self.entries.remove(key).map(|(_, v)| v)
    }

    /// The value of `key`'s entry, if it is there.
    pub(super) fn get_mut(&mut self, key: &Key) -> Option<&mut V> {
        self.entries.get_mut(key).map(|(_, v)| v)
    }

    /// Whether `key` has an entry.
    pub(super) fn contains(&self, key: &Key) -> bool {
        self.entries.contains_key(key)
    }

    /// Drops the entries whose time is up; returns how many notifications they stood for.
    pub(super) fn expire(&mut self, now: Instant) -> u64 {
        let mut expired = 0;
        while let Some((_, until)) = self.order.front() {
            if *until > now {
                break;
            }
            expired += self.pop_front();
        }
        expired
    }

    /// Removes the oldest entry of `order`; returns the weight of the entry if it was still live.
    fn pop_front(&mut self) -> u64 {
        let Some((key, until)) = self.order.pop_front() else { return 0 };
        if self.entries.get(&key).is_some_and(|(u, _)| *u == until) {
            self.entries.remove(&key).map_or(0, |(_, v)| (self.weight)(&v))
        } else {
            0
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The earliest expiry.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.order
            .iter()
            .find(|(k, until)| self.entries.get(k).is_some_and(|(u, _)| u == until))
            .map(|(_, until)| *until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::HexBytes;

    fn key(id: &str, n: u8) -> Key {
        (RequestId::new(id), HexBytes([n; 16]))
    }

    #[test]
    fn a_flood_is_bounded_and_the_newest_survive() {
        let now = Instant::now();
        let mut early = TtlMap::<()>::new(100, Duration::from_secs(10));
        let mut dropped = 0;
        for i in 0..100_000u32 {
            dropped += early.insert(now, key(&i.to_string(), 1), ());
        }
        assert_eq!(early.len(), 100);
        assert_eq!(dropped, 100_000 - 100);
        assert!(early.order.len() <= 100, "no stale keys pile up: {}", early.order.len());
        assert!(early.take(&key("99999", 1)).is_some());
        assert!(early.take(&key("0", 1)).is_none(), "the oldest went first");
    }

    #[test]
    fn entries_expire_and_match_only_their_nonce() {
        let now = Instant::now();
        let mut early = TtlMap::<()>::new(8, Duration::from_secs(10));
        early.insert(now, key("a", 1), ());
        early.insert(now + Duration::from_secs(5), key("b", 1), ());
        assert!(early.take(&key("a", 2)).is_none(), "another nonce");
        assert_eq!(early.next_deadline(), Some(now + Duration::from_secs(10)));
        assert_eq!(early.expire(now + Duration::from_secs(10)), 1);
        assert!(early.take(&key("a", 1)).is_none(), "expired");
        // Re-inserting keeps the later expiry.
        early.insert(now + Duration::from_secs(6), key("b", 1), ());
        assert_eq!(early.expire(now + Duration::from_secs(15)), 0);
        assert!(early.take(&key("b", 1)).is_some());
        assert_eq!((early.len(), early.next_deadline()), (0, None));
        assert_eq!(
            TtlMap::<()>::new(0, Duration::ZERO).insert(now, key("x", 0), ()),
            1,
            "capacity 0 keeps none"
        );
    }
}
