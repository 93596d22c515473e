//! The fault matrix (`kvx_testkit::matrix`) over the real NIXL library (UCX backend): prefill and
//! decode engines with TP=2 in one process, each rank a `NixlAgent` over host memory (as
//! `kvx demo --backend nixl` runs), every received byte checked. Without NIXL each case prints a
//! loud SKIP, or fails with `KVX_REQUIRE_NIXL=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by unwrapping.

mod common;

use std::sync::Arc;

use kvx_core::TransferAgent;
use kvx_nixl::{NixlAgent, NixlConfig};
use kvx_testkit::matrix::Matrix;
use kvx_testkit::sim::SimBackend;

/// NIXL agents named `{engine}-{rank}`, NIXL's defaults, host memory. Nothing else keeps an
/// agent alive, so a dropped engine's agents really go.
fn backend() -> SimBackend {
    SimBackend::new(|engine, rank| {
        let agent = NixlAgent::new(format!("{engine}-{rank}"), &NixlConfig::default())?;
        Ok(Arc::new(agent) as Arc<dyn TransferAgent>)
    })
}

fn setup(case: &str) -> Option<Matrix> {
    common::nixl_or_skip(case).then(|| Matrix::new(backend()))
}

// NIXL refuses to post a READ to a dropped agent ("postXferReq: remote agent ... was disconnected
// after transfer request creation", NIXL_ERR_BACKEND from `post`): kvx-core handles that as a
// failed READ (`prefill_restart_unnamed_instance`).
kvx_testkit::fault_matrix!(setup);
