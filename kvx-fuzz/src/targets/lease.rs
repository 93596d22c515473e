//! Hostile notifications of every kind to a prefill and a decode rank in the middle of a session
//! of leased holds: releases with hostile `reply_to`, heartbeats naming anything, answers for
//! loads that are not theirs, garbage, and time passing between them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::wire::{self, MessageKind};
use kvx_core::worker::{MAX_HOST_LEN, MAX_ID_LEN};
use kvx_core::{
    AgentName, ConnectorMetadata, ConnectorWorker, Finished, Heartbeat, HeldRequest, HoldRelease, HoldStatus,
    HostMemory, Nonce, Notification, RecvRequest, RemoteCoordinates, RenewLeases, ReplyTo, RequestId,
    TransferAgent, WorkerCommand, WorkerConfig, WorkerStats,
};
use kvx_loopback::{Fabric, Faults, LoopbackAgent};

use super::fixture::{
    BLOCK_LEN, DECODE, DECODE_BLOCKS, Holds, Lease, NONCE, PREFILL, PREFILL_BLOCKS, Recorder, caches,
    check_bytes, check_session, config, decode_config, decode_side_channel, fill_pattern, must, nonce_of,
    other_nonce, prefill_coordinates, recv, unreachable_peer,
};
use crate::input::ByteSource;
use crate::seeds::Seed;

/// At most this many events per run.
const MAX_EVENTS: usize = 48;

/// The session's loads: two plain ones and one whose prefill request id differs from its own.
fn lease_loads() -> Vec<RecvRequest> {
    let mut c = recv("c", vec![4], vec![15]);
    c.remote_request_id = Some("cmpl-p-c".into());
    c.nonce = Some(nonce_of("cmpl-p-c"));
    vec![recv("a", vec![0, 1], vec![10, 11]), recv("b", vec![2, 3], vec![12, 13, 14]), c]
}

/// A prefill and a decode rank (both fresh, rank 0 of 1 or rank 1 of 2, buffers of 8) mid-session:
/// the prefill rank holds three offers (each held, expired, held under another nonce or never
/// held, as the bytes pick), the decode rank loads them (its READs may stay in flight for a few
/// progress passes). Then the bytes pick up to 48 events: time passing (up to past a lease, a
/// confirmation timeout) with both ranks stepping, heartbeats from the decode scheduler, and
/// notifications from a third agent on the fabric (or from the peers themselves): releases (of
/// any hold, any nonce, with `reply_to` naming the decode engine, another instance of it, the
/// prefill engine itself, a huge host, the last port, an unreachable engine), heartbeats
/// (thousands of holds, wrong nonces), hold answers (unknown nonces, other requests, either
/// way), garbage, messages of other kinds and versions, each to either rank.
///
/// Checks: no panic; the prefill rank frees exactly what a model of its leases frees (a release
/// or heartbeat counts only with its hold's nonce), at each step; a load is done only if the
/// prefill engine held its offer, and then its blocks hold the prefill's bytes as held (whatever
/// answers a third agent or the prefill agent itself sent); every load is reported once, every
/// hold freed once;
/// both ranks end idle; the counters agree with what was sent (notifications, expired holds,
/// renewals, rejected releases and answers exactly; stray notifications within bounds), and
/// the prefill rank handshakes only to send an answer; at every step neither rank keeps more
/// unanswered releases than its buffer holds.
pub fn worker_lease_notifications(data: &[u8]) {
    lease_session(data);
}

/// What a notification is, as a worker routes it.
#[derive(Debug)]
enum Kind {
    Release(HoldRelease),
    Renew(RenewLeases),
    Status(HoldStatus),
    Other,
}

fn kind(msg: &[u8]) -> Kind {
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
struct Model {
    lease: Duration,
    live: HashMap<RequestId, (Nonce, Instant)>,
    /// Holds that ended (released or expired), until they are forgotten, and whether a release
    /// asking for an answer came since (an ended hold is answered once).
    ended: HashMap<(RequestId, Nonce), (Instant, bool)>,
    /// What the prefill rank must have counted.
    released: u64,
    expired: u64,
    renewed: u64,
    rejected: u64,
    answers: u64,
    /// Notifications it drained: releases and others (heartbeats aside).
    releases_and_others: u64,
}

impl Model {
    /// One `get_finished(now)` of the prefill rank, which drained `drained`: what it must free.
    fn step(&mut self, now: Instant, drained: &[Notification]) -> Vec<RequestId> {
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
                    if answer {
                        self.answers += u64::from(r.reply_to.as_ref().is_some_and(|to| {
                            to.engine.check().is_ok() && to.engine.engine_id.as_str() != PREFILL
                        }));
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

/// One rank: its worker over a recording agent, the agent itself, and region 0 of its first
/// layer.
struct Rank {
    worker: ConnectorWorker,
    recorder: Arc<Recorder>,
    agent: Arc<LoopbackAgent>,
    keys: Arc<HostMemory>,
    payload: Vec<u8>,
}

impl Rank {
    fn new(fabric: &Fabric, name: &str, config: WorkerConfig, blocks: u32) -> Self {
        let agent = Arc::new(must(fabric.agent(name), "an agent"));
        let recorder = Arc::new(Recorder::new(agent.clone()));
        let mut worker = must(ConnectorWorker::new(config, recorder.clone()), "a worker");
        let (layers, keys) = caches(blocks);
        let payload = must(worker.register_kv_caches(&layers), "registering caches");
        Rank { worker, recorder, agent, keys, payload }
    }
}

/// A message on its way: to the prefill rank or the decode rank, from the third agent or the
/// other rank's own agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum To {
    Prefill,
    Decode,
}

struct Session {
    now: Instant,
    prefill: Rank,
    decode: Rank,
    mallory: LoopbackAgent,
    /// The names under which mallory (and each rank's agent) reach the ranks.
    prefill_name: AgentName,
    decode_name: AgentName,
    loads: Vec<RecvRequest>,
    holds: Holds,
    model: Model,
    decode_done: Finished,
    /// Handshakes the prefill rank asked for.
    prefill_fetches: u64,
    /// Of the notifications the decode rank drained: how many it must count stray (once no
    /// longer buffered), and how many more it may.
    decode_strays: u64,
    decode_maybe_strays: u64,
}

impl Session {
    fn start(src: &mut ByteSource<'_>) -> Self {
        let (rank, world) = [(0, 1), (1, 2)][src.below(2)];
        let delay = [0, 1, 3, 16][src.below(4)];
        let leases: Vec<Lease> = (0..3)
            .map(|_| [Lease::Held, Lease::Expired, Lease::OtherNonce, Lease::Missing][src.below(4)])
            .collect();
        let small = |c: WorkerConfig| WorkerConfig { rank, world_size: world, max_early_releases: 8, ..c };
        let fabric = Fabric::new();
        let mut prefill = Rank::new(&fabric, "prefill-agent", small(config(PREFILL)), PREFILL_BLOCKS);
        let decode = Rank::new(&fabric, "decode-agent", small(decode_config()), DECODE_BLOCKS);
        must(decode.agent.set_faults(Faults::none().delay_completion(delay)), "delaying the READs");
        let mallory = must(fabric.agent("mallory"), "a third agent");
        let prefill_name =
            must(mallory.load_remote(&must(prefill.agent.local_metadata(), "metadata")), "loading");
        let decode_name =
            must(mallory.load_remote(&must(decode.agent.local_metadata(), "metadata")), "loading");
        fill_pattern(&prefill.keys, PREFILL_BLOCKS);

        let now = Instant::now() + Duration::from_secs(3600);
        let loads = lease_loads();
        let refs: Vec<&RecvRequest> = loads.iter().collect();
        let holds = Holds::start_reused(&mut prefill.worker, &refs, &leases, now, &prefill.keys);
        let mut model = Model { lease: prefill.worker.config().lease_duration, ..Model::default() };
        for (r, lease) in loads.iter().zip(&leases) {
            let (Some(nonce), id) = (r.nonce, r.prefill_request_id().clone()) else { continue };
            let lease_time = model.lease;
            match lease {
                Lease::Held => model.live.insert(id, (nonce, now + lease_time)),
                Lease::Expired => model.live.insert(id, (nonce, now - Duration::from_secs(1))),
                Lease::OtherNonce => model.live.insert(id, (other_nonce(&nonce), now + lease_time)),
                Lease::Missing => None,
            };
        }
        let mut s = Session {
            now,
            prefill,
            decode,
            mallory,
            prefill_name,
            decode_name,
            loads,
            holds,
            model,
            decode_done: Finished::default(),
            prefill_fetches: 0,
            decode_strays: 0,
            decode_maybe_strays: 0,
        };
        s.prefill_step();
        let meta = ConnectorMetadata { reqs_to_recv: s.loads.clone(), ..Default::default() };
        s.decode.worker.start_load_kv(now, &meta);
        s.answer_decode_fetches();
        s
    }

    /// The decode rank's handshakes: the prefill engine's payload; any other engine is
    /// unreachable.
    fn answer_decode_fetches(&mut self) {
        while let Some(WorkerCommand::FetchHandshake { engine_id, .. }) = self.decode.worker.poll_command() {
            let result = if engine_id.as_str() == PREFILL {
                Ok(self.prefill.payload.clone())
            } else {
                Err(unreachable_peer(&engine_id))
            };
            self.decode.worker.handle_handshake(self.now, &engine_id, result);
        }
    }

    /// One step of the prefill rank, checked against the model.
    fn prefill_step(&mut self) {
        let sent = self.prefill.worker.get_finished(self.now);
        let drained = self.prefill.recorder.take();
        let mut expected = self.model.step(self.now, &drained);
        let mut got = sent.sending.clone();
        expected.sort();
        got.sort();
        assert_eq!(
            got, expected,
            "the prefill rank freed {got:?} where its leases free {expected:?}, after {drained:?}"
        );
        assert!(
            sent.recving.is_empty() && sent.failed_recving.is_empty(),
            "the prefill rank loaded: {sent:?}"
        );
        self.holds.freed(sent.sending, &self.prefill.keys);
        let mut fetches = Vec::new();
        while let Some(command) = self.prefill.worker.poll_command() {
            fetches.push(command);
        }
        self.prefill_fetches += fetches.len() as u64;
        for WorkerCommand::FetchHandshake { engine_id, .. } in fetches {
            let result = if engine_id.as_str() == DECODE {
                Ok(self.decode.payload.clone())
            } else {
                Err(unreachable_peer(&engine_id))
            };
            self.prefill.worker.handle_handshake(self.now, &engine_id, result);
        }
        // What is neither counted nor buffered is lost; what is buffered is bounded.
        let p = self.prefill.worker.stats();
        let counted = p.notifications + p.stray_notifications + p.rejected_notifications;
        let buffered = self.model.releases_and_others.checked_sub(counted);
        let cap = self.prefill.worker.config().max_early_releases as u64;
        assert!(
            buffered.is_some_and(|b| b <= cap),
            "the prefill rank counted {counted} of {} releases and other notifications, {cap} may wait: {p:?}",
            self.model.releases_and_others
        );
    }

    fn decode_step(&mut self) {
        let finished = self.decode.worker.get_finished(self.now);
        assert!(finished.sending.is_empty(), "the decode rank released holds it never had: {finished:?}");
        self.decode_done.extend(finished);
        // Releases and other messages are stray (a release once out of the buffer); answers are,
        // unless they come from the READ's peer and name one of its loads (request and nonce).
        for n in self.decode.recorder.take() {
            match kind(&n.msg) {
                Kind::Release(_) | Kind::Other => self.decode_strays += 1,
                Kind::Status(s)
                    if n.from == *self.prefill.agent.name()
                        && self
                            .loads
                            .iter()
                            .any(|r| r.nonce == Some(s.nonce) && r.prefill_request_id() == &s.request_id) =>
                {
                    self.decode_maybe_strays += 1
                }
                Kind::Status(_) => self.decode_strays += 1,
                Kind::Renew(_) => {}
            }
        }
        let d = self.decode.worker.stats();
        let counted = d.stray_notifications + d.rejected_notifications;
        let cap = self.decode.worker.config().max_early_releases as u64;
        assert!(
            counted <= self.decode_strays + self.decode_maybe_strays && counted + cap >= self.decode_strays,
            "the decode rank counted {counted} stray, of {} to {} (and {cap} may wait): {d:?}",
            self.decode_strays,
            self.decode_strays + self.decode_maybe_strays
        );
        self.answer_decode_fetches();
    }

    fn both_step(&mut self) {
        self.decode_step();
        self.prefill_step();
    }

    fn send(&mut self, to: To, from_peer: bool, msg: &[u8]) {
        let sent = match (to, from_peer) {
            (To::Prefill, false) => self.mallory.notify(&self.prefill_name, msg),
            (To::Decode, false) => self.mallory.notify(&self.decode_name, msg),
            // The ranks' own agents reach each other once their workers loaded the peer.
            (To::Prefill, true) => self.decode.agent.notify(self.prefill.agent.name(), msg),
            (To::Decode, true) => self.prefill.agent.notify(self.decode.agent.name(), msg),
        };
        // Not loaded yet: nothing sent.
        let _ = sent;
    }

    /// A request id the bytes pick: one of the loads' (as the prefill engine names it), an
    /// unknown one, an empty one or one over kvx's limit.
    fn pick_id(&self, src: &mut ByteSource<'_>) -> (RequestId, Option<usize>) {
        match src.below(6) {
            i @ 0..3 => (self.loads[i].prefill_request_id().clone(), Some(i)),
            3 => ("cmpl-unknown".into(), None),
            4 => ("".into(), None),
            _ => ("x".repeat(MAX_ID_LEN + 1).into(), None),
        }
    }

    /// A nonce for `load`: its own, another, a shared or an arbitrary one.
    fn pick_nonce(&self, src: &mut ByteSource<'_>, load: Option<usize>) -> Nonce {
        let own = load.and_then(|i| self.loads[i].nonce).unwrap_or(NONCE);
        match src.below(4) {
            0 => own,
            1 => other_nonce(&own),
            2 => NONCE,
            _ => kvx_core::HexBytes([src.u8(); 16]),
        }
    }

    fn pick_reply_to(&self, src: &mut ByteSource<'_>) -> Option<ReplyTo> {
        let instance = self.decode.worker.instance();
        let decode = decode_side_channel();
        let (engine, instance) = match src.below(9) {
            0 => return None,
            1 => (decode, instance),
            2 => (decode, instance ^ 1),
            3 => (prefill_coordinates(), instance),
            4 => (RemoteCoordinates { host: "h".repeat(MAX_HOST_LEN + 1), ..decode }, instance),
            5 => (RemoteCoordinates { host: "h".repeat(MAX_HOST_LEN), ..decode }, instance),
            6 => (RemoteCoordinates { port: u16::MAX, ..decode }, instance),
            7 => (RemoteCoordinates { engine_id: "elsewhere".into(), ..decode }, instance),
            _ => (RemoteCoordinates { engine_id: "e".repeat(MAX_ID_LEN + 1).into(), ..decode }, src.u64()),
        };
        Some(ReplyTo { engine, instance, token: kvx_core::HexBytes([src.u8(); 16]) })
    }

    fn event(&mut self, src: &mut ByteSource<'_>) {
        match src.below(8) {
            0 => {
                let lease = self.model.lease;
                let confirm = self.decode.worker.config().confirm_timeout;
                let dt = [
                    Duration::ZERO,
                    Duration::from_secs(1),
                    lease / 2,
                    lease + Duration::from_secs(1),
                    confirm,
                ][src.below(5)];
                self.now += dt;
                self.both_step();
            }
            1 => {
                let (request_id, load) = self.pick_id(src);
                let nonce = self.pick_nonce(src, load);
                // Released by someone who knows the offer, asking for the answer at the decode
                // engine: the answer carries this release's token, not the READ's.
                let reply_to = self.pick_reply_to(src);
                let msg = must(wire::encode(&HoldRelease { request_id, nonce, reply_to }), "encoding");
                let from_peer = src.below(4) == 3;
                self.send(To::Prefill, from_peer, &msg);
            }
            2 => {
                let count = [1, 3, 128, 2000][src.below(4)];
                let mut holds = Vec::with_capacity(count);
                for _ in 0..count.min(4) {
                    let (request_id, load) = self.pick_id(src);
                    let nonce = self.pick_nonce(src, load);
                    holds.push(HeldRequest { request_id, nonce });
                }
                while holds.len() < count {
                    let k = holds.len();
                    holds.push(HeldRequest { request_id: format!("r-{k}").into(), nonce: NONCE });
                }
                let msg = must(wire::encode(&RenewLeases { holds }), "encoding");
                self.send(To::Prefill, src.below(4) == 3, &msg);
            }
            3 => {
                let (request_id, load) = self.pick_id(src);
                let nonce = self.pick_nonce(src, load);
                let held = src.below(2) == 0;
                let from_peer = src.below(2) == 1;
                // Even from the peer's agent, an answer without the READ's token confirms nothing.
                let msg = must(
                    wire::encode(&HoldStatus {
                        request_id,
                        nonce,
                        held,
                        token: kvx_core::HexBytes([src.u8(); 16]),
                    }),
                    "encoding",
                );
                self.send(To::Decode, from_peer, &msg);
            }
            4 => {
                let to = if src.below(2) == 0 { To::Prefill } else { To::Decode };
                let msg = src.bytes(64).to_vec();
                self.send(to, src.below(2) == 1, &msg);
            }
            5 => {
                // The wrong way: answers to the prefill rank, releases and heartbeats to the decode
                // rank.
                let (request_id, load) = self.pick_id(src);
                let nonce = self.pick_nonce(src, load);
                let (to, msg) = match src.below(3) {
                    0 => (
                        To::Prefill,
                        wire::encode(&HoldStatus {
                            request_id,
                            nonce,
                            held: true,
                            token: kvx_core::HexBytes([src.u8(); 16]),
                        }),
                    ),
                    1 => {
                        let reply_to = self.pick_reply_to(src);
                        (To::Decode, wire::encode(&HoldRelease { request_id, nonce, reply_to }))
                    }
                    _ => (
                        To::Decode,
                        wire::encode(&RenewLeases { holds: vec![HeldRequest { request_id, nonce }] }),
                    ),
                };
                let msg = must(msg, "encoding");
                self.send(to, src.below(2) == 1, &msg);
            }
            6 => {
                // Other kinds and versions: a payload, metadata, a release of another wire version.
                let to = if src.below(2) == 0 { To::Prefill } else { To::Decode };
                let msg = match src.below(3) {
                    0 => self.prefill.payload.clone(),
                    1 => must(wire::encode(&ConnectorMetadata::default()), "encoding"),
                    _ => {
                        let body = rmp_serde::to_vec_named(&HoldStatus {
                            request_id: self.loads[0].prefill_request_id().clone(),
                            nonce: self.loads[0].nonce.unwrap_or(NONCE),
                            held: true,
                            token: NONCE,
                        })
                        .unwrap_or_default();
                        crate::seeds::raw_envelope(
                            b"KVX1",
                            wire::WIRE_VERSION + 1,
                            MessageKind::HoldStatus,
                            &body,
                        )
                    }
                };
                self.send(to, src.below(2) == 1, &msg);
            }
            _ => {
                // The decode scheduler's heartbeat for the loads still waiting.
                let holds = self
                    .loads
                    .iter()
                    .filter_map(|r| {
                        Some(HeldRequest { request_id: r.prefill_request_id().clone(), nonce: r.nonce? })
                    })
                    .collect();
                let remote = match src.below(3) {
                    0 => prefill_coordinates(),
                    1 => RemoteCoordinates { engine_id: "elsewhere".into(), ..prefill_coordinates() },
                    _ => RemoteCoordinates { port: u16::MAX, ..prefill_coordinates() },
                };
                let meta =
                    ConnectorMetadata { heartbeats: vec![Heartbeat { remote, holds }], ..Default::default() };
                self.decode.worker.start_load_kv(self.now, &meta);
                self.answer_decode_fetches();
            }
        }
    }

    /// Lets everything in flight finish, then times everything out, and checks the session.
    fn finish(mut self) -> Finished {
        for _ in 0..4 {
            self.both_step();
        }
        // A decode rank whose load got no answer releases the hold again, after a new
        // handshake: the last jump lets what that release left in the prefill's buffers expire.
        for _ in 0..3 {
            self.now += Duration::from_secs(24 * 3600);
            self.both_step();
            self.both_step();
        }

        let done = std::mem::take(&mut self.decode_done);
        let meta = ConnectorMetadata { reqs_to_recv: self.loads.clone(), ..Default::default() };
        check_session(&meta, &done);
        let honest: Vec<RequestId> = done.recving.to_vec();
        for id in &honest {
            let r = self.loads.iter().find(|r| &r.request_id == id);
            let covered = r.map(|r| self.holds.covers(r));
            assert!(
                matches!(covered, Some(Ok(()))),
                "load {id} reported done although the prefill engine did not hold its offer: {covered:?}"
            );
        }
        let refs: Vec<&RecvRequest> = self.loads.iter().collect();
        check_bytes(&refs, &honest, &self.decode.keys);
        self.holds.check_freed();
        self.check_counters(&done);
        assert!(
            self.decode.worker.is_idle(),
            "the decode worker is not idle: {:?}",
            self.decode.worker.stats()
        );
        assert!(
            self.prefill.worker.is_idle(),
            "the prefill worker is not idle: {:?}",
            self.prefill.worker.stats()
        );
        done
    }

    fn check_counters(&self, done: &Finished) {
        let p: &WorkerStats = self.prefill.worker.stats();
        let m = &self.model;
        let got =
            (p.notifications, p.expired_holds, p.leases_renewed, p.rejected_notifications, p.hold_answers);
        let want = (m.released, m.expired, m.renewed, m.rejected, m.answers);
        assert_eq!(
            got, want,
            "prefill counters (released, expired, renewed, rejected, answers) {got:?}, expected {want:?}: {p:?}"
        );
        assert_eq!(
            p.notifications + p.stray_notifications + p.rejected_notifications,
            m.releases_and_others,
            "every release and every notification that is no heartbeat is counted once: {p:?}"
        );
        assert!(
            self.prefill_fetches <= p.hold_answers,
            "the prefill rank handshook {} times for {} answers",
            self.prefill_fetches,
            p.hold_answers
        );
        let d: &WorkerStats = self.decode.worker.stats();
        assert_eq!(d.failed_loads, done.failed_recving.len() as u64, "{d:?}");
        assert_eq!(d.transfer_latencies.count(), done.recving.len() as u64, "{d:?}");
        let bytes: u64 = done
            .recving
            .iter()
            .filter_map(|id| self.loads.iter().find(|r| &r.request_id == id))
            .map(|r| {
                let n = r.local_block_ids.len();
                (2 * n + 2 * n.min(2)) as u64 * BLOCK_LEN as u64
            })
            .sum();
        assert_eq!(d.bytes_read, bytes, "bytes read by the confirmed loads: {d:?}");
        assert!(d.lease_failures <= d.failed_loads && d.reads_posted <= self.loads.len() as u64, "{d:?}");
        // Every buffered release has expired by now.
        let (strays, maybe) = (self.decode_strays, self.decode_maybe_strays);
        assert!(
            (strays..=strays + maybe).contains(&(d.stray_notifications + d.rejected_notifications)),
            "decode strays {} + rejected {}, expected {strays} to {}: {d:?}",
            d.stray_notifications,
            d.rejected_notifications,
            strays + maybe
        );
        assert_eq!(d.notifications, 0, "the decode rank released holds: {d:?}");
    }
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
