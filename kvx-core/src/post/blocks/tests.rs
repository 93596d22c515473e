use super::*;
use crate::ErrorKind;
use crate::memory::MemKind;
use crate::post::PostRequest;
use crate::post::tests::{CAPS, LOCAL, REMOTE};
use crate::transfer::{BlockList, DlistOwner};

const NB: u32 = 8;
const LEN: u64 = 16;
const REGION: u64 = NB as u64 * LEN;

struct Lists {
    local: (DlistOwner, BlockList),
    remote: (DlistOwner, BlockList),
}

/// Four regions of 8 blocks of 16 bytes on each side, back to back in memory.
fn lists() -> Lists {
    let list = |base: u64| BlockList {
        kind: MemKind::Dram,
        device: 0,
        bases: (0..4).map(|r| base + r * REGION).collect(),
        num_blocks: NB,
        block_len: LEN,
    };
    Lists {
        local: (DlistOwner::Local, list(0x1000)),
        remote: (DlistOwner::Remote(AgentName::new("peer")), list(0x9000)),
    }
}

impl Lists {
    fn get(&self, id: DlistId) -> Option<DlistView<'_>> {
        let (owner, blocks) = match id {
            LOCAL => &self.local,
            REMOTE => &self.remote,
            _ => return None,
        };
        Some(DlistView { owner, blocks })
    }

    /// Checks the post (every region joinable), and checks its ranges against `post`'s
    /// checked pairs for the descriptors the default implementation numbers: the same
    /// blocks in the same order.
    fn plan(&self, blocks: BlockPost<'_>) -> Result<BlockRuns> {
        self.plan_joining(blocks, |_, _| true)
    }

    fn plan_joining(
        &self,
        blocks: BlockPost<'_>,
        joinable: impl Fn(DlistId, usize) -> bool,
    ) -> Result<BlockRuns> {
        let request =
            BlockPostRequest { op: XferOp::Read, local: LOCAL, remote: REMOTE, blocks, notify: None };
        let runs = request.check(&CAPS, |id| self.get(id), joinable)?.into_runs();
        let (mut l, mut r) = (Vec::new(), Vec::new());
        blocks.descriptor_indices(&mut l, &mut r).unwrap();
        let indexed = PostRequest {
            op: XferOp::Read,
            local: LOCAL,
            local_descs: &l,
            remote: REMOTE,
            remote_descs: &r,
            notify: None,
        }
        .check(&CAPS, |id| self.get(id))
        .unwrap();
        let expected: Vec<(u64, u64)> = indexed.pairs().iter().map(|(l, r)| (l.addr, r.addr)).collect();
        let planned: Vec<(u64, u64)> = runs
            .iter()
            .flat_map(|range| {
                assert_eq!(range.len % LEN, 0);
                (0..range.len / LEN).map(move |i| (range.local + i * LEN, range.remote + i * LEN))
            })
            .collect();
        assert_eq!(planned, expected, "the ranges move the blocks `post` would, in order");
        assert_eq!(runs.descriptors(), expected.len() as u64);
        assert_eq!(runs.bytes(), expected.len() as u64 * LEN);
        assert_eq!(runs.iter().count(), runs.len());
        Ok(runs)
    }
}

fn post<'a>(local: &'a [u32], remote: &'a [u32], regions: RegionBlocks<'a>) -> BlockPost<'a> {
    BlockPost {
        local_blocks: local,
        local_num_blocks: NB,
        remote_blocks: remote,
        remote_num_blocks: NB,
        regions,
    }
}

fn ranges(runs: &BlockRuns) -> Vec<(usize, u64, u64, u64)> {
    runs.iter().map(|r| (r.region, r.local - 0x1000, r.remote - 0x9000, r.len)).collect()
}

#[test]
fn contiguous_blocks_are_one_range_per_region() {
    let l = lists();
    let blocks = post(&[2, 3, 4], &[5, 6, 7], RegionBlocks::All(2));
    let runs = l.plan(blocks).unwrap();
    assert_eq!(ranges(&runs), [(0, 32, 80, 48), (1, REGION + 32, REGION + 80, 48)]);
    assert_eq!((runs.len(), runs.descriptors()), (2, 6));
    assert_eq!(blocks.coalesced_len(), 2);
    assert_eq!(runs.regions().collect::<Vec<_>>(), [0, 1]);
}

#[test]
fn scattered_reversed_and_repeated_blocks_are_not_merged() {
    let l = lists();
    for (local, remote, per_region) in [
        (&[1, 5, 3][..], &[0, 2, 4][..], 3),
        (&[3, 2, 1], &[3, 2, 1], 3),
        // Contiguous on one side only.
        (&[1, 2, 3], &[1, 3, 5], 3),
        // A repeated pair starts a new run; the run after it goes on from the repeat.
        (&[2, 2, 3], &[4, 4, 5], 2),
    ] {
        let blocks = post(local, remote, RegionBlocks::All(3));
        let runs = l.plan(blocks).unwrap();
        assert_eq!(runs.len(), 3 * per_region, "{local:?} {remote:?}");
        assert_eq!(blocks.coalesced_len(), 3 * per_region as u64);
    }
    let runs = l.plan(post(&[2, 2, 3], &[4, 4, 5], RegionBlocks::All(1))).unwrap();
    assert_eq!(ranges(&runs), [(0, 32, 64, 16), (0, 32, 64, 32)]);
}

#[test]
fn windowed_regions_take_the_last_pairs_of_their_runs() {
    let l = lists();
    let windows = [None, Some(4), Some(1), Some(0)];
    let blocks = post(&[0, 1, 2, 5, 6], &[1, 2, 3, 4, 5], RegionBlocks::Windows(&windows));
    let runs = l.plan(blocks).unwrap();
    let r = |region: u64| region * REGION;
    assert_eq!(
        ranges(&runs),
        [
            (0, 0, 16, 48),
            (0, 80, 64, 32),
            (1, r(1) + 16, r(1) + 32, 32),
            (1, r(1) + 80, r(1) + 64, 32),
            (2, r(2) + 96, r(2) + 80, 16),
        ]
    );
    assert_eq!((runs.len(), runs.descriptors()), (5, 10));
    assert_eq!(blocks.coalesced_len(), 5);
    // A window wider than the post takes every pair.
    let wide = [Some(9), None];
    let runs = l.plan(post(&[0, 1, 2, 5, 6], &[1, 2, 3, 4, 5], RegionBlocks::Windows(&wide))).unwrap();
    assert_eq!(runs.len(), 4);
}

#[test]
fn whole_regions_back_to_back_merge_into_one_range() {
    let l = lists();
    let all: Vec<u32> = (0..NB).collect();
    let runs = l.plan(post(&all, &all, RegionBlocks::All(4))).unwrap();
    assert_eq!(ranges(&runs), [(0, 0, 0, 4 * REGION)]);
    assert_eq!((runs.len(), runs.descriptors()), (1, 32));
    assert_eq!(runs.regions().collect::<Vec<_>>(), [0]);
    // Where the backend cannot join region 1 to 2 (two registrations), two ranges.
    let runs =
        l.plan_joining(post(&all, &all, RegionBlocks::All(4)), |id, r| !(id == REMOTE && r == 1)).unwrap();
    assert_eq!(ranges(&runs), [(0, 0, 0, 2 * REGION), (2, 2 * REGION, 2 * REGION, 2 * REGION)]);
    // Nor where a region is not whole, or the regions are not adjacent on one side.
    let windows = [None, None, Some(7), None];
    assert_eq!(l.plan(post(&all, &all, RegionBlocks::Windows(&windows))).unwrap().len(), 3);
    let mut apart = lists();
    apart.remote.1.bases[2] += 4 * REGION;
    let runs = apart.plan(post(&all, &all, RegionBlocks::All(4))).unwrap();
    assert_eq!(runs.iter().map(|r| r.region).collect::<Vec<_>>(), [0, 2, 3]);
    // Shifted blocks are contiguous but not whole regions.
    let shifted: Vec<u32> = (1..NB).collect();
    assert_eq!(l.plan(post(&shifted, &shifted, RegionBlocks::All(4))).unwrap().len(), 4);
}

#[test]
fn each_bad_argument_has_the_kind_and_order_of_post() {
    let l = lists();
    let check = |lists: &Lists, request: BlockPostRequest<'_>| {
        request.check(&CAPS, |id| lists.get(id), |_, _| true).map(|_| ()).unwrap_err()
    };
    let ok = post(&[0, 1], &[2, 3], RegionBlocks::All(2));
    let base = BlockPostRequest { op: XferOp::Read, local: LOCAL, remote: REMOTE, blocks: ok, notify: None };
    let with = |blocks| BlockPostRequest { blocks, ..base };
    let none = [Some(0), Some(0)];
    let big = vec![0; crate::MAX_NOTIFICATION_LEN + 1];
    let cases: [(&str, BlockPostRequest<'_>, ErrorKind); 12] = [
        (
            "unknown list before a bad block",
            BlockPostRequest { local: DlistId(9), ..with(post(&[8], &[0], RegionBlocks::All(1))) },
            ErrorKind::NotFound,
        ),
        ("remote list as local", BlockPostRequest { local: REMOTE, ..base }, ErrorKind::InvalidArgument),
        ("long notification", BlockPostRequest { notify: Some(&big), ..base }, ErrorKind::InvalidArgument),
        ("unequal lengths", with(post(&[0, 1], &[2], RegionBlocks::All(2))), ErrorKind::InvalidArgument),
        ("no pairs", with(post(&[], &[], RegionBlocks::All(2))), ErrorKind::InvalidArgument),
        ("no regions", with(post(&[0], &[0], RegionBlocks::All(0))), ErrorKind::InvalidArgument),
        (
            "only empty windows",
            with(post(&[0], &[0], RegionBlocks::Windows(&none))),
            ErrorKind::InvalidArgument,
        ),
        (
            "local block = num_blocks",
            with(post(&[0, NB], &[0, 1], RegionBlocks::All(1))),
            ErrorKind::InvalidArgument,
        ),
        (
            "remote block u32::MAX",
            with(post(&[0], &[u32::MAX], RegionBlocks::All(1))),
            ErrorKind::InvalidArgument,
        ),
        (
            "more regions than the lists",
            with(post(&[0], &[0], RegionBlocks::All(5))),
            ErrorKind::InvalidArgument,
        ),
        (
            "wrong local num_blocks",
            with(BlockPost { local_num_blocks: NB + 1, ..ok }),
            ErrorKind::InvalidArgument,
        ),
        (
            "wrong remote num_blocks",
            with(BlockPost { remote_num_blocks: 1, ..ok }),
            ErrorKind::InvalidArgument,
        ),
    ];
    for (what, request, kind) in cases {
        let e = check(&l, request);
        assert_eq!((e.kind(), e.backend()), (kind, Some("test")), "{what}: {e}");
    }
    let mut half = lists();
    half.remote.1.block_len = LEN / 2;
    assert_eq!(check(&half, base).kind(), ErrorKind::InvalidArgument, "unequal block lengths");
    let no_read = Capabilities { read: false, ..CAPS };
    let unknown = BlockPostRequest { local: DlistId(9), ..base };
    let e = unknown.check(&no_read, |id| l.get(id), |_, _| true).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
}

#[test]
fn the_default_numbering_refuses_what_it_cannot_number() {
    let (mut l, mut r) = (Vec::new(), Vec::new());
    assert!(post(&[0, 1], &[1, 2], RegionBlocks::All(2)).descriptor_indices(&mut l, &mut r).is_ok());
    assert_eq!((l, r), (vec![0, 1, 8, 9], vec![1, 2, 9, 10]));
    for bad in [
        post(&[NB], &[0], RegionBlocks::All(1)),
        post(&[0], &[0, 1], RegionBlocks::All(1)),
        BlockPost {
            local_num_blocks: u32::MAX,
            remote_num_blocks: u32::MAX,
            ..post(&[1], &[1], RegionBlocks::All(2))
        },
    ] {
        let e = bad.descriptor_indices(&mut Vec::new(), &mut Vec::new()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }
}

#[test]
fn random_posts_move_exactly_the_blocks_post_would() {
    let l = lists();
    let mut seed = 0x5eed_u64;
    let mut next = |n: u32| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 33) % u64::from(n)) as u32
    };
    for _ in 0..200 {
        let pairs = 1 + next(12) as usize;
        let (mut local, mut remote) = (vec![next(NB)], vec![next(NB)]);
        while local.len() < pairs {
            // Mostly contiguous, sometimes not.
            let (a, b) = (local[local.len() - 1], remote[remote.len() - 1]);
            let jump = next(4) == 0;
            local.push(if jump || a + 1 >= NB { next(NB) } else { a + 1 });
            remote.push(if jump || b + 1 >= NB { next(NB) } else { b + 1 });
        }
        let windows: Vec<Option<u32>> =
            (0..4).map(|_| if next(3) == 0 { None } else { Some(next(pairs as u32 + 1)) }).collect();
        let selections = [RegionBlocks::All(1 + next(4)), RegionBlocks::Windows(&windows)];
        for regions in selections {
            let blocks = post(&local, &remote, regions);
            match l.plan(blocks) {
                Ok(runs) => assert!(runs.len() as u64 <= blocks.coalesced_len()),
                Err(e) => {
                    assert!(windows.iter().all(|w| w == &Some(0)) && e.kind() == ErrorKind::InvalidArgument)
                }
            }
        }
    }
}
