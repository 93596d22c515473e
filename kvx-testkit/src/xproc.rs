//! A READ target in another process, for any [`TransferAgent`] backend.
//!
//! A test or bench binary re-executes itself ([`Target::spawn`], or [`Target::start`] for another
//! [`Shape`]) with [`TARGET_ENV`] set to a backend-defined *spec* string. In the child,
//! [`run_target_if_child`] (or [`serve_if_child`]; called first thing) builds the target agent and
//! its KV memory through the backend's closure, fills the memory with a known pattern
//! ([`Shape::fill_target`]), registers it, prints its base address and hex metadata on stdout,
//! and serves until the reader's [`DONE`] notification arrives. In the parent, a [`Reader`] loads
//! that metadata and posts the shape's scattered READs per round out of its target blocks
//! ([`READS`] of [`BLOCK_LEN`] out of [`TARGET_BLOCKS`] by default), then checks every byte.
//!
//! Every wait is bounded: lines from the child, transfers, the target's service loop and the
//! child's exit. The functions of the default shape panic with a message on failure, like
//! `assert!`; those that take a [`Shape`] return errors.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{
    AgentName, BlockList, DlistId, DlistOwner, Error, ErrorKind, HostMemory, KvMemory, MemKind, Result,
    TransferAgent, XferId, XferOp, XferState,
};

use crate::child::SelfChild;

/// Length of every block of the default shape.
pub const BLOCK_LEN: usize = 64 << 10;
/// Blocks the target exports in the default shape; each round reads [`READS`] of them, scattered.
pub const TARGET_BLOCKS: usize = 2000;
/// READs per round in the default shape, into as many local slots.
pub const READS: usize = 1000;
/// Set in the child's environment to the backend's spec string: the child is a target.
pub const TARGET_ENV: &str = "KVX_XPROC_TARGET";
/// Set in the child's environment to the [`Shape`] it serves, when not the default.
pub const SHAPE_ENV: &str = "KVX_XPROC_SHAPE";
/// The notification that ends the target's service loop.
pub const DONE: &[u8] = b"kvx-xproc-done";
/// Bound on each wait for a line from the target or its exit, and on the target's wait for the
/// next notification.
pub const PROCESS_DEADLINE: Duration = Duration::from_secs(120);
/// Bound on one round of READs.
pub const TRANSFER_DEADLINE: Duration = Duration::from_secs(60);

const BASE_LINE: &str = "KVX-XPROC-BASE ";
const META_LINE: &str = "KVX-XPROC-META ";
const DONE_LINE: &str = "KVX-XPROC-DONE ";

/// The sizes of a two-process READ: `reads` scattered blocks of `block_len` bytes out of the
/// target's `target_blocks`, into `reads` local slots, per round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Bytes per block, a non-zero multiple of 8.
    pub block_len: usize,
    /// Blocks the target exports.
    pub target_blocks: usize,
    /// READs per round, at most `target_blocks`.
    pub reads: usize,
}

impl Shape {
    /// [`READS`] blocks of [`BLOCK_LEN`] out of [`TARGET_BLOCKS`].
    pub const DEFAULT: Shape = Shape { block_len: BLOCK_LEN, target_blocks: TARGET_BLOCKS, reads: READS };

    /// A shape, checked: a non-zero multiple of 8 bytes per block, `0 < reads <= target_blocks`,
    /// block ids that fit a `u32` and memory sizes that fit a `usize`.
    pub fn new(block_len: usize, target_blocks: usize, reads: usize) -> Result<Shape> {
        if block_len == 0 || block_len % 8 != 0 {
            return Err(Error::invalid_argument(format!(
                "block length {block_len} is not a non-zero multiple of 8"
            )));
        }
        if reads == 0 || reads > target_blocks || u32::try_from(target_blocks).is_err() {
            return Err(Error::invalid_argument(format!(
                "need 0 < reads ({reads}) <= target blocks ({target_blocks}) < 2^32"
            )));
        }
        if block_len.checked_mul(target_blocks).is_none() {
            return Err(Error::invalid_argument("the target's memory would not fit in a usize"));
        }
        Ok(Shape { block_len, target_blocks, reads })
    }

    /// Bytes of the target's memory.
    pub fn target_len(&self) -> usize {
        self.block_len * self.target_blocks
    }

    /// Bytes moved per round (and of the reader's local slots).
    pub fn read_len(&self) -> usize {
        self.block_len * self.reads
    }

    /// The target block read into slot [`local_slot`](Self::local_slot)`(i)` in round `round`:
    /// scattered, distinct within a round (the stride is coprime with the target's blocks), and
    /// different from round to round.
    pub fn remote_block(&self, i: usize, round: usize) -> usize {
        let n = self.target_blocks;
        (i * coprime_from(7919, n) + round * 101) % n
    }

    /// The local slot of read `i`: a permutation of `0..reads`.
    pub fn local_slot(&self, i: usize) -> usize {
        (i * coprime_from(7, self.reads) + 3) % self.reads
    }

    /// The bytes of target block `b`.
    pub fn block_bytes(&self, b: usize) -> Vec<u8> {
        (0..self.block_len / 8).flat_map(|w| word(b, w).to_le_bytes()).collect()
    }

    /// Writes the target's pattern, block by block, through `write(offset, bytes)` (the target
    /// memory's own host copy).
    pub fn fill_target(&self, mut write: impl FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
        (0..self.target_blocks).try_for_each(|b| write(b * self.block_len, &self.block_bytes(b)))
    }

    /// Times of `rounds` single-thread memcpys of the same scattered blocks the READs move,
    /// between two buffers of this process (one untimed warm-up round first): the baseline the
    /// benches compare against.
    pub fn memcpy_rounds(&self, rounds: usize) -> Result<Vec<Duration>> {
        let mut memcpy = Memcpy::new(*self)?;
        Ok((0..=rounds).map(|round| memcpy.round(round)).skip(1).collect())
    }

    /// Checks that `slots` (the reader's local slots) hold round `round`'s blocks; the error names
    /// the first read whose block differs.
    pub fn check_round(
        &self,
        round: usize,
        mut slot: impl FnMut(usize, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let mut block = vec![0u8; self.block_len];
        for i in 0..self.reads {
            slot(self.local_slot(i), &mut block)?;
            let b = self.remote_block(i, round);
            if block != self.block_bytes(b) {
                let w = (0..self.block_len / 8)
                    .find(|&w| block[w * 8..w * 8 + 8] != word(b, w).to_le_bytes())
                    .unwrap_or(0);
                return Err(Error::new(
                    ErrorKind::Transfer,
                    format!("round {round}: read {i} (remote block {b}) differs at word {w}"),
                ));
            }
        }
        Ok(())
    }

    /// The value of [`SHAPE_ENV`] for this shape.
    pub fn to_env(&self) -> String {
        format!("{} {} {}", self.block_len, self.target_blocks, self.reads)
    }

    /// The shape a child was started with: [`SHAPE_ENV`], or the default without it.
    pub fn from_env() -> Result<Shape> {
        let Ok(text) = std::env::var(SHAPE_ENV) else { return Ok(Shape::DEFAULT) };
        let n: Vec<usize> = text.split(' ').filter_map(|n| n.parse().ok()).collect();
        match n[..] {
            [block_len, target_blocks, reads] => Shape::new(block_len, target_blocks, reads),
            _ => Err(Error::invalid_argument(format!("{SHAPE_ENV}={text:?}: expected three numbers"))),
        }
    }
}

/// Single-thread memcpy of a [`Shape`]'s scattered blocks between two buffers of this process,
/// one round at a time (so that a bench can interleave it with its READs). The buffers are
/// [`HostMemory`], as the READs' are, so that both sides run on the same kind of pages.
#[derive(Debug)]
pub struct Memcpy {
    shape: Shape,
    src: HostMemory,
    dst: HostMemory,
}

impl Memcpy {
    /// The source filled with the target's pattern, and the destination slots.
    pub fn new(shape: Shape) -> Result<Memcpy> {
        let src = HostMemory::new(shape.target_len())?;
        shape.fill_target(|offset, bytes| src.write(offset, bytes))?;
        Ok(Memcpy { shape, src, dst: HostMemory::new(shape.read_len())? })
    }

    /// Copies round `round`'s blocks into their slots; returns the time the copies took.
    pub fn round(&mut self, round: usize) -> Duration {
        let (shape, bl) = (self.shape, self.shape.block_len);
        let (src, dst) = (self.src.as_mut_slice(), self.dst.as_mut_slice());
        dst.fill(0);
        let start = Instant::now();
        for i in 0..shape.reads {
            let (s, d) = (shape.remote_block(i, round) * bl, shape.local_slot(i) * bl);
            dst[d..d + bl].copy_from_slice(&src[s..s + bl]);
        }
        let elapsed = start.elapsed();
        std::hint::black_box(dst);
        elapsed
    }
}

/// The smallest number from `start` on that is coprime with `n`.
fn coprime_from(start: usize, n: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    (start..).find(|&s| gcd(s, n) == 1).unwrap_or(1)
}

/// Word `w` of target block `b`: position-dependent, so a shifted or misplaced block never matches.
pub fn word(b: usize, w: usize) -> u64 {
    ((b as u64) << 32 | w as u64) ^ 0x5a5a_0000_a5a5
}

/// The bytes of target block `b` of the default shape.
pub fn block_bytes(b: usize) -> Vec<u8> {
    Shape::DEFAULT.block_bytes(b)
}

/// [`Shape::remote_block`] of the default shape.
pub fn remote_block(i: usize, round: usize) -> usize {
    Shape::DEFAULT.remote_block(i, round)
}

/// [`Shape::local_slot`] of the default shape.
pub fn local_slot(i: usize) -> usize {
    Shape::DEFAULT.local_slot(i)
}

/// [`Shape::fill_target`] of the default shape.
pub fn fill_target(write: impl FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
    Shape::DEFAULT.fill_target(write)
}

/// [`Shape::memcpy_rounds`] of the default shape.
pub fn memcpy_rounds(rounds: usize) -> Result<Vec<Duration>> {
    Shape::DEFAULT.memcpy_rounds(rounds)
}

/// How the target waits between drains of its notifications.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idle {
    /// `yield_now`: the target polls hot (drains are what progress the backend).
    Yield,
    /// A bounded park, so that the target's polling does not compete with the reader for the
    /// CPUs (the backend needs no help from the drains, e.g. it has a progress thread or the READs
    /// are truly one-sided).
    Park(Duration),
}

/// What the backend's closure hands [`run_target_if_child`]: the target agent, its KV memory
/// already filled by [`Shape::fill_target`], and how to wait between drains.
#[derive(Debug)]
pub struct TargetSetup<A> {
    /// The target's agent.
    pub agent: A,
    /// The shape's target blocks holding the pattern; registered by the harness.
    pub memory: Arc<dyn KvMemory>,
    /// How the service loop waits between drains.
    pub idle: Idle,
}

/// If this process is a target child of the default shape (started by [`Target::spawn`]), runs
/// the target and returns true: the caller then returns. Otherwise returns false at once. Panics
/// if the target fails.
///
/// `setup` receives the spec string passed to [`Target::spawn`].
pub fn run_target_if_child<A: TransferAgent>(setup: impl FnOnce(&str) -> TargetSetup<A>) -> bool {
    match serve_if_child(|spec, _| Ok(setup(spec))) {
        None => false,
        Some(outcome) => {
            ok(outcome, "target");
            true
        }
    }
}

/// If this process is a target child (started by [`Target::start`]), runs the target and returns
/// how that went; otherwise returns `None` at once.
///
/// `setup` receives the spec string and the [`Shape`] passed to [`Target::start`]. The target
/// registers the memory, announces it on stdout and drains notifications until [`DONE`] arrives,
/// at most [`PROCESS_DEADLINE`] after the previous notification; every notification must come
/// from the agent that sent `DONE`.
pub fn serve_if_child<A: TransferAgent>(
    setup: impl FnOnce(&str, Shape) -> Result<TargetSetup<A>>,
) -> Option<Result<()>> {
    let spec = std::env::var(TARGET_ENV).ok()?;
    Some(Shape::from_env().and_then(|shape| serve(setup(&spec, shape)?, shape)))
}

fn serve<A: TransferAgent>(setup: TargetSetup<A>, shape: Shape) -> Result<()> {
    let TargetSetup { agent, memory, idle } = setup;
    let region = memory.region();
    let expected = shape.target_len() as u64;
    if region.len < expected {
        return Err(Error::invalid_argument(format!(
            "target memory holds {} bytes, needs {expected}",
            region.len
        )));
    }
    agent.register(memory)?;
    let metadata = agent.local_metadata()?;
    say(&format!("{BASE_LINE}{}\n{META_LINE}{}", region.addr, hex(&metadata)))?;

    let mut deadline = Instant::now() + PROCESS_DEADLINE;
    let mut notes = Vec::new();
    let mut senders = Vec::new();
    loop {
        agent.drain_notifications(&mut notes)?;
        for n in notes.drain(..) {
            deadline = Instant::now() + PROCESS_DEADLINE;
            if n.msg == DONE {
                if let Some(other) = senders.iter().find(|s| **s != n.from) {
                    return Err(Error::invalid_peer_data(format!(
                        "notifications from {other} and from {}",
                        n.from
                    )));
                }
                let received = senders.len() + 1;
                return say(&format!("{DONE_LINE}{received} {}", n.from));
            }
            senders.push(n.from);
        }
        if Instant::now() > deadline {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("no notification within {PROCESS_DEADLINE:?}"),
            ));
        }
        match idle {
            Idle::Yield => std::thread::yield_now(),
            Idle::Park(pause) => std::thread::park_timeout(pause),
        }
    }
}

/// A running target process, as the reader sees it; killed on drop if still running.
#[derive(Debug)]
pub struct Target {
    child: SelfChild,
    /// The target agent's metadata, for [`TransferAgent::load_remote`].
    pub metadata: Vec<u8>,
    /// Address of the target's memory: the shape's target blocks.
    pub base: u64,
}

impl Target {
    /// Starts this executable again as a target of the default shape: `args` select the entry
    /// point (a libtest test that calls [`run_target_if_child`], or none for a bench's `main`),
    /// `spec` goes to the backend's setup closure. Returns once the target has announced its
    /// memory.
    pub fn spawn(args: &[&str], spec: &str) -> Target {
        ok(Target::start(args, spec, Shape::DEFAULT), "target")
    }

    /// The CPU time the target process has used so far (all its threads).
    pub fn cpu_time(&self) -> Result<Duration> {
        self.child.cpu_time()
    }

    /// [`spawn`](Self::spawn) for a target of `shape` (the child calls [`serve_if_child`]).
    pub fn start(args: &[&str], spec: &str, shape: Shape) -> Result<Target> {
        let mut child = SelfChild::spawn_peer(args, &[(TARGET_ENV, spec), (SHAPE_ENV, &shape.to_env())])?;
        let base = child.wait_line(BASE_LINE, PROCESS_DEADLINE)?;
        let base =
            base.parse().map_err(|e| Error::invalid_peer_data(format!("target base {base:?}: {e}")))?;
        let metadata = unhex(&child.wait_line(META_LINE, PROCESS_DEADLINE)?)?;
        Ok(Target { child, metadata, base })
    }

    /// Waits (bounded) for the target to report [`DONE`] from `reader` and to exit successfully;
    /// returns how many notifications the target received, `DONE` included. Panics on failure.
    pub fn finish(self, reader: &str) -> usize {
        ok(self.wait_done(reader), "target")
    }

    /// [`finish`](Self::finish), returning failures as errors.
    pub fn wait_done(mut self, reader: &str) -> Result<usize> {
        let done = self.child.wait_line(DONE_LINE, PROCESS_DEADLINE)?;
        let bad = || Error::invalid_peer_data(format!("the target's done line {done:?}"));
        let (count, from) = done.split_once(' ').ok_or_else(bad)?;
        if from != reader {
            return Err(Error::invalid_peer_data(format!(
                "the target's notifications came from {from}, not {reader}"
            )));
        }
        let count = count.parse().map_err(|_| bad())?;
        self.child.wait_success(PROCESS_DEADLINE)?;
        Ok(count)
    }
}

/// The reading side: its agent, the shape's local slots registered, and descriptor lists over
/// both memories.
#[derive(Debug)]
pub struct Reader<A> {
    /// The reader's agent.
    pub agent: A,
    shape: Shape,
    local: Arc<HostMemory>,
    peer: AgentName,
    local_list: DlistId,
    remote_list: DlistId,
}

impl<A: TransferAgent> Reader<A> {
    /// Registers the local slots, loads the target's `metadata` and prepares the lists (the
    /// target's memory starts at `base`), for the default shape. Panics on failure.
    pub fn new(agent: A, metadata: &[u8], base: u64) -> Self {
        ok(Reader::open(agent, metadata, base, Shape::DEFAULT), "reader")
    }

    /// [`new`](Self::new) for a target of `shape`, returning failures as errors.
    pub fn open(agent: A, metadata: &[u8], base: u64, shape: Shape) -> Result<Self> {
        let local = Arc::new(HostMemory::new(shape.read_len())?);
        agent.register(local.clone())?;
        let peer = agent.load_remote(metadata)?;
        let list = |base, n: usize| BlockList {
            kind: MemKind::Dram,
            device: 0,
            bases: vec![base],
            // Shape::new keeps block counts within a u32.
            num_blocks: n as u32,
            block_len: shape.block_len as u64,
        };
        let local_list = agent.prep_dlist(&DlistOwner::Local, &list(local.region().addr, shape.reads))?;
        let remote_list =
            agent.prep_dlist(&DlistOwner::Remote(peer.clone()), &list(base, shape.target_blocks))?;
        Ok(Reader { agent, shape, local, peer, local_list, remote_list })
    }

    /// The shape it reads.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The target agent's name.
    pub fn peer(&self) -> &AgentName {
        &self.peer
    }

    /// Posts the round's scattered READs as one transfer (with `notify` attached) and polls until
    /// done; returns the time from post to done.
    pub fn read_round(&self, round: usize, notify: Option<&[u8]>) -> Duration {
        self.read_round_with(round, notify, &|| {})
    }

    /// [`read_round`](Self::read_round), calling `service` between polls (e.g. to progress a
    /// target agent in this same process).
    pub fn read_round_with(&self, round: usize, notify: Option<&[u8]>, service: &dyn Fn()) -> Duration {
        ok(
            self.try_read_round(round, notify, &mut |_| {
                service();
                Ok(())
            }),
            "reader",
        )
    }

    /// [`read_round_with`](Self::read_round_with), returning failures (of the READ or of
    /// `service`) as errors. `service` is handed the pending transfer (so that it can wait on it,
    /// for an agent whose own threads move it).
    pub fn try_read_round(
        &self,
        round: usize,
        notify: Option<&[u8]>,
        service: &mut dyn FnMut(XferId) -> Result<()>,
    ) -> Result<Duration> {
        let shape = &self.shape;
        let local: Vec<u32> = (0..shape.reads).map(|i| shape.local_slot(i) as u32).collect();
        let remote: Vec<u32> = (0..shape.reads).map(|i| shape.remote_block(i, round) as u32).collect();
        let start = Instant::now();
        let x = self.agent.post(XferOp::Read, self.local_list, &local, self.remote_list, &remote, notify)?;
        self.wait(x, service)?;
        let elapsed = start.elapsed();
        self.agent.release(x)?;
        Ok(elapsed)
    }

    /// READs every block of the target once, a slot-full at a time, without a notification:
    /// the warm-up that leaves the reader's view of the target as a memcpy's source is (every
    /// page touched once), so that timed rounds do not pay first touches a memcpy does not.
    pub fn touch_target(&self, service: &mut dyn FnMut(XferId) -> Result<()>) -> Result<()> {
        let shape = &self.shape;
        for first in (0..shape.target_blocks).step_by(shape.reads) {
            let remote: Vec<u32> =
                (first..shape.target_blocks.min(first + shape.reads)).map(|b| b as u32).collect();
            let local: Vec<u32> = (0..remote.len() as u32).collect();
            let x =
                self.agent.post(XferOp::Read, self.local_list, &local, self.remote_list, &remote, None)?;
            self.wait(x, service)?;
            self.agent.release(x)?;
        }
        Ok(())
    }

    fn wait(&self, x: XferId, service: &mut dyn FnMut(XferId) -> Result<()>) -> Result<()> {
        let deadline = Instant::now() + TRANSFER_DEADLINE;
        loop {
            match self.agent.poll(x)? {
                XferState::Pending if Instant::now() > deadline => {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("READ still pending after {TRANSFER_DEADLINE:?}"),
                    ));
                }
                XferState::Pending => {}
                XferState::Done => return Ok(()),
                XferState::Failed(e) => return Err(e),
            }
            service(x)?;
        }
    }

    /// Checks every byte of the round's reads. Panics, like `assert!`, naming the first read
    /// whose block differs from the target's.
    pub fn verify(&self, round: usize) {
        ok(self.check(round), "reader");
    }

    /// [`verify`](Self::verify), returning a difference as an error.
    pub fn check(&self, round: usize) -> Result<()> {
        let bl = self.shape.block_len;
        self.shape.check_round(round, |slot, block| self.local.read(slot * bl, block))
    }

    /// Clears the local slots, so that a round cannot pass on stale data.
    pub fn clear(&self) {
        ok(self.local.fill(0, self.shape.read_len(), 0), "reader: clear");
    }

    /// Sends [`DONE`] to the target as a plain notification. Panics on failure.
    pub fn notify_done(&self) {
        ok(self.agent.notify(&self.peer, DONE), "reader: notify");
    }
}

/// Writes `text` and a newline to stdout at once, flushed (the reader waits for it).
fn say(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}")
        .and_then(|()| out.flush())
        .map_err(|e| Error::new(ErrorKind::Io, format!("writing stdout: {e}")))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    let byte = |i: usize| {
        s.get(i..i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .ok_or_else(|| Error::invalid_peer_data(format!("target metadata is not hex at {i}")))
    };
    (0..s.len()).step_by(2).map(byte).collect()
}

#[track_caller]
fn ok<T>(r: Result<T>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{what}: unexpected error: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_is_a_permutation_and_pattern_roundtrips() {
        let shapes = [Shape::DEFAULT, Shape { block_len: 16, target_blocks: 7919 * 2, reads: 14 }];
        for shape in shapes {
            for round in 0..3 {
                let mut remote: Vec<usize> = (0..shape.reads).map(|i| shape.remote_block(i, round)).collect();
                remote.sort_unstable();
                remote.dedup();
                assert_eq!(remote.len(), shape.reads, "{shape:?} round {round}: remote blocks repeat");
            }
            let mut local: Vec<usize> = (0..shape.reads).map(|i| shape.local_slot(i)).collect();
            local.sort_unstable();
            assert!(local.iter().copied().eq(0..shape.reads), "{shape:?}");
        }
        // The default shape's scatter is the one the functions without a shape always had.
        assert_eq!((remote_block(3, 2), local_slot(5)), ((3 * 7919 + 202) % 2000, 38));
        assert_eq!(unhex(&hex(&[0, 1, 0xab, 0xff])).ok(), Some(vec![0, 1, 0xab, 0xff]));
        assert_ne!(block_bytes(1), block_bytes(2));
    }

    #[test]
    fn shapes_are_checked_and_travel_through_the_environment_text() {
        assert!(Shape::new(12, 10, 5).is_err(), "not a multiple of 8");
        assert!(Shape::new(16, 10, 11).is_err(), "more reads than blocks");
        assert!(Shape::new(16, 10, 0).is_err(), "no reads");
        let shape = Shape::new(16 << 10, 64, 32).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(shape.to_env(), "16384 64 32");
        assert_eq!((shape.target_len(), shape.read_len()), (1 << 20, 1 << 19));
    }
}
