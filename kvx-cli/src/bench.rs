//! `kvx bench`: READ bandwidth of scattered blocks between two agents of one backend, against a
//! single-thread memcpy of the same scattered blocks measured in the same run.

use clap::Args;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use std::hint::black_box;
use std::time::{Duration, Instant};

use kvx_core::{BlockList, DlistOwner, Error, ErrorKind, MemKind, Result, TransferAgent, XferOp, XferState};
use kvx_testkit::conformance::TestBuffer;

use crate::backend::Backend;

/// Options of `kvx bench`.
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Transfer backend.
    #[arg(long, value_enum, default_value_t = Backend::Loopback)]
    backend: Backend,
    /// Blocks read per transfer.
    #[arg(long, default_value_t = 1000)]
    blocks: u32,
    /// Block size in KiB.
    #[arg(long, default_value_t = 64)]
    block_kib: u64,
    /// Blocks in each side's pool (the READ picks `--blocks` of them at random).
    #[arg(long, default_value_t = 2000)]
    pool_blocks: u32,
    /// Timed rounds (the first, a warm-up, is not counted).
    #[arg(long, default_value_t = 20)]
    rounds: u32,
    /// Seed of the block choice.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// What one bench run measured.
#[derive(Debug)]
pub(crate) struct BenchReport {
    backend: &'static str,
    bytes: u64,
    transfer: Duration,
    memcpy: Duration,
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gbps = |d: Duration| self.bytes as f64 / d.as_secs_f64() / 1e9;
        writeln!(f, "  memcpy (same blocks, 1 thread)   {:>8.2} GB/s", gbps(self.memcpy))?;
        writeln!(f, "  {:<32} {:>8.2} GB/s", format!("{} READ", self.backend), gbps(self.transfer))?;
        writeln!(f, "  ratio to memcpy                  {:>8.2}", gbps(self.transfer) / gbps(self.memcpy))
    }
}

/// Runs the benchmark: every byte of the first transfer is checked; medians of the others.
pub(crate) fn run(args: &BenchArgs) -> Result<BenchReport> {
    if args.blocks == 0 || args.blocks > args.pool_blocks || args.rounds == 0 {
        return Err(Error::invalid_argument("need 0 < --blocks <= --pool-blocks and --rounds > 0"));
    }
    let block_len = args.block_kib * 1024;
    let pool_len = usize::try_from(block_len * u64::from(args.pool_blocks))
        .map_err(|_| Error::invalid_argument("pool too large"))?;
    let backend = args.backend.sim_backend(false)?;
    println!(
        "kvx bench: {} backend, READ of {} scattered {} KiB blocks out of {}, {} rounds",
        args.backend.name(),
        args.blocks,
        args.block_kib,
        args.pool_blocks,
        args.rounds
    );
    let (reader_id, target_id) = ("bench-reader".into(), "bench-target".into());
    let reader = backend.agent(&reader_id, 0)?;
    let target = backend.agent(&target_id, 0)?;
    let (src, dst) = (backend.memory(&target_id, 0, pool_len)?, backend.memory(&reader_id, 0, pool_len)?);
    let pattern: Vec<u8> = (0..pool_len).map(|i| (i / 4096 % 251) as u8 ^ (i % 256) as u8).collect();
    src.write(0, &pattern)?;
    target.register(src.memory())?;
    reader.register(dst.memory())?;
    let peer = reader.load_remote(&target.local_metadata()?)?;
    let list = |b: &TestBuffer| BlockList {
        kind: MemKind::Dram,
        device: 0,
        bases: vec![b.region().addr],
        num_blocks: args.pool_blocks,
        block_len,
    };
    let local = reader.prep_dlist(&DlistOwner::Local, &list(&dst))?;
    let remote = reader.prep_dlist(&DlistOwner::Remote(peer), &list(&src))?;

    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut pick = || {
        let mut ids: Vec<u32> = (0..args.pool_blocks).collect();
        ids.shuffle(&mut rng);
        ids.truncate(args.blocks as usize);
        ids
    };
    let (src_ids, dst_ids) = (pick(), pick());

    let mut transfer_times = Vec::new();
    for round in 0..=args.rounds {
        let start = Instant::now();
        let xfer = reader.post(XferOp::Read, local, &dst_ids, remote, &src_ids, None)?;
        wait(reader.as_ref(), target.as_ref(), xfer)?;
        transfer_times.push(start.elapsed());
        reader.release(xfer)?;
        if round == 0 {
            verify(&src, &dst, &src_ids, &dst_ids, block_len as usize)?;
        }
    }

    // The baseline: the same scattered blocks, copied by one thread between two heap pools.
    let from = pattern;
    let mut to = vec![0u8; pool_len];
    let mut memcpy_times = Vec::new();
    let bl = block_len as usize;
    for _ in 0..=args.rounds {
        let start = Instant::now();
        for (&s, &d) in src_ids.iter().zip(&dst_ids) {
            let (s, d) = (s as usize * bl, d as usize * bl);
            to[d..d + bl].copy_from_slice(&from[s..s + bl]);
        }
        black_box(&mut to);
        memcpy_times.push(start.elapsed());
    }
    Ok(BenchReport {
        backend: args.backend.name(),
        bytes: u64::from(args.blocks) * block_len,
        transfer: median(&mut transfer_times[1..]),
        memcpy: median(&mut memcpy_times[1..]),
    })
}

/// Drains the reader's completions until the transfer ends, progressing the target too (a target
/// in the same process must be serviced, e.g. by UCX without UCX-allocated memory); bounded.
fn wait(reader: &dyn TransferAgent, target: &dyn TransferAgent, xfer: kvx_core::XferId) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut done = Vec::new();
    loop {
        reader.drain_completions(&mut done)?;
        if done.contains(&xfer) {
            return match reader.poll(xfer)? {
                XferState::Done => Ok(()),
                XferState::Failed(e) => Err(e),
                XferState::Pending => Err(Error::new(ErrorKind::Backend, "reported complete, yet pending")),
            };
        }
        if Instant::now() > deadline {
            return Err(Error::new(ErrorKind::Timeout, "transfer not done within 60 s"));
        }
        target.progress()?;
    }
}

fn verify(
    src: &TestBuffer,
    dst: &TestBuffer,
    src_ids: &[u32],
    dst_ids: &[u32],
    block_len: usize,
) -> Result<()> {
    let (mut a, mut b) = (vec![0u8; block_len], vec![0u8; block_len]);
    for (&s, &d) in src_ids.iter().zip(dst_ids) {
        src.read(s as usize * block_len, &mut a)?;
        dst.read(d as usize * block_len, &mut b)?;
        if a != b {
            return Err(Error::new(ErrorKind::Transfer, format!("block {s} arrived wrong in block {d}")));
        }
    }
    Ok(())
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}
