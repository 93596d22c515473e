//! Shared by kvx-nixl's integration tests: the NIXL-or-skip rule, bounded waits, byte patterns.
#![allow(dead_code, unreachable_pub)] // Each test binary uses a different subset.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by unwrapping.

pub mod xproc;

use std::io::Write;
use std::time::{Duration, Instant};

use kvx_core::{Notification, TransferAgent, XferId, XferState};

/// How long any single wait in these tests may take.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Whether NIXL is usable. If not: with `KVX_REQUIRE_NIXL=1` (CI) the test fails; otherwise it
/// prints a loud SKIP line (straight to stderr, past the test harness's capture) and the caller
/// returns.
pub fn nixl_or_skip(test: &str) -> bool {
    match kvx_nixl::check_library() {
        Ok(()) => true,
        Err(e) => {
            if std::env::var("KVX_REQUIRE_NIXL").as_deref() == Ok("1") {
                panic!("{test}: KVX_REQUIRE_NIXL=1 but NIXL is not available: {e}");
            }
            let _ = writeln!(
                std::io::stderr(),
                "\n*** SKIP {test}: NIXL is not available: {e}\n*** run scripts/install-nixl.sh, \
                 `source scripts/nixl-env.sh`; KVX_REQUIRE_NIXL=1 turns this skip into a failure\n"
            );
            false
        }
    }
}

/// Polls `xfer` on `initiator` until it leaves `Pending`, servicing `target` in between (two NIXL
/// agents in one process: connection setup needs the target to progress too).
pub fn wait_xfer(initiator: &dyn TransferAgent, target: &dyn TransferAgent, xfer: XferId) -> XferState {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let state = initiator.poll(xfer).unwrap();
        if state != XferState::Pending {
            return state;
        }
        target.progress().unwrap();
        assert!(Instant::now() < deadline, "transfer {xfer} still pending after {DEADLINE:?}");
        std::thread::yield_now();
    }
}

/// Drains `agent` until it has received `count` notifications, progressing `other` in between.
pub fn wait_notifications(
    agent: &dyn TransferAgent,
    other: &dyn TransferAgent,
    count: usize,
) -> Vec<Notification> {
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    while out.len() < count {
        agent.drain_notifications(&mut out).unwrap();
        other.progress().unwrap();
        assert!(Instant::now() < deadline, "{} of {count} notifications after {DEADLINE:?}", out.len());
        std::thread::yield_now();
    }
    out
}

/// Deterministic, position-dependent bytes (a shifted copy never matches).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}
