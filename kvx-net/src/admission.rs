//! Who gets a connection slot on a kvx server, and who gives one up: the policy that keeps a
//! legitimate peer served while any number of other connections are open, idle, slow,
//! unauthenticated or busy. Every server kvx runs on the network takes it: the side channel, the
//! group's rank 0, the `kvx` request API, the `/metrics` server and `kvx router`.
//!
//! A connection is *pending* from its accept until it proves itself: with a key, until its proof of
//! the key verifies; without one, until its first complete, well-formed request. Then it is
//! *established*. The two have separate budgets, and a newcomer is never refused for room:
//!
//! - **Pending**: at most `max_pending`. A newcomer when they are full evicts a pending connection
//!   of the source (IP address, IPv6 by /64) with the most pending connections, the oldest of
//!   them. Pending connections must prove themselves within `handshake_timeout` of their accept.
//!   So connections that never authenticate, or never complete a request, cost a peer that does at
//!   most a short wait: they only ever compete with each other, and a flood evicts its own oldest
//!   first.
//! - **Established**: at most `max_connections`, at most `max_per_source` of them from one source.
//!   A connection that proves itself when its source is at its budget evicts that source's idlest
//!   connection; when all are taken, the idlest connection of the source with the most. A
//!   connection being served (a request in the service, a reply being written) is never evicted;
//!   if every candidate is being served, the newcomer is refused.
//!
//! "Idlest" is the longest since the connection's last change of phase: the end of its last
//! reply for one waiting for a request, the first byte of its request for one reading a slow
//! request. A peer that keeps one request at a time going (the one a connection allows) keeps its
//! slot; one that holds a slot without using it loses it to the next peer that needs one.
//!
//! A connection dismissed for room (evicted, or finding every candidate served) is not closed but
//! *parked* in the server's [`Lot`]: held open and never served, what it sends read and thrown
//! away, until its peer closes it, it has waited `idle_timeout`, or the lot needs its place
//! (`max_parked`, oldest first, or file descriptors to accept with). Closing it would only make its
//! peer connect again at once: a flood larger than the budgets would then turn over as fast as
//! the server accepts, fill the kernel's accept queue, and make every other peer's connect wait for
//! a retransmitted SYN (a second or more). Parked, it costs a socket and a small task, and the
//! accept queue stays empty for the peers that are served.
//!
//! [`Gate`] is the shared, lockable policy; each connection holds a [`Ticket`] that tells the gate
//! its phase, hears when it is evicted, and leaves the gate when dropped.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

mod lot;

pub use lot::{Lot, MAX_PARKED_BYTES, Parked, Spare};

/// The budgets of a [`Gate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    /// The most pending connections (not yet proven).
    pub max_pending: usize,
    /// The most established connections.
    pub max_connections: usize,
    /// The most established connections from one source.
    pub max_per_source: usize,
}

/// Where connections come from, for budgets: an IPv4 address, or an IPv6 /64 (one host's or one
/// subnet's addresses, of which an attacker may have billions). IPv4-mapped IPv6 addresses count as
/// IPv4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source(IpAddr);

impl Source {
    /// The source of `peer`.
    pub fn of(peer: SocketAddr) -> Self {
        match peer.ip() {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source(IpAddr::V4(v4)),
                None => {
                    let bits = u128::from(v6) & !((1u128 << 64) - 1);
                    Source(IpAddr::V6(bits.into()))
                }
            },
            v4 => Source(v4),
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            IpAddr::V6(v6) => write!(f, "{v6}/64"),
            v4 => write!(f, "{v4}"),
        }
    }
}

/// What a connection is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for the peer's next request (or its first).
    Waiting,
    /// Reading a request that has begun.
    Reading,
    /// Being served: the service runs, or the reply is being written. Never evicted.
    Busy,
}

/// How a promotion went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promotion {
    /// The connection is established.
    Established,
    /// No room: every candidate to make way is being served. The caller closes the connection.
    Full,
    /// The connection holds no place any more: it was evicted (its ticket hears so).
    Gone,
}

#[derive(Debug)]
struct Entry {
    source: Source,
    accepted: Instant,
    since: Instant,
    phase: Phase,
    proven: bool,
    evict: Option<oneshot::Sender<()>>,
}

impl Entry {
    /// Where it stands in its source's queue of candidates to make way: pending ones by age,
    /// established ones by idleness (ties go to the one admitted first).
    fn key(&self, id: u64) -> (Instant, u64) {
        (if self.proven { self.since } else { self.accepted }, id)
    }
}

/// One source's connections: counts, and the candidates to make way in order (those being
/// served are in neither queue).
#[derive(Debug, Default)]
struct SourceState {
    pending: usize,
    established: usize,
    pending_queue: BTreeSet<(Instant, u64)>,
    idle_queue: BTreeSet<(Instant, u64)>,
}

impl SourceState {
    fn queue(&mut self, proven: bool) -> &mut BTreeSet<(Instant, u64)> {
        if proven { &mut self.idle_queue } else { &mut self.pending_queue }
    }
}

/// The policy's state: every connection's source, phase and age. Each decision costs a pass
/// over the sources and a few ordered-set operations, so that making way stays cheap however
/// many connections a flood brings.
#[derive(Debug)]
struct Admission {
    budgets: Budgets,
    next: u64,
    entries: HashMap<u64, Entry>,
    sources: HashMap<Source, SourceState>,
    pending: usize,
    established: usize,
    evicted: u64,
}

impl Admission {
    fn admit(&mut self, source: Source, now: Instant) -> Option<(u64, oneshot::Receiver<()>)> {
        if self.pending >= self.budgets.max_pending.max(1) {
            let victim = self.pick(None, false)?;
            self.evict(victim);
        }
        let (tx, rx) = oneshot::channel();
        let id = self.next;
        self.next += 1;
        let entry = Entry {
            source,
            accepted: now,
            since: now,
            phase: Phase::Waiting,
            proven: false,
            evict: Some(tx),
        };
        let state = self.sources.entry(source).or_default();
        state.pending += 1;
        state.pending_queue.insert(entry.key(id));
        self.entries.insert(id, entry);
        self.pending += 1;
        Some((id, rx))
    }

    fn promote(&mut self, id: u64) -> Promotion {
        let Some(entry) = self.entries.get(&id) else { return Promotion::Gone };
        if entry.proven {
            return Promotion::Established;
        }
        let source = entry.source;
        let own = self.sources.get(&source).map_or(0, |c| c.established);
        let victim = if own >= self.budgets.max_per_source.max(1) {
            Some(self.pick(Some(source), true))
        } else if self.established >= self.budgets.max_connections.max(1) {
            Some(self.pick(None, true))
        } else {
            None
        };
        match victim {
            Some(Some(victim)) => self.evict(victim),
            Some(None) => return Promotion::Full,
            None => {}
        }
        let Some(entry) = self.entries.get_mut(&id) else { return Promotion::Gone };
        let (old, busy) = (entry.key(id), entry.phase == Phase::Busy);
        entry.proven = true;
        let new = entry.key(id);
        if let Some(state) = self.sources.get_mut(&source) {
            state.pending -= 1;
            state.established += 1;
            state.pending_queue.remove(&old);
            if !busy {
                state.idle_queue.insert(new);
            }
        }
        self.pending -= 1;
        self.established += 1;
        Promotion::Established
    }

    fn set(&mut self, id: u64, phase: Phase, now: Instant) {
        let Some(entry) = self.entries.get_mut(&id) else { return };
        let (old, was_busy) = (entry.key(id), entry.phase == Phase::Busy);
        entry.phase = phase;
        entry.since = now;
        let (new, proven) = (entry.key(id), entry.proven);
        if let Some(state) = self.sources.get_mut(&entry.source) {
            let queue = state.queue(proven);
            if !was_busy {
                queue.remove(&old);
            }
            if phase != Phase::Busy {
                queue.insert(new);
            }
        }
    }

    /// The candidate to make way: of `only` that source, or else of the source with the most
    /// connections of the kind (pending, or established when `proven`) that has a candidate, the
    /// first in its queue.
    fn pick(&self, only: Option<Source>, proven: bool) -> Option<u64> {
        fn queue(s: &SourceState, proven: bool) -> &BTreeSet<(Instant, u64)> {
            if proven { &s.idle_queue } else { &s.pending_queue }
        }
        let size = |s: &SourceState| if proven { s.established } else { s.pending };
        let state = match only {
            Some(source) => self.sources.get(&source)?,
            None => self.sources.values().filter(|s| !queue(s, proven).is_empty()).max_by_key(|s| size(s))?,
        };
        queue(state, proven).first().map(|&(_, id)| id)
    }

    fn evict(&mut self, id: u64) {
        if let Some(mut entry) = self.remove(id) {
            self.evicted += 1;
            if let Some(tx) = entry.evict.take() {
                let _ = tx.send(());
            }
        }
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        if let Some(state) = self.sources.get_mut(&entry.source) {
            state.queue(entry.proven).remove(&entry.key(id));
            if entry.proven {
                state.established -= 1;
            } else {
                state.pending -= 1;
            }
            if state.pending == 0 && state.established == 0 {
                self.sources.remove(&entry.source);
            }
        }
        if entry.proven {
            self.established -= 1;
        } else {
            self.pending -= 1;
        }
        Some(entry)
    }
}

/// What a [`Gate`] holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GateStats {
    /// Pending connections.
    pub pending: usize,
    /// Established connections.
    pub established: usize,
    /// Sources with a connection.
    pub sources: usize,
    /// Connections evicted to make room, in all.
    pub evicted: u64,
}

/// The admission policy of one server, shared by its accept loop and its connections.
#[derive(Clone)]
pub struct Gate {
    inner: Arc<Mutex<Admission>>,
}

impl fmt::Debug for Gate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gate").field("stats", &self.stats()).finish()
    }
}

impl Gate {
    /// A gate with `budgets`.
    pub fn new(budgets: Budgets) -> Self {
        let admission = Admission {
            budgets,
            next: 0,
            entries: HashMap::new(),
            sources: HashMap::new(),
            pending: 0,
            established: 0,
            evicted: 0,
        };
        Gate { inner: Arc::new(Mutex::new(admission)) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Admission> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits a connection from `peer` as pending, evicting the oldest pending connection of the
    /// largest pending source when the pending budget is full. `None`: every pending connection is
    /// being served, so none can make way (the caller closes the newcomer).
    pub fn admit(&self, peer: SocketAddr) -> Option<Ticket> {
        let now = Instant::now();
        let (id, evicted) = self.lock().admit(Source::of(peer), now)?;
        Some(Ticket { gate: self.clone(), id, accepted: now, evicted })
    }

    /// What it holds now.
    pub fn stats(&self) -> GateStats {
        let a = self.lock();
        GateStats {
            pending: a.pending,
            established: a.established,
            sources: a.sources.len(),
            evicted: a.evicted,
        }
    }
}

/// One connection's place at a [`Gate`]; dropping it gives the place up.
pub struct Ticket {
    gate: Gate,
    id: u64,
    accepted: Instant,
    evicted: oneshot::Receiver<()>,
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Ticket {
    /// The connection's number, unique within its gate.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// How long ago the connection was admitted.
    pub fn age(&self) -> Duration {
        self.accepted.elapsed()
    }

    /// Marks the connection proven (established), making room as the policy says.
    pub fn promote(&self) -> Promotion {
        self.handle().promote()
    }

    /// Whether the connection has been promoted and is still held.
    pub fn is_established(&self) -> bool {
        self.gate.lock().entries.get(&self.id).is_some_and(|e| e.proven)
    }

    /// Tells the gate what the connection is doing now.
    pub fn set(&self, phase: Phase) {
        self.handle().set(phase);
    }

    /// A handle that promotes the connection and sets its phase from elsewhere (an HTTP
    /// service's request handler, say); it does nothing once the ticket is gone.
    pub fn handle(&self) -> TicketHandle {
        TicketHandle { gate: self.gate.clone(), id: self.id }
    }

    /// Returns when the connection is evicted (never, while it is not).
    pub async fn evicted(&mut self) {
        if (&mut self.evicted).await.is_err() {
            // The sender went with the entry without a word: the ticket left the gate itself.
            std::future::pending::<()>().await;
        }
    }
}

/// Promotes a [`Ticket`]'s connection and sets its phase; see [`Ticket::handle`].
#[derive(Debug, Clone)]
pub struct TicketHandle {
    gate: Gate,
    id: u64,
}

impl TicketHandle {
    /// As [`Ticket::promote`]; `Gone` once the ticket is gone.
    pub fn promote(&self) -> Promotion {
        self.gate.lock().promote(self.id)
    }

    /// As [`Ticket::set`].
    pub fn set(&self, phase: Phase) {
        self.set_at(phase, Instant::now());
    }

    fn set_at(&self, phase: Phase, now: Instant) {
        self.gate.lock().set(self.id, phase, now);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.gate.lock().remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(ip: &str, port: u16) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), port)
    }

    fn gate(max_pending: usize, max_connections: usize, max_per_source: usize) -> Gate {
        Gate::new(Budgets { max_pending, max_connections, max_per_source })
    }

    fn is_evicted(t: &mut Ticket) -> bool {
        t.evicted.try_recv().is_ok()
    }

    #[test]
    fn a_full_pending_budget_evicts_the_oldest_pending_of_the_largest_source() {
        let g = gate(3, 8, 8);
        let mut legit = g.admit(peer("10.0.0.1", 1)).unwrap();
        let mut flood: Vec<Ticket> = (0..2).map(|p| g.admit(peer("10.0.0.2", p)).unwrap()).collect();
        // Full: the newcomer (from the flood's source) evicts the flood's oldest, not the legit one.
        flood.push(g.admit(peer("10.0.0.2", 9)).unwrap());
        assert!(is_evicted(&mut flood[0]) && !is_evicted(&mut legit));
        // A flood from the legit peer's own source evicts oldest first.
        let g = gate(2, 8, 8);
        let mut old = g.admit(peer("127.0.0.1", 1)).unwrap();
        let mut young = g.admit(peer("127.0.0.1", 2)).unwrap();
        let _new = g.admit(peer("127.0.0.1", 3)).unwrap();
        assert!(is_evicted(&mut old) && !is_evicted(&mut young));
        assert_eq!(g.stats(), GateStats { pending: 2, established: 0, sources: 1, evicted: 1 });
    }

    #[test]
    fn established_connections_make_way_idlest_first_and_busy_ones_never() {
        let g = gate(4, 2, 8);
        let mut a = g.admit(peer("10.0.0.2", 1)).unwrap();
        let mut b = g.admit(peer("10.0.0.2", 2)).unwrap();
        assert_eq!((a.promote(), b.promote()), (Promotion::Established, Promotion::Established));
        let t = Instant::now();
        a.handle().set_at(Phase::Waiting, t); // a was idle first
        b.handle().set_at(Phase::Waiting, t + Duration::from_millis(1));
        let c = g.admit(peer("10.0.0.3", 1)).unwrap();
        assert_eq!(c.promote(), Promotion::Established);
        assert!(is_evicted(&mut a) && !is_evicted(&mut b));
        // Both remaining are served now: no room for another.
        b.set(Phase::Busy);
        c.set(Phase::Busy);
        let d = g.admit(peer("10.0.0.4", 1)).unwrap();
        assert_eq!(d.promote(), Promotion::Full);
        assert_eq!(g.stats().established, 2);
        drop(c);
        assert_eq!(d.promote(), Promotion::Established);
        assert!(d.is_established());
    }

    #[test]
    fn a_source_at_its_budget_makes_way_among_its_own() {
        let g = gate(4, 8, 2);
        let mut other = g.admit(peer("10.0.0.9", 1)).unwrap();
        other.promote();
        let mut own: Vec<Ticket> = (0..2).map(|p| g.admit(peer("10.0.0.2", p)).unwrap()).collect();
        for t in &own {
            assert_eq!(t.promote(), Promotion::Established);
        }
        let third = g.admit(peer("10.0.0.2", 5)).unwrap();
        assert_eq!(third.promote(), Promotion::Established);
        assert!(is_evicted(&mut own[0]) && !is_evicted(&mut own[1]) && !is_evicted(&mut other));
        assert_eq!(g.stats().established, 3);
    }

    #[test]
    fn ipv6_sources_are_slash_64_and_mapped_ipv4_is_ipv4() {
        assert_eq!(Source::of(peer("2001:db8::1", 1)), Source::of(peer("2001:db8::ffff:1", 2)));
        assert_ne!(Source::of(peer("2001:db8::1", 1)), Source::of(peer("2001:db8:0:1::1", 1)));
        assert_eq!(Source::of(peer("::ffff:10.1.2.3", 1)), Source::of(peer("10.1.2.3", 1)));
        assert_eq!(Source::of(peer("2001:db8::1", 1)).to_string(), "2001:db8::/64");
    }

    #[test]
    fn dropped_tickets_free_their_places() {
        let g = gate(1, 1, 1);
        let a = g.admit(peer("10.0.0.1", 1)).unwrap();
        a.promote();
        drop(a);
        assert_eq!(g.stats(), GateStats::default());
    }
}
