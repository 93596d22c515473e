//! The whole kvx conformance suite for UcxAgent, one `#[test]` per check: two agents in one
//! process, over UCX's default transports, over TCP only (also with peer failure detection), with
//! progress threads, through `dyn TransferAgent`, and with UCX-allocated memory (over the default
//! transports and over TCP only).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test setup: a failed unwrap is a failed test.

use kvx_core::{Result, TransferAgent};
use kvx_testkit::conformance::{Dyn, Harness, Side, TestBuffer};
use kvx_ucx::{ProgressThreadConfig, UcxAgent, UcxConfig};

/// Two UCX agents of one configuration, named after the test (for readable logs). `pools`: their
/// memory is allocated by UCX (`UCP_MEM_MAP_ALLOCATE`: the one-sided fast path), otherwise heap.
struct Ucx {
    initiator: Option<UcxAgent>,
    target: UcxAgent,
    pools: bool,
}

impl Ucx {
    fn new(test: &str, config: &UcxConfig) -> Self {
        Ucx {
            initiator: Some(UcxAgent::with_config(format!("decode-{test}"), config).unwrap()),
            target: UcxAgent::with_config(format!("prefill-{test}"), config).unwrap(),
            pools: false,
        }
    }

    fn with_pools(mut self) -> Self {
        self.pools = true;
        self
    }
}

impl Harness for Ucx {
    type Agent = UcxAgent;

    fn initiator(&self) -> &UcxAgent {
        self.initiator.as_ref().expect("the initiator lives until the harness is dropped")
    }

    fn target(&self) -> &UcxAgent {
        &self.target
    }

    fn alloc(&self, side: Side, len: usize) -> Result<TestBuffer> {
        if !self.pools {
            return TestBuffer::host(len);
        }
        let agent = match side {
            Side::Initiator => self.initiator(),
            Side::Target => &self.target,
        };
        Ok(TestBuffer::new(agent.alloc_memory(len)?))
    }
}

impl Drop for Ucx {
    fn drop(&mut self) {
        // Dropping the initiator closes its endpoint to the target, which over TCP completes only
        // while the target progresses: progress it meanwhile. (The target goes second: UCX 1.13
        // aborts when a peer vanishes under an endpoint without error handling.)
        if let Some(initiator) = self.initiator.take() {
            std::thread::scope(|s| {
                let closing = s.spawn(move || drop(initiator));
                while !closing.is_finished() {
                    let _ = self.target.progress();
                }
            });
        }
    }
}

mod default_transports {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| Some(Ucx::new(test, &UcxConfig::default())));
}

mod tcp {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| Some(Ucx::new(
        test,
        &UcxConfig::default().with_transports("tcp")
    )));
}

mod progress_threads {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| {
        let h = Ucx::new(test, &UcxConfig::default().with_progress_thread(ProgressThreadConfig::default()));
        assert!(h.initiator().has_progress_thread());
        Some(h)
    });
}

mod tcp_with_peer_failure_detection {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| {
        let config = UcxConfig::default()
            .with_transports("tcp")
            .with_peer_failure_detection()
            .with_progress_thread(ProgressThreadConfig::default());
        Some(Ucx::new(test, &config))
    });
}

mod dyn_agents {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| Some(Dyn(Ucx::new(test, &UcxConfig::default()))));
}

mod ucx_allocated_memory {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| Some(Ucx::new(test, &UcxConfig::default()).with_pools()));
}

mod ucx_allocated_memory_tcp {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| {
        Some(Ucx::new(test, &UcxConfig::default().with_transports("tcp")).with_pools())
    });
}
