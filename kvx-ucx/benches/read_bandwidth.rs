//! Bandwidth of 1000 scattered 64 KiB READs between two processes over UCX, next to a
//! single-thread memcpy of the same scattered blocks and `ucx_perftest -t ucp_get -s 65536`, all in
//! one run; prints the ratios.
//!
//! `cargo bench -p kvx-ucx --bench read_bandwidth` (environment: `KVX_BENCH_ROUNDS`, default 20).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Benchmark driver: panics are failures.

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvx_testkit::xproc::{self, BLOCK_LEN as BLOCK, DONE, READS, TARGET_BLOCKS as REMOTE_BLOCKS};
use support::two_process::{TargetMem, reader, run_target_if_requested, spawn_target};

/// GB/s are 10^9 bytes per second, as in every kvx benchmark.
const GB: f64 = 1e9;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn gbps(d: Duration) -> f64 {
    (READS * BLOCK) as f64 / d.as_secs_f64() / GB
}

/// READs through kvx-ucx from a target process; every round verified.
fn ucx_reads(tls: Option<&str>, mem: TargetMem, rounds: usize) -> Duration {
    let target = spawn_target(&[], tls, mem);
    let reader = reader("bench-reader", tls, &target);
    let mut times = Vec::new();
    for round in 0..=rounds {
        reader.clear();
        let t = reader.read_round(round, (round == rounds).then_some(DONE));
        reader.verify(round);
        if round > 0 {
            times.push(t); // round 0 warms up (connection, registration caches)
        }
    }
    target.finish("bench-reader");
    median(times)
}

/// `ucx_perftest -t ucp_get -s 65536` between two processes; GB/s from its "Final:" line.
fn perftest() -> Option<f64> {
    let port = 13_000 + (std::process::id() % 2000) as u16;
    let mut server = Command::new("ucx_perftest")
        .args(["-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    // The server needs a moment to listen: retry the client within a bound.
    let deadline = Instant::now() + Duration::from_secs(20);
    let output = loop {
        let out = Command::new("ucx_perftest")
            .args(["127.0.0.1", "-p", &port.to_string(), "-t", "ucp_get", "-s", "65536", "-n", "20000"])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.contains("Final:") || Instant::now() > deadline {
            break text;
        }
        std::thread::park_timeout(Duration::from_millis(100));
    };
    let _ = server.kill();
    let _ = server.wait();
    // Final: iterations, latency typical/avg/overall (usec), bandwidth avg/overall (MB/s), msgrate.
    let line = output.lines().find(|l| l.contains("Final:"))?;
    let fields: Vec<f64> = line.split_whitespace().filter_map(|f| f.parse().ok()).collect();
    let mb_per_s = *fields.get(5)?;
    // ucx_perftest's MB are 2^20 bytes.
    Some(mb_per_s * (1u64 << 20) as f64 / GB)
}

fn main() {
    if run_target_if_requested() {
        return;
    }
    let rounds: usize = std::env::var("KVX_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let (major, minor, release) = kvx_ucx::ucx_version().expect("UCX loads");
    println!(
        "kvx-ucx read bandwidth: UCX {major}.{minor}.{release}, {READS} scattered READs of {} KiB \
              out of {REMOTE_BLOCKS} remote blocks, median of {rounds} rounds, every byte verified; GB/s = 1e9 B/s",
        BLOCK >> 10
    );

    let memcpy = gbps(median(xproc::memcpy_rounds(rounds).unwrap()));
    println!("  memcpy, same scattered blocks, one thread:        {memcpy:6.2} GB/s");
    let cases = [
        ("shared memory, UCX-allocated target (one-sided)", None, TargetMem::Pool),
        ("shared memory, heap target + progress thread", None, TargetMem::Heap),
        ("UCX_TLS=tcp, heap target + progress thread", Some("tcp"), TargetMem::Heap),
    ];
    let mut shm = None;
    for (what, tls, mem) in cases {
        let bw = gbps(ucx_reads(tls, mem, rounds));
        shm.get_or_insert(bw);
        println!("  kvx-ucx READ, {what:<48} {bw:6.2} GB/s  ({:.2} x memcpy)", bw / memcpy);
    }
    match perftest() {
        Some(p) => {
            let shm = shm.unwrap_or(0.0);
            println!("  ucx_perftest -t ucp_get -s 65536 (one cache-hot buffer): {p:6.2} GB/s");
            println!(
                "  ratios: one-sided kvx-ucx / memcpy = {:.2}, kvx-ucx / ucx_perftest = {:.2}",
                shm / memcpy,
                shm / p
            );
        }
        None => println!("  ucx_perftest: not run (install ucx-utils: scripts/install-ucx.sh)"),
    }
}
