//! A READ target in another process: the test or bench binary re-executes itself with
//! `KVX_UCX_ROLE=target`; the target prints its metadata on stdout, serves its memory, and exits
//! when the reader's notification arrives. Shared by `tests/two_process.rs` and the benchmark.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // Test support: panics are failures.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use kvx_core::{
    BlockList, DlistId, DlistOwner, HostMemory, KvMemory, MemKind, TransferAgent, XferId, XferOp, XferState,
};
use kvx_ucx::{ProgressThreadConfig, UcxAgent, UcxConfig};

pub(crate) const BLOCK: usize = 64 << 10;
/// Blocks the target exports; each round reads `READS` of them, scattered.
pub(crate) const REMOTE_BLOCKS: usize = 2000;
pub(crate) const READS: usize = 1000;
pub(crate) const ROLE_ENV: &str = "KVX_UCX_ROLE";
const TLS_ENV: &str = "KVX_UCX_TLS";
const MEM_ENV: &str = "KVX_UCX_MEM";
const DONE: &[u8] = b"kvx-two-process-done";
const DEADLINE: Duration = Duration::from_secs(120);

/// Word `w` of block `b` of the target's pattern.
pub(crate) fn word(b: usize, w: usize) -> u64 {
    ((b as u64) << 32 | w as u64) ^ 0x5a5a_0000_a5a5
}

pub(crate) fn block_bytes(b: usize) -> Vec<u8> {
    (0..BLOCK / 8).flat_map(|w| word(b, w).to_le_bytes()).collect()
}

/// The remote block read into slot `i` in round `round` (scattered, different every round).
pub(crate) fn remote_block(i: usize, round: usize) -> usize {
    (i * 7919 + round * 101) % REMOTE_BLOCKS
}

/// The local slot of read `i`: a permutation of 0..READS (gcd(7, 1000) = 1).
pub(crate) fn local_slot(i: usize) -> usize {
    (i * 7 + 3) % READS
}

fn config(tls: Option<&str>) -> UcxConfig {
    match tls {
        Some(t) => UcxConfig::default().with_transports(t),
        None => UcxConfig::default(),
    }
}

/// Target memory: allocated by UCX (`pool`, truly one-sided) or a heap buffer (`heap`, served by
/// the target's progress thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TargetMem {
    Pool,
    Heap,
}

/// The target role: call first thing in `main` / the role test; returns unless this process is
/// a target.
pub(crate) fn run_target_if_requested() {
    if std::env::var(ROLE_ENV).as_deref() != Ok("target") {
        return;
    }
    let tls = std::env::var(TLS_ENV).ok();
    let mem = if std::env::var(MEM_ENV).as_deref() == Ok("heap") { TargetMem::Heap } else { TargetMem::Pool };
    let mut cfg = config(tls.as_deref());
    if mem == TargetMem::Heap {
        cfg = cfg.with_progress_thread(ProgressThreadConfig::default());
    }
    let agent = UcxAgent::with_config("two-process-target", &cfg).unwrap();
    let len = REMOTE_BLOCKS * BLOCK;
    let (memory, base): (Arc<dyn KvMemory>, u64) = match mem {
        TargetMem::Pool => {
            let pool = agent.alloc_memory(len).unwrap();
            for b in 0..REMOTE_BLOCKS {
                pool.write(b * BLOCK, &block_bytes(b)).unwrap();
            }
            let base = pool.as_ptr() as u64;
            (pool, base)
        }
        TargetMem::Heap => {
            let heap = Arc::new(HostMemory::new(len).unwrap());
            for b in 0..REMOTE_BLOCKS {
                heap.write(b * BLOCK, &block_bytes(b)).unwrap();
            }
            let base = heap.region().addr;
            (heap, base)
        }
    };
    agent.register(memory).unwrap();
    let meta = agent.local_metadata().unwrap();
    let hex: String = meta.iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "KVX-META {hex}").unwrap();
    writeln!(out, "KVX-BASE {base}").unwrap();
    out.flush().unwrap();
    drop(out);

    // Serve until the reader's final notification (the memory itself needs no help for `pool`).
    let deadline = Instant::now() + DEADLINE;
    let mut notes = Vec::new();
    loop {
        agent.drain_notifications(&mut notes).unwrap();
        if let Some(n) = notes.iter().find(|n| n.msg == DONE) {
            println!("KVX-NOTIFIED {}", n.from);
            std::process::exit(0);
        }
        assert!(Instant::now() < deadline, "target: no final notification within {DEADLINE:?}");
        // Between drains: a bounded pause so that the target's polling does not compete with
        // the reader for the CPUs.
        std::thread::park_timeout(Duration::from_millis(1));
    }
}

/// A running target process.
pub(crate) struct Target {
    child: Child,
    lines: Receiver<String>,
    pub(crate) metadata: Vec<u8>,
    pub(crate) base: u64,
}

impl Target {
    /// Starts this executable as a target; `args` select the role test (libtest) or nothing.
    pub(crate) fn spawn(args: &[&str], tls: Option<&str>, mem: TargetMem) -> Self {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(args).env(ROLE_ENV, "target").stdout(Stdio::piped()).stdin(Stdio::null());
        cmd.env(MEM_ENV, if mem == TargetMem::Heap { "heap" } else { "pool" });
        match tls {
            Some(t) => cmd.env(TLS_ENV, t),
            None => cmd.env_remove(TLS_ENV),
        };
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut t = Target { child, lines, metadata: Vec::new(), base: 0 };
        let hex = t.wait_line("KVX-META ");
        t.metadata =
            (0..hex.len() / 2).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()).collect();
        t.base = t.wait_line("KVX-BASE ").parse().unwrap();
        t
    }

    /// The rest of the first stdout line starting with `prefix` (bounded wait).
    pub(crate) fn wait_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    // libtest may print its own text before ours on the same line.
                    if let Some(at) = line.find(prefix) {
                        return line[at + prefix.len()..].trim().to_string();
                    }
                }
                Err(RecvTimeoutError::Timeout) => panic!("target printed no {prefix:?} within {DEADLINE:?}"),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("target exited before printing {prefix:?}: {:?}", self.child.try_wait())
                }
            }
        }
    }

    /// Waits (bounded) for the target to report the final notification and exit successfully.
    pub(crate) fn finish(mut self, reader: &str) {
        assert_eq!(self.wait_line("KVX-NOTIFIED "), reader);
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "target failed: {status}");
                return;
            }
            assert!(Instant::now() < deadline, "target did not exit");
            std::thread::park_timeout(Duration::from_millis(1));
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The reading side, in this process.
pub(crate) struct Reader {
    pub(crate) agent: UcxAgent,
    pub(crate) local: Arc<HostMemory>,
    local_list: DlistId,
    remote_list: DlistId,
}

impl Reader {
    pub(crate) fn new(name: &str, tls: Option<&str>, target: &Target) -> Self {
        let agent = UcxAgent::with_config(name, &config(tls)).unwrap();
        let local = Arc::new(HostMemory::new(READS * BLOCK).unwrap());
        agent.register(local.clone()).unwrap();
        let peer = agent.load_remote(&target.metadata).unwrap();
        let list = |base, n| BlockList {
            kind: MemKind::Dram,
            device: 0,
            bases: vec![base],
            num_blocks: n as u32,
            block_len: BLOCK as u64,
        };
        let local_list = agent.prep_dlist(&DlistOwner::Local, &list(local.region().addr, READS)).unwrap();
        let remote_list =
            agent.prep_dlist(&DlistOwner::Remote(peer), &list(target.base, REMOTE_BLOCKS)).unwrap();
        Reader { agent, local, local_list, remote_list }
    }

    /// Posts the round's `READS` scattered reads at once and polls until done; returns the time.
    pub(crate) fn read_round(&self, round: usize, notify: bool) -> Duration {
        let local: Vec<u32> = (0..READS).map(|i| local_slot(i) as u32).collect();
        let remote: Vec<u32> = (0..READS).map(|i| remote_block(i, round) as u32).collect();
        let start = Instant::now();
        let msg = notify.then_some(DONE);
        let x =
            self.agent.post(XferOp::Read, self.local_list, &local, self.remote_list, &remote, msg).unwrap();
        self.wait(x);
        let elapsed = start.elapsed();
        self.agent.release(x).unwrap();
        elapsed
    }

    fn wait(&self, x: XferId) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            match self.agent.poll(x).unwrap() {
                XferState::Pending => assert!(Instant::now() < deadline, "READ still pending"),
                XferState::Done => return,
                XferState::Failed(e) => panic!("READ failed: {e}"),
            }
        }
    }

    /// Checks every byte of the round's reads; returns the number of blocks checked.
    pub(crate) fn verify(&self, round: usize) -> usize {
        let mut block = vec![0u8; BLOCK];
        for i in 0..READS {
            self.local.read(local_slot(i) * BLOCK, &mut block).unwrap();
            let b = remote_block(i, round);
            for (w, chunk) in block.chunks_exact(8).enumerate() {
                let got = u64::from_le_bytes(chunk.try_into().unwrap());
                assert_eq!(got, word(b, w), "round {round}: read {i} (remote block {b}) differs at word {w}");
            }
        }
        READS
    }

    /// Clears the local slots so a round cannot pass on stale data.
    pub(crate) fn clear(&self) {
        self.local.fill(0, READS * BLOCK, 0).unwrap();
    }
}
