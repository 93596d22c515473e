//! kvx-nixl against NIXL's own Python API: the same library, the same scattered blocks, two
//! processes each, with and without NIXL's progress thread, at 16 KiB, 64 KiB and 1 MiB.
//!
//! Each round READs `READS` blocks scattered over a target of `2 x READS` blocks into permuted
//! local slots, in one transfer with a notification, timed from `post` (Python: from
//! `make_prepped_xfer`) to done, every byte checked after it. Both sides yield the CPU between
//! status checks, as a caller waiting on a transfer should on a shared machine: a loop that
//! checks without yielding starves NIXL's progress threads on 2 vCPUs, and kvx's checks, far
//! cheaper than Python's, starved them most (kvx / Python 0.95-0.96 at 64 KiB with the progress
//! thread when neither side yielded); the first round of each run
//! (connection setup) is not timed. kvx's side: this binary re-executes itself as the target
//! (kvx-testkit's `xproc` harness). Python's side: `scripts/bench_nixl_python.py`, reader and
//! target, run by the interpreter in `KVX_NIXL_PYTHON` (with numpy and `nixl_cu12`). The two
//! alternate, `KVX_BENCH_REPS` runs each (default 3), and each row prints the medians over all
//! their rounds and kvx / Python. Also printed: how often the post completed the transfer at once
//! and the mean number of status checks that still found it in flight.
//!
//! `scripts/bench-nixl-python.sh` sets everything up and runs it. `KVX_BENCH_ROW=<KiB>/<polled|
//! progress>` (e.g. `1024/progress`) runs one row only.
#![allow(clippy::unwrap_used, clippy::expect_used)] // A benchmark fails loudly by unwrapping.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::xproc::config;
use kvx_core::{BlockList, DlistOwner, HostMemory, KvMemory, MemKind, TransferAgent, XferOp, XferState};
use kvx_nixl::NixlAgent;
use kvx_testkit::xproc::{self, Idle, Target, TargetSetup};

/// READs per transfer; the target holds twice as many blocks.
const READS: usize = 1000;
/// Block sizes and timed rounds per run.
const SIZES: [(usize, usize); 3] = [(16 << 10, 40), (64 << 10, 20), (1 << 20, 6)];
/// Bound on one transfer.
const TRANSFER_DEADLINE: Duration = Duration::from_secs(60);

/// The target block read into local slot `local_slot(i)` in round `round` (as the Python side).
fn remote_block(i: usize, round: usize) -> usize {
    (i * 7919 + round * 101) % (2 * READS)
}

fn local_slot(i: usize) -> usize {
    (i * 7 + 3) % READS
}

/// Block `b` of `len` bytes: kvx-testkit's xproc pattern at any block length.
fn block_bytes(b: usize, len: usize) -> Vec<u8> {
    (0..len / 8).flat_map(|w| xproc::word(b, w).to_le_bytes()).collect()
}

/// One run's timed rounds: (post to done, completed by the post itself, status checks in flight).
#[derive(Default)]
struct Rounds {
    times: Vec<Duration>,
    at_once: usize,
    checks: usize,
}

impl Rounds {
    fn extend(&mut self, other: Rounds) {
        self.times.extend(other.times);
        self.at_once += other.at_once;
        self.checks += other.checks;
    }

    fn median_gbps(&self, block_len: usize) -> f64 {
        let mut t = self.times.clone();
        t.sort();
        (READS * block_len) as f64 / t[t.len() / 2].as_secs_f64() / 1e9
    }

    fn describe(&self, block_len: usize) -> String {
        let n = self.times.len().max(1) as f64;
        format!(
            "{:>6.2} GB/s  done at post {:>3.0}%  checks {:>6.1}",
            self.median_gbps(block_len),
            100.0 * self.at_once as f64 / n,
            self.checks as f64 / n
        )
    }
}

/// The child's spec: "<block_len> <progress thread 0|1>".
fn run_target_if_child() -> bool {
    xproc::run_target_if_child(|spec| {
        let (len, progress) = spec.split_once(' ').expect("spec");
        let len: usize = len.parse().expect("block length");
        let agent = NixlAgent::new("prefill", &config(progress == "1")).unwrap();
        // The harness wants at least its own 64 KiB x 2000 blocks: smaller targets are padded.
        let bytes = (2 * READS * len).max(xproc::TARGET_BLOCKS * xproc::BLOCK_LEN);
        let pool = Arc::new(HostMemory::new(bytes).unwrap());
        for b in 0..2 * READS {
            pool.write(b * len, &block_bytes(b, len)).unwrap();
        }
        TargetSetup { agent, memory: pool, idle: Idle::Yield }
    })
}

fn kvx_run(block_len: usize, rounds: usize, progress: bool) -> Rounds {
    let target = Target::spawn(&[], &format!("{block_len} {}", u8::from(progress)));
    let agent = NixlAgent::new("decode", &config(progress)).unwrap();
    let local = Arc::new(HostMemory::new(READS * block_len).unwrap());
    agent.register(local.clone()).unwrap();
    let peer = agent.load_remote(&target.metadata).unwrap();
    let list = |base, n: usize| BlockList {
        kind: MemKind::Dram,
        device: 0,
        bases: vec![base],
        num_blocks: n as u32,
        block_len: block_len as u64,
    };
    let local_list = agent.prep_dlist(&DlistOwner::Local, &list(local.region().addr, READS)).unwrap();
    let remote_list =
        agent.prep_dlist(&DlistOwner::Remote(peer.clone()), &list(target.base, 2 * READS)).unwrap();
    let slots: Vec<u32> = (0..READS).map(|i| local_slot(i) as u32).collect();

    let mut out = Rounds::default();
    let mut block = vec![0u8; block_len];
    for round in 0..=rounds {
        local.fill(0, READS * block_len, 0).unwrap();
        let remote: Vec<u32> = (0..READS).map(|i| remote_block(i, round) as u32).collect();
        let msg = format!("round-{round}");
        let start = Instant::now();
        let x =
            agent.post(XferOp::Read, local_list, &slots, remote_list, &remote, Some(msg.as_bytes())).unwrap();
        let mut checks = 0;
        let deadline = start + TRANSFER_DEADLINE;
        loop {
            match agent.poll(x).unwrap() {
                XferState::Pending => {
                    checks += 1;
                    std::thread::yield_now();
                }
                XferState::Done => break,
                XferState::Failed(e) => panic!("round {round}: READ failed: {e}"),
            }
            assert!(Instant::now() < deadline, "round {round}: READ still pending");
        }
        let elapsed = start.elapsed();
        agent.release(x).unwrap();
        for i in 0..READS {
            local.read(local_slot(i) * block_len, &mut block).unwrap();
            assert!(
                block == block_bytes(remote_block(i, round), block_len),
                "round {round}: read {i} differs"
            );
        }
        if round > 0 {
            out.times.push(elapsed);
            out.at_once += usize::from(checks == 0);
            out.checks += checks;
        }
    }
    agent.notify(&peer, xproc::DONE).unwrap();
    assert_eq!(target.finish("decode"), rounds + 2, "the target got every round's notification and DONE");
    out
}

fn python_run(python: &str, block_len: usize, rounds: usize, progress: bool) -> Rounds {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/bench_nixl_python.py");
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .args(["--block-len", &block_len.to_string(), "--reads", &READS.to_string()])
        .args(["--rounds", &rounds.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if progress {
        cmd.arg("--progress-thread");
    }
    let mut child = cmd.spawn().expect("starting the Python reader (KVX_NIXL_PYTHON)");
    let stdout = child.stdout.take().expect("stdout");
    let mut out = Rounds::default();
    let mut ok = false;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        let mut words = line.split_whitespace();
        match words.next() {
            Some("KVX-PY-ROUND") => {
                let secs: f64 = words.next().and_then(|s| s.parse().ok()).expect("round time");
                let posted = words.next().expect("post status");
                let checks: usize = words.next().and_then(|s| s.parse().ok()).expect("checks");
                out.times.push(Duration::from_secs_f64(secs));
                out.at_once += usize::from(posted == "DONE");
                out.checks += checks;
            }
            Some("KVX-PY-OK") => ok = true,
            _ => {}
        }
    }
    let status = child.wait().unwrap();
    assert!(ok && status.success(), "the Python reader failed ({status}); run it alone to see why");
    assert_eq!(out.times.len(), rounds, "the Python reader reported every round");
    out
}

fn main() {
    if run_target_if_child() {
        return;
    }
    if !common::nixl_or_skip("vs_python") {
        return;
    }
    let Ok(python) = std::env::var("KVX_NIXL_PYTHON") else {
        eprintln!(
            "vs_python: set KVX_NIXL_PYTHON to a Python with numpy and nixl_cu12 (scripts/bench-nixl-python.sh does)"
        );
        return;
    };
    let reps = std::env::var("KVX_BENCH_REPS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    println!(
        "{READS} scattered READs of a {}-block target per transfer, with a notification; {reps} alternating runs each; GB/s = 1e9 B/s, medians",
        2 * READS
    );
    let only = std::env::var("KVX_BENCH_ROW").ok();
    for progress in [false, true] {
        for (block_len, rounds) in SIZES {
            let row = format!("{}/{}", block_len >> 10, if progress { "progress" } else { "polled" });
            if only.as_ref().is_some_and(|only| *only != row) {
                continue;
            }
            let (mut kvx, mut py) = (Rounds::default(), Rounds::default());
            for _ in 0..reps {
                kvx.extend(kvx_run(block_len, rounds, progress));
                py.extend(python_run(&python, block_len, rounds, progress));
            }
            let thread = if progress { "progress thread" } else { "no progress thread" };
            println!(
                "{:>4} KiB, {thread:<18}  kvx-nixl {}  |  NIXL Python {}  |  kvx / Python {:.2}",
                block_len >> 10,
                kvx.describe(block_len),
                py.describe(block_len),
                kvx.median_gbps(block_len) / py.median_gbps(block_len)
            );
        }
    }
}
