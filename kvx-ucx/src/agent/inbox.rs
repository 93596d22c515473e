//! Notifications and endpoint failures, as UCX's callbacks report them during progress: the
//! active-message handler fills the [`Inbox`], the endpoint error handler records failed endpoints.

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use kvx_core::wire::agent_metadata::MAX_AGENT_NAME;
use kvx_core::{AgentName, MAX_NOTIFICATION_LEN, Notification, NotificationWaker};
use kvx_ucx_sys as sys;

pub(super) struct Inbox {
    pub(super) queue: Mutex<Vec<Notification>>,
    pub(super) rejected: AtomicU64,
    /// Endpoints UCX reported failed (peer gone, connection reset, keepalive timeout), with the
    /// status: filled by [`on_endpoint_error`] during progress, settled by `Inner::progress_all`.
    pub(super) failed_eps: Mutex<Vec<(usize, sys::ucs_status_t)>>,
    /// Endpoints UCX reported failed, ever.
    pub(super) failures: AtomicU64,
    /// Called after each notification queued (with a progress thread: see
    /// `TransferAgent::wake_on_notification`).
    pub(super) waker: Mutex<Option<NotificationWaker>>,
}

impl Inbox {
    pub(super) fn new() -> Box<Self> {
        Box::new(Inbox {
            queue: Mutex::new(Vec::new()),
            rejected: AtomicU64::new(0),
            failed_eps: Mutex::default(),
            failures: AtomicU64::new(0),
            waker: Mutex::new(None),
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
        if let Some(wake) = &*self.waker.lock().unwrap_or_else(PoisonError::into_inner) {
            wake.wake();
        }
        sys::UCS_OK
    }
}

/// What UCX passes an active-message handler, made safe to read: the header, the data (a pointer:
/// a rendezvous descriptor when [`rndv`](Message::rndv), else `length` readable bytes during the
/// call), the receive attributes and the reply endpoint (null unless the sender asked for one).
pub(super) struct Message<'a> {
    pub(super) header: &'a [u8],
    pub(super) data: *mut c_void,
    pub(super) length: usize,
    pub(super) recv_attr: u64,
    pub(super) reply_ep: sys::ucp_ep_h,
}

impl Message<'_> {
    /// The data comes by rendezvous: `data` is a descriptor for `ucp_am_recv_data_nbx`.
    pub(super) fn rndv(&self) -> bool {
        self.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0
    }

    /// The data's bytes, unless it comes by rendezvous.
    pub(super) fn eager_data(&self) -> Option<&[u8]> {
        // SAFETY: not rendezvous, so UCX guarantees `length` readable bytes during the call,
        // which the message's lifetime does not outlive.
        (!self.rndv()).then(|| unsafe { bytes(self.data, self.length) })
    }
}

/// The body of every active-message handler: `arg` as the `T` registered with it, and the message,
/// to `handle`; a panic is caught (it must not unwind into C) and answers `UCS_OK`.
///
/// # Safety
/// As for `ucp_am_recv_callback_t`: `arg` is the live `T` registered with the handler, `header`
/// holds `header_length` bytes, `param` is valid or null, all for the duration of the call.
pub(super) unsafe fn on_message<T>(
    arg: *mut c_void,
    (header, header_length): (*const c_void, usize),
    (data, length): (*mut c_void, usize),
    param: *const sys::ucp_am_recv_param_t,
    handle: impl FnOnce(&T, Message<'_>) -> sys::ucs_status_t,
) -> sys::ucs_status_t {
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the caller's promise: `arg` is a live `T`, freed only after the worker (the
        // only caller) is destroyed.
        let target = unsafe { &*arg.cast::<T>() };
        // SAFETY: the caller's promise, for the duration of the call.
        let (header, param) = unsafe { (bytes(header, header_length), param.as_ref()) };
        let recv_attr = param.map_or(0, |p| p.recv_attr);
        let reply_ep = match param {
            Some(p) if recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 => p.reply_ep,
            _ => std::ptr::null_mut(),
        };
        handle(target, Message { header, data, length, recv_attr, reply_ep })
    }));
    result.unwrap_or(sys::UCS_OK)
}

/// `len` bytes at `ptr` (none when null or empty).
///
/// # Safety
/// `len` bytes at `ptr` are readable for the returned lifetime.
unsafe fn bytes<'a>(ptr: *const c_void, len: usize) -> &'a [u8] {
    if len == 0 || ptr.is_null() {
        &[]
    } else {
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) }
    }
}

am_handler! {
    /// The active-message handler of [`AM_NOTIFY`](super::AM_NOTIFY): header = sender's name,
    /// data = payload.
    pub(super) fn on_notification(&Inbox) |inbox: &Inbox, message: Message<'_>| match message.eager_data() {
        Some(data) => inbox.accept(message.header, data),
        None => {
            // kvx senders always use eager; a rendezvous message is not ours. The sender's
            // request completes with this status.
            inbox.reject("rendezvous message");
            sys::UCS_ERR_UNSUPPORTED
        }
    }
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
