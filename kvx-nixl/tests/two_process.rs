//! Two processes over real NIXL: this binary re-executes itself as the target ("prefill"), which
//! passes its metadata back on stdout; the initiator ("decode") READs 1000 scattered 64 KiB blocks
//! in one transfer with a notification, and checks every byte. The target exits once the
//! notification has arrived. Without NIXL: a loud SKIP, or a failure with `KVX_REQUIRE_NIXL=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by unwrapping.

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::xproc::{DONE, Target, TargetParams, run_target_if_child, shuffled};
use common::{DEADLINE, nixl_or_skip, pattern};
use kvx_core::{BlockList, DlistOwner, HostMemory, KvMemory, MemKind, TransferAgent, XferOp, XferState};
use kvx_nixl::{NixlAgent, NixlConfig};

const BLOCK: u64 = 64 << 10;
const READS: u32 = 1000;
const TARGET_BLOCKS: u32 = 1536;

fn blocks(base: u64, num_blocks: u32) -> BlockList {
    BlockList { kind: MemKind::Dram, device: 0, bases: vec![base], num_blocks, block_len: BLOCK }
}

#[test]
fn thousand_scattered_reads_across_processes() {
    if run_target_if_child() {
        return;
    }
    if !nixl_or_skip("thousand_scattered_reads_across_processes") {
        return;
    }
    let params =
        TargetParams { blocks: TARGET_BLOCKS, block_len: BLOCK, seed: 0xdec0de, progress_thread: false };
    let (target, info) =
        Target::spawn(&["--exact", "thousand_scattered_reads_across_processes", "--nocapture"], params);

    let decode = NixlAgent::new("decode", &NixlConfig::default()).unwrap();
    let pool = Arc::new(HostMemory::new(READS as usize * BLOCK as usize).unwrap());
    decode.register(pool.clone()).unwrap();
    let peer = decode.load_remote(&info.metadata).unwrap();
    let local = decode.prep_dlist(&DlistOwner::Local, &blocks(pool.region().addr, READS)).unwrap();
    let remote = decode.prep_dlist(&DlistOwner::Remote(peer), &blocks(info.base, TARGET_BLOCKS)).unwrap();

    // Scattered on both sides: 1000 distinct remote blocks out of 1536, into a shuffled order.
    let src: Vec<u32> = shuffled(TARGET_BLOCKS, 7).into_iter().take(READS as usize).collect();
    let dst = shuffled(READS, 11);
    let xfer = decode.post(XferOp::Read, local, &dst, remote, &src, Some(b"blocks-read")).unwrap();
    let deadline = Instant::now() + DEADLINE;
    let state = loop {
        match decode.poll(xfer).unwrap() {
            XferState::Pending => assert!(Instant::now() < deadline, "READ still pending after {DEADLINE:?}"),
            state => break state,
        }
    };
    assert_eq!(state, XferState::Done);
    decode.release(xfer).unwrap();

    let expected = pattern(0xdec0de, TARGET_BLOCKS as usize * BLOCK as usize);
    let got = pool.to_vec();
    let b = BLOCK as usize;
    for (&d, &s) in dst.iter().zip(&src) {
        let (d, s) = (d as usize, s as usize);
        assert!(got[d * b..(d + 1) * b] == expected[s * b..(s + 1) * b], "block {s} -> {d} differs");
    }

    decode.notify(&kvx_core::AgentName::new("prefill"), DONE).unwrap();
    let mut target = target;
    assert_eq!(target.expect_line("TARGET-OK "), "2", "the target got the READ's notification and DONE");
    target.finish();
}
