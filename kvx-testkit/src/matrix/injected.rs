//! The cases that need faults inside the transport: a lost or doubled release, a lost answer, an
//! answer path that cannot be reached. The [`Chaos`](crate::chaos::Chaos) layer injects them over
//! the matrix's backend, whatever it is. They run in simulated time ([`SimTime`]): the leases and
//! the 10 s confirmation timeouts they wait out cost steps, not wall time (a READ over a real
//! transport still takes its real time; its engine is busy meanwhile, so the clock waits for it a
//! step at a time).

use std::sync::Arc;
use std::time::Duration;

use kvx_core::{ErrorKind, ManualClock, WorkerStats};

use super::{
    LIMIT, Matrix, PROMPT_BLOCKS, assert_clean, assert_failed, assert_finished, run, step_until, submit,
};
use crate::chaos::{ChaosNet, Faults};
use crate::sim::{Cluster, EngineConfig, InProcessSideChannels, SimTime};

/// The matrix's backend in the chaos layer of a net on a simulated clock: a prefill engine
/// `{case}-prefill` with the lease `lease` and a decode engine `{case}-decode`, in that time (10 ms
/// a step). Agents are named `{engine}-{rank}` on the net.
fn chaos_cluster(m: &Matrix, case: &str, lease: Duration) -> (Cluster, ChaosNet) {
    let clock = ManualClock::new();
    let chaos = ChaosNet::with_clock(Arc::new(clock.clone()));
    let m = Matrix { backend: chaos.backend(m.backend.clone()), ..m.clone() };
    let net = InProcessSideChannels::new();
    let time = SimTime::chaos(clock, Duration::from_millis(10), &chaos, &net);
    let config = |id: &str| time.configure(m.config(&format!("{case}-{id}"), &net));
    let prefill = m.engine(EngineConfig { lease_duration: lease, ..config("prefill") });
    let decode = m.engine(config("decode"));
    let c = super::cluster(vec![prefill], decode).with_sim_time(time).unwrap_or_else(|e| panic!("{e}"));
    (c, chaos)
}

/// Sets `faults` on agent `agent` of `chaos`.
#[track_caller]
fn set(chaos: &ChaosNet, agent: &str, faults: Faults) {
    chaos.set_agent_faults(agent, faults).unwrap_or_else(|e| panic!("faults on {agent}: {e}"));
}

/// Each rank's value of `f` for `stats`.
fn per_rank<T>(stats: &[WorkerStats], f: impl Fn(&WorkerStats) -> T) -> Vec<T> {
    stats.iter().map(f).collect()
}

/// Rank 1 of the prefill engine loses its first answer ("held"): that rank's load waits out its
/// confirmation (10 s) and fails "timed out" instead of succeeding; the request fails, its bytes
/// unused; the hold was released (no expiry). The decode worker drops that peer and handshakes
/// again (same instance: not a restart), and the next request succeeds. The other ranks are
/// untouched.
pub fn lost_answer(m: &Matrix) {
    let (mut c, chaos) = chaos_cluster(m, "lost-answer", Duration::from_secs(30));
    set(&chaos, "lost-answer-prefill-1", Faults::none().drop_nth_notification(1));
    let lost = submit(&mut c, "lost", 1, 1);
    run(&mut c);
    assert_failed(&c.decodes[0], &lost[0], &[ErrorKind::Timeout]);
    let w = c.decodes[0].worker_stats();
    let mut expected = vec![(0, 0); m.tp() as usize];
    expected[1] = (1, 1);
    assert_eq!(per_rank(&w, |w| (w.lease_failures, w.peers_invalidated)), expected);
    assert_eq!(c.decodes[0].stats().blocks_verified, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "hold_answers", |w| w.hold_answers, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);

    let next = submit(&mut c, "next", 2, 1);
    run(&mut c);
    assert_finished(&c.decodes[0], &next);
    let mut handshakes = vec![(1, 0); m.tp() as usize];
    handshakes[1] = (2, 0);
    assert_eq!(per_rank(&c.decodes[0].worker_stats(), |w| (w.handshakes, w.peer_restarts)), handshakes);
    assert_eq!(c.decodes[0].stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    assert_clean(&c);
}

/// Rank 0 of the decode engine loses its READ's release: the prefill worker never learns of the
/// READ, so it never answers; the load fails "timed out" after its confirmation timeout, and the
/// hold is freed by its lease (1 s here), not by a release.
pub fn lost_release(m: &Matrix) {
    let (mut c, chaos) = chaos_cluster(m, "lost-release", Duration::from_secs(1));
    set(&chaos, "lost-release-decode-0", Faults::none().drop_nth_notification(1));
    let lost = submit(&mut c, "lost", 1, 1);
    run(&mut c);
    assert_failed(&c.decodes[0], &lost[0], &[ErrorKind::Timeout]);
    let mut failures = vec![0; m.tp() as usize];
    failures[0] = 1;
    assert_eq!(per_rank(&c.decodes[0].worker_stats(), |w| w.lease_failures), failures);
    let mut holds = vec![(1, 0); m.tp() as usize];
    holds[0] = (0, 1);
    assert_eq!(per_rank(&c.prefills[0].worker_stats(), |w| (w.notifications, w.expired_holds)), holds);
    assert_eq!(c.decodes[0].stats().blocks_verified, 0);
    assert_clean(&c);
}

/// Rank 0 of the decode engine's first notification (its READ's release) is delivered twice: the
/// first frees the hold and is answered "held", the second matches the ended hold and is answered
/// "not held"; the decode worker takes the first answer and counts the second as stray. The
/// request succeeds.
pub fn doubled_release(m: &Matrix) {
    let (mut c, chaos) = chaos_cluster(m, "doubled", Duration::from_secs(30));
    set(&chaos, "doubled-decode-0", Faults::none().duplicate_nth_notification(1));
    let ids = submit(&mut c, "doubled", 1, 1);
    run(&mut c);
    assert_finished(&c.decodes[0], &ids);
    assert_eq!(c.decodes[0].stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    let mut prefill = vec![(1, 0, 1); m.tp() as usize];
    prefill[0] = (1, 1, 2);
    let counts = |w: &WorkerStats| (w.notifications, w.stray_notifications, w.hold_answers);
    // The request finished on the first answer; the doubled release and its answer may still be
    // on their way.
    step_until(&mut c, "the doubled release answered and counted as stray", |c| {
        c.prefills[0].worker_stats()[0].stray_notifications == 1
            && c.decodes[0].worker_stats()[0].stray_notifications == 1
    });
    assert_eq!(per_rank(&c.prefills[0].worker_stats(), counts), prefill);
    let mut decode = vec![(0, 0); m.tp() as usize];
    decode[0] = (1, 0);
    assert_eq!(per_rank(&c.decodes[0].worker_stats(), |w| (w.stray_notifications, w.lease_failures)), decode);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// The prefill workers cannot reach the decode engine to answer (every handshake on the net is
/// refused once the decode workers have connected): the hold is released by the READ's release,
/// but no answer comes, so the load fails "timed out" and its bytes are not used. With the fault
/// gone, both sides handshake again and the next request succeeds.
pub fn unreachable_answer_path(m: &Matrix) {
    let (mut c, chaos) = chaos_cluster(m, "no-answer", Duration::from_secs(30));
    let ids = submit(&mut c, "no-answer", 1, 1);
    let refusing = chaos.clone();
    let mut refused = false;
    c.run_until_idle_with(LIMIT, |c| {
        if !refused && c.decodes[0].worker_stats().iter().all(|w| w.handshakes == 1) {
            refusing.set_faults(Faults::none().refuse_handshakes()).unwrap_or_else(|e| panic!("{e}"));
            refused = true;
        }
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(refused);
    assert_failed(&c.decodes[0], &ids[0], &[ErrorKind::Timeout]);
    m.assert_per_rank(&c.decodes[0], "lease_failures", |w| w.lease_failures, 1);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "handshake_failures", |w| w.handshake_failures, 1);
    m.assert_per_rank(&c.prefills[0], "unsent_messages", |w| w.unsent_messages, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_eq!(c.decodes[0].stats().blocks_verified, 0);
    assert_clean(&c);

    chaos.set_faults(Faults::none()).unwrap_or_else(|e| panic!("{e}"));
    let next = submit(&mut c, "next", 2, 1);
    run(&mut c);
    assert_finished(&c.decodes[0], &next);
    m.assert_per_rank(&c.prefills[0], "handshakes", |w| w.handshakes, 1);
    m.assert_per_rank(&c.prefills[0], "hold_answers", |w| w.hold_answers, 2);
    assert_clean(&c);
}
