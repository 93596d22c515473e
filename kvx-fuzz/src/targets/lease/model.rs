//! A model of the prefill rank's leases: what each notification it drains and each step must
//! free, and what it must count.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvx_core::wire::{self, MessageKind};
use kvx_core::worker::MAX_ID_LEN;
use kvx_core::{HoldRelease, HoldStatus, Nonce, Notification, RenewLeases, RequestId};

use crate::targets::fixture::PREFILL;

/// What a notification is, as a worker routes it.
#[derive(Debug)]
pub(super) enum Kind {
    Release(HoldRelease),
    Renew(RenewLeases),
    Status(HoldStatus),
    Other,
}

pub(super) fn kind(msg: &[u8]) -> Kind {
    let Ok(opened) = wire::open(msg) else { return Kind::Other };
    match opened.kind() {
        MessageKind::HoldRelease => opened.decode().map_or(Kind::Other, Kind::Release),
        MessageKind::RenewLeases => opened.decode().map_or(Kind::Other, Kind::Renew),
        MessageKind::HoldStatus => opened.decode().map_or(Kind::Other, Kind::Status),
        _ => Kind::Other,
    }
}

/// The prefill rank's leases as the contract says they behave, fed the notifications it drained.
#[derive(Debug, Default)]
pub(super) struct Model {
    pub(super) lease: Duration,
    /// The prefill rank's instance: releases naming it may be answered before their hold.
    instance: u64,
    pub(super) live: HashMap<RequestId, (Nonce, Instant)>,
    /// Holds that ended (released or expired), until they are forgotten, and whether a release
    /// asking for an answer came since (an ended hold is answered once).
    ended: HashMap<(RequestId, Nonce), (Instant, bool)>,
    /// What the prefill rank must have counted.
    pub(super) released: u64,
    pub(super) expired: u64,
    pub(super) renewed: u64,
    pub(super) rejected: u64,
    pub(super) answers: u64,
    /// Releases the prefill rank may answer at once (they name its instance and ask for an
    /// answer, and the model answers them not): at least as many as its early answers.
    pub(super) early_candidates: u64,
    /// Notifications it drained: releases and others (heartbeats aside).
    pub(super) releases_and_others: u64,
}

impl Model {
    /// A model of leases of `lease` at the prefill rank of `instance`, with no hold yet.
    pub(super) fn new(lease: Duration, instance: u64) -> Self {
        Model { lease, instance, ..Model::default() }
    }

    /// One `get_finished(now)` of the prefill rank, which drained `drained`: what it must free.
    pub(super) fn step(&mut self, now: Instant, drained: &[Notification]) -> Vec<RequestId> {
        let mut freed = Vec::new();
        for n in drained {
            match kind(&n.msg) {
                Kind::Release(r) => {
                    self.releases_and_others += 1;
                    if r.request_id.as_str().len() > MAX_ID_LEN {
                        continue;
                    }
                    let answer = match self.live.get(&r.request_id) {
                        Some((nonce, _)) if *nonce == r.nonce => {
                            self.live.remove(&r.request_id);
                            self.released += 1;
                            self.ended.insert((r.request_id.clone(), r.nonce), (now + self.lease, false));
                            freed.push(r.request_id.clone());
                            true
                        }
                        Some(_) => {
                            self.rejected += 1;
                            false
                        }
                        None => match self.ended.get_mut(&(r.request_id.clone(), r.nonce)) {
                            Some((_, answered)) if r.reply_to.is_some() && !*answered => {
                                *answered = true;
                                true
                            }
                            _ => false,
                        },
                    };
                    let answerable = r.reply_to.as_ref().is_some_and(|to| {
                        to.engine.check().is_ok() && to.engine.engine_id.as_str() != PREFILL
                    });
                    if answer {
                        self.answers += u64::from(answerable);
                    } else if answerable && r.instance == Some(self.instance) {
                        self.early_candidates += 1;
                    }
                }
                Kind::Renew(renew) => {
                    for h in renew.holds {
                        if let Some((_, until)) =
                            self.live.get_mut(&h.request_id).filter(|(n, _)| *n == h.nonce)
                        {
                            *until = (*until).max(now + self.lease);
                            self.renewed += 1;
                        }
                    }
                }
                Kind::Status(_) | Kind::Other => self.releases_and_others += 1,
            }
        }
        self.ended.retain(|_, (until, _)| *until > now);
        let expired: Vec<RequestId> =
            self.live.iter().filter(|(_, (_, until))| *until <= now).map(|(id, _)| id.clone()).collect();
        for id in expired {
            if let Some((nonce, _)) = self.live.remove(&id) {
                self.expired += 1;
                self.ended.insert((id.clone(), nonce), (now + self.lease, false));
                freed.push(id);
            }
        }
        freed
    }
}
