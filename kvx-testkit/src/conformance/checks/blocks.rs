//! Block posts (`post_blocks`): runs of contiguous blocks, scattered blocks, windows and whole
//! regions back to back, with every byte of both sides checked; and the arguments it refuses,
//! with `post`'s kinds.

use kvx_core::{BlockPost, ErrorKind, RegionBlocks, TransferAgent, XferOp};

use crate::conformance::checks::validation::{assert_refused_posts_left_no_trace, must_not_arrive};
use crate::conformance::fixture::{Fixture, Shape};
use crate::conformance::harness::Harness;
use crate::conformance::support::{
    assert_no_more_notifications, expect_kind, ok, ops, wait_done, wait_notifications,
};

/// Posts `blocks` with a notification (where the backend has them), waits for both, and checks
/// every byte of both sides.
fn transfer<H: Harness + ?Sized>(
    h: &H,
    f: &mut Fixture<'_, H>,
    op: XferOp,
    blocks: &BlockPost<'_>,
    what: &str,
) {
    let msg = format!("kvx-block-post-{op:?}-{what}").into_bytes();
    let notify = h.initiator().capabilities().notifications.then_some(msg.as_slice());
    let x = ok(f.post_blocks(op, blocks, notify), &format!("{op:?} post_blocks of {what}"));
    f.apply_blocks(op, blocks);
    wait_done(h, x, &format!("{op:?} of {what}"));
    if notify.is_some() {
        wait_notifications(h, std::slice::from_ref(&msg), |_| {});
    }
    f.verify(&format!("after a {op:?} of {what}"));
    ok(h.initiator().release(x), "release");
    assert_no_more_notifications(h, &format!("after a {op:?} of {what}"));
}

/// READ and WRITE of runs of blocks contiguous on both sides (a run, then a second run elsewhere,
/// then one block), in every region: each run is one range per region where the backend
/// coalesces.
pub fn check_block_post_contiguous<H: Harness + ?Sized>(h: &H) {
    for op in ops(h.initiator().capabilities()) {
        let mut f = Fixture::new(h, 0x5eed_0b01);
        let local: Vec<u32> = (5..25).chain(40..44).chain([2]).collect();
        let remote: Vec<u32> = (30..50).chain(0..4).chain([63]).collect();
        let blocks = f.block_post(&local, &remote, RegionBlocks::All(2));
        transfer(h, &mut f, op, &blocks, "contiguous runs");
        // One region only.
        let blocks = f.block_post(&remote, &local, RegionBlocks::All(1));
        transfer(h, &mut f, op, &blocks, "contiguous runs in region 0");
    }
}

/// READ and WRITE of 48 random block pairs (distinct on each side), in every region.
pub fn check_block_post_scattered<H: Harness + ?Sized>(h: &H) {
    for op in ops(h.initiator().capabilities()) {
        let mut f = Fixture::new(h, 0x5eed_0b02);
        let (local, remote) = (f.random_blocks(48), f.random_blocks(48));
        let blocks = f.block_post(&local, &remote, RegionBlocks::All(2));
        transfer(h, &mut f, op, &blocks, "scattered blocks");
    }
}

/// READ and WRITE where regions take only their last blocks (sliding-window layers), the window
/// cutting into a run, wider than the post, or empty.
pub fn check_block_post_windowed<H: Harness + ?Sized>(h: &H) {
    for op in ops(h.initiator().capabilities()) {
        let mut f = Fixture::new(h, 0x5eed_0b03);
        let local = [10, 11, 12, 40, 41, 7];
        let remote = [20, 21, 22, 50, 51, 3];
        for windows in [[None, Some(4)], [Some(2), Some(99)], [Some(0), Some(5)]] {
            let blocks = f.block_post(&local, &remote, RegionBlocks::Windows(&windows));
            transfer(h, &mut f, op, &blocks, &format!("blocks in windows {windows:?}"));
        }
    }
}

/// READ and WRITE of every block of three regions back to back in one registration on each side
/// (one range where the backend merges whole regions), then of the same blocks with the middle
/// region's window breaking the merge.
pub fn check_block_post_whole_regions<H: Harness + ?Sized>(h: &H) {
    let shape = Shape { regions: 3, num_blocks: 16, block_len: 4096, joined: true };
    for op in ops(h.initiator().capabilities()) {
        let mut f = Fixture::with_shape(h, 0x5eed_0b04, shape);
        let all: Vec<u32> = (0..shape.num_blocks).collect();
        let blocks = f.block_post(&all, &all, RegionBlocks::All(3));
        transfer(h, &mut f, op, &blocks, "whole regions");
        let windows = [None, Some(9), None];
        let blocks = f.block_post(&all, &all, RegionBlocks::Windows(&windows));
        transfer(h, &mut f, op, &blocks, "whole regions but one");
    }
}

/// `post_blocks` refuses what `post` refuses, with the same kinds and in the same order: unknown
/// and wrong lists before bad blocks, unequal lengths, empty posts, more regions than the lists
/// have, block ids out of range. Nothing moves and no notification arrives. (A `num_blocks` other
/// than the list's is refused by backends that override `post_blocks`; the default numbering
/// takes it as given, as `post` takes indices: kvx-core's unit tests check the refusal.)
pub fn check_block_post_rejects_like_post<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let mut f = Fixture::new(h, 0x5eed_0b05);
    let (local, remote) = f.lists();
    let n = f.shape.num_blocks;
    let none = [Some(0), Some(0)];
    let ok_blocks = f.block_post(&[0, 1], &[2, 3], RegionBlocks::All(2));
    let out_of_range = [0, n];
    let bad_block = f.block_post(&out_of_range, &[2, 3], RegionBlocks::All(2));
    let cases = [
        (
            "an unknown local list and a bad block",
            kvx_core::DlistId(u64::MAX),
            remote,
            bad_block,
            ErrorKind::NotFound,
        ),
        (
            "an unknown remote list and a bad block",
            local,
            kvx_core::DlistId(u64::MAX),
            bad_block,
            ErrorKind::NotFound,
        ),
        ("the lists swapped", remote, local, ok_blocks, ErrorKind::InvalidArgument),
        (
            "unequal lengths",
            local,
            remote,
            f.block_post(&[0, 1], &[2], RegionBlocks::All(2)),
            ErrorKind::InvalidArgument,
        ),
        (
            "no blocks",
            local,
            remote,
            f.block_post(&[], &[], RegionBlocks::All(2)),
            ErrorKind::InvalidArgument,
        ),
        (
            "no regions",
            local,
            remote,
            f.block_post(&[0], &[0], RegionBlocks::All(0)),
            ErrorKind::InvalidArgument,
        ),
        (
            "only empty windows",
            local,
            remote,
            f.block_post(&[0], &[0], RegionBlocks::Windows(&none)),
            ErrorKind::InvalidArgument,
        ),
        ("a local block = num_blocks", local, remote, bad_block, ErrorKind::InvalidArgument),
        (
            "a remote block u32::MAX",
            local,
            remote,
            f.block_post(&[0], &[u32::MAX], RegionBlocks::All(1)),
            ErrorKind::InvalidArgument,
        ),
        (
            "more regions than the lists",
            local,
            remote,
            f.block_post(&[0], &[0], RegionBlocks::All(3)),
            ErrorKind::InvalidArgument,
        ),
    ];
    for op in ops(ini.capabilities()) {
        for (what, l, r, blocks, kind) in &cases {
            expect_kind(
                ini.post_blocks(op, *l, *r, blocks, must_not_arrive(h)),
                *kind,
                &format!("{op:?} post_blocks with {what}"),
            );
        }
    }
    assert_refused_posts_left_no_trace(h, &mut f, "refused block posts");
}
