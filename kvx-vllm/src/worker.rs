//! The worker-side connector (one per vLLM worker process): kvx-core's [`WorkerDriver`] over a
//! transfer agent the backend module creates, on a tokio runtime of its own.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvx_core::{
    BlockId, ConnectorMetadata, ConnectorWorker, EngineId, Error, LayerCache, MetadataExchange,
    NotificationWaker, RemoteCoordinates, RequestId, Samples, SingleRank, TransferAgent, WorkerConfig,
    WorkerStats, wire,
};
use kvx_etcd::{EtcdConfig, EtcdExchange};
use kvx_net::WorkerDriver;
use kvx_net::metrics::{Metrics, MetricsServer, SideChannelMetrics, WorkerMetrics};
use kvx_net::{NetConfig, SideChannel};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::runtime::Runtime;

use crate::affinity::unpinned;
use crate::memory::TensorMemory;
use crate::py_err;

/// Settings of one worker-side connector.
#[pyclass(module = "kvx_vllm", get_all, set_all)]
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// This engine.
    pub engine_id: String,
    /// Tensor-parallel rank of this worker.
    pub rank: u32,
    /// Tensor-parallel size.
    pub world_size: u32,
    /// KV heads of the whole model (vLLM's total KV heads); `None`: this rank's cache's heads
    /// times `world_size`.
    pub kv_heads: Option<u32>,
    /// The engine's instance, the same on every rank (rank 0 draws it and vLLM's TP group
    /// broadcasts it); `None`: drawn by this worker (TP 1).
    pub instance: Option<u64>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Model and dtype: peers must agree on it.
    pub compat_tag: String,
    /// Host the side channel binds, and the host peers reach it at.
    pub side_channel_host: String,
    /// Base port of the side channel; this worker binds `side_channel_port + rank`.
    pub side_channel_port: u16,
    /// Seconds a handshake may take.
    pub handshake_timeout_s: f64,
    /// The deployment's lease (`kv_lease_duration`), seconds: a prefill hold that no reader
    /// released and no heartbeat renewed for this long is freed.
    pub lease_duration_s: f64,
    /// Threads of the worker's tokio runtime (side channel and handshakes).
    pub runtime_threads: usize,
    /// The deployment's shared key (authenticated mode), or none.
    pub auth_key: Option<String>,
    /// Base port of the Prometheus `/metrics` endpoint on `side_channel_host`: this worker serves
    /// on `metrics_port + rank` (0: a free port, see `Worker.metrics_address`). None: no endpoint.
    pub metrics_port: Option<u16>,
    /// How peers find this worker's payload: `None` or `"tcp"`, the side channel; an
    /// `etcd://HOST:PORT[,HOST:PORT]` URL, that etcd cluster (the side channel is not bound).
    pub discovery: Option<String>,
}

impl WorkerOptions {
    /// The options of a worker of engine `engine_id` whose side channel binds
    /// `side_channel_host:side_channel_port` (plus its rank), with every other option at its
    /// default: rank 0 of 1, the heads of this rank's cache, an instance drawn by the worker, no
    /// compatibility tag, 30 s handshakes and leases, one runtime thread, no key, no metrics
    /// endpoint, TCP discovery. Set the others with struct update syntax.
    pub fn new(
        engine_id: impl Into<String>,
        block_size: u32,
        side_channel_host: impl Into<String>,
        side_channel_port: u16,
    ) -> Self {
        WorkerOptions {
            engine_id: engine_id.into(),
            rank: 0,
            world_size: 1,
            kv_heads: None,
            instance: None,
            block_size,
            compat_tag: String::new(),
            side_channel_host: side_channel_host.into(),
            side_channel_port,
            handshake_timeout_s: 30.0,
            lease_duration_s: 30.0,
            runtime_threads: 1,
            auth_key: None,
            metrics_port: None,
            discovery: None,
        }
    }
}

#[pymethods]
impl WorkerOptions {
    /// The same as [`WorkerOptions::new`], in Python: the four essential arguments, then any
    /// other option by keyword (`None`, or left out: its default).
    #[new]
    #[pyo3(signature = (engine_id, block_size, side_channel_host, side_channel_port, *, rank = None,
        world_size = None, kv_heads = None, instance = None, compat_tag = None, handshake_timeout_s = None,
        lease_duration_s = None, runtime_threads = None, auth_key = None, metrics_port = None,
        discovery = None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments.
    fn py_new(
        engine_id: String,
        block_size: u32,
        side_channel_host: String,
        side_channel_port: u16,
        rank: Option<u32>,
        world_size: Option<u32>,
        kv_heads: Option<u32>,
        instance: Option<u64>,
        compat_tag: Option<String>,
        handshake_timeout_s: Option<f64>,
        lease_duration_s: Option<f64>,
        runtime_threads: Option<usize>,
        auth_key: Option<String>,
        metrics_port: Option<u16>,
        discovery: Option<String>,
    ) -> Self {
        let defaults = WorkerOptions::new(engine_id, block_size, side_channel_host, side_channel_port);
        WorkerOptions {
            rank: rank.unwrap_or(defaults.rank),
            world_size: world_size.unwrap_or(defaults.world_size),
            kv_heads,
            instance,
            compat_tag: compat_tag.unwrap_or(defaults.compat_tag.clone()),
            handshake_timeout_s: handshake_timeout_s.unwrap_or(defaults.handshake_timeout_s),
            lease_duration_s: lease_duration_s.unwrap_or(defaults.lease_duration_s),
            runtime_threads: runtime_threads.unwrap_or(defaults.runtime_threads),
            auth_key,
            metrics_port,
            discovery,
            ..defaults
        }
    }

    fn __repr__(&self) -> String {
        // The key is a secret: say only whether there is one.
        let redacted =
            WorkerOptions { auth_key: self.auth_key.as_ref().map(|_| "<redacted>".into()), ..self.clone() };
        format!("{redacted:?}")
    }
}

#[derive(Debug)]
struct State {
    driver: WorkerDriver,
    /// Local blocks of each load handed to the workers, every KV-cache group's, until it is
    /// reported (for vLLM's `get_block_ids_with_load_errors`, which the connector answers only
    /// with one group: vLLM's block ids name a block of a group, not of the request).
    loading: HashMap<RequestId, Vec<BlockId>>,
    /// What finished while the pump stepped the worker, for the engine's next `get_finished`.
    pending: FinishedLists,
    /// When the engine last called in.
    last_call: Instant,
    /// With a `/metrics` endpoint: what brings it up to date at each step.
    metrics: Option<StepMetrics>,
}

/// The metrics of one worker and of its TCP side channel (none with etcd discovery), updated at
/// each step.
#[derive(Debug)]
struct StepMetrics {
    worker: WorkerMetrics,
    side_channel: Option<(SideChannelMetrics, Arc<SideChannel>)>,
}

impl StepMetrics {
    fn observe(&mut self, worker: &ConnectorWorker) {
        self.worker.observe(worker);
        if let Some((metrics, channel)) = &mut self.side_channel {
            metrics.observe(&channel.stats());
        }
    }
}

impl State {
    /// Steps the worker (notifications, transfers, timeouts) and adds what finished to
    /// `pending`, with the local blocks of the failed loads.
    fn collect(&mut self) -> kvx_core::Result<()> {
        let finished = self.driver.get_finished()?;
        let (sending, recving, failed) = &mut self.pending;
        for f in finished.failed_recving {
            let blocks = self.loading.remove(&f.request_id).unwrap_or_default();
            failed.push((f.request_id.as_str().to_owned(), blocks, f.error.to_string()));
        }
        for id in finished.recving {
            self.loading.remove(&id);
            recving.push(id.as_str().to_owned());
        }
        sending.extend(finished.sending.into_iter().map(|id| id.as_str().to_owned()));
        if let Some(m) = &mut self.metrics {
            m.observe(self.driver.worker());
        }
        Ok(())
    }
}

type SharedState = Arc<Mutex<Option<State>>>;

/// How often the pump thread runs at least (see [`Worker`]).
const PUMP_PERIOD: Duration = Duration::from_millis(10);

/// After this long without a call from the engine, the pump steps the worker itself.
const ENGINE_QUIET: Duration = Duration::from_millis(50);

/// kvx's worker-side connector for one vLLM worker process.
///
/// The engine calls it in every step, but the network must not wait for the engine: vLLM stops
/// stepping when it has no request (a prefill engine that has just reported a hold released may
/// never step again while its answer to the decode worker, whether the hold lived through the
/// READ, still waits for a handshake with that decode engine), and an engine's step loop can
/// stall (on a loaded 2-vCPU machine, vLLM's worker and scheduler processes were measured
/// waiting on each other for tens of seconds). So a pump thread, every [`PUMP_PERIOD`], hands
/// finished handshakes to the worker (the messages and READs that waited for them go out), and
/// when the engine has not called for [`ENGINE_QUIET`], steps the worker as `get_finished`
/// would: releases are answered, leases renewed, READs completed and confirmed, timeouts
/// applied. What finished then waits for the engine's next `get_finished`. Where the agent
/// receives notifications on a thread of its own (kvx-ucx with its progress thread, kvx-tcp;
/// `TransferAgent::wake_on_notification`), each one wakes the pump, which steps the worker at
/// once, engine busy or not: a release is answered, and an answer taken, within the transport's
/// latency instead of up to [`ENGINE_QUIET`] later.
#[pyclass(module = "kvx_vllm")]
#[derive(Debug)]
pub struct Worker {
    /// `None` once closed. Declared before the runtime: dropped first.
    state: SharedState,
    /// Wakes the pump thread, or stops it.
    pump_signal: Arc<PumpSignal>,
    pump: Option<JoinHandle<()>>,
    /// `None` once closed: the agent goes with the last reference.
    agent: Option<Arc<dyn TransferAgent>>,
    /// The backend's name (kept past close).
    backend: &'static str,
    /// The `/metrics` endpoint, if asked for; stopped before the runtime.
    metrics: Option<MetricsServer>,
    runtime: Option<Runtime>,
}

/// What wakes the pump thread before its [`PUMP_PERIOD`]: a notification the agent received, or
/// the worker shutting down.
#[derive(Debug, Default)]
struct PumpSignal {
    /// (a notification came since the pump last woke, stop)
    flags: Mutex<(bool, bool)>,
    cond: Condvar,
}

impl PumpSignal {
    fn set(&self, f: impl FnOnce(&mut (bool, bool))) {
        f(&mut self.flags.lock().unwrap_or_else(PoisonError::into_inner));
        self.cond.notify_one();
    }

    /// Waits at most `timeout` for a notification or the stop: whether a notification came
    /// (cleared), and whether to stop.
    fn wait(&self, timeout: Duration) -> (bool, bool) {
        let flags = self.flags.lock().unwrap_or_else(PoisonError::into_inner);
        let (mut flags, _) = self
            .cond
            .wait_timeout_while(flags, timeout, |(notified, stop)| !*notified && !*stop)
            .unwrap_or_else(PoisonError::into_inner);
        (std::mem::take(&mut flags.0), flags.1)
    }
}

/// The pump thread: every [`PUMP_PERIOD`] until stopped (or the state is gone), feeds finished
/// handshakes to the worker and starts the network work that waited for them (an empty step's
/// metadata does exactly that); when the engine is quiet, or a notification came, steps the
/// worker for it.
fn run_pump(state: &Weak<Mutex<Option<State>>>, signal: &PumpSignal) {
    let idle = ConnectorMetadata::default();
    loop {
        let (notified, stop) = signal.wait(PUMP_PERIOD);
        let Some(state) = state.upgrade().filter(|_| !stop) else { return };
        let mut guard = state.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(s) = guard.as_mut() else { return };
        if !notified && s.last_call.elapsed() < ENGINE_QUIET {
            s.driver.start_load_kv(&idle);
        } else if let Err(e) = s.collect() {
            tracing::warn!(error = %e, "kvx's pump could not step the worker");
        }
    }
}

/// `base + rank`, the port of this rank's `what` endpoint.
fn plus_rank(base: u16, rank: u32, what: &str) -> PyResult<u16> {
    u16::try_from(rank)
        .ok()
        .and_then(|r| base.checked_add(r))
        .ok_or_else(|| PyRuntimeError::new_err(format!("{what} port {base} + rank {rank} overflows")))
}

fn duration(secs: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs).map_err(|e| PyRuntimeError::new_err(format!("{what}: {e}")))
}

impl Worker {
    /// A worker over `agent` (which the backend module created, inside [`unpinned`] so that the
    /// transport's threads are not pinned to the engine thread's core): starts its runtime and
    /// binds its side channel at once, so a taken port fails here.
    pub fn create(options: &WorkerOptions, agent: Arc<dyn TransferAgent>) -> PyResult<Self> {
        if options.world_size > 1 && options.instance.is_none() {
            return Err(py_err(Error::invalid_argument(format!(
                "rank {} of {}: the ranks of an engine share one instance; none was given",
                options.rank, options.world_size
            ))));
        }
        // Started off the engine thread's CPU pinning (see `affinity`).
        let runtime = unpinned(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(options.runtime_threads.max(1))
                .thread_name("kvx-vllm")
                .enable_all()
                .build()
        })?
        .map_err(|e| PyRuntimeError::new_err(format!("starting the tokio runtime: {e}")))?;
        let auth_key = crate::scheduler::auth_key(options.auth_key.as_deref())?;
        let engine_id: EngineId = options.engine_id.clone().into();
        // This engine's own coordinates, where this worker's payload is published: a decode
        // worker names them in each READ's release, and the prefill worker answers there whether
        // its hold lived through the READ (set on both roles; only a decode worker uses it).
        // The TCP side channel, when there is one, also feeds the metrics its server's counters.
        let (exchange, own, channel): (Arc<dyn MetadataExchange>, _, _) =
            match crate::discovery::etcd_url(options.discovery.as_deref())? {
                Some(url) => {
                    let config = EtcdConfig { auth_key: auth_key.clone(), ..EtcdConfig::new(url) };
                    let connect = EtcdExchange::connect(config, &engine_id, options.rank);
                    let exchange = runtime.block_on(connect).map_err(py_err)?;
                    (Arc::new(exchange), RemoteCoordinates::by_id(engine_id.clone()), None)
                }
                None => {
                    let port = plus_rank(options.side_channel_port, options.rank, "side-channel")?;
                    let host = options.side_channel_host.clone();
                    let net = NetConfig::with_key(auth_key.clone());
                    let channel = Arc::new(
                        runtime
                            .block_on(async move { SideChannel::bind_with(&host, port, net).await })
                            .map_err(py_err)?,
                    );
                    let own = RemoteCoordinates::at(
                        engine_id.clone(),
                        options.side_channel_host.clone(),
                        options.side_channel_port,
                    );
                    (Arc::clone(&channel) as Arc<dyn MetadataExchange>, own, Some(channel))
                }
            };
        let mut config = WorkerConfig::new(
            options.engine_id.clone().into(),
            options.rank,
            options.world_size,
            options.block_size,
        );
        config.compat_tag = options.compat_tag.clone();
        config.kv_heads = options.kv_heads;
        config.instance = options.instance;
        config.handshake_timeout = duration(options.handshake_timeout_s, "handshake_timeout_s")?;
        config.lease_duration = crate::scheduler::lease_duration(options.lease_duration_s)?;
        config.auth_key = auth_key;
        config.side_channel = Some(own);
        let worker = ConnectorWorker::new(config, Arc::clone(&agent)).map_err(py_err)?;
        let (metrics, step_metrics) = match options.metrics_port {
            Some(base) => {
                let port = if base == 0 { 0 } else { plus_rank(base, options.rank, "metrics")? };
                let registry = Metrics::new();
                let server = runtime
                    .block_on(kvx_net::metrics::serve(&options.side_channel_host, port, registry.registry()))
                    .map_err(py_err)?;
                let mut step = StepMetrics {
                    worker: registry.worker(&options.engine_id, options.rank),
                    side_channel: channel
                        .map(|channel| (registry.side_channel(&options.engine_id, options.rank), channel)),
                };
                step.observe(&worker);
                (Some(server), Some(step))
            }
            None => (None, None),
        };
        let driver = WorkerDriver::new(worker, exchange, Arc::new(SingleRank), runtime.handle().clone());
        let state: SharedState = Arc::new(Mutex::new(Some(State {
            driver,
            loading: HashMap::new(),
            pending: FinishedLists::default(),
            last_call: Instant::now(),
            metrics: step_metrics,
        })));
        let pump_signal = Arc::new(PumpSignal::default());
        let wake = pump_signal.clone();
        let woken =
            agent.wake_on_notification(NotificationWaker::new(move || wake.set(|flags| flags.0 = true)));
        tracing::debug!(woken, "kvx's pump: woken by each notification");
        let (weak, signal) = (Arc::downgrade(&state), pump_signal.clone());
        // Started off the engine thread's CPU pinning, as kvx's other threads.
        let pump = unpinned(move || {
            std::thread::Builder::new().name("kvx-vllm-pump".into()).spawn(move || run_pump(&weak, &signal))
        })?
        .map_err(|e| PyRuntimeError::new_err(format!("starting kvx's pump thread: {e}")))?;
        let backend = agent.capabilities().backend;
        Ok(Worker {
            state,
            pump_signal,
            pump: Some(pump),
            agent: Some(agent),
            backend,
            metrics,
            runtime: Some(runtime),
        })
    }

    fn with_state<T>(&self, f: impl FnOnce(&mut State) -> PyResult<T>) -> PyResult<T> {
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match guard.as_mut() {
            Some(state) => f(state),
            None => Err(closed()),
        }
    }

    /// Stops the pump thread, closes the connector worker (its READs cancelled or released, and
    /// every registration, descriptor list and peer given back to the agent), drops this
    /// object's reference to the agent (the agent's own teardown ends whatever the worker could
    /// not give back) and stops the side channel. Afterwards nothing of kvx keeps the tensors
    /// registered, though this object lives on. Idempotent.
    fn shut_down(&mut self) {
        self.pump_signal.set(|flags| flags.1 = true);
        if let Some(pump) = self.pump.take() {
            let _ = pump.join();
        }
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(mut state) = state {
            if let Err(e) = state.driver.worker_mut().close() {
                tracing::warn!(error = %e, "closing kvx's worker: the agent ends the rest when it goes");
            }
        }
        self.agent = None;
        drop(self.metrics.take());
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

fn closed() -> PyErr {
    PyRuntimeError::new_err("the kvx worker is closed")
}

/// One completed load's stages, as [`Worker::take_load_times`] returns them: `(request id,
/// admitted, posted, read_done, confirmed)`, seconds since the Unix epoch.
type LoadStages = (String, f64, f64, f64, f64);

/// What [`Worker::get_finished`] returns: released holds, completed loads, and failed loads as
/// `(request id, its local block ids, reason)`.
type FinishedLists = (Vec<String>, Vec<String>, Vec<(String, Vec<BlockId>, String)>);

#[pymethods]
impl Worker {
    /// The backend's name.
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// This worker's instance (drawn at start, published in its handshake payload): the engine's
    /// scheduler names it in the params it hands out.
    #[getter]
    fn instance(&self) -> PyResult<u64> {
        self.with_state(|s| Ok(s.driver.worker().instance()))
    }

    /// Registers every layer's cache, given as `(data_ptr, nbytes, shape, element_size)` in
    /// layer order, and publishes the handshake payload. Returns the layout's kind.
    ///
    /// The caller keeps the tensors alive until [`close`](Self::close).
    fn register_kv_caches(&self, layers: Vec<(u64, u64, Vec<u64>, u64)>) -> PyResult<String> {
        let caches: Vec<LayerCache> = layers
            .into_iter()
            .map(|(addr, len, shape, elem_size)| LayerCache {
                // SAFETY: the Python connector passes each tensor's own data_ptr and nbytes and
                // holds a reference to every tensor until it closes this worker (documented on
                // `register_kv_caches` and done by kvx_vllm.connector), so the memory outlives
                // every registration.
                memory: Arc::new(unsafe { TensorMemory::new(addr, len) }),
                shape,
                elem_size,
                window: None,
            })
            .collect();
        self.with_state(|s| {
            s.driver.register_kv_caches(&caches).map_err(py_err)?;
            Ok(s.driver.worker().layout().map(|l| format!("{:?}", l.kind)).unwrap_or_default())
        })
    }

    /// Starts this step's loads (READs in pull mode, registrations in push mode) and holds from
    /// the scheduler's encoded metadata; returns the requests whose loads it started and those
    /// whose push holds it took (for the connector's latency trace).
    fn start_load_kv(&self, metadata: &[u8]) -> PyResult<(Vec<String>, Vec<String>)> {
        let meta: ConnectorMetadata = wire::decode(metadata).map_err(py_err)?;
        self.with_state(|s| {
            s.last_call = Instant::now();
            let mut started = Vec::new();
            let loads = meta.reqs_to_recv.iter().chain(&meta.reqs_to_register);
            for r in loads.filter(|r| !r.is_notify_only()) {
                let blocks = r.local_block_ids.iter().flat_map(|g| g.ids.iter().copied()).collect();
                s.loading.insert(r.request_id.clone(), blocks);
                started.push(r.request_id.as_str().to_owned());
            }
            s.driver.start_load_kv(&meta);
            let held = meta.reqs_to_push.iter().map(|h| h.request_id.as_str().to_owned()).collect();
            Ok((started, held))
        })
    }

    /// What finished since the last call, including what the pump thread collected while the
    /// engine did not call (also progresses the agent).
    fn get_finished(&self) -> PyResult<FinishedLists> {
        self.with_state(|s| {
            s.last_call = Instant::now();
            s.collect().map_err(py_err)?;
            Ok(std::mem::take(&mut s.pending))
        })
    }

    /// Progresses the agent (for backends without a progress thread, between steps).
    fn progress(&self) -> PyResult<()> {
        self.agent.as_ref().ok_or_else(closed)?.progress().map_err(py_err)
    }

    /// Where this worker serves `/metrics` (`host:port`), or None without `metrics_port`.
    #[getter]
    fn metrics_address(&self) -> Option<String> {
        self.metrics.as_ref().map(|m| m.local_addr().to_string())
    }

    /// Whether nothing is in flight or held.
    fn is_idle(&self) -> PyResult<bool> {
        self.with_state(|s| Ok(s.driver.is_idle()))
    }

    /// The worker's counters since it started (keys: `WORKER_COUNTERS`), and its latency samples
    /// since the last call: for each key of `WORKER_TIMINGS` (`read`: from posting a READ to the
    /// step that found it done, `transfer`: to the prefill engine's confirmation, `handshake`,
    /// `post_wait`: from a load's admission to its READ's post, `confirm`: from the READ done to
    /// the confirmation), `<key>_count`, `<key>_seconds` (their sum) and `<key>_max_seconds`. (The
    /// `/metrics` endpoint's histograms are not affected by this call.)
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        self.with_state(|s| {
            let w = s.driver.worker_mut();
            let st = w.stats();
            for c in WorkerStats::COUNTERS {
                d.set_item(c.key, (c.read)(st))?;
            }
            for t in WorkerStats::TIMINGS {
                let samples = (t.read)(st);
                d.set_item(format!("{}_count", t.key), samples.count())?;
                d.set_item(format!("{}_seconds", t.key), sum_estimate(samples))?;
                d.set_item(format!("{}_max_seconds", t.key), samples.max().as_secs_f64())?;
            }
            w.take_latencies();
            Ok(())
        })?;
        Ok(d)
    }

    /// The stages of the loads completed since the last call (at most the last 1024), oldest
    /// first, as `(request id, admitted, posted, read_done, confirmed)`: when the step handed the
    /// load to the worker, its READ was posted, a step found the READ done, and a step took the
    /// prefill engine's confirmation (the load finished), each in seconds since the Unix epoch
    /// (this process's wall clock, comparable with Python's `time.time()`).
    fn take_load_times(&self) -> PyResult<Vec<LoadStages>> {
        self.with_state(|s| {
            let (now, wall) = (Instant::now(), unix_seconds(SystemTime::now()));
            let at = |t: Instant| wall - now.saturating_duration_since(t).as_secs_f64();
            let times = s.driver.worker_mut().take_load_times();
            Ok(times
                .into_iter()
                .map(|t| {
                    let id = t.request_id.as_str().to_owned();
                    (id, at(t.admitted), at(t.posted), at(t.read_done), at(t.confirmed))
                })
                .collect())
        })
    }

    /// The READs completed and confirmed since the last call, oldest first, as vLLM's
    /// NixlConnector records each transfer: `(seconds from post to done, bytes, descriptors)`.
    fn take_transfers(&self) -> PyResult<Vec<(f64, u64, u64)>> {
        self.with_state(|s| {
            let transfers = s.driver.worker_mut().take_transfers();
            Ok(transfers.into_iter().map(|t| (t.duration.as_secs_f64(), t.bytes, t.descriptors)).collect())
        })
    }

    /// Stops the pump thread, closes the connector (every READ cancelled or released, every
    /// registration given back) and drops the agent, then stops the side channel; without the
    /// GIL, since an agent's teardown may wait for its transfers (bounded). Afterwards the caller
    /// may free the tensors. Idempotent.
    fn close(&mut self, py: Python<'_>) {
        py.allow_threads(|| self.shut_down());
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Adds the module's `WORKER_COUNTERS` and `WORKER_TIMINGS`: the keys of [`Worker::stats`] with
/// their help texts, as `(key, help)` pairs ([`WorkerStats::COUNTERS`] and
/// [`WorkerStats::TIMINGS`]), from which the Python connector defines vLLM's metrics.
pub(crate) fn add_stat_keys(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let counters: Vec<_> = WorkerStats::COUNTERS.iter().map(|c| (c.key, c.help)).collect();
    let timings: Vec<_> = WorkerStats::TIMINGS.iter().map(|t| (t.key, t.help)).collect();
    module.add("WORKER_COUNTERS", counters)?;
    module.add("WORKER_TIMINGS", timings)
}

/// `t` in seconds since the Unix epoch (0 before it).
fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// The sum of all the samples that came: exact while the reservoir kept every one, otherwise
/// the kept samples' mean times their count.
fn sum_estimate(samples: &Samples) -> f64 {
    let kept = samples.kept();
    let sum: f64 = kept.iter().map(Duration::as_secs_f64).sum();
    if kept.is_empty() || kept.len() as u64 == samples.count() {
        sum
    } else {
        sum / kept.len() as f64 * samples.count() as f64
    }
}

#[cfg(test)]
mod tests;
