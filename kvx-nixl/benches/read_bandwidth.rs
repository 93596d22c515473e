//! 1000 scattered 64 KiB READs through NIXL (UCX, host memory), against single-thread memcpy of
//! the same blocks measured in the same run.
//!
//! Modes: two processes (this binary re-executes itself as the target) and two agents in one
//! process, each with NIXL's progress thread off and on. Each iteration is one transfer of 1000
//! descriptors with a notification (as kvx's decode side posts them), timed from `post` to `Done`,
//! scattered differently each time and checked byte for byte after it; the first iteration
//! (connection setup) is not timed. The harness is kvx-testkit's `xproc`.
//!
//! `cargo bench -p kvx-nixl --bench read_bandwidth` (with `source scripts/nixl-env.sh`);
//! `KVX_BENCH_ITERS` sets the iterations per mode (default 30).
#![allow(clippy::unwrap_used, clippy::expect_used)] // A benchmark fails loudly by unwrapping.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::xproc::{config, run_target_if_child, spawn_target};
use kvx_core::{HostMemory, KvMemory, TransferAgent};
use kvx_nixl::NixlAgent;
use kvx_testkit::xproc::{self, BLOCK_LEN as BLOCK, READS, Reader, TARGET_BLOCKS};

/// One way of running the transfers: (progress thread, iterations).
type Mode = fn(bool, usize) -> Stats;

struct Stats {
    median: f64,
    min: f64,
    max: f64,
}

/// GB/s (10^9 bytes per second) of READS blocks, per timed iteration.
fn stats(times: &[Duration]) -> Stats {
    let bytes = READS as f64 * BLOCK as f64;
    let mut rates: Vec<f64> = times.iter().map(|t| bytes / t.as_secs_f64() / 1e9).collect();
    rates.sort_by(f64::total_cmp);
    Stats { median: rates[rates.len() / 2], min: rates[0], max: rates[rates.len() - 1] }
}

/// Runs `iters + 1` transfers, each with a notification and checked byte for byte; returns the
/// timings of all but the first (connection setup). `service` runs between polls.
fn timed_rounds(reader: &Reader<NixlAgent>, iters: usize, service: &dyn Fn()) -> Vec<Duration> {
    let mut times = Vec::new();
    for i in 0..=iters {
        let msg = format!("iter-{i}");
        reader.clear();
        let elapsed = reader.read_round_with(i, Some(msg.as_bytes()), service);
        reader.verify(i);
        if i > 0 {
            times.push(elapsed);
        }
    }
    times
}

fn two_processes(progress_thread: bool, iters: usize) -> Stats {
    let target = spawn_target(&[], progress_thread);
    let decode = NixlAgent::new("decode", &config(progress_thread)).unwrap();
    let reader = Reader::new(decode, &target.metadata, target.base);
    let times = timed_rounds(&reader, iters, &|| {});
    reader.notify_done();
    assert_eq!(target.finish("decode"), iters + 2, "the target got every iteration's notification and DONE");
    stats(&times)
}

fn one_process(progress_thread: bool, iters: usize) -> Stats {
    let config = config(progress_thread);
    let prefill = NixlAgent::new("prefill", &config).unwrap();
    let pool = Arc::new(HostMemory::new(TARGET_BLOCKS * BLOCK).unwrap());
    xproc::fill_target(|offset, bytes| pool.write(offset, bytes)).unwrap();
    prefill.register(pool.clone()).unwrap();
    let decode = NixlAgent::new("decode", &config).unwrap();
    let reader = Reader::new(decode, &prefill.local_metadata().unwrap(), pool.region().addr);
    let mut notes = Vec::new();
    let times = timed_rounds(&reader, iters, &|| prefill.progress().unwrap());
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

    println!(
        "1000 scattered 64 KiB READs (65.5 MB) per transfer, {iters} timed transfers per mode, GB/s = 1e9 B/s"
    );
    let memcpy = stats(&xproc::memcpy_rounds(iters).unwrap());
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
        let s = run(progress_thread, iters);
        println!(
            "{name:<34} median {:>6.2}  min {:>6.2}  max {:>6.2}  = {:.2} x memcpy",
            s.median,
            s.min,
            s.max,
            s.median / memcpy.median
        );
    }
}
