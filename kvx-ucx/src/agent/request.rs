//! Outstanding UCX requests: a transfer's gets, puts, flush and notification, counted by a
//! [`Tracker`] as their callbacks report them; standalone notifications and endpoint closes,
//! checked when progressed.

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use kvx_core::{AgentName, Error, ErrorKind, Result};
use kvx_ucx_sys as sys;

use crate::status::ucx_error;

use super::AM_NOTIFY;

/// The transfers whose requests all completed since the last progress pass: filled by
/// [`on_request_done`], taken by `Inner::progress_all`, which advances only these.
pub(super) type Completions = Mutex<Vec<u64>>;

/// Counts the UCX requests of one transfer's current stage.
///
/// Every request is posted with [`Tracker::param`]: UCX calls [`on_request_done`] when it
/// completes, which frees it, keeps the first failure, and, for the last one, queues the transfer
/// on the worker's [`Completions`]. A progress pass thus costs O(1) plus the transfers that
/// moved, however many requests are in flight.
///
/// A stage is posted between [`begin`](Tracker::begin) and [`end`](Tracker::end), which hold one
/// count of their own: the count cannot reach zero while requests are still being posted.
pub(super) struct Tracker {
    id: u64,
    /// Requests in flight, plus one between `begin` and `end`.
    outstanding: AtomicUsize,
    /// The first failed request's status; `UCS_OK` while none failed.
    failure: AtomicI8,
    completions: Arc<Completions>,
}

impl Tracker {
    /// A tracker for transfer `id`, which reports to `completions`.
    pub(super) fn new(id: u64, completions: &Arc<Completions>) -> Arc<Self> {
        Arc::new(Tracker {
            id,
            outstanding: AtomicUsize::new(0),
            failure: AtomicI8::new(sys::UCS_OK),
            completions: Arc::clone(completions),
        })
    }

    /// The transfer's id (or the answers').
    pub(super) fn id(&self) -> u64 {
        self.id
    }

    /// Starts posting a stage's requests.
    pub(super) fn begin(&self) {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends posting a stage's requests: from now on the last request to complete queues the
    /// transfer (when none is left, the caller advances it itself).
    pub(super) fn end(&self) {
        self.outstanding.fetch_sub(1, Ordering::AcqRel);
    }

    /// Counts `n` completions still to come that are not requests of this agent (the ranges of
    /// a READ by active messages, each [`complete`](Tracker::complete)d when it arrived or was
    /// given up); between `begin` and `end`.
    pub(super) fn expect(&self, n: usize) {
        self.outstanding.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts one completion with its status (a failure is kept if it is the first); the last
    /// one queues the transfer on the worker's completions.
    pub(super) fn complete(&self, status: sys::ucs_status_t) {
        if status != sys::UCS_OK {
            let _ = self.failure.compare_exchange(sys::UCS_OK, status, Ordering::AcqRel, Ordering::Relaxed);
        }
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.completions.lock().unwrap_or_else(PoisonError::into_inner).push(self.id);
        }
    }

    /// Whether no request of the transfer is in flight.
    pub(super) fn is_idle(&self) -> bool {
        self.outstanding.load(Ordering::Acquire) == 0
    }

    /// The first failed request's status, taken (`None` when none failed).
    pub(super) fn take_failure(&self) -> Option<sys::ucs_status_t> {
        Some(self.failure.swap(sys::UCS_OK, Ordering::AcqRel)).filter(|&s| s != sys::UCS_OK)
    }

    /// Request parameters that report the request's completion to this tracker. The tracker
    /// must stay alive until it is idle (the transfer holding it is dropped only then, or leaked).
    pub(super) fn param(&self) -> sys::ucp_request_param_t {
        // SAFETY: all-zero is "no fields set" for this plain C struct.
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = Some(on_request_done);
        param.user_data = std::ptr::from_ref(self).cast_mut().cast();
        param
    }

    /// Parameters of an active-message data receive that report its completion to this
    /// tracker, as [`param`](Tracker::param) does for sends.
    pub(super) fn recv_param(&self) -> sys::ucp_request_param_t {
        let mut param = self.param();
        param.cb.recv_am = Some(on_receive_done);
        param
    }

    /// Records the status pointer of a `*_nbx` call made with [`param`](Tracker::param), between
    /// `begin` and `end`: a request is counted until its callback; an immediate completion needs
    /// nothing; an error is returned, of `kind` and naming `what`.
    pub(super) fn record(&self, ptr: sys::ucs_status_ptr_t, what: &str) -> Result<()> {
        if sys::UCS_PTR_IS_ERR(ptr) {
            return Err(ucx_error(ErrorKind::Transfer, what, sys::UCS_PTR_RAW_STATUS(ptr)));
        }
        if !ptr.is_null() {
            // Should the callback run first, `begin`'s count keeps the total above zero.
            self.outstanding.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// The completion callback of every tracked send, get, put and flush (see [`Tracker`]); UCX
/// calls it from progress (or when an endpoint fails or closes), always with the agent's lock
/// held.
unsafe extern "C" fn on_request_done(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: UCX passes the request and the user data of `Tracker::param`.
    unsafe { request_done(request, status, user_data) }
}

/// The completion callback of a tracked active-message data receive (`ucp_am_recv_data_nbx`
/// with [`Tracker::recv_param`]); as [`on_request_done`].
pub(super) unsafe extern "C" fn on_receive_done(
    request: *mut c_void,
    status: sys::ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    // SAFETY: UCX passes the request and the user data of `Tracker::recv_param`.
    unsafe { request_done(request, status, user_data) }
}

/// Frees a completed tracked request and counts it on its tracker.
///
/// # Safety
/// `request` is a completed request of a live worker, not freed yet; `user_data` is the
/// [`Tracker`] it was posted with, alive until the tracker is idle.
unsafe fn request_done(request: *mut c_void, status: sys::ucs_status_t, user_data: *mut c_void) {
    // Nothing below panics short of an allocation failure; a panic must not unwind into C.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `user_data` is the Tracker of the request's transfer (`Tracker::param`), which
        // lives until the tracker is idle, that is, past this call; the agent's lock, held by
        // whoever progresses the worker, keeps anyone from dropping it meanwhile.
        let tracker = unsafe { &*user_data.cast::<Tracker>() };
        // SAFETY: a request of a live worker, completed, freed once (here: kvx keeps no handle
        // on a tracked request); freeing from its callback is allowed.
        unsafe { sys::ucp_request_free(request) };
        tracker.complete(status);
    }));
}

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

/// Removes finished requests (endpoint closes); returns the first failure, of kind `Transfer`
/// with UCX's status.
pub(super) fn reap(requests: &mut Vec<Request>) -> Option<Error> {
    let mut failure = None;
    requests.retain(|r| match r.status() {
        sys::UCS_INPROGRESS => true,
        sys::UCS_OK => false,
        status => {
            failure.get_or_insert_with(|| ucx_error(ErrorKind::Transfer, "a UCX request", status));
            false
        }
    });
    failure
}

/// A notification's buffers, which UCX reads until its send completes.
pub(super) struct SendBuffers {
    _header: Box<[u8]>,
    _payload: Box<[u8]>,
}

/// Sends a notification from `from` (eager active message) with `param` (its flags are set
/// here); returns the buffers to keep until the send completes, and the call's status pointer.
pub(super) fn send_notification(
    ep: NonNull<sys::ucp_ep>,
    from: &AgentName,
    msg: &[u8],
    mut param: sys::ucp_request_param_t,
) -> (SendBuffers, sys::ucs_status_ptr_t) {
    let header: Box<[u8]> = from.as_str().as_bytes().into();
    let payload: Box<[u8]> = msg.into();
    param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = sys::UCP_AM_SEND_FLAG_EAGER;
    // SAFETY: the endpoint is live; header and payload are heap buffers the caller keeps (in the
    // returned SendBuffers) until the request completes (or the worker is destroyed).
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
    (SendBuffers { _header: header, _payload: payload }, status_ptr)
}

/// A standalone notification on its way out.
pub(super) struct PendingSend {
    pub(super) request: Option<Request>,
    pub(super) _buffers: SendBuffers,
}

impl PendingSend {
    pub(super) fn post(ep: NonNull<sys::ucp_ep>, from: &AgentName, msg: &[u8]) -> Result<Self> {
        // SAFETY: all-zero is "no fields set" for this plain C struct.
        let param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        let (buffers, status_ptr) = send_notification(ep, from, msg, param);
        let request = Request::from_status_ptr(status_ptr, ErrorKind::Transfer, "ucp_am_send_nbx")?;
        Ok(PendingSend { request, _buffers: buffers })
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
