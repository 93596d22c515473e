//! NIXL's errors as kvx [`Error`]s, with NIXL's C status kept as the code.

use kvx_core::{Error, ErrorKind};
use nixl_sys::NixlError;

use crate::BACKEND;

/// The C API status behind a nixl-sys error, where nixl-sys keeps one. nixl-sys folds every
/// status other than "invalid parameter", "not found" and "no telemetry" into `BackendError`
/// (`NIXL_CAPI_ERROR_BACKEND`), so that is the finest status available above it.
pub(crate) fn status_of(e: &NixlError) -> Option<i64> {
    let status = match e {
        NixlError::InvalidParam => nixl_sys::NIXL_CAPI_ERROR_INVALID_PARAM,
        NixlError::BackendError => nixl_sys::NIXL_CAPI_ERROR_BACKEND,
        NixlError::NotFound => nixl_sys::NIXL_CAPI_ERROR_NOT_FOUND,
        NixlError::NoTelemetry => nixl_sys::NIXL_CAPI_ERROR_NO_TELEMETRY,
        _ => return None,
    };
    Some(i64::from(status))
}

/// Wraps a nixl-sys error: `what` says which call failed.
pub(crate) fn nixl_error(kind: ErrorKind, what: &str, e: NixlError) -> Error {
    let mut err = Error::new(kind, format!("{what}: {e}")).with_backend(BACKEND);
    if let Some(code) = status_of(&e) {
        err = err.with_code(code);
    }
    err.with_source(e)
}

/// An error of this backend without a NIXL status.
pub(crate) fn error(kind: ErrorKind, message: impl Into<String>) -> Error {
    Error::new(kind, message).with_backend(BACKEND)
}

/// Extension to turn a nixl-sys `Result` into a kvx one in one line at each call site.
pub(crate) trait NixlResultExt<T> {
    /// Maps the error to `kind`, saying which call failed.
    fn nixl(self, kind: ErrorKind, what: &str) -> kvx_core::Result<T>;
}

impl<T> NixlResultExt<T> for Result<T, NixlError> {
    fn nixl(self, kind: ErrorKind, what: &str) -> kvx_core::Result<T> {
        self.map_err(|e| nixl_error(kind, what, e))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests fail loudly by unwrapping.
mod tests {
    use super::*;

    #[test]
    fn keeps_status_and_backend() {
        let e = nixl_error(ErrorKind::Backend, "register", NixlError::NotFound);
        assert_eq!(e.backend(), Some("nixl"));
        assert_eq!(e.code(), Some(-6));
        assert_eq!(e.kind(), ErrorKind::Backend);
        assert!(e.to_string().contains("register"));
        let e = nixl_error(ErrorKind::Backend, "x", NixlError::IndexOutOfBounds);
        assert_eq!(e.code(), None);
    }
}
