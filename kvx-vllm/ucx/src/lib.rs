//! The `kvx_vllm_ucx` extension module: kvx-vllm's classes with a kvx-ucx agent. Never load it in
//! a process that also loads NIXL (see kvx-vllm's README).

use std::sync::Arc;

use kvx_ucx::{ProgressThreadConfig, UcxAgent, UcxConfig};
use kvx_vllm::{Worker, WorkerOptions, py_err, unpinned};
use pyo3::prelude::*;

/// A worker-side connector over a UCX agent. `progress_thread`: progress the agent in the
/// background (a prefill engine must, since vLLM's KV memory is not UCX-allocated and the target
/// of a READ has to progress); `transports`: as `UCX_TLS`, or None for UCX's choice.
#[pyfunction]
#[pyo3(signature = (options, progress_thread, transports = None))]
fn create_worker(
    options: &WorkerOptions,
    progress_thread: bool,
    transports: Option<String>,
) -> PyResult<Worker> {
    // vLLM's engines always progress (a progress thread, or the connector's pump thread), so
    // endpoints can detect a failed peer: a dead engine's READs and notifications fail at once.
    let mut config = UcxConfig::default().with_peer_failure_detection();
    if let Some(t) = transports {
        config = config.with_transports(t);
    }
    if progress_thread {
        config = config.with_progress_thread(ProgressThreadConfig::default());
    }
    let name = format!("{}-{}", options.engine_id, options.rank);
    // The progress thread starts here: off the engine thread's CPU pinning.
    let agent = unpinned(|| UcxAgent::with_config(name, &config))?.map_err(py_err)?;
    Worker::create(options, Arc::new(agent))
}

#[pymodule]
fn kvx_vllm_ucx(m: &Bound<'_, PyModule>) -> PyResult<()> {
    kvx_vllm::add_classes(m)?;
    m.add_function(wrap_pyfunction!(create_worker, m)?)?;
    m.add("BACKEND", "ucx")?;
    Ok(())
}
