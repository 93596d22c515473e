//! Hostile notifications of every kind to a prefill and a decode rank in the middle of a session
//! of leased holds: releases with hostile `reply_to`, heartbeats naming anything, answers for
//! loads that are not theirs, garbage, and time passing between them.

mod events;
mod model;
mod session;

use kvx_core::Finished;

use crate::input::ByteSource;
use crate::seeds::Seed;
use session::Session;

/// At most this many events per run.
const MAX_EVENTS: usize = 48;

/// A prefill and a decode rank (both fresh, rank 0 of 1 or rank 1 of 2, buffers of 8) mid-session:
/// the prefill rank holds three offers (each held, expired, held under another nonce or never
/// held, as the bytes pick), the decode rank loads them (its READs may stay in flight for a few
/// progress passes). Then the bytes pick up to 48 events: time passing (up to past a lease, a
/// confirmation timeout) with both ranks stepping, heartbeats from the decode scheduler, and
/// notifications from a third agent on the fabric (or from the peers themselves): releases (of
/// any hold, any nonce, with `reply_to` naming the decode engine, another instance of it, the
/// prefill engine itself, a huge host, the last port, an unreachable engine; naming the prefill
/// rank's instance, another or none, so that some are answered before their hold), heartbeats
/// (thousands of holds, wrong nonces), hold answers (unknown nonces, other requests, either
/// way), garbage, messages of other kinds and versions, each to either rank.
///
/// Checks: no panic; the prefill rank frees exactly what a model of its leases frees (a release
/// or heartbeat counts only with its hold's nonce), at each step; a load is done only if the
/// prefill engine held its offer, and then its blocks hold the prefill's bytes as held (whatever
/// answers a third agent or the prefill agent itself sent); every load is reported once, every
/// hold freed once;
/// both ranks end idle; the counters agree with what was sent (notifications, expired holds,
/// renewals, rejected releases and answers to live or ended holds exactly; answers sent before a
/// hold came at most one per release naming the prefill rank's instance; stray notifications
/// within bounds), and
/// the prefill rank handshakes only to send an answer; at every step neither rank keeps more
/// unanswered releases than its buffer holds.
pub fn worker_lease_notifications(data: &[u8]) {
    lease_session(data);
}

fn lease_session(data: &[u8]) -> Finished {
    let mut src = ByteSource::new(data);
    let mut session = Session::start(&mut src);
    let mut events = 0;
    while !src.is_empty() && events < MAX_EVENTS {
        session.event(&mut src);
        events += 1;
    }
    session.finish()
}

/// Seeds: the natural session (every offer held, every load done), each setup choice, and
/// scripts of the events the contract is about.
pub(crate) fn worker_lease_notifications_seeds() -> Vec<Seed> {
    // Setup bytes: rank, READ delay, the three leases. Then events (see `Session::event`).
    let mut seeds = vec![Seed::new("all-held", Vec::new())];
    seeds.push(Seed::new("rank-1-of-2", [1]));
    seeds.push(Seed::new("reads-in-flight", [0, 2]));
    for (lease, name) in [(1u8, "expired"), (2, "other-nonce"), (3, "missing")] {
        seeds.push(Seed::new(format!("lease-{name}"), [0, 0, lease, lease, lease]));
    }
    let setup = [0u8, 2, 0, 0, 0];
    let script = |name: &str, events: &[&[u8]]| Seed::new(name, [&setup[..], &events.concat()].concat());
    // Event 1: release (id, nonce, reply_to, from).
    seeds.push(script("early-release-answered-to-the-decode-rank", &[&[1, 0, 0, 1, 0]]));
    seeds.push(script("release-wrong-nonce-then-time", &[&[1, 0, 1, 1, 0], &[0, 3]]));
    seeds.push(script("release-reply-to-another-instance", &[&[1, 1, 0, 2, 0]]));
    seeds.push(script("release-reply-to-itself", &[&[1, 2, 0, 3, 0]]));
    seeds.push(script("release-reply-to-a-huge-host", &[&[1, 0, 0, 4, 0]]));
    seeds.push(script("release-reply-to-the-last-port", &[&[1, 0, 0, 6, 0]]));
    seeds.push(script("release-reply-to-elsewhere", &[&[1, 0, 0, 7, 0]]));
    seeds.push(script("release-over-long-id", &[&[1, 5, 0, 1, 0]]));
    // Event 2: heartbeat (count, then per hold id and nonce).
    seeds.push(script("renew-then-past-the-lease", &[&[2, 0, 0, 0], &[0, 3]]));
    seeds.push(script("renew-wrong-nonce-then-past-the-lease", &[&[2, 0, 0, 1], &[0, 3]]));
    seeds.push(script("renew-two-thousand", &[&[2, 3, 0, 0, 1, 0, 2, 1, 3, 0]]));
    // Event 3: an answer (id, nonce, held, from the peer).
    seeds.push(script("forged-held-for-a-load-still-reading", &[&[3, 0, 0, 0, 0]]));
    seeds.push(script("forged-held-other-nonce", &[&[3, 0, 1, 0, 0]]));
    seeds.push(script("peer-says-not-held", &[&[3, 0, 0, 1, 1]]));
    // Events 4 to 7: garbage, the wrong way, other kinds, the scheduler's heartbeat.
    seeds.push(script("garbage-to-both", &[&[4, 0, 3, b'x', b'y', b'z', 0], &[4, 1, 0, 0]]));
    seeds.push(script("wrong-way", &[&[5, 0, 0, 0, 0], &[5, 0, 0, 1, 1, 0], &[5, 0, 0, 2, 0]]));
    seeds.push(script("other-kinds", &[&[6, 0, 0, 0], &[6, 1, 1, 0], &[6, 0, 2, 0]]));
    seeds.push(script("scheduler-heartbeats", &[&[7, 0], &[0, 2], &[7, 1], &[7, 2], &[0, 3]]));
    // More releases of holds that do not exist (each another nonce) than either rank buffers.
    let flood: Vec<u8> = (0..12u8).flat_map(|k| [1, 3, 3, k, 0, 0, 5, 3, 3, k, 1, 0, 0]).collect();
    seeds.push(script("flood-early-releases", &[&flood]));
    // An expired hold, then a forged answer from a third agent and the expiry.
    let expired = [0u8, 2, 1, 0, 0];
    seeds.push(Seed::new(
        "forged-held-for-an-expired-hold",
        [&expired[..], &[3, 0, 0, 0, 0], &[0, 1]].concat(),
    ));
    // READs in flight for 16 passes; a third agent's release (the right nonce, the decode
    // engine's side channel and instance) reaches the prefill rank first.
    seeds.push(Seed::new(
        "forged-release-while-reading",
        [&[0u8, 3, 0, 0, 0][..], &[1, 0, 0, 1, 0], &[0, 0]].concat(),
    ));
    seeds
}

#[cfg(test)]
mod tests {
    use kvx_core::RequestId;

    use super::*;

    fn seed(name: &str) -> Vec<u8> {
        match worker_lease_notifications_seeds().into_iter().find(|s| s.name == name) {
            Some(s) => s.bytes,
            None => panic!("no seed {name}"),
        }
    }

    fn done(f: &Finished) -> Vec<&str> {
        let mut ids: Vec<&str> = f.recving.iter().map(RequestId::as_str).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn held_offers_load_and_unheld_ones_fail() {
        for name in
            ["all-held", "rank-1-of-2", "reads-in-flight", "garbage-to-both", "renew-then-past-the-lease"]
        {
            assert_eq!(done(&lease_session(&seed(name))), ["a", "b", "c"], "{name}");
        }
        for name in ["lease-expired", "lease-other-nonce", "lease-missing"] {
            let f = lease_session(&seed(name));
            assert_eq!((f.recving.len(), f.failed_recving.len()), (0, 3), "{name}: {f:?}");
        }
        // A third agent's "held" for a load whose hold expired does not make it load.
        let forged = lease_session(&seed("forged-held-for-an-expired-hold"));
        assert_eq!(done(&forged), ["b", "c"], "{forged:?}");
    }

    /// Found by this target: someone who knows the offer released it, asking for the answer at
    /// the decode engine, while the READ ran. The prefill engine freed the hold and answered
    /// "held" to that release; the decode rank does not take that answer for its READ.
    #[test]
    fn a_forged_release_while_reading_confirms_nothing() {
        let f = lease_session(&seed("forged-release-while-reading"));
        assert!(!f.recving.iter().any(|id| id.as_str() == "a"), "{f:?}");
    }
}
