//! kvx-loopback runs the whole conformance suite, one `#[test]` per check: with explicit progress,
//! through `dyn TransferAgent`, with background progress threads, and with its two agents on two
//! clones of one fabric. Every configuration can make a transfer fail (an injected fault).
#![allow(clippy::unwrap_used)] // Test setup: a failed unwrap is a failed test.

use std::time::Duration;

use kvx_core::{Result, TransferAgent};
use kvx_loopback::{AgentOptions, Fabric, Faults, LoopbackAgent};
use kvx_testkit::conformance::{Dyn, Harness};

/// Two loopback agents. `drive`: whether the suite's progress calls drive them (with progress
/// threads they need not: every transfer the suite sees complete was then performed by the
/// initiator's thread).
#[derive(Debug)]
struct Loopback {
    initiator: LoopbackAgent,
    target: LoopbackAgent,
    drive: bool,
}

impl Loopback {
    fn explicit() -> Self {
        let fabric = Fabric::new();
        Loopback {
            initiator: fabric.agent("decode").unwrap(),
            target: fabric.agent("prefill").unwrap(),
            drive: true,
        }
    }

    fn threads() -> Self {
        let fabric = Fabric::new();
        let options = AgentOptions::progress_thread(Duration::from_micros(100));
        let h = Loopback {
            initiator: fabric.agent_with("decode", options.clone()).unwrap(),
            target: fabric.agent_with("prefill", options).unwrap(),
            drive: false,
        };
        assert!(h.initiator.has_progress_thread());
        h
    }

    /// Agents on two clones of one fabric: the same network.
    fn fabric_clones() -> Self {
        let fabric = Fabric::new();
        let other = fabric.clone();
        Loopback { initiator: fabric.agent("a").unwrap(), target: other.agent("b").unwrap(), drive: true }
    }
}

impl Harness for Loopback {
    type Agent = LoopbackAgent;

    fn initiator(&self) -> &LoopbackAgent {
        &self.initiator
    }

    fn target(&self) -> &LoopbackAgent {
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
