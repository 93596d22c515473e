//! Two processes over real NIXL: this binary re-executes itself as the target ("prefill"), which
//! passes its metadata back on stdout; the initiator ("decode") READs 1000 scattered 64 KiB blocks
//! in one transfer with a notification, and checks every byte. The target exits once the
//! notification has arrived. Without NIXL: a loud SKIP, or a failure with `KVX_REQUIRE_NIXL=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by unwrapping.

mod common;

use common::nixl_or_skip;
use common::xproc::{config, run_target_if_child, spawn_target};
use kvx_nixl::NixlAgent;
use kvx_testkit::xproc::Reader;

#[test]
fn thousand_scattered_reads_across_processes() {
    if run_target_if_child() {
        return;
    }
    if !nixl_or_skip("thousand_scattered_reads_across_processes") {
        return;
    }
    let target =
        spawn_target(&["--exact", "thousand_scattered_reads_across_processes", "--nocapture"], false);
    let decode = NixlAgent::new("decode", &config(false)).unwrap();
    let reader = Reader::new(decode, &target.metadata, target.base);
    assert_eq!(reader.peer().as_str(), "prefill");

    // Scattered on both sides: 1000 distinct remote blocks out of 2000, into a permuted order.
    reader.read_round(0, Some(b"blocks-read"));
    reader.verify(0);

    reader.notify_done();
    assert_eq!(target.finish("decode"), 2, "the target got the READ's notification and DONE");
}
