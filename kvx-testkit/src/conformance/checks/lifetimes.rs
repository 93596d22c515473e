//! Deregistering memory, forgetting peers and releasing transfers, also while transfers are in
//! flight: what is released is gone for new calls at once (`NotFound`), transfers posted before
//! finish as if nothing happened, and the memory is released once the last of them settles.

use kvx_core::{DlistOwner, ErrorKind, TransferAgent};

use crate::conformance::fixture::Fixture;
use crate::conformance::harness::Harness;
use crate::conformance::support::{any_op, expect_kind, ok, wait_done, wait_notifications, wait_until};

/// After `forget_remote`, the peer's lists are released and posts, lists and notifications naming
/// it are `NotFound`, and nothing moves; loading it again works.
pub fn check_forget_remote<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let caps = ini.capabilities();
    let op = any_op(caps);
    let mut f = Fixture::new(h, 0x5eed_000d);
    let pairs = f.random_pairs(4);
    let x = ok(f.post(op, &pairs, None), "post");
    wait_done(h, x, "transfer before forget_remote");
    ok(ini.release(x), "release");
    f.apply(op, &pairs);

    let stale = f.forget_target();
    forgotten_is_not_found(h, &f, stale);
    f.settle_and_verify("after posts to a forgotten remote");

    f.load_target();
    let pairs = f.random_pairs(4);
    let x = ok(f.post(op, &pairs, None), "post after reloading");
    wait_done(h, x, "transfer after reloading");
    ok(ini.release(x), "release");
    f.apply(op, &pairs);
    f.verify("after a transfer to a reloaded remote");
}

/// What naming a forgotten peer does: its old list, a new list, a notification are `NotFound`.
fn forgotten_is_not_found<H: Harness + ?Sized>(h: &H, f: &Fixture<'_, H>, stale: Option<kvx_core::DlistId>) {
    let ini = h.initiator();
    let caps = ini.capabilities();
    let (local, _) = f.lists();
    if let Some(stale) = stale {
        let op = any_op(caps);
        expect_kind(
            ini.post(op, local, &[0], stale, &[0], None),
            ErrorKind::NotFound,
            "post to a forgotten remote",
        );
        expect_kind(
            ini.release_dlist(stale),
            ErrorKind::NotFound,
            "forget_remote releases the remote's lists",
        );
    }
    let owner = DlistOwner::Remote(f.target_name.clone());
    expect_kind(
        ini.prep_dlist(&owner, &f.shape.list(&f.remote)),
        ErrorKind::NotFound,
        "list of a forgotten remote",
    );
    if caps.notifications {
        expect_kind(
            ini.notify(&f.target_name, b"kvx-must-not-arrive"),
            ErrorKind::NotFound,
            "notify a forgotten remote",
        );
    }
}

/// Deregistering the initiator's memory right after a post (no progress in between) succeeds at
/// once; the lists over it are released (posts over them `NotFound`, new lists over the memory
/// `InvalidArgument`); the transfer completes with every byte and its notification; and the agent
/// lets the memory go once the transfer has settled.
pub fn check_deregister_in_flight<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let caps = ini.capabilities();
    let op = any_op(caps);
    let mut f = Fixture::new(h, 0x5eed_0012);
    let pairs = f.random_pairs(64);
    let msg = b"kvx-deregistered-while-in-flight".to_vec();
    let x = ok(f.post(op, &pairs, caps.notifications.then_some(&msg[..])), "post");
    let stale = f.deregister_local();

    let (_, remote) = f.lists();
    if let Some(stale) = stale {
        expect_kind(
            ini.post(op, stale, &[0], remote, &[0], None),
            ErrorKind::NotFound,
            "post over deregistered memory",
        );
        expect_kind(
            ini.release_dlist(stale),
            ErrorKind::NotFound,
            "deregistering releases the lists over it",
        );
    }
    expect_kind(
        ini.prep_dlist(&DlistOwner::Local, &f.shape.list(&f.local)),
        ErrorKind::InvalidArgument,
        "a new list over deregistered memory",
    );

    wait_done(h, x, "a transfer whose memory was deregistered after the post");
    assert!(f.local_released(), "the agent still holds memory deregistered under a transfer that settled");
    f.apply(op, &pairs);
    f.verify("after a transfer whose memory was deregistered after the post");
    if caps.notifications {
        wait_notifications(h, std::slice::from_ref(&msg), |_| {});
    }
    ok(ini.release(x), "release");
}

/// A transfer released while pending, over memory then deregistered: the agent lets the memory go
/// once the transfer has settled in the background (driven by progress).
pub fn check_release_in_flight<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let op = any_op(ini.capabilities());
    let mut f = Fixture::new(h, 0x5eed_0013);
    let pairs = f.random_pairs(64);
    let x = ok(f.post(op, &pairs, None), "post");
    ok(ini.release(x), "releasing a transfer in flight");
    expect_kind(ini.poll(x), ErrorKind::NotFound, "polling a released transfer");
    f.deregister_local();
    wait_until(h, "the memory of a released, deregistered transfer released", || f.local_released());
}

/// Forgetting the target right after a post succeeds at once, and its name is `NotFound` for new
/// calls; the transfer completes with every byte and its notification; the target can be loaded
/// again at once, while the transfer is still in flight, and read from through the new load.
pub fn check_forget_remote_in_flight<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let caps = ini.capabilities();
    let op = any_op(caps);
    let mut f = Fixture::new(h, 0x5eed_0014);
    // Distinct blocks on both sides for the two transfers, which may run in any order.
    let mut pairs = f.random_pairs(68);
    let again = pairs.split_off(64);
    let msg = b"kvx-forgotten-while-in-flight".to_vec();
    let x = ok(f.post(op, &pairs, caps.notifications.then_some(&msg[..])), "post");
    let stale = f.forget_target();
    forgotten_is_not_found(h, &f, stale);

    f.load_target();
    let y = ok(f.post(op, &again, None), "post through the new load");

    wait_done(h, x, "a transfer whose peer was forgotten after the post");
    f.apply(op, &pairs);
    wait_done(h, y, "a transfer through the peer loaded again");
    f.apply(op, &again);
    f.verify("after transfers before and after forgetting and loading the peer again");
    if caps.notifications {
        wait_notifications(h, std::slice::from_ref(&msg), |_| {});
    }
    ok(ini.release(x), "release");
    ok(ini.release(y), "release");
}
