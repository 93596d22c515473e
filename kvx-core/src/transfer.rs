//! The transport seam: [`TransferAgent`], one endpoint of a one-sided transport (NIXL, UCX, the
//! in-process loopback).
//!
//! Post then poll, as NIXL and UCX themselves work: memory is registered once, peers' metadata is
//! loaded once, descriptor lists are prepared once per side, and each transfer names blocks by
//! index into those lists.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::ids::AgentName;
use crate::memory::{KvMemory, MemKind, MemRegion};

/// What a backend can do. Checked once, up front, by the connector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// The backend's name, as it appears in errors ("loopback", "ucx", "nixl").
    pub backend: &'static str,
    /// Host memory can be registered.
    pub dram: bool,
    /// GPU memory can be registered.
    pub vram: bool,
    /// One-sided READ is supported.
    pub read: bool,
    /// One-sided WRITE is supported.
    pub write: bool,
    /// Notifications (with transfers and on their own) are supported.
    pub notifications: bool,
}

impl Capabilities {
    /// Whether memory of `kind` can be registered.
    pub fn supports(&self, kind: MemKind) -> bool {
        match kind {
            MemKind::Dram => self.dram,
            MemKind::Vram => self.vram,
        }
    }

    /// What [`TransferAgent::register`] checks of a region before anything else: `Unsupported`
    /// for a kind this agent cannot register (the message says which kinds it can: a backend
    /// whose capabilities depend on the machine, as NIXL's plugins do, registers different kinds
    /// on different machines), `InvalidArgument` for an empty region or one that wraps the
    /// address space. The error names the backend.
    pub fn check_registration(&self, region: &MemRegion) -> Result<()> {
        if !self.supports(region.kind) {
            let registers = match (self.dram, self.vram) {
                (true, true) => "host and GPU memory",
                (true, false) => "host memory only",
                (false, true) => "GPU memory only",
                (false, false) => "no memory at all",
            };
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("{} cannot register {region:?}: this agent registers {registers}", self.backend),
            )
            .with_backend(self.backend));
        }
        if region.len == 0 || region.end().is_none() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("invalid region {:#x}+{}", region.addr, region.len),
            )
            .with_backend(self.backend));
        }
        Ok(())
    }
}

macro_rules! handle_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}#{}", stringify!($name), self.0)
            }
        }
    };
}

handle_id!(
    /// A memory registration of one agent.
    RegistrationId
);
handle_id!(
    /// A prepared descriptor list of one agent.
    DlistId
);
handle_id!(
    /// A posted transfer of one agent.
    XferId
);

/// Whose memory a descriptor list describes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DlistOwner {
    /// This agent's own registered memory.
    Local,
    /// A loaded remote agent's registered memory.
    Remote(AgentName),
}

/// Equal-length blocks laid out as regions × blocks, the shape of a paged KV cache.
///
/// Descriptor `r * num_blocks + b` is the `block_len` bytes at `bases[r] + b * block_len`. This is
/// the reference's descriptor numbering (`region * num_blocks + block`); keeping it implicit means
/// a list of millions of blocks costs one `Vec` of region bases, not millions of entries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockList {
    /// Host or GPU memory.
    pub kind: MemKind,
    /// Device id of all regions.
    pub device: u32,
    /// Base address of each region.
    pub bases: Vec<u64>,
    /// Blocks per region.
    pub num_blocks: u32,
    /// Bytes per block.
    pub block_len: u64,
}

impl BlockList {
    /// Number of descriptors (regions × blocks).
    pub fn len(&self) -> u64 {
        self.bases.len() as u64 * u64::from(self.num_blocks)
    }

    /// Whether the list has no descriptors.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The memory of descriptor `index`, or `None` when it is out of range or overflows.
    pub fn desc(&self, index: u32) -> Option<MemRegion> {
        if self.num_blocks == 0 {
            return None;
        }
        let region = (index / self.num_blocks) as usize;
        let block = u64::from(index % self.num_blocks);
        let base = *self.bases.get(region)?;
        let addr = base.checked_add(block.checked_mul(self.block_len)?)?;
        let desc = MemRegion { addr, len: self.block_len, kind: self.kind, device: self.device };
        desc.end().map(|_| desc)
    }

    /// The whole of each region (for checking the list against registrations).
    pub fn regions(&self) -> impl Iterator<Item = Option<MemRegion>> + '_ {
        self.bases.iter().map(move |&addr| {
            let len = u64::from(self.num_blocks).checked_mul(self.block_len)?;
            let region = MemRegion { addr, len, kind: self.kind, device: self.device };
            region.end().map(|_| region)
        })
    }
}

/// Which regions of the two lists a [`BlockPost`] covers, and which of its block pairs each
/// region takes. Region `r` of the local list pairs with region `r` of the remote list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionBlocks<'a> {
    /// Regions `0..n` each take every block pair.
    All(u32),
    /// Region `r`, for `r` in `0..windows.len()`, takes the last `windows[r]` block pairs (all of
    /// them where it is `None` or where the post has fewer): the layers of a sliding window read
    /// only their most recent blocks. `Some(0)` takes none.
    Windows(&'a [Option<u32>]),
}

impl RegionBlocks<'_> {
    /// The regions the post covers (`0..count`).
    pub fn count(&self) -> usize {
        match self {
            RegionBlocks::All(n) => *n as usize,
            RegionBlocks::Windows(w) => w.len(),
        }
    }

    /// The first of `pairs` block pairs that region `region` takes (`pairs` when it takes none).
    pub fn first_pair(&self, region: usize, pairs: usize) -> usize {
        let window = match self {
            RegionBlocks::All(_) => None,
            RegionBlocks::Windows(w) => w.get(region).copied().unwrap_or(Some(0)),
        };
        match window {
            Some(w) => pairs.saturating_sub(w as usize),
            None => 0,
        }
    }
}

/// A block-major transfer for [`TransferAgent::post_blocks`]: block `local_blocks[i]` of each
/// covered region of the local list pairs with block `remote_blocks[i]` of the same region of the
/// remote list. Each block id is named once, whatever the number of regions.
///
/// `local_num_blocks` and `remote_num_blocks` are the lists' blocks per region as the caller
/// prepared them: backends check them against the lists, and the default `post_blocks` needs them
/// to number descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockPost<'a> {
    /// Block ids of the local list, in transfer order.
    pub local_blocks: &'a [u32],
    /// Blocks per region of the local list.
    pub local_num_blocks: u32,
    /// Block ids of the remote list, one per local block.
    pub remote_blocks: &'a [u32],
    /// Blocks per region of the remote list.
    pub remote_num_blocks: u32,
    /// The regions covered, and the block pairs each takes.
    pub regions: RegionBlocks<'a>,
}

impl BlockPost<'_> {
    /// Descriptors before coalescing: per covered region, the block pairs it takes (over the
    /// common prefix of unequal slices).
    pub fn block_descriptors(&self) -> u64 {
        let pairs = self.local_blocks.len().min(self.remote_blocks.len());
        (0..self.regions.count()).map(|r| (pairs - self.regions.first_pair(r, pairs)) as u64).sum()
    }

    /// Appends the descriptor indices (`region * num_blocks + block`) of this post to `local` and
    /// `remote`, region by region: what [`TransferAgent::post`] takes. Fails with
    /// `InvalidArgument` for a block id out of range of its side's `num_blocks`, for slices of
    /// unequal lengths, and for an index past `u32::MAX`, before it appends anything.
    pub fn descriptor_indices(&self, local: &mut Vec<u32>, remote: &mut Vec<u32>) -> Result<()> {
        let pairs = self.local_blocks.len();
        if pairs != self.remote_blocks.len() {
            return Err(Error::invalid_argument(format!(
                "{pairs} local and {} remote blocks",
                self.remote_blocks.len()
            )));
        }
        let regions = self.regions.count();
        for (blocks, num_blocks) in
            [(self.local_blocks, self.local_num_blocks), (self.remote_blocks, self.remote_num_blocks)]
        {
            if let Some(b) = blocks.iter().find(|&&b| b >= num_blocks) {
                return Err(Error::invalid_argument(format!(
                    "block {b} out of range ({num_blocks} blocks per region)"
                )));
            }
            // The last index, regions * num_blocks - 1, must fit.
            if (regions as u64).saturating_mul(u64::from(num_blocks)) > 1 << 32 {
                return Err(Error::invalid_argument(format!(
                    "{regions} regions of {num_blocks} blocks: descriptor indices past u32::MAX"
                )));
            }
        }
        for region in 0..regions {
            let first = self.regions.first_pair(region, pairs);
            // Checked above: region * num_blocks + block < 2^32.
            let (lbase, rbase) =
                (region as u32 * self.local_num_blocks, region as u32 * self.remote_num_blocks);
            local.extend(self.local_blocks[first..].iter().map(|&b| lbase + b));
            remote.extend(self.remote_blocks[first..].iter().map(|&b| rbase + b));
        }
        Ok(())
    }
}

/// The direction of a one-sided transfer, from the initiator's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum XferOp {
    /// Copy remote blocks into local blocks.
    Read,
    /// Copy local blocks into remote blocks.
    Write,
}

/// What an agent calls when a notification arrives (see
/// [`TransferAgent::wake_on_notification`]).
#[derive(Clone)]
pub struct NotificationWaker(std::sync::Arc<dyn Fn() + Send + Sync>);

impl NotificationWaker {
    /// A waker that runs `wake`.
    pub fn new(wake: impl Fn() + Send + Sync + 'static) -> Self {
        NotificationWaker(std::sync::Arc::new(wake))
    }

    /// Runs it.
    pub fn wake(&self) {
        (self.0)()
    }
}

impl std::fmt::Debug for NotificationWaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NotificationWaker")
    }
}

/// Where a posted transfer stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XferState {
    /// Still moving data.
    Pending,
    /// All data is in place; the notification, if any, has been handed to the transport.
    Done,
    /// The transfer failed; the destination blocks hold unspecified bytes. The error is of kind
    /// [`Transfer`](crate::ErrorKind::Transfer) for a failure of the transport (a peer gone, a
    /// connection reset, memory the peer no longer serves), with the backend's name and, where
    /// the transport gives one, its status code.
    Failed(Error),
}

/// The longest notification payload, in bytes, that [`TransferAgent::post`] and
/// [`TransferAgent::notify`] accept (kvx sends request ids and small wire messages). A backend
/// drops a longer one it receives.
pub const MAX_NOTIFICATION_LEN: usize = 64 << 10;

/// A notification received from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The agent that sent it.
    pub from: AgentName,
    /// Its payload (kvx sends request ids).
    pub msg: Vec<u8>,
}

/// One endpoint of a one-sided transport.
///
/// Sync and object-safe (`Arc<dyn TransferAgent>` works). Every method is non-blocking except where
/// its doc says otherwise. Errors carry the backend's name and status. docs/CONTRACT.md ("Backend
/// side") states the same contract with the code that enforces it; kvx-testkit's conformance
/// suite checks it on every backend.
///
/// # Calling order
/// 1. [`register`](Self::register) the KV memory; [`local_metadata`](Self::local_metadata) and give
///    it to peers.
/// 2. [`load_remote`](Self::load_remote) each peer's metadata; [`prep_dlist`](Self::prep_dlist) one
///    local list and one list per remote.
/// 3. [`post`](Self::post) transfers; each step, [`drain_completions`](Self::drain_completions)
///    names those that reached `Done` or `Failed`: [`poll`](Self::poll) each for its state, then
///    [`release`](Self::release) it.
/// 4. [`drain_notifications`](Self::drain_notifications) every step.
///
/// # Transfers in flight
/// A posted transfer is *in flight* until it *settles*: until its state is `Done` or `Failed`, or,
/// released while `Pending`, until the transport is done with it (the agent completes it in the
/// background, in `drain_completions`, `progress` and `drain_notifications`). While in flight it keeps what it
/// uses: the registrations of its local blocks (the agent's `Arc<dyn KvMemory>` and the
/// transport's mapping) and its peer (connection and keys). So:
/// - [`deregister`](Self::deregister) and [`forget_remote`](Self::forget_remote) succeed at once,
///   also while transfers use the registration or the peer. What they release is gone for new
///   calls at once: the descriptor lists over it are released (their ids are `NotFound`), so new
///   posts over them fail with `NotFound`.
/// - Transfers posted before go on as if nothing happened: each finishes (`Done`, with its
///   notification) or fails for its own reasons. None fails because of the deregistration or the
///   forget.
/// - The memory and the peer's connection are released when the last transfer using them settles
///   (or when the agent is dropped).
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait TransferAgent: Send + Sync + fmt::Debug {
    /// This agent's name.
    fn name(&self) -> &AgentName;

    /// What this backend supports.
    fn capabilities(&self) -> Capabilities;

    /// Registers memory with the transport. The agent keeps `memory` alive until
    /// [`deregister`](Self::deregister) (and the transfers in flight over it settle) or the agent
    /// is dropped, so it cannot be freed while a peer may still access it.
    ///
    /// Requires [`Capabilities::dram`] or [`Capabilities::vram`] for the memory's kind
    /// (`Unsupported`); an empty or address-wrapping region is `InvalidArgument`.
    fn register(&self, memory: Arc<dyn KvMemory>) -> Result<RegistrationId>;

    /// Deregisters memory: it leaves [`local_metadata`](Self::local_metadata), the local
    /// descriptor lists over it are released, and a new [`prep_dlist`](Self::prep_dlist) over it
    /// fails with `InvalidArgument` (as over any memory that is not registered). Succeeds at once
    /// while transfers use it: see [Transfers in flight](Self#transfers-in-flight). An unknown
    /// (or already deregistered) id is `NotFound`.
    fn deregister(&self, registration: RegistrationId) -> Result<()>;

    /// An opaque blob that a peer passes to [`load_remote`](Self::load_remote): the agent's name,
    /// its transport address and its registered regions. Call it after registering.
    fn local_metadata(&self) -> Result<Vec<u8>>;

    /// Loads a peer's metadata (from the network: validated). Returns the peer's name.
    ///
    /// # Behavior
    /// A peer already loaded is an error of kind `State`: [`forget_remote`](Self::forget_remote)
    /// it first (a restarted peer has new metadata).
    fn load_remote(&self, metadata: &[u8]) -> Result<AgentName>;

    /// Forgets a peer: its descriptor lists are released, and later `prep_dlist`, `post` and
    /// `notify` naming it fail with `NotFound` until it is loaded again. Succeeds at once while
    /// transfers to it are in flight: see [Transfers in flight](Self#transfers-in-flight). A peer
    /// not loaded is `NotFound`.
    fn forget_remote(&self, agent: &AgentName) -> Result<()>;

    /// Prepares a descriptor list over this agent's registered memory or a remote agent's.
    ///
    /// # Behavior
    /// Every region of `blocks` must lie inside one registration of the owner, or the call fails
    /// with `InvalidArgument` (local) or `InvalidPeerData` (remote: the peer's metadata does not
    /// cover it). A remote that is not loaded is `NotFound`.
    fn prep_dlist(&self, owner: &DlistOwner, blocks: &BlockList) -> Result<DlistId>;

    /// Releases a descriptor list. Transfers posted over it are not affected. An unknown (or
    /// already released) id is `NotFound`.
    fn release_dlist(&self, dlist: DlistId) -> Result<()>;

    /// Posts one transfer of `local_descs[i]` <-> `remote_descs[i]` for every `i`. With `notify`,
    /// the remote agent receives the message after all the data is in place.
    ///
    /// # Errors
    /// Every backend checks its arguments with [`PostRequest::check`](crate::post::PostRequest::check)
    /// before it touches its transport, in this order; on any of these nothing is transferred and
    /// no notification sent:
    ///
    /// | the call | kind |
    /// |---|---|
    /// | `op` is not supported ([`Capabilities::read`], [`Capabilities::write`]) | `Unsupported` |
    /// | `notify` without [`Capabilities::notifications`] | `Unsupported` |
    /// | `notify` longer than [`MAX_NOTIFICATION_LEN`] | `InvalidArgument` |
    /// | `local` or `remote` is no list of this agent (never prepared, released, or released with its registration or peer) | `NotFound` |
    /// | `local` is a remote list, or `remote` a local one | `InvalidArgument` |
    /// | `local_descs` and `remote_descs` differ in length | `InvalidArgument` |
    /// | no descriptors at all (an empty post) | `InvalidArgument` |
    /// | the two lists' blocks differ in length | `InvalidArgument` |
    /// | an index out of range of its list | `InvalidArgument` |
    ///
    /// All of these are the local caller's arguments, remote indices included: a caller that takes
    /// indices from a peer checks them first and reports `InvalidPeerData` itself (kvx's worker
    /// does). After the checks, a transport that refuses the transfer is `Transfer` (for example a
    /// peer the transport already knows is gone) and another failure of the transport library is
    /// `Backend`.
    #[allow(clippy::needless_lifetimes)] // mockall needs the lifetime named.
    fn post<'a>(
        &self,
        op: XferOp,
        local: DlistId,
        local_descs: &[u32],
        remote: DlistId,
        remote_descs: &[u32],
        notify: Option<&'a [u8]>,
    ) -> Result<XferId>;

    /// Posts one transfer of the blocks `blocks` names, in every region it covers, as
    /// [`post`](Self::post) does for the same descriptors
    /// ([`BlockPost::descriptor_indices`]), with the same notification rule.
    ///
    /// A backend that overrides it checks with
    /// [`BlockPostRequest::check`](crate::post::BlockPostRequest::check), whose plan coalesces
    /// runs of blocks contiguous on both sides into one range per region: posting costs
    /// O(blocks + regions), not O(blocks × regions), and a transport moves one range per run.
    ///
    /// # Errors
    /// The kinds of [`post`](Self::post), in its order, with blocks for indices: slices of unequal
    /// lengths, no block at all in any covered region, and blocks of unequal lengths are
    /// `InvalidArgument`, then a `local_num_blocks` or `remote_num_blocks` other than its list's,
    /// a covered region missing from a list, or a block id out of range is `InvalidArgument`.
    /// (The default implementation cannot see the lists: it takes the two `num_blocks` as given.)
    ///
    /// The default implementation numbers the descriptors and calls `post` (lists of at most
    /// `u32::MAX` descriptors); for a block id out of range it first calls `post` without
    /// descriptors, to report an earlier argument's kind.
    #[allow(clippy::needless_lifetimes)] // mockall needs the lifetime named.
    fn post_blocks<'a>(
        &self,
        op: XferOp,
        local: DlistId,
        remote: DlistId,
        blocks: &BlockPost<'a>,
        notify: Option<&'a [u8]>,
    ) -> Result<XferId> {
        let (mut local_descs, mut remote_descs) = (Vec::new(), Vec::new());
        match blocks.descriptor_indices(&mut local_descs, &mut remote_descs) {
            Ok(()) => self.post(op, local, &local_descs, remote, &remote_descs, notify),
            Err(bad) => match self.post(op, local, &[], remote, &[], notify) {
                // The lists, the operation or the notification were wrong first.
                Err(e) if e.kind() != ErrorKind::InvalidArgument => Err(e),
                Err(_) => Err(bad.with_backend(self.capabilities().backend)),
                Ok(xfer) => {
                    // A backend that accepts empty posts: take it back.
                    let _ = self.release(xfer);
                    Err(bad.with_backend(self.capabilities().backend))
                }
            },
        }
    }

    /// Where a transfer stands. `Done` and `Failed` are final: the transfer has settled and later
    /// polls return the same state until it is released. An unknown (or released) id is
    /// `NotFound`. Whether it drives the transport's progress is the backend's choice (the
    /// loopback agent's does not: it is a lookup); a caller with many transfers in flight waits
    /// for them with [`drain_completions`](Self::drain_completions), not by polling each.
    fn poll(&self, xfer: XferId) -> Result<XferState>;

    /// Moves into `out` (appending) the ids of this agent's transfers that reached `Done` or
    /// `Failed` since the last call; drives the transport's progress.
    ///
    /// # Behavior
    /// - Each posted transfer is reported at most once, after its state became final; `poll`
    ///   of a reported id returns that final state until the id is released.
    /// - A released transfer is never reported, also one released while `Pending` that then
    ///   settles in the background.
    /// - A transfer that is `Done` or `Failed` is reported by this call or the next: a caller
    ///   that calls it every step sees every transfer end, without polling those still pending.
    ///
    /// The cost of a call is the backend's (each documents it): the loopback agent's is linear
    /// in the transfers that ran or completed, UCX's in the transfers not yet final, NIXL's in
    /// the transfers not yet released (NIXL has no completion queue: one status check for each
    /// still pending).
    fn drain_completions(&self, out: &mut Vec<XferId>) -> Result<()>;

    /// Forgets a transfer: its id is `NotFound` from now on. A transfer still `Pending` is
    /// cancelled where the backend can, otherwise completed in the background; either way its
    /// destination blocks hold unspecified bytes and its notification may or may not be sent.
    fn release(&self, xfer: XferId) -> Result<()>;

    /// Sends a notification without data. Requires [`Capabilities::notifications`]
    /// (`Unsupported`); a message longer than [`MAX_NOTIFICATION_LEN`] is `InvalidArgument`; a
    /// peer not loaded is `NotFound`.
    fn notify(&self, agent: &AgentName, msg: &[u8]) -> Result<()>;

    /// Moves received notifications into `out`; drives the transport's progress.
    fn drain_notifications(&self, out: &mut Vec<Notification>) -> Result<()>;

    /// Asks the agent to call `wake` whenever a notification arrives on a thread of its own (a
    /// progress or I/O thread), so that whoever drives the worker drains it at once rather than
    /// at its next poll: a prefill engine answers a release, and a decode engine takes the
    /// answer, within the transport's latency. Returns whether it will: an agent whose
    /// notifications arrive only while its caller drives it (`drain_notifications`, `progress`)
    /// returns false, the default, and never calls `wake`. A later call replaces the waker.
    /// `wake` must be cheap and must not call back into the agent.
    fn wake_on_notification(&self, wake: NotificationWaker) -> bool {
        let _ = wake;
        false
    }

    /// Drives the transport once without blocking: moves transfers in flight along (released ones
    /// included) and serves peers that read or write this agent's memory. Backends that progress
    /// on their own do nothing. A target that only serves memory calls this (or
    /// `drain_notifications`) regularly.
    fn progress(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_list_numbers_descriptors_region_major() {
        let l = BlockList {
            kind: MemKind::Dram,
            device: 0,
            bases: vec![1000, 5000],
            num_blocks: 4,
            block_len: 10,
        };
        assert_eq!(l.len(), 8);
        assert_eq!(l.desc(0).unwrap().addr, 1000);
        assert_eq!(l.desc(3).unwrap().addr, 1030);
        assert_eq!(l.desc(4).unwrap().addr, 5000);
        assert_eq!(l.desc(7).unwrap(), MemRegion::dram(5030, 10));
        assert_eq!(l.desc(8), None);
        let regions: Vec<_> = l.regions().collect();
        assert_eq!(regions, vec![Some(MemRegion::dram(1000, 40)), Some(MemRegion::dram(5000, 40))]);
    }

    /// The region check refuses a kind the agent cannot register, saying which it can, and an
    /// empty or wrapping region; each error names the backend.
    #[test]
    fn registration_check_names_the_kinds_the_agent_registers() {
        let caps = Capabilities {
            backend: "host-only",
            dram: true,
            vram: false,
            read: true,
            write: true,
            notifications: true,
        };
        let gpu = MemRegion { kind: MemKind::Vram, ..MemRegion::dram(4096, 64) };
        let e = caps.check_registration(&gpu).unwrap_err();
        assert_eq!((e.kind(), e.backend()), (ErrorKind::Unsupported, Some("host-only")));
        assert!(e.message().ends_with("this agent registers host memory only"), "{e}");
        let e =
            Capabilities { dram: false, vram: true, ..caps }.check_registration(&MemRegion::dram(4096, 64));
        assert!(e.unwrap_err().message().ends_with("GPU memory only"));
        for bad in [MemRegion::dram(4096, 0), MemRegion::dram(u64::MAX - 5, 64)] {
            let e = caps.check_registration(&bad).unwrap_err();
            assert_eq!((e.kind(), e.backend()), (ErrorKind::InvalidArgument, Some("host-only")), "{bad:?}");
        }
        assert!(caps.check_registration(&MemRegion::dram(4096, 64)).is_ok());
    }

    #[test]
    fn block_list_rejects_overflow() {
        let l = BlockList {
            kind: MemKind::Dram,
            device: 0,
            bases: vec![u64::MAX - 5],
            num_blocks: 2,
            block_len: 4,
        };
        assert_eq!(l.desc(1), None);
        assert_eq!(l.regions().next(), Some(None));
        let empty = BlockList { num_blocks: 0, ..l };
        assert!(empty.is_empty());
        assert_eq!(empty.desc(0), None);
    }
}
