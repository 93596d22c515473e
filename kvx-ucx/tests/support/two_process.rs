//! kvx-ucx's side of the two-process READ harness ([`kvx_testkit::xproc`]): the target's UCX
//! transports and memory, passed to the child as the spec `"<pool|heap> <UCX_TLS or ->"`.
//! Shared by `tests/two_process.rs` and the benchmark.
#![allow(dead_code, clippy::unwrap_used)] // Test support: panics are failures.

use std::sync::Arc;
use std::time::Duration;

use kvx_core::{HostMemory, KvMemory};
use kvx_testkit::xproc::{self, Idle, Reader, Target, TargetSetup};
use kvx_ucx::{ProgressThreadConfig, UcxAgent, UcxConfig};

/// Target memory: allocated by UCX (`Pool`, truly one-sided) or a heap buffer (`Heap`, served by
/// the target's progress thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TargetMem {
    Pool,
    Heap,
}

fn config(tls: Option<&str>) -> UcxConfig {
    match tls {
        Some(t) => UcxConfig::default().with_transports(t),
        None => UcxConfig::default(),
    }
}

/// The target role: call first thing in `main` / the role test; returns true if this process
/// was a target (and has served), false otherwise.
pub(crate) fn run_target_if_requested() -> bool {
    xproc::run_target_if_child(|spec| {
        let (mem, tls) = spec.split_once(' ').unwrap();
        let tls = (tls != "-").then_some(tls);
        let mut cfg = config(tls);
        if mem == "heap" {
            cfg = cfg.with_progress_thread(ProgressThreadConfig::default());
        }
        let agent = UcxAgent::with_config("two-process-target", &cfg).unwrap();
        let len = xproc::TARGET_BLOCKS * xproc::BLOCK_LEN;
        let memory: Arc<dyn KvMemory> = if mem == "heap" {
            let heap = Arc::new(HostMemory::new(len).unwrap());
            xproc::fill_target(|offset, bytes| heap.write(offset, bytes)).unwrap();
            heap
        } else {
            let pool = agent.alloc_memory(len).unwrap();
            xproc::fill_target(|offset, bytes| pool.write(offset, bytes)).unwrap();
            pool
        };
        // The READs need no help from the target's drains (one-sided, or its progress thread
        // serves them): park between drains so that it does not compete with the reader for CPUs.
        TargetSetup { agent, memory, idle: Idle::Park(Duration::from_millis(1)) }
    })
}

/// Starts this executable as a target; `args` select the role test (libtest) or nothing.
pub(crate) fn spawn_target(args: &[&str], tls: Option<&str>, mem: TargetMem) -> Target {
    let mem = if mem == TargetMem::Heap { "heap" } else { "pool" };
    Target::spawn(args, &format!("{mem} {}", tls.unwrap_or("-")))
}

/// The reading side, in this process, over the same transports as the target.
pub(crate) fn reader(name: &str, tls: Option<&str>, target: &Target) -> Reader<UcxAgent> {
    let agent = UcxAgent::with_config(name, &config(tls)).unwrap();
    Reader::new(agent, &target.metadata, target.base)
}
