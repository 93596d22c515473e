//! Notifications and endpoint failures, as UCX's callbacks report them during progress: the
//! active-message handler fills the [`Inbox`], the endpoint error handler records failed endpoints.

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use kvx_core::wire::agent_metadata::MAX_AGENT_NAME;
use kvx_core::{AgentName, MAX_NOTIFICATION_LEN, Notification};
use kvx_ucx_sys as sys;

pub(super) struct Inbox {
    pub(super) queue: Mutex<Vec<Notification>>,
    pub(super) rejected: AtomicU64,
    /// Endpoints UCX reported failed (peer gone, connection reset, keepalive timeout), with the
    /// status: filled by [`on_endpoint_error`] during progress, settled by `Inner::progress_all`.
    pub(super) failed_eps: Mutex<Vec<(usize, sys::ucs_status_t)>>,
    /// Endpoints UCX reported failed, ever.
    pub(super) failures: AtomicU64,
}

impl Inbox {
    pub(super) fn new() -> Box<Self> {
        Box::new(Inbox {
            queue: Mutex::new(Vec::new()),
            rejected: AtomicU64::new(0),
            failed_eps: Mutex::default(),
            failures: AtomicU64::new(0),
        })
    }

    pub(super) fn reject(&self, why: &str) -> sys::ucs_status_t {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("dropping a malformed UCX notification: {why}");
        sys::UCS_OK
    }

    pub(super) fn accept(&self, header: &[u8], data: &[u8]) -> sys::ucs_status_t {
        if header.is_empty() || header.len() > MAX_AGENT_NAME {
            return self.reject("bad sender name length");
        }
        let Ok(from) = std::str::from_utf8(header) else {
            return self.reject("sender name is not UTF-8");
        };
        if data.len() > MAX_NOTIFICATION_LEN {
            return self.reject("payload too large");
        }
        let note = Notification { from: AgentName::new(from), msg: data.to_vec() };
        self.queue.lock().unwrap_or_else(PoisonError::into_inner).push(note);
        sys::UCS_OK
    }
}

/// The active-message handler of [`AM_NOTIFY`]: header = sender's name, data = payload.
///
/// [`AM_NOTIFY`]: super::AM_NOTIFY
pub(super) unsafe extern "C" fn on_notification(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // A panic must not unwind into C: catch it, drop the message.
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `arg` is the Box<Inbox> registered with this handler; it is freed only after the
        // worker (the only caller) is destroyed.
        let inbox = unsafe { &*arg.cast::<Inbox>() };
        // SAFETY: UCX passes a valid parameter struct for the duration of the call.
        let recv_attr = unsafe { param.as_ref() }.map_or(0, |p| p.recv_attr);
        if recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 {
            // kvx senders always use eager; a rendezvous message is not ours. The sender's
            // request completes with this status.
            inbox.reject("rendezvous message");
            return sys::UCS_ERR_UNSUPPORTED;
        }
        let header = if header_length == 0 || header.is_null() {
            &[][..]
        } else {
            // SAFETY: UCX guarantees `header_length` readable bytes at `header` during the call.
            unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }
        };
        let data = if length == 0 || data.is_null() {
            &[][..]
        } else {
            // SAFETY: not rendezvous, so `data` holds `length` readable bytes during the call.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }
        };
        inbox.accept(header, data)
    }));
    result.unwrap_or(sys::UCS_OK)
}

/// The endpoints' error handler (`UCP_ERR_HANDLING_MODE_PEER`): UCX calls it from
/// `ucp_worker_progress` when a peer fails; the endpoint is unusable from then on and its
/// outstanding requests complete with the error.
pub(super) unsafe extern "C" fn on_endpoint_error(
    arg: *mut c_void,
    ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `arg` is the Box<Inbox> of the endpoint's worker; it is freed only after the
        // worker (whose progress is the only caller) is destroyed.
        let inbox = unsafe { &*arg.cast::<Inbox>() };
        inbox.failures.fetch_add(1, Ordering::Relaxed);
        inbox.failed_eps.lock().unwrap_or_else(PoisonError::into_inner).push((ep as usize, status));
    }));
}
