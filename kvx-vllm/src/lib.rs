#![doc = include_str!("../README.md")]

mod memory;
mod scheduler;
mod worker;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pub use memory::TensorMemory;
pub use scheduler::Scheduler;
pub use worker::{Worker, WorkerOptions};

/// Adds kvx-vllm's classes to an extension module (each backend's module calls it).
pub fn add_classes(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<Scheduler>()?;
    module.add_class::<Worker>()?;
    module.add_class::<WorkerOptions>()?;
    Ok(())
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
