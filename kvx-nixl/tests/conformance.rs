//! The whole kvx conformance suite against the real NIXL library: two NixlAgents in one process,
//! UCX backend, host memory. Once with the concrete type, once through `Arc<dyn TransferAgent>`,
//! then with NIXL's progress thread and with its UCX thread-pool engine.
//! The suite's default harness progresses the target while the initiator polls, which two NIXL
//! agents in one process need. Without NIXL: a loud SKIP, or a failure with `KVX_REQUIRE_NIXL=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by unwrapping.

mod common;

use std::sync::Arc;

use kvx_core::TransferAgent;
use kvx_nixl::{NixlAgent, NixlConfig};
use kvx_testkit::conformance::{Pair, check_all};

fn agent(name: &str, config: &NixlConfig) -> NixlAgent {
    NixlAgent::new(name, config).unwrap()
}

#[test]
fn conformance() {
    if !common::nixl_or_skip("conformance") {
        return;
    }
    let config = NixlConfig::default();
    check_all(&Pair::new(Arc::new(agent("decode", &config)), Arc::new(agent("prefill", &config))));
}

#[test]
fn conformance_dyn() {
    if !common::nixl_or_skip("conformance_dyn") {
        return;
    }
    let config = NixlConfig::default();
    let decode: Arc<dyn TransferAgent> = Arc::new(agent("decode-dyn", &config));
    let prefill: Arc<dyn TransferAgent> = Arc::new(agent("prefill-dyn", &config));
    check_all(&Pair::new(decode, prefill));
}

/// With NIXL's progress thread on, the suite must pass just the same.
#[test]
fn conformance_with_progress_thread() {
    if !common::nixl_or_skip("conformance_with_progress_thread") {
        return;
    }
    let config = NixlConfig::default().with_progress_thread(true, std::time::Duration::from_micros(100));
    check_all(&Pair::new(Arc::new(agent("decode-pt", &config)), Arc::new(agent("prefill-pt", &config))));
}

/// With NIXL's UCX thread-pool engine (`num_threads`, as kvx's vLLM connector uses it), the suite
/// must pass just the same.
#[test]
fn conformance_with_thread_pool() {
    if !common::nixl_or_skip("conformance_with_thread_pool") {
        return;
    }
    let config = NixlConfig::default().with_threads(4);
    check_all(&Pair::new(Arc::new(agent("decode-tp", &config)), Arc::new(agent("prefill-tp", &config))));
}
