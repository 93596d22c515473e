//! When loads and holds are due, in deadline order: a worker's step looks at what is due, not at
//! every load or hold in flight.
//!
//! Entries are hints, checked against the live state when they come due: a deadline that moved
//! later (a renewed lease, a READ that went on to its confirmation) is pushed again and the old
//! entry is then skipped, as is the entry of a load or hold that already ended. So the callers
//! push wherever a deadline is set and never remove.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

/// Due times of keys `K` (request ids for holds, a request's READ from one rank for loads).
#[derive(Debug)]
pub(super) struct Deadlines<K> {
    heap: BinaryHeap<Reverse<(Instant, K)>>,
}

impl<K: Ord> Default for Deadlines<K> {
    fn default() -> Self {
        Deadlines { heap: BinaryHeap::new() }
    }
}

impl<K: Ord> Deadlines<K> {
    /// `id` is due at `when` (unless its deadline has changed by then).
    pub(super) fn push(&mut self, when: Instant, id: K) {
        self.heap.push(Reverse((when, id)));
    }

    /// Takes the ids whose entries came due by `now`, each once, in id order (an id pushed
    /// several times comes once).
    pub(super) fn take_due(&mut self, now: Instant) -> Vec<K> {
        let mut out = Vec::new();
        while let Some(Reverse((when, _))) = self.heap.peek() {
            if *when > now {
                break;
            }
            if let Some(Reverse((_, id))) = self.heap.pop() {
                out.push(id);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Drops every entry (the worker's loads or holds were all ended at once).
    pub(super) fn clear(&mut self) {
        self.heap.clear();
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RequestId;
    use std::time::Duration;

    #[test]
    fn due_entries_come_out_in_order_and_later_ones_stay() {
        let now = Instant::now();
        let s = Duration::from_secs(1);
        let mut d = Deadlines::default();
        d.push(now + 3 * s, RequestId::new("c"));
        d.push(now + s, RequestId::new("a"));
        d.push(now + 2 * s, RequestId::new("b"));
        assert!(d.take_due(now).is_empty());
        d.push(now + s, RequestId::new("a"));
        assert_eq!(d.take_due(now + 2 * s), [RequestId::new("a"), RequestId::new("b")], "each once");
        assert_eq!(d.len(), 1);
    }
}
