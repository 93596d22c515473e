//! kvx-loopback runs the whole conformance suite: with its concrete agent type, through
//! `Arc<dyn TransferAgent>`, and with background progress threads.

use std::sync::Arc;
use std::time::Duration;

use kvx_core::{Result, TransferAgent};
use kvx_loopback::{AgentOptions, Fabric, LoopbackAgent};
use kvx_testkit::conformance::{Harness, Pair, check_all};

#[test]
fn concrete_agents() {
    let fabric = Fabric::new();
    let pair: Pair<LoopbackAgent> =
        Pair::new(Arc::new(fabric.agent("decode").unwrap()), Arc::new(fabric.agent("prefill").unwrap()));
    check_all(&pair);
}

#[test]
fn dyn_agents() {
    let fabric = Fabric::new();
    let decode: Arc<dyn TransferAgent> = Arc::new(fabric.agent("decode").unwrap());
    let prefill: Arc<dyn TransferAgent> = Arc::new(fabric.agent("prefill").unwrap());
    check_all(&Pair::new(decode, prefill));
}

/// Both agents progress on their own threads; the harness drives nothing, so every transfer the
/// suite sees complete was performed by the initiator's progress thread.
#[derive(Debug)]
struct ThreadHarness {
    initiator: LoopbackAgent,
    target: LoopbackAgent,
}

impl Harness for ThreadHarness {
    type Agent = LoopbackAgent;

    fn initiator(&self) -> &LoopbackAgent {
        &self.initiator
    }

    fn target(&self) -> &LoopbackAgent {
        &self.target
    }

    fn progress(&self) -> Result<()> {
        Ok(())
    }
}

#[test]
fn progress_threads() {
    let fabric = Fabric::new();
    let options = AgentOptions::progress_thread(Duration::from_micros(100));
    let h = ThreadHarness {
        initiator: fabric.agent_with("decode", options.clone()).unwrap(),
        target: fabric.agent_with("prefill", options).unwrap(),
    };
    assert!(h.initiator.has_progress_thread());
    check_all(&h);
}

/// Self-transfers: one agent as both initiator and target is not allowed by the harness (names
/// must differ), but two agents on two clones of one fabric are the same network.
#[test]
fn agents_on_fabric_clones() {
    let fabric = Fabric::new();
    let other = fabric.clone();
    check_all(&Pair::new(Arc::new(fabric.agent("a").unwrap()), Arc::new(other.agent("b").unwrap())));
}
