//! The fixture most checks start from: two regions of blocks on each side, registered, the target
//! loaded by the initiator, one list per side, and the bytes every buffer must hold. Undone on
//! drop, also when a check panics.

use kvx_core::{
    AgentName, BlockList, BlockPost, DlistId, DlistOwner, MemRegion, RegionBlocks, RegistrationId, Result,
    TransferAgent, XferId, XferOp,
};

use super::harness::{Harness, Side, TestBuffer};
use super::support::{SplitMix, ok};

/// Bytes before and after the blocks of each region buffer: lists need not start at a
/// registration's start, and a transfer that overruns a block shows up here.
pub(crate) const PAD: usize = 128;

/// How the fixture's buffers are cut into blocks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) regions: usize,
    pub(crate) num_blocks: u32,
    pub(crate) block_len: u64,
    /// All regions back to back in one buffer per side (one registration), not one buffer each.
    pub(crate) joined: bool,
}

impl Shape {
    pub(crate) const DEFAULT: Shape = Shape { regions: 2, num_blocks: 64, block_len: 4096, joined: false };

    /// Buffers per side.
    fn buffers(&self) -> usize {
        if self.joined { 1 } else { self.regions }
    }

    fn region_len(&self) -> usize {
        self.num_blocks as usize * self.block_len as usize
    }

    /// Descriptors per list.
    pub(crate) fn len(&self) -> u32 {
        // The default shape's 128 descriptors fit; the conversion cannot saturate.
        u32::try_from(self.regions).unwrap_or(u32::MAX).saturating_mul(self.num_blocks)
    }

    fn buffer_len(&self) -> usize {
        PAD * 2 + self.region_len() * (self.regions / self.buffers())
    }

    /// The list over `bufs`: one region per buffer, or every region in the one buffer.
    pub(crate) fn list(&self, bufs: &[TestBuffer]) -> BlockList {
        let first = bufs.first().map(|b| b.region()).unwrap_or(MemRegion::dram(0, 0));
        let bases = if self.joined {
            (0..self.regions).map(|r| first.addr + (PAD + r * self.region_len()) as u64).collect()
        } else {
            bufs.iter().map(|b| b.region().addr + PAD as u64).collect()
        };
        BlockList {
            kind: first.kind,
            device: first.device,
            bases,
            num_blocks: self.num_blocks,
            block_len: self.block_len,
        }
    }

    /// (buffer, byte offset) of descriptor `index`.
    pub(crate) fn locate(&self, index: u32) -> (usize, usize) {
        let region = (index / self.num_blocks) as usize;
        let block = (index % self.num_blocks) as usize;
        if self.joined {
            (0, PAD + region * self.region_len() + block * self.block_len as usize)
        } else {
            (region, PAD + block * self.block_len as usize)
        }
    }
}

/// Registrations, a loaded remote and lists, undone on drop (also when a check panics).
pub(crate) struct Fixture<'h, H: Harness + ?Sized> {
    pub(crate) h: &'h H,
    pub(crate) shape: Shape,
    pub(crate) local: Vec<TestBuffer>,
    pub(crate) remote: Vec<TestBuffer>,
    /// How many holders each local buffer's memory had before it was registered.
    local_unregistered: Vec<usize>,
    pub(crate) local_regs: Vec<RegistrationId>,
    pub(crate) remote_regs: Vec<RegistrationId>,
    /// What the suite expects each buffer to hold.
    local_image: Vec<Vec<u8>>,
    remote_image: Vec<Vec<u8>>,
    pub(crate) target_name: AgentName,
    pub(crate) loaded: bool,
    pub(crate) local_dlist: Option<DlistId>,
    pub(crate) remote_dlist: Option<DlistId>,
    rng: SplitMix,
}

impl<'h, H: Harness + ?Sized> Fixture<'h, H> {
    pub(crate) fn new(h: &'h H, seed: u64) -> Self {
        Self::with_shape(h, seed, Shape::DEFAULT)
    }

    pub(crate) fn with_shape(h: &'h H, seed: u64, shape: Shape) -> Self {
        let (ini, tgt) = (h.initiator(), h.target());
        // Leftovers of an earlier failed check must not be taken for this check's notifications.
        let mut stale = Vec::new();
        let _ = tgt.drain_notifications(&mut stale);
        let _ = ini.drain_notifications(&mut stale);

        let mut f = Fixture {
            h,
            shape,
            local: Vec::new(),
            remote: Vec::new(),
            local_unregistered: Vec::new(),
            local_regs: Vec::new(),
            remote_regs: Vec::new(),
            local_image: Vec::new(),
            remote_image: Vec::new(),
            target_name: tgt.name().clone(),
            loaded: false,
            local_dlist: None,
            remote_dlist: None,
            rng: SplitMix(seed),
        };
        for side in [Side::Initiator, Side::Target] {
            for _ in 0..shape.buffers() {
                let buf = ok(h.alloc(side, shape.buffer_len()), "alloc");
                let mut image = vec![0u8; buf.len()];
                f.rng.fill(&mut image);
                ok(buf.write(0, &image), "filling test memory");
                let holders = buf.holders();
                let agent = if side == Side::Initiator { ini } else { tgt };
                let reg = ok(agent.register(buf.memory()), "register");
                match side {
                    Side::Initiator => {
                        f.local.push(buf);
                        f.local_unregistered.push(holders);
                        f.local_regs.push(reg);
                        f.local_image.push(image);
                    }
                    Side::Target => {
                        f.remote.push(buf);
                        f.remote_regs.push(reg);
                        f.remote_image.push(image);
                    }
                }
            }
        }
        f.load_target();
        f.local_dlist =
            Some(ok(ini.prep_dlist(&DlistOwner::Local, &shape.list(&f.local)), "prep local list"));
        f
    }

    /// Loads the target's current metadata and prepares the remote list over its buffers.
    pub(crate) fn load_target(&mut self) {
        let (ini, tgt) = (self.h.initiator(), self.h.target());
        let md = ok(tgt.local_metadata(), "local_metadata");
        let name = ok(ini.load_remote(&md), "load_remote");
        self.loaded = true;
        assert_eq!(&name, tgt.name(), "load_remote returned another name than the peer's");
        let owner = DlistOwner::Remote(name);
        let list = self.shape.list(&self.remote);
        self.remote_dlist = Some(ok(ini.prep_dlist(&owner, &list), "prep remote list"));
    }

    /// Forgets the target; returns the remote list that forgetting released.
    pub(crate) fn forget_target(&mut self) -> Option<DlistId> {
        ok(self.h.initiator().forget_remote(&self.target_name), "forget_remote");
        self.loaded = false;
        self.remote_dlist.take()
    }

    /// Deregisters the initiator's buffers; returns the local list that deregistering released.
    pub(crate) fn deregister_local(&mut self) -> Option<DlistId> {
        for reg in self.local_regs.drain(..) {
            ok(self.h.initiator().deregister(reg), "deregister");
        }
        self.local_dlist.take()
    }

    /// Whether no agent holds the initiator's buffers any more (as before they were registered).
    pub(crate) fn local_released(&self) -> bool {
        self.local.iter().zip(&self.local_unregistered).all(|(buf, &before)| buf.holders() == before)
    }

    /// `n` (local, remote) descriptor pairs, each side's indices distinct and randomly scattered.
    pub(crate) fn random_pairs(&mut self, n: usize) -> Vec<(u32, u32)> {
        let l = self.rng.distinct(self.shape.len(), n);
        let r = self.rng.distinct(self.shape.len(), n);
        l.into_iter().zip(r).collect()
    }

    /// `n` distinct random block ids of a region (of either side).
    pub(crate) fn random_blocks(&mut self, n: usize) -> Vec<u32> {
        self.rng.distinct(self.shape.num_blocks, n)
    }

    pub(crate) fn post(&self, op: XferOp, pairs: &[(u32, u32)], notify: Option<&[u8]>) -> Result<XferId> {
        let (l, r): (Vec<u32>, Vec<u32>) = pairs.iter().copied().unzip();
        self.post_indices(op, &l, &r, notify)
    }

    pub(crate) fn post_indices(
        &self,
        op: XferOp,
        l: &[u32],
        r: &[u32],
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        let (local, remote) = self.lists();
        self.h.initiator().post(op, local, l, remote, r, notify)
    }

    /// A block post over every region of both lists.
    pub(crate) fn block_post<'a>(
        &self,
        local: &'a [u32],
        remote: &'a [u32],
        regions: RegionBlocks<'a>,
    ) -> BlockPost<'a> {
        let num_blocks = self.shape.num_blocks;
        BlockPost {
            local_blocks: local,
            local_num_blocks: num_blocks,
            remote_blocks: remote,
            remote_num_blocks: num_blocks,
            regions,
        }
    }

    pub(crate) fn post_blocks(
        &self,
        op: XferOp,
        blocks: &BlockPost<'_>,
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        let (local, remote) = self.lists();
        self.h.initiator().post_blocks(op, local, remote, blocks, notify)
    }

    /// Updates the expected images as a block post does to the memory.
    pub(crate) fn apply_blocks(&mut self, op: XferOp, blocks: &BlockPost<'_>) {
        let (mut l, mut r) = (Vec::new(), Vec::new());
        ok(blocks.descriptor_indices(&mut l, &mut r), "numbering the descriptors of a block post");
        let pairs: Vec<(u32, u32)> = l.into_iter().zip(r).collect();
        self.apply(op, &pairs);
    }

    /// The local and remote list (ids that no agent uses when they were released).
    pub(crate) fn lists(&self) -> (DlistId, DlistId) {
        let unknown = DlistId(u64::MAX);
        (self.local_dlist.unwrap_or(unknown), self.remote_dlist.unwrap_or(unknown))
    }

    /// Updates the expected images as the transfer of `pairs` does to the memory.
    pub(crate) fn apply(&mut self, op: XferOp, pairs: &[(u32, u32)]) {
        let len = self.shape.block_len as usize;
        for &(l, r) in pairs {
            let (lb, lo) = self.shape.locate(l);
            let (rb, ro) = self.shape.locate(r);
            match op {
                XferOp::Read => {
                    let block = self.remote_image[rb][ro..ro + len].to_vec();
                    self.local_image[lb][lo..lo + len].copy_from_slice(&block);
                }
                XferOp::Write => {
                    let block = self.local_image[lb][lo..lo + len].to_vec();
                    self.remote_image[rb][ro..ro + len].copy_from_slice(&block);
                }
            }
        }
    }

    /// Checks every byte of every buffer of both sides against the expected images.
    pub(crate) fn verify(&self, when: &str) {
        for (side, bufs, images) in
            [("initiator", &self.local, &self.local_image), ("target", &self.remote, &self.remote_image)]
        {
            for (i, (buf, image)) in bufs.iter().zip(images).enumerate() {
                let actual = ok(buf.to_vec(), "reading test memory");
                if let Some(at) = actual.iter().zip(image).position(|(a, e)| a != e) {
                    let block = at.checked_sub(PAD).map(|o| o / self.shape.block_len as usize);
                    panic!(
                        "{when}: {side} region {i} differs at byte {at} (block {block:?}): {} != expected {}",
                        actual[at], image[at]
                    );
                }
            }
        }
    }

    /// Drives progress a few rounds (so that anything wrongly posted would land), then verifies.
    pub(crate) fn settle_and_verify(&self, when: &str) {
        for _ in 0..20 {
            ok(self.h.progress(), "progress");
        }
        self.verify(when);
    }

    /// Takes every buffer as it is now for what it must hold: after a transfer that failed, whose
    /// destination blocks hold unspecified bytes.
    pub(crate) fn resync(&mut self) {
        for (bufs, images) in [(&self.local, &mut self.local_image), (&self.remote, &mut self.remote_image)] {
            for (buf, image) in bufs.iter().zip(images.iter_mut()) {
                *image = ok(buf.to_vec(), "reading test memory");
            }
        }
    }
}

impl<H: Harness + ?Sized> Drop for Fixture<'_, H> {
    fn drop(&mut self) {
        let (ini, tgt) = (self.h.initiator(), self.h.target());
        for dl in [self.local_dlist.take(), self.remote_dlist.take()].into_iter().flatten() {
            let _ = ini.release_dlist(dl);
        }
        if self.loaded {
            let _ = ini.forget_remote(&self.target_name);
        }
        for r in self.local_regs.drain(..) {
            let _ = ini.deregister(r);
        }
        for r in self.remote_regs.drain(..) {
            let _ = tgt.deregister(r);
        }
    }
}

/// One registration, deregistered on drop.
pub(crate) struct Registered<'a, A: TransferAgent + ?Sized> {
    agent: &'a A,
    id: RegistrationId,
}

impl<'a, A: TransferAgent + ?Sized> Registered<'a, A> {
    pub(crate) fn new(agent: &'a A, buf: &TestBuffer) -> Self {
        Registered { agent, id: ok(agent.register(buf.memory()), "register") }
    }
}

impl<A: TransferAgent + ?Sized> Drop for Registered<'_, A> {
    fn drop(&mut self) {
        let _ = self.agent.deregister(self.id);
    }
}

/// One loaded remote, forgotten on drop (whatever its state by then).
pub(crate) struct Loaded<'a, A: TransferAgent + ?Sized> {
    agent: &'a A,
    pub(crate) name: AgentName,
}

impl<'a, A: TransferAgent + ?Sized> Loaded<'a, A> {
    pub(crate) fn new(agent: &'a A, md: &[u8]) -> Self {
        Loaded { agent, name: ok(agent.load_remote(md), "load_remote") }
    }
}

impl<A: TransferAgent + ?Sized> Drop for Loaded<'_, A> {
    fn drop(&mut self) {
        let _ = self.agent.forget_remote(&self.name);
    }
}
