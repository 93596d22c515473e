//! The deterministic fault soak (`kvx_testkit::soak`): requests under every fault the connector
//! must survive, in simulated time. Every request ends, no received byte is wrong, no block
//! leaks, nothing panics, every failure is of a kind the faults explain; and a seed replays its run
//! exactly.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use kvx_core::ErrorKind;
use kvx_testkit::soak::{FaultRates, SoakConfig, SoakReport, run_soak};

/// The kinds of failure the injected faults explain: a failed READ (`Transfer`), a refused
/// handshake (`Handshake`), a hold that ended before its release reached it (`Expired`), a lost
/// notification or an unanswered handshake (`Timeout`).
const FAULT_KINDS: [ErrorKind; 4] =
    [ErrorKind::Transfer, ErrorKind::Handshake, ErrorKind::Expired, ErrorKind::Timeout];

fn clean(config: &SoakConfig) -> SoakReport {
    let r = run_soak(config).unwrap();
    assert!(r.is_clean(), "{} not 0:\n{r}", r.violations().join(", "));
    for (kind, n) in &r.failure_kinds {
        assert!(FAULT_KINDS.contains(kind), "{n} failures of kind {kind:?}, which no fault explains:\n{r}");
    }
    let a = &r.aborted;
    let ended = r.finished + r.recomputed + r.failed + a.total() + r.lost.prefill + r.lost.decode;
    assert_eq!(ended, config.requests, "every request is counted once:\n{r}");
    r
}

#[test]
fn without_faults_every_request_finishes() {
    let config = SoakConfig { faults: FaultRates::none(), ..SoakConfig::new(300, 3) };
    let r = clean(&config);
    assert_eq!(r.finished, 300, "{r}");
    assert_eq!((r.protocol.handshake_failures, r.protocol.failed_loads, r.protocol.expired_holds), (0, 0, 0));
    assert!(r.protocol.blocks_verified > 0, "{r}");
}

#[test]
fn two_thousand_requests_under_every_fault_end_cleanly_and_replay_exactly() {
    let config = SoakConfig::new(2000, 1);
    let r = clean(&config);
    let (f, h) = (&r.faults.transport, &r.faults.handshakes);
    for (what, n) in [
        ("failed READ", f.transfers_failed),
        ("late READ", f.transfers_delayed),
        ("lost notification", f.notifications_dropped),
        ("doubled notification", f.notifications_duplicated),
        ("late notification", f.notifications_delayed),
        ("stray notification", f.stray_notifications),
        ("refused handshake", h.refused),
        ("late handshake", h.delayed),
        ("unanswered handshake", h.silent),
        ("prefill restart", r.faults.prefill_restarts),
        ("decode restart", r.faults.decode_restarts),
        ("decode stall beyond the lease", r.faults.decode_stalls),
        ("abort", r.aborted.total()),
        ("request lost with a prefill engine", r.lost.prefill),
        ("recomputed request", r.recomputed),
        ("expired hold", r.protocol.expired_holds),
    ] {
        assert!(n > 0, "no {what} in the run:\n{r}");
    }
    for kind in FAULT_KINDS {
        assert!(r.failure_kinds.iter().any(|(k, _)| *k == kind), "no failure of kind {kind:?}:\n{r}");
    }
    assert!(r.finished > r.requests / 2, "{r}");
    assert_eq!(run_soak(&config).unwrap(), r, "the same seed, the same run");
}

#[test]
fn other_seeds_are_other_runs_and_end_cleanly_too() {
    let digests: Vec<u64> = (2..4).map(|seed| clean(&SoakConfig::new(1000, seed)).digest).collect();
    assert_ne!(digests[0], digests[1]);
}

/// Push mode under the same faults: lost, doubled and late registrations and results, failed and
/// late WRITEs, refused handshakes (in both directions: a prefill engine connects back to write),
/// restarts of either engine mid-push and stalled decode engines. Every request ends, every byte
/// pushed is checked, nothing leaks; the seed replays the run.
#[test]
fn two_thousand_pushed_requests_under_every_fault_end_cleanly_and_replay_exactly() {
    let config = SoakConfig { mode: kvx_core::TransferMode::Push, ..SoakConfig::new(2000, 1) };
    let r = clean(&config);
    let [registered, writes, failed, refused, ..] = r.protocol.push;
    for (what, n) in [
        ("registration", registered),
        ("WRITE", writes),
        ("failed WRITE", failed),
        ("registration answered not written", refused),
        ("request lost with a decode engine", r.lost.decode),
        ("recomputed request", r.recomputed),
        ("prefill restart", r.faults.prefill_restarts),
    ] {
        assert!(n > 0, "no {what} in the run:\n{r}");
    }
    assert_eq!(r.protocol.reads, 0, "nothing is read:\n{r}");
    assert!(r.finished > r.requests / 2 && r.protocol.blocks_verified > 0, "{r}");
    assert_eq!(run_soak(&config).unwrap(), r, "the same seed, the same run");
}
