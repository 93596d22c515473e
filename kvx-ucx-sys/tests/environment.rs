//! UCX reads `UCX_*` variables from the namespace's copy of the environment, which
//! `Lib::refresh_environment` brings up to date with the program's. Its own test binary: it sets
//! variables, which no other test may see.

use std::ptr;

use kvx_ucx_sys::*;

/// `ucp_config_read`'s status with the namespace's environment as it is.
fn config_read() -> ucs_status_t {
    let mut config: *mut ucp_config_t = ptr::null_mut();
    // SAFETY: UCX is loaded; defaults for the prefix and file; a valid out-pointer; released once.
    unsafe {
        let status = ucp_config_read(ptr::null(), ptr::null(), &mut config);
        if status == UCS_OK {
            ucp_config_release(config);
        }
        status
    }
}

#[test]
fn ucx_reads_the_environment_as_of_the_last_refresh() {
    let lib = load().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config_read(), UCS_OK);
    // SAFETY: this binary's only test; no other thread reads or writes the environment.
    unsafe { std::env::set_var("UCX_RNDV_THRESH", "not-a-size") };
    assert_eq!(config_read(), UCS_OK, "not seen before a refresh");
    lib.refresh_environment(&[]);
    assert_ne!(config_read(), UCS_OK, "a bad value seen after a refresh");
    // SAFETY: as above.
    unsafe { std::env::remove_var("UCX_RNDV_THRESH") };
    lib.refresh_environment(&[]);
    assert_eq!(config_read(), UCS_OK);

    // A default is seen when the program's environment does not set the variable, and only then.
    let defaults = [("UCX_RNDV_THRESH", "not-a-size")];
    lib.refresh_environment(&defaults);
    assert_ne!(config_read(), UCS_OK, "the default seen");
    // SAFETY: as above.
    unsafe { std::env::set_var("UCX_RNDV_THRESH", "8K") };
    lib.refresh_environment(&defaults);
    assert_eq!(config_read(), UCS_OK, "the program's value wins over the default");
    // SAFETY: as above.
    unsafe { std::env::remove_var("UCX_RNDV_THRESH") };
    lib.refresh_environment(&[]);
    assert_eq!(config_read(), UCS_OK);
}
