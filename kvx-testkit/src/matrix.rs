//! The fault matrix: every fault that can be injected without transport hooks, run end to end on
//! any backend.
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

use kvx_core::{Error, ErrorKind, FinishReason, RequestId, TransferParams, WorkerStats};

use crate::sim::{
    ClientRequest, Cluster, EngineConfig, InProcessSideChannels, ModelSpec, RequestState, SideChannel,
    SimBackend, SimEngine, VOCAB,
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
    for e in c.prefills.iter().chain([&c.decode]) {
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
    c.decode
        .add_request(rid.clone(), &prompt, max_new_tokens, Some(params))
        .unwrap_or_else(|e| panic!("adding {rid}: {e}"));
}

// ---------------------------------------------------------------------------------------------
// The cases.

/// A reader too late for its lease: the prefill engine's lease is zero, so every hold ends at the
/// step that records it, before any READ. Every load fails, [`ErrorKind::Expired`] (the prefill
/// worker answered "not held") or [`ErrorKind::Timeout`] (no answer: with a zero lease the worker
/// forgets ended holds at once, so a late release waits as an early one and is never answered); no
/// byte of it is used, nothing leaks, the prefill holds all expired. Then a prefill engine with a
/// normal lease serves the same decode engine.
pub fn late_reader(m: &Matrix) {
    let net = InProcessSideChannels::new();
    let late = m.engine(EngineConfig { lease_duration: Duration::ZERO, ..m.config("late-prefill", &net) });
    let decode = m.engine(m.config("late-decode", &net));
    let mut c = cluster(vec![late], decode);
    let ids = submit(&mut c, "late", 1, 4);
    run(&mut c);
    for rid in &ids {
        assert_failed(&c.decode, rid, &[ErrorKind::Expired, ErrorKind::Timeout]);
    }
    let s = c.decode.stats().clone();
    assert_eq!((s.finished, s.failed, s.blocks_verified, s.tokens_loaded), (0, 4, 0, 0), "{s:?}");
    m.assert_per_rank(&c.decode, "lease_failures", |w| w.lease_failures, 4);
    m.assert_per_rank(&c.decode, "failed_loads", |w| w.failed_loads, 4);
    m.assert_per_rank(&c.decode, "bytes_read", |w| w.bytes_read, 0);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 4);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 0);
    m.assert_per_rank(&c.prefills[0], "leases_renewed", |w| w.leases_renewed, 0);
    assert_clean(&c);

    // The same decode engine, now fed by a prefill engine with the usual lease.
    let late = std::mem::replace(&mut c.prefills[0], m.engine(m.config("late-ok-prefill", &net)));
    let ids = submit(&mut c, "late-ok", 2, 4);
    run(&mut c);
    assert_finished(&c.decode, &ids);
    assert_eq!(c.decode.stats().blocks_verified, 4 * m.verified_per_load(PROMPT_BLOCKS));
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 4);
    m.assert_per_rank(&c.prefills[0], "hold_answers", |w| w.hold_answers, 4);
    m.assert_per_rank(&c.decode, "lease_failures", |w| w.lease_failures, 4);
    assert_clean(&c);
    assert_engine_clean(&late);
}

/// The prefill engine restarts between requests: it is dropped (its agents and KV memory go) and
/// started again under the same engine id (on new in-process ports). The new engine's params name
/// its instance, so the decode workers handshake with it again before reading: no READ goes
/// through the stale connection, and every request after the restart succeeds, every byte
/// checked.
pub fn prefill_restart(m: &Matrix) {
    let c = restart_prefill(m, "restart", false, false);
    m.assert_per_rank(&c.decode, "reads_posted", |w| w.reads_posted, 6);
}

/// [`prefill_restart`] with real TCP side channels, the new engine binding the ports the old one
/// had: the params of both starts name the same host and port, only their instance differs.
pub fn prefill_restart_same_ports(m: &Matrix) {
    let c = restart_prefill(m, "restart-ports", true, false);
    m.assert_per_rank(&c.decode, "reads_posted", |w| w.reads_posted, 6);
}

/// [`prefill_restart`] with params that name no instance (a client that drops the keys it does
/// not know, or a prefill engine that sets none; without a key nothing refuses them): the decode
/// workers READ through the connection to the dropped engine's agent. That READ must fail (the
/// contract: the peer is dropped, handshaken again, and the READ posted once more to the new
/// instance), so every request after the restart still succeeds.
pub fn prefill_restart_unnamed_instance(m: &Matrix) {
    restart_prefill(m, "restart-unnamed", false, true);
}

/// Drops a client's `kvx_instance` from the params it hands on.
fn without_instance(mut request: ClientRequest) -> Vec<ClientRequest> {
    request.3.kvx_instance = None;
    vec![request]
}

/// Three requests, a prefill restart, three more that must all succeed; returns the cluster.
fn restart_prefill(m: &Matrix, case: &str, same_ports: bool, unnamed: bool) -> Cluster {
    let net = InProcessSideChannels::new();
    let config = |id: &str| {
        let c = m.config(&format!("{case}-{id}"), &net);
        if same_ports { EngineConfig { side_channel: tcp(0), ..c } } else { c }
    };
    let mut c = cluster(vec![m.engine(config("prefill"))], m.engine(config("decode")));
    if unnamed {
        c = c.with_client(without_instance);
    }
    let before = submit(&mut c, "before", 1, 3);
    run(&mut c);
    assert_finished(&c.decode, &before);
    assert_clean(&c);

    let mut config = c.prefills[0].config().clone();
    if same_ports {
        config.side_channel = tcp(c.prefills[0].side_channel_port());
    }
    c.prefills.clear();
    c.prefills.push(m.engine(config));

    let after = submit(&mut c, "after", 2, 3);
    run(&mut c);
    assert_finished(&c.decode, &after);
    assert_eq!(c.decode.stats().blocks_verified, 6 * m.verified_per_load(PROMPT_BLOCKS));
    assert_eq!(c.decode.stats().failed, 0);
    m.assert_per_rank(&c.decode, "handshakes", |w| w.handshakes, 2);
    m.assert_per_rank(&c.decode, "peer_restarts", |w| w.peer_restarts, 1);
    m.assert_per_rank(&c.decode, "peers_invalidated", |w| w.peers_invalidated, 1);
    m.assert_per_rank(&c.decode, "lease_failures", |w| w.lease_failures, 0);
    m.assert_per_rank(&c.decode, "failed_loads", |w| w.failed_loads, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 3);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
    c
}

/// TCP side channels on 127.0.0.1, rank 0 on `port` (0: a free one).
fn tcp(port: u16) -> SideChannel {
    SideChannel::Tcp { host: "127.0.0.1".into(), port }
}

/// What every backend must keep when the prefill engine restarts, even one whose READs of the
/// dropped engine's agent are not seen to fail, and with params that name no instance (so that
/// those READs happen): no wrong byte is used. The requests sent to the restarted engine (whose
/// lease is 3 s here) either succeed or fail ([`ErrorKind::Timeout`], [`ErrorKind::Transfer`] or
/// [`ErrorKind::Expired`]); every hold of the new engine ends, released or expired; nothing leaks;
/// and once the decode workers have found the new instance, every request succeeds.
pub fn prefill_restart_is_safe(m: &Matrix) {
    let (c, _net) = m.cluster("safe-restart");
    let mut c = c.with_client(without_instance);
    let before = submit(&mut c, "before", 1, 3);
    run(&mut c);
    assert_finished(&c.decode, &before);

    let config = EngineConfig { lease_duration: Duration::from_secs(3), ..c.prefills[0].config().clone() };
    c.prefills.clear();
    c.prefills.push(m.engine(config));
    let after = submit(&mut c, "after", 2, 3);
    run(&mut c);
    let mut loads = before.len() as u64;
    for rid in &after {
        if finished(&c.decode, rid) {
            loads += 1;
        } else {
            assert_failed(&c.decode, rid, &[ErrorKind::Timeout, ErrorKind::Transfer, ErrorKind::Expired]);
        }
    }
    assert_clean(&c);
    let ended = |w: &WorkerStats| w.notifications + w.expired_holds;
    m.assert_per_rank(&c.prefills[0], "holds released or expired", ended, 3);

    let more = submit(&mut c, "more", 3, 3);
    run(&mut c);
    assert_finished(&c.decode, &more);
    loads += more.len() as u64;
    assert_eq!(c.decode.stats().blocks_verified, loads * m.verified_per_load(PROMPT_BLOCKS));
    m.assert_per_rank(&c.decode, "peer_restarts", |w| w.peer_restarts, 1);
    m.assert_per_rank(&c.prefills[0], "holds released or expired", ended, 6);
    assert_clean(&c);
}

/// The decode engine restarts between requests (dropped, started again under the same id). Its
/// releases carry its new instance, so the prefill workers handshake with it again before they
/// answer. Every request after the restart succeeds.
pub fn decode_restart(m: &Matrix) {
    let (mut c, _net) = m.cluster("decode-restart");
    let before = submit(&mut c, "before", 1, 3);
    run(&mut c);
    assert_finished(&c.decode, &before);
    assert_clean(&c);

    let Cluster { prefills, decode, .. } = c;
    let config = decode.config().clone();
    drop(decode);
    let mut c = cluster(prefills, m.engine(config));

    let after = submit(&mut c, "after", 2, 3);
    run(&mut c);
    assert_finished(&c.decode, &after);
    assert_eq!(c.decode.stats().blocks_verified, 3 * m.verified_per_load(PROMPT_BLOCKS));
    m.assert_per_rank(&c.decode, "handshakes", |w| w.handshakes, 1);
    m.assert_per_rank(&c.decode, "lease_failures", |w| w.lease_failures, 0);
    // The prefill workers answered 6 releases, reaching each decode instance by its own handshake.
    m.assert_per_rank(&c.prefills[0], "hold_answers", |w| w.hold_answers, 6);
    m.assert_per_rank(&c.prefills[0], "handshakes", |w| w.handshakes, 2);
    m.assert_per_rank(&c.prefills[0], "peer_restarts", |w| w.peer_restarts, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A client edits the params so that the READ window reaches past the prefill engine's pool (a
/// remote block id equal to its `num_blocks`; no key, so the edit is not refused up front). The
/// decode worker finds it out after the handshake, when it knows the pool's size: the request
/// fails, nothing is read, and the prefill engine is told at once to free (no hold expires). Once
/// while the handshake is under way, once with the peer ready.
pub fn out_of_range_read(m: &Matrix) {
    let (c, _net) = m.cluster("oob");
    let mut c = c.with_client(|mut request: ClientRequest| {
        if request.0.as_str().starts_with("oob") {
            if let Some(last) = request.3.remote_block_ids.as_mut().and_then(|b| b.last_mut()) {
                *last = NUM_BLOCKS;
            }
        }
        vec![request]
    });
    let first = submit(&mut c, "oob-first", 1, 1);
    run(&mut c);
    let (good, later) = (submit(&mut c, "good", 2, 1), submit(&mut c, "oob-later", 3, 1));
    run(&mut c);
    for rid in first.iter().chain(&later) {
        // Every check of peer data fails with this kind; the message says it was this one.
        let e = assert_failed(&c.decode, rid, &[ErrorKind::InvalidPeerData]);
        let out_of_range = format!("remote block id {NUM_BLOCKS} out of range");
        assert!(e.message().contains(&out_of_range), "{rid}: {e}");
    }
    assert_finished(&c.decode, &good);
    assert_eq!(c.decode.stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    m.assert_per_rank(&c.decode, "reads_posted", |w| w.reads_posted, 1);
    m.assert_per_rank(&c.decode, "handshakes", |w| w.handshakes, 1);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 3);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// The decode engine runs another model (another block length): the handshake refuses the
/// prefill engine as incompatible, both waiting requests fail, nothing is read, and the decode
/// workers still tell the prefill engine to free (no hold expires).
pub fn layout_refusal(m: &Matrix) {
    let net = InProcessSideChannels::new();
    let prefill = m.engine(m.config("layout-prefill", &net));
    let other = ModelSpec::standard(2, 4, 16, BLOCK_SIZE as u32);
    let decode = m.engine(EngineConfig { model: other, ..m.config("layout-decode", &net) });
    let mut c = cluster(vec![prefill], decode);
    let ids = submit(&mut c, "layout", 1, 2);
    run(&mut c);
    for rid in &ids {
        assert_failed(&c.decode, rid, &[ErrorKind::Incompatible]);
    }
    m.assert_per_rank(&c.decode, "handshake_failures", |w| w.handshake_failures, 1);
    m.assert_per_rank(&c.decode, "reads_posted", |w| w.reads_posted, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 2);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A decode-side request aborted while queued, before it has blocks: nothing is read, and the
/// prefill engine is told at once to free (a notify-only release; no hold expires).
pub fn abort_queued_on_decode(m: &Matrix) {
    let (c, _net) = m.cluster("abort-queued");
    let (hook, held) = holding_client("held");
    let mut c = c.with_client(hook);
    submit(&mut c, "held", 1, 1);
    let request = take_held(&mut c, &held, &id("held-0"));
    let rid = request.0.clone();
    add_to_decode(&mut c, request);
    c.decode.abort(&rid);
    assert_eq!(c.decode.state(&rid), Some(&RequestState::Finished(FinishReason::Aborted)));
    run(&mut c);
    m.assert_per_rank(&c.decode, "reads_posted", |w| w.reads_posted, 0);
    m.assert_per_rank(&c.decode, "notify_only", |w| w.notify_only, 1);
    assert_eq!(c.decode.stats().blocks_verified, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A decode-side request aborted right after its allocation, on a fresh cluster: its load waits
/// for the handshake (or its READ has just been posted). Its blocks stay until the load is
/// reported; the READ's release frees the prefill hold (no expiry); the loaded bytes are not used.
pub fn abort_before_the_read(m: &Matrix) {
    abort_while_loading(m, "abort-early", false);
}

/// A decode-side request aborted while its READ is in flight (the peer is ready, so the READ is
/// posted in the step that allocates): as [`abort_before_the_read`].
pub fn abort_during_read(m: &Matrix) {
    abort_while_loading(m, "abort-read", true);
}

fn abort_while_loading(m: &Matrix, case: &str, warm: bool) {
    let (c, _net) = m.cluster(case);
    let (hook, held) = holding_client("held");
    let mut c = c.with_client(hook);
    let warmed = if warm { submit(&mut c, "warm", 1, 1) } else { Vec::new() };
    run(&mut c);
    assert_finished(&c.decode, &warmed);
    submit(&mut c, "held", 2, 1);
    let request = take_held(&mut c, &held, &id("held-0"));
    let rid = request.0.clone();
    add_to_decode(&mut c, request);
    if let Err(e) = c.decode.step() {
        panic!("decode step: {e}");
    }
    assert_eq!(c.decode.state(&rid), Some(&RequestState::WaitingForRemoteKv));
    if warm {
        m.assert_per_rank(&c.decode, "reads_posted", |w| w.reads_posted, 2);
    }
    let pool = c.decode.pool();
    let used = pool.num_blocks() as usize - pool.num_free();
    c.decode.abort(&rid);
    assert_eq!(c.decode.state(&rid), Some(&RequestState::Finished(FinishReason::Aborted)));
    let pool = c.decode.pool();
    assert_eq!(pool.num_blocks() as usize - pool.num_free(), used, "nothing freed while the load runs");
    assert_eq!(pool.num_in_flight(), PROMPT_BLOCKS, "the load's blocks stay in flight");
    run(&mut c);
    let loads = warmed.len() as u64;
    assert_eq!(
        c.decode.stats().blocks_verified,
        loads * m.verified_per_load(PROMPT_BLOCKS),
        "an aborted load is not used"
    );
    m.assert_per_rank(&c.decode, "reads_posted", |w| w.reads_posted, loads + 1);
    m.assert_per_rank(&c.decode, "failed_loads", |w| w.failed_loads, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, loads + 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A decode-side request aborted while it runs (its KV loaded and checked): its blocks are freed,
/// nothing else happens.
pub fn abort_running(m: &Matrix) {
    let (c, _net) = m.cluster("abort-running");
    let (hook, held) = holding_client("held");
    let mut c = c.with_client(hook);
    submit(&mut c, "held", 1, 1);
    let (rid, prompt, _, params) = take_held(&mut c, &held, &id("held-0"));
    add_to_decode(&mut c, (rid.clone(), prompt, 64, params));
    step_until(&mut c, "the request to run", |c| c.decode.state(&rid) == Some(&RequestState::Running));
    c.decode.abort(&rid);
    assert_eq!(c.decode.state(&rid), Some(&RequestState::Finished(FinishReason::Aborted)));
    run(&mut c);
    assert_eq!(c.decode.stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    assert!(c.decode.output_tokens(&rid).is_some_and(|t| t.len() < 64), "aborted before its last token");
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// Prefill-side aborts: a request aborted while queued on the prefill engine offers nothing and
/// holds nothing; a request the client aborts at the prefill engine after its params went out is
/// not freed by that (its hold belongs to its reader), and the decode engine reads it whole.
pub fn abort_on_prefill(m: &Matrix) {
    let (c, _net) = m.cluster("abort-prefill");
    let (hook, held) = holding_client("held");
    let mut c = c.with_client(hook);
    let queued = id("queued");
    let params = TransferParams { do_remote_decode: true, ..Default::default() };
    c.prefills[0]
        .add_request(queued.clone(), &prompt(7, PROMPT_LEN), 1, Some(params))
        .unwrap_or_else(|e| panic!("adding {queued}: {e}"));
    c.prefills[0].abort(&queued);
    assert_eq!(c.prefills[0].state(&queued), Some(&RequestState::Finished(FinishReason::Aborted)));

    submit(&mut c, "held", 1, 1);
    let request = take_held(&mut c, &held, &id("held-0"));
    let rid = request.0.clone();
    assert!(finished(&c.prefills[0], &rid), "{:?}", c.prefills[0].state(&rid));
    c.prefills[0].abort(&rid);
    assert!(finished(&c.prefills[0], &rid), "an abort after the offer changes nothing");
    add_to_decode(&mut c, request);
    run(&mut c);
    assert_finished(&c.decode, &[rid]);
    assert_eq!(c.decode.stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    assert!(c.prefills[0].take_transfer_params().is_empty(), "the queued abort offered nothing");
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A client submits the same offer twice at once (a copy of the params under another request
/// id): one load per offer, so exactly one of the two is read; the other fails before reading or
/// releasing anything; nothing leaks and the hold is released once.
pub fn duplicate_offer(m: &Matrix) {
    let (c, _net) = m.cluster("dup");
    let mut c = c.with_client(|request: ClientRequest| {
        let copy = (id(format!("{}-copy", request.0)), request.1.clone(), request.2, request.3.clone());
        vec![request, copy]
    });
    submit(&mut c, "dup", 1, 1);
    run(&mut c);
    let (a, b) = (id("dup-0"), id("dup-0-copy"));
    let (read, refused) = if finished(&c.decode, &a) { (a, b) } else { (b, a) };
    assert_finished(&c.decode, std::slice::from_ref(&read));
    // Any misuse of the connector fails with this kind; the message says it was the duplicate.
    let e = assert_failed(&c.decode, &refused, &[ErrorKind::InvalidArgument]);
    assert!(e.message().contains("already in flight"), "{refused}: {e}");
    assert_eq!(c.decode.stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    m.assert_per_rank(&c.decode, "reads_posted", |w| w.reads_posted, 1);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "stray_notifications", |w| w.stray_notifications, 0);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A client submits an offer again, with another prompt, after its load completed: the READ happens
/// (the decode engine cannot know), but the prefill worker answers its release "not held", so the
/// load fails [`ErrorKind::Expired`] and its bytes are not used; nothing leaks. (With the same
/// prompt the decode engine's prefix cache would serve it: a notify-only release, no READ.)
pub fn replayed_offer(m: &Matrix) {
    let (c, _net) = m.cluster("replay");
    let kept: Held = Arc::default();
    let keep = Arc::clone(&kept);
    let mut c = c.with_client(move |request: ClientRequest| {
        keep.lock().unwrap_or_else(PoisonError::into_inner).push(request.clone());
        vec![request]
    });
    let first = submit(&mut c, "orig", 1, 1);
    run(&mut c);
    assert_finished(&c.decode, &first);
    let (_, _, n, params) = kept.lock().unwrap_or_else(PoisonError::into_inner).remove(0);
    let replay = id("replay");
    add_to_decode(&mut c, (replay.clone(), prompt(2, PROMPT_LEN), n, params));
    run(&mut c);
    assert_failed(&c.decode, &replay, &[ErrorKind::Expired]);
    assert_eq!(
        c.decode.stats().blocks_verified,
        m.verified_per_load(PROMPT_BLOCKS),
        "the replay's bytes are not used"
    );
    m.assert_per_rank(&c.decode, "reads_posted", |w| w.reads_posted, 2);
    m.assert_per_rank(&c.decode, "lease_failures", |w| w.lease_failures, 1);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "stray_notifications", |w| w.stray_notifications, 1);
    m.assert_per_rank(&c.prefills[0], "hold_answers", |w| w.hold_answers, 2);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

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

        #[test]
        fn fault_matrix_runs_every_case() {
            let listed = [
                "late_reader", "prefill_restart", "prefill_restart_same_ports",
                "prefill_restart_unnamed_instance", "prefill_restart_is_safe", "decode_restart",
                "out_of_range_read", "layout_refusal", "abort_queued_on_decode",
                "abort_before_the_read", "abort_during_read", "abort_running", "abort_on_prefill",
                "duplicate_offer", "replayed_offer",
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
