//! The fault matrix (`kvx_testkit::matrix`) over kvx-tcp: prefill and decode engines with TP=2 in
//! one process, each rank a `TcpAgent` on 127.0.0.1 over host memory (as `kvx demo --backend tcp`
//! runs), every received byte checked; the faults inside the transport injected by the chaos layer
//! over it.
#![allow(clippy::unwrap_used)] // Test setup: a failed unwrap is a failed test.

use std::sync::Arc;

use kvx_core::TransferAgent;
use kvx_tcp::TcpAgent;
use kvx_testkit::matrix::Matrix;
use kvx_testkit::sim::SimBackend;

/// TCP agents named `{engine}-{rank}`, the default config. Nothing else keeps an agent alive, so a
/// dropped engine's agents (and their listeners and connections) really go.
fn backend() -> SimBackend {
    SimBackend::new(|engine, rank| {
        Ok(Arc::new(TcpAgent::new(format!("{engine}-{rank}"))?) as Arc<dyn TransferAgent>)
    })
}

kvx_testkit::fault_matrix!(|_case: &str| Some(Matrix::new(backend())));
