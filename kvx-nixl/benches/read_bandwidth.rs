//! 1000 scattered 64 KiB READs through NIXL (UCX, host memory), against single-thread memcpy of
//! the same blocks measured in the same run.
//!
//! Modes: two processes (this binary re-executes itself as the target) and two agents in one
//! process, each with NIXL's progress thread off and on. Each iteration is one transfer of 1000
//! descriptors with a notification (as kvx's decode side posts them), timed from `post` to `Done`;
//! the first iteration (connection setup) is checked byte for byte and not timed.
//!
//! `cargo bench -p kvx-nixl --bench read_bandwidth` (with `source scripts/nixl-env.sh`);
//! `KVX_BENCH_ITERS` sets the iterations per mode (default 30).
#![allow(clippy::unwrap_used, clippy::expect_used)] // A benchmark fails loudly by unwrapping.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pattern;
use common::xproc::{DONE, Target, TargetParams, run_target_if_child, shuffled};
use kvx_core::{
    AgentName, BlockList, DlistId, DlistOwner, HostMemory, KvMemory, MemKind, TransferAgent, XferOp,
    XferState,
};
use kvx_nixl::{NixlAgent, NixlConfig};

const BLOCK: usize = 64 << 10;
const READS: u32 = 1000;
const TARGET_BLOCKS: u32 = 1536;
const SEED: u64 = 0xbe7c;

fn blocks(base: u64, num_blocks: u32) -> BlockList {
    BlockList { kind: MemKind::Dram, device: 0, bases: vec![base], num_blocks, block_len: BLOCK as u64 }
}

/// One way of running the transfers: (progress thread, source blocks, destination blocks, iterations).
type Mode = fn(bool, &[u32], &[u32], usize) -> Stats;

struct Stats {
    median: f64,
    min: f64,
    max: f64,
}

/// GB/s (10^9 bytes per second) of READS blocks, per timed iteration.
fn stats(times: &[Duration]) -> Stats {
    let bytes = f64::from(READS) * BLOCK as f64;
    let mut rates: Vec<f64> = times.iter().map(|t| bytes / t.as_secs_f64() / 1e9).collect();
    rates.sort_by(f64::total_cmp);
    Stats { median: rates[rates.len() / 2], min: rates[0], max: rates[rates.len() - 1] }
}

fn memcpy_baseline(src_idx: &[u32], dst_idx: &[u32], iters: usize) -> Stats {
    let src = pattern(SEED, TARGET_BLOCKS as usize * BLOCK);
    let mut dst = vec![0u8; READS as usize * BLOCK];
    let mut times = Vec::new();
    for i in 0..=iters {
        let t = Instant::now();
        for (&d, &s) in dst_idx.iter().zip(src_idx) {
            let (d, s) = (d as usize * BLOCK, s as usize * BLOCK);
            dst[d..d + BLOCK].copy_from_slice(&src[s..s + BLOCK]);
        }
        let elapsed = t.elapsed();
        std::hint::black_box(&mut dst);
        if i > 0 {
            times.push(elapsed);
        }
    }
    stats(&times)
}

/// The decode side: its agent, pool and lists against the target.
struct Initiator {
    agent: NixlAgent,
    pool: Arc<HostMemory>,
    local: DlistId,
    remote: DlistId,
}

impl Initiator {
    fn new(config: &NixlConfig, metadata: &[u8], base: u64) -> Initiator {
        let agent = NixlAgent::new("decode", config).unwrap();
        let pool = Arc::new(HostMemory::new(READS as usize * BLOCK).unwrap());
        agent.register(pool.clone()).unwrap();
        let peer = agent.load_remote(metadata).unwrap();
        let local = agent.prep_dlist(&DlistOwner::Local, &blocks(pool.region().addr, READS)).unwrap();
        let remote = agent.prep_dlist(&DlistOwner::Remote(peer), &blocks(base, TARGET_BLOCKS)).unwrap();
        Initiator { agent, pool, local, remote }
    }

    /// Runs `iters + 1` transfers; returns the timings of all but the first, which is verified.
    fn run(&self, src: &[u32], dst: &[u32], iters: usize, service: &dyn Fn()) -> Vec<Duration> {
        let mut times = Vec::new();
        for i in 0..=iters {
            let msg = format!("iter-{i}");
            let t = Instant::now();
            let x = self
                .agent
                .post(XferOp::Read, self.local, dst, self.remote, src, Some(msg.as_bytes()))
                .unwrap();
            let deadline = t + Duration::from_secs(30);
            loop {
                match self.agent.poll(x).unwrap() {
                    XferState::Done => break,
                    XferState::Pending => {}
                    XferState::Failed(reason) => panic!("transfer failed: {reason}"),
                }
                service();
                assert!(Instant::now() < deadline, "transfer pending after 30 s");
            }
            let elapsed = t.elapsed();
            self.agent.release(x).unwrap();
            if i == 0 {
                self.verify(src, dst);
            } else {
                times.push(elapsed);
            }
        }
        times
    }

    fn verify(&self, src: &[u32], dst: &[u32]) {
        let expected = pattern(SEED, TARGET_BLOCKS as usize * BLOCK);
        let got = self.pool.to_vec();
        for (&d, &s) in dst.iter().zip(src) {
            let (d, s) = (d as usize * BLOCK, s as usize * BLOCK);
            assert!(
                got[d..d + BLOCK] == expected[s..s + BLOCK],
                "block {} -> {} differs",
                s / BLOCK,
                d / BLOCK
            );
        }
    }
}

fn two_processes(progress_thread: bool, src: &[u32], dst: &[u32], iters: usize) -> Stats {
    let params = TargetParams { blocks: TARGET_BLOCKS, block_len: BLOCK as u64, seed: SEED, progress_thread };
    let (mut target, info) = Target::spawn(&[], params);
    let initiator = Initiator::new(&params.config(), &info.metadata, info.base);
    let times = initiator.run(src, dst, iters, &|| {});
    initiator.agent.notify(&AgentName::new("prefill"), DONE).unwrap();
    target.expect_line("TARGET-OK ");
    target.finish();
    stats(&times)
}

fn one_process(progress_thread: bool, src: &[u32], dst: &[u32], iters: usize) -> Stats {
    let config = NixlConfig::default().with_progress_thread(progress_thread, Duration::ZERO);
    let prefill = NixlAgent::new("prefill", &config).unwrap();
    let len = TARGET_BLOCKS as usize * BLOCK;
    let pool = Arc::new(HostMemory::new(len).unwrap());
    pool.write(0, &pattern(SEED, len)).unwrap();
    prefill.register(pool.clone()).unwrap();
    let initiator = Initiator::new(&config, &prefill.local_metadata().unwrap(), pool.region().addr);
    let mut notes = Vec::new();
    let times = initiator.run(src, dst, iters, &|| prefill.progress().unwrap());
    prefill.drain_notifications(&mut notes).unwrap();
    stats(&times)
}

fn main() {
    if run_target_if_child() {
        return;
    }
    if !common::nixl_or_skip("read_bandwidth") {
        return;
    }
    let iters = std::env::var("KVX_BENCH_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    let src: Vec<u32> = shuffled(TARGET_BLOCKS, 7).into_iter().take(READS as usize).collect();
    let dst = shuffled(READS, 11);

    println!(
        "1000 scattered 64 KiB READs (65.5 MB) per transfer, {iters} timed transfers per mode, GB/s = 1e9 B/s"
    );
    let memcpy = memcpy_baseline(&src, &dst, iters);
    println!(
        "{:<34} median {:>6.2}  min {:>6.2}  max {:>6.2}",
        "memcpy, one thread, same blocks", memcpy.median, memcpy.min, memcpy.max
    );
    let modes: [(&str, Mode, bool); 4] = [
        ("NIXL two processes", two_processes, false),
        ("NIXL two processes, progress thr", two_processes, true),
        ("NIXL one process, two agents", one_process, false),
        ("NIXL one process, progress thr", one_process, true),
    ];
    for (name, run, progress_thread) in modes {
        let s = run(progress_thread, &src, &dst, iters);
        println!(
            "{name:<34} median {:>6.2}  min {:>6.2}  max {:>6.2}  = {:.2} x memcpy",
            s.median,
            s.min,
            s.max,
            s.median / memcpy.median
        );
    }
}
