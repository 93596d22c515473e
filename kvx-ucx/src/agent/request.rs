//! Outstanding UCX requests: transfers' gets, puts and flushes, and notifications on their way out.

use std::ffi::c_void;
use std::ptr::NonNull;

use kvx_core::{AgentName, Error, ErrorKind, Result};
use kvx_ucx_sys as sys;

use crate::status::ucx_error;

use super::AM_NOTIFY;

/// An outstanding UCX request, freed on drop (UCX releases a still-running one when it
/// completes). Dropped only while the worker is alive.
pub(super) struct Request(pub(super) NonNull<c_void>);

impl Request {
    /// Interprets the status pointer of a `*_nbx` call: `None` when it completed at once.
    pub(super) fn from_status_ptr(
        ptr: sys::ucs_status_ptr_t,
        kind: ErrorKind,
        what: &str,
    ) -> Result<Option<Self>> {
        if sys::UCS_PTR_IS_ERR(ptr) {
            return Err(ucx_error(kind, what, sys::UCS_PTR_RAW_STATUS(ptr)));
        }
        Ok(NonNull::new(ptr).map(Request))
    }

    pub(super) fn status(&self) -> sys::ucs_status_t {
        // SAFETY: the request is live (freed only in drop).
        unsafe { sys::ucp_request_check_status(self.0.as_ptr()) }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: the request came from a *_nbx call of a live worker and is freed once.
        unsafe { sys::ucp_request_free(self.0.as_ptr()) };
    }
}

/// Removes finished requests; returns the first failure, of kind `Transfer` with UCX's status.
pub(super) fn reap(requests: &mut Vec<Request>) -> Option<Error> {
    let mut failure = None;
    requests.retain(|r| match r.status() {
        sys::UCS_INPROGRESS => true,
        sys::UCS_OK => false,
        status => {
            failure
                .get_or_insert_with(|| ucx_error(ErrorKind::Transfer, "a request of the transfer", status));
            false
        }
    });
    failure
}

/// A notification on its way out: UCX reads the buffers until the request completes.
pub(super) struct PendingSend {
    pub(super) request: Option<Request>,
    pub(super) _header: Box<[u8]>,
    pub(super) _payload: Box<[u8]>,
}

impl PendingSend {
    pub(super) fn post(ep: NonNull<sys::ucp_ep>, from: &AgentName, msg: &[u8]) -> Result<Self> {
        let header: Box<[u8]> = from.as_str().as_bytes().into();
        let payload: Box<[u8]> = msg.into();
        // SAFETY: all-zero is "no fields set" for this plain C struct.
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = sys::UCP_AM_SEND_FLAG_EAGER;
        // SAFETY: the endpoint is live; header and payload are heap buffers owned by the returned
        // PendingSend, which lives until the request completes (or the worker is destroyed).
        let status_ptr = unsafe {
            sys::ucp_am_send_nbx(
                ep.as_ptr(),
                AM_NOTIFY,
                header.as_ptr().cast(),
                header.len(),
                payload.as_ptr().cast(),
                payload.len(),
                &param,
            )
        };
        let request = Request::from_status_ptr(status_ptr, ErrorKind::Transfer, "ucp_am_send_nbx")?;
        Ok(PendingSend { request, _header: header, _payload: payload })
    }

    /// `None` while in flight, then the outcome.
    pub(super) fn outcome(&self) -> Option<Result<()>> {
        let Some(request) = &self.request else { return Some(Ok(())) };
        match request.status() {
            sys::UCS_INPROGRESS => None,
            sys::UCS_OK => Some(Ok(())),
            s => Some(Err(ucx_error(ErrorKind::Transfer, "sending a notification", s))),
        }
    }
}
