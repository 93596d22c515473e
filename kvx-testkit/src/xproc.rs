//! A READ target in another process, for any [`TransferAgent`] backend.
//!
//! A test or bench binary re-executes itself ([`Target::spawn`]) with [`TARGET_ENV`] set to a
//! backend-defined *spec* string. In the child, [`run_target_if_child`] (called first thing)
//! builds the target agent and its KV memory through the backend's closure, fills the memory with
//! a known pattern ([`fill_target`]), registers it, prints its base address and hex metadata on
//! stdout, and serves until the reader's [`DONE`] notification arrives. In the parent, a
//! [`Reader`] loads that metadata and posts [`READS`] scattered [`BLOCK_LEN`] READs per round out
//! of [`TARGET_BLOCKS`], then checks every byte.
//!
//! Every wait is bounded: lines from the child, transfers, the target's service loop and the
//! child's exit. Functions panic with a message on failure, like `assert!`.

use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use kvx_core::{
    AgentName, BlockList, DlistId, DlistOwner, HostMemory, KvMemory, MemKind, Result, TransferAgent, XferId,
    XferOp, XferState,
};

/// Length of every block.
pub const BLOCK_LEN: usize = 64 << 10;
/// Blocks the target exports; each round reads [`READS`] of them, scattered.
pub const TARGET_BLOCKS: usize = 2000;
/// READs per round, into as many local slots.
pub const READS: usize = 1000;
/// Set in the child's environment to the backend's spec string: the child is a target.
pub const TARGET_ENV: &str = "KVX_XPROC_TARGET";
/// The notification that ends the target's service loop.
pub const DONE: &[u8] = b"kvx-xproc-done";
/// Bound on the target's whole service loop, and on each wait for a line from it or its exit.
pub const PROCESS_DEADLINE: Duration = Duration::from_secs(120);
/// Bound on one round of READs.
pub const TRANSFER_DEADLINE: Duration = Duration::from_secs(60);

const BASE_LINE: &str = "KVX-XPROC-BASE ";
const META_LINE: &str = "KVX-XPROC-META ";
const DONE_LINE: &str = "KVX-XPROC-DONE ";

/// Word `w` of target block `b`: position-dependent, so a shifted or misplaced block never matches.
pub fn word(b: usize, w: usize) -> u64 {
    ((b as u64) << 32 | w as u64) ^ 0x5a5a_0000_a5a5
}

/// The bytes of target block `b`.
pub fn block_bytes(b: usize) -> Vec<u8> {
    (0..BLOCK_LEN / 8).flat_map(|w| word(b, w).to_le_bytes()).collect()
}

/// The target block read into slot [`local_slot`]`(i)` in round `round`: scattered, distinct
/// within a round (7919 is coprime with [`TARGET_BLOCKS`]), and different every round.
pub fn remote_block(i: usize, round: usize) -> usize {
    (i * 7919 + round * 101) % TARGET_BLOCKS
}

/// The local slot of read `i`: a permutation of `0..READS` (7 is coprime with [`READS`]).
pub fn local_slot(i: usize) -> usize {
    (i * 7 + 3) % READS
}

/// Writes the target's pattern, block by block, through `write(offset, bytes)` (the target
/// memory's own host copy).
pub fn fill_target(mut write: impl FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
    (0..TARGET_BLOCKS).try_for_each(|b| write(b * BLOCK_LEN, &block_bytes(b)))
}

/// Times of `rounds` single-thread memcpys of the same scattered blocks the READs move, between
/// two buffers of this process (one untimed warm-up round first): the baseline the benches
/// compare against.
pub fn memcpy_rounds(rounds: usize) -> Vec<Duration> {
    let src: Vec<u8> = (0..TARGET_BLOCKS).flat_map(block_bytes).collect();
    let mut dst = vec![0u8; READS * BLOCK_LEN];
    let mut times = Vec::new();
    for round in 0..=rounds {
        dst.fill(0);
        let start = Instant::now();
        for i in 0..READS {
            let (s, d) = (remote_block(i, round) * BLOCK_LEN, local_slot(i) * BLOCK_LEN);
            dst[d..d + BLOCK_LEN].copy_from_slice(&src[s..s + BLOCK_LEN]);
        }
        let elapsed = start.elapsed();
        std::hint::black_box(&dst);
        if round > 0 {
            times.push(elapsed);
        }
    }
    times
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
/// already filled by [`fill_target`], and how to wait between drains.
#[derive(Debug)]
pub struct TargetSetup<A> {
    /// The target's agent.
    pub agent: A,
    /// [`TARGET_BLOCKS`] × [`BLOCK_LEN`] bytes holding the pattern; registered by the harness.
    pub memory: Arc<dyn KvMemory>,
    /// How the service loop waits between drains.
    pub idle: Idle,
}

/// If this process is a target child (started by [`Target::spawn`]), runs the target and returns
/// true: the caller then returns. Otherwise returns false at once.
///
/// `setup` receives the spec string passed to [`Target::spawn`]. The target registers the
/// memory, announces it on stdout and drains notifications until [`DONE`] arrives (within
/// [`PROCESS_DEADLINE`]); every notification must come from the agent that sent `DONE`.
pub fn run_target_if_child<A: TransferAgent>(setup: impl FnOnce(&str) -> TargetSetup<A>) -> bool {
    let Ok(spec) = std::env::var(TARGET_ENV) else { return false };
    let TargetSetup { agent, memory, idle } = setup(&spec);
    let region = memory.region();
    let expected = (TARGET_BLOCKS * BLOCK_LEN) as u64;
    assert!(region.len >= expected, "target memory holds {} bytes, needs {expected}", region.len);
    ok(agent.register(memory), "target: register");
    let metadata = ok(agent.local_metadata(), "target: local_metadata");
    say(&format!("{BASE_LINE}{}\n{META_LINE}{}", region.addr, hex(&metadata)));

    let deadline = Instant::now() + PROCESS_DEADLINE;
    let mut notes = Vec::new();
    let mut senders = Vec::new();
    loop {
        ok(agent.drain_notifications(&mut notes), "target: drain_notifications");
        for n in notes.drain(..) {
            if n.msg == DONE {
                if let Some(other) = senders.iter().find(|s| **s != n.from) {
                    panic!("target: notifications from {other} and from {}", n.from);
                }
                let received = senders.len() + 1;
                say(&format!("{DONE_LINE}{received} {}", n.from));
                return true;
            }
            senders.push(n.from);
        }
        assert!(Instant::now() < deadline, "target: no {DONE:?} notification within {PROCESS_DEADLINE:?}");
        match idle {
            Idle::Yield => std::thread::yield_now(),
            Idle::Park(pause) => std::thread::park_timeout(pause),
        }
    }
}

/// A running target process, as the reader sees it; killed on drop if still running.
pub struct Target {
    child: Child,
    lines: Receiver<String>,
    /// The target agent's metadata, for [`TransferAgent::load_remote`].
    pub metadata: Vec<u8>,
    /// Address of the target's memory: [`TARGET_BLOCKS`] blocks of [`BLOCK_LEN`].
    pub base: u64,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("pid", &self.child.id())
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// Starts this executable again as a target: `args` select the entry point (a libtest test
    /// that calls [`run_target_if_child`], or none for a bench's `main`), `spec` goes to the
    /// backend's setup closure. Returns once the target has announced its memory.
    pub fn spawn(args: &[&str], spec: &str) -> Target {
        let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
        let mut child = Command::new(exe)
            .args(args)
            .env(TARGET_ENV, spec)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning the target process: {e}"));
        let Some(stdout) = child.stdout.take() else { panic!("target process without stdout") };
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut target = Target { child, lines, metadata: Vec::new(), base: 0 };
        let base = target.wait_line(BASE_LINE);
        target.base = base.parse().unwrap_or_else(|e| panic!("target base {base:?}: {e}"));
        target.metadata = unhex(&target.wait_line(META_LINE));
        target
    }

    /// The rest of the next stdout line that contains `prefix` (other lines are skipped; libtest
    /// may print its own text before ours on the same line), within [`PROCESS_DEADLINE`].
    fn wait_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + PROCESS_DEADLINE;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    if let Some(at) = line.find(prefix) {
                        return line[at + prefix.len()..].trim().to_owned();
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("target printed no {prefix:?} within {PROCESS_DEADLINE:?}")
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("target exited before printing {prefix:?}: {:?}", self.child.try_wait())
                }
            }
        }
    }

    /// Waits (bounded) for the target to report [`DONE`] from `reader` and to exit successfully;
    /// returns how many notifications the target received, `DONE` included.
    pub fn finish(mut self, reader: &str) -> usize {
        let done = self.wait_line(DONE_LINE);
        let (count, from) = done.split_once(' ').unwrap_or_else(|| panic!("target's done line {done:?}"));
        assert_eq!(from, reader, "the target's notifications came from {from}, not {reader}");
        let count = count.parse().unwrap_or_else(|e| panic!("target's done line {done:?}: {e}"));
        // Its stdout closes when it exits.
        let deadline = Instant::now() + PROCESS_DEADLINE;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(_) => {}
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => panic!("target still running after {PROCESS_DEADLINE:?}"),
            }
        }
        match crate::child::wait_within(&mut self.child, PROCESS_DEADLINE) {
            Some(status) => assert!(status.success(), "target process failed: {status}"),
            None => panic!("target closed its stdout but did not exit within {PROCESS_DEADLINE:?}"),
        }
        count
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // A failed test must not leave the child behind.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The reading side: its agent, [`READS`] local slots registered, and descriptor lists over both
/// memories.
#[derive(Debug)]
pub struct Reader<A> {
    /// The reader's agent.
    pub agent: A,
    local: Arc<HostMemory>,
    peer: AgentName,
    local_list: DlistId,
    remote_list: DlistId,
}

impl<A: TransferAgent> Reader<A> {
    /// Registers the local slots, loads the target's `metadata` and prepares the lists (the
    /// target's memory starts at `base`).
    pub fn new(agent: A, metadata: &[u8], base: u64) -> Self {
        let local = Arc::new(ok(HostMemory::new(READS * BLOCK_LEN), "reader: HostMemory::new"));
        ok(agent.register(local.clone()), "reader: register");
        let peer = ok(agent.load_remote(metadata), "reader: load_remote");
        let list = |base, n: usize| BlockList {
            kind: MemKind::Dram,
            device: 0,
            bases: vec![base],
            num_blocks: n as u32,
            block_len: BLOCK_LEN as u64,
        };
        let local_list =
            ok(agent.prep_dlist(&DlistOwner::Local, &list(local.region().addr, READS)), "reader: local list");
        let remote_list = ok(
            agent.prep_dlist(&DlistOwner::Remote(peer.clone()), &list(base, TARGET_BLOCKS)),
            "reader: remote list",
        );
        Reader { agent, local, peer, local_list, remote_list }
    }

    /// The target agent's name.
    pub fn peer(&self) -> &AgentName {
        &self.peer
    }

    /// Posts the round's [`READS`] scattered READs as one transfer (with `notify` attached) and
    /// polls until done; returns the time from post to done.
    pub fn read_round(&self, round: usize, notify: Option<&[u8]>) -> Duration {
        self.read_round_with(round, notify, &|| {})
    }

    /// [`read_round`](Self::read_round), calling `service` between polls (e.g. to progress a
    /// target agent in this same process).
    pub fn read_round_with(&self, round: usize, notify: Option<&[u8]>, service: &dyn Fn()) -> Duration {
        let local: Vec<u32> = (0..READS).map(|i| local_slot(i) as u32).collect();
        let remote: Vec<u32> = (0..READS).map(|i| remote_block(i, round) as u32).collect();
        let start = Instant::now();
        let x = ok(
            self.agent.post(XferOp::Read, self.local_list, &local, self.remote_list, &remote, notify),
            "reader: post",
        );
        self.wait(x, service);
        let elapsed = start.elapsed();
        ok(self.agent.release(x), "reader: release");
        elapsed
    }

    fn wait(&self, x: XferId, service: &dyn Fn()) {
        let deadline = Instant::now() + TRANSFER_DEADLINE;
        loop {
            match ok(self.agent.poll(x), "reader: poll") {
                XferState::Pending => {
                    assert!(Instant::now() < deadline, "READ still pending after {TRANSFER_DEADLINE:?}")
                }
                XferState::Done => return,
                XferState::Failed(e) => panic!("READ failed: {e}"),
            }
            service();
        }
    }

    /// Checks every byte of the round's reads. Panics, like `assert!`, naming the first read
    /// whose block differs from the target's.
    pub fn verify(&self, round: usize) {
        let mut block = vec![0u8; BLOCK_LEN];
        for i in 0..READS {
            ok(self.local.read(local_slot(i) * BLOCK_LEN, &mut block), "reader: read local slot");
            let b = remote_block(i, round);
            if block != block_bytes(b) {
                let w = (0..BLOCK_LEN / 8)
                    .find(|&w| block[w * 8..w * 8 + 8] != word(b, w).to_le_bytes())
                    .unwrap_or(0);
                panic!("round {round}: read {i} (remote block {b}) differs at word {w}");
            }
        }
    }

    /// Clears the local slots, so that a round cannot pass on stale data.
    pub fn clear(&self) {
        ok(self.local.fill(0, READS * BLOCK_LEN, 0), "reader: clear");
    }

    /// Sends [`DONE`] to the target as a plain notification.
    pub fn notify_done(&self) {
        ok(self.agent.notify(&self.peer, DONE), "reader: notify");
    }
}

/// Writes `text` and a newline to stdout at once, flushed (the reader waits for it).
fn say(text: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}")
        .and_then(|()| out.flush())
        .unwrap_or_else(|e| panic!("target: writing stdout: {e}"));
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    let byte = |i: usize| {
        s.get(i..i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .unwrap_or_else(|| panic!("target metadata is not hex at {i}"))
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
        for round in 0..3 {
            let mut remote: Vec<usize> = (0..READS).map(|i| remote_block(i, round)).collect();
            remote.sort_unstable();
            remote.dedup();
            assert_eq!(remote.len(), READS, "round {round}: remote blocks repeat");
        }
        let mut local: Vec<usize> = (0..READS).map(local_slot).collect();
        local.sort_unstable();
        assert!(local.iter().copied().eq(0..READS));
        assert_eq!(unhex(&hex(&[0, 1, 0xab, 0xff])), [0, 1, 0xab, 0xff]);
        assert_ne!(block_bytes(1), block_bytes(2));
    }
}
