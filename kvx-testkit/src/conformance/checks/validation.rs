//! `post`'s argument checks: each bad argument is refused with the one kind the trait documents,
//! nothing is transferred, no notification is sent, and the agent keeps working.

use kvx_core::{BlockList, DlistId, DlistOwner, ErrorKind, MAX_NOTIFICATION_LEN, TransferAgent};

use crate::conformance::fixture::Fixture;
use crate::conformance::harness::Harness;
use crate::conformance::support::{any_op, assert_no_more_notifications, expect_kind, ok, ops, wait_done};

/// What every refused post must leave behind: no byte moved, no notification, a working agent.
pub(crate) fn assert_refused_posts_left_no_trace<H: Harness + ?Sized>(
    h: &H,
    f: &mut Fixture<'_, H>,
    what: &str,
) {
    f.settle_and_verify(&format!("after {what} (destination touched?)"));
    assert_no_more_notifications(h, &format!("after {what}"));
    let op = any_op(h.initiator().capabilities());
    let pairs = f.random_pairs(4);
    let x = ok(f.post(op, &pairs, None), &format!("a valid post after {what}"));
    wait_done(h, x, &format!("a valid transfer after {what}"));
    f.apply(op, &pairs);
    f.verify(&format!("after a valid transfer following {what}"));
    ok(h.initiator().release(x), "release");
}

/// A notification for posts that must be refused, when the backend has notifications.
pub(crate) fn must_not_arrive<H: Harness + ?Sized>(h: &H) -> Option<&'static [u8]> {
    h.initiator().capabilities().notifications.then_some(&b"kvx-must-not-arrive"[..])
}

/// Descriptor lists this agent does not know are `NotFound`, in `release_dlist` and in `post`.
pub fn check_unknown_dlist<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    expect_kind(ini.release_dlist(DlistId(u64::MAX)), ErrorKind::NotFound, "releasing an unknown list");
    let mut f = Fixture::new(h, 0x5eed_0008);
    let (local, remote) = f.lists();
    for op in ops(ini.capabilities()) {
        expect_kind(
            ini.post(op, DlistId(u64::MAX), &[0], remote, &[0], must_not_arrive(h)),
            ErrorKind::NotFound,
            &format!("{op:?} with an unknown local list"),
        );
        expect_kind(
            ini.post(op, local, &[0], DlistId(u64::MAX), &[0], must_not_arrive(h)),
            ErrorKind::NotFound,
            &format!("{op:?} with an unknown remote list"),
        );
    }
    assert_refused_posts_left_no_trace(h, &mut f, "posts with unknown lists");
}

/// A remote list passed as the local one (and the other way round) is `InvalidArgument`.
pub fn check_wrong_dlist_owner_rejected<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let mut f = Fixture::new(h, 0x5eed_000b);
    let (local, remote) = f.lists();
    for op in ops(ini.capabilities()) {
        for (what, l, r) in [
            ("the lists swapped", remote, local),
            ("a local list as remote", local, local),
            ("a remote list as local", remote, remote),
        ] {
            expect_kind(
                ini.post(op, l, &[0], r, &[1], must_not_arrive(h)),
                ErrorKind::InvalidArgument,
                &format!("{op:?} with {what}"),
            );
        }
    }
    assert_refused_posts_left_no_trace(h, &mut f, "posts with wrong lists");
}

/// Index slices of unequal lengths are `InvalidArgument`.
pub fn check_unequal_lengths_rejected<H: Harness + ?Sized>(h: &H) {
    let mut f = Fixture::new(h, 0x5eed_000a);
    for op in ops(h.initiator().capabilities()) {
        for (l, r) in [(&[0u32, 1][..], &[0u32][..]), (&[0], &[0, 1]), (&[], &[3])] {
            expect_kind(
                f.post_indices(op, l, r, must_not_arrive(h)),
                ErrorKind::InvalidArgument,
                &format!("{op:?} with {} local and {} remote indices", l.len(), r.len()),
            );
        }
    }
    assert_refused_posts_left_no_trace(h, &mut f, "posts of unequal lengths");
}

/// A post of no descriptors is `InvalidArgument`, with or without a notification.
pub fn check_empty_post_rejected<H: Harness + ?Sized>(h: &H) {
    let mut f = Fixture::new(h, 0x5eed_000e);
    for op in ops(h.initiator().capabilities()) {
        for notify in [None, must_not_arrive(h)] {
            expect_kind(
                f.post_indices(op, &[], &[], notify),
                ErrorKind::InvalidArgument,
                &format!("an empty {op:?} (notification: {})", notify.is_some()),
            );
        }
    }
    assert_refused_posts_left_no_trace(h, &mut f, "empty posts");
}

/// A local and a remote list whose blocks differ in length are `InvalidArgument` together.
pub fn check_unequal_block_lengths_rejected<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let mut f = Fixture::new(h, 0x5eed_000f);
    let (local, remote) = f.lists();
    // The same memory cut into blocks half as long.
    let halve = |list: BlockList| BlockList {
        num_blocks: list.num_blocks * 2,
        block_len: list.block_len / 2,
        ..list
    };
    let remote_owner = DlistOwner::Remote(f.target_name.clone());
    let half_local =
        ok(ini.prep_dlist(&DlistOwner::Local, &halve(f.shape.list(&f.local))), "half local list");
    let half_remote = ok(ini.prep_dlist(&remote_owner, &halve(f.shape.list(&f.remote))), "half remote list");
    for op in ops(ini.capabilities()) {
        for (what, l, r) in [("local", local, half_remote), ("remote", half_local, remote)] {
            expect_kind(
                ini.post(op, l, &[0, 1], r, &[2, 3], must_not_arrive(h)),
                ErrorKind::InvalidArgument,
                &format!("{op:?} with {what} blocks twice as long as the other side's"),
            );
        }
    }
    ok(ini.release_dlist(half_local), "release_dlist");
    ok(ini.release_dlist(half_remote), "release_dlist");
    assert_refused_posts_left_no_trace(h, &mut f, "posts of unequal block lengths");
}

/// Out-of-range descriptor indices, local or remote, are `InvalidArgument`, also after valid pairs.
pub fn check_out_of_range_rejected<H: Harness + ?Sized>(h: &H) {
    let mut f = Fixture::new(h, 0x5eed_0009);
    let n = f.shape.len();
    let bad: [(&str, Vec<u32>, Vec<u32>); 5] = [
        ("local index = len", vec![0, n], vec![0, 1]),
        ("remote index = len", vec![0, 1], vec![0, n]),
        ("local index u32::MAX", vec![u32::MAX], vec![0]),
        ("remote index u32::MAX", vec![0], vec![u32::MAX]),
        ("valid pairs then one bad", vec![0, 1, 2, 3], vec![4, 5, 6, n + 7]),
    ];
    for op in ops(h.initiator().capabilities()) {
        for (what, l, r) in &bad {
            expect_kind(
                f.post_indices(op, l, r, must_not_arrive(h)),
                ErrorKind::InvalidArgument,
                &format!("{op:?} with {what}"),
            );
        }
    }
    assert_refused_posts_left_no_trace(h, &mut f, "out-of-range posts");
}

/// A notification over [`MAX_NOTIFICATION_LEN`] bytes is `InvalidArgument`, attached to a post or
/// sent alone.
pub fn check_oversized_notification_rejected<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    if !ini.capabilities().notifications {
        return crate::conformance::support::skip_because("the backend has no notifications");
    }
    let mut f = Fixture::new(h, 0x5eed_0011);
    let big = vec![0x6b; MAX_NOTIFICATION_LEN + 1];
    for op in ops(ini.capabilities()) {
        expect_kind(
            f.post(op, &[(0, 0)], Some(&big)),
            ErrorKind::InvalidArgument,
            &format!("{op:?} with it"),
        );
    }
    expect_kind(ini.notify(&f.target_name, &big), ErrorKind::InvalidArgument, "notify with it");
    assert_refused_posts_left_no_trace(h, &mut f, "oversized notifications");
}
