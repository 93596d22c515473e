//! The prefill side: each held request's blocks stay under a lease until its readers release
//! them or the lease runs out; heartbeats extend it. A decode engine with more ranks than this
//! one has several readers for a rank's hold: each release names its reader and how many there
//! are, and the hold ends with the last distinct reader. A release that asks is answered whether
//! the hold was still alive: the release comes only after the READ completed, so "held" means
//! the lease covered the whole READ.

use std::collections::HashMap;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

use super::deadlines::Deadlines;
use super::early::{Early, EarlyReleases};
use super::ttl::{Key, TtlMap};
use super::{ConnectorWorker, WorkerConfig, WorkerStats};
use crate::auth::Nonce;
use crate::ids::{AgentName, RequestId};
use crate::meta::{HeldRequest, HoldRelease, HoldStatus, RenewLeases, ReplyTo};
use crate::params::MAX_ID_LEN;
use crate::tp::MAX_TP;
use crate::wire;

#[derive(Debug)]
struct Hold {
    until: Instant,
    nonce: Nonce,
    /// The readers the first release announced, and those that released so far.
    readers: Option<u32>,
    released: Vec<u32>,
}

/// Held requests, releases that came before their hold, and holds that ended recently.
#[derive(Debug)]
pub(super) struct Holds {
    lease: Duration,
    live: HashMap<RequestId, Hold>,
    /// When the live holds' leases run out.
    due: Deadlines<RequestId>,
    /// Releases that arrived before their hold, per sender.
    early: EarlyReleases,
    /// Holds released or expired, and whether a "not held" answer went out for them: a late
    /// release is answered "not held" at once, once (whoever asks, whichever reader it names, so
    /// that replays and forged reader numbers cost no more handshakes; another late reader of
    /// the same hold gets no answer and fails its load when its confirmation times out).
    ended: TtlMap<bool>,
}

impl Holds {
    pub(super) fn new(config: &WorkerConfig) -> Self {
        Holds {
            lease: config.lease_duration,
            live: HashMap::new(),
            due: Deadlines::default(),
            early: EarlyReleases::new(config),
            // As many as early releases in all, kept at least as long as an early release: a
            // release that comes later than that is kept as early and never answered (the decode
            // worker waits out its confirmation).
            ended: TtlMap::new(
                config.early_releases_per_sender.saturating_mul(config.max_early_senders),
                config.lease_duration.max(config.early_release_ttl),
            ),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.live.len()
    }

    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.live.values().map(|h| h.until).chain(self.early.next_deadline()).min()
    }

    /// The early releases kept, and from how many senders.
    #[cfg(test)]
    pub(super) fn early_len(&self) -> (u64, usize) {
        self.early.len()
    }

    pub(super) fn expire_buffers(&mut self, now: Instant, stats: &mut WorkerStats) {
        stats.stray_notifications += self.early.expire(now);
        self.ended.expire(now);
    }
}

impl ConnectorWorker {
    /// A hold from the scheduler: its lease starts now, unless its release already came.
    pub(super) fn hold(&mut self, now: Instant, held: &HeldRequest) {
        let key = (held.request_id.clone(), held.nonce);
        let hold =
            Hold { until: now + self.holds.lease, nonce: held.nonce, readers: None, released: Vec::new() };
        self.holds.due.push(hold.until, held.request_id.clone());
        self.holds.live.insert(held.request_id.clone(), hold);
        for early in self.holds.early.take(&key) {
            if self.holds.live.contains_key(&key.0) {
                self.release_live(now, &key, early.reader, early.readers, early.reply_to);
            } else {
                // The hold ended with an earlier one of these releases: a duplicate.
                self.stats.stray_notifications += 1;
            }
        }
    }

    /// Counts a live hold's release by `reader` of `readers`, answers it if asked, and frees the
    /// hold once every reader released it. A release announcing another number of readers than
    /// the first is refused; a reader's second release changes nothing (it is answered again).
    fn release_live(
        &mut self,
        now: Instant,
        key: &Key,
        reader: u32,
        readers: u32,
        reply_to: Option<ReplyTo>,
    ) {
        let Some(hold) = self.holds.live.get_mut(&key.0) else { return };
        if *hold.readers.get_or_insert(readers) != readers {
            debug!(request_id = %key.0, reader, readers, "release with another count of readers refused");
            self.stats.rejected_notifications += 1;
            return;
        }
        if hold.released.contains(&reader) {
            // A reader's second release: answered again (its first answer may have been lost),
            // counted as a duplicate.
            self.stats.stray_notifications += 1;
        } else {
            hold.released.push(reader);
            self.stats.notifications += 1;
            if hold.released.len() as u32 >= readers {
                self.holds.live.remove(&key.0);
                self.finished.sending.push(key.0.clone());
                self.holds.ended.insert(now, key.clone(), false);
            }
        }
        self.answer(now, key, reply_to, true);
    }

    pub(super) fn on_release(&mut self, now: Instant, from: &AgentName, release: HoldRelease) {
        let (reader, readers) = (release.reader, release.readers);
        if release.request_id.as_str().len() > MAX_ID_LEN
            || readers == 0
            || readers > MAX_TP
            || reader >= MAX_TP
        {
            self.stats.stray_notifications += 1;
            return;
        }
        let key = (release.request_id, release.nonce);
        match self.holds.live.get(&key.0) {
            Some(hold) if hold.nonce == key.1 => {
                self.release_live(now, &key, reader, readers, release.reply_to)
            }
            Some(_) => {
                // Counted, and logged at debug only: a flood of forged releases must not flood
                // the log.
                debug!(request_id = %key.0, %from, "release with a wrong nonce refused: the hold stays");
                self.stats.rejected_notifications += 1;
            }
            None if self.holds.ended.contains(&key) => {
                // Its lease ran out (or it was released) before this release came: the READ may
                // have copied reused blocks. Answered once: replays cost no more handshakes.
                self.stats.stray_notifications += 1;
                let asks = release.reply_to.is_some();
                if let Some(answered) = self.holds.ended.get_mut(&key).filter(|a| asks && !**a) {
                    *answered = true;
                    self.answer(now, &key, release.reply_to, false);
                }
            }
            None => {
                self.stats.early_notifications += 1;
                let early = Early { reader, readers, reply_to: release.reply_to };
                let kept = self.holds.early.insert(now, from, key, early);
                self.stats.stray_notifications += kept.stray;
                self.stats.early_notifications_dropped += kept.dropped;
            }
        }
    }

    /// Sends `status` to the decode worker that asked. A decode engine that restarted (a new
    /// instance) is handshaken again first.
    fn answer(&mut self, now: Instant, key: &Key, reply_to: Option<ReplyTo>, held: bool) {
        let Some(ReplyTo { engine, rank, instance, token }) = reply_to else { return };
        let status = HoldStatus { request_id: key.0.clone(), nonce: key.1, held, token };
        if engine.check().is_err() || engine.engine_id == self.config.engine_id {
            self.stats.unsent_messages += 1;
            return;
        }
        if rank >= MAX_TP {
            self.stats.unsent_messages += 1;
            return;
        }
        let peer = (engine.engine_id.clone(), rank);
        if matches!(self.peers.get(&peer), Some(super::Peer::Ready(c)) if c.instance != instance) {
            self.invalidate(&peer);
        }
        match wire::encode(&status) {
            Ok(msg) => {
                self.stats.hold_answers += 1;
                self.send_to(now, &engine, rank, msg);
            }
            Err(e) => debug!(error = %e, "encoding an answer failed"),
        }
    }

    /// A heartbeat: extends the leases of the holds it names with their nonces.
    pub(super) fn on_renew(&mut self, now: Instant, renew: RenewLeases) {
        let until = now + self.holds.lease;
        for held in renew.holds {
            if let Some(hold) = self.holds.live.get_mut(&held.request_id).filter(|h| h.nonce == held.nonce) {
                hold.until = hold.until.max(until);
                self.holds.due.push(hold.until, held.request_id.clone());
                self.stats.leases_renewed += 1;
            }
        }
    }

    /// At close: every hold ends (nobody can read its blocks any more) and the buffers of
    /// early releases and ended holds are emptied.
    pub(super) fn close_holds(&mut self) {
        let mut ended: Vec<RequestId> = self.holds.live.drain().map(|(id, _)| id).collect();
        ended.sort();
        self.finished.sending.extend(ended);
        self.holds = Holds::new(&self.config);
    }

    /// Frees the holds whose lease ran out.
    /// Looks only at the holds whose lease entries came due: O(what is due), not O(holds).
    pub(super) fn expire_holds(&mut self, now: Instant) {
        let mut due = Vec::new();
        self.holds.due.take_due(now, &mut due);
        due.sort_unstable();
        due.dedup();
        for id in due {
            // An entry whose hold ended, or whose lease was renewed, is stale.
            if self.holds.live.get(&id).is_none_or(|h| h.until > now) {
                continue;
            }
            let Some(hold) = self.holds.live.remove(&id) else { continue };
            warn!(request_id = %id, "lease ran out with no release: freeing the blocks");
            self.stats.expired_holds += 1;
            self.finished.sending.push(id.clone());
            self.holds.ended.insert(now, (id, hold.nonce), false);
        }
    }
}
