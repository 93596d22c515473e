//! The control-plane cost of a new peer and of posting many descriptors, with criterion.
//!
//! - `first_contact/<backend>/<blocks>`: loading a new peer's metadata and preparing the list of
//!   its KV pool, `blocks` blocks x 128 regions (`load_remote` + `prep_dlist`), on kvx-nixl and on
//!   kvx-loopback. Before criterion runs, the memory each backend keeps per peer (RSS after the
//!   prep minus before) and the peak on the way (VmHWM, reset first) are printed once.
//! - `post_1000x128/<path>/<pattern>`: one READ of 1000 blocks x 128 regions (128,000 block
//!   descriptors of 256 bytes), post to done, between two NIXL agents in this process: `post`
//!   (indices into NIXL lists prepared at first contact, `makeXferReq`) against `post_blocks`
//!   (per-request lists from the coalesced plan, `createXferReq`), with the blocks scattered on
//!   both sides or contiguous on both (a fresh prompt's blocks allocated together).
//!
//! `cargo bench -p kvx-nixl --bench first_contact` (with `source scripts/nixl-env.sh`). Blocks
//! are 256 bytes so that 50k x 128 of them fit in memory the peer never touches: the costs
//! measured here are per descriptor, not per byte.
#![allow(clippy::unwrap_used, clippy::expect_used)] // A benchmark fails loudly by unwrapping.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::wait_xfer;
use criterion::{BenchmarkId, Criterion, SamplingMode};
use kvx_core::{
    BlockList, BlockPost, DlistId, DlistOwner, HostMemory, KvMemory, MemKind, RegionBlocks, TransferAgent,
    XferOp,
};
use kvx_loopback::Fabric;
use kvx_nixl::{NixlAgent, NixlConfig};

const REGIONS: u32 = 128;
const BLOCK: u64 = 256;
/// Peer sizes (blocks per region) for first contact.
const PEER_BLOCKS: [u32; 3] = [1_000, 10_000, 50_000];
/// Blocks per post, and blocks per region of the lists posted from.
const POST_BLOCKS: u32 = 1_000;
const POOL_BLOCKS: u32 = 2 * POST_BLOCKS;

/// A pool of `REGIONS` x `blocks` blocks in one registration, and its list.
fn pool(agent: &dyn TransferAgent, blocks: u32) -> (Arc<HostMemory>, BlockList) {
    let region_len = u64::from(blocks) * BLOCK;
    let memory = Arc::new(HostMemory::new((u64::from(REGIONS) * region_len) as usize).unwrap());
    agent.register(memory.clone()).unwrap();
    let base = memory.region().addr;
    let list = BlockList {
        kind: MemKind::Dram,
        device: 0,
        bases: (0..u64::from(REGIONS)).map(|r| base + r * region_len).collect(),
        num_blocks: blocks,
        block_len: BLOCK,
    };
    (memory, list)
}

/// A line of /proc/self/status in KiB.
fn status_kib(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find_map(|l| l.strip_prefix(key)).unwrap();
    line.trim().trim_end_matches("kB").trim().parse().unwrap()
}

/// One first contact: loads `metadata` and prepares `peer_list`; returns the time it took.
/// The peer is forgotten again afterwards (not timed).
fn first_contact(agent: &dyn TransferAgent, metadata: &[u8], peer_list: &BlockList) -> Duration {
    let start = Instant::now();
    let peer = agent.load_remote(metadata).unwrap();
    let list = agent.prep_dlist(&DlistOwner::Remote(peer.clone()), peer_list).unwrap();
    let elapsed = start.elapsed();
    agent.release_dlist(list).unwrap();
    agent.forget_remote(&peer).unwrap();
    elapsed
}

/// RSS kept per peer and the peak during first contact, in MiB.
fn first_contact_memory(agent: &dyn TransferAgent, metadata: &[u8], peer_list: &BlockList) -> (f64, f64) {
    std::fs::write("/proc/self/clear_refs", "5").unwrap(); // Resets VmHWM to the current RSS.
    let before = status_kib("VmRSS:");
    let peer = agent.load_remote(metadata).unwrap();
    let list = agent.prep_dlist(&DlistOwner::Remote(peer.clone()), peer_list).unwrap();
    let (kept, peak) = (status_kib("VmRSS:"), status_kib("VmHWM:"));
    agent.release_dlist(list).unwrap();
    agent.forget_remote(&peer).unwrap();
    let mib = |kib: u64| kib.saturating_sub(before) as f64 / 1024.0;
    (mib(kept), mib(peak))
}

/// The backends' first contacts: (name, the agent making contact, the peer's metadata and list,
/// what must stay alive).
type Contact = (&'static str, Box<dyn TransferAgent>, Vec<u8>, BlockList, Vec<Box<dyn std::any::Any>>);

fn contacts(blocks: u32) -> Vec<Contact> {
    let nixl_peer = NixlAgent::new("prefill", &NixlConfig::default()).unwrap();
    let (nixl_memory, nixl_list) = pool(&nixl_peer, blocks);
    let nixl = NixlAgent::new("decode", &NixlConfig::default()).unwrap();
    let fabric = Fabric::new();
    let loop_peer = fabric.agent("prefill").unwrap();
    let (loop_memory, loop_list) = pool(&loop_peer, blocks);
    let loopback = fabric.agent("decode").unwrap();
    vec![
        (
            "nixl",
            Box::new(nixl),
            nixl_peer.local_metadata().unwrap(),
            nixl_list,
            vec![Box::new(nixl_peer), Box::new(nixl_memory)],
        ),
        (
            "loopback",
            Box::new(loopback),
            loop_peer.local_metadata().unwrap(),
            loop_list,
            vec![Box::new(loop_peer), Box::new(loop_memory), Box::new(fabric)],
        ),
    ]
}

fn bench_first_contact(c: &mut Criterion) {
    let mut group = c.benchmark_group("first_contact");
    // A few contacts per sample: each NIXL contact opens UCX connections that forgetting the peer
    // closes only later, and thousands of them in a row run the process out of file descriptors.
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_nanos(1))
        .measurement_time(Duration::from_millis(1));
    for blocks in PEER_BLOCKS {
        for (name, agent, metadata, list, _alive) in contacts(blocks) {
            let (kept, peak) = first_contact_memory(agent.as_ref(), &metadata, &list);
            println!(
                "first contact, {name}, {blocks} blocks x {REGIONS} regions: {kept:.1} MiB kept per peer, \
                 {peak:.1} MiB peak"
            );
            group.bench_with_input(BenchmarkId::new(name, blocks), &blocks, |b, _| {
                b.iter_custom(|iters| {
                    (0..iters).map(|_| first_contact(agent.as_ref(), &metadata, &list)).sum()
                })
            });
        }
    }
    group.finish();
}

/// Two NIXL agents in this process with lists over `POOL_BLOCKS` x 128 blocks each.
struct PostSetup {
    decode: NixlAgent,
    prefill: NixlAgent,
    local: DlistId,
    remote: DlistId,
    _memory: [Arc<HostMemory>; 2],
}

impl PostSetup {
    fn new() -> PostSetup {
        let prefill = NixlAgent::new("prefill", &NixlConfig::default()).unwrap();
        let (remote_memory, remote_list) = pool(&prefill, POOL_BLOCKS);
        let decode = NixlAgent::new("decode", &NixlConfig::default()).unwrap();
        let (local_memory, local_list) = pool(&decode, POOL_BLOCKS);
        let peer = decode.load_remote(&prefill.local_metadata().unwrap()).unwrap();
        let local = decode.prep_dlist(&DlistOwner::Local, &local_list).unwrap();
        let remote = decode.prep_dlist(&DlistOwner::Remote(peer), &remote_list).unwrap();
        PostSetup { decode, prefill, local, remote, _memory: [local_memory, remote_memory] }
    }

    /// One READ of `blocks` (local, remote) in every region, through `post` or `post_blocks`,
    /// post to done.
    fn read(&self, blocks: &(Vec<u32>, Vec<u32>), with_blocks: bool) -> Duration {
        let (local_blocks, remote_blocks) = blocks;
        let start = Instant::now();
        let xfer = if with_blocks {
            let post = BlockPost {
                local_blocks,
                local_num_blocks: POOL_BLOCKS,
                remote_blocks,
                remote_num_blocks: POOL_BLOCKS,
                regions: RegionBlocks::All(REGIONS),
            };
            self.decode.post_blocks(XferOp::Read, self.local, self.remote, &post, None).unwrap()
        } else {
            let (mut local, mut remote) = (Vec::new(), Vec::new());
            for region in 0..REGIONS {
                local.extend(local_blocks.iter().map(|b| region * POOL_BLOCKS + b));
                remote.extend(remote_blocks.iter().map(|b| region * POOL_BLOCKS + b));
            }
            self.decode.post(XferOp::Read, self.local, &local, self.remote, &remote, None).unwrap()
        };
        wait_xfer(&self.decode, &self.prefill, xfer);
        let elapsed = start.elapsed();
        self.decode.release(xfer).unwrap();
        elapsed
    }
}

fn bench_post(c: &mut Criterion) {
    let setup = PostSetup::new();
    // Scattered: no two consecutive pairs adjacent on either side. Contiguous: one run.
    let scattered: (Vec<u32>, Vec<u32>) =
        (0..POST_BLOCKS).map(|i| ((i * 7 + 3) % POOL_BLOCKS, (i * 7919 + 11) % POOL_BLOCKS)).unzip();
    let contiguous: (Vec<u32>, Vec<u32>) = (0..POST_BLOCKS).map(|i| (i, POST_BLOCKS + i)).unzip();
    setup.read(&contiguous, false); // Connection setup.
    let mut group = c.benchmark_group("post_1000x128");
    group.sample_size(10).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_secs(3));
    for (pattern, blocks) in [("scattered", &scattered), ("contiguous", &contiguous)] {
        for (path, with_blocks) in [("post_prepped", false), ("post_blocks_per_request", true)] {
            group.bench_function(BenchmarkId::new(path, pattern), |b| {
                b.iter_custom(|iters| (0..iters).map(|_| setup.read(blocks, with_blocks)).sum())
            });
        }
    }
    group.finish();
}

fn main() {
    if !common::nixl_or_skip("first_contact") {
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    bench_first_contact(&mut c);
    bench_post(&mut c);
    c.final_summary();
}
