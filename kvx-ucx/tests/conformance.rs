//! The whole kvx conformance suite for UcxAgent: two agents in one process, over UCX's default
//! transports, over TCP only (also with peer failure detection), with UCX-allocated target memory, with progress threads, and through
//! `Arc<dyn TransferAgent>`.
#![allow(clippy::unwrap_used)] // Test helpers outside #[test] fns panic on failure, like asserts.

use std::sync::Arc;

use kvx_core::{Result, TransferAgent};
use kvx_testkit::conformance::{Harness, Pair, Side, TestBuffer, check_all};
use kvx_ucx::{ProgressThreadConfig, UcxAgent, UcxConfig};

fn pair(tag: &str, config: &UcxConfig) -> (Arc<UcxAgent>, Arc<UcxAgent>) {
    let initiator = UcxAgent::with_config(format!("decode-{tag}"), config).unwrap();
    let target = UcxAgent::with_config(format!("prefill-{tag}"), config).unwrap();
    (Arc::new(initiator), Arc::new(target))
}

#[test]
fn conformance_default_transports() {
    let (i, t) = pair("default", &UcxConfig::default());
    check_all(&Pair::new(i, t));
}

#[test]
fn conformance_tcp_only() {
    let (i, t) = pair("tcp", &UcxConfig::default().with_transports("tcp"));
    check_all(&Pair::new(i, t));
}

#[test]
fn conformance_with_progress_threads() {
    let config = UcxConfig::default().with_progress_thread(ProgressThreadConfig::default());
    let (i, t) = pair("threads", &config);
    assert!(i.has_progress_thread());
    check_all(&Pair::new(i, t));
}

#[test]
fn conformance_tcp_with_peer_failure_detection() {
    let config = UcxConfig::default()
        .with_transports("tcp")
        .with_peer_failure_detection()
        .with_progress_thread(ProgressThreadConfig::default());
    let (i, t) = pair("detect", &config);
    check_all(&Pair::new(i, t));
}

#[test]
fn conformance_through_dyn_agent() {
    let (i, t) = pair("dyn", &UcxConfig::default());
    let (i, t): (Arc<dyn TransferAgent>, Arc<dyn TransferAgent>) = (i, t);
    check_all(&Pair::new(i, t));
}

/// Both agents' memory allocated by UCX (`UCP_MEM_MAP_ALLOCATE`): the one-sided fast path.
struct UcxPoolHarness {
    initiator: UcxAgent,
    target: UcxAgent,
}

impl Harness for UcxPoolHarness {
    type Agent = UcxAgent;

    fn initiator(&self) -> &UcxAgent {
        &self.initiator
    }

    fn target(&self) -> &UcxAgent {
        &self.target
    }

    fn alloc(&self, side: Side, len: usize) -> Result<TestBuffer> {
        let agent = match side {
            Side::Initiator => &self.initiator,
            Side::Target => &self.target,
        };
        Ok(TestBuffer::new(agent.alloc_memory(len)?))
    }
}

#[test]
fn conformance_ucx_allocated_memory() {
    let h = UcxPoolHarness {
        initiator: UcxAgent::new("decode-pool").unwrap(),
        target: UcxAgent::new("prefill-pool").unwrap(),
    };
    check_all(&h);
}

#[test]
fn conformance_ucx_allocated_memory_tcp_only() {
    let tcp = UcxConfig::default().with_transports("tcp");
    let h = UcxPoolHarness {
        initiator: UcxAgent::with_config("decode-pool-tcp", &tcp).unwrap(),
        target: UcxAgent::with_config("prefill-pool-tcp", &tcp).unwrap(),
    };
    check_all(&h);
}
