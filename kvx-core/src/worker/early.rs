//! Notifications that arrive before their hold: kept in a bounded buffer, each for a bounded time.
//!
//! A decode worker may finish its READ before the prefill worker has seen the hold in its
//! metadata, so a release that names no hold yet is kept until the hold arrives. Anyone who can
//! send notifications can also send releases for holds that will never exist: the buffer holds
//! at most `capacity` entries (the oldest goes first) and each expires after `ttl`, so a flood
//! costs bounded memory and time. Entries are keyed by request id and nonce together: a forged
//! release for a real request id never displaces or matches the real one.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::auth::Nonce;
use crate::ids::RequestId;

type Key = (RequestId, Nonce);

#[derive(Debug)]
pub(super) struct EarlyReleases {
    capacity: usize,
    ttl: Duration,
    expiry: HashMap<Key, Instant>,
    /// Keys in arrival order (with their expiry, so a re-inserted key is told apart).
    order: VecDeque<(Key, Instant)>,
}

impl EarlyReleases {
    pub(super) fn new(capacity: usize, ttl: Duration) -> Self {
        EarlyReleases { capacity, ttl, expiry: HashMap::new(), order: VecDeque::new() }
    }

    /// Keeps a release until `now + ttl`. Returns how many entries it pushed out (duplicates and
    /// evictions), for the stray counter.
    pub(super) fn insert(&mut self, now: Instant, key: Key) -> u64 {
        if self.capacity == 0 {
            return 1;
        }
        let until = now + self.ttl;
        let mut dropped = u64::from(self.expiry.insert(key.clone(), until).is_some());
        self.order.push_back((key, until));
        // `order` also keeps the keys of taken entries until they reach the front: bound it too.
        while self.expiry.len() > self.capacity || self.order.len() > 2 * self.capacity {
            dropped += u64::from(self.pop_front());
        }
        dropped
    }

    /// Takes the release matching a new hold, if one came early.
    pub(super) fn take(&mut self, key: &Key) -> bool {
        // Its entry in `order` is skipped when it reaches the front.
        self.expiry.remove(key).is_some()
    }

    /// Drops the releases whose time is up; returns how many.
    pub(super) fn expire(&mut self, now: Instant) -> u64 {
        let mut expired = 0;
        while let Some((_, until)) = self.order.front() {
            if *until > now {
                break;
            }
            expired += u64::from(self.pop_front());
        }
        expired
    }

    /// Removes the oldest entry of `order`; true if it was still live.
    fn pop_front(&mut self) -> bool {
        let Some((key, until)) = self.order.pop_front() else { return false };
        if self.expiry.get(&key) == Some(&until) {
            self.expiry.remove(&key);
            true
        } else {
            false
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.expiry.len()
    }

    /// The earliest expiry.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.order.iter().find(|(k, until)| self.expiry.get(k) == Some(until)).map(|(_, until)| *until)
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
        let mut early = EarlyReleases::new(100, Duration::from_secs(10));
        let mut dropped = 0;
        for i in 0..100_000u32 {
            dropped += early.insert(now, key(&i.to_string(), 1));
        }
        assert_eq!(early.len(), 100);
        assert_eq!(dropped, 100_000 - 100);
        assert!(early.order.len() <= 100, "no stale keys pile up: {}", early.order.len());
        assert!(early.take(&key("99999", 1)));
        assert!(!early.take(&key("0", 1)), "the oldest went first");
    }

    #[test]
    fn entries_expire_and_match_only_their_nonce() {
        let now = Instant::now();
        let mut early = EarlyReleases::new(8, Duration::from_secs(10));
        early.insert(now, key("a", 1));
        early.insert(now + Duration::from_secs(5), key("b", 1));
        assert!(!early.take(&key("a", 2)), "another nonce");
        assert_eq!(early.next_deadline(), Some(now + Duration::from_secs(10)));
        assert_eq!(early.expire(now + Duration::from_secs(10)), 1);
        assert!(!early.take(&key("a", 1)), "expired");
        // Re-inserting keeps the later expiry.
        early.insert(now + Duration::from_secs(6), key("b", 1));
        assert_eq!(early.expire(now + Duration::from_secs(15)), 0);
        assert!(early.take(&key("b", 1)));
        assert_eq!((early.len(), early.next_deadline()), (0, None));
        assert_eq!(
            EarlyReleases::new(0, Duration::ZERO).insert(now, key("x", 0)),
            1,
            "capacity 0 keeps none"
        );
    }
}
