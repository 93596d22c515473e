//! What the `kvx` suites share: whether a native library loads, or why a test skips.

#![allow(dead_code)] // Each suite uses some, and a build without native backends none.

use std::io::Write;

use kvx_core::Error;

/// Whether `library` is usable (`check` is `Ok`). If not: with `require_var=1` the test fails;
/// otherwise it prints a loud SKIP line for `test` and the caller returns.
pub(crate) fn available(test: &str, library: &str, check: Result<(), Error>, require_var: &str) -> bool {
    let Err(e) = check else { return true };
    assert_ne!(
        std::env::var(require_var).as_deref(),
        Ok("1"),
        "{require_var}=1 but {library} is not available: {e}"
    );
    let _ = writeln!(std::io::stderr(), "\n*** SKIP {test}: {library}: {e}\n");
    false
}

/// Whether the library of the native `backend` (`ucx` or `nixl`, built in) loads, as
/// [`available`] says (`KVX_REQUIRE_UCX`, `KVX_REQUIRE_NIXL`).
#[cfg(any(feature = "ucx", feature = "nixl"))]
pub(crate) fn backend_available(test: &str, backend: &str) -> bool {
    let (library, check, require_var) = match backend {
        #[cfg(feature = "ucx")]
        "ucx" => ("UCX", kvx_ucx::ucx_version().map(drop), "KVX_REQUIRE_UCX"),
        #[cfg(feature = "nixl")]
        "nixl" => ("NIXL", kvx_nixl::check_library(), "KVX_REQUIRE_NIXL"),
        other => panic!("{other} is no native backend of this build"),
    };
    available(test, library, check, require_var)
}
