//! The decode side of a push: a load registers this rank's blocks with every prefill rank that
//! holds some of its heads, and is done when each has answered. A [`PushResult`] counts only from
//! the agent the registration went to and only with the registration's random token, so nobody
//! else can make a load report blocks that were not written.
//!
//! A load never reports failed while a WRITE into its blocks may still land: a prefill rank says
//! `written: false` only once nothing of the registration is in flight and nothing will be. A
//! registration that waits past `transfer_timeout` (the prefill engine's queue and compute
//! included) is cancelled, and its answer awaited for `confirm_timeout`; one failed rank cancels
//! the others. Only a prefill rank that answers nothing at all, not even the cancel, is given up
//! on at the end of the cancel's wait (its peer dropped), as a READ whose peer stopped answering.
//!
//! [`Registrations`] keeps that state with no I/O and returns [`RegEffect`]s.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::deadlines::Deadlines;
use super::loads::LoadKey;
use super::peers::PeerKey;
use super::{WorkerConfig, WorkerStats};
use crate::auth::Nonce;
use crate::error::{Error, ErrorKind};
use crate::ids::{AgentName, RequestId};
use crate::meta::{PushResult, RecvRequest};
use crate::tp::{Slice, Target};

/// What the worker does for [`Registrations`], in the order given.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum RegEffect {
    /// Send the registration of `key` once its prefill rank is ready ([`Registrations::to_send`]).
    Register(LoadKey),
    /// Send the registration of `key` again to the agent it went to ([`Registrations::to_resend`]):
    /// no answer came yet, and the registration or its answer may have been lost.
    Resend(LoadKey),
    /// Tell the prefill rank `peer` not to write the registration of `request_id` (its id)
    /// with `token`.
    Cancel { peer: PeerKey, request_id: RequestId, token: Nonce },
    /// Drop the peer (it answered nothing).
    DropPeer { peer: PeerKey, agent: AgentName },
    /// Report the request's KV in place.
    Loaded(RequestId),
    /// Report the load failed.
    Failed { request_id: RequestId, error: Error },
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    /// Waiting for the prefill rank's handshake.
    AwaitingPeer,
    /// Sent to `agent` (of prefill `instance`); a WRITE may come until `until`; sent again at
    /// `resend` while no answer came.
    Registered { agent: AgentName, instance: u64, until: Instant, resend: Instant },
    /// Cancelled at `agent` (of prefill `instance`); its answer is awaited until `until`.
    Cancelling { agent: AgentName, instance: u64, until: Instant },
    /// Written.
    Written,
    /// Not written, and nothing of it in flight.
    Settled,
}

#[derive(Debug)]
struct Rank {
    heads: Option<Slice>,
    readers: u32,
    token: Nonce,
    phase: Phase,
}

#[derive(Debug)]
struct Load {
    req: RecvRequest,
    ranks: HashMap<u32, Rank>,
    /// The first failure: the load fails with it once every rank is settled.
    error: Option<Error>,
}

/// A registration to send: what [`Registrations::to_send`] hands the worker.
#[derive(Debug)]
pub(super) struct ToSend<'a> {
    pub(super) req: &'a RecvRequest,
    pub(super) heads: Option<Slice>,
    pub(super) readers: u32,
    pub(super) token: Nonce,
}

/// The decode side's push loads (see the module's documentation).
#[derive(Debug)]
pub(super) struct Registrations {
    wait: Duration,
    confirm: Duration,
    /// How often an unanswered registration is sent again.
    resend: Duration,
    loads: HashMap<RequestId, Load>,
    /// Each registration's token, to its load and rank.
    tokens: HashMap<Nonce, LoadKey>,
    due: Deadlines<LoadKey>,
}

impl Registrations {
    pub(super) fn new(config: &WorkerConfig) -> Self {
        Registrations {
            wait: config.transfer_timeout,
            confirm: config.confirm_timeout,
            resend: (config.confirm_timeout / 10).max(Duration::from_millis(1)),
            loads: HashMap::new(),
            tokens: HashMap::new(),
            due: Deadlines::default(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.loads.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.loads.is_empty()
    }

    pub(super) fn contains(&self, request_id: &RequestId) -> bool {
        self.loads.contains_key(request_id)
    }

    pub(super) fn next_deadline(&self) -> Option<Instant> {
        let until = |r: &Rank| match &r.phase {
            Phase::Registered { resend, .. } => Some(*resend),
            Phase::Cancelling { until, .. } => Some(*until),
            _ => None,
        };
        self.loads.values().flat_map(|l| l.ranks.values().filter_map(until)).min()
    }

    /// A push load: one registration per target rank, each with a token from `token`.
    pub(super) fn admit(
        &mut self,
        req: &RecvRequest,
        targets: &[Target],
        mut token: impl FnMut() -> Nonce,
    ) -> Vec<RegEffect> {
        let ranks: HashMap<u32, Rank> = targets
            .iter()
            .map(|t| {
                let rank =
                    Rank { heads: t.read, readers: t.readers, token: token(), phase: Phase::AwaitingPeer };
                (t.rank, rank)
            })
            .collect();
        let mut keys: Vec<LoadKey> = ranks.keys().map(|&r| LoadKey::new(req.request_id.clone(), r)).collect();
        keys.sort();
        for (&r, rank) in &ranks {
            self.tokens.insert(rank.token, LoadKey::new(req.request_id.clone(), r));
        }
        self.loads.insert(req.request_id.clone(), Load { req: req.clone(), ranks, error: None });
        keys.into_iter().map(RegEffect::Register).collect()
    }

    /// The registration of `key`, while it waits for its peer.
    pub(super) fn to_send(&self, key: &LoadKey) -> Option<ToSend<'_>> {
        let load = self.loads.get(&key.request_id)?;
        let rank = load.ranks.get(&key.rank).filter(|r| r.phase == Phase::AwaitingPeer)?;
        Some(ToSend { req: &load.req, heads: rank.heads, readers: rank.readers, token: rank.token })
    }

    /// The registration of `key` while it waits for an answer: what to send, the agent and
    /// instance it went to, and when its wait ends.
    pub(super) fn to_resend(&self, key: &LoadKey) -> Option<(ToSend<'_>, &AgentName, u64, Instant)> {
        let load = self.loads.get(&key.request_id)?;
        let rank = load.ranks.get(&key.rank)?;
        let Phase::Registered { agent, instance, until, .. } = &rank.phase else { return None };
        let send = ToSend { req: &load.req, heads: rank.heads, readers: rank.readers, token: rank.token };
        Some((send, agent, *instance, *until))
    }

    /// The registration of `key` went to `agent` of prefill `instance`, or could not (the
    /// handshake failed, the send failed): nothing can be written then.
    pub(super) fn sent(
        &mut self,
        now: Instant,
        key: &LoadKey,
        outcome: Result<(AgentName, u64), Error>,
        stats: &mut WorkerStats,
    ) -> Vec<RegEffect> {
        let until = now + self.wait;
        let resend = now + self.resend;
        let rank = self.loads.get_mut(&key.request_id).and_then(|l| l.ranks.get_mut(&key.rank));
        let Some(rank) = rank.filter(|r| r.phase == Phase::AwaitingPeer) else {
            return Vec::new();
        };
        match outcome {
            Ok((agent, instance)) => {
                stats.push_registrations += 1;
                // A rank with nothing to write only frees its share of the hold.
                rank.phase = if rank.heads.is_some() {
                    self.due.push(resend, key.clone());
                    Phase::Registered { agent, instance, until, resend }
                } else {
                    Phase::Written
                };
                self.settle(&key.request_id)
            }
            Err(e) => {
                rank.phase = Phase::Settled;
                self.fail(now, &key.request_id, e)
            }
        }
    }

    /// A prefill rank's word on a registration, from `from`.
    pub(super) fn result(
        &mut self,
        now: Instant,
        from: &AgentName,
        result: PushResult,
        stats: &mut WorkerStats,
    ) -> Vec<RegEffect> {
        let Some(key) = self.tokens.get(&result.token).cloned() else {
            stats.stray_notifications += 1;
            return Vec::new();
        };
        let Some(load) = self.loads.get_mut(&key.request_id) else { return Vec::new() };
        let names_it = *load.req.prefill_request_id() == result.request_id;
        let Some(rank) = load.ranks.get_mut(&key.rank) else { return Vec::new() };
        let from_its_agent = matches!(&rank.phase,
            Phase::Registered { agent, .. } | Phase::Cancelling { agent, .. } if agent == from);
        if !names_it || !from_its_agent {
            stats.rejected_notifications += 1;
            return Vec::new();
        }
        self.tokens.remove(&result.token);
        if result.written {
            rank.phase = Phase::Written;
            stats.pushes_written += 1;
            self.settle(&key.request_id)
        } else {
            rank.phase = Phase::Settled;
            let reason: String = result.reason.chars().take(crate::error::MAX_MESSAGE_LEN).collect();
            let e =
                Error::new(ErrorKind::Transfer, format!("prefill rank {} did not write: {reason}", key.rank));
            self.fail(now, &key.request_id, e)
        }
    }

    fn rank_mut(&mut self, key: &LoadKey) -> Option<&mut Rank> {
        self.loads.get_mut(&key.request_id)?.ranks.get_mut(&key.rank)
    }

    /// Records `error` (the first one stands), cancels every rank still registered, and fails the
    /// load once every rank is settled.
    fn fail(&mut self, now: Instant, request_id: &RequestId, error: Error) -> Vec<RegEffect> {
        let mut effects = Vec::new();
        let Some(load) = self.loads.get_mut(request_id) else { return effects };
        load.error.get_or_insert(error);
        let prefill_id = load.req.prefill_request_id().clone();
        let engine = load.req.remote.engine_id.clone();
        for (&rank_no, rank) in load.ranks.iter_mut() {
            match &rank.phase {
                &Phase::Registered { ref agent, instance, .. } => {
                    let until = now + self.confirm;
                    self.due.push(until, LoadKey::new(request_id.clone(), rank_no));
                    effects.push(RegEffect::Cancel {
                        peer: (engine.clone(), rank_no),
                        request_id: prefill_id.clone(),
                        token: rank.token,
                    });
                    rank.phase = Phase::Cancelling { agent: agent.clone(), instance, until };
                }
                // Never sent: it never will be.
                Phase::AwaitingPeer => rank.phase = Phase::Settled,
                _ => {}
            }
        }
        effects.extend(self.settle(request_id));
        effects
    }

    /// Reports the load once no rank is pending: loaded when every rank was written, else failed.
    fn settle(&mut self, request_id: &RequestId) -> Vec<RegEffect> {
        let Some(load) = self.loads.get(request_id) else { return Vec::new() };
        let pending = load.ranks.values().any(|r| {
            matches!(r.phase, Phase::AwaitingPeer | Phase::Registered { .. } | Phase::Cancelling { .. })
        });
        if pending {
            return Vec::new();
        }
        let Some(load) = self.loads.remove(request_id) else { return Vec::new() };
        for rank in load.ranks.values() {
            self.tokens.remove(&rank.token);
        }
        vec![match load.error {
            None => RegEffect::Loaded(load.req.request_id),
            Some(error) => RegEffect::Failed { request_id: load.req.request_id, error },
        }]
    }

    /// Registrations past their wait are cancelled, those waiting less sent again every
    /// `resend`; cancels past their wait give their peer up.
    pub(super) fn expire(&mut self, now: Instant, stats: &mut WorkerStats) -> Vec<RegEffect> {
        let due = self.due.take_due(now);
        let (every, mut effects) = (self.resend, Vec::new());
        for key in due {
            let Some(rank) = self.rank_mut(&key) else { continue };
            match rank.phase.clone() {
                Phase::Registered { resend, until, .. } if resend <= now && now < until => {
                    let next = (now + every).min(until);
                    if let Phase::Registered { resend, .. } = &mut rank.phase {
                        *resend = next;
                    }
                    self.due.push(next, key.clone());
                    effects.push(RegEffect::Resend(key));
                }
                Phase::Registered { until, .. } if until <= now => {
                    stats.push_cancels += 1;
                    let e = Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "prefill rank {} wrote nothing within {:?} of the registration",
                            key.rank, self.wait
                        ),
                    );
                    effects.extend(self.fail(now, &key.request_id, e));
                }
                Phase::Cancelling { agent, until, .. } if until <= now => {
                    stats.push_cancels_unanswered += 1;
                    rank.phase = Phase::Settled;
                    let Some(load) = self.loads.get(&key.request_id) else { continue };
                    let peer = (load.req.remote.engine_id.clone(), key.rank);
                    effects.push(RegEffect::DropPeer { peer, agent });
                    let e = Error::new(
                        ErrorKind::Timeout,
                        format!("prefill rank {} answered neither the registration nor its cancel", key.rank),
                    );
                    effects.extend(self.fail(now, &key.request_id, e));
                }
                _ => {}
            }
        }
        effects
    }

    /// Prefill rank `peer` restarted (a handshake found a new instance): registrations that went
    /// to instance `old` will not be written by it (it is gone), and their loads fail now.
    pub(super) fn peer_restarted(&mut self, now: Instant, peer: &PeerKey, old: u64) -> Vec<RegEffect> {
        let stale: Vec<LoadKey> = self
            .loads
            .iter()
            .filter(|(_, l)| l.req.remote.engine_id == peer.0)
            .filter_map(|(id, l)| {
                let rank = l.ranks.get(&peer.1)?;
                matches!(rank.phase,
                    Phase::Registered { instance, .. } | Phase::Cancelling { instance, .. } if instance == old)
                    .then(|| LoadKey::new(id.clone(), peer.1))
            })
            .collect();
        let mut effects = Vec::new();
        for key in stale {
            if let Some(rank) = self.rank_mut(&key) {
                rank.phase = Phase::Settled;
            }
            let e = Error::new(ErrorKind::Transfer, format!("engine {} restarted before it wrote", peer.0));
            effects.extend(self.fail(now, &key.request_id, e));
        }
        effects
    }

    /// At close: every load fails; returns their ids (in order) and the cancels to send.
    pub(super) fn close(&mut self) -> (Vec<RequestId>, Vec<RegEffect>) {
        let mut cancels = Vec::new();
        let mut ids = Vec::new();
        for (id, load) in self.loads.drain() {
            for (&rank_no, rank) in &load.ranks {
                if matches!(rank.phase, Phase::Registered { .. }) {
                    cancels.push(RegEffect::Cancel {
                        peer: (load.req.remote.engine_id.clone(), rank_no),
                        request_id: load.req.prefill_request_id().clone(),
                        token: rank.token,
                    });
                }
            }
            ids.push(id);
        }
        ids.sort();
        self.tokens.clear();
        self.due.clear();
        (ids, cancels)
    }
}

#[cfg(test)]
mod tests;
