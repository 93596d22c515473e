//! A transfer's stages (data, flush, notification), and how a checked post maps to UCX.

use std::sync::Arc;

use kvx_core::post::BlockRuns;
use kvx_core::{DlistId, Error, ErrorKind, PostPlan, Result, XferOp, XferState};
use kvx_ucx_sys as sys;

use crate::status::{error, ucx_error};

use super::request::{SendBuffers, Tracker, send_notification};
use super::state::{DlistTarget, Inner};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Stage {
    /// Gets or puts in flight.
    Data,
    /// The endpoint flush after puts in flight (a WRITE is complete only when remotely visible).
    Flush,
    /// The notification in flight.
    Notify,
    Done,
    Failed(Error),
}

impl Stage {
    /// What the stage's requests do, for an error of one of them.
    fn what(&self) -> &'static str {
        match self {
            Stage::Data => "moving the transfer's data",
            Stage::Flush => "flushing the transfer's puts",
            _ => "sending the transfer's notification",
        }
    }
}

pub(super) struct Xfer {
    pub(super) op: XferOp,
    pub(super) peer: u64,
    pub(super) regs: Vec<u64>,
    /// Counts the current stage's requests in flight (see [`Tracker`]).
    pub(super) tracker: Arc<Tracker>,
    pub(super) notify: Option<Vec<u8>>,
    /// The notification's buffers while its send may be in flight.
    pub(super) send: Option<SendBuffers>,
    pub(super) stage: Stage,
    pub(super) failure: Option<Error>,
    pub(super) holds_refs: bool,
    /// Released by its owner while running: dropped, unreported, once UCX is done with it.
    pub(super) released: bool,
}

impl Inner {
    /// Moves a transfer through its stages as far as UCX allows: called when it is posted and
    /// whenever its tracker reports its requests done.
    pub(super) fn advance(&mut self, xfer: &mut Xfer) {
        loop {
            if !xfer.tracker.is_idle() {
                return; // the last request's callback queues the transfer again
            }
            if let Some(status) = xfer.tracker.take_failure() {
                xfer.failure.get_or_insert_with(|| ucx_error(ErrorKind::Transfer, xfer.stage.what(), status));
            }
            let next = match (&xfer.stage, &xfer.failure) {
                (Stage::Done | Stage::Failed(_), _) => break,
                (Stage::Data | Stage::Flush | Stage::Notify, Some(failure)) => Stage::Failed(failure.clone()),
                (Stage::Data, None) => {
                    if xfer.op == XferOp::Write {
                        self.post_flush(xfer);
                    }
                    Stage::Flush
                }
                (Stage::Flush, None) => {
                    if let Some(msg) = xfer.notify.take() {
                        self.post_notification(xfer, &msg);
                    }
                    Stage::Notify
                }
                (Stage::Notify, None) => Stage::Done,
            };
            xfer.stage = next;
        }
        xfer.send = None;
        if xfer.op == XferOp::Read {
            self.reads.finish(xfer.tracker.id());
        }
        self.drop_refs(xfer);
    }

    pub(super) fn post_flush(&mut self, xfer: &mut Xfer) {
        let Some(peer) = self.peers.get(&xfer.peer) else {
            xfer.failure = Some(error(ErrorKind::Backend, "the transfer's peer vanished"));
            return;
        };
        xfer.tracker.begin();
        // SAFETY: the endpoint is live (the transfer holds a reference on the peer).
        let status_ptr = unsafe { sys::ucp_ep_flush_nbx(peer.ep.as_ptr(), &xfer.tracker.param()) };
        if let Err(e) = xfer.tracker.record(status_ptr, "ucp_ep_flush_nbx") {
            xfer.failure = Some(e);
        }
        xfer.tracker.end();
    }

    pub(super) fn post_notification(&mut self, xfer: &mut Xfer, msg: &[u8]) {
        let Some(peer) = self.peers.get(&xfer.peer) else {
            xfer.failure = Some(error(ErrorKind::Backend, "the transfer's peer vanished"));
            return;
        };
        xfer.tracker.begin();
        let (buffers, status_ptr) = send_notification(peer.ep, &self.name, msg, xfer.tracker.param());
        xfer.send = Some(buffers);
        if let Err(e) = xfer.tracker.record(status_ptr, "ucp_am_send_nbx") {
            xfer.failure = Some(e);
        }
        xfer.tracker.end();
    }

    /// Releases the transfer's hold on its peer and registrations (once, when it is terminal).
    pub(super) fn drop_refs(&mut self, xfer: &mut Xfer) {
        if !xfer.holds_refs {
            return;
        }
        xfer.holds_refs = false;
        if let Some(peer) = self.peers.get_mut(&xfer.peer) {
            peer.inflight -= 1;
            if peer.forgotten && peer.inflight == 0 {
                self.destroy_peer(xfer.peer);
            }
        }
        for id in &xfer.regs {
            if let Some(reg) = self.regs.get_mut(id) {
                reg.inflight -= 1;
                if reg.retired && reg.inflight == 0 {
                    self.destroy_reg(*id);
                }
            }
        }
    }
}

impl Xfer {
    pub(super) fn is_terminal(&self) -> bool {
        matches!(self.stage, Stage::Done | Stage::Failed(_))
    }

    pub(super) fn state(&self) -> XferState {
        match &self.stage {
            Stage::Done => XferState::Done,
            Stage::Failed(e) => XferState::Failed(e.clone()),
            _ => XferState::Pending,
        }
    }
}

/// A planned range: local address, local memory handle, remote address, remote region index,
/// length.
pub(super) type Desc = (u64, sys::ucp_mem_h, u64, usize, usize);

/// A checked transfer mapped to UCX: every range resolved, nothing posted yet.
pub(super) struct Plan {
    pub(super) peer: u64,
    /// Distinct local registrations used.
    pub(super) regs: Vec<u64>,
    pub(super) descs: Vec<Desc>,
}

/// Maps a post that passed kvx-core's checks to this agent's memory handles and rkeys: one get
/// or put per block.
pub(super) fn plan(inner: &Inner, checked: &PostPlan<'_>, local: DlistId, remote: DlistId) -> Result<Plan> {
    let len = checked.block_len();
    let ranges = checked.pairs().iter().map(|(l, r)| (l.region, l.addr, r.region, r.addr, len));
    plan_ranges(inner, local, remote, checked.pairs().len(), ranges)
}

/// The same for a block post: one get or put per coalesced range.
pub(super) fn plan_runs(inner: &Inner, runs: &BlockRuns, local: DlistId, remote: DlistId) -> Result<Plan> {
    let ranges = runs.iter().map(|r| (r.region, r.local, r.region, r.remote, r.len));
    plan_ranges(inner, local, remote, runs.len(), ranges)
}

/// Whether one range of list `id` may run from region `region` into the next: both lie in one
/// registration (local) or one remote region (one rkey).
pub(super) fn joinable(inner: &Inner, id: DlistId, region: usize) -> bool {
    match inner.dlists.get(&id.0).map(|d| &d.target) {
        Some(DlistTarget::Local(regs)) => matches!(regs.get(region..region + 2), Some([a, b]) if a == b),
        Some(DlistTarget::Remote { regions, .. }) => {
            matches!(regions.get(region..region + 2), Some([a, b]) if a == b)
        }
        None => false,
    }
}

/// Maps (local region, local address, remote region, remote address, length) ranges of a
/// checked post to memory handles and rkeys.
fn plan_ranges(
    inner: &Inner,
    local: DlistId,
    remote: DlistId,
    count: usize,
    ranges: impl Iterator<Item = (usize, u64, usize, u64, u64)>,
) -> Result<Plan> {
    let target = |id: DlistId| inner.dlists.get(&id.0).map(|d| &d.target);
    let (Some(DlistTarget::Local(lregs)), Some(DlistTarget::Remote { peer, regions })) =
        (target(local), target(remote))
    else {
        return Err(error(ErrorKind::Backend, "a checked list has no UCX target of its kind"));
    };
    let mut descs = Vec::with_capacity(count);
    let mut regs = Vec::new();
    // Ranges come region by region: look each region's registration up once.
    let mut last: Option<(usize, sys::ucp_mem_h)> = None;
    for (lregion, laddr, rregion, raddr, len) in ranges {
        let len = usize::try_from(len)
            .map_err(|_| error(ErrorKind::InvalidArgument, "a range exceeds the address space"))?;
        let Some(&region) = regions.get(rregion) else {
            return Err(error(ErrorKind::Backend, "a descriptor outside its list's regions"));
        };
        let memh = match last {
            Some((r, memh)) if r == lregion => memh,
            _ => {
                // The list has one registration per region, and deregistering releases the lists
                // over it: the registration is live.
                let Some(&reg_id) = lregs.get(lregion) else {
                    return Err(error(ErrorKind::Backend, "a descriptor outside its list's regions"));
                };
                let reg = inner.regs.get(&reg_id).filter(|r| !r.retired).ok_or_else(|| {
                    error(ErrorKind::Backend, format!("{local} lies in memory that was deregistered"))
                })?;
                regs.push(reg_id);
                last = Some((lregion, reg.memh.raw()));
                reg.memh.raw()
            }
        };
        descs.push((laddr, memh, raddr, region, len));
    }
    regs.sort_unstable();
    regs.dedup();
    Ok(Plan { peer: *peer, regs, descs })
}
