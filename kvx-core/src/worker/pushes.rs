//! The prefill side of a push: a request's blocks stay held under a lease until every decode
//! rank that registered for them has been written (or refused), and each registration is
//! answered exactly once with a [`PushResult`].
//!
//! In push mode the decode engine is dispatched at the same time as the prefill engine, so its
//! registrations usually come before the hold: they are kept per sender within the same bounds
//! as early releases (`early`), and taken when the hold comes. A registration names the request
//! and, with a deployment key, carries a MAC over every field, so only a member of the deployment
//! can have blocks written; it is written only into the blocks it names, only from the blocks of
//! the hold of the request it names.
//!
//! Every registration that will not be written is answered `written: false` once no WRITE of it
//! is in flight, so the decode engine can reuse its blocks then and there (never by waiting for a
//! lease): a hold that ended before the registration came, a pull hold, blocks the hold does not
//! have, a WRITE that failed, a cancel that came before the WRITE was posted. A WRITE that ends
//! well is announced by the notification posted with it, which the transport delivers after the
//! data. A cancel is remembered (`cancelled`), so a registration kept before its hold is never
//! written after its decode worker gave up on it.
//!
//! [`Pushes`] keeps that state with no I/O and returns [`PushEffect`]s for the worker to carry
//! out (`pushing`).

use std::collections::HashMap;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

use super::deadlines::Deadlines;
use super::early::{EarlyReleases, MAX_EARLY_READERS, Reader};
use super::ttl::{Key, TtlMap};
use super::{WorkerConfig, WorkerStats};
use crate::auth::{AuthKey, HexBytes, Nonce, PromptDigest};
use crate::ids::{AgentName, BlockId, EngineId, GroupBlocks, RequestId};
use crate::meta::{PushCancel, PushHold, PushRegistration, ReplyTo, block_pairs};
use crate::params::MAX_ID_LEN;
use crate::tp::{MAX_TP, Slice};
use crate::transfer::XferId;

/// A registration's place in its hold: the request and the decode rank that registered.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct PushKey {
    pub(super) request_id: RequestId,
    pub(super) reader: u32,
}

/// A WRITE to post: the prefill blocks, the decode blocks they go to (index by index), and the
/// heads, seen from this side (`local_head` in this rank's blocks).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct WriteJob {
    pub(super) to: ReplyTo,
    pub(super) local: Vec<BlockId>,
    pub(super) remote: Vec<BlockId>,
    pub(super) heads: Slice,
    /// When the registration's time runs out (see [`PushRegistration::valid_ms`]): no WRITE is
    /// posted after it, and one in flight is cancelled.
    pub(super) expires: Instant,
}

/// What the worker does for [`Pushes`], in the order given.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum PushEffect {
    /// Post the WRITE of `key` once its decode worker is ready ([`Pushes::job`]).
    Write(PushKey),
    /// Tell the decode worker whether its registration was written: `written: false` (why in
    /// `reason`) once nothing of it is in flight, or `written: true` again for a WRITE that ended
    /// well (its own notification said so first).
    Answer { to: ReplyTo, request_id: RequestId, written: bool, reason: String },
    /// Cancel a WRITE in flight (the hold's lease, or its registration's time, ran out).
    Cancel(XferId),
    /// Report the held request finished: its blocks are free.
    Freed(RequestId),
}

#[derive(Debug)]
enum Job {
    /// Waiting for the decode worker's handshake.
    AwaitingPeer(WriteJob),
    /// Posted to `agent`: `bytes` go to the decode worker `to`, and must have by `expires`.
    Writing { xfer: XferId, agent: AgentName, to: ReplyTo, bytes: u64, expires: Instant },
}

impl Job {
    fn expires(&self) -> Instant {
        match self {
            Job::AwaitingPeer(job) => job.expires,
            Job::Writing { expires, .. } => *expires,
        }
    }
}

#[derive(Debug)]
struct Live {
    /// The prefill engine's id of the request (the holds are keyed by the id registrations name).
    request_id: RequestId,
    groups: Vec<GroupBlocks>,
    /// The digest of the held request's prompt, if its engine computed one.
    prompt: Option<PromptDigest>,
    /// When the hold came: heartbeats renew it to at most ten leases from then.
    start: Instant,
    until: Instant,
    /// The readers the first registration announced.
    readers: Option<u32>,
    /// Readers whose registration was taken, with its token.
    taken: Vec<(u32, Nonce)>,
    /// Readers written, refused or failed.
    done: u32,
    jobs: HashMap<u32, Job>,
    /// The lease ran out: the hold ends once its WRITEs in flight end.
    expired: bool,
}

/// A registration kept before its hold, and when its time runs out.
#[derive(Debug)]
pub(super) struct Early {
    registration: PushRegistration,
    expires: Instant,
}

impl Reader for Early {
    /// A registration sent again (same reader, same token) replaces the one kept; another
    /// registration of the same reader (another decode request under the same id) is kept beside
    /// it, and the hold writes the one of its prompt.
    fn replaced_by(&self, later: &Self) -> bool {
        let (kept, later) = (&self.registration, &later.registration);
        kept.reader == later.reader && kept.reply_to.token == later.reply_to.token
    }
}

/// Push holds, registrations that came before their hold, WRITEs in flight.
#[derive(Debug)]
pub(super) struct Pushes {
    engine_id: EngineId,
    instance: u64,
    lease: Duration,
    auth_key: Option<AuthKey>,
    live: HashMap<RequestId, Live>,
    due: Deadlines<RequestId>,
    early: EarlyReleases<Early>,
    /// Holds that ended (see [`Ended`]).
    ended: TtlMap<Ended>,
    /// Registrations their decode worker cancelled, by request and token.
    cancelled: TtlMap<()>,
    /// Requests whose registrations were answered "no hold came in time": their decode legs
    /// gave up, so the hold that comes after is freed at once, unpushed.
    given_up: TtlMap<()>,
    /// The answers given, by request and token.
    answered: TtlMap<Answered>,
    writes: HashMap<XferId, PushKey>,
}

/// A hold that ended, or a request that will not be pushed: a registration that comes later is
/// refused with `reason` (at most [`MAX_EARLY_READERS`] of them, so that replays cost bounded
/// work).
#[derive(Debug, Default)]
struct Ended {
    reason: String,
    answered: usize,
}

/// The answer given to a registration: its decode worker may ask again (a registration sent
/// again, a cancel) when the first answer was lost.
#[derive(Debug, Clone, Copy)]
struct Answered {
    written: bool,
    /// Times it was given again.
    again: u32,
}

/// At most this many times is one registration's answer given again.
const MAX_ANSWERS_AGAIN: u32 = 8;

/// Why a registration whose time ran out is refused.
const TIME_RAN_OUT: &str = "the registration's time ran out before the WRITE";

/// Why a registration of another prompt than the held request's is refused (two requests a
/// router sent under one id).
const OTHER_PROMPT: &str = "the registration's prompt is not the held request's (two requests under one id?)";

/// Why a registration for a request held for a pull is refused.
const PULL_HELD: &str =
    "the prefill engine holds the request for a pull (READ), not a push: the modes differ";

/// The key of a request in the maps keyed by request and nonce, where only the request counts.
fn request_key(request_id: &RequestId) -> Key {
    (request_id.clone(), HexBytes([0; 16]))
}

impl Pushes {
    pub(super) fn new(config: &WorkerConfig, instance: u64) -> Self {
        let kept = config.early_releases_per_sender.saturating_mul(config.max_early_senders);
        // Ended holds, cancels and answers are remembered for ten leases: a decode engine may
        // register long after its prefill leg ended (its own queue was full), and learns at once
        // that nothing will be written.
        let ttl = config.lease_duration.max(config.early_release_ttl).saturating_mul(10);
        Pushes {
            engine_id: config.engine_id.clone(),
            instance,
            lease: config.lease_duration,
            auth_key: config.auth_key.clone(),
            live: HashMap::new(),
            due: Deadlines::default(),
            early: EarlyReleases::new(config),
            ended: TtlMap::new(kept, ttl),
            cancelled: TtlMap::new(kept, ttl),
            given_up: TtlMap::new(kept, ttl),
            answered: TtlMap::new(kept, ttl),
            writes: HashMap::new(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.live.len()
    }

    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.live.values().filter(|l| !l.expired).map(|l| l.until).chain(self.early.next_deadline()).min()
    }

    /// Whether a WRITE to `agent` is in flight.
    pub(super) fn writes_to(&self, agent: &AgentName) -> bool {
        let writing =
            |l: &Live| l.jobs.values().any(|j| matches!(j, Job::Writing { agent: a, .. } if a == agent));
        self.live.values().any(writing)
    }

    /// Registrations whose hold did not come within `early_release_ttl` are answered "not
    /// written" (the decode worker need not wait for its registration's end), and the other
    /// memories expire. Only decode workers `connected` at the instance they name are answered
    /// (as for a hold this worker does not have: no handshake for whatever a registration names);
    /// a hold that comes after such an answer is freed at once.
    pub(super) fn expire_buffers(
        &mut self,
        now: Instant,
        connected: impl Fn(&ReplyTo) -> bool,
        stats: &mut WorkerStats,
    ) -> Vec<PushEffect> {
        let mut expired = Vec::new();
        stats.stray_notifications += self.early.expire_into(now, &mut expired);
        self.ended.expire(now);
        self.cancelled.expire(now);
        self.given_up.expire(now);
        self.answered.expire(now);
        let reason = "no hold of the request came to the prefill engine in time";
        let mut effects = Vec::new();
        for early in expired {
            let reg = early.registration;
            if reg.heads.is_none() || !connected(&reg.reply_to) {
                continue;
            }
            self.given_up.insert(now, request_key(&reg.request_id), ());
            effects.push(self.refuse(now, reg, reason, stats));
        }
        effects
    }

    /// A push hold from the scheduler: its lease starts now; the registrations that came before
    /// it are taken.
    pub(super) fn hold(&mut self, now: Instant, held: &PushHold, stats: &mut WorkerStats) -> Vec<PushEffect> {
        let id = held.registered_as.clone();
        let empty = held.groups.iter().all(|g| g.ids.is_empty());
        if self.live.contains_key(&id) {
            // Two requests registered for under one id (a router that reused it): the first
            // keeps it, the second's blocks are freed unpushed (its registrations go to the first).
            warn!(request_id = %held.request_id, registered_as = %id, "another push hold is registered for under this id: freed unpushed");
            return if empty { Vec::new() } else { vec![PushEffect::Freed(held.request_id.clone())] };
        }
        if empty {
            return self.end_unheld(now, &id, "the prefill engine kept no blocks of the request", stats);
        }
        if self.given_up.take(&request_key(&id)).is_some() {
            // Its decode leg was told nothing would come, and failed: nobody will register.
            debug!(request_id = %held.request_id, "push hold after its registrations gave up: freed unpushed");
            let reason = "the registration had run out before the hold came";
            let mut effects = self.end_unheld(now, &id, reason, stats);
            effects.push(PushEffect::Freed(held.request_id.clone()));
            return effects;
        }
        let live = Live {
            request_id: held.request_id.clone(),
            groups: held.groups.clone(),
            prompt: held.prompt,
            start: now,
            until: now + self.lease,
            readers: None,
            taken: Vec::new(),
            done: 0,
            jobs: HashMap::new(),
            expired: false,
        };
        self.due.push(live.until, id.clone());
        self.live.insert(id.clone(), live);
        let mut effects = Vec::new();
        for early in self.early.take(&request_key(&id)) {
            self.register_live(now, early.registration, early.expires, stats, &mut effects);
        }
        effects
    }

    /// A registration from `from`. `connected` tells whether its decode worker is connected at
    /// the instance it names: only those are answered about a hold this worker does not have
    /// (no handshake for whatever a registration names). `pull_held` tells whether the request
    /// is held for a pull.
    pub(super) fn register(
        &mut self,
        now: Instant,
        from: &AgentName,
        reg: PushRegistration,
        connected: impl Fn(&ReplyTo) -> bool,
        pull_held: bool,
        stats: &mut WorkerStats,
    ) -> Vec<PushEffect> {
        let mut effects = Vec::new();
        if !self.plausible(&reg) {
            stats.stray_notifications += 1;
            return effects;
        }
        if let Some(key) = &self.auth_key {
            if let Err(e) = reg.verify(key) {
                debug!(request_id = %reg.request_id, %from, error = %e, "push registration refused");
                stats.rejected_notifications += 1;
                return effects;
            }
        }
        let id = reg.request_id.clone();
        // Never past ten leases, whatever the registration says.
        let expires = now + Duration::from_millis(reg.valid_ms).min(self.lease.saturating_mul(10));
        if self.live.contains_key(&id) {
            self.register_live(now, reg, expires, stats, &mut effects);
            return effects;
        }
        if pull_held && !self.ended.contains(&request_key(&id)) {
            let ended = Ended { reason: PULL_HELD.to_owned(), ..Ended::default() };
            self.ended.insert(now, request_key(&id), ended);
        }
        if let Some(again) = self.answer_again(&id, &reg.reply_to, stats) {
            effects.extend(again);
            return effects;
        }
        if let Some(ended) = self.ended.get_mut(&request_key(&id)) {
            if ended.answered >= MAX_EARLY_READERS {
                stats.stray_notifications += 1;
                return effects;
            }
            if reg.heads.is_some() {
                ended.answered += 1;
                let reason = ended.reason.clone();
                effects.push(self.refuse(now, reg, &reason, stats));
            }
            return effects;
        }
        let restarted = reg.instance.is_some_and(|i| i != self.instance);
        match restarted {
            true if connected(&reg.reply_to) => {
                let reason = "the registration names another instance of the prefill engine (it restarted)";
                effects.push(self.refuse(now, reg, reason, stats))
            }
            true => stats.stray_notifications += 1,
            false => {
                stats.early_notifications += 1;
                let kept =
                    self.early.insert(now, from, request_key(&id), Early { registration: reg, expires });
                stats.stray_notifications += kept.stray;
                stats.early_notifications_dropped += kept.dropped;
            }
        }
        effects
    }

    /// A request this worker will not push (`reason`): the registrations kept for it are
    /// refused, and so are those that come later.
    fn end_unheld(
        &mut self,
        now: Instant,
        id: &RequestId,
        reason: &str,
        stats: &mut WorkerStats,
    ) -> Vec<PushEffect> {
        let early = self.early.take(&request_key(id));
        let ended = Ended { reason: reason.to_owned(), answered: early.len() };
        self.ended.insert(now, request_key(id), ended);
        // A registration with nothing to write waits for no answer.
        let waiting = early.into_iter().filter(|e| e.registration.heads.is_some());
        waiting.map(|e| self.refuse(now, e.registration, reason, stats)).collect()
    }

    /// A heartbeat of a decode engine whose requests wait for their blocks: the push holds of
    /// `ids` live a lease longer, to at most ten leases from their start (a heartbeat needs no
    /// secret, so it can pin a hold only so long).
    pub(super) fn renew(&mut self, now: Instant, ids: &[RequestId], stats: &mut WorkerStats) {
        for id in ids {
            let Some(live) = self.live.get_mut(id).filter(|l| !l.expired) else { continue };
            let until = (now + self.lease).min(live.start + self.lease.saturating_mul(10));
            if until > live.until {
                live.until = until;
                self.due.push(until, id.clone());
                stats.leases_renewed += 1;
            }
        }
    }

    /// A pull hold came for `id`: registrations that came before it are refused (the modes
    /// differ), and so are those to come.
    pub(super) fn pull_held(
        &mut self,
        now: Instant,
        id: &RequestId,
        stats: &mut WorkerStats,
    ) -> Vec<PushEffect> {
        if self.early.is_empty() {
            return Vec::new();
        }
        self.end_unheld(now, id, PULL_HELD, stats)
    }

    /// Within kvx's bounds, and not naming this engine.
    fn plausible(&self, reg: &PushRegistration) -> bool {
        let to = &reg.reply_to;
        reg.request_id.as_str().len() <= MAX_ID_LEN
            && reg.readers > 0
            && reg.readers <= MAX_TP
            && reg.reader < MAX_TP
            && to.rank < MAX_TP
            && to.engine.check().is_ok()
            && to.engine.engine_id != self.engine_id
            && reg.groups.len() <= crate::params::MAX_GROUPS
    }

    /// Takes a registration for a live hold: a WRITE to post, or a refusal.
    fn register_live(
        &mut self,
        now: Instant,
        reg: PushRegistration,
        expires: Instant,
        stats: &mut WorkerStats,
        effects: &mut Vec<PushEffect>,
    ) {
        let id = reg.request_id.clone();
        if self.cancelled.contains(&(id.clone(), reg.reply_to.token)) {
            stats.stray_notifications += 1;
            return;
        }
        if let Some(again) = self.answer_again(&id, &reg.reply_to, stats) {
            effects.extend(again);
            return;
        }
        let Some(live) = self.live.get_mut(&id) else { return };
        if live.prompt.is_some() && live.prompt != reg.prompt {
            // Another request's registration under this id: refused at once, whatever was taken.
            stats.rejected_notifications += 1;
            effects.push(self.refuse(now, reg, OTHER_PROMPT, stats));
            return;
        }
        if live.taken.iter().any(|&(r, t)| r == reg.reader || t == reg.reply_to.token) {
            // A second registration of one reader (being written, or another token): the first
            // stands.
            stats.stray_notifications += 1;
            return;
        }
        let refusal = if live.expired {
            Some("the prefill engine's lease of the request ran out".to_owned())
        } else if expires <= now {
            Some(TIME_RAN_OUT.to_owned())
        } else if *live.readers.get_or_insert(reg.readers) != reg.readers {
            Some(format!(
                "{} readers registered, the first registration said {:?}",
                reg.readers, live.readers
            ))
        } else {
            None
        };
        if let Some(reason) = refusal {
            stats.rejected_notifications += 1;
            effects.push(self.refuse(now, reg, &reason, stats));
            return;
        }
        live.taken.push((reg.reader, reg.reply_to.token));
        stats.notifications += 1;
        let job = match (reg.heads, pairs(&live.groups, &reg.groups)) {
            (None, _) => None,
            (Some(heads), Ok((local, remote))) if !local.is_empty() => {
                let to = reg.reply_to.clone();
                Some(Ok(WriteJob { to, local, remote, heads: heads.mirrored(), expires }))
            }
            (Some(_), Ok(_)) => None,
            (Some(_), Err(e)) => Some(Err(e)),
        };
        match job {
            Some(Ok(job)) => {
                live.jobs.insert(reg.reader, Job::AwaitingPeer(job));
                self.due.push(expires, id.clone());
                effects.push(PushEffect::Write(PushKey { request_id: id, reader: reg.reader }));
            }
            Some(Err(reason)) => {
                effects.push(self.refuse(now, reg, &reason, stats));
                self.reader_done(&id, now, effects);
            }
            // Nothing to write: the registration only frees its share of the hold.
            None => self.reader_done(&id, now, effects),
        }
    }

    /// The WRITE of `key`, while it waits for its decode worker.
    pub(super) fn job(&self, key: &PushKey) -> Option<&WriteJob> {
        match self.live.get(&key.request_id)?.jobs.get(&key.reader)? {
            Job::AwaitingPeer(job) => Some(job),
            Job::Writing { .. } => None,
        }
    }

    /// The WRITE of `key` was posted (to `agent`, `bytes` in all), or could not be (refused, the
    /// hold counts the reader done).
    pub(super) fn posted(
        &mut self,
        now: Instant,
        key: &PushKey,
        outcome: crate::error::Result<(XferId, AgentName, u64)>,
        stats: &mut WorkerStats,
    ) -> Vec<PushEffect> {
        let mut effects = Vec::new();
        let Some(live) = self.live.get_mut(&key.request_id) else { return effects };
        let Some(Job::AwaitingPeer(job)) = live.jobs.remove(&key.reader) else { return effects };
        match outcome {
            Ok((xfer, agent, bytes)) => {
                stats.writes_posted += 1;
                let expires = job.expires;
                live.jobs.insert(key.reader, Job::Writing { xfer, agent, to: job.to, bytes, expires });
                self.writes.insert(xfer, key.clone());
            }
            Err(e) => {
                warn!(request_id = %key.request_id, error = %e, "push WRITE not posted");
                stats.writes_failed += 1;
                effects.push(self.refuse_to(now, job.to, &key.request_id, &e.to_string(), stats));
                self.reader_done(&key.request_id, now, &mut effects);
            }
        }
        effects
    }

    /// The decode worker of `key` could not be reached: nothing can be written or said to it.
    pub(super) fn unreachable(
        &mut self,
        now: Instant,
        key: &PushKey,
        stats: &mut WorkerStats,
    ) -> Vec<PushEffect> {
        let mut effects = Vec::new();
        if let Some(live) = self.live.get_mut(&key.request_id) {
            if live.jobs.remove(&key.reader).is_some() {
                stats.writes_failed += 1;
                self.reader_done(&key.request_id, now, &mut effects);
            }
        }
        effects
    }

    /// The push WRITE `xfer`, if it is one: taken from the WRITEs in flight.
    pub(super) fn take_write(&mut self, xfer: XferId) -> Option<PushKey> {
        self.writes.remove(&xfer)
    }

    /// A WRITE ended. Done: its notification told the decode worker. Failed: the decode worker is
    /// told now (nothing of it is in flight any more).
    pub(super) fn write_ended(
        &mut self,
        now: Instant,
        key: &PushKey,
        outcome: crate::error::Result<()>,
        stats: &mut WorkerStats,
    ) -> Vec<PushEffect> {
        let mut effects = Vec::new();
        let Some(live) = self.live.get_mut(&key.request_id) else { return effects };
        let Some(Job::Writing { to, bytes, .. }) = live.jobs.remove(&key.reader) else { return effects };
        match outcome {
            Ok(()) => {
                stats.bytes_written += bytes;
                let answered = Answered { written: true, again: 0 };
                self.answered.insert(now, (key.request_id.clone(), to.token), answered);
            }
            Err(e) => {
                warn!(request_id = %key.request_id, error = %e, "push WRITE failed");
                stats.writes_failed += 1;
                effects.push(self.refuse_to(now, to, &key.request_id, &e.to_string(), stats));
            }
        }
        self.reader_done(&key.request_id, now, &mut effects);
        effects
    }

    /// A decode worker's cancel: a registration not written yet never will be (answered so);
    /// one being written is answered by its WRITE. One this worker does not have is answered only
    /// when its decode worker is `connected` (no handshake for whatever a cancel names); one it
    /// keeps for a hold to come is answered in any case.
    pub(super) fn cancel(
        &mut self,
        now: Instant,
        cancel: PushCancel,
        connected: bool,
        stats: &mut WorkerStats,
    ) -> Vec<PushEffect> {
        let mut effects = Vec::new();
        let PushCancel { request_id: id, reply_to } = cancel;
        if id.as_str().len() > MAX_ID_LEN || reply_to.rank >= MAX_TP || reply_to.engine.check().is_err() {
            stats.stray_notifications += 1;
            return effects;
        }
        self.cancelled.insert(now, (id.clone(), reply_to.token), ());
        let waiting = self.live.get_mut(&id).and_then(|live| {
            let reader = live.taken.iter().find(|(_, t)| *t == reply_to.token).map(|(r, _)| *r)?;
            match live.jobs.get(&reader)? {
                Job::AwaitingPeer(_) => match live.jobs.remove(&reader) {
                    Some(Job::AwaitingPeer(job)) => Some(job.to),
                    _ => None,
                },
                Job::Writing { .. } => None,
            }
        });
        if let Some(to) = waiting {
            effects.push(self.refuse_to(now, to, &id, "cancelled before it was written", stats));
            self.reader_done(&id, now, &mut effects);
        } else if let Some(again) = self.answer_again(&id, &reply_to, stats) {
            effects.extend(again);
        } else if (connected || self.kept(&id, &reply_to.token)) && !self.writing(&id, &reply_to.token) {
            effects.push(self.refuse_to(
                now,
                reply_to,
                &id,
                "cancelled: not written, and it will not be",
                stats,
            ));
        }
        effects
    }

    /// Whether a registration of `id` with `token` waits for its hold: its decode worker is
    /// answered (connected to first, if need be) when it cancels, for the token proves the cancel
    /// comes from the worker that registered.
    fn kept(&self, id: &RequestId, token: &Nonce) -> bool {
        self.early.any(&request_key(id), |e| e.registration.reply_to.token == *token)
    }

    /// Whether the registration with `token` was taken by its live hold and is not answered yet:
    /// its WRITE is in flight, or waits for its decode worker.
    fn writing(&self, id: &RequestId, token: &Nonce) -> bool {
        self.live.get(id).is_some_and(|live| live.taken.iter().any(|(_, t)| t == token))
    }

    /// Ends the holds whose lease ran out, and the WRITEs whose registration's time ran out:
    /// registrations not written are refused, WRITEs in flight cancelled; a hold is freed once
    /// none is in flight.
    pub(super) fn expire(&mut self, now: Instant, stats: &mut WorkerStats) -> Vec<PushEffect> {
        let due = self.due.take_due(now);
        let mut effects = Vec::new();
        for id in due {
            let Some(live) = self.live.get_mut(&id) else { continue };
            let lease_over = !live.expired && live.until <= now;
            if lease_over {
                warn!(request_id = %id, "push lease ran out before every reader was written: ending the hold");
                live.expired = true;
                stats.expired_holds += 1;
            }
            let mut refused = Vec::new();
            for (reader, job) in std::mem::take(&mut live.jobs) {
                let over = live.expired || job.expires() <= now;
                match job {
                    Job::AwaitingPeer(job) if over => refused.push(job.to),
                    Job::Writing { xfer, .. } if over => {
                        effects.push(PushEffect::Cancel(xfer));
                        live.jobs.insert(reader, job);
                    }
                    job => {
                        live.jobs.insert(reader, job);
                    }
                }
            }
            live.done += refused.len() as u32;
            let reason = if live.expired { "the prefill engine's lease ran out" } else { TIME_RAN_OUT };
            for to in refused {
                effects.push(self.refuse_to(now, to, &id, reason, stats));
            }
            self.end_if_idle(&id, now, &mut effects);
        }
        effects
    }

    /// Counts a reader done; the hold ends with the last one.
    fn reader_done(&mut self, id: &RequestId, now: Instant, effects: &mut Vec<PushEffect>) {
        if let Some(live) = self.live.get_mut(id) {
            live.done += 1;
        }
        self.end_if_idle(id, now, effects);
    }

    /// Ends the hold when every reader is done, or its lease ran out and no WRITE is in flight.
    fn end_if_idle(&mut self, id: &RequestId, now: Instant, effects: &mut Vec<PushEffect>) {
        let Some(live) = self.live.get(id) else { return };
        let all_done = live.readers.is_some_and(|r| live.done >= r);
        if !(all_done || live.expired) || !live.jobs.is_empty() {
            return;
        }
        let Some(live) = self.live.remove(id) else { return };
        let ended =
            Ended { reason: "the prefill engine's hold of the request ended".to_owned(), answered: 0 };
        self.ended.insert(now, request_key(id), ended);
        effects.push(PushEffect::Freed(live.request_id));
    }

    fn refuse(
        &mut self,
        now: Instant,
        reg: PushRegistration,
        reason: &str,
        stats: &mut WorkerStats,
    ) -> PushEffect {
        self.refuse_to(now, reg.reply_to, &reg.request_id, reason, stats)
    }

    /// Answers "not written", and remembers it (see [`Pushes::answered`]).
    fn refuse_to(
        &mut self,
        now: Instant,
        to: ReplyTo,
        request_id: &RequestId,
        reason: &str,
        stats: &mut WorkerStats,
    ) -> PushEffect {
        stats.push_refusals += 1;
        self.answered.insert(now, (request_id.clone(), to.token), Answered { written: false, again: 0 });
        PushEffect::Answer { to, request_id: request_id.clone(), written: false, reason: reason.to_owned() }
    }

    /// The answer given to the registration of `id` with `token`, given again (its decode worker
    /// sent the registration or a cancel again: the first answer may have been lost), at most
    /// [`MAX_ANSWERS_AGAIN`] times.
    fn answer_again(
        &mut self,
        id: &RequestId,
        to: &ReplyTo,
        stats: &mut WorkerStats,
    ) -> Option<Option<PushEffect>> {
        let answered = self.answered.get_mut(&(id.clone(), to.token))?;
        if answered.again >= MAX_ANSWERS_AGAIN {
            stats.stray_notifications += 1;
            return Some(None);
        }
        answered.again += 1;
        stats.push_answers_again += 1;
        let reason = if answered.written { "" } else { "not written (answered before)" };
        Some(Some(PushEffect::Answer {
            to: to.clone(),
            request_id: id.clone(),
            written: answered.written,
            reason: reason.to_owned(),
        }))
    }

    /// At close: every hold ends (in request order), with the WRITEs in flight to cancel.
    pub(super) fn close(&mut self, config: &WorkerConfig) -> (Vec<RequestId>, Vec<XferId>) {
        let writes: Vec<XferId> = self.writes.keys().copied().collect();
        let mut ended: Vec<RequestId> = self.live.drain().map(|(_, live)| live.request_id).collect();
        ended.sort();
        *self = Pushes::new(config, self.instance);
        (ended, writes)
    }
}

/// The prefill blocks and the registered decode blocks they go to, index by index, group by
/// group; refused when the registration names positions the hold does not have.
fn pairs(held: &[GroupBlocks], registered: &[GroupBlocks]) -> Result<(Vec<BlockId>, Vec<BlockId>), String> {
    let (registered, held) =
        block_pairs(registered, held, "registered", ("held", "the prefill engine holds"))
            .map_err(|e| e.message().to_owned())?;
    Ok((held.into_owned(), registered.into_owned()))
}

#[cfg(test)]
mod tests;
