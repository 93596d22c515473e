//! How READs end: done and confirmed, failed (with the request's other READs that are not in
//! flight), past their deadlines, cut off by a restarted engine, or at close.

use std::time::Instant;
use tracing::debug;

use super::{
    Closed, Free, HandshakeFailed, LOAD_TIMES_KEPT, Load, LoadEffect, LoadKey, Loads, Overdue, PeerRelease,
    Read, Retry, Stage, TRANSFERS_KEPT,
};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{AgentName, RequestId};
use crate::meta::HoldStatus;
use crate::transfer::XferId;
use crate::worker::peers::PeerKey;
use crate::worker::{LoadTimes, TransferRecord, WorkerStats};

impl Loads {
    /// Fails READ `key`, telling its prefill rank to free as `free` says. The first failure of a
    /// request's READs fails the request and ends its READs that are not in flight (a waiting
    /// one's prefill rank is told to free; a confirming one's release went with its READ); those
    /// in flight end when their transfers do. The request is reported once its last READ ended.
    pub(in crate::worker) fn fail(
        &mut self,
        now: Instant,
        key: &LoadKey,
        error: Error,
        free: Free,
    ) -> Vec<LoadEffect> {
        let mut effects = Vec::new();
        let Some(load) = self.remove(key) else { return effects };
        if free == Free::Now {
            effects.extend(load.free_hold(key, self.rank));
        }
        self.fail_removed(now, key, error, &mut effects);
        effects
    }

    /// As [`fail`](Self::fail), for a READ whose peer's handshake failed: its release is handed
    /// back rather than sent (the peer can be reached, if at all, only through its refused
    /// payload).
    pub(in crate::worker) fn handshake_failed(
        &mut self,
        now: Instant,
        key: &LoadKey,
        error: Error,
    ) -> HandshakeFailed {
        let mut failed = HandshakeFailed::default();
        let Some(load) = self.remove(key) else { return failed };
        failed.release = load.free_at_once(self.rank);
        self.fail_removed(now, key, error, &mut failed.effects);
        failed
    }

    /// Takes READ `key` out of the maps.
    fn remove(&mut self, key: &LoadKey) -> Option<Load> {
        let load = self.reads.remove(key)?;
        if let Stage::Reading { xfer, .. } = &load.stage {
            self.in_flight.remove(xfer);
        }
        Some(load)
    }

    /// The rest of [`fail`](Self::fail), once READ `key` is out of the maps.
    fn fail_removed(&mut self, now: Instant, key: &LoadKey, error: Error, effects: &mut Vec<LoadEffect>) {
        let first = match self.requests.get_mut(&key.request_id) {
            Some(p) if p.error.is_none() => {
                p.error = Some(error);
                true
            }
            _ => false,
        };
        if first {
            self.end_siblings(now, &key.request_id, effects);
        }
        self.part_ended(now, key, effects);
    }

    /// After a READ of request `id` failed first: its other READs that wait for a handshake or a
    /// confirmation end now (the request is not reported before the failed READ's own end).
    fn end_siblings(&mut self, now: Instant, id: &RequestId, effects: &mut Vec<LoadEffect>) {
        let Some(p) = self.requests.get(id) else { return };
        let siblings: Vec<LoadKey> = p
            .ranks
            .iter()
            .map(|&r| LoadKey::new(id.clone(), r))
            .filter(|k| {
                self.reads
                    .get(k)
                    .is_some_and(|l| matches!(l.stage, Stage::Waiting { .. } | Stage::Confirming(_)))
            })
            .collect();
        for key in siblings {
            let Some(load) = self.remove(&key) else { continue };
            if let Stage::Waiting { .. } = load.stage {
                effects.extend(load.free_hold(&key, self.rank));
            }
            self.part_ended(now, &key, effects);
        }
    }

    /// READ `key`'s hold was confirmed: it is done.
    fn confirmed(&mut self, now: Instant, key: &LoadKey, stats: &mut WorkerStats) -> Vec<LoadEffect> {
        let mut effects = Vec::new();
        let Some(load) = self.remove(key) else { return effects };
        if let Stage::Confirming(Read { posted, done, bytes, descriptors, .. }) = load.stage {
            let took = now.saturating_duration_since(posted);
            debug!(request_id = %key.request_id, rank = key.rank, ?took, bytes, "READ done and confirmed");
            stats.bytes_read += bytes;
            stats.transfer_latencies.push(took);
            if self.transfers.len() == TRANSFERS_KEPT {
                self.transfers.pop_front();
            }
            let duration = done.unwrap_or(now).saturating_duration_since(posted);
            self.transfers.push_back(TransferRecord { duration, bytes, descriptors });
        }
        self.part_ended(now, key, &mut effects);
        if let Some(LoadEffect::Loaded(_)) = effects.last() {
            self.count_loaded(stats);
        }
        effects
    }

    /// Counts a request's READ ended; reports the request when it was the last.
    fn part_ended(&mut self, now: Instant, key: &LoadKey, effects: &mut Vec<LoadEffect>) {
        let Some(p) = self.requests.get_mut(&key.request_id) else { return };
        p.ranks.retain(|&r| r != key.rank);
        if !p.ranks.is_empty() {
            return;
        }
        let Some(p) = self.requests.remove(&key.request_id) else { return };
        if let Some(nonce) = p.nonce {
            self.offers.remove(&nonce);
        }
        let request_id = key.request_id.clone();
        if let Some(error) = p.error {
            effects.push(LoadEffect::Failed { request_id, error });
            return;
        }
        let posted = p.posted.unwrap_or(now);
        let read_done = p.read_done.unwrap_or(now);
        if self.times.len() == LOAD_TIMES_KEPT {
            self.times.pop_front();
        }
        let admitted = p.admitted;
        self.times.push_back(LoadTimes {
            request_id: request_id.clone(),
            admitted,
            posted,
            read_done,
            confirmed: now,
        });
        effects.push(LoadEffect::Loaded(request_id));
    }

    /// Adds the stage waits of the load just reported loaded (the newest of `times`).
    fn count_loaded(&self, stats: &mut WorkerStats) {
        if let Some(t) = self.times.back() {
            stats.post_waits.push(t.posted.saturating_duration_since(t.admitted));
            stats.confirm_waits.push(t.confirmed.saturating_duration_since(t.read_done));
        }
    }

    /// The READ of transfer `xfer`, which the agent reported ended (`None`: not a READ of a load,
    /// or one that ended already).
    pub(in crate::worker) fn take_completed(&mut self, xfer: XferId) -> Option<LoadKey> {
        self.in_flight.remove(&xfer)
    }

    /// READ `key`'s transfer ended (taken by [`take_completed`](Self::take_completed)): a done
    /// READ waits for its confirmation; a failed one fails its load and drops the peer (it may
    /// have restarted), or, the first time, is posted again after a new handshake.
    pub(in crate::worker) fn read_ended(
        &mut self,
        now: Instant,
        key: &LoadKey,
        outcome: Result<()>,
        stats: &mut WorkerStats,
    ) -> Vec<LoadEffect> {
        let Some(load) = self.reads.get_mut(key) else { return Vec::new() };
        let Stage::Reading { xfer, read, answer } = &load.stage else { return Vec::new() };
        let mut effects = vec![LoadEffect::ReleaseTransfer(*xfer)];
        let (mut read, answer) = (read.clone(), *answer);
        let peer = load.peer(key);
        let failed = self.requests.get(&key.request_id).and_then(|p| p.error.clone());
        match outcome {
            Ok(()) => {
                stats.read_latencies.push(now.saturating_duration_since(read.posted));
                if let Some(p) = self.requests.get_mut(&key.request_id) {
                    p.read_done = Some(now);
                }
                read.done = Some(now);
                read.deadline = now + self.confirm_timeout;
                self.deadlines.push(read.deadline, key.clone());
                load.stage = Stage::Confirming(read);
                if let Some(e) = failed {
                    // Another READ of the request failed: no confirmation is waited for.
                    effects.extend(self.fail(now, key, e, Free::No));
                } else if let Some(held) = answer {
                    effects.extend(self.confirm(now, key, held, stats));
                }
            }
            Err(e) if load.retried || failed.is_some() => {
                stats.reads_failed += 1;
                effects.push(LoadEffect::DropPeer { peer, agent: Some(read.peer) });
                effects.extend(self.fail(now, key, e, Free::Now));
            }
            Err(e) => {
                // The engine may have restarted: handshake again, and post again only if it has
                // (see `Stage::Waiting`). The READ's notification was not sent.
                debug!(request_id = %key.request_id, error = %e, "READ failed: handshaking with the engine again");
                stats.reads_failed += 1;
                load.retried = true;
                load.stage = Stage::Waiting { retry: Some(Retry { error: e, instance: read.instance }) };
                let remote = load.req.remote.clone();
                effects.push(LoadEffect::DropPeer { peer, agent: Some(read.peer) });
                effects.push(LoadEffect::AwaitPeer { key: key.clone(), remote, free: Free::No });
            }
        }
        effects
    }

    /// A prefill rank's answer for one of this worker's READs: confirms (or fails) the READ whose
    /// release carried its token, now or, if that READ is not seen done yet, once it is.
    pub(in crate::worker) fn answer(
        &mut self,
        now: Instant,
        from: &AgentName,
        status: &HoldStatus,
        stats: &mut WorkerStats,
    ) -> Vec<LoadEffect> {
        let Some(id) = self.offers.get(&status.nonce) else {
            stats.stray_notifications += 1;
            return Vec::new();
        };
        // Only the answer to the release a READ carried (its token) confirms that READ.
        let key = self.requests.get(id).and_then(|p| {
            p.ranks
                .iter()
                .map(|&r| LoadKey::new(id.clone(), r))
                .find(|k| self.reads.get(k).is_some_and(|l| l.answered_by(from, &status.token)))
        });
        let Some((key, load)) = key.and_then(|k| self.reads.get_mut(&k).map(|l| (k, l))) else {
            stats.stray_notifications += 1;
            return Vec::new();
        };
        if load.req.prefill_request_id() != &status.request_id {
            stats.stray_notifications += 1;
            return Vec::new();
        }
        match &mut load.stage {
            Stage::Reading { answer, .. } => {
                *answer = Some(status.held);
                Vec::new()
            }
            _ => self.confirm(now, &key, status.held, stats),
        }
    }

    fn confirm(
        &mut self,
        now: Instant,
        key: &LoadKey,
        held: bool,
        stats: &mut WorkerStats,
    ) -> Vec<LoadEffect> {
        if held {
            return self.confirmed(now, key, stats);
        }
        stats.lease_failures += 1;
        let e = Error::new(
            ErrorKind::Expired,
            "the prefill engine's hold ended before the READ's release reached it: the blocks read may have been reused",
        );
        self.fail(now, key, e, Free::No)
    }

    /// Rank `peer` of an engine restarted (it was at instance `old`): it answers nothing for its
    /// earlier instance, so the READs waiting for that instance's confirmation fail now.
    pub(in crate::worker) fn peer_restarted(
        &mut self,
        now: Instant,
        peer: &PeerKey,
        old: u64,
        stats: &mut WorkerStats,
    ) -> Vec<LoadEffect> {
        let stale: Vec<LoadKey> = self
            .reads
            .iter()
            .filter(|(k, l)| k.rank == peer.1 && l.req.remote.engine_id == peer.0)
            .filter(|(_, l)| matches!(&l.stage, Stage::Confirming(read) if read.instance == old))
            .map(|(k, _)| k.clone())
            .collect();
        let mut effects = Vec::new();
        for key in stale {
            stats.lease_failures += 1;
            let e = Error::new(
                ErrorKind::Expired,
                format!("engine {} restarted before it confirmed the hold", peer.0),
            );
            effects.extend(self.fail(now, &key, e, Free::No));
        }
        effects
    }

    /// The READs whose deadline entries came due by `now`, each once, in key order. Each is then
    /// checked with [`overdue`](Self::overdue): an entry whose READ ended or whose deadline moved
    /// on is stale. O(what is due), not O(loads).
    pub(in crate::worker) fn take_due(&mut self, now: Instant) -> Vec<LoadKey> {
        self.deadlines.take_due(now)
    }

    /// READ `key` if it is past its deadline: a READ (whose transfer the caller cancels before
    /// [`time_out`](Self::time_out), or if it cannot yet, [`recheck`](Self::recheck)s), or a
    /// confirmation.
    pub(in crate::worker) fn overdue(&self, now: Instant, key: &LoadKey) -> Option<Overdue> {
        let load = self.reads.get(key).filter(|l| l.deadline().is_some_and(|d| d <= now))?;
        let (agent, transfer) = match &load.stage {
            Stage::Reading { xfer, read, .. } => (read.peer.clone(), Some(*xfer)),
            Stage::Confirming(read) => (read.peer.clone(), None),
            Stage::Waiting { .. } => return None,
        };
        Some(Overdue { peer: load.peer(key), agent, transfer })
    }

    /// An overdue READ whose transfer cannot be cancelled yet keeps its blocks: looked at again
    /// at the next step.
    pub(in crate::worker) fn recheck(&mut self, now: Instant, key: LoadKey) {
        self.deadlines.push(now, key);
    }

    /// Fails an [`overdue`](Self::overdue) READ (its transfer cancelled) or confirmation, and
    /// tells its prefill rank to free: a hold that a confirmation's release never reached is
    /// freed now, not at the end of its lease.
    pub(in crate::worker) fn time_out(
        &mut self,
        now: Instant,
        key: &LoadKey,
        stats: &mut WorkerStats,
    ) -> Vec<LoadEffect> {
        let Some(load) = self.reads.get(key) else { return Vec::new() };
        let e = match &load.stage {
            Stage::Reading { .. } => {
                stats.reads_failed += 1;
                Error::new(ErrorKind::Timeout, format!("the READ took over {:?}", self.transfer_timeout))
            }
            Stage::Confirming(_) => {
                stats.lease_failures += 1;
                let e = "no answer from the prefill engine whether its hold lived through the READ";
                Error::new(ErrorKind::Timeout, e)
            }
            Stage::Waiting { .. } => return Vec::new(),
        };
        self.fail(now, key, e, Free::Now)
    }

    /// At close: ends every READ and every request. A READ not completed leaves a release for
    /// its prefill rank; one in flight, its transfer.
    pub(in crate::worker) fn close(&mut self, stats: &mut WorkerStats) -> Closed {
        let mut reads: Vec<(LoadKey, Load)> = self.reads.drain().collect();
        self.deadlines.clear();
        reads.sort_by(|a, b| a.0.cmp(&b.0));
        self.offers.clear();
        self.in_flight.clear();
        let mut closed = Closed::default();
        for (key, load) in reads {
            match load.stage {
                Stage::Reading { xfer, .. } => {
                    stats.reads_failed += 1;
                    closed.transfers.push(xfer);
                }
                Stage::Waiting { .. } => {}
                // Its release went with its READ.
                Stage::Confirming(_) => continue,
            }
            if let Some(release) = load.free_at_once(self.rank) {
                closed.releases.push(PeerRelease { peer: load.peer(&key), release });
            }
        }
        closed.failed = self.requests.drain().map(|(id, _)| id).collect();
        closed.failed.sort();
        closed
    }
}
