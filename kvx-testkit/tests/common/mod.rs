//! What the loopback end-to-end suites share: agents on one fabric, each in the chaos layer and
//! kept by (engine, rank) so tests can inject faults, a small model, prompts, and the final
//! cleanliness check.

#![allow(clippy::unwrap_used, dead_code, unreachable_pub)] // Shared test helpers; each suite uses some.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvx_core::{EngineId, FinishReason, ManualClock, RequestId, TransferAgent};
use kvx_loopback::{Fabric, LoopbackAgent};
use kvx_testkit::chaos::{Chaos, ChaosNet};
use kvx_testkit::matrix::step_until;
use kvx_testkit::sim::{
    Cluster, EngineConfig, InProcessSideChannels, ModelSpec, RequestState, SimBackend, SimEngine, SimTime,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const BS: usize = 16;
pub const LIMIT: Duration = Duration::from_secs(60);

/// Agents by (engine, rank).
pub type Agents = Arc<Mutex<HashMap<(String, u32), Arc<Chaos<LoopbackAgent>>>>>;

/// Loopback agents on one fabric, in the chaos layer of one net, kept by (engine, rank) so tests
/// can inject faults.
#[derive(Default)]
pub struct Loopback {
    pub fabric: Fabric,
    pub chaos: ChaosNet,
    pub agents: Agents,
    pub net: InProcessSideChannels,
    /// Simulated time of the engines and clusters, or `None`: the system clock.
    pub time: Option<SimTime>,
}

impl Loopback {
    /// Engines and clusters in simulated time (10 ms a step): the leases and timeouts they wait
    /// out cost steps, not wall time.
    pub fn simulated() -> Self {
        let clock = ManualClock::new();
        let chaos = ChaosNet::with_clock(Arc::new(clock.clone()));
        let net = InProcessSideChannels::new();
        let time = SimTime::chaos(clock, Duration::from_millis(10), &chaos, &net);
        Loopback { fabric: Fabric::new(), chaos, agents: Agents::default(), net, time: Some(time) }
    }

    pub fn backend(&self) -> SimBackend {
        let (fabric, chaos, agents) = (self.fabric.clone(), self.chaos.clone(), self.agents.clone());
        SimBackend::new(move |engine: &EngineId, rank| {
            let agent = Arc::new(Chaos::new(Arc::new(fabric.agent(format!("{engine}-{rank}"))?), &chaos));
            agents.lock().unwrap().insert((engine.to_string(), rank), agent.clone());
            Ok(agent as Arc<dyn TransferAgent>)
        })
    }

    pub fn agent(&self, engine: &str, rank: u32) -> Arc<Chaos<LoopbackAgent>> {
        self.agents.lock().unwrap()[&(engine.to_owned(), rank)].clone()
    }

    pub fn engine(&self, config: EngineConfig) -> SimEngine {
        SimEngine::new(config, &self.backend()).unwrap()
    }

    pub fn config(&self, id: &str, model: &ModelSpec) -> EngineConfig {
        let config = EngineConfig::new(id, 2, 512, model.clone(), &self.net);
        match &self.time {
            Some(time) => time.configure(config),
            None => config,
        }
    }

    /// One prefill and one decode engine, TP=2.
    pub fn cluster(&self, model: &ModelSpec) -> Cluster {
        let prefill = self.engine(self.config("prefill", model));
        let decode = self.engine(self.config("decode", model));
        self.cluster_of(vec![prefill], decode)
    }

    /// A cluster of these engines (in this simulated time).
    pub fn cluster_of(&self, prefills: Vec<SimEngine>, decode: SimEngine) -> Cluster {
        let c = Cluster::new(prefills, decode).unwrap();
        match &self.time {
            Some(time) => c.with_sim_time(time.clone()).unwrap(),
            None => c,
        }
    }
}

pub fn model() -> ModelSpec {
    ModelSpec::standard(2, 4, 8, BS as u32)
}

pub fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(0..kvx_testkit::sim::VOCAB)).collect()
}

pub fn id(s: impl Into<String>) -> RequestId {
    RequestId::new(s)
}

/// Nothing went wrong, every engine is idle and every pool whole.
pub fn assert_clean(c: &Cluster) {
    for e in c.prefills.iter().chain(&c.decodes) {
        assert!(e.errors().is_empty(), "{}: {:?}", e.engine_id(), e.errors());
        assert_eq!(e.stats().blocks_mismatched, 0);
        assert!(e.is_idle(), "{} is not idle", e.engine_id());
        assert!(e.pool().is_whole(), "{} leaked {} blocks", e.engine_id(), c.blocks_in_use());
    }
}

/// An engine `name` of TP `tp` for `model`, in `lb`'s simulated time.
pub fn engine(lb: &Loopback, name: &str, model: &ModelSpec, tp: u32) -> SimEngine {
    lb.engine(EngineConfig { tp, ..lb.config(name, model) })
}

/// A prefill engine of TP `p` and a decode engine of TP `d` for `model`, in simulated time.
pub fn cluster(lb: &Loopback, model: &ModelSpec, (p, d): (u32, u32)) -> Cluster {
    lb.cluster_of(vec![engine(lb, "prefill", model, p)], engine(lb, "decode", model, d))
}

/// Every hold of every rank of `prefill` was released by its readers; none expired.
#[track_caller]
pub fn assert_no_hold_expired(prefill: &SimEngine, what: &str) {
    let expired: Vec<u64> = prefill.worker_stats().iter().map(|w| w.expired_holds).collect();
    assert_eq!(expired, vec![0; expired.len()], "{what}: holds expired per rank of {}", prefill.engine_id());
}

/// Submits `id` with `prompt`, 2 tokens to generate.
pub fn submit(c: &mut Cluster, id: &RequestId, prompt: Vec<u32>) {
    c.submit(id.clone(), prompt, 2).unwrap_or_else(|e| panic!("submitting {id}: {e}"));
}

/// `id` is in `state` at `e`.
#[track_caller]
pub fn assert_state(e: &SimEngine, id: &RequestId, state: RequestState, what: &str) {
    assert_eq!(e.state(id), Some(&state), "{what}: {id}");
}

/// Ends a workload on `c`: aborts a request at the prefill engine before its first step and one
/// at the decode engine while its KV is on the way (seeds of their prompts from `seed`), runs until
/// idle, and checks that nothing went wrong or leaked, every request of `served` finished, the two
/// were aborted where they were, and the decode engine finished or failed nothing else.
pub fn abort_at_both_and_finish(c: &mut Cluster, served: &[RequestId], seed: u64, what: &str) {
    let early = id("abort-at-prefill");
    submit(c, &early, prompt(seed + 1, 2 * BS + 3));
    c.abort(&early);
    let loading = id("abort-while-loading");
    submit(c, &loading, prompt(seed + 2, 3 * BS + 1));
    step_until(c, &format!("{what}: {loading} waits for its KV (or ended)"), |c| {
        matches!(
            c.decodes[0].state(&loading),
            Some(RequestState::WaitingForRemoteKv | RequestState::Finished(_) | RequestState::Failed(_))
        )
    });
    c.abort(&loading);
    c.run_until_idle(LIMIT).unwrap_or_else(|e| panic!("{what}: {e}"));

    assert_clean(c);
    let (prefill, decode) = (&c.prefills[0], &c.decodes[0]);
    for rid in served {
        assert_state(decode, rid, RequestState::Finished(FinishReason::LengthCapped), what);
    }
    assert_state(prefill, &early, RequestState::Finished(FinishReason::Aborted), what);
    assert_eq!(decode.state(&early), None, "{what}: {early} never reached the decode engine");
    assert_state(decode, &loading, RequestState::Finished(FinishReason::Aborted), what);
    let s = decode.stats();
    assert_eq!((s.finished, s.failed), (served.len() as u64 + 1, 0), "{what}: {s:?}");
}
