//! What the suite needs from a backend: [`Harness`], the memory it allocates ([`TestBuffer`]),
//! and the two ready-made harnesses [`Pair`] and [`Dyn`].

use std::sync::Arc;
use std::time::Duration;

use kvx_core::{ByteAccess, HostMemory, KvMemory, MemRegion, Result, TransferAgent};

/// Which agent of a [`Harness`] memory is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The agent that posts transfers.
    Initiator,
    /// The agent whose memory is read and written.
    Target,
}

/// Memory for the suite: what an agent registers, together with host access to its bytes.
#[derive(Debug, Clone)]
pub struct TestBuffer {
    memory: Arc<dyn KvMemory>,
    access: Arc<dyn ByteAccess>,
}

impl TestBuffer {
    /// Wraps memory that can be both registered and accessed from the host.
    pub fn new<M: KvMemory + ByteAccess + 'static>(memory: Arc<M>) -> Self {
        TestBuffer { memory: memory.clone(), access: memory }
    }

    /// `len` zeroed bytes of [`HostMemory`].
    pub fn host(len: usize) -> Result<Self> {
        Ok(Self::new(Arc::new(HostMemory::new(len)?)))
    }

    /// The memory, to pass to [`TransferAgent::register`].
    pub fn memory(&self) -> Arc<dyn KvMemory> {
        self.memory.clone()
    }

    /// The memory's region.
    pub fn region(&self) -> MemRegion {
        self.memory.region()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        usize::try_from(self.region().len).unwrap_or(usize::MAX)
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.access.write(offset, src)
    }

    /// Copies the bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.access.read(offset, dst)
    }

    /// Copies the whole buffer out.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// How many `Arc`s of the memory exist: this buffer's, its clones' and any agent's that
    /// registered it. A check compares it before registering and after deregistering.
    pub(crate) fn holders(&self) -> usize {
        Arc::strong_count(&self.memory)
    }
}

/// What the suite needs from a backend: two agents, memory they can register, and progress.
///
/// [`Pair`] is the harness for backends that register plain [`HostMemory`] and whose
/// [`TransferAgent::progress`] is all the driving they need.
pub trait Harness {
    /// The agents' type: a concrete agent, or `dyn TransferAgent`.
    type Agent: TransferAgent + ?Sized;

    /// The agent that posts transfers (the decode side of kvx).
    fn initiator(&self) -> &Self::Agent;

    /// The agent whose memory is read and written (the prefill side of kvx).
    fn target(&self) -> &Self::Agent;

    /// Allocates `len` bytes (`len > 0`) that `side`'s agent can register. Default: [`HostMemory`].
    fn alloc(&self, side: Side, len: usize) -> Result<TestBuffer> {
        let _ = side;
        TestBuffer::host(len)
    }

    /// Drives both agents once, without blocking. The suite calls it in every wait loop, so a
    /// backend whose target must be serviced while the initiator polls (UCX and NIXL with two
    /// agents in one process) gets that here. Default: `progress()` on the target, then on the
    /// initiator.
    fn progress(&self) -> Result<()> {
        self.target().progress()?;
        self.initiator().progress()
    }

    /// How long any single wait of the suite may take before the check fails. Default: 10 s.
    fn deadline(&self) -> Duration {
        Duration::from_secs(10)
    }

    /// Makes the next transfer the initiator posts fail in its transport after it is posted (an
    /// injected fault), where the backend can; returns whether it did. Default: it cannot, and
    /// the check that needs a failed transfer says it skips.
    fn fail_next_transfer(&self) -> Result<bool> {
        Ok(false)
    }
}

/// The plain harness: two agents, [`HostMemory`], and `progress()` on both.
#[derive(Debug)]
pub struct Pair<A: ?Sized> {
    initiator: Arc<A>,
    target: Arc<A>,
}

impl<A: ?Sized> Pair<A> {
    /// A harness over two distinct agents.
    pub fn new(initiator: Arc<A>, target: Arc<A>) -> Self {
        Pair { initiator, target }
    }
}

impl<A: TransferAgent + ?Sized> Harness for Pair<A> {
    type Agent = A;

    fn initiator(&self) -> &A {
        &self.initiator
    }

    fn target(&self) -> &A {
        &self.target
    }
}

/// Any harness with its agents seen as `dyn TransferAgent`: runs the suite through dynamic
/// dispatch while keeping the harness's memory, progress and fault injection.
#[derive(Debug)]
pub struct Dyn<H>(pub H);

impl<H: Harness> Harness for Dyn<H>
where
    H::Agent: Sized + 'static,
{
    type Agent = dyn TransferAgent;

    fn initiator(&self) -> &Self::Agent {
        self.0.initiator()
    }

    fn target(&self) -> &Self::Agent {
        self.0.target()
    }

    fn alloc(&self, side: Side, len: usize) -> Result<TestBuffer> {
        self.0.alloc(side, len)
    }

    fn progress(&self) -> Result<()> {
        self.0.progress()
    }

    fn deadline(&self) -> Duration {
        self.0.deadline()
    }

    fn fail_next_transfer(&self) -> Result<bool> {
        self.0.fail_next_transfer()
    }
}
