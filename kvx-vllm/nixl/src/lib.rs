//! The `kvx_vllm_nixl` extension module: kvx-vllm's classes with a kvx-nixl agent (the NIXL
//! wheel's `libnixl_capi.so` must be loadable). Never load it in a process that also loads
//! kvx-ucx (see kvx-vllm's README).

use std::sync::Arc;
use std::time::Duration;

use kvx_nixl::{NixlAgent, NixlConfig};
use kvx_vllm::{Worker, WorkerOptions, py_err, unpinned};
use pyo3::prelude::*;

/// A worker-side connector over a NIXL agent (UCX plugin). `progress_thread`: NIXL's progress
/// thread, off by default (it busy-spins a core); kvx progresses the agent in every step.
/// `num_threads`: the UCX backend's thread-pool engine (NIXL's `num_threads`; 0: none).
#[pyfunction]
#[pyo3(signature = (options, progress_thread = false, progress_delay_us = 0, num_threads = 0))]
fn create_worker(
    options: &WorkerOptions,
    progress_thread: bool,
    progress_delay_us: u64,
    num_threads: u32,
) -> PyResult<Worker> {
    let config = NixlConfig::default()
        .with_progress_thread(progress_thread, Duration::from_micros(progress_delay_us))
        .with_threads(num_threads);
    let name = format!("{}-{}", options.engine_id, options.rank);
    // NIXL starts its threads here: off the engine thread's CPU pinning.
    let agent = unpinned(|| NixlAgent::new(name, &config))?.map_err(py_err)?;
    Worker::create(options, Arc::new(agent))
}

#[pymodule]
fn kvx_vllm_nixl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    kvx_vllm::add_classes(m)?;
    m.add_function(wrap_pyfunction!(create_worker, m)?)?;
    m.add("BACKEND", "nixl")?;
    Ok(())
}
