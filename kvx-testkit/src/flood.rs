//! Floods of well-formed, slow, idle or unauthenticated connections against a server on this
//! machine, and the legitimate side's outcome measured while they go on.
//!
//! A [`Flood`] keeps `connections` attacker connections to one address, each of one [`Shape`],
//! on a runtime of its own: an attacker the server drops connects again at once, as a real flood
//! does, until the flood is dropped. Every connection goes to a loopback address given by the
//! caller, and the flood stops (its runtime shut down, its sockets closed) when dropped.
//! [`ChildFlood`] runs one in a child process, with file descriptors of its own. [`Latencies`]
//! collects the legitimate requests' outcomes for a report and a bound.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::watch;

use crate::child::SelfChild;
use kvx_core::{Error, ErrorKind, Result};

/// What each attacker connection does.
#[derive(Debug, Clone)]
pub enum Shape {
    /// Connects and sends nothing.
    Idle,
    /// Sends `bytes` (a request cut short, a keyless hello) and then nothing.
    Stalled(Vec<u8>),
    /// Sends `bytes` one byte every `pace`, and never more.
    Trickle { bytes: Vec<u8>, pace: Duration },
    /// Sends `bytes` (one whole request), reads whatever comes back, and sends it again every
    /// `pace` on the same connection: a peer holding its slot with real requests.
    Holding { bytes: Vec<u8>, pace: Duration },
    /// Sends `bytes` (one whole request) and reads its answer, back to back.
    Busy(Vec<u8>),
}

impl Shape {
    /// A short name for reports.
    pub fn name(&self) -> &'static str {
        match self {
            Shape::Idle => "idle",
            Shape::Stalled(_) => "stalled",
            Shape::Trickle { .. } => "trickle",
            Shape::Holding { .. } => "holding",
            Shape::Busy(_) => "busy",
        }
    }
}

impl Shape {
    /// The shape as one word, for [`ChildFlood`]: its name, then its bytes in hex and its pace in
    /// milliseconds, separated by `/`.
    fn to_word(&self) -> String {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        match self {
            Shape::Idle => "idle".into(),
            Shape::Stalled(b) => format!("stalled/{}", hex(b)),
            Shape::Trickle { bytes, pace } => format!("trickle/{}/{}", hex(bytes), pace.as_millis()),
            Shape::Holding { bytes, pace } => format!("holding/{}/{}", hex(bytes), pace.as_millis()),
            Shape::Busy(b) => format!("busy/{}", hex(b)),
        }
    }

    /// The shape [`to_word`](Self::to_word) wrote.
    fn from_word(word: &str) -> Option<Shape> {
        let mut parts = word.split('/');
        let name = parts.next()?;
        let bytes = match parts.next() {
            Some(h) if h.len() % 2 == 0 => (0..h.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
                .collect::<Option<Vec<u8>>>()?,
            Some(_) => return None,
            None => Vec::new(),
        };
        let pace = parts.next().map(|ms| ms.parse().map(Duration::from_millis));
        Some(match (name, pace) {
            ("idle", None) => Shape::Idle,
            ("stalled", None) => Shape::Stalled(bytes),
            ("busy", None) => Shape::Busy(bytes),
            ("trickle", Some(Ok(pace))) => Shape::Trickle { bytes, pace },
            ("holding", Some(Ok(pace))) => Shape::Holding { bytes, pace },
            _ => return None,
        })
    }
}

/// What a flood did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FloodStats {
    /// Connections opened (each attacker reconnects after a drop).
    pub opened: u64,
    /// Connections the server closed or reset.
    pub dropped: u64,
    /// Connection attempts that failed.
    pub failed_connects: u64,
    /// Answers read (Holding and Busy).
    pub answers: u64,
}

#[derive(Debug, Default)]
struct Counters {
    opened: AtomicU64,
    dropped: AtomicU64,
    failed_connects: AtomicU64,
    answers: AtomicU64,
    /// Set (and waited on) once `opened` reaches the flood's size.
    all_open: (Mutex<bool>, Condvar),
}

impl Counters {
    fn opened(&self, size: u64) {
        if self.opened.fetch_add(1, Ordering::Relaxed) + 1 == size {
            let (done, cv) = &self.all_open;
            *done.lock().unwrap_or_else(PoisonError::into_inner) = true;
            cv.notify_all();
        }
    }
}

/// A running flood; dropping it stops it and closes its connections.
pub struct Flood {
    shape: &'static str,
    connections: usize,
    counters: Arc<Counters>,
    stop: watch::Sender<bool>,
    runtime: Option<Runtime>,
}

impl fmt::Debug for Flood {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Flood")
            .field("shape", &self.shape)
            .field("connections", &self.connections)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Flood {
    /// Starts `connections` attackers of `shape` against `target`, connecting from `source`
    /// (both loopback addresses; a source other than the legitimate peers' is an attacker on
    /// another host).
    pub fn start(
        target: SocketAddr,
        source: IpAddr,
        shape: Shape,
        connections: usize,
    ) -> std::io::Result<Flood> {
        assert!(
            target.ip().is_loopback() && source.is_loopback(),
            "floods go between loopback addresses only, not {source} -> {target}"
        );
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvx-flood")
            .enable_all()
            .build()?;
        let counters = Arc::new(Counters::default());
        let (stop, stopped) = watch::channel(false);
        let size = connections as u64;
        for _ in 0..connections {
            let (shape, counters, stopped) = (shape.clone(), Arc::clone(&counters), stopped.clone());
            runtime.spawn(attacker(target, source, shape, counters, stopped, size));
        }
        Ok(Flood { shape: shape.name(), connections, counters, stop, runtime: Some(runtime) })
    }

    /// What it has done so far.
    pub fn stats(&self) -> FloodStats {
        let c = &self.counters;
        FloodStats {
            opened: c.opened.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            failed_connects: c.failed_connects.load(Ordering::Relaxed),
            answers: c.answers.load(Ordering::Relaxed),
        }
    }

    /// Waits until as many connections were opened as the flood has attackers (each has
    /// connected once, or dropped ones reconnected), at most `timeout`; `false` when it passed.
    pub fn wait_connected(&self, timeout: Duration) -> bool {
        let (done, cv) = &self.counters.all_open;
        let guard = done.lock().unwrap_or_else(PoisonError::into_inner);
        let (guard, _) =
            cv.wait_timeout_while(guard, timeout, |d| !*d).unwrap_or_else(PoisonError::into_inner);
        *guard
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

/// The environment variable that tells a [`ChildFlood`]'s child what to run.
const CHILD_ENV: &str = "KVX_FLOOD_CHILD";

/// A [`Flood`] in a child process: this test binary started again to run its test `entry`, which
/// calls [`run_child_flood`]. The flood has file descriptors of its own there (a flood of 10,000
/// connections and a server that holds them all need more than one process may open here), and
/// the server's memory is measured without it. Killed on drop if still running.
#[derive(Debug)]
pub struct ChildFlood {
    child: SelfChild,
}

impl ChildFlood {
    /// Starts the child, running `connections` attackers of `shape` against `target` from `source`
    /// (see [`Flood::start`]).
    pub fn start(
        entry: &str,
        target: SocketAddr,
        source: IpAddr,
        shape: &Shape,
        connections: usize,
    ) -> Result<ChildFlood> {
        let spec = format!("{target} {source} {connections} {}", shape.to_word());
        let args = [entry, "--exact", "--nocapture", "--test-threads", "1"];
        Ok(ChildFlood { child: SelfChild::spawn(&args, &[(CHILD_ENV, &spec)])? })
    }

    /// Waits until every attacker has connected (see [`Flood::wait_connected`]), at most `timeout`.
    pub fn wait_connected(&mut self, timeout: Duration) -> Result<()> {
        self.child.wait_line("FLOOD CONNECTED", timeout).map(drop)
    }

    /// Stops the flood (its connections closed, the child gone, within `timeout`) and says what
    /// it did.
    pub fn stop(mut self, timeout: Duration) -> Result<FloodStats> {
        self.child.close_stdin();
        let line = self.child.wait_line("FLOOD STATS", timeout)?;
        let n: Vec<u64> = line.split_whitespace().filter_map(|v| v.parse().ok()).collect();
        let &[opened, dropped, failed_connects, answers] = n.as_slice() else {
            return Err(Error::new(ErrorKind::Wire, format!("a flood's stats line {line:?}")));
        };
        self.child.wait_success(timeout)?;
        Ok(FloodStats { opened, dropped, failed_connects, answers })
    }
}

/// In a [`ChildFlood`]'s child (the test that [`ChildFlood::start`] named calls it): runs the
/// flood, says when it is connected, and at the end of its stdin stops it and prints its stats. In
/// any other process it returns at once.
pub fn run_child_flood() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let words: Vec<&str> = spec.split_whitespace().collect();
    let [target, source, connections, shape] = words.as_slice() else { panic!("a flood of {spec:?}") };
    let (Ok(target), Ok(source), Ok(connections), Some(shape)) =
        (target.parse(), source.parse(), connections.parse::<usize>(), Shape::from_word(shape))
    else {
        panic!("a flood of {spec:?}")
    };
    raise_open_files(connections as u64 + 1024);
    let flood = Flood::start(target, source, shape, connections).unwrap_or_else(|e| panic!("{e}"));
    if flood.wait_connected(Duration::from_secs(60)) {
        println!("FLOOD CONNECTED");
    }
    // Until the parent closes its end.
    let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
    let s = flood.stats();
    drop(flood);
    println!("FLOOD STATS {} {} {} {}", s.opened, s.dropped, s.failed_connects, s.answers);
}

/// The longest pause between failed connection attempts.
const MAX_CONNECT_PAUSE: Duration = Duration::from_millis(50);

async fn attacker(
    target: SocketAddr,
    source: IpAddr,
    shape: Shape,
    c: Arc<Counters>,
    mut stop: watch::Receiver<bool>,
    size: u64,
) {
    let mut pause = Duration::from_millis(1);
    loop {
        let stream = tokio::select! {
            s = connect(source, target) => s,
            _ = stop.wait_for(|s| *s) => return,
        };
        let mut stream = match stream {
            Ok(s) => s,
            Err(_) => {
                c.failed_connects.fetch_add(1, Ordering::Relaxed);
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
                pause = (pause * 2).min(MAX_CONNECT_PAUSE);
                continue;
            }
        };
        pause = Duration::from_millis(1);
        c.opened(size);
        tokio::select! {
            () = act(&mut stream, &shape, &c) => c.dropped.fetch_add(1, Ordering::Relaxed),
            _ = stop.wait_for(|s| *s) => return,
        };
    }
}

async fn connect(source: IpAddr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = if target.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.bind(SocketAddr::new(source, 0))?;
    socket.connect(target).await
}

/// Sends `request` and reads (the start of) its answer; false when the server dropped the
/// connection instead.
async fn exchange(stream: &mut TcpStream, sink: &mut [u8], request: &[u8], c: &Counters) -> bool {
    if stream.write_all(request).await.is_err() {
        return false;
    }
    let answered = matches!(stream.read(sink).await, Ok(n) if n > 0);
    if answered {
        c.answers.fetch_add(1, Ordering::Relaxed);
    }
    answered
}

/// Waits `pace`; true when the server dropped the connection meanwhile.
async fn closed_within(stream: &mut TcpStream, sink: &mut [u8], pace: Duration) -> bool {
    tokio::select! {
        () = tokio::time::sleep(pace) => false,
        n = stream.read(sink) => !matches!(n, Ok(n) if n > 0),
    }
}

/// Plays `shape` on `stream` until the server drops it.
async fn act(stream: &mut TcpStream, shape: &Shape, c: &Counters) {
    let mut sink = vec![0u8; 4 << 10];
    match shape {
        Shape::Idle => {}
        Shape::Stalled(bytes) => {
            if stream.write_all(bytes).await.is_err() {
                return;
            }
        }
        Shape::Trickle { bytes, pace } => {
            for b in bytes {
                if stream.write_all(&[*b]).await.is_err() || closed_within(stream, &mut sink, *pace).await {
                    return;
                }
            }
        }
        Shape::Holding { bytes, pace } => {
            while exchange(stream, &mut sink, bytes, c).await {
                if closed_within(stream, &mut sink, *pace).await {
                    return;
                }
            }
            return;
        }
        Shape::Busy(bytes) => {
            while exchange(stream, &mut sink, bytes, c).await {}
            return;
        }
    }
    // Hold the connection until the server drops it.
    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
}

/// The legitimate side's outcomes: how many succeeded and how long each took.
#[derive(Debug, Clone, Default)]
pub struct Latencies {
    ok: Vec<Duration>,
    failed: Vec<String>,
}

impl Latencies {
    /// Records one outcome.
    pub fn record<T, E: fmt::Display>(&mut self, took: Duration, outcome: &Result<T, E>) {
        match outcome {
            Ok(_) => self.ok.push(took),
            Err(e) => self.failed.push(e.to_string()),
        }
    }

    /// Times `f` and records its outcome.
    pub fn time<T, E: fmt::Display>(&mut self, f: impl FnOnce() -> Result<T, E>) {
        let start = Instant::now();
        let outcome = f();
        self.record(start.elapsed(), &outcome);
    }

    /// Successes and attempts.
    pub fn succeeded(&self) -> (usize, usize) {
        (self.ok.len(), self.ok.len() + self.failed.len())
    }

    /// The failures' messages.
    pub fn failures(&self) -> &[String] {
        &self.failed
    }

    /// The `q` quantile (0..=1) of the successes' latencies.
    pub fn quantile(&self, q: f64) -> Duration {
        let mut sorted = self.ok.clone();
        sorted.sort();
        if sorted.is_empty() {
            return Duration::ZERO;
        }
        let i = ((sorted.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        sorted[i]
    }

    /// The slowest success.
    pub fn max(&self) -> Duration {
        self.ok.iter().copied().max().unwrap_or_default()
    }

    /// The bound a loaded run is held to against this unloaded one: twice its slowest, plus 1 s.
    pub fn bound(&self) -> Duration {
        2 * self.max() + Duration::from_secs(1)
    }
}

impl fmt::Display for Latencies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (ok, all) = self.succeeded();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        write!(
            f,
            "{ok}/{all} ok, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            ms(self.quantile(0.5)),
            ms(self.quantile(0.99)),
            ms(self.max())
        )
    }
}

/// This process's resident memory, in KiB (0 where `/proc` does not say).
pub fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Raises this process's soft limit of open files to at least `want` (at most its hard limit),
/// with util-linux's `prlimit` (this crate has no unsafe code to call `setrlimit` itself); returns
/// the limit in force afterwards.
pub fn raise_open_files(want: u64) -> u64 {
    let (soft, hard) = open_files();
    if soft < want {
        let limit = format!("--nofile={}:{hard}", want.min(hard));
        let pid = std::process::id().to_string();
        let _ = std::process::Command::new("prlimit").args(["--pid", &pid, &limit]).status();
    }
    open_files().0
}

/// The soft and hard limits of open files, from `/proc/self/limits` (0 where it does not say).
fn open_files() -> (u64, u64) {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap_or_default();
    let field = |i: usize| match line.split_whitespace().nth(i) {
        Some("unlimited") => u64::MAX,
        Some(v) => v.parse().unwrap_or(0),
        None => 0,
    };
    (field(3), field(4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_go_to_a_child_as_one_word_and_back() {
        let shapes = [
            Shape::Idle,
            Shape::Stalled(vec![0, 1, 0xfe]),
            Shape::Trickle { bytes: vec![7; 3], pace: Duration::from_millis(500) },
            Shape::Holding { bytes: vec![0xab], pace: Duration::from_secs(50) },
            Shape::Busy(vec![]),
        ];
        for shape in shapes {
            let word = shape.to_word();
            assert!(!word.contains(char::is_whitespace), "{word}");
            let back = Shape::from_word(&word).map(|s| s.to_word());
            assert_eq!(back.as_deref(), Some(word.as_str()));
        }
        for bad in ["", "idle/00/5", "trickle/0", "stalled/zz", "holding/00/x", "other"] {
            assert!(Shape::from_word(bad).is_none(), "{bad}");
        }
    }
}
