//! The worker-side connector (one per vLLM worker process): kvx-core's [`WorkerDriver`] over a
//! transfer agent the backend module creates, on a tokio runtime of its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvx_core::net::{NetConfig, SideChannel};
use kvx_core::{
    BlockId, ConnectorMetadata, ConnectorWorker, Error, ErrorKind, LayerCache, RemoteCoordinates, RequestId,
    SingleRank, TransferAgent, WorkerConfig, WorkerDriver, wire,
};
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
    /// Tensor-parallel size (kvx-vllm supports 1).
    pub world_size: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Model and dtype: peers must agree on it.
    pub compat_tag: String,
    /// Host the side channel binds.
    pub side_channel_host: String,
    /// Base port of the side channel; this worker binds `side_channel_port + rank`.
    pub side_channel_port: u16,
    /// Seconds a handshake may take.
    pub handshake_timeout_s: f64,
    /// Seconds the prefill side holds blocks for a reader that never comes.
    pub hold_timeout_s: f64,
    /// Threads of the worker's tokio runtime (side channel and handshakes).
    pub runtime_threads: usize,
    /// The deployment's shared key (authenticated mode), or none.
    pub auth_key: Option<String>,
}

#[pymethods]
impl WorkerOptions {
    #[new]
    #[pyo3(signature = (engine_id, block_size, side_channel_host, side_channel_port, *, rank = 0,
        world_size = 1, compat_tag = String::new(), handshake_timeout_s = 30.0, hold_timeout_s = 120.0,
        runtime_threads = 1, auth_key = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        engine_id: String,
        block_size: u32,
        side_channel_host: String,
        side_channel_port: u16,
        rank: u32,
        world_size: u32,
        compat_tag: String,
        handshake_timeout_s: f64,
        hold_timeout_s: f64,
        runtime_threads: usize,
        auth_key: Option<String>,
    ) -> Self {
        WorkerOptions {
            engine_id,
            rank,
            world_size,
            block_size,
            compat_tag,
            side_channel_host,
            side_channel_port,
            handshake_timeout_s,
            hold_timeout_s,
            runtime_threads,
            auth_key,
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
    /// Local blocks of each load handed to the workers, until it is reported (for vLLM's
    /// `get_block_ids_with_load_errors`).
    loading: HashMap<RequestId, Vec<BlockId>>,
}

/// kvx's worker-side connector for one vLLM worker process.
#[pyclass(module = "kvx_vllm")]
#[derive(Debug)]
pub struct Worker {
    /// `None` once closed. Declared before the runtime: dropped first.
    state: Mutex<Option<State>>,
    agent: Arc<dyn TransferAgent>,
    runtime: Option<Runtime>,
}

fn duration(secs: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs).map_err(|e| PyRuntimeError::new_err(format!("{what}: {e}")))
}

impl Worker {
    /// A worker over `agent` (which the backend module created, inside [`unpinned`] so that the
    /// transport's threads are not pinned to the engine thread's core): starts its runtime and
    /// binds its side channel at once, so a taken port fails here.
    pub fn create(options: &WorkerOptions, agent: Arc<dyn TransferAgent>) -> PyResult<Self> {
        if options.world_size != 1 {
            return Err(py_err(Error::new(
                ErrorKind::Unsupported,
                format!("kvx-vllm supports tensor-parallel size 1, not {}", options.world_size),
            )));
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
        let port = options
            .side_channel_port
            .checked_add(u16::try_from(options.rank).unwrap_or(u16::MAX))
            .ok_or_else(|| PyRuntimeError::new_err("side-channel port + rank overflows"))?;
        let host = options.side_channel_host.clone();
        let auth_key = crate::scheduler::auth_key(options.auth_key.as_deref())?;
        let net = NetConfig::with_key(auth_key.clone());
        let channel = runtime
            .block_on(async move { SideChannel::bind_with(&host, port, net).await })
            .map_err(py_err)?;
        let mut config = WorkerConfig::new(
            options.engine_id.clone().into(),
            options.rank,
            options.world_size,
            options.block_size,
        );
        config.compat_tag = options.compat_tag.clone();
        config.handshake_timeout = duration(options.handshake_timeout_s, "handshake_timeout_s")?;
        config.lease_duration = duration(options.hold_timeout_s, "hold_timeout_s")?;
        config.auth_key = auth_key;
        // Where this engine serves its payloads: a prefill engine answers its leases there.
        config.side_channel = Some(RemoteCoordinates {
            engine_id: options.engine_id.clone().into(),
            host: options.side_channel_host.clone(),
            port: options.side_channel_port,
        });
        let worker = ConnectorWorker::new(config, Arc::clone(&agent)).map_err(py_err)?;
        let driver =
            WorkerDriver::new(worker, Arc::new(channel), Arc::new(SingleRank), runtime.handle().clone());
        Ok(Worker {
            state: Mutex::new(Some(State { driver, loading: HashMap::new() })),
            agent,
            runtime: Some(runtime),
        })
    }

    fn with_state<T>(&self, f: impl FnOnce(&mut State) -> PyResult<T>) -> PyResult<T> {
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match guard.as_mut() {
            Some(state) => f(state),
            None => Err(PyRuntimeError::new_err("the kvx worker is closed")),
        }
    }
}

/// What [`Worker::get_finished`] returns: released holds, completed loads, and failed loads as
/// `(request id, its local block ids, reason)`.
type FinishedLists = (Vec<String>, Vec<String>, Vec<(String, Vec<BlockId>, String)>);

#[pymethods]
impl Worker {
    /// The backend's name.
    #[getter]
    fn backend(&self) -> String {
        self.agent.capabilities().backend.to_string()
    }

    /// This worker's instance (random at start, published in its payload). vLLM hands it to the
    /// engine's scheduler (`get_handshake_metadata`), which names it in its params.
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

    /// Starts this step's loads and holds from the scheduler's encoded metadata.
    fn start_load_kv(&self, metadata: &[u8]) -> PyResult<()> {
        let meta: ConnectorMetadata = wire::decode(metadata).map_err(py_err)?;
        self.with_state(|s| {
            for r in meta.reqs_to_recv.iter().filter(|r| !r.is_notify_only()) {
                s.loading.insert(r.request_id.clone(), r.local_block_ids.clone());
            }
            s.driver.start_load_kv(&meta);
            Ok(())
        })
    }

    /// What finished since the last call (also progresses the agent).
    fn get_finished(&self) -> PyResult<FinishedLists> {
        self.with_state(|s| {
            let finished = s.driver.get_finished().map_err(py_err)?;
            let mut failed = Vec::with_capacity(finished.failed_recving.len());
            for f in finished.failed_recving {
                let blocks = s.loading.remove(&f.request_id).unwrap_or_default();
                failed.push((f.request_id.as_str().to_owned(), blocks, f.reason));
            }
            let recving = finished
                .recving
                .into_iter()
                .map(|id| {
                    s.loading.remove(&id);
                    id.as_str().to_owned()
                })
                .collect();
            let sending = finished.sending.into_iter().map(|id| id.as_str().to_owned()).collect();
            Ok((sending, recving, failed))
        })
    }

    /// Progresses the agent (for backends without a progress thread, between steps).
    fn progress(&self) -> PyResult<()> {
        self.agent.progress().map_err(py_err)
    }

    /// Whether nothing is in flight or held.
    fn is_idle(&self) -> PyResult<bool> {
        self.with_state(|s| Ok(s.driver.is_idle()))
    }

    /// The worker's counters, and the sums of its latency samples since the last call.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        self.with_state(|s| {
            let w = s.driver.worker_mut();
            let (xfer, hs) = w.take_latencies();
            let st = w.stats();
            d.set_item("handshakes", st.handshakes)?;
            d.set_item("handshake_failures", st.handshake_failures)?;
            d.set_item("reads_posted", st.reads_posted)?;
            d.set_item("descriptors", st.descriptors)?;
            d.set_item("bytes_read", st.bytes_read)?;
            d.set_item("failed_loads", st.failed_loads)?;
            d.set_item("notify_only", st.notify_only)?;
            d.set_item("notifications", st.notifications)?;
            d.set_item("stray_notifications", st.stray_notifications)?;
            d.set_item("expired_holds", st.expired_holds)?;
            d.set_item("transfer_count", xfer.len())?;
            d.set_item("transfer_seconds", xfer.iter().map(Duration::as_secs_f64).sum::<f64>())?;
            d.set_item("handshake_seconds", hs.iter().map(Duration::as_secs_f64).sum::<f64>())?;
            Ok(())
        })?;
        Ok(d)
    }

    /// Deregisters everything and stops the side channel. Afterwards the caller may free the
    /// tensors. Idempotent.
    fn close(&mut self) {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner).take();
        drop(state);
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.close();
    }
}
