//! A `kvx prefill` process killed in the middle of a `kvx decode` run and started again on the
//! same ports: the decode process reconnects, fails or recomputes only the requests that were in
//! flight at the kill, completes the rest, and the new prefill process leaks nothing.
//!
//! Driven by the processes' output, not by sleeps: the decode process is frozen (SIGSTOP) once it
//! has sent a quarter of its prompts, the prefill process is killed (SIGKILL) and reaped, the
//! decode process goes on (SIGCONT) until it says the prefill process is lost, then a new prefill
//! process starts on the same request-API and side-channel ports. Every wait is bounded, and every
//! child is killed however the test ends.

#![cfg(any(feature = "ucx", feature = "nixl"))]
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const KVX: &str = env!("CARGO_BIN_EXE_kvx");
/// The bound of every wait.
const LIMIT: Duration = Duration::from_secs(120);
/// Small sizes: the debug build checks every byte.
const SIZES: [&str; 8] = ["--layers", "2", "--kv-heads", "4", "--head-dim", "32", "--blocks", "256"];

/// Requests of the decode run, and how many go through the first prefill process at least.
const REQUESTS: usize = 400;
const BEFORE_KILL: usize = REQUESTS / 4;
/// `--max-in-flight` of the decode process: at most this many requests can be in flight at a kill.
const MAX_IN_FLIGHT: usize = 8;

/// Child processes, killed (SIGKILL) and reaped when the test ends, however it ends.
#[derive(Default)]
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Children {
    fn spawn(&mut self, args: &[&str]) -> (usize, Output) {
        let mut child = Command::new(KVX)
            .env_remove("KVX_AUTH_KEY")
            .args(args)
            .args(SIZES)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let output = Output::of(&mut child);
        self.0.push(child);
        (self.0.len() - 1, output)
    }

    fn pid(&self, i: usize) -> u32 {
        self.0[i].id()
    }

    /// Sends `signal` (a `kill -s` name) to child `i`.
    fn signal(&self, i: usize, signal: &str) {
        let pid = self.pid(i).to_string();
        let status = Command::new("kill").args(["-s", signal, &pid]).status().unwrap();
        assert!(status.success(), "kill -s {signal} {pid}");
    }

    /// SIGKILLs child `i` and reaps it.
    fn kill(&mut self, i: usize) {
        self.0[i].kill().unwrap();
        self.0[i].wait().unwrap();
    }

    /// Child `i`'s exit status, within [`LIMIT`] (killed after).
    fn exit_status(&mut self, i: usize) -> ExitStatus {
        let pid = self.pid(i);
        kvx_testkit::child::wait_within(&mut self.0[i], LIMIT)
            .unwrap_or_else(|| panic!("kvx (pid {pid}) did not exit within {LIMIT:?}"))
    }
}

/// A child's stdout and stderr, line by line as they come (read on threads).
struct Output {
    lines: mpsc::Receiver<(Stream, Option<String>)>,
    stdout: String,
    stderr: String,
    open: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    Out,
    Err,
}

impl Output {
    fn of(child: &mut Child) -> Self {
        let (tx, rx) = mpsc::channel();
        fn pump(
            from: impl Read + Send + 'static,
            stream: Stream,
            tx: mpsc::Sender<(Stream, Option<String>)>,
        ) {
            std::thread::spawn(move || {
                for line in BufReader::new(from).lines() {
                    let Ok(line) = line else { break };
                    if tx.send((stream, Some(line))).is_err() {
                        return;
                    }
                }
                let _ = tx.send((stream, None));
            });
        }
        pump(child.stdout.take().unwrap(), Stream::Out, tx.clone());
        pump(child.stderr.take().unwrap(), Stream::Err, tx);
        Output { lines: rx, stdout: String::new(), stderr: String::new(), open: 2 }
    }

    /// The next line of either stream (`None` once both ended), within `deadline`.
    fn next(&mut self, deadline: Instant, what: &str) -> Option<(Stream, String)> {
        while self.open > 0 {
            let wait = deadline.saturating_duration_since(Instant::now());
            let Ok((stream, line)) = self.lines.recv_timeout(wait) else {
                panic!("no {what} within {LIMIT:?}; so far:\n{}\n{}", self.stdout, self.stderr)
            };
            let Some(line) = line else {
                self.open -= 1;
                continue;
            };
            let all = if stream == Stream::Out { &mut self.stdout } else { &mut self.stderr };
            all.push_str(&line);
            all.push('\n');
            return Some((stream, line));
        }
        None
    }

    /// Waits for a stdout line that `want` accepts, and returns it.
    fn wait_for(&mut self, what: &str, want: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + LIMIT;
        loop {
            match self.next(deadline, what) {
                Some((Stream::Out, line)) if want(&line) => return line,
                Some(_) => {}
                None => panic!("the process ended before {what}:\n{}\n{}", self.stdout, self.stderr),
            }
        }
    }

    /// Everything up to the end of both streams: (stdout, stderr).
    fn rest(&mut self) -> (String, String) {
        let deadline = Instant::now() + LIMIT;
        while self.next(deadline, "end of output").is_some() {}
        (self.stdout.clone(), self.stderr.clone())
    }
}

/// The ports in a prefill banner: (request API, side channel of rank 0).
fn prefill_ports(banner: &str) -> (u16, u16) {
    let api = banner.rsplit(':').next().unwrap().parse().unwrap();
    let side = banner.split("side channels on ports ").nth(1).unwrap().split('-').next().unwrap();
    (api, side.parse().unwrap())
}

/// The numbers of a summary row, in order (`requests  400 (390 finished, 0 failed, 10 recomputed)`
/// gives 400, 390, 0, 10).
fn row(summary: &str, name: &str) -> Vec<usize> {
    let line = summary
        .lines()
        .find_map(|l| l.trim().strip_prefix(name).filter(|rest| rest.starts_with("  ")))
        .unwrap_or_else(|| panic!("no {name:?} row in:\n{summary}"));
    line.split(|c: char| !c.is_ascii_digit()).filter(|n| !n.is_empty()).map(|n| n.parse().unwrap()).collect()
}

/// Kills the prefill process mid-run, restarts it on the same ports and checks both processes'
/// accounts, on `backend` with `--on-load-failure policy` (`fail` or `recompute`).
fn prefill_restart_mid_run(backend: &str, policy: &str) {
    let mut children = Children::default();
    let (first, mut first_out) = children.spawn(&["prefill", "--backend", backend, "--api-port", "0"]);
    let banner = first_out.wait_for("the prefill banner", |l| l.contains("request API on tcp://"));
    let (api_port, side_port) = prefill_ports(&banner);

    let (requests, max_in_flight) = (REQUESTS.to_string(), MAX_IN_FLIGHT.to_string());
    let api = format!("tcp://127.0.0.1:{api_port}");
    #[rustfmt::skip]
    let (decode, mut decode_out) = children.spawn(&[
        "decode", "--backend", backend, "--prefill", &api, "--requests", &requests,
        "--prompt-len", "1..120", "--max-in-flight", &max_in_flight, "--on-load-failure", policy,
        "--reconnect-timeout", "30", "--timeout", "60",
    ]);
    let sent = |line: &str| -> Option<usize> {
        line.strip_prefix("kvx decode: ")?.split_once(" of ")?.0.parse().ok()
    };
    decode_out.wait_for("a quarter of the prompts sent", |l| sent(l).is_some_and(|n| n >= BEFORE_KILL));
    // Frozen, the decode process cannot finish before the kill, however slow this thread is.
    children.signal(decode, "STOP");
    children.kill(first);
    children.signal(decode, "CONT");
    decode_out.wait_for("the prefill loss", |l| l.starts_with("kvx decode: prefill lost"));

    let side = side_port.to_string();
    #[rustfmt::skip]
    let (second, mut second_out) = children.spawn(&[
        "prefill", "--backend", backend, "--api-port", &api_port.to_string(), "--side-channel-port", &side,
    ]);
    let again = second_out.wait_for("the new prefill banner", |l| l.contains("request API on tcp://"));
    assert_eq!(prefill_ports(&again), (api_port, side_port), "{again}");

    let status = children.exit_status(decode);
    let (d, d_err) = decode_out.rest();
    assert!(status.success(), "decode ({status}):\n{d}\n{d_err}");
    let status = children.exit_status(second);
    let (p, p_err) = second_out.rest();
    assert!(status.success(), "new prefill ({status}):\n{p}\n{p_err}");

    // Every request is accounted for; only those in flight at the kill failed or were recomputed.
    let [total, finished, failed, recomputed] = row(&d, "requests")[..] else { panic!("{d}") };
    assert_eq!((total, finished + failed + recomputed), (REQUESTS, REQUESTS), "{d}");
    let [losses, in_flight] = row(&d, "prefill losses")[..] else { panic!("{d}") };
    assert!(losses >= 1 && in_flight <= losses * MAX_IN_FLIGHT, "{d}");
    assert!(failed + recomputed <= in_flight, "{d}\n{d_err}");
    assert_eq!(row(&d, "load failures"), [failed + recomputed], "{d}");
    assert_eq!(row(&d, "unexpected failures"), [0], "{d}");
    match policy {
        "fail" => assert_eq!(recomputed, 0, "{d}"),
        _ => assert_eq!(failed, 0, "every recompute finishes: {d}"),
    }
    // Every byte of every completed load checked; no block left in either engine still running.
    assert!(row(&d, "blocks verified")[0] > 0, "{d}");
    assert_eq!(row(&d, "blocks mismatched"), [0], "{d}");
    assert_eq!(row(&d, "blocks leaked"), [0], "{d}");
    // The new prefill process served the rest (the first one took at least a quarter) and leaks
    // nothing.
    let served: usize = p
        .lines()
        .find_map(|l| l.strip_prefix("kvx prefill: served ")?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{p}"));
    assert!(served > 0 && served <= REQUESTS - BEFORE_KILL, "{p}");
    assert_eq!(row(&p, "blocks leaked"), [0], "{p}");
}

/// The restart tests on a native backend this `kvx` was built with, in a module named after it.
macro_rules! restart_tests {
    ($backend:ident) => {
        mod $backend {
            /// With `--on-load-failure recompute`, the decode engine computes the requests whose
            /// loads the kill broke; every request finishes.
            #[test]
            fn prefill_restart_mid_run_recomputes_requests_in_flight() {
                super::prefill_restart_mid_run(stringify!($backend), "recompute");
            }

            /// With `--on-load-failure fail`, the requests whose loads the kill broke fail, and
            /// only they.
            #[test]
            fn prefill_restart_mid_run_fails_only_requests_in_flight() {
                super::prefill_restart_mid_run(stringify!($backend), "fail");
            }
        }
    };
}

#[cfg(feature = "ucx")]
restart_tests!(ucx);
#[cfg(feature = "nixl")]
restart_tests!(nixl);
