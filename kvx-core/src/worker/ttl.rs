//! A bounded map whose entries expire: the prefill worker's memory of releases and holds.
//!
//! - Early releases: each sender's releases that name no hold yet (see `early`).
//! - Ended holds: a release that comes after its hold expired or was released is answered "not
//!   held" at once (not kept as early).
//!
//! The map holds at most `capacity` entries (the oldest goes first) and each expires after `ttl`,
//! so a flood costs bounded memory and time. Entries are keyed by request id and nonce together: a
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
    /// How many notifications an entry stands for (what dropping it adds to the stray counter);
    /// the map holds at most `capacity` of them.
    weight: fn(&V) -> u64,
    /// The weight of the live entries.
    total: u64,
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
        TtlMap { capacity, ttl, weight, total: 0, entries: HashMap::new(), order: VecDeque::new() }
    }

    /// Keeps `value` until `now + ttl`. Returns how many notifications it pushed out (a replaced
    /// entry and evictions, by weight), for the stray counter.
    pub(super) fn insert(&mut self, now: Instant, key: Key, value: V) -> u64 {
        if self.capacity == 0 {
            return (self.weight)(&value);
        }
        let until = now + self.ttl;
        self.total += (self.weight)(&value);
        let replaced = self.entries.insert(key.clone(), (until, value)).map_or(0, |(_, v)| (self.weight)(&v));
        self.total -= replaced;
        self.order.push_back((key, until));
        replaced + self.shrink()
    }

    /// Changes the value of `key`'s entry, if it is there, with `change` (its expiry stays).
    /// Returns how many notifications that pushed out of the map (the oldest go first).
    pub(super) fn update(&mut self, key: &Key, change: impl FnOnce(&mut V)) -> u64 {
        let Some((_, value)) = self.entries.get_mut(key) else { return 0 };
        let before = (self.weight)(value);
        change(value);
        self.total = self.total - before + (self.weight)(value);
        self.shrink()
    }

    /// Drops the oldest entries while the map holds more than its capacity; returns their weight.
    fn shrink(&mut self) -> u64 {
        let mut dropped = 0;
        // `order` also keeps the keys of taken entries until they reach the front: bound it too.
        while self.total > self.capacity as u64 || self.order.len() > 2 * self.capacity {
            let Some(entry) = self.pop_front() else { break };
            dropped += entry.map_or(0, |(weight, _)| weight);
        }
        dropped
    }

    /// Takes the entry of `key`, if it is there.
    pub(super) fn take(&mut self, key: &Key) -> Option<V> {
        // Its entry in `order` is skipped when it reaches the front.
        let (_, value) = self.entries.remove(key)?;
        self.total -= (self.weight)(&value);
        Some(value)
    }

    /// The value of `key`'s entry, if it is there.
    pub(super) fn get(&self, key: &Key) -> Option<&V> {
        self.entries.get(key).map(|(_, v)| v)
    }

    /// The value of `key`'s entry, to change, if it is there.
    pub(super) fn get_mut(&mut self, key: &Key) -> Option<&mut V> {
        self.entries.get_mut(key).map(|(_, v)| v)
    }

    /// Whether the map has no entry.
    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The weight of the entries: how many notifications they stand for.
    pub(super) fn weight(&self) -> u64 {
        self.total
    }

    /// Whether `key` has an entry.
    pub(super) fn contains(&self, key: &Key) -> bool {
        self.entries.contains_key(key)
    }

    /// Drops the entries whose time is up; returns how many notifications they stood for.
    pub(super) fn expire(&mut self, now: Instant) -> u64 {
        self.expire_into(now, &mut Vec::new())
    }

    /// Drops the entries whose time is up into `out`; returns how many notifications they stood
    /// for.
    pub(super) fn expire_into(&mut self, now: Instant, out: &mut Vec<V>) -> u64 {
        let mut expired = 0;
        while let Some((_, until)) = self.order.front() {
            if *until > now {
                break;
            }
            if let Some(Some((weight, value))) = self.pop_front() {
                expired += weight;
                out.push(value);
            }
        }
        expired
    }

    /// Removes the oldest entry of `order`; returns the entry if it was still live (`None` for a
    /// stale one) with its weight, `None` when `order` is empty.
    fn pop_front(&mut self) -> Option<Option<(u64, V)>> {
        let (key, until) = self.order.pop_front()?;
        if self.entries.get(&key).is_none_or(|(u, _)| *u != until) {
            return Some(None);
        }
        let entry = self.entries.remove(&key).map(|(_, v)| ((self.weight)(&v), v));
        self.total -= entry.as_ref().map_or(0, |(w, _)| *w);
        Some(entry)
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
    fn weighted_entries_count_against_the_capacity_and_growing_one_pushes_the_oldest_out() {
        let now = Instant::now();
        let mut early = TtlMap::<Vec<u8>>::weighted(4, Duration::from_secs(10), |v| v.len() as u64);
        assert_eq!(early.insert(now, key("a", 1), vec![1, 2]), 0);
        assert_eq!(early.insert(now, key("b", 1), vec![1]), 0);
        // "b" grows to 3: 5 in all, so the oldest ("a", 2) goes.
        assert_eq!(early.update(&key("b", 1), |v| v.extend([2, 3])), 2);
        assert_eq!(early.len(), 1);
        assert_eq!(early.update(&key("none", 1), |v| v.push(0)), 0, "no entry, no change");
        assert_eq!(early.take(&key("b", 1)), Some(vec![1, 2, 3]));
        assert_eq!(early.insert(now, key("c", 1), vec![0; 4]), 0, "taking freed the room");
        assert_eq!(early.expire(now + Duration::from_secs(10)), 4, "expiry counts weights");
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
