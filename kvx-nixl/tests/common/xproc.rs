//! Two processes: this test (or bench) binary re-executes itself as the *target* (the prefill side,
//! agent "prefill"), which registers a pool filled with a known pattern, prints its metadata on
//! stdout and serves until the initiator's final notification arrives. Every wait is bounded.
#![allow(dead_code, unreachable_pub)] // Test and bench use different parts.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code fails loudly by unwrapping.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use kvx_core::{HostMemory, KvMemory, TransferAgent};
use kvx_nixl::{NixlAgent, NixlConfig};

/// Set in the child's environment: its role and parameters.
pub const ROLE_VAR: &str = "KVX_NIXL_XPROC_TARGET";
/// The notification that ends the target's service loop.
pub const DONE: &[u8] = b"kvx-xproc-done";
/// Bound on the whole life of the target process.
pub const TARGET_LIFETIME: Duration = Duration::from_secs(120);

/// What the target process announces on stdout.
#[derive(Debug)]
pub struct TargetInfo {
    pub metadata: Vec<u8>,
    pub base: u64,
}

/// The parameters the child reads from `ROLE_VAR`: `blocks,block_len,seed,progress_thread`.
#[derive(Debug, Clone, Copy)]
pub struct TargetParams {
    pub blocks: u32,
    pub block_len: u64,
    pub seed: u64,
    pub progress_thread: bool,
}

impl TargetParams {
    fn encode(&self) -> String {
        format!("{},{},{},{}", self.blocks, self.block_len, self.seed, u8::from(self.progress_thread))
    }

    fn decode(s: &str) -> TargetParams {
        let f: Vec<u64> = s.split(',').map(|x| x.parse().unwrap()).collect();
        TargetParams { blocks: f[0] as u32, block_len: f[1], seed: f[2], progress_thread: f[3] != 0 }
    }

    pub fn config(&self) -> NixlConfig {
        NixlConfig::default().with_progress_thread(self.progress_thread, Duration::ZERO)
    }
}

/// If this process is the target child, runs the target and returns true (the caller returns).
pub fn run_target_if_child() -> bool {
    let Ok(params) = std::env::var(ROLE_VAR) else { return false };
    let params = TargetParams::decode(&params);
    let agent = NixlAgent::new("prefill", &params.config()).unwrap();
    let len = params.blocks as usize * params.block_len as usize;
    let pool = Arc::new(HostMemory::new(len).unwrap());
    pool.write(0, &super::pattern(params.seed, len)).unwrap();
    agent.register(pool.clone()).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "BASE {}", pool.region().addr).unwrap();
    writeln!(out, "METADATA {}", hex(&agent.local_metadata().unwrap())).unwrap();
    out.flush().unwrap();

    // Serve: the target only drains notifications (which progresses NIXL) until told to stop.
    let deadline = Instant::now() + TARGET_LIFETIME;
    let mut notes = Vec::new();
    let mut received = 0usize;
    loop {
        agent.drain_notifications(&mut notes).unwrap();
        for n in notes.drain(..) {
            assert_eq!(n.from.as_str(), "decode", "notification from {}", n.from);
            received += 1;
            if n.msg == DONE {
                writeln!(out, "TARGET-OK {received}").unwrap();
                out.flush().unwrap();
                return true;
            }
        }
        assert!(Instant::now() < deadline, "target: no {DONE:?} notification within {TARGET_LIFETIME:?}");
        std::thread::yield_now();
    }
}

/// The target child process, as the initiator sees it.
pub struct Target {
    child: Child,
    lines: Receiver<String>,
}

impl Target {
    /// Starts this binary again as the target (`args` select the test or bench entry point).
    pub fn spawn(args: &[&str], params: TargetParams) -> (Target, TargetInfo) {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(args)
            .env(ROLE_VAR, params.encode())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
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
        let mut target = Target { child, lines };
        let base = target.expect_line("BASE ").parse().unwrap();
        let metadata = unhex(&target.expect_line("METADATA "));
        (target, TargetInfo { metadata, base })
    }

    /// The rest of the next line that starts with `prefix` (other lines, e.g. libtest's, are
    /// skipped), within a bound.
    pub fn expect_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return rest.to_owned();
                    }
                }
                Err(RecvTimeoutError::Timeout) => panic!("target printed no {prefix:?} line within 60 s"),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("target exited before printing {prefix:?}: {:?}", self.child.wait())
                }
            }
        }
    }

    /// Waits (bounded) for the target to exit successfully: its stdout closes when it exits.
    pub fn finish(mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(_) => {}
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => panic!("target process still running after 30 s"),
            }
        }
        let status = self.child.wait().unwrap();
        assert!(status.success(), "target process failed: {status}");
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

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// A random permutation of `0..n` (xorshift, seeded).
pub fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}
