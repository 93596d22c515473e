//! NixlAgent against the real NIXL library: two agents in one process, UCX backend, host memory.
//! Every transferred byte is checked. Without NIXL these tests SKIP loudly, or fail with
//! `KVX_REQUIRE_NIXL=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by unwrapping.

mod common;

use std::sync::Arc;

use common::{nixl_or_skip, pattern, wait_notifications, wait_xfer};
use kvx_core::wire::agent_metadata;
use kvx_core::{
    AgentName, BlockList, BlockPost, DlistId, DlistOwner, ErrorKind, HostMemory, KvMemory, MemKind,
    Notification, RegionBlocks, TransferAgent, XferOp, XferState,
};
use kvx_nixl::{NixlAgent, NixlConfig};

const BLOCK: u64 = 4096;
const BLOCKS: u32 = 16;
const REGIONS: usize = 2;

/// One side: an agent and a pool of REGIONS x BLOCKS blocks in one registration.
struct Side {
    agent: NixlAgent,
    pool: Arc<HostMemory>,
}

impl Side {
    fn new(name: &str, seed: u64) -> Side {
        let agent = NixlAgent::new(name, &NixlConfig::default()).unwrap();
        let pool = Arc::new(HostMemory::new(REGIONS * BLOCKS as usize * BLOCK as usize).unwrap());
        pool.write(0, &pattern(seed, pool.len())).unwrap();
        agent.register(pool.clone()).unwrap();
        Side { agent, pool }
    }

    fn blocks(&self) -> BlockList {
        let base = self.pool.region().addr;
        let region_len = u64::from(BLOCKS) * BLOCK;
        BlockList {
            kind: MemKind::Dram,
            device: 0,
            bases: (0..REGIONS as u64).map(|r| base + r * region_len).collect(),
            num_blocks: BLOCKS,
            block_len: BLOCK,
        }
    }

    fn block(&self, desc: u32) -> Vec<u8> {
        let mut out = vec![0; BLOCK as usize];
        self.pool.read(desc as usize * BLOCK as usize, &mut out).unwrap();
        out
    }
}

/// `a` with both lists prepared against `b`.
fn connect(a: &Side, b: &Side) -> (AgentName, DlistId, DlistId) {
    let peer = a.agent.load_remote(&b.agent.local_metadata().unwrap()).unwrap();
    assert_eq!(peer.as_str(), b.agent.name().as_str());
    let local = a.agent.prep_dlist(&DlistOwner::Local, &a.blocks()).unwrap();
    let remote = a.agent.prep_dlist(&DlistOwner::Remote(peer.clone()), &b.blocks()).unwrap();
    (peer, local, remote)
}

#[test]
fn read_and_write_move_every_byte_and_notify_after() {
    if !nixl_or_skip("read_and_write_move_every_byte_and_notify_after") {
        return;
    }
    let decode = Side::new("decode", 1);
    let prefill = Side::new("prefill", 2);
    let (peer, local, remote) = connect(&decode, &prefill);
    // The prefill side also knows the decode side (for notifications back and WRITEs).
    prefill.agent.load_remote(&decode.agent.local_metadata().unwrap()).unwrap();
    let caps = decode.agent.capabilities();
    assert!(caps.dram && caps.read && caps.write && caps.notifications);
    assert_eq!(caps.backend, "nixl");

    // READ scattered blocks across both regions, with a notification.
    let (dst, src) = ([0u32, 1, 17, 30], [5u32, 31, 3, 16]);
    let before: Vec<_> = (0..REGIONS as u32 * BLOCKS).map(|d| decode.block(d)).collect();
    let xfer = decode.agent.post(XferOp::Read, local, &dst, remote, &src, Some(b"req-1")).unwrap();
    assert_eq!(wait_xfer(&decode.agent, &prefill.agent, xfer), XferState::Done);
    for (d, s) in dst.iter().zip(&src) {
        assert_eq!(decode.block(*d), prefill.block(*s), "block {s} -> {d}");
    }
    for d in (0..REGIONS as u32 * BLOCKS).filter(|d| !dst.contains(d)) {
        assert_eq!(decode.block(d), before[d as usize], "untouched block {d} changed");
    }
    let notes = wait_notifications(&prefill.agent, &decode.agent, 1);
    assert_eq!(notes, vec![Notification { from: AgentName::new("decode"), msg: b"req-1".to_vec() }]);
    decode.agent.release(xfer).unwrap();
    assert_eq!(decode.agent.poll(xfer).unwrap_err().kind(), ErrorKind::NotFound);

    // WRITE back the other way, with a notification that is not UTF-8.
    let xfer =
        decode.agent.post(XferOp::Write, local, &[2, 3], remote, &[7, 8], Some(&[0xff, 0, 0xfe])).unwrap();
    assert_eq!(wait_xfer(&decode.agent, &prefill.agent, xfer), XferState::Done);
    assert_eq!(prefill.block(7), decode.block(2));
    assert_eq!(prefill.block(8), decode.block(3));
    let notes = wait_notifications(&prefill.agent, &decode.agent, 1);
    assert_eq!(notes[0].msg, vec![0xff, 0, 0xfe]);
    decode.agent.release(xfer).unwrap();

    // A notification without data, both ways.
    decode.agent.notify(&peer, b"ping").unwrap();
    assert_eq!(wait_notifications(&prefill.agent, &decode.agent, 1)[0].msg, b"ping");
    prefill.agent.notify(&AgentName::new("decode"), b"pong").unwrap();
    let back = wait_notifications(&decode.agent, &prefill.agent, 1);
    assert_eq!(back[0], Notification { from: AgentName::new("prefill"), msg: b"pong".to_vec() });
}

/// Posts `blocks` from `from` to `to` with `post_blocks` (READ: `from` initiates and reads `to`'s
/// blocks; WRITE: `from` writes into `to`) and checks every byte of both pools afterwards.
fn post_blocks_and_verify(
    op: XferOp,
    from: &Side,
    to: &Side,
    lists: (DlistId, DlistId),
    blocks: &BlockPost<'_>,
) {
    let all = REGIONS as u32 * BLOCKS;
    let (src, dst) = if op == XferOp::Read { (to, from) } else { (from, to) };
    let (src_before, dst_before): (Vec<_>, Vec<_>) = (0..all).map(|d| (src.block(d), dst.block(d))).unzip();
    let mut expected = dst_before;
    let pairs = blocks.local_blocks.len();
    for region in 0..blocks.regions.count() {
        for i in blocks.regions.first_pair(region, pairs)..pairs {
            let (l, r) = (blocks.local_blocks[i], blocks.remote_blocks[i]);
            let (s, d) = if op == XferOp::Read { (r, l) } else { (l, r) };
            let region = region as u32 * BLOCKS;
            expected[(region + d) as usize] = src_before[(region + s) as usize].clone();
        }
    }
    let xfer = from.agent.post_blocks(op, lists.0, lists.1, blocks, Some(b"blocks")).unwrap();
    assert_eq!(wait_xfer(&from.agent, &to.agent, xfer), XferState::Done);
    for d in 0..all {
        assert!(dst.block(d) == expected[d as usize], "{op:?}: block {d} of the destination");
        assert!(src.block(d) == src_before[d as usize], "{op:?}: block {d} of the source changed");
    }
    let notes = wait_notifications(&to.agent, &from.agent, 1);
    assert_eq!(notes[0].msg, b"blocks");
    from.agent.release(xfer).unwrap();
}

#[test]
fn post_blocks_moves_coalesced_runs_and_every_byte() {
    if !nixl_or_skip("post_blocks_moves_coalesced_runs_and_every_byte") {
        return;
    }
    let decode = Side::new("decode", 11);
    let prefill = Side::new("prefill", 12);
    let (_, local, remote) = connect(&decode, &prefill);
    prefill.agent.load_remote(&decode.agent.local_metadata().unwrap()).unwrap();
    let post = |local_blocks, remote_blocks, regions| BlockPost {
        local_blocks,
        local_num_blocks: BLOCKS,
        remote_blocks,
        remote_num_blocks: BLOCKS,
        regions,
    };
    let all = RegionBlocks::All(REGIONS as u32);

    // Runs of 3, 1 and 2 blocks contiguous on both sides, scattered between them.
    let (l, r) = ([0u32, 1, 2, 7, 9, 10], [3u32, 4, 5, 1, 14, 15]);
    post_blocks_and_verify(XferOp::Read, &decode, &prefill, (local, remote), &post(&l, &r, all));
    // Every block of the pool: both regions become one range.
    let every: Vec<u32> = (0..BLOCKS).collect();
    post_blocks_and_verify(XferOp::Read, &decode, &prefill, (local, remote), &post(&every, &every, all));
    // A sliding window: region 0 takes only the last two pairs, region 1 all of them.
    let windows = [Some(2), None];
    let (l, r) = ([4u32, 5, 6, 12], [8u32, 9, 10, 0]);
    post_blocks_and_verify(
        XferOp::Read,
        &decode,
        &prefill,
        (local, remote),
        &post(&l, &r, RegionBlocks::Windows(&windows)),
    );
    // WRITE, only the first region.
    let (l, r) = ([3u32, 4, 11], [6u32, 7, 2]);
    post_blocks_and_verify(
        XferOp::Write,
        &decode,
        &prefill,
        (local, remote),
        &post(&l, &r, RegionBlocks::All(1)),
    );

    // `post` on the same lists prepares their per-block NIXL lists on first use.
    let (dst, src) = ([1u32, 20], [30u32, 2]);
    let xfer = decode.agent.post(XferOp::Read, local, &dst, remote, &src, None).unwrap();
    assert_eq!(wait_xfer(&decode.agent, &prefill.agent, xfer), XferState::Done);
    for (d, s) in dst.iter().zip(&src) {
        assert_eq!(decode.block(*d), prefill.block(*s), "block {s} -> {d}");
    }
    decode.agent.release(xfer).unwrap();

    // Refused before anything moves, with post's kinds.
    let refused = |blocks: &BlockPost<'_>| {
        decode.agent.post_blocks(XferOp::Read, local, remote, blocks, None).unwrap_err().kind()
    };
    assert_eq!(refused(&post(&[BLOCKS], &[0], all)), ErrorKind::InvalidArgument);
    assert_eq!(refused(&post(&[0, 1], &[0], all)), ErrorKind::InvalidArgument);
    let mut wrong_size = post(&[0], &[0], all);
    wrong_size.remote_num_blocks = BLOCKS + 1;
    assert_eq!(refused(&wrong_size), ErrorKind::InvalidArgument);
    assert_eq!(refused(&post(&[0], &[0], RegionBlocks::All(REGIONS as u32 + 1))), ErrorKind::InvalidArgument);
    let e = decode.agent.post_blocks(XferOp::Read, remote, local, &post(&[0], &[0], all), None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

#[test]
fn descriptor_lists_must_lie_in_registered_memory() {
    if !nixl_or_skip("descriptor_lists_must_lie_in_registered_memory") {
        return;
    }
    let decode = Side::new("decode", 5);
    let prefill = Side::new("prefill", 6);
    let peer = decode.agent.load_remote(&prefill.agent.local_metadata().unwrap()).unwrap();
    let mut outside = decode.blocks();
    outside.num_blocks += 1; // The last region now runs past the registration.
    assert_eq!(
        decode.agent.prep_dlist(&DlistOwner::Local, &outside).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let mut outside = prefill.blocks();
    outside.bases[0] -= BLOCK;
    let e = decode.agent.prep_dlist(&DlistOwner::Remote(peer.clone()), &outside).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPeerData);
    let mut wrapping = prefill.blocks();
    wrapping.bases[1] = u64::MAX - BLOCK;
    let e = decode.agent.prep_dlist(&DlistOwner::Remote(peer), &wrapping).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPeerData);
    let e = decode
        .agent
        .prep_dlist(&DlistOwner::Remote(AgentName::new("nobody")), &prefill.blocks())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    let vram = BlockList { kind: MemKind::Vram, ..decode.blocks() };
    let e = decode.agent.prep_dlist(&DlistOwner::Local, &vram).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidArgument | ErrorKind::Unsupported), "{e}");
    let list = decode.agent.prep_dlist(&DlistOwner::Local, &decode.blocks()).unwrap();
    decode.agent.release_dlist(list).unwrap();
    assert_eq!(decode.agent.release_dlist(list).unwrap_err().kind(), ErrorKind::NotFound);
}

/// Agent metadata is kvx-core's envelope: a loopback agent's metadata is `Incompatible` here and
/// a NIXL agent's is there; a byte after it is `InvalidPeerData`; neither loads anything.
#[test]
fn metadata_of_another_backend_is_incompatible_and_bytes_after_it_are_invalid() {
    if !nixl_or_skip("metadata_of_another_backend_is_incompatible_and_bytes_after_it_are_invalid") {
        return;
    }
    let decode = Side::new("decode", 9);
    let prefill = Side::new("prefill", 10);
    let fabric = kvx_loopback::Fabric::new();
    let loopback = fabric.agent("loopback-peer").unwrap();
    let e = decode.agent.load_remote(&loopback.local_metadata().unwrap()).unwrap_err();
    assert_eq!((e.kind(), e.backend()), (ErrorKind::Incompatible, Some("nixl")), "{e}");
    let e = loopback.load_remote(&prefill.agent.local_metadata().unwrap()).unwrap_err();
    assert_eq!((e.kind(), e.backend()), (ErrorKind::Incompatible, Some("loopback")), "{e}");
    let ucx = agent_metadata::seal("ucx", prefill.agent.name(), &()).unwrap();
    assert_eq!(decode.agent.load_remote(&ucx).unwrap_err().kind(), ErrorKind::Incompatible);

    let md = prefill.agent.local_metadata().unwrap();
    let e = decode.agent.load_remote(&[&md[..], &[0]].concat()).unwrap_err();
    assert_eq!((e.kind(), e.backend()), (ErrorKind::InvalidPeerData, Some("nixl")), "{e}");
    assert_eq!(decode.agent.load_remote(&md).unwrap(), *prefill.agent.name(), "nothing was half-loaded");
    for bad in ["n".repeat(agent_metadata::MAX_AGENT_NAME + 1), "a\0".to_owned()] {
        let made = NixlAgent::new(bad, &NixlConfig::default());
        assert_eq!(made.err().map(|e| e.kind()), Some(ErrorKind::InvalidArgument));
    }
}

#[test]
fn metadata_is_validated_and_a_restarted_peer_is_reloaded() {
    if !nixl_or_skip("metadata_is_validated_and_a_restarted_peer_is_reloaded") {
        return;
    }
    let decode = Side::new("decode", 7);
    let prefill = Side::new("prefill", 8);
    let metadata = prefill.agent.local_metadata().unwrap();
    assert_eq!(decode.agent.load_remote(b"not metadata").unwrap_err().kind(), ErrorKind::InvalidPeerData);
    assert_eq!(
        decode.agent.load_remote(&metadata[..metadata.len() / 2]).unwrap_err().kind(),
        ErrorKind::InvalidPeerData
    );
    let own = decode.agent.local_metadata().unwrap();
    assert_eq!(decode.agent.load_remote(&own).unwrap_err().kind(), ErrorKind::InvalidPeerData);
    let (peer, local, remote) = connect(&decode, &prefill);
    assert_eq!(decode.agent.load_remote(&metadata).unwrap_err().kind(), ErrorKind::State);

    // The peer restarts: same name, new memory, new metadata.
    drop(prefill);
    decode.agent.forget_remote(&peer).unwrap();
    assert_eq!(decode.agent.forget_remote(&peer).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(decode.agent.notify(&peer, b"x").unwrap_err().kind(), ErrorKind::NotFound);
    // Its lists went with it.
    assert_eq!(
        decode.agent.post(XferOp::Read, local, &[0], remote, &[0], None).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    let restarted = Side::new("prefill", 9);
    let (_, local, remote) = connect(&decode, &restarted);
    let xfer = decode.agent.post(XferOp::Read, local, &[4], remote, &[9], None).unwrap();
    assert_eq!(wait_xfer(&decode.agent, &restarted.agent, xfer), XferState::Done);
    assert_eq!(decode.block(4), restarted.block(9));
}

#[test]
fn deregistering_releases_the_lists_over_the_memory() {
    if !nixl_or_skip("deregistering_releases_the_lists_over_the_memory") {
        return;
    }
    let agent = NixlAgent::new("solo", &NixlConfig::default()).unwrap();
    let a = Arc::new(HostMemory::new(1 << 16).unwrap());
    let b = Arc::new(HostMemory::new(1 << 16).unwrap());
    let reg_a = agent.register(a.clone()).unwrap();
    let _reg_b = agent.register(b.clone()).unwrap();
    let over = |m: &HostMemory| BlockList {
        kind: MemKind::Dram,
        device: 0,
        bases: vec![m.region().addr],
        num_blocks: 4,
        block_len: 1 << 14,
    };
    let list_a = agent.prep_dlist(&DlistOwner::Local, &over(&a)).unwrap();
    let list_b = agent.prep_dlist(&DlistOwner::Local, &over(&b)).unwrap();
    agent.deregister(reg_a).unwrap();
    assert_eq!(agent.release_dlist(list_a).unwrap_err().kind(), ErrorKind::NotFound);
    agent.release_dlist(list_b).unwrap();
    assert_eq!(agent.deregister(reg_a).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(
        agent.prep_dlist(&DlistOwner::Local, &over(&a)).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // The agent held the memory until deregistration; now only the test does.
    assert_eq!(Arc::strong_count(&a), 1);
    assert_eq!(Arc::strong_count(&b), 2);
    drop(agent);
    assert_eq!(Arc::strong_count(&b), 1);
}

#[test]
fn agents_can_be_created_and_used_from_many_threads_at_once() {
    if !nixl_or_skip("agents_can_be_created_and_used_from_many_threads_at_once") {
        return;
    }
    std::thread::scope(|s| {
        for t in 0..4u64 {
            s.spawn(move || {
                let decode = Side::new(&format!("decode-{t}"), 10 + t);
                let prefill = Side::new(&format!("prefill-{t}"), 20 + t);
                let (_, local, remote) = connect(&decode, &prefill);
                let xfer = decode.agent.post(XferOp::Read, local, &[1], remote, &[2], None).unwrap();
                assert_eq!(wait_xfer(&decode.agent, &prefill.agent, xfer), XferState::Done);
                assert_eq!(decode.block(1), prefill.block(2));
            });
        }
    });
}

/// Without the library, creating an agent is a typed error, not an abort: run in a child process
/// whose loader cannot find NIXL. Needs no NIXL, so it always runs.
#[test]
fn a_missing_library_is_an_error_not_an_abort() {
    const ROLE: &str = "KVX_NIXL_TEST_NO_LIBRARY";
    if std::env::var_os(ROLE).is_some() {
        let e = NixlAgent::new("orphan", &NixlConfig::default()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAvailable, "{e}");
        assert_eq!(e.backend(), Some("nixl"));
        assert!(kvx_nixl::check_library().is_err());
        println!("CHILD-OK: {e}");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_missing_library_is_an_error_not_an_abort", "--nocapture", "--test-threads=1"])
        .env(ROLE, "1")
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD-OK"),
        "child failed: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// GPU memory registered as NIXL VRAM and read into host memory. Needs a GPU: without one it says
/// SKIP (the `cuda` feature only has to build here).
#[cfg(feature = "cuda")]
#[test]
fn vram_blocks_are_read_into_host_memory() {
    use kvx_nixl::CudaMemory;
    use std::io::Write;
    if !nixl_or_skip("vram_blocks_are_read_into_host_memory") {
        return;
    }
    let gpu = match CudaMemory::new(0, 1 << 20) {
        Ok(gpu) => Arc::new(gpu),
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "\n*** SKIP vram_blocks_are_read_into_host_memory: no GPU: {e}\n"
            );
            return;
        }
    };
    let data = pattern(42, gpu.len());
    gpu.write(0, &data).unwrap();
    let prefill = NixlAgent::new("prefill-gpu", &NixlConfig::default()).unwrap();
    assert!(prefill.capabilities().vram);
    prefill.register(gpu.clone()).unwrap();
    let decode = Side::new("decode-host", 43);
    let peer = decode.agent.load_remote(&prefill.local_metadata().unwrap()).unwrap();
    let remote_blocks = BlockList {
        kind: MemKind::Vram,
        device: gpu.region().device,
        bases: vec![gpu.region().addr],
        num_blocks: 256,
        block_len: BLOCK,
    };
    let local = decode.agent.prep_dlist(&DlistOwner::Local, &decode.blocks()).unwrap();
    let remote = decode.agent.prep_dlist(&DlistOwner::Remote(peer), &remote_blocks).unwrap();
    let xfer = decode.agent.post(XferOp::Read, local, &[0, 5], remote, &[200, 7], Some(b"gpu")).unwrap();
    assert_eq!(wait_xfer(&decode.agent, &prefill, xfer), XferState::Done);
    assert_eq!(decode.block(0), data[200 * BLOCK as usize..201 * BLOCK as usize]);
    assert_eq!(decode.block(5), data[7 * BLOCK as usize..8 * BLOCK as usize]);
}

/// A transfer in flight keeps its memory and its remote: deregistering and forgetting succeed at
/// once; released, it completes in the background, and only then does the agent let the memory
/// go. A restarted peer (new metadata under the same name) cannot be loaded while it is in flight:
/// NIXL keeps one connection per name.
#[test]
fn transfers_in_flight_keep_their_memory_and_remote() {
    if !nixl_or_skip("transfers_in_flight_keep_their_memory_and_remote") {
        return;
    }
    let decode = NixlAgent::new("decode", &NixlConfig::default()).unwrap();
    let pool = Arc::new(HostMemory::new(REGIONS * BLOCKS as usize * BLOCK as usize).unwrap());
    let registration = decode.register(pool.clone()).unwrap();
    let decode = Side { agent: decode, pool };
    let prefill = Side::new("prefill", 50);
    let (peer, local, remote) = connect(&decode, &prefill);
    // The first transfer needs the target to progress (connection setup): it stays in flight
    // until `prefill` is serviced.
    let xfer = decode.agent.post(XferOp::Read, local, &[0, 1, 2, 3], remote, &[9, 8, 7, 6], None).unwrap();
    assert_eq!(decode.agent.poll(xfer).unwrap(), XferState::Pending, "in flight until the target progresses");
    decode.agent.forget_remote(&peer).unwrap();
    decode.agent.deregister(registration).unwrap();
    assert_eq!(Arc::strong_count(&decode.pool), 2, "the transfer in flight keeps the memory");
    assert_eq!(
        decode.agent.post(XferOp::Read, local, &[0], remote, &[0], None).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    let restarted = Side::new("prefill", 51);
    let e = decode.agent.load_remote(&restarted.agent.local_metadata().unwrap()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::State, "{e}");
    decode.agent.release(xfer).unwrap();
    assert_eq!(decode.agent.poll(xfer).unwrap_err().kind(), ErrorKind::NotFound);

    // Serviced, the detached transfer completes, and then the memory and remote go.
    let deadline = std::time::Instant::now() + common::DEADLINE;
    while Arc::strong_count(&decode.pool) > 1 {
        prefill.agent.progress().unwrap();
        decode.agent.progress().unwrap();
        assert!(std::time::Instant::now() < deadline, "detached transfer never completed");
    }
    for (d, s) in [(0, 9), (1, 8), (2, 7), (3, 6)] {
        assert_eq!(decode.block(d), prefill.block(s));
    }
    assert_eq!(decode.agent.load_remote(&restarted.agent.local_metadata().unwrap()).unwrap(), peer);
}
