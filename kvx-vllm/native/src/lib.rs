//! The `kvx_vllm_native` extension module: kvx-vllm's classes, and workers over a kvx-ucx, a
//! kvx-nixl or a kvx-tcp agent, chosen by name. One process may use both native ones: kvx-ucx-sys
//! loads Debian's UCX apart from the UCX bundled in NIXL's wheel (the wheel's `libnixl_capi.so`
//! must be loadable for `nixl`); kvx-tcp needs no library.

use std::sync::Arc;
use std::time::Duration;

use kvx_core::TransferAgent;
use kvx_nixl::{NixlAgent, NixlConfig};
use kvx_tcp::{TcpAgent, TcpConfig};
use kvx_ucx::{ProgressThreadConfig, UcxAgent, UcxConfig};
use kvx_vllm::{Worker, WorkerOptions, auth_key, py_err, unpinned};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The backends `create_worker` takes.
const BACKENDS: [&str; 3] = ["ucx", "nixl", "tcp"];

/// A worker-side connector over an agent of `backend`.
///
/// - `ucx`: `progress_thread` progresses the agent in the background (a prefill engine must,
///   since vLLM's KV memory is not UCX-allocated and the target of a READ has to progress);
///   `transports`: as `UCX_TLS`, or None for UCX's choice.
/// - `nixl` (UCX plugin): `progress_thread` is NIXL's progress thread (it busy-spins a core; kvx
///   progresses the agent in every step), pausing `progress_delay_us` between rounds;
///   `num_threads`: the UCX backend's thread-pool engine (NIXL's `num_threads`; 0: none).
/// - `tcp` (kvx-tcp, plain TCP, nothing to install): the agent listens on the side channel's host
///   at a free port, which its handshake payload names, and authenticates peers with the
///   deployment's key like the side channel; `connections`: connections per peer (0: kvx-tcp's
///   default). Its I/O threads serve READs of this engine's memory whether or not the engine
///   steps.
///
/// An option of another backend is refused (`ValueError`), as is an unknown backend.
#[pyfunction]
#[pyo3(signature = (options, backend, progress_thread = false, transports = None, progress_delay_us = 0, num_threads = 0, connections = 0))]
fn create_worker(
    options: &WorkerOptions,
    backend: &str,
    progress_thread: bool,
    transports: Option<String>,
    progress_delay_us: u64,
    num_threads: u32,
    connections: usize,
) -> PyResult<Worker> {
    let name = format!("{}-{}", options.engine_id, options.rank);
    if backend != "tcp" && connections != 0 {
        return Err(PyValueError::new_err("connections is tcp's option"));
    }
    let agent: Arc<dyn TransferAgent> = match backend {
        "ucx" => {
            if progress_delay_us != 0 || num_threads != 0 {
                return Err(PyValueError::new_err("progress_delay_us and num_threads are nixl's options"));
            }
            // vLLM's engines always progress (a progress thread, or the connector's pump thread),
            // so endpoints can detect a failed peer: a dead engine's READs and notifications fail
            // at once.
            let mut config = UcxConfig::default().with_peer_failure_detection();
            if let Some(t) = transports {
                config = config.with_transports(t);
            }
            if progress_thread {
                config = config.with_progress_thread(ProgressThreadConfig::default());
            }
            // The progress thread starts here: off the engine thread's CPU pinning.
            Arc::new(unpinned(|| UcxAgent::with_config(name, &config))?.map_err(py_err)?)
        }
        "nixl" => {
            if transports.is_some() {
                return Err(PyValueError::new_err("transports is ucx's option"));
            }
            let config = NixlConfig::default()
                .with_progress_thread(progress_thread, Duration::from_micros(progress_delay_us))
                .with_threads(num_threads);
            // NIXL starts its threads here: off the engine thread's CPU pinning.
            Arc::new(unpinned(|| NixlAgent::new(name, &config))?.map_err(py_err)?)
        }
        "tcp" => {
            if progress_thread || transports.is_some() || progress_delay_us != 0 || num_threads != 0 {
                return Err(PyValueError::new_err(
                    "progress_thread, transports, progress_delay_us and num_threads are ucx's and nixl's options",
                ));
            }
            let mut config = TcpConfig::default()
                .with_host(options.side_channel_host.clone(), None)
                .with_auth_key(auth_key(options.auth_key.as_deref())?);
            if connections != 0 {
                config = config.with_connections(connections);
            }
            // Its I/O threads start here: off the engine thread's CPU pinning.
            Arc::new(unpinned(|| TcpAgent::with_config(name, &config))?.map_err(py_err)?)
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown backend {other:?}; expected one of {BACKENDS:?}"
            )));
        }
    };
    Worker::create(options, agent)
}

#[pymodule]
fn kvx_vllm_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    kvx_vllm::add_classes(m)?;
    m.add_function(wrap_pyfunction!(create_worker, m)?)?;
    m.add("BACKENDS", BACKENDS.to_vec())?;
    Ok(())
}
