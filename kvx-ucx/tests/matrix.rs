//! The fault matrix (`kvx_testkit::matrix`) over real UCX: prefill and decode engines with TP=2 in
//! one process, each rank a `UcxAgent` over UCX's default transports whose KV pools UCX allocates
//! (as `kvx demo --backend ucx` runs), every received byte checked.
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use kvx_core::{EngineId, Error, ErrorKind, TransferAgent};
use kvx_testkit::conformance::TestBuffer;
use kvx_testkit::matrix::Matrix;
use kvx_testkit::sim::SimBackend;
use kvx_ucx::UcxAgent;

/// UCX agents named `{engine}-{rank}`, their KV pools allocated by UCX. The registry keeps no
/// agent alive (it only finds a rank's agent for its memory), so a dropped engine's agents, UCP
/// workers and pools really go.
fn backend() -> SimBackend {
    type Agents = Mutex<HashMap<(EngineId, u32), Weak<UcxAgent>>>;
    let agents: Arc<Agents> = Arc::default();
    let created = Arc::clone(&agents);
    SimBackend::new(move |engine, rank| {
        let agent = Arc::new(UcxAgent::new(format!("{engine}-{rank}"))?);
        created.lock().unwrap().insert((engine.clone(), rank), Arc::downgrade(&agent));
        Ok(agent as Arc<dyn TransferAgent>)
    })
    .with_memory(move |engine, rank, len| {
        let agent = agents.lock().unwrap().get(&(engine.clone(), rank)).and_then(Weak::upgrade);
        let agent =
            agent.ok_or_else(|| Error::new(ErrorKind::State, format!("no UCX agent for {engine} {rank}")))?;
        Ok(TestBuffer::new(agent.alloc_memory(len)?))
    })
}

// Over shared memory (these UCX-allocated pools), a READ of a dropped engine's agent completes at
// once, copying the dead engine's pages (the reader's mapping of them outlives their owner), and
// its release goes into the dead worker's FIFO without an error: kvx-ucx creates its endpoints
// without an error-handling mode (UCP_ERR_HANDLING_MODE_NONE), and in one process UCX could not
// tell a dropped worker anyway. Only the instance in the params keeps the decode workers from
// reading through that connection; without it no answer comes, the loads fail "timed out" after
// confirm_timeout (10 s) and their holds at the new engine expire. The confirmation keeps every
// wrong byte out (`prefill_restart_is_safe`).
kvx_testkit::fault_matrix!(|_case: &str| Some(Matrix::new(backend())); ignore [
    prefill_restart_unnamed_instance: "over shared memory UCX completes a READ of a dropped agent \
        with its stale bytes and loses its release: with params that name no instance, the \
        requests after a prefill restart fail 'timed out' instead of being posted again",
]);

/// The same matrix over UCX's TCP transport only (a deployment without shared memory or RDMA),
/// with heap memory that each agent's progress thread serves.
mod tcp {
    use super::*;
    use kvx_ucx::{ProgressThreadConfig, UcxConfig};

    fn tcp_backend() -> SimBackend {
        SimBackend::new(move |engine, rank| {
            let config = UcxConfig::default()
                .with_transports("tcp")
                .with_peer_failure_detection()
                .with_progress_thread(ProgressThreadConfig::default());
            Ok(Arc::new(UcxAgent::with_config(format!("{engine}-{rank}"), &config)?)
                as Arc<dyn TransferAgent>)
        })
    }

    // Over TCP, UCX fails the READ of a dropped agent at post ("ucp_get_nbx: Endpoint timeout"):
    // kvx-core handles that as a failed READ (`prefill_restart_unnamed_instance`).
    kvx_testkit::fault_matrix!(|_case: &str| Some(Matrix::new(tcp_backend())));
}
