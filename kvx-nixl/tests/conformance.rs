//! The whole kvx conformance suite against the real NIXL library, one `#[test]` per check: two
//! NixlAgents in one process, UCX backend, host memory. With the default configuration, through
//! `Arc<dyn TransferAgent>`, with NIXL's progress thread and with its UCX thread-pool engine.
//! The suite's default harness progresses the target while the initiator polls, which two NIXL
//! agents in one process need. Without NIXL every test prints a loud SKIP, or fails with
//! `KVX_REQUIRE_NIXL=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by unwrapping.

mod common;

use std::sync::Arc;
use std::time::Duration;

use kvx_core::TransferAgent;
use kvx_nixl::{NixlAgent, NixlConfig};
use kvx_testkit::conformance::Pair;

/// Two agents of `config` named after the test, or `None` (after saying why) without NIXL.
fn pair(test: &str, config: &NixlConfig) -> Option<Pair<NixlAgent>> {
    if !common::nixl_or_skip(test) {
        return None;
    }
    let initiator = NixlAgent::new(format!("decode-{test}"), config).unwrap();
    let target = NixlAgent::new(format!("prefill-{test}"), config).unwrap();
    Some(Pair::new(Arc::new(initiator), Arc::new(target)))
}

mod default_config {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| pair(test, &NixlConfig::default()));
}

mod dyn_agents {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| {
        if !common::nixl_or_skip(test) {
            return None;
        }
        let config = NixlConfig::default();
        let initiator: Arc<dyn TransferAgent> =
            Arc::new(NixlAgent::new(format!("decode-dyn-{test}"), &config).unwrap());
        let target: Arc<dyn TransferAgent> =
            Arc::new(NixlAgent::new(format!("prefill-dyn-{test}"), &config).unwrap());
        Some(Pair::new(initiator, target))
    });
}

mod progress_thread {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| {
        pair(test, &NixlConfig::default().with_progress_thread(true, Duration::from_micros(100)))
    });
}

/// NIXL's UCX thread-pool engine (`num_threads`, as kvx's vLLM connector uses it).
mod thread_pool {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| pair(test, &NixlConfig::default().with_threads(4)));
}
