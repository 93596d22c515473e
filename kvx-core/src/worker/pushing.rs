//! The driver of push mode on both sides: the decode side admits a push load and sends its
//! registrations ([`Registrations`]); the prefill side takes registrations and holds, posts the
//! WRITEs and answers ([`Pushes`]). Both carry out their state's effects here.
//!
//! [`Registrations`]: super::registrations::Registrations
//! [`Pushes`]: super::pushes::Pushes

use std::time::Instant;
use tracing::debug;

use super::decode::Pairs;
use super::loads::LoadKey;
use super::peers::Waiter;
use super::pushes::{PushEffect, PushKey};
use super::registrations::RegEffect;
use super::{ConnectorWorker, carry_out};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::AgentName;
use crate::meta::{PushCancel, PushHold, PushRegistration, PushResult, RecvRequest, ReplyTo};
use crate::tp::Target;
use crate::transfer::{XferId, XferOp};
use crate::wire;

impl ConnectorWorker {
    /// Decode side: a push load. Checked before anything touches the network; then one
    /// registration per prefill rank that holds some of this rank's heads (and one that frees,
    /// for a prefill rank nobody reads from). Nothing to load (the request ended before its
    /// blocks were allocated): the registrations only free the prefill engine's hold.
    pub(super) fn admit_push(&mut self, now: Instant, req: &RecvRequest) {
        let checked = self.check_push(req).and_then(|()| self.targets(req));
        let mut targets = match checked {
            Ok(targets) => targets,
            Err(e) => return self.fail(&req.request_id, e),
        };
        if req.is_notify_only() {
            self.stats.notify_only += 1;
            for t in &mut targets {
                t.read = None;
            }
            return self.register_free_only(now, req, &targets);
        }
        let tokens = &mut self.tokens;
        let effects = self.registrations.admit(req, &targets, || tokens.next_nonce());
        self.apply_registrations(now, effects);
    }

    /// Sends registrations with nothing to write, which free each target's share of the hold; no
    /// answer is awaited.
    fn register_free_only(&mut self, now: Instant, req: &RecvRequest, targets: &[Target]) {
        for t in targets {
            let token = self.tokens.next_nonce();
            let wait = self.config.transfer_timeout;
            match self.registration(req, None, t.readers, token, wait).and_then(|r| wire::encode(&r)) {
                Ok(msg) => self.send_to(now, &req.remote, t.rank, msg),
                Err(e) => debug!(error = %e, "a registration that frees could not be made"),
            }
        }
    }

    /// What a push load's params and blocks must be before anything touches the network.
    fn check_push(&self, req: &RecvRequest) -> Result<()> {
        let Some(registered) = &self.registered else {
            return Err(Error::new(ErrorKind::State, "load requested before KV caches were registered"));
        };
        req.remote.check()?;
        if req.remote.engine_id == self.config.engine_id {
            return Err(Error::invalid_peer_data(format!(
                "remote engine {} is this engine",
                req.remote.engine_id
            )));
        }
        if self.registrations.contains(&req.request_id) || self.loads.is_loading(&req.request_id, None) {
            return Err(Error::invalid_argument("a load for this request is already in flight"));
        }
        let local: Vec<_> = req.local_block_ids.iter().flat_map(|g| g.ids.iter().copied()).collect();
        self.check_local_blocks(registered, req.local_block_ids.len(), &local)
    }

    /// The registration this rank sends a prefill rank, MACed under the deployment's key.
    fn registration(
        &self,
        req: &RecvRequest,
        heads: Option<crate::tp::Slice>,
        readers: u32,
        token: crate::auth::Nonce,
        valid: std::time::Duration,
    ) -> Result<PushRegistration> {
        let Some(reply_to) = self.reply_to(token) else {
            return Err(Error::new(ErrorKind::State, "no side channel to be written and answered on"));
        };
        let mut reg = PushRegistration {
            request_id: req.prefill_request_id().clone(),
            reply_to,
            groups: if heads.is_some() { req.local_block_ids.clone() } else { Vec::new() },
            heads,
            reader: self.config.rank,
            readers,
            instance: req.prefill_instance(),
            valid_ms: u64::try_from(valid.as_millis()).unwrap_or(u64::MAX),
            prompt: req.prompt,
            mac: None,
        };
        reg.mac = self.config.auth_key.as_ref().map(|key| reg.tag(key));
        Ok(reg)
    }

    /// Carries out what `Registrations` asked for, in order.
    pub(super) fn apply_registrations(&mut self, now: Instant, effects: Vec<RegEffect>) {
        carry_out(effects, |effect| match effect {
            RegEffect::Register(key) => {
                let Some(req) = self.registrations.to_send(&key).map(|s| s.req) else { return Vec::new() };
                let (remote, instance) = (req.remote.clone(), req.prefill_instance());
                // Connected to another instance of the prefill engine: connect again first.
                let peer = (remote.engine_id.clone(), key.rank);
                if self.peers.ready(&peer).is_some_and(|c| instance.is_some_and(|i| i != c.instance)) {
                    self.invalidate(&peer);
                }
                match self.peers.when_ready(now, &remote, key.rank, Waiter::Register(key.clone())) {
                    Ok(Some(_)) => self.send_registration_effects(now, &key),
                    Ok(None) => Vec::new(),
                    Err(e) => self.registrations.sent(now, &key, Err(e), &mut self.stats),
                }
            }
            RegEffect::Resend(key) => {
                self.resend_registration(now, &key);
                Vec::new()
            }
            RegEffect::Cancel { peer, request_id, token } => {
                self.send_cancel(&peer, request_id, token);
                Vec::new()
            }
            RegEffect::DropPeer { peer, agent } => {
                self.invalidate_connection(&peer, &agent);
                Vec::new()
            }
            RegEffect::Loaded(id) => {
                self.finished.recving.push(id);
                Vec::new()
            }
            RegEffect::Failed { request_id, error } => {
                self.fail(&request_id, error);
                Vec::new()
            }
        });
    }

    /// Decode side: tells a prefill rank not to write a registration (its answer comes as a
    /// [`PushResult`]).
    pub(super) fn send_cancel(
        &mut self,
        peer: &super::peers::PeerKey,
        request_id: crate::ids::RequestId,
        token: crate::auth::Nonce,
    ) {
        let Some(reply_to) = self.reply_to(token) else { return };
        match wire::encode(&PushCancel { request_id, reply_to }) {
            Ok(msg) => self.notify_peer(peer, &msg),
            Err(e) => debug!(error = %e, "encoding a cancel failed"),
        }
    }

    /// Decode side: the prefill rank of `key` is ready: its registration goes out.
    pub(super) fn send_registration(&mut self, now: Instant, key: &LoadKey) {
        let effects = self.send_registration_effects(now, key);
        self.apply_registrations(now, effects);
    }

    fn send_registration_effects(&mut self, now: Instant, key: &LoadKey) -> Vec<RegEffect> {
        let Some(send) = self.registrations.to_send(key) else { return Vec::new() };
        let peer = (send.req.remote.engine_id.clone(), key.rank);
        let (heads, readers, token) = (send.heads, send.readers, send.token);
        let req = send.req.clone();
        let wait = self.config.transfer_timeout;
        let outcome = self
            .registration(&req, heads, readers, token, wait)
            .and_then(|r| wire::encode(&r))
            .and_then(|msg| {
                let conn =
                    self.peers.ready(&peer).ok_or_else(|| Error::new(ErrorKind::State, "peer not ready"))?;
                if req.prefill_instance().is_some_and(|i| i != conn.instance) {
                    return Err(Error::new(
                        ErrorKind::Transfer,
                        format!("prefill engine {} restarted (a new instance) before the push", peer.0),
                    ));
                }
                let (agent, instance) = (conn.agent.clone(), conn.instance);
                self.agent.notify(&agent, &msg).map(|()| (agent, instance))
            });
        if outcome.is_err() {
            self.invalidate(&peer);
        }
        self.registrations.sent(now, key, outcome, &mut self.stats)
    }

    /// Decode side: sends a registration again to the instance it went to. A peer dropped since
    /// (a failed send) is connected again first: a handshake that finds a new instance fails the
    /// registrations of the old one (`peer_restarted`), one that finds the same instance sends
    /// it again.
    pub(super) fn resend_registration(&mut self, now: Instant, key: &LoadKey) {
        let Some((send, _, instance, until)) = self.registrations.to_resend(key) else { return };
        let left = until.saturating_duration_since(now);
        let peer = (send.req.remote.engine_id.clone(), key.rank);
        let (req, heads, readers, token) = (send.req.clone(), send.heads, send.readers, send.token);
        match self.peers.ready(&peer).map(|c| c.instance) {
            Some(i) if i == instance => {}
            // Another instance: the handshake that connected it failed the registration already.
            Some(_) => return,
            None => {
                if let Err(e) = self.peers.when_ready(now, &req.remote, key.rank, Waiter::Resend(key.clone()))
                {
                    debug!(error = %e, "a registration cannot be sent again");
                }
                return;
            }
        }
        match self.registration(&req, heads, readers, token, left).and_then(|r| wire::encode(&r)) {
            Ok(msg) => {
                self.stats.push_resends += 1;
                self.notify_peer(&peer, &msg);
            }
            Err(e) => debug!(error = %e, "a registration could not be made again"),
        }
    }

    /// Decode side: a prefill rank's word on a registration.
    pub(super) fn on_push_result(&mut self, now: Instant, from: &AgentName, result: PushResult) {
        let effects = self.registrations.result(now, from, result, &mut self.stats);
        self.apply_registrations(now, effects);
    }

    /// Prefill side: a push hold from the scheduler.
    pub(super) fn push_hold(&mut self, now: Instant, held: &PushHold) {
        let effects = self.pushes.hold(now, held, &mut self.stats);
        self.apply_pushes(now, effects);
    }

    /// Prefill side: a decode worker's registration.
    pub(super) fn on_push_registration(&mut self, now: Instant, from: &AgentName, reg: PushRegistration) {
        let pull_held = self.holds.holds(&reg.request_id);
        let peers = &self.peers;
        let connected = |to: &ReplyTo| peers.connected_at(to);
        let effects = self.pushes.register(now, from, reg, connected, pull_held, &mut self.stats);
        self.apply_pushes(now, effects);
    }

    /// Prefill side: a decode worker's cancel. A registration this worker does not have is
    /// answered only to a decode worker already connected at the instance the cancel names.
    pub(super) fn on_push_cancel(&mut self, now: Instant, cancel: PushCancel) {
        let connected = self.peers.connected_at(&cancel.reply_to);
        let effects = self.pushes.cancel(now, cancel, connected, &mut self.stats);
        self.apply_pushes(now, effects);
    }

    /// Carries out what `Pushes` asked for, in order.
    pub(super) fn apply_pushes(&mut self, now: Instant, effects: Vec<PushEffect>) {
        carry_out(effects, |effect| match effect {
            PushEffect::Write(key) => {
                let Some(to) = self.pushes.job(&key).map(|j| j.to.clone()) else { return Vec::new() };
                let peer = (to.engine.engine_id.clone(), to.rank);
                if self.peers.ready(&peer).is_some_and(|c| c.instance != to.instance) {
                    self.invalidate(&peer);
                }
                match self.peers.when_ready(now, &to.engine, to.rank, Waiter::Write(key.clone())) {
                    Ok(Some(_)) => self.post_write_effects(now, &key),
                    Ok(None) => Vec::new(),
                    Err(_) => self.pushes.unreachable(now, &key, &mut self.stats),
                }
            }
            PushEffect::Answer { to, request_id, written, reason } => {
                let result = PushResult { request_id, token: to.token, written, reason };
                match wire::encode(&result) {
                    Ok(msg) => self.send_to(now, &to.engine, to.rank, msg),
                    Err(e) => debug!(error = %e, "encoding a push result failed"),
                }
                Vec::new()
            }
            // Cancelled, the WRITE is over (no completion will come); one that cannot be
            // cancelled yet ends on its own.
            PushEffect::Cancel(xfer) => match self.agent.release(xfer) {
                Ok(()) => match self.pushes.take_write(xfer) {
                    Some(key) => {
                        let cancelled =
                            Error::new(ErrorKind::Transfer, "the WRITE was cancelled: the lease ran out");
                        self.pushes.write_ended(now, &key, Err(cancelled), &mut self.stats)
                    }
                    None => Vec::new(),
                },
                Err(e) => {
                    debug!(%xfer, error = %e, "a push WRITE cannot be cancelled yet: it ends on its own");
                    Vec::new()
                }
            },
            PushEffect::Freed(id) => {
                self.finished.sending.push(id);
                Vec::new()
            }
        });
    }

    /// Prefill side: the decode worker of `key` is ready: its WRITE is posted.
    pub(super) fn post_write(&mut self, now: Instant, key: &PushKey) {
        let effects = self.post_write_effects(now, key);
        self.apply_pushes(now, effects);
    }

    fn post_write_effects(&mut self, now: Instant, key: &PushKey) -> Vec<PushEffect> {
        let Some(job) = self.pushes.job(key).cloned() else { return Vec::new() };
        if job.expires <= now {
            let late = Error::new(ErrorKind::Timeout, "the registration's time ran out before the WRITE");
            return self.pushes.posted(now, key, Err(late), &mut self.stats);
        }
        let peer = (job.to.engine.engine_id.clone(), job.to.rank);
        let done = PushResult {
            request_id: key.request_id.clone(),
            token: job.to.token,
            written: true,
            reason: String::new(),
        };
        let outcome = wire::encode(&done).and_then(|msg| {
            let pairs = Pairs { local: &job.local, remote: &job.remote, slice: &job.heads };
            let posted = self.post_pairs(XferOp::Write, &peer, None, pairs, &msg)?;
            Ok((posted.xfer, posted.agent, posted.bytes))
        });
        if outcome.is_err() {
            self.invalidate(&peer);
        }
        self.pushes.posted(now, key, outcome, &mut self.stats)
    }

    /// Prefill side: the decode worker of `key` could not be reached.
    pub(super) fn push_unreachable(&mut self, now: Instant, key: &PushKey) {
        let effects = self.pushes.unreachable(now, key, &mut self.stats);
        self.apply_pushes(now, effects);
    }

    /// Prefill side: a push WRITE ended.
    pub(super) fn push_write_ended(
        &mut self,
        now: Instant,
        xfer: XferId,
        key: &PushKey,
        outcome: Result<()>,
    ) {
        if let Err(e) = self.agent.release(xfer) {
            debug!(%xfer, error = %e, "releasing a finished WRITE failed");
        }
        let effects = self.pushes.write_ended(now, key, outcome, &mut self.stats);
        self.apply_pushes(now, effects);
    }

    /// Both sides: registrations past their wait, push holds past their lease.
    pub(super) fn expire_pushes(&mut self, now: Instant) {
        let effects = self.registrations.expire(now, &mut self.stats);
        self.apply_registrations(now, effects);
        let effects = self.pushes.expire(now, &mut self.stats);
        self.apply_pushes(now, effects);
    }
}
