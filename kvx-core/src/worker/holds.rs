//! The prefill side: each held request's blocks stay under a lease until its readers release
//! them or the lease runs out; heartbeats extend it. A decode engine with more ranks than this
//! one has several readers for a rank's hold: each release names its reader and how many there
//! are, and the hold ends with the last distinct reader. A release that asks is answered whether
//! the hold was still alive: the release comes only after the READ completed, so "held" means
//! the lease covered the whole READ.
//!
//! A release can come before the worker is handed its hold: vLLM hands a finished request's hold
//! to the workers in the metadata of a later engine step, and a prefill engine's step can last
//! seconds. Waiting for it would couple the decode engine's first token to the prefill engine's
//! forward passes, so a release that names this worker's instance is placed by its nonce (see
//! [`nonce_place`]): the scheduler hands holds over in the order it made their nonces, so a hold
//! placed after the last one handed over has not come yet. Its blocks cannot have been freed
//! (only this worker frees them, and only once it has the hold), so the READ, which ended before
//! its release was sent, read them intact: "held" goes out at once and the release waits for its
//! hold. A hold placed before it came and is gone: "not held" at once. These early answers go
//! only to decode workers already connected at the instance they name: a release that does not
//! name a live hold makes this engine handshake with nobody.
//!
//! [`Holds`] keeps that state with no I/O: its methods take the events (a hold from the
//! scheduler, a release, a heartbeat, the time) and return [`HoldEffect`]s, which the worker
//! carries out (reporting a hold freed, answering a release).

use std::collections::HashMap;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

use super::deadlines::Deadlines;
use super::early::{Early, EarlyReleases};
use super::ttl::{Key, TtlMap};
use super::{ConnectorWorker, WorkerConfig, WorkerStats};
use crate::auth::{Nonce, nonce_place};
use crate::ids::{AgentName, EngineId, RequestId};
use crate::meta::{HeldRequest, HoldRelease, HoldStatus, RenewLeases, ReplyTo};
use crate::params::MAX_ID_LEN;
use crate::params::RemoteCoordinates;
use crate::tp::MAX_TP;
use crate::wire;

#[derive(Debug)]
struct Hold {
    until: Instant,
    nonce: Nonce,
    /// The readers the first release announced, and those that released so far.
    readers: Option<u32>,
    /// With each the token its release carried, if it asked for an answer (see [`Ended`]).
    released: Vec<(u32, Option<Nonce>)>,
}

/// What the worker does for [`Holds`], in the order given.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum HoldEffect {
    /// Report the held request finished: its blocks are free.
    Freed(RequestId),
    /// Send `status` to rank `rank` of the decode engine at `engine`, handshaking again first if
    /// that peer is not at `instance` (the decode engine restarted).
    Answer { engine: RemoteCoordinates, rank: u32, instance: u64, status: HoldStatus },
}

/// Held requests, releases that came before their hold, and holds that ended recently.
#[derive(Debug)]
pub(super) struct Holds {
    /// This engine: an answer is never sent to it.
    engine_id: EngineId,
    /// This worker's instance: releases naming it are placed by their nonce.
    instance: u64,
    /// The place of the last hold handed to this worker ([`nonce_place`]), 0 before the first.
    handed: u64,
    lease: Duration,
    live: HashMap<RequestId, Hold>,
    /// When the live holds' leases run out.
    due: Deadlines<RequestId>,
    /// Releases that arrived before their hold, per sender.
    early: EarlyReleases,
    /// Holds released or expired (see [`Ended`]).
    ended: TtlMap<Ended>,
}

/// A hold that ended, kept to answer releases that come after it: one answer per ended hold, so
/// that replays and forged reader numbers cost no more handshakes (another late reader of the
/// same hold gets no answer and fails its load when its confirmation times out).
#[derive(Debug, Default)]
struct Ended {
    /// The readers whose releases ended it, with the token each release carried (none when its
    /// lease ran out). A second copy of one of those releases (a doubled notification: the same
    /// reader, the same token, which is random for each READ) is answered "held": its first copy
    /// came while the hold was alive. Any other release, a replayed offer's READ included, is
    /// answered "not held": that READ may have copied reused blocks.
    released: Vec<(u32, Option<Nonce>)>,
    /// Whether an answer went out for a late release.
    answered: bool,
}

impl Holds {
    pub(super) fn new(config: &WorkerConfig, instance: u64) -> Self {
        Holds {
            engine_id: config.engine_id.clone(),
            instance,
            handed: 0,
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

    /// Whether `request_id` is held now.
    pub(super) fn holds(&self, request_id: &RequestId) -> bool {
        self.live.contains_key(request_id)
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

    /// A hold from the scheduler: its lease starts now, unless its release already came.
    pub(super) fn hold(
        &mut self,
        now: Instant,
        held: &HeldRequest,
        stats: &mut WorkerStats,
    ) -> Vec<HoldEffect> {
        let key = (held.request_id.clone(), held.nonce);
        self.handed = self.handed.max(nonce_place(&held.nonce));
        let hold = Hold { until: now + self.lease, nonce: held.nonce, readers: None, released: Vec::new() };
        self.due.push(hold.until, held.request_id.clone());
        self.live.insert(held.request_id.clone(), hold);
        let mut effects = Vec::new();
        for early in self.early.take(&key) {
            if self.live.contains_key(&key.0) {
                self.release_live(now, &key, early, stats, &mut effects);
            } else {
                // The hold ended with an earlier one of these releases: a duplicate.
                stats.stray_notifications += 1;
            }
        }
        effects
    }

    /// Counts a live hold's release by `reader` of `readers`, answers it if asked, and frees the
    /// hold once every reader released it. A release announcing another number of readers than
    /// the first is refused; a reader's second release changes nothing (it is answered again).
    fn release_live(
        &mut self,
        now: Instant,
        key: &Key,
        Early { reader, readers, reply_to, answered }: Early,
        stats: &mut WorkerStats,
        effects: &mut Vec<HoldEffect>,
    ) {
        let Some(hold) = self.live.get_mut(&key.0) else { return };
        if *hold.readers.get_or_insert(readers) != readers {
            debug!(request_id = %key.0, reader, readers, "release with another count of readers refused");
            stats.rejected_notifications += 1;
            return;
        }
        if hold.released.iter().any(|&(r, _)| r == reader) {
            // A reader's second release: answered again (its first answer may have been lost),
            // counted as a duplicate.
            stats.stray_notifications += 1;
        } else {
            hold.released.push((reader, reply_to.as_ref().map(|r| r.token)));
            stats.notifications += 1;
            if hold.released.len() as u32 >= readers {
                let released = self.live.remove(&key.0).map(|h| h.released).unwrap_or_default();
                effects.push(HoldEffect::Freed(key.0.clone()));
                self.ended.insert(now, key.clone(), Ended { released, answered: false });
            }
        }
        if !answered {
            effects.extend(self.answer(key, reply_to, true, stats));
        }
    }

    /// A release from `from` (the agent the transport names as the notification's sender).
    /// `connected` tells whether a decode worker is connected at the instance its [`ReplyTo`]
    /// names: only those get an answer before their hold comes (see the module's documentation).
    pub(super) fn release(
        &mut self,
        now: Instant,
        from: &AgentName,
        release: HoldRelease,
        connected: impl Fn(&ReplyTo) -> bool,
        stats: &mut WorkerStats,
    ) -> Vec<HoldEffect> {
        let mut effects = Vec::new();
        let (reader, readers) = (release.reader, release.readers);
        if release.request_id.as_str().len() > MAX_ID_LEN
            || readers == 0
            || readers > MAX_TP
            || reader >= MAX_TP
        {
            stats.stray_notifications += 1;
            return effects;
        }
        let key = (release.request_id, release.nonce);
        match self.live.get(&key.0) {
            Some(hold) if hold.nonce == key.1 => {
                let early = Early { reader, readers, reply_to: release.reply_to, answered: false };
                self.release_live(now, &key, early, stats, &mut effects)
            }
            Some(_) => {
                // Counted, and logged at debug only: a flood of forged releases must not flood
                // the log.
                debug!(request_id = %key.0, %from, "release with a wrong nonce refused: the hold stays");
                stats.rejected_notifications += 1;
            }
            None if self.ended.contains(&key) => {
                // Its lease ran out, or its readers released it, before this release came: "held"
                // only for a copy of a release that ended it (see `Ended`). Answered once.
                stats.stray_notifications += 1;
                let asks = release.reply_to.is_some();
                let held = self.ended.get_mut(&key).filter(|e| asks && !e.answered).map(|ended| {
                    ended.answered = true;
                    release
                        .reply_to
                        .as_ref()
                        .is_some_and(|r| ended.released.contains(&(reader, Some(r.token))))
                });
                if let Some(held) = held {
                    effects.extend(self.answer(&key, release.reply_to, held, stats));
                }
            }
            None => {
                let mut early = Early { reader, readers, reply_to: release.reply_to, answered: false };
                let connected = early.reply_to.as_ref().is_some_and(connected);
                match self.not_handed_yet(&key.1, release.instance) {
                    Some(false) => {
                        // Handed over before, and ended longer ago than ended holds are kept (or
                        // never a hold of this worker): it will not come again.
                        stats.stray_notifications += 1;
                        if connected {
                            let answer = self.answer(&key, early.reply_to, false, stats);
                            stats.early_answers += u64::from(answer.is_some());
                            effects.extend(answer);
                        }
                    }
                    not_yet => {
                        if not_yet == Some(true) && connected {
                            let answer = self.answer(&key, early.reply_to.clone(), true, stats);
                            early.answered = answer.is_some();
                            stats.early_answers += u64::from(early.answered);
                            effects.extend(answer);
                        }
                        stats.early_notifications += 1;
                        let kept = self.early.insert(now, from, key, early);
                        stats.stray_notifications += kept.stray;
                        stats.early_notifications_dropped += kept.dropped;
                    }
                }
            }
        }
        effects
    }

    /// For a release naming `instance` of a hold with `nonce` that is neither live nor recently
    /// ended: whether that hold is yet to be handed to this worker (`Some(false)`: it was handed
    /// over and is gone), or `None` when the release names another instance or none.
    fn not_handed_yet(&self, nonce: &Nonce, instance: Option<u64>) -> Option<bool> {
        (instance == Some(self.instance)).then(|| nonce_place(nonce) > self.handed)
    }

    /// The answer to the decode worker that asked, if it can be sent.
    fn answer(
        &self,
        key: &Key,
        reply_to: Option<ReplyTo>,
        held: bool,
        stats: &mut WorkerStats,
    ) -> Option<HoldEffect> {
        let ReplyTo { engine, rank, instance, token } = reply_to?;
        let status = HoldStatus { request_id: key.0.clone(), nonce: key.1, held, token };
        if engine.check().is_err() || engine.engine_id == self.engine_id || rank >= MAX_TP {
            stats.unsent_messages += 1;
            return None;
        }
        Some(HoldEffect::Answer { engine, rank, instance, status })
    }

    /// A heartbeat: extends the leases of the holds it names with their nonces.
    pub(super) fn renew(&mut self, now: Instant, renew: RenewLeases, stats: &mut WorkerStats) {
        let until = now + self.lease;
        for held in renew.holds {
            if let Some(hold) = self.live.get_mut(&held.request_id).filter(|h| h.nonce == held.nonce) {
                hold.until = hold.until.max(until);
                self.due.push(hold.until, held.request_id.clone());
                stats.leases_renewed += 1;
            }
        }
    }

    /// Frees the holds whose lease ran out.
    /// Looks only at the holds whose lease entries came due: O(what is due), not O(holds).
    pub(super) fn expire(&mut self, now: Instant, stats: &mut WorkerStats) -> Vec<HoldEffect> {
        let due = self.due.take_due(now);
        let mut effects = Vec::new();
        for id in due {
            // An entry whose hold ended, or whose lease was renewed, is stale.
            if self.live.get(&id).is_none_or(|h| h.until > now) {
                continue;
            }
            let Some(hold) = self.live.remove(&id) else { continue };
            warn!(request_id = %id, "lease ran out with no release: freeing the blocks");
            stats.expired_holds += 1;
            effects.push(HoldEffect::Freed(id.clone()));
            self.ended.insert(now, (id, hold.nonce), Ended::default());
        }
        effects
    }

    /// At close: every hold ends (nobody can read its blocks any more), in request order, and the
    /// buffers of early releases and ended holds are emptied.
    pub(super) fn close(&mut self, config: &WorkerConfig) -> Vec<RequestId> {
        let mut ended: Vec<RequestId> = self.live.drain().map(|(id, _)| id).collect();
        ended.sort();
        *self = Holds::new(config, self.instance);
        ended
    }
}

impl ConnectorWorker {
    /// Carries out what [`Holds`] asked for, in order.
    pub(super) fn apply_holds(&mut self, now: Instant, effects: Vec<HoldEffect>) {
        for effect in effects {
            match effect {
                HoldEffect::Freed(id) => self.finished.sending.push(id),
                HoldEffect::Answer { engine, rank, instance, status } => {
                    let peer = (engine.engine_id.clone(), rank);
                    if self.peers.ready(&peer).is_some_and(|c| c.instance != instance) {
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
            }
        }
    }
}

#[cfg(test)]
mod tests;
