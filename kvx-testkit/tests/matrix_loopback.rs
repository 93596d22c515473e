//! The fault matrix (`kvx_testkit::matrix`) on the loopback backend, TP=2, then the faults only
//! loopback can inject (`kvx_loopback::Faults`) that the lease protocol adds to
//! `e2e_loopback.rs`'s: a lost or doubled release, a lost answer, and an answer path that cannot
//! be reached. Those run in simulated time (`kvx_testkit::sim::SimTime`): the leases and the
//! 10 s confirmation timeouts they wait out cost steps, not wall time.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvx_core::{EngineId, ErrorKind, ManualClock, TransferAgent};
use kvx_loopback::{Fabric, Faults, LoopbackAgent};
use kvx_testkit::matrix::{
    self, Matrix, PROMPT_BLOCKS, assert_clean, assert_failed, assert_finished, run, submit,
};
use kvx_testkit::sim::{Cluster, EngineConfig, InProcessSideChannels, SimBackend, SimTime};

/// A rank's agent, by (engine, rank), without keeping it alive.
type Agents = Arc<Mutex<HashMap<(String, u32), Weak<LoopbackAgent>>>>;

/// Loopback agents on one fabric. Agents are kept by (engine, rank) without keeping them alive, so
/// that a dropped engine's agents really go and a restarted engine can take their names again.
#[derive(Default, Clone)]
struct Loopback {
    fabric: Fabric,
    agents: Agents,
}

impl Loopback {
    fn backend(&self) -> SimBackend {
        let (fabric, agents) = (self.fabric.clone(), self.agents.clone());
        SimBackend::new(move |engine: &EngineId, rank| {
            let agent = Arc::new(fabric.agent(format!("{engine}-{rank}"))?);
            agents.lock().unwrap().insert((engine.to_string(), rank), Arc::downgrade(&agent));
            Ok(agent as Arc<dyn TransferAgent>)
        })
    }

    fn agent(&self, engine: &str, rank: u32) -> Arc<LoopbackAgent> {
        self.agents.lock().unwrap()[&(engine.to_owned(), rank)].upgrade().unwrap()
    }

    fn matrix(&self) -> Matrix {
        Matrix::new(self.backend())
    }
}

kvx_testkit::fault_matrix!(|_case: &str| Some(Loopback::default().matrix()));

/// The matrix at TP=1 and TP=4 too (TP=2 above): one case of each kind.
#[test]
fn other_tensor_parallel_sizes() {
    for tp in [1, 4] {
        let m = Loopback::default().matrix().with_tp(tp);
        matrix::prefill_restart(&m);
        matrix::out_of_range_read(&m);
        matrix::abort_during_read(&m);
        matrix::duplicate_offer(&m);
    }
}

/// Loopback agents on a fabric of a simulated clock, and that clock.
fn simulated() -> (Loopback, ManualClock) {
    let clock = ManualClock::new();
    let lb = Loopback { fabric: Fabric::with_clock(Arc::new(clock.clone())), agents: Agents::default() };
    (lb, clock)
}

/// A cluster on `lb` (of `clock`) whose prefill engine has the lease `lease`, in simulated time
/// (10 ms a step): the leases and the decode workers' confirmation timeout (10 s) it waits out
/// cost steps.
fn cluster_with_lease(lb: &Loopback, clock: &ManualClock, case: &str, lease: Duration) -> Cluster {
    let m = lb.matrix();
    let net = InProcessSideChannels::new();
    let time = SimTime::loopback(clock.clone(), Duration::from_millis(10), &lb.fabric, &net);
    let config = |id: &str| time.configure(m.config(&format!("{case}-{id}"), &net));
    let prefill = m.engine(EngineConfig { lease_duration: lease, ..config("prefill") });
    let decode = m.engine(config("decode"));
    matrix::cluster(vec![prefill], decode).with_sim_time(time).unwrap()
}

/// Rank 1 of the prefill engine loses its first answer ("held"): that rank's load waits out its
/// confirmation (10 s) and fails "timed out" instead of succeeding; the request fails, its bytes
/// unused; the hold was released (no expiry). The decode worker drops that peer and handshakes
/// again (same instance: not a restart), and the next request succeeds.
#[test]
fn a_lost_answer_fails_the_load_after_its_confirmation_timeout() {
    let (lb, clock) = simulated();
    let m = lb.matrix();
    let mut c = cluster_with_lease(&lb, &clock, "lost-answer", Duration::from_secs(30));
    lb.agent("lost-answer-prefill", 1).set_faults(Faults::none().drop_nth_notification(1)).unwrap();
    let lost = submit(&mut c, "lost", 1, 1);
    run(&mut c);
    assert_failed(&c.decodes[0], &lost[0], &[ErrorKind::Timeout]);
    let w = c.decodes[0].worker_stats();
    assert_eq!(
        w.iter().map(|w| (w.lease_failures, w.peers_invalidated)).collect::<Vec<_>>(),
        [(0, 0), (1, 1)]
    );
    assert_eq!(c.decodes[0].stats().blocks_verified, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "hold_answers", |w| w.hold_answers, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);

    let next = submit(&mut c, "next", 2, 1);
    run(&mut c);
    assert_finished(&c.decodes[0], &next);
    let w = c.decodes[0].worker_stats();
    assert_eq!(w.iter().map(|w| (w.handshakes, w.peer_restarts)).collect::<Vec<_>>(), [(1, 0), (2, 0)]);
    assert_eq!(c.decodes[0].stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    assert_clean(&c);
}

/// Rank 0 of the decode engine loses its READ's release: the prefill worker never learns of the
/// READ, so it never answers; the load fails "timed out" after its confirmation timeout, and the
/// hold is freed by its lease (1 s here), not by a release.
#[test]
fn a_lost_release_fails_the_load_and_the_hold_expires() {
    let (lb, clock) = simulated();
    let mut c = cluster_with_lease(&lb, &clock, "lost-release", Duration::from_secs(1));
    lb.agent("lost-release-decode", 0).set_faults(Faults::none().drop_nth_notification(1)).unwrap();
    let lost = submit(&mut c, "lost", 1, 1);
    run(&mut c);
    assert_failed(&c.decodes[0], &lost[0], &[ErrorKind::Timeout]);
    let w = c.decodes[0].worker_stats();
    assert_eq!(w.iter().map(|w| w.lease_failures).collect::<Vec<_>>(), [1, 0]);
    let p = c.prefills[0].worker_stats();
    assert_eq!(p.iter().map(|w| (w.notifications, w.expired_holds)).collect::<Vec<_>>(), [(0, 1), (1, 0)]);
    assert_eq!(c.decodes[0].stats().blocks_verified, 0);
    assert_clean(&c);
}

/// Rank 0 of the decode engine's first notification (its READ's release) is delivered twice: the
/// first frees the hold and is answered "held", the second matches the ended hold and is answered
/// "not held"; the decode worker takes the first answer and counts the second as stray. The
/// request succeeds.
#[test]
fn a_doubled_release_is_answered_twice_and_the_load_succeeds() {
    let (lb, clock) = simulated();
    let m = lb.matrix();
    let mut c = cluster_with_lease(&lb, &clock, "doubled", Duration::from_secs(30));
    lb.agent("doubled-decode", 0).set_faults(Faults::none().duplicate_nth_notification(1)).unwrap();
    let ids = submit(&mut c, "doubled", 1, 1);
    run(&mut c);
    assert_finished(&c.decodes[0], &ids);
    assert_eq!(c.decodes[0].stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    let p = c.prefills[0].worker_stats();
    let counts = |w: &kvx_core::WorkerStats| (w.notifications, w.stray_notifications, w.hold_answers);
    assert_eq!(p.iter().map(counts).collect::<Vec<_>>(), [(1, 1, 2), (1, 0, 1)]);
    let d = c.decodes[0].worker_stats();
    assert_eq!(
        d.iter().map(|w| (w.stray_notifications, w.lease_failures)).collect::<Vec<_>>(),
        [(1, 0), (0, 0)]
    );
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// The prefill workers cannot reach the decode engine to answer (every handshake on the fabric
/// is refused once the decode workers have connected): the hold is released by the READ's
/// release, but no answer comes, so the load fails "timed out" and its bytes are not used. With
/// the fault gone, both sides handshake again and the next request succeeds.
#[test]
fn an_unreachable_answer_path_fails_the_load_and_nothing_leaks() {
    let (lb, clock) = simulated();
    let m = lb.matrix();
    let mut c = cluster_with_lease(&lb, &clock, "no-answer", Duration::from_secs(30));
    let ids = submit(&mut c, "no-answer", 1, 1);
    let fabric = lb.fabric.clone();
    let mut refused = false;
    c.run_until_idle_with(matrix::LIMIT, |c| {
        if !refused && c.decodes[0].worker_stats().iter().all(|w| w.handshakes == 1) {
            fabric.set_faults(Faults::none().refuse_handshakes()).unwrap();
            refused = true;
        }
    })
    .unwrap();
    assert!(refused);
    assert_failed(&c.decodes[0], &ids[0], &[ErrorKind::Timeout]);
    m.assert_per_rank(&c.decodes[0], "lease_failures", |w| w.lease_failures, 1);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "handshake_failures", |w| w.handshake_failures, 1);
    m.assert_per_rank(&c.prefills[0], "unsent_messages", |w| w.unsent_messages, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_eq!(c.decodes[0].stats().blocks_verified, 0);
    assert_clean(&c);

    lb.fabric.set_faults(Faults::none()).unwrap();
    let next = submit(&mut c, "next", 2, 1);
    run(&mut c);
    assert_finished(&c.decodes[0], &next);
    m.assert_per_rank(&c.prefills[0], "handshakes", |w| w.handshakes, 1);
    m.assert_per_rank(&c.prefills[0], "hold_answers", |w| w.hold_answers, 2);
    assert_clean(&c);
}
