#![doc = include_str!("../README.md")]

mod affinity;
mod discovery;
mod memory;
mod scheduler;
mod worker;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pub use affinity::unpinned;
pub use memory::TensorMemory;
pub use scheduler::{Scheduler, auth_key, side_channel_host_warning, vllm_block_groups};
pub use worker::{Worker, WorkerOptions};

/// Adds kvx-vllm's classes, `side_channel_host_warning`, `vllm_block_groups` and the keys of
/// `Worker.stats()` (`WORKER_COUNTERS`, `WORKER_TIMINGS`) to an extension module (each backend's
/// module calls it), and sends kvx's `tracing` events to stderr when `KVX_LOG` is set (a filter
/// such as `debug` or `kvx_core=debug`).
pub fn add_classes(module: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    module.add_class::<Scheduler>()?;
    module.add_class::<Worker>()?;
    module.add_class::<WorkerOptions>()?;
    module.add_function(wrap_pyfunction!(side_channel_host_warning, module)?)?;
    module.add_function(wrap_pyfunction!(vllm_block_groups, module)?)?;
    worker::add_stat_keys(module)
}

/// A kvx error as a Python exception: `ValueError` for bad arguments and bad peer data,
/// `RuntimeError` otherwise. The message names the kind.
pub fn py_err(e: kvx_core::Error) -> PyErr {
    use kvx_core::ErrorKind;
    match e.kind() {
        ErrorKind::InvalidArgument | ErrorKind::InvalidPeerData | ErrorKind::Wire => {
            PyValueError::new_err(e.to_string())
        }
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Installs a stderr subscriber for kvx's `tracing` events when `KVX_LOG` names a filter; a
/// process that already has a subscriber keeps it.
fn init_logging() {
    if let Ok(filter) = std::env::var("KVX_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init();
    }
}
