//! kvx-nixl's side of the two-process READ harness ([`kvx_testkit::xproc`]): the target is a NIXL
//! agent "prefill" over a host pool; the spec passed to the child says whether NIXL's progress
//! thread runs. Used by `tests/two_process.rs` and the benchmark.
#![allow(dead_code, unreachable_pub)] // Test and bench use different parts.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code fails loudly by unwrapping.

use std::sync::Arc;
use std::time::Duration;

use kvx_core::HostMemory;
use kvx_nixl::{NixlAgent, NixlConfig};
use kvx_testkit::xproc::{self, Idle, Target, TargetSetup};

/// NIXL's configuration with its progress thread on or off.
pub fn config(progress_thread: bool) -> NixlConfig {
    NixlConfig::default().with_progress_thread(progress_thread, Duration::ZERO)
}

/// If this process is the target child, runs the target and returns true (the caller returns).
pub fn run_target_if_child() -> bool {
    xproc::run_target_if_child(|spec| {
        let agent = NixlAgent::new("prefill", &config(spec == "progress-thread")).unwrap();
        let pool = Arc::new(HostMemory::new(xproc::TARGET_BLOCKS * xproc::BLOCK_LEN).unwrap());
        xproc::fill_target(|offset, bytes| pool.write(offset, bytes)).unwrap();
        // The target's drains are what progress NIXL without its progress thread: poll hot.
        TargetSetup { agent, memory: pool, idle: Idle::Yield }
    })
}

/// Starts this binary again as the target (`args` select the test or bench entry point).
pub fn spawn_target(args: &[&str], progress_thread: bool) -> Target {
    Target::spawn(args, if progress_thread { "progress-thread" } else { "polled" })
}
