//! Completion events: `drain_completions` reports each transfer once, after it ended, and never a
//! released one.

use kvx_core::{ErrorKind, TransferAgent, XferId, XferState};
use std::time::Instant;

use crate::conformance::fixture::Fixture;
use crate::conformance::harness::Harness;
use crate::conformance::support::{any_op, expect_kind, ok, skip_because, wait_settled};

/// Drains the initiator's completions, driving both agents, until every id of `want` has been
/// reported. Every id reported goes to `seen`; an id reported twice, or one not in `posted` (the
/// transfers of the check that are not released), fails the check.
#[track_caller]
fn drain_until<H: Harness + ?Sized>(h: &H, want: &[XferId], posted: &[XferId], seen: &mut Vec<XferId>) {
    let deadline = Instant::now() + h.deadline();
    let mut got = Vec::new();
    while !want.iter().all(|x| seen.contains(x)) {
        ok(h.progress(), "progress");
        ok(h.initiator().drain_completions(&mut got), "drain_completions");
        for x in got.drain(..) {
            assert!(!seen.contains(&x), "transfer {x} reported twice");
            assert!(posted.contains(&x), "transfer {x} reported, but it is released or was never posted");
            seen.push(x);
        }
        assert!(Instant::now() < deadline, "transfers {want:?} not all reported after {:?}", h.deadline());
    }
}

/// Drives both agents a few rounds and checks that no completion is reported.
#[track_caller]
fn assert_no_more_completions<H: Harness + ?Sized>(h: &H, when: &str) {
    let mut got = Vec::new();
    for _ in 0..20 {
        ok(h.progress(), "progress");
        ok(h.initiator().drain_completions(&mut got), "drain_completions");
    }
    assert!(got.is_empty(), "{when}: unexpected completions {got:?}");
}

/// Eight transfers posted at once are each reported exactly once by `drain_completions`, and only
/// once they are `Done`; a reported transfer still polls `Done` until it is released.
pub fn check_completions_reported_once<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let op = any_op(ini.capabilities());
    let mut f = Fixture::new(h, 0x5eed_0020);
    let pairs = f.random_pairs(16);
    let posted: Vec<XferId> = pairs.chunks(2).map(|c| ok(f.post(op, c, None), "post")).collect();
    let mut seen = Vec::new();
    drain_until(h, &posted, &posted, &mut seen);
    for &x in &posted {
        assert_eq!(ok(ini.poll(x), "poll of a reported transfer"), XferState::Done, "reported, so final");
    }
    assert_no_more_completions(h, "after every transfer was reported");
    f.apply(op, &pairs);
    f.verify("after the reported transfers");
    for &x in &posted {
        assert_eq!(ok(ini.poll(x), "poll"), XferState::Done, "Done stays final after the report");
        ok(ini.release(x), "release");
        expect_kind(ini.poll(x), ErrorKind::NotFound, "polling a released transfer");
    }
    assert_no_more_completions(h, "after every transfer was released");
}

/// A transfer that fails in its transport (injected by [`Harness::fail_next_transfer`]) is
/// reported exactly once, and polls `Failed` afterwards until it is released.
pub fn check_failed_completion_reported_once<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let caps = ini.capabilities();
    let mut f = Fixture::new(h, 0x5eed_0021);
    if !ok(h.fail_next_transfer(), "fail_next_transfer") {
        return skip_because(&format!("the harness cannot make a {} transfer fail", caps.backend));
    }
    let pairs = f.random_pairs(4);
    let x = ok(f.post(any_op(caps), &pairs, None), "post of a transfer that will fail");
    let mut seen = Vec::new();
    drain_until(h, &[x], &[x], &mut seen);
    let XferState::Failed(e) = ok(ini.poll(x), "poll of a reported transfer") else {
        panic!("a transfer made to fail was reported, but does not poll Failed");
    };
    assert_eq!(e.kind(), ErrorKind::Transfer, "{e}");
    assert_no_more_completions(h, "after the failed transfer was reported");
    assert_eq!(ok(ini.poll(x), "poll"), XferState::Failed(e), "Failed stays final after the report");
    ok(ini.release(x), "release");
    f.resync(); // the failed transfer's destination holds unspecified bytes
}

/// A released transfer is never reported: neither one released at once after its post (still
/// pending, settling in the background) nor one released once it was `Done` but not yet reported.
pub fn check_released_transfers_not_reported<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let op = any_op(ini.capabilities());
    let mut f = Fixture::new(h, 0x5eed_0022);
    let pairs = f.random_pairs(4);
    let early = ok(f.post(op, &pairs, None), "post");
    ok(ini.release(early), "release of a transfer just posted");
    let done = ok(f.post(op, &pairs, None), "post");
    assert_eq!(wait_settled(h, done, "a transfer polled to its end"), XferState::Done);
    ok(ini.release(done), "release of a transfer done, not yet reported");
    // Later transfers, reported once the agent has moved on: the released ones never are.
    let mut seen = Vec::new();
    for round in 0..2 {
        let x = ok(f.post(op, &pairs, None), "post");
        drain_until(h, &[x], &[x], &mut seen);
        ok(ini.release(x), "release");
        assert!(seen.len() == round + 1, "only the later transfers are reported: {seen:?}");
    }
    assert_no_more_completions(h, "after released transfers");
}
