//! The session's two ranks, their steps checked against the model, and the final checks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::testing::Recording;
use kvx_core::{
    AgentName, ConnectorMetadata, ConnectorWorker, Finished, HostMemory, RecvRequest, RequestId,
    TransferAgent, WorkerCommand, WorkerConfig, WorkerStats,
};
use kvx_loopback::{Fabric, LoopbackAgent};
use kvx_testkit::chaos::{Chaos, ChaosNet, Faults};

use super::model::{Kind, Model, kind};
use crate::input::ByteSource;
use crate::targets::fixture::{
    BLOCK_LEN, DECODE, DECODE_BLOCKS, Holds, Lease, PREFILL, PREFILL_BLOCKS, caches, check_bytes,
    check_session, config, decode_config, fill_pattern, must, nonce_of, other_nonce, recv, unreachable_peer,
};

/// The session's loads: two plain ones and one whose prefill request id differs from its own.
fn lease_loads() -> Vec<RecvRequest> {
    let mut c = recv("c", vec![4], vec![15]);
    c.remote_request_id = Some("cmpl-p-c".into());
    c.nonce = Some(nonce_of("cmpl-p-c"));
    vec![recv("a", vec![0, 1], vec![10, 11]), recv("b", vec![2, 3], vec![12, 13, 14]), c]
}

/// One rank: its worker over a recording agent, the agent itself, and region 0 of its first
/// layer.
pub(super) struct Rank {
    pub(super) worker: ConnectorWorker,
    recorder: Arc<Recording<Chaos<LoopbackAgent>>>,
    agent: Arc<Chaos<LoopbackAgent>>,
    keys: Arc<HostMemory>,
    pub(super) payload: Vec<u8>,
}

impl Rank {
    fn new(fabric: &Fabric, chaos: &ChaosNet, name: &str, config: WorkerConfig, blocks: u32) -> Self {
        let agent = Arc::new(Chaos::new(Arc::new(must(fabric.agent(name), "an agent")), chaos));
        let recorder = Arc::new(Recording::new(agent.clone()));
        let mut worker = must(ConnectorWorker::new(config, recorder.clone()), "a worker");
        let (layers, keys) = caches(blocks);
        let payload = must(worker.register_kv_caches(&layers), "registering caches");
        Rank { worker, recorder, agent, keys, payload }
    }
}

/// A message on its way: to the prefill rank or the decode rank, from the third agent or the
/// other rank's own agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum To {
    Prefill,
    Decode,
}

pub(super) struct Session {
    pub(super) now: Instant,
    pub(super) prefill: Rank,
    pub(super) decode: Rank,
    mallory: LoopbackAgent,
    /// The names under which mallory (and each rank's agent) reach the ranks.
    prefill_name: AgentName,
    decode_name: AgentName,
    pub(super) loads: Vec<RecvRequest>,
    holds: Holds,
    pub(super) model: Model,
    decode_done: Finished,
    /// Handshakes the prefill rank asked for.
    prefill_fetches: u64,
    /// Of the notifications the decode rank drained: how many it must count stray (once no
    /// longer buffered), and how many more it may.
    decode_strays: u64,
    decode_maybe_strays: u64,
}

impl Session {
    pub(super) fn start(src: &mut ByteSource<'_>) -> Self {
        let (rank, world) = [(0, 1), (1, 2)][src.below(2)];
        let delay = [0, 1, 3, 16][src.below(4)];
        let leases: Vec<Lease> = (0..3)
            .map(|_| [Lease::Held, Lease::Expired, Lease::OtherNonce, Lease::Missing][src.below(4)])
            .collect();
        let small = |c: WorkerConfig| WorkerConfig {
            rank,
            world_size: world,
            early_releases_per_sender: 8,
            max_early_senders: 2,
            ..c
        };
        let (fabric, chaos) = (Fabric::new(), ChaosNet::new());
        let mut prefill = Rank::new(&fabric, &chaos, "prefill-agent", small(config(PREFILL)), PREFILL_BLOCKS);
        let decode = Rank::new(&fabric, &chaos, "decode-agent", small(decode_config()), DECODE_BLOCKS);
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
        let mut model = Model::new(prefill.worker.config().lease_duration, prefill.worker.instance());
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
    pub(super) fn answer_decode_fetches(&mut self) {
        while let Some(WorkerCommand::FetchHandshake(kvx_core::PeerLocator { engine_id, rank, .. })) =
            self.decode.worker.poll_command()
        {
            let result = if engine_id.as_str() == PREFILL {
                Ok(self.prefill.payload.clone())
            } else {
                Err(unreachable_peer(&engine_id))
            };
            self.decode.worker.handle_handshake(self.now, &engine_id, rank, result);
        }
    }

    /// One step of the prefill rank, checked against the model.
    fn prefill_step(&mut self) {
        let sent = self.prefill.worker.get_finished(self.now);
        let drained = self.prefill.recorder.take_notifications();
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
        for WorkerCommand::FetchHandshake(kvx_core::PeerLocator { engine_id, rank, .. }) in fetches {
            let result = if engine_id.as_str() == DECODE {
                Ok(self.decode.payload.clone())
            } else {
                Err(unreachable_peer(&engine_id))
            };
            self.prefill.worker.handle_handshake(self.now, &engine_id, rank, result);
        }
        // What is neither counted nor buffered is lost; what is buffered is bounded.
        let p = self.prefill.worker.stats();
        let counted = p.notifications + p.stray_notifications + p.rejected_notifications;
        let buffered = self.model.releases_and_others.checked_sub(counted);
        let cap = early_cap(self.prefill.worker.config());
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
        for n in self.decode.recorder.take_notifications() {
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
        let cap = early_cap(self.decode.worker.config());
        assert!(
            counted <= self.decode_strays + self.decode_maybe_strays && counted + cap >= self.decode_strays,
            "the decode rank counted {counted} stray, of {} to {} (and {cap} may wait): {d:?}",
            self.decode_strays,
            self.decode_strays + self.decode_maybe_strays
        );
        self.answer_decode_fetches();
    }

    pub(super) fn both_step(&mut self) {
        self.decode_step();
        self.prefill_step();
    }

    pub(super) fn send(&mut self, to: To, from_peer: bool, msg: &[u8]) {
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

    /// Lets everything in flight finish, then times everything out, and checks the session.
    pub(super) fn finish(mut self) -> Finished {
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
        // Answers to releases of live or ended holds, exactly; those sent at once to releases
        // of holds it was never handed (or forgot), at most one for each such release.
        let late = p.hold_answers.checked_sub(p.early_answers);
        let got = (p.notifications, p.expired_holds, p.leases_renewed, p.rejected_notifications, late);
        let want = (m.released, m.expired, m.renewed, m.rejected, Some(m.answers));
        assert_eq!(
            got, want,
            "prefill counters (released, expired, renewed, rejected, answers) {got:?}, expected {want:?}: {p:?}"
        );
        assert!(
            p.early_answers <= m.early_candidates,
            "{} early answers for {} releases that may have one: {p:?}",
            p.early_answers,
            m.early_candidates
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
                let n: usize = r.local_block_ids.iter().map(|g| g.ids.len()).sum();
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

/// The most releases a worker keeps before their holds come.
fn early_cap(config: &WorkerConfig) -> u64 {
    (config.early_releases_per_sender * config.max_early_senders) as u64
}
