//! kvx-loopback runs the whole conformance suite, one `#[test]` per check: with explicit progress,
//! through `dyn TransferAgent`, with background progress threads, and with its two agents on two
//! clones of one fabric. The agents are in kvx-testkit's chaos layer (without faults, it must
//! change nothing the suite sees), so every configuration can make a transfer fail (an injected
//! fault).
#![allow(clippy::unwrap_used)] // Test setup: a failed unwrap is a failed test.

use std::sync::Arc;

use kvx_core::{Result, TransferAgent};
use kvx_loopback::{AgentOptions, Fabric, LoopbackAgent};
use kvx_testkit::chaos::{Chaos, ChaosNet, Faults};
use kvx_testkit::conformance::{Dyn, Harness};

/// Two loopback agents, each in the chaos layer. `drive`: whether the suite's progress calls drive them (with progress
/// threads they need not: every transfer the suite sees complete was then performed by the
/// initiator's thread).
#[derive(Debug)]
struct Loopback {
    initiator: Chaos<LoopbackAgent>,
    target: Chaos<LoopbackAgent>,
    drive: bool,
}

fn chaos(net: &ChaosNet, agent: LoopbackAgent) -> Chaos<LoopbackAgent> {
    Chaos::new(Arc::new(agent), net)
}

impl Loopback {
    fn explicit() -> Self {
        let (fabric, net) = (Fabric::new(), ChaosNet::new());
        Loopback {
            initiator: chaos(&net, fabric.agent("decode").unwrap()),
            target: chaos(&net, fabric.agent("prefill").unwrap()),
            drive: true,
        }
    }

    fn threads() -> Self {
        let (fabric, net) = (Fabric::new(), ChaosNet::new());
        let options = AgentOptions::progress_thread();
        let h = Loopback {
            initiator: chaos(&net, fabric.agent_with("decode", options.clone()).unwrap()),
            target: chaos(&net, fabric.agent_with("prefill", options).unwrap()),
            drive: false,
        };
        assert!(h.initiator.inner().has_progress_thread());
        h
    }

    /// Agents on two clones of one fabric: the same network.
    fn fabric_clones() -> Self {
        let (fabric, net) = (Fabric::new(), ChaosNet::new());
        let other = fabric.clone();
        Loopback {
            initiator: chaos(&net, fabric.agent("a").unwrap()),
            target: chaos(&net, other.agent("b").unwrap()),
            drive: true,
        }
    }
}

impl Harness for Loopback {
    type Agent = Chaos<LoopbackAgent>;

    fn initiator(&self) -> &Chaos<LoopbackAgent> {
        &self.initiator
    }

    fn target(&self) -> &Chaos<LoopbackAgent> {
        &self.target
    }

    fn progress(&self) -> Result<()> {
        if self.drive {
            self.target.progress()?;
            self.initiator.progress()?;
        }
        Ok(())
    }

    fn fail_next_transfer(&self) -> Result<bool> {
        self.initiator.set_faults(Faults::none().fail_nth_transfer(1))?;
        Ok(true)
    }
}

mod explicit {
    use super::*;
    kvx_testkit::conformance_tests!(|_test: &str| Some(Loopback::explicit()));
}

mod dyn_agents {
    use super::*;
    kvx_testkit::conformance_tests!(|_test: &str| Some(Dyn(Loopback::explicit())));
}

mod progress_threads {
    use super::*;
    kvx_testkit::conformance_tests!(|_test: &str| Some(Loopback::threads()));
}

mod fabric_clones {
    use super::*;
    kvx_testkit::conformance_tests!(|_test: &str| Some(Loopback::fabric_clones()));
}
