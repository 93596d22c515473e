//! The fault matrix (`kvx_testkit::matrix`) on the loopback backend, TP=2 (the faults inside the
//! transport injected by the chaos layer over it), and at TP=1 and TP=4.

use std::sync::Arc;

use kvx_core::TransferAgent;
use kvx_loopback::Fabric;
use kvx_testkit::matrix::{self, Matrix};
use kvx_testkit::sim::SimBackend;

/// Loopback agents on a fresh fabric. Nothing else keeps them alive, so a dropped engine's agents
/// really go and a restarted engine can take their names again.
fn loopback() -> Matrix {
    let fabric = Fabric::new();
    Matrix::new(SimBackend::new(move |engine, rank| {
        Ok(Arc::new(fabric.agent(format!("{engine}-{rank}"))?) as Arc<dyn TransferAgent>)
    }))
}

kvx_testkit::fault_matrix!(|_case: &str| Some(loopback()));

/// The matrix at TP=1 and TP=4 too (TP=2 above): one case of each kind.
#[test]
fn other_tensor_parallel_sizes() {
    for tp in [1, 4] {
        let m = loopback().with_tp(tp);
        matrix::prefill_restart(&m);
        matrix::out_of_range_read(&m);
        matrix::abort_during_read(&m);
        matrix::duplicate_offer(&m);
    }
}
