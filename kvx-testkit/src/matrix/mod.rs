//! The fault matrix: every fault the connector must survive, run end to end on any backend: those
//! injected through the engines, the client or the engines' lifetimes, and those inside the
//! transport, injected by the [`Chaos`](crate::chaos::Chaos) layer over the backend.
//!
//! Each case is a plain function over a [`Matrix`] (a [`SimBackend`] and the tensor-parallel size
//! to run it at): it builds its own [`Cluster`] (a prefill and a decode [`SimEngine`] on
//! in-process side channels), injects its fault through the engines, the client between them or
//! the engines' lifetimes, drives the cluster until idle within a bound, and asserts the exact
//! outcome: which requests finish and which fail and why, that no wrong byte was used
//! (`blocks_mismatched == 0`, [`SimEngine::errors`] empty), that every pool is whole and every
//! engine idle, and the worker counters the contract names (`docs/CONTRACT.md`). Cases panic on
//! failure, like `assert!`.
//!
//! A backend runs all of them with [`fault_matrix!`](crate::fault_matrix), one `#[test]` per case:
//!
//! ```
//! use std::sync::Arc;
//! use kvx_core::TransferAgent;
//! use kvx_loopback::Fabric;
//! use kvx_testkit::matrix::Matrix;
//! use kvx_testkit::sim::SimBackend;
//!
//! let fabric = Fabric::new();
//! let backend = SimBackend::new(move |engine, rank| {
//!     Ok(Arc::new(fabric.agent(format!("{engine}-{rank}"))?) as Arc<dyn TransferAgent>)
//! });
//! kvx_testkit::matrix::duplicate_offer(&Matrix::new(backend));
//! ```
//!
//! Restart cases drop an engine and start it again under the same engine id: a backend whose
//! agents are kept alive elsewhere (a registry of strong references) does not really restart.
//!
//! Every wait is bounded ([`LIMIT`]). Some cases wait out the decode workers' confirmation timeout
//! (10 s, `WorkerConfig::confirm_timeout`, which [`EngineConfig`] does not set): they take that long.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvx_core::{Error, ErrorKind, FinishReason, RequestId, WorkerStats};

use crate::sim::{
    ClientRequest, Cluster, EngineConfig, InProcessSideChannels, ModelSpec, RequestState, SimBackend,
    SimEngine, VOCAB,
};

/// Tokens per block of the matrix's model.
pub const BLOCK_SIZE: usize = 16;

/// Blocks in every engine's pool.
pub const NUM_BLOCKS: u32 = 256;

/// The bound of every run until idle and every stepping loop. Passing runs take far less; a run
/// that waits for a confirmation to time out takes about 10 s.
pub const LIMIT: Duration = Duration::from_secs(60);

/// Full blocks in a matrix prompt (`PROMPT_LEN` tokens): what each load READs.
pub const PROMPT_BLOCKS: usize = 3;

/// Tokens in a matrix prompt: three full blocks and a partial one (computed by the decode engine).
pub const PROMPT_LEN: usize = PROMPT_BLOCKS * BLOCK_SIZE + 5;

/// What every case runs on: a backend and a tensor-parallel size.
#[derive(Debug, Clone)]
pub struct Matrix {
    backend: SimBackend,
    tp: u32,
    model: ModelSpec,
}

impl Matrix {
    /// The matrix on `backend`, TP=2, a 2-layer model with 4 KV heads of 8 elements.
    pub fn new(backend: SimBackend) -> Self {
        Matrix { backend, tp: 2, model: ModelSpec::standard(2, 4, 8, BLOCK_SIZE as u32) }
    }

    /// The same matrix at another tensor-parallel size (1, 2 or 4).
    pub fn with_tp(mut self, tp: u32) -> Self {
        self.tp = tp;
        self
    }

    /// The backend.
    pub fn backend(&self) -> &SimBackend {
        &self.backend
    }

    /// The tensor-parallel size of every engine.
    pub fn tp(&self) -> u32 {
        self.tp
    }

    /// The model every engine runs (but the decode engine of [`layout_refusal`]).
    pub fn model(&self) -> &ModelSpec {
        &self.model
    }

    /// An engine's configuration: `NUM_BLOCKS` blocks, side channels on `net`, the usual timeouts.
    pub fn config(&self, engine_id: &str, net: &InProcessSideChannels) -> EngineConfig {
        EngineConfig::new(engine_id, self.tp, NUM_BLOCKS, self.model.clone(), net)
    }

    /// Starts an engine on the backend (panics if it cannot).
    pub fn engine(&self, config: EngineConfig) -> SimEngine {
        let id = config.engine_id.clone();
        SimEngine::new(config, &self.backend).unwrap_or_else(|e| panic!("starting engine {id}: {e}"))
    }

    /// A prefill engine `{case}-prefill` and a decode engine `{case}-decode` on fresh side
    /// channels.
    pub fn cluster(&self, case: &str) -> (Cluster, InProcessSideChannels) {
        let net = InProcessSideChannels::new();
        let prefill = self.engine(self.config(&format!("{case}-prefill"), &net));
        let decode = self.engine(self.config(&format!("{case}-decode"), &net));
        (cluster(vec![prefill], decode), net)
    }

    /// Blocks checked when a load of `blocks` blocks completes (every layer, K and V, every rank).
    pub fn verified_per_load(&self, blocks: usize) -> u64 {
        let regions = u64::from(self.model.kind().regions_per_layer());
        blocks as u64 * self.model.num_layers() as u64 * regions * u64::from(self.tp)
    }

    /// Every rank's value of `f` for `engine`, checked against `expected` on each rank.
    #[track_caller]
    pub fn assert_per_rank(
        &self,
        engine: &SimEngine,
        what: &str,
        f: impl Fn(&WorkerStats) -> u64,
        expected: u64,
    ) {
        let got: Vec<u64> = engine.worker_stats().iter().map(f).collect();
        assert_eq!(got, vec![expected; self.tp as usize], "{} {what} per rank", engine.engine_id());
    }
}

/// A cluster of `prefills` and `decode` (panics if it cannot be built).
pub fn cluster(prefills: Vec<SimEngine>, decode: SimEngine) -> Cluster {
    Cluster::new(prefills, decode).unwrap_or_else(|e| panic!("building the cluster: {e}"))
}

/// A deterministic prompt of `len` tokens.
pub fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % u64::from(VOCAB)) as u32
        })
        .collect()
}

/// A request id.
pub fn id(s: impl Into<String>) -> RequestId {
    RequestId::new(s)
}

/// Submits requests `{prefix}-0` .. `{prefix}-{n-1}` of [`PROMPT_LEN`] tokens (seeded by `seed`
/// and the index) that generate 2 tokens; returns their ids.
pub fn submit(c: &mut Cluster, prefix: &str, seed: u64, n: usize) -> Vec<RequestId> {
    (0..n)
        .map(|i| {
            let rid = id(format!("{prefix}-{i}"));
            c.submit(rid.clone(), prompt(seed * 1000 + i as u64, PROMPT_LEN), 2)
                .unwrap_or_else(|e| panic!("submitting {rid}: {e}"));
            rid
        })
        .collect()
}

/// Runs the cluster until idle within [`LIMIT`] (panics otherwise).
#[track_caller]
pub fn run(c: &mut Cluster) {
    if let Err(e) = c.run_until_idle(LIMIT) {
        panic!("{e}");
    }
}

/// Steps the cluster until `done` holds, within [`LIMIT`].
#[track_caller]
pub fn step_until(c: &mut Cluster, what: &str, mut done: impl FnMut(&Cluster) -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !done(c) {
        assert!(Instant::now() < deadline, "{what}: not after {LIMIT:?}: {c:?}");
        if let Err(e) = c.step() {
            panic!("stepping the cluster: {e}");
        }
        std::thread::yield_now();
    }
}

/// Whether `id` finished normally on `engine`.
pub fn finished(engine: &SimEngine, id: &RequestId) -> bool {
    engine.state(id) == Some(&RequestState::Finished(FinishReason::LengthCapped))
}

/// Asserts that every request of `ids` finished normally on `engine`.
#[track_caller]
pub fn assert_finished(engine: &SimEngine, ids: &[RequestId]) {
    for rid in ids {
        assert!(finished(engine, rid), "{rid}: {:?}", engine.state(rid));
    }
}

/// The error `id` failed with on `engine` (panics if it did not fail).
#[track_caller]
pub fn failure(engine: &SimEngine, id: &RequestId) -> Error {
    match engine.state(id) {
        Some(RequestState::Failed(error)) => error.clone(),
        other => panic!("{id} did not fail: {other:?}"),
    }
}

/// Asserts that `id` failed on `engine` with an error of one of `kinds`; returns the error.
#[track_caller]
pub fn assert_failed(engine: &SimEngine, id: &RequestId, kinds: &[ErrorKind]) -> Error {
    let error = failure(engine, id);
    assert!(kinds.contains(&error.kind()), "{id} failed with another kind than {kinds:?}: {error}");
    error
}

/// Nothing went wrong in any engine (no wrong byte, no pool misuse), every engine is idle and
/// every pool whole.
#[track_caller]
pub fn assert_clean(c: &Cluster) {
    for e in c.prefills.iter().chain(&c.decodes) {
        assert_engine_clean(e);
    }
}

/// [`assert_clean`] for one engine.
#[track_caller]
pub fn assert_engine_clean(e: &SimEngine) {
    assert!(e.errors().is_empty(), "{}: {:?}", e.engine_id(), e.errors());
    assert_eq!(e.stats().blocks_mismatched, 0, "{}", e.engine_id());
    assert!(e.is_idle(), "{} is not idle: {e:?}", e.engine_id());
    let pool = e.pool();
    assert!(
        pool.is_whole(),
        "{} leaked {} blocks ({} in flight)",
        e.engine_id(),
        pool.num_blocks() as usize - pool.num_free(),
        pool.num_in_flight()
    );
}

/// Requests a client held back instead of handing them to the decode engine.
pub type Held = Arc<Mutex<Vec<ClientRequest>>>;

/// A client that holds back the requests whose id starts with `prefix` (the test hands them to
/// the decode engine itself, when it chooses) and passes the others on.
pub fn holding_client(
    prefix: &'static str,
) -> (impl FnMut(ClientRequest) -> Vec<ClientRequest> + Send + 'static, Held) {
    let held: Held = Arc::default();
    let keep = Arc::clone(&held);
    let hook = move |request: ClientRequest| {
        if request.0.as_str().starts_with(prefix) {
            keep.lock().unwrap_or_else(PoisonError::into_inner).push(request);
            Vec::new()
        } else {
            vec![request]
        }
    };
    (hook, held)
}

/// Steps until the client holds `id`, and takes it.
#[track_caller]
pub fn take_held(c: &mut Cluster, held: &Held, id: &RequestId) -> ClientRequest {
    let lock = |h: &Held| h.lock().unwrap_or_else(PoisonError::into_inner).iter().any(|r| &r.0 == id);
    step_until(c, &format!("the client to get the params of {id}"), |_| lock(held));
    let mut requests = held.lock().unwrap_or_else(PoisonError::into_inner);
    let i = requests.iter().position(|r| &r.0 == id).unwrap_or_else(|| panic!("{id} not held"));
    requests.remove(i)
}

/// Hands a request to the decode engine.
#[track_caller]
pub fn add_to_decode(c: &mut Cluster, (rid, prompt, max_new_tokens, params): ClientRequest) {
    c.decodes[0]
        .add_request(rid.clone(), &prompt, max_new_tokens, Some(params))
        .unwrap_or_else(|e| panic!("adding {rid}: {e}"));
}

mod cases;
mod injected;

pub use cases::*;
pub use injected::*;

/// The names of the cases, in the order [`fault_matrix!`](crate::fault_matrix) runs them.
pub const CASES: &[&str] = &[
    "late_reader",
    "prefill_restart",
    "prefill_restart_same_ports",
    "prefill_restart_unnamed_instance",
    "prefill_restart_is_safe",
    "decode_restart",
    "out_of_range_read",
    "layout_refusal",
    "abort_queued_on_decode",
    "abort_before_the_read",
    "abort_during_read",
    "abort_running",
    "abort_on_prefill",
    "duplicate_offer",
    "replayed_offer",
    "lost_answer",
    "lost_release",
    "doubled_release",
    "unreachable_answer_path",
];

/// One `#[test]` per case of the matrix ([`CASES`]), named after the case. `$setup` is called
/// with the case's name and returns the [`Matrix`](crate::matrix::Matrix) to run it on, or `None`
/// to skip it (after saying why, loudly).
///
/// A backend on which a case fails because of a known bug lists it after `ignore` with the
/// reason: the test is still built, marked `#[ignore = reason]`, and runs with
/// `cargo test -- --ignored`.
///
/// ```ignore
/// kvx_testkit::fault_matrix!(|_case: &str| Some(Matrix::new(backend())));
/// kvx_testkit::fault_matrix!(setup; ignore [prefill_restart: "why, and the issue"]);
/// ```
#[macro_export]
macro_rules! fault_matrix {
    ($setup:expr) => {
        $crate::fault_matrix!($setup; ignore []);
    };
    ($setup:expr; ignore [$($ignored:ident: $reason:literal),* $(,)?]) => {
        $crate::fault_matrix!(@dollar ($) $setup; [$($ignored: $reason),*]);
    };
    // A local macro matches each case against the ignored ones (`$d` is a `$` for its rules).
    (@dollar ($d:tt) $setup:expr; [$($ignored:ident: $reason:literal),*]) => {
        macro_rules! __kvx_fault_matrix_case {
            $( ($ignored) => { $crate::fault_matrix!(@case $setup; $ignored; #[ignore = $reason]); }; )*
            ($d case:ident) => { $crate::fault_matrix!(@case $setup; $d case;); };
        }
        __kvx_fault_matrix_case!(late_reader);
        __kvx_fault_matrix_case!(prefill_restart);
        __kvx_fault_matrix_case!(prefill_restart_same_ports);
        __kvx_fault_matrix_case!(prefill_restart_unnamed_instance);
        __kvx_fault_matrix_case!(prefill_restart_is_safe);
        __kvx_fault_matrix_case!(decode_restart);
        __kvx_fault_matrix_case!(out_of_range_read);
        __kvx_fault_matrix_case!(layout_refusal);
        __kvx_fault_matrix_case!(abort_queued_on_decode);
        __kvx_fault_matrix_case!(abort_before_the_read);
        __kvx_fault_matrix_case!(abort_during_read);
        __kvx_fault_matrix_case!(abort_running);
        __kvx_fault_matrix_case!(abort_on_prefill);
        __kvx_fault_matrix_case!(duplicate_offer);
        __kvx_fault_matrix_case!(replayed_offer);
        __kvx_fault_matrix_case!(lost_answer);
        __kvx_fault_matrix_case!(lost_release);
        __kvx_fault_matrix_case!(doubled_release);
        __kvx_fault_matrix_case!(unreachable_answer_path);

        #[test]
        fn fault_matrix_runs_every_case() {
            let listed = [
                "late_reader", "prefill_restart", "prefill_restart_same_ports",
                "prefill_restart_unnamed_instance", "prefill_restart_is_safe", "decode_restart",
                "out_of_range_read", "layout_refusal", "abort_queued_on_decode",
                "abort_before_the_read", "abort_during_read", "abort_running", "abort_on_prefill",
                "duplicate_offer", "replayed_offer", "lost_answer", "lost_release",
                "doubled_release", "unreachable_answer_path",
            ];
            assert_eq!(listed, $crate::matrix::CASES, "fault_matrix! and matrix::CASES differ");
        }
    };
    (@case $setup:expr; $case:ident; $(#[$attr:meta])*) => {
        #[test]
        $(#[$attr])*
        fn $case() {
            let matrix: ::std::option::Option<$crate::matrix::Matrix> = ($setup)(stringify!($case));
            if let ::std::option::Option::Some(matrix) = matrix {
                $crate::matrix::$case(&matrix);
            }
        }
    };
}
