//! READs by rendezvous active messages ([`ReadPath::ActiveMessages`]): the reader asks for its
//! ranges, the target answers each one from its registered memory straight into the reader's
//! slot.
//!
//! - The reader sends [`AM_READ_REQUEST`]s: header `id, nonce, first, count`, data `count`
//!   `(address, length)` ranges of the target's memory (at most [`MAX_RANGES`] per message).
//! - The target's handler checks the message's shape and queues it ([`Serve`]); right after the
//!   `ucp_worker_progress` call that ran the handler, the agent checks each range against its live
//!   registrations and answers it on the request's reply endpoint with one [`AM_READ_DATA`]:
//!   header `id, nonce, index, status`, data the range, sent by rendezvous from the registration
//!   (status 0), or no data and a UCX error status when the range is not all in one registration.
//! - The reader's handler ([`Reads`]) takes a range only for a READ it has in flight, with that
//!   READ's nonce, at an index it did not take yet, of exactly the length it asked for, and
//!   receives it into the slot (`ucp_am_recv_data_nbx`). Anything else is dropped and counted: a
//!   peer can neither write into another READ's slots nor complete a READ twice.
//!
//! Each range is one completion on the transfer's [`Tracker`], so a READ is done when every
//! range arrived or was refused, failed when any was refused, failed or its peer failed.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::ffi::c_void;
use std::hash::BuildHasher;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use kvx_core::{Error, ErrorKind, Result};
use kvx_ucx_sys as sys;

#[cfg(doc)]
use crate::ReadPath;
use crate::status::error;

use super::inbox::Message;
use super::request::Tracker;
use super::state::Inner;
use super::xfer::Desc;

/// Active-message id of a READ's request (reader to target).
pub(super) const AM_READ_REQUEST: u32 = 0x6b77;
/// Active-message id of one range of a READ (target to reader).
pub(super) const AM_READ_DATA: u32 = 0x6b78;
/// Ranges per request message (16 bytes each).
pub(super) const MAX_RANGES: usize = 512;
/// Ranges of at least this many bytes are answered by rendezvous (sent from the registration,
/// received into the slot), smaller ones eagerly (through UCX's segments, fewer round trips).
/// Measured over TCP with `kvx bench` (1000 scattered blocks, against a TCP stream in the same
/// run): rendezvous costs about 17 µs per range more than it saves below 64 KiB (32 KiB blocks:
/// 0.49 of the stream by rendezvous, 1.08 eagerly), and gains above (64 KiB: 1.53-1.78 against
/// 1.22 with UCX's own choice, eager).
const RNDV_MIN: usize = 64 << 10;
const HEADER_LEN: usize = 24;
const RANGE_LEN: usize = 16;

/// A request's or a range's header: the READ (its transfer id at the reader and the nonce the
/// reader drew for it), then an index and a count (request) or status (range).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) id: u64,
    pub(super) nonce: u64,
    pub(super) index: u32,
    /// A request: how many ranges follow. A range: 0, or the UCX status it was refused with.
    pub(super) word: u32,
}

impl Header {
    pub(super) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[..8].copy_from_slice(&self.id.to_le_bytes());
        out[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        out[16..20].copy_from_slice(&self.index.to_le_bytes());
        out[20..].copy_from_slice(&self.word.to_le_bytes());
        out
    }

    pub(super) fn decode(bytes: &[u8]) -> Option<Header> {
        let bytes: &[u8; HEADER_LEN] = bytes.try_into().ok()?;
        let (id, rest) = bytes.split_first_chunk::<8>()?;
        let (nonce, rest) = rest.split_first_chunk::<8>()?;
        let (index, word) = rest.split_first_chunk::<4>()?;
        Some(Header {
            id: u64::from_le_bytes(*id),
            nonce: u64::from_le_bytes(*nonce),
            index: u32::from_le_bytes(*index),
            word: u32::from_le_bytes(word.try_into().ok()?),
        })
    }
}

/// A READ request's ranges, `(address, length)`, from its message data; `None` unless the data
/// is exactly `count` ranges, `count` is 1 to [`MAX_RANGES`], each range non-empty and inside
/// the address space, and the last index fits in 32 bits.
pub(super) fn decode_ranges(header: &Header, data: &[u8]) -> Option<Vec<(u64, u64)>> {
    let count = usize::try_from(header.word).ok().filter(|&c| (1..=MAX_RANGES).contains(&c))?;
    if data.len() != count * RANGE_LEN || header.index.checked_add(header.word - 1).is_none() {
        return None;
    }
    data.chunks_exact(RANGE_LEN)
        .map(|c| {
            let addr = u64::from_le_bytes(c[..8].try_into().ok()?);
            let len = u64::from_le_bytes(c[8..].try_into().ok()?);
            (len > 0 && addr.checked_add(len).is_some()).then_some((addr, len))
        })
        .collect()
}

/// A request's data: the target's `(address, length)` of each range.
fn encode_ranges(descs: &[Desc]) -> Vec<u8> {
    let mut out = Vec::with_capacity(descs.len() * RANGE_LEN);
    for &(_, _, addr, _, len) in descs {
        out.extend_from_slice(&addr.to_le_bytes());
        out.extend_from_slice(&(len as u64).to_le_bytes());
    }
    out
}

/// The READs this agent has in flight by active messages, as its [`AM_READ_DATA`] handler
/// sees them.
pub(super) struct Reads {
    /// The agent's worker (`ucp_am_recv_data_nbx` needs it), set once it exists.
    worker: sys::ucp_worker_h,
    table: Mutex<HashMap<u64, Read>>,
    nonces: RandomState,
    /// Ranges dropped: unknown READ or nonce, index taken or out of range, wrong length.
    pub(super) refused: AtomicU64,
}

struct Read {
    nonce: u64,
    /// The peer's key in `Inner::peers`.
    peer: u64,
    tracker: Arc<Tracker>,
    /// Each range's slot: local address, length and memory handle.
    slots: Vec<(u64, usize, sys::ucp_mem_h)>,
    /// Ranges that arrived or were given up: a second answer is refused.
    taken: Vec<bool>,
    /// Request messages, which UCX reads until their sends complete (the READ is dropped from
    /// the table only once its tracker is idle).
    _requests: Vec<(Box<[u8; HEADER_LEN]>, Vec<u8>)>,
}

impl Read {
    /// Gives up every range not taken yet, with `status`.
    fn give_up(&mut self, status: sys::ucs_status_t) {
        for taken in self.taken.iter_mut().filter(|t| !**t) {
            *taken = true;
            self.tracker.complete(status);
        }
    }
}

// SAFETY: the raw handles (worker, memory handles) are only used by the handler, which UCX runs
// from progress with the agent's lock held (serialized mode); the table has its own lock.
unsafe impl Send for Reads {}
// SAFETY: as for Send.
unsafe impl Sync for Reads {}

impl Reads {
    pub(super) fn new(worker: sys::ucp_worker_h) -> Box<Self> {
        Box::new(Reads {
            worker,
            table: Mutex::default(),
            nonces: RandomState::new(),
            refused: AtomicU64::new(0),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Read>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives up the ranges of READ `id` that have not arrived (its owner released it): the
    /// transfer completes without them, and a late one is refused rather than written.
    pub(super) fn cancel(&self, id: u64) {
        if let Some(read) = self.table().get_mut(&id) {
            read.give_up(sys::UCS_ERR_CANCELED);
        }
    }

    /// Gives up every READ (the agent is going away).
    pub(super) fn cancel_all(&self) {
        for read in self.table().values_mut() {
            read.give_up(sys::UCS_ERR_CANCELED);
        }
    }

    /// Fails the READs from peer `peer`, whose endpoint UCX reported failed with `status`.
    pub(super) fn fail_peer(&self, peer: u64, status: sys::ucs_status_t) {
        for read in self.table().values_mut().filter(|r| r.peer == peer) {
            read.give_up(status);
        }
    }

    /// Forgets READ `id` (its transfer is final and its tracker idle).
    pub(super) fn finish(&self, id: u64) {
        self.table().remove(&id);
    }

    /// The [`AM_READ_DATA`] handler's work: takes range `header.index` of a READ in flight if the
    /// message is its answer. Returns what the handler returns to UCX.
    fn accept(&self, header: &Header, data: *mut c_void, length: usize, rndv: bool) -> sys::ucs_status_t {
        let mut table = self.table();
        let slot = table.get_mut(&header.id).filter(|r| r.nonce == header.nonce).and_then(|read| {
            let index = usize::try_from(header.index).ok()?;
            let (addr, len, memh) = *read.slots.get(index)?;
            let taken = read.taken.get_mut(index).filter(|t| !**t)?;
            // 0 with exactly the length asked for, or a UCX error status with no data.
            let status = sys::ucs_status_t::try_from(header.word as i32).ok().filter(|&s| s <= 0)?;
            let fits = if status == sys::UCS_OK { length == len } else { length == 0 };
            fits.then(|| {
                *taken = true;
                (Arc::clone(&read.tracker), addr, len, memh, status)
            })
        });
        drop(table);
        let Some((tracker, addr, len, memh, status)) = slot else {
            self.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("dropping a UCX READ answer that answers no READ in flight: {header:?}");
            return sys::UCS_OK;
        };
        if status != sys::UCS_OK {
            tracker.complete(status);
        } else if rndv {
            let mut param = tracker.recv_param();
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
            param.memh = memh;
            // SAFETY: a live worker; `data` is the rendezvous descriptor UCX just passed; the slot
            // lies in a registration that the READ's transfer holds until its tracker is idle,
            // which is after this receive completes (it counts on the tracker).
            let status_ptr =
                unsafe { sys::ucp_am_recv_data_nbx(self.worker, data, addr as *mut c_void, len, &param) };
            if sys::UCS_PTR_IS_ERR(status_ptr) {
                tracker.complete(sys::UCS_PTR_RAW_STATUS(status_ptr));
            } else if status_ptr.is_null() {
                tracker.complete(sys::UCS_OK);
            }
        } else {
            // SAFETY: an eager message's `length` (= `len`) bytes are readable during the call;
            // the slot is writable and held as above; the two cannot overlap (UCX's buffer).
            unsafe { ptr::copy_nonoverlapping(data.cast::<u8>(), addr as *mut u8, len) };
            tracker.complete(sys::UCS_OK);
        }
        sys::UCS_OK
    }
}

/// Requests received, to be answered right after the progress call that received them (while
/// their reply endpoints are certainly alive).
pub(super) struct Serve {
    queue: Mutex<Vec<Request>>,
    /// Request messages dropped as malformed.
    pub(super) refused: AtomicU64,
}

struct Request {
    reply_ep: usize,
    header: Header,
    ranges: Vec<(u64, u64)>,
}

impl Serve {
    pub(super) fn new() -> Box<Self> {
        Box::new(Serve { queue: Mutex::default(), refused: AtomicU64::new(0) })
    }

    fn take(&self) -> Vec<Request> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn refuse(&self, why: &str) -> sys::ucs_status_t {
        self.refused.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("dropping a malformed UCX READ request: {why}");
        sys::UCS_OK
    }
}

/// One request's answers on their way out: their headers (UCX may read them until the sends
/// complete) and the registrations they send from.
pub(super) struct Answers {
    pub(super) tracker: Arc<Tracker>,
    pub(super) regs: Vec<u64>,
    _headers: Box<[[u8; HEADER_LEN]]>,
}

am_handler! {
    /// The handler of [`AM_READ_REQUEST`] (a target's): checks the message's shape and queues it.
    pub(super) fn on_read_request(&Serve) |serve: &Serve, message: Message<'_>| {
        // kvx sends requests eagerly; a rendezvous sender learns it from the status.
        let Some(data) = message.eager_data() else { return sys::UCS_ERR_UNSUPPORTED };
        if message.reply_ep.is_null() {
            return serve.refuse("no reply endpoint");
        }
        let Some(header) = Header::decode(message.header) else { return serve.refuse("bad header length") };
        let Some(ranges) = decode_ranges(&header, data) else { return serve.refuse("bad ranges") };
        let request = Request { reply_ep: message.reply_ep as usize, header, ranges };
        serve.queue.lock().unwrap_or_else(PoisonError::into_inner).push(request);
        sys::UCS_OK
    }
}

am_handler! {
    /// The handler of [`AM_READ_DATA`] (a reader's): see [`Reads::accept`].
    pub(super) fn on_read_data(&Reads) |reads: &Reads, message: Message<'_>| match Header::decode(message.header) {
        Some(header) => reads.accept(&header, message.data, message.length, message.rndv()),
        None => {
            reads.refused.fetch_add(1, Ordering::Relaxed);
            sys::UCS_OK
        }
    }
}

impl Inner {
    /// Posts READ `id` of the planned ranges `descs` from peer `peer` (endpoint `ep`) by active
    /// messages: registers its slots, then sends the requests. On an error the ranges not asked
    /// for are given up.
    pub(super) fn post_am_read(
        &self,
        id: u64,
        tracker: &Arc<Tracker>,
        (peer, ep): (u64, sys::ucp_ep_h),
        descs: &[Desc],
    ) -> Result<()> {
        let nonce = self.reads.nonces.hash_one(id);
        let count = descs.len();
        let mut messages = Vec::with_capacity(count.div_ceil(MAX_RANGES));
        for (i, chunk) in descs.chunks(MAX_RANGES).enumerate() {
            let index = u32::try_from(i * MAX_RANGES)
                .map_err(|_| error(ErrorKind::InvalidArgument, "more than 2^32 ranges in one READ"))?;
            let word = chunk.len() as u32; // at most MAX_RANGES
            messages.push((Box::new(Header { id, nonce, index, word }.encode()), encode_ranges(chunk)));
        }
        tracker.expect(count);
        let mut read = Read {
            nonce,
            peer,
            tracker: Arc::clone(tracker),
            slots: descs.iter().map(|&(laddr, memh, _, _, len)| (laddr, len, memh)).collect(),
            taken: vec![false; count],
            _requests: Vec::new(),
        };
        let mut failure: Option<Error> = None;
        for (header, data) in messages {
            if failure.is_none() {
                let mut param = tracker.param();
                param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
                param.flags = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER;
                // SAFETY: a live endpoint; header and data are heap buffers kept in the table's
                // entry until the tracker is idle, past the send's completion.
                let status_ptr = unsafe {
                    sys::ucp_am_send_nbx(
                        ep,
                        AM_READ_REQUEST,
                        header.as_ptr().cast(),
                        header.len(),
                        data.as_ptr().cast(),
                        data.len(),
                        &param,
                    )
                };
                failure = tracker.record(status_ptr, "ucp_am_send_nbx (READ request)").err();
            }
            read._requests.push((header, data));
        }
        if failure.is_some() {
            read.give_up(sys::UCS_ERR_CANCELED);
        }
        self.reads.table().insert(id, read);
        failure.map_or(Ok(()), Err)
    }

    /// Answers the READ requests that the last progress call received.
    pub(super) fn serve_reads(&mut self) {
        let requests = self.serve.take();
        if requests.is_empty() {
            return;
        }
        let mut regs: Vec<(u64, u64, u64, sys::ucp_mem_h)> = self
            .regs
            .iter()
            .filter(|(_, r)| !r.retired)
            .filter_map(|(id, r)| Some((r.region.addr, r.region.end()?, *id, r.memh.raw())))
            .collect();
        regs.sort_unstable_by_key(|r| r.0);
        for request in requests {
            self.answer(&request, &regs);
        }
    }

    /// Answers one request: each range from the registration holding it, or refused.
    fn answer(&mut self, request: &Request, regs: &[(u64, u64, u64, sys::ucp_mem_h)]) {
        let mut used = Vec::new();
        // Each range: (status, buffer, length, memory handle), and its answer's header.
        let (ranges, headers): (Vec<_>, Vec<_>) = (request.ranges.iter().enumerate())
            .map(|(i, &(addr, len))| {
                let index = request.header.index + i as u32; // checked when the request was decoded
                // The registration starting at or before `addr` is the only one that can hold it.
                let holder = regs.partition_point(|r| r.0 <= addr).checked_sub(1).map(|h| regs[h]);
                let holder = holder.filter(|&(_, end, _, _)| addr.checked_add(len).is_some_and(|e| e <= end));
                let range = match (holder, usize::try_from(len)) {
                    (Some((_, _, reg, memh)), Ok(len)) => {
                        if !used.contains(&reg) {
                            used.push(reg);
                        }
                        (sys::UCS_OK, addr as *const c_void, len, Some(memh))
                    }
                    _ => {
                        self.serve.refused.fetch_add(1, Ordering::Relaxed);
                        (sys::UCS_ERR_INVALID_ADDR, ptr::null(), 0, None)
                    }
                };
                let (id, nonce) = (request.header.id, request.header.nonce);
                (range, Header { id, nonce, index, word: range.0 as u32 }.encode())
            })
            .unzip();
        // Boxed once and never resized: UCX may read each header until its send completes.
        let headers: Box<[[u8; HEADER_LEN]]> = headers.into();
        let id = self.next_id();
        let tracker = Tracker::new(id, &self.moved);
        let ep = request.reply_ep as sys::ucp_ep_h;
        tracker.begin();
        for ((_, buffer, len, memh), header) in ranges.into_iter().zip(headers.iter()) {
            let mut param = tracker.param();
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::UCP_AM_SEND_FLAG_EAGER;
            if let Some(memh) = memh {
                param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
                param.memh = memh;
                if len >= RNDV_MIN {
                    param.flags = sys::UCP_AM_SEND_FLAG_RNDV;
                }
            }
            // SAFETY: the reply endpoint UCX gave the request's handler during the progress call
            // that just returned (nothing could close it since); the header is kept with the
            // answers until their tracker is idle; a range is sent only from a live registration
            // that the answers hold until then.
            let status_ptr = unsafe {
                sys::ucp_am_send_nbx(
                    ep,
                    AM_READ_DATA,
                    header.as_ptr().cast(),
                    header.len(),
                    buffer,
                    len,
                    &param,
                )
            };
            if let Err(e) = tracker.record(status_ptr, "ucp_am_send_nbx (READ answer)") {
                tracing::warn!("answering a UCX READ request: {e}");
                break;
            }
        }
        tracker.end();
        for reg in &used {
            if let Some(r) = self.regs.get_mut(reg) {
                r.inflight += 1;
            }
        }
        let answers = Answers { tracker, regs: used, _headers: headers };
        if answers.tracker.is_idle() {
            self.finish_answers(answers);
        } else {
            self.answers.insert(id, answers);
        }
    }

    /// Releases what answers held once their sends completed.
    pub(super) fn finish_answers(&mut self, answers: Answers) {
        if let Some(status) = answers.tracker.take_failure() {
            tracing::debug!("a UCX READ answer failed: {}", crate::status::status_string(status));
        }
        for id in &answers.regs {
            if let Some(reg) = self.regs.get_mut(id) {
                reg.inflight -= 1;
                if reg.retired && reg.inflight == 0 {
                    self.destroy_reg(*id);
                }
            }
        }
    }
}

/// Whether READs to a peer should go by active messages: every lane of its endpoint that can
/// carry RMA is TCP, as `ucp_ep_print_info` lists them (`lane[0]:  0:tcp/lo.0 md[0] -> ...
/// rma_bw#0 am am_bw#0`). `false` when no lane is listed (an unknown format keeps gets).
pub(super) fn rma_lanes_are_tcp(info: &str) -> bool {
    let lanes: Vec<&str> = info.lines().filter(|l| l.contains("lane[")).collect();
    let transport = |line: &str| {
        let after = line.split_once("]:")?.1.trim_start();
        let after = after.split_once(':')?.1;
        Some(after.split('/').next()?.to_owned())
    };
    !lanes.is_empty()
        && lanes.iter().all(|l| !l.contains("rma_bw") || transport(l).is_some_and(|t| t == "tcp"))
        && lanes.iter().any(|l| transport(l).is_some_and(|t| t == "tcp"))
}

#[cfg(test)]
mod tests;
