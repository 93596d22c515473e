//! READ prep + post of 1000 blocks × 128 regions, as kvx's worker posts a request: the index post
//! (`post`, descriptor indices numbered per region and block, as the worker did before
//! `post_blocks`) against the block post (`post_blocks`, each block named once, planned as
//! coalesced runs), in the same run, for blocks scattered over the pool and for contiguous blocks.
//!
//! Agents: kvx-loopback, a no-op agent (the caller's own cost: numbering descriptors, or nothing)
//! and kvx-ucx (two agents in one process, UCX-allocated pools; only the post is timed, the gets
//! then complete untimed). The `kvx-core check` group times kvx-core's checks alone
//! (`PostRequest::check`, `BlockPostRequest::check`): what every backend pays before its
//! transport.
//!
//! `UCX_LOG_LEVEL=fatal cargo bench -p kvx-ucx --bench post`
#![allow(clippy::unwrap_used, clippy::expect_used)] // Benchmark driver: panics are failures.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvx_core::post::{BlockPostRequest, DlistView};
use kvx_core::testing::NoopAgent;
use kvx_core::{
    AgentName, BlockList, BlockPost, DlistId, DlistOwner, HostMemory, KvMemory, PostRequest, RegionBlocks,
    TransferAgent, XferId, XferOp, XferState,
};
use kvx_loopback::Fabric;
use kvx_ucx::UcxAgent;

const REGIONS: u32 = 128;
/// Blocks per region of the pool on each side.
const POOL: u32 = 2048;
/// Blocks per request.
const BLOCKS: usize = 1000;
/// Bytes per block (the post's cost does not depend on it; small keeps the pools small).
const BLOCK_LEN: u64 = 64;

/// The block ids of one request: contiguous on both sides, or scattered over the pool.
fn request(contiguous: bool) -> (Vec<u32>, Vec<u32>) {
    if contiguous {
        return ((100..100 + BLOCKS as u32).collect(), (500..500 + BLOCKS as u32).collect());
    }
    // Distinct random blocks (a partial Fisher-Yates shuffle of a fixed seed).
    let mut seed = 0x5eed_u64;
    let mut pick = || {
        let mut v: Vec<u32> = (0..POOL).collect();
        for i in 0..BLOCKS {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let j = i + (seed >> 33) as usize % (v.len() - i);
            v.swap(i, j);
        }
        v.truncate(BLOCKS);
        v
    };
    (pick(), pick())
}

fn block_post<'a>(local: &'a [u32], remote: &'a [u32]) -> BlockPost<'a> {
    BlockPost {
        local_blocks: local,
        local_num_blocks: POOL,
        remote_blocks: remote,
        remote_num_blocks: POOL,
        regions: RegionBlocks::All(REGIONS),
    }
}

/// The list of `REGIONS` regions back to back in `memory`.
fn list(memory: &dyn KvMemory) -> BlockList {
    let base = memory.region().addr;
    let region_len = u64::from(POOL) * BLOCK_LEN;
    BlockList {
        kind: memory.region().kind,
        device: 0,
        bases: (0..u64::from(REGIONS)).map(|r| base + r * region_len).collect(),
        num_blocks: POOL,
        block_len: BLOCK_LEN,
    }
}

fn pool_len() -> usize {
    (u64::from(REGIONS) * u64::from(POOL) * BLOCK_LEN) as usize
}

/// Two agents, each with one pool registered, the target loaded by the initiator, one list each.
struct Lists {
    local: DlistId,
    remote: DlistId,
}

fn connect(
    ini: &dyn TransferAgent,
    tgt: &dyn TransferAgent,
    ini_mem: Arc<dyn KvMemory>,
    tgt_mem: Arc<dyn KvMemory>,
) -> Lists {
    ini.register(ini_mem.clone()).unwrap();
    tgt.register(tgt_mem.clone()).unwrap();
    let peer = ini.load_remote(&tgt.local_metadata().unwrap()).unwrap();
    Lists {
        local: ini.prep_dlist(&DlistOwner::Local, &list(&*ini_mem)).unwrap(),
        remote: ini.prep_dlist(&DlistOwner::Remote(peer), &list(&*tgt_mem)).unwrap(),
    }
}

/// What the worker did before `post_blocks`: number the descriptors (into buffers it reuses),
/// then `post`.
struct IndexPost {
    local: Vec<u32>,
    remote: Vec<u32>,
}

impl IndexPost {
    fn post(&mut self, agent: &dyn TransferAgent, lists: &Lists, blocks: &BlockPost<'_>) -> XferId {
        self.local.clear();
        self.remote.clear();
        blocks.descriptor_indices(&mut self.local, &mut self.remote).unwrap();
        agent.post(XferOp::Read, lists.local, &self.local, lists.remote, &self.remote, Some(b"req")).unwrap()
    }
}

/// Times `post` alone over `iters` posts; `settle` completes and releases each, untimed.
fn time_posts(iters: u64, mut post: impl FnMut() -> XferId, mut settle: impl FnMut(XferId)) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let start = Instant::now();
        let x = post();
        total += start.elapsed();
        settle(x);
    }
    total
}

/// The four cases (index or block post, scattered or contiguous) for one agent.
fn bench_agent(
    c: &mut Criterion,
    name: &str,
    agent: &dyn TransferAgent,
    lists: &Lists,
    mut settle: impl FnMut(XferId),
) {
    let mut group = c.benchmark_group(format!("read_post_1000x128/{name}"));
    for contiguous in [false, true] {
        let shape = if contiguous { "contiguous" } else { "scattered" };
        let (local, remote) = request(contiguous);
        let blocks = block_post(&local, &remote);
        let mut index = IndexPost { local: Vec::new(), remote: Vec::new() };
        group.bench_function(BenchmarkId::new("index_post", shape), |b| {
            b.iter_custom(|iters| time_posts(iters, || index.post(agent, lists, &blocks), &mut settle))
        });
        group.bench_function(BenchmarkId::new("block_post", shape), |b| {
            b.iter_custom(|iters| {
                time_posts(
                    iters,
                    || {
                        agent
                            .post_blocks(XferOp::Read, lists.local, lists.remote, &blocks, Some(b"req"))
                            .unwrap()
                    },
                    &mut settle,
                )
            })
        });
    }
    group.finish();
}

fn loopback(c: &mut Criterion) {
    let fabric = Fabric::new();
    let (ini, tgt) = (fabric.agent("decode").unwrap(), fabric.agent("prefill").unwrap());
    let mem = || -> Arc<dyn KvMemory> { Arc::new(HostMemory::new(pool_len()).unwrap()) };
    let lists = connect(&ini, &tgt, mem(), mem());
    // A queued transfer is cancelled by its release: nothing is copied.
    bench_agent(c, "loopback", &ini, &lists, |x| ini.release(x).unwrap());
}

fn ucx(c: &mut Criterion) {
    let ini = UcxAgent::new("bench-decode").unwrap();
    let tgt = UcxAgent::new("bench-prefill").unwrap();
    let lists =
        connect(&ini, &tgt, ini.alloc_memory(pool_len()).unwrap(), tgt.alloc_memory(pool_len()).unwrap());
    let mut done = Vec::new();
    let settle = |x: XferId| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            tgt.progress().unwrap();
            done.clear();
            ini.drain_completions(&mut done).unwrap();
            if done.contains(&x) {
                break;
            }
            assert!(Instant::now() < deadline, "a READ did not complete in 30 s");
        }
        assert_eq!(ini.poll(x).unwrap(), XferState::Done);
        ini.release(x).unwrap();
        let mut notes = Vec::new();
        tgt.drain_notifications(&mut notes).unwrap();
    };
    bench_agent(c, "ucx", &ini, &lists, settle);
}

/// An agent that does nothing (`kvx_core::testing::NoopAgent`): the numbering (or naming) of the
/// blocks is all a post costs.
fn noop(c: &mut Criterion) {
    let (agent, peer) = (NoopAgent::new("noop"), NoopAgent::new("peer"));
    let mem = || -> Arc<dyn KvMemory> { Arc::new(HostMemory::new(pool_len()).unwrap()) };
    let lists = connect(&agent, &peer, mem(), mem());
    bench_agent(c, "noop", &agent, &lists, |_| {});
}

/// The local list (id 0) and the remote list (id 1) as kvx-core's checks see them.
struct CoreLists {
    owners: [DlistOwner; 2],
    lists: [BlockList; 2],
}

impl CoreLists {
    fn get(&self, id: DlistId) -> Option<DlistView<'_>> {
        let i = usize::try_from(id.0).ok().filter(|&i| i < 2)?;
        Some(DlistView { owner: &self.owners[i], blocks: &self.lists[i] })
    }
}

/// kvx-core's checks alone, on the lists the agents above hold.
fn core_check(c: &mut Criterion) {
    let caps = NoopAgent::new("noop").capabilities();
    let (ini, tgt) = (HostMemory::new(pool_len()).unwrap(), HostMemory::new(pool_len()).unwrap());
    let core = CoreLists {
        owners: [DlistOwner::Local, DlistOwner::Remote(AgentName::new("peer"))],
        lists: [list(&ini), list(&tgt)],
    };
    let mut group = c.benchmark_group("read_post_1000x128/kvx-core check");
    for contiguous in [false, true] {
        let shape = if contiguous { "contiguous" } else { "scattered" };
        let (l, r) = request(contiguous);
        let blocks = block_post(&l, &r);
        let (mut li, mut ri) = (Vec::new(), Vec::new());
        group.bench_function(BenchmarkId::new("index_post", shape), |b| {
            b.iter(|| {
                li.clear();
                ri.clear();
                blocks.descriptor_indices(&mut li, &mut ri).unwrap();
                let request = PostRequest {
                    op: XferOp::Read,
                    local: DlistId(0),
                    local_descs: &li,
                    remote: DlistId(1),
                    remote_descs: &ri,
                    notify: None,
                };
                black_box(request.check(&caps, |id| core.get(id)).unwrap().pairs().len())
            })
        });
        group.bench_function(BenchmarkId::new("block_post", shape), |b| {
            b.iter(|| {
                let request = BlockPostRequest {
                    op: XferOp::Read,
                    local: DlistId(0),
                    remote: DlistId(1),
                    blocks,
                    notify: None,
                };
                black_box(request.check(&caps, |id| core.get(id), |_, _| true).unwrap().runs().len())
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = noop, core_check, loopback, ucx
}
criterion_main!(benches);
