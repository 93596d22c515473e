#![doc = include_str!("../README.md")]
// Generated bindings follow C's naming and carry no docs of their own.
#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case, missing_debug_implementations)]

#[allow(
    clippy::all,
    clippy::undocumented_unsafe_blocks,
    unreachable_pub,
    rustdoc::broken_intra_doc_links,
    unsafe_op_in_unsafe_fn
)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}

mod load;

pub use generated::*;
pub use load::{LIBDIR_VAR, Lib, LoadError, load};

use std::ffi::c_void;

/// `ucp_init` from `<ucp/api/ucp.h>`: a `static inline` there, so bindgen does not emit it. It
/// passes the API version this crate was generated against to [`ucp_init_version`].
///
/// # Safety
/// As for `ucp_init`: `params` and `config` must be valid (or `config` null) and `context_p`
/// writable.
///
/// # Panics
/// As [`ucp_init_version`]: when UCX cannot be loaded.
pub unsafe fn ucp_init(
    params: *const ucp_params_t,
    config: *const ucp_config_t,
    context_p: *mut ucp_context_h,
) -> ucs_status_t {
    // SAFETY: the caller upholds ucp_init's contract, which is ucp_init_version's.
    unsafe { ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, params, config, context_p) }
}

/// `UCS_PTR_IS_ERR`: whether a status pointer returned by a `*_nbx` call encodes an error.
#[inline]
pub fn UCS_PTR_IS_ERR(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_IS_PTR`: whether a status pointer is a real request (neither null nor an error).
#[inline]
pub fn UCS_PTR_IS_PTR(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize).wrapping_sub(1) < (UCS_ERR_LAST as isize as usize).wrapping_sub(1)
}

/// `UCS_PTR_RAW_STATUS`: the status encoded in a status pointer, without checking that it is one.
#[inline]
pub fn UCS_PTR_RAW_STATUS(ptr: ucs_status_ptr_t) -> ucs_status_t {
    ptr as isize as ucs_status_t
}

/// `UCS_PTR_STATUS`: `UCS_INPROGRESS` for a request, otherwise the encoded status (`UCS_OK` for
/// null).
#[inline]
pub fn UCS_PTR_STATUS(ptr: ucs_status_ptr_t) -> ucs_status_t {
    if UCS_PTR_IS_PTR(ptr) { UCS_INPROGRESS } else { UCS_PTR_RAW_STATUS(ptr) }
}

/// `UCS_STATUS_PTR`: a status encoded as a status pointer.
#[inline]
pub fn UCS_STATUS_PTR(status: ucs_status_t) -> ucs_status_ptr_t {
    status as isize as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_pointer_macros_match_c() {
        let null: ucs_status_ptr_t = std::ptr::null_mut();
        assert!(!UCS_PTR_IS_ERR(null));
        assert!(!UCS_PTR_IS_PTR(null));
        assert_eq!(UCS_PTR_STATUS(null), UCS_OK);

        let err = UCS_STATUS_PTR(UCS_ERR_NO_MEMORY);
        assert!(UCS_PTR_IS_ERR(err));
        assert!(!UCS_PTR_IS_PTR(err));
        assert_eq!(UCS_PTR_STATUS(err), UCS_ERR_NO_MEMORY);

        let mut slot = 0u64;
        let req = (&mut slot as *mut u64).cast::<c_void>();
        assert!(!UCS_PTR_IS_ERR(req));
        assert!(UCS_PTR_IS_PTR(req));
        assert_eq!(UCS_PTR_STATUS(req), UCS_INPROGRESS);
    }

    #[test]
    fn init_and_cleanup_a_context() {
        // SAFETY: plain UCX calls with valid out-pointers; the context is cleaned up once.
        unsafe {
            let mut params: ucp_params_t = std::mem::zeroed();
            params.field_mask = UCP_PARAM_FIELD_FEATURES as u64;
            params.features = UCP_FEATURE_RMA as u64;
            let mut ctx: ucp_context_h = std::ptr::null_mut();
            assert_eq!(ucp_init(&params, std::ptr::null(), &mut ctx), UCS_OK);
            assert!(!ctx.is_null());
            ucp_cleanup(ctx);
            let msg = std::ffi::CStr::from_ptr(ucs_status_string(UCS_ERR_NO_MEMORY));
            assert!(!msg.to_bytes().is_empty());
        }
    }

    /// UCX parses its configuration with `<ctype.h>` functions of the namespace's C library, whose
    /// per-thread tables a thread started after the load has only once a wrapper set them up.
    #[test]
    fn threads_started_after_the_load_read_the_configuration() {
        assert!(load().is_ok());
        for _ in 0..2 {
            let read = std::thread::spawn(|| {
                let mut config: *mut ucp_config_t = std::ptr::null_mut();
                // SAFETY: defaults for the prefix and file; a valid out-pointer; released once.
                unsafe {
                    let status = ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config);
                    if status == UCS_OK {
                        ucp_config_release(config);
                    }
                    status
                }
            });
            assert_eq!(read.join().ok(), Some(UCS_OK));
        }
    }
}
