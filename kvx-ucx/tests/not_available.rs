//! Without a loadable UCX, creating an agent fails with `NotAvailable` and the reason; nothing
//! aborts. UCX is loaded once per process, so the check runs in a child process of this test
//! binary, pointed at a directory without UCX (`KVX_UCX_LIBDIR`).

#![allow(clippy::unwrap_used)] // Test: a failed unwrap is a failed test.

use std::process::Command;

use kvx_core::ErrorKind;
use kvx_ucx::UcxAgent;

/// A directory that holds no UCX.
const NO_UCX: &str = "/nonexistent/kvx-ucx-test";

#[test]
fn agent_creation_without_ucx_is_not_available() {
    if std::env::var_os(kvx_ucx_sys::LIBDIR_VAR).is_some_and(|dir| dir == NO_UCX) {
        let e = UcxAgent::new("no-ucx").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAvailable, "{e}");
        assert_eq!(e.backend(), Some("ucx"));
        assert!(e.message().contains(NO_UCX), "{e}");
        assert_eq!(kvx_ucx::ucx_version().unwrap_err().kind(), ErrorKind::NotAvailable);
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "agent_creation_without_ucx_is_not_available", "--nocapture"])
        .env(kvx_ucx_sys::LIBDIR_VAR, NO_UCX)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("1 passed"), "the child ran the check: {stdout}");
}
