//! UCX and NIXL agents in one process, as a `kvx` built with both features has them: Debian's UCX
//! (kvx-ucx, loaded apart by kvx-ucx-sys) and the UCX bundled in NIXL's wheel must not disturb
//! each other. Each pair moves bytes, every one checked, before and after the other backend is
//! loaded and used. Without a library: a loud SKIP, or a failure with `KVX_REQUIRE_UCX=1`
//! (`KVX_REQUIRE_NIXL=1`).

#![cfg(all(feature = "ucx", feature = "nixl"))]
#![allow(clippy::unwrap_used)] // Test: a failed unwrap is a failed test.

mod common;

use std::sync::Arc;

use common::available;
use kvx_nixl::{NixlAgent, NixlConfig};
use kvx_testkit::conformance::{
    Pair, check_notification_with_read, check_notification_with_write, check_read_scattered,
    check_write_scattered,
};
use kvx_ucx::UcxAgent;

#[test]
fn ucx_and_nixl_agents_in_one_process() {
    const TEST: &str = "ucx_and_nixl_agents_in_one_process";
    if !available(TEST, "UCX", kvx_ucx::ucx_version().map(drop), "KVX_REQUIRE_UCX")
        || !available(TEST, "NIXL", kvx_nixl::check_library(), "KVX_REQUIRE_NIXL")
    {
        return;
    }
    let ucx = Pair::new(
        Arc::new(UcxAgent::new("ucx-decode").unwrap()),
        Arc::new(UcxAgent::new("ucx-prefill").unwrap()),
    );
    check_read_scattered(&ucx);

    let config = NixlConfig::default();
    let nixl = Pair::new(
        Arc::new(NixlAgent::new("nixl-decode", &config).unwrap()),
        Arc::new(NixlAgent::new("nixl-prefill", &config).unwrap()),
    );
    check_read_scattered(&nixl);
    check_write_scattered(&nixl);
    check_notification_with_read(&nixl);

    // UCX after NIXL loaded its own UCX, with both pairs alive.
    check_write_scattered(&ucx);
    check_notification_with_write(&ucx);
    let ucx_again = Pair::new(
        Arc::new(UcxAgent::new("ucx-decode-2").unwrap()),
        Arc::new(UcxAgent::new("ucx-prefill-2").unwrap()),
    );
    check_read_scattered(&ucx_again);
    check_notification_with_write(&nixl);
}
