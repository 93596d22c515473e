//! A reader and a target in two processes: 1000 scattered 64 KiB READs, every byte verified, over
//! shared memory (UCX-allocated target) and over TCP (heap target served by a progress thread, and
//! UCX-allocated target); the target exits once the reader's notification arrives.
#![allow(clippy::unwrap_used)] // Test code: panics are failures.

mod support;

use kvx_testkit::xproc::DONE;
use support::two_process::{TargetMem, reader, run_target_if_requested, spawn_target};

/// The target role: does nothing unless this process was started as a target.
#[test]
fn two_process_target_role() {
    run_target_if_requested();
}

fn two_process_reads(tls: Option<&str>, mem: TargetMem, reader_name: &str) {
    let target =
        spawn_target(&["--exact", "two_process_target_role", "--nocapture", "--test-threads=1"], tls, mem);
    let reader = reader(reader_name, tls, &target);
    for round in 0..3 {
        reader.clear();
        reader.read_round(round, (round == 2).then_some(DONE));
        reader.verify(round);
    }
    assert_eq!(target.finish(reader_name), 1, "the target got exactly the final READ's notification");
}

#[test]
fn two_process_reads_over_shared_memory() {
    two_process_reads(None, TargetMem::Pool, "reader-shm");
}

#[test]
fn two_process_reads_of_heap_memory_over_tcp() {
    two_process_reads(Some("tcp"), TargetMem::Heap, "reader-tcp");
}

#[test]
fn two_process_reads_of_ucx_memory_over_tcp() {
    two_process_reads(Some("tcp"), TargetMem::Pool, "reader-tcp-pool");
}
