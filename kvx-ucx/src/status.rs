//! UCX status codes as kvx errors: one helper per shape of C result, so a call site is one line.

use std::ffi::CStr;

use kvx_core::{Error, ErrorKind, Result};
use kvx_ucx_sys as sys;

/// The backend name on every error this crate raises.
pub(crate) const BACKEND: &str = "ucx";

/// UCX's text for a status ("No such element", ..).
pub(crate) fn status_string(status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string accepts any status value and returns a pointer to a static,
    // NUL-terminated string (a generic one for unknown codes).
    let text = unsafe { CStr::from_ptr(sys::ucs_status_string(status)) };
    text.to_string_lossy().into_owned()
}

/// An error of `kind` for a failed UCX call `what`, carrying the status and its text.
pub(crate) fn ucx_error(kind: ErrorKind, what: &str, status: sys::ucs_status_t) -> Error {
    Error::new(kind, format!("{what}: {}", status_string(status)))
        .with_backend(BACKEND)
        .with_code(i64::from(status))
}

/// `Ok(())` for `UCS_OK`, otherwise an error of `kind` naming the call.
pub(crate) fn check_as(kind: ErrorKind, status: sys::ucs_status_t, what: &str) -> Result<()> {
    if status == sys::UCS_OK { Ok(()) } else { Err(ucx_error(kind, what, status)) }
}

/// `Ok(())` for `UCS_OK`, otherwise a [`ErrorKind::Backend`] error naming the call.
pub(crate) fn check(status: sys::ucs_status_t, what: &str) -> Result<()> {
    check_as(ErrorKind::Backend, status, what)
}

/// Loads UCX (see [`sys::load`]): [`ErrorKind::NotAvailable`] with the reason when it cannot be
/// loaded. Every other call into UCX comes after one that succeeded.
pub(crate) fn load() -> Result<&'static sys::Lib> {
    sys::load().map_err(|e| error(ErrorKind::NotAvailable, e.to_string()))
}

/// An error raised by this crate itself (not by a UCX call).
pub(crate) fn error(kind: ErrorKind, message: impl Into<String>) -> Error {
    Error::new(kind, message).with_backend(BACKEND)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_becomes_error_with_code_and_text() {
        assert!(check(sys::UCS_OK, "noop").is_ok());
        let e = check_as(ErrorKind::Transfer, sys::UCS_ERR_NO_ELEM, "ucp_get_nbx").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Transfer);
        assert_eq!(e.backend(), Some("ucx"));
        assert_eq!(e.code(), Some(i64::from(sys::UCS_ERR_NO_ELEM)));
        assert!(e.message().starts_with("ucp_get_nbx: "), "{e}");
        assert!(e.message().len() > "ucp_get_nbx: ".len());
    }
}
