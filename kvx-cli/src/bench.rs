//! `kvx bench`: READ bandwidth of scattered blocks for each backend, transport and block size,
//! each row beside a baseline measured in the same run: single-thread memcpy of the same scattered
//! blocks over shared memory, a plain TCP stream between two processes moving the same bytes over
//! TCP.
//!
//! The loopback backend reads between two agents of this process. The native backends read from
//! a target in another process: `kvx bench` starts itself again as the reader of each row, with
//! the row's `UCX_TLS` (NIXL's UCX reads only the environment), and the reader starts itself again
//! as the target ([`kvx_testkit::xproc`]). The READs, the memcpy and the TCP stream all move the
//! blocks of one [`Shape`], and each round of the baseline runs right before the same round of
//! READs, in the reader's process.

use clap::{Args, ValueEnum};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvx_core::{Error, ErrorKind, HostMemory, KvMemory, Result, TransferAgent, XferId};
use kvx_testkit::baseline::TcpStreamBaseline;
use kvx_testkit::child::{SelfChild, bench_host, own_cpu_time};
use kvx_testkit::xproc::{self, PROCESS_DEADLINE, Reader, Shape, TRANSFER_DEADLINE};

use crate::backend::Backend;
use crate::summary::percentile;

mod report;

use report::{CSV_HEADER, Row, TABLE_HEADER, plot, size_text};

/// The link a row's READs cross.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Transport {
    /// Memory shared within one host: UCX's own choice of transports (`UCX_TLS=all`, shared
    /// memory between two processes of one host; NIXL's UCX refuses `sm,self` alone), the loopback
    /// backend's in-process copy. Baseline: memcpy of the same blocks.
    Shm,
    /// TCP over 127.0.0.1 (`UCX_TLS=tcp`; not for the loopback backend). Baseline: a TCP stream
    /// between two processes.
    Tcp,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
        }
    }

    fn ucx_tls(self) -> &'static str {
        match self {
            Transport::Shm => "all",
            Transport::Tcp => "tcp",
        }
    }

    fn baseline(self) -> &'static str {
        match self {
            Transport::Shm => "memcpy",
            Transport::Tcp => "tcp-stream",
        }
    }

    /// The baseline's name in rows: `tcp-stream/N` for a stream of `N` blocks per system call.
    fn baseline_label(self, stream_batch: u32) -> String {
        match self {
            Transport::Tcp if stream_batch > 1 => format!("{}/{stream_batch}", self.baseline()),
            _ => self.baseline().to_owned(),
        }
    }

    fn parse(name: &str) -> Result<Transport> {
        Transport::from_str(name, false)
            .map_err(|e| Error::invalid_argument(format!("transport {name:?}: {e}")))
    }
}

/// Options of `kvx bench`.
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Transfer backend.
    #[arg(long, value_enum, default_value_t = Backend::Loopback, conflicts_with = "all")]
    backend: Backend,
    /// Every backend this kvx was built with.
    #[arg(long)]
    all: bool,
    /// Transports, comma-separated: shm (baseline memcpy), tcp (baseline a TCP stream between two
    /// processes; the native backends only).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "shm")]
    transport: Vec<Transport>,
    /// Block sizes, comma-separated, in bytes or with a K or M suffix (KiB, MiB).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "64K")]
    sizes: Vec<usize>,
    /// Blocks read per transfer.
    #[arg(long, default_value_t = 1000)]
    blocks: usize,
    /// Blocks the target exports (the READ picks `--blocks` of them, scattered); twice `--blocks`
    /// by default.
    #[arg(long)]
    pool_blocks: Option<usize>,
    /// Timed rounds per row, after one warm-up round.
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Blocks per system call of the TCP stream baseline (`writev` / `readv`); 1 (one `write`
    /// and one `read` per block) unless set. Its rows name the baseline `tcp-stream/N`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    stream_batch: u32,
    /// Writes the rows as CSV.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Draws GB/s and the baselines against block size (`.svg`).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Internal: this process is the reader of one native row started by `kvx bench`.
    #[arg(long, hide = true)]
    reader_row: bool,
}

/// A block size: bytes, or KiB / MiB with a `K` / `M` suffix.
fn parse_size(text: &str) -> std::result::Result<usize, String> {
    let (digits, unit) = match text.trim().to_ascii_uppercase() {
        t if t.ends_with('K') => (t[..t.len() - 1].to_owned(), 1 << 10),
        t if t.ends_with('M') => (t[..t.len() - 1].to_owned(), 1 << 20),
        t => (t, 1),
    };
    let size = digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| format!("{text:?} is not a size (bytes, or a number with K or M)"))?;
    if size == 0 || size % 8 != 0 {
        return Err(format!("{text:?}: block sizes are non-zero multiples of 8 bytes"));
    }
    Ok(size)
}

/// A row's timed rounds, the kvx READs' and the baseline's (interleaved, round by round), and how
/// many rounds of each were checked byte for byte.
#[derive(Debug)]
struct Rounds {
    times: Vec<Duration>,
    baseline: Vec<Duration>,
    verified: usize,
    /// CPU time of the reader's and the target's processes over the timed READs.
    cpu: Duration,
}

/// A row's baseline, a round at a time.
#[derive(Debug)]
enum Baseline {
    Memcpy(xproc::Memcpy),
    Tcp(TcpStreamBaseline),
}

impl Baseline {
    /// The transport's baseline for `shape`: a TCP stream starts its sender process.
    fn start(transport: Transport, shape: Shape, stream_batch: u32) -> Result<Baseline> {
        Ok(match transport {
            Transport::Shm => Baseline::Memcpy(xproc::Memcpy::new(shape)?),
            Transport::Tcp => {
                Baseline::Tcp(TcpStreamBaseline::start_batched(&[], shape, stream_batch as usize)?)
            }
        })
    }

    /// One round; `check`: its bytes are checked (a memcpy's always are what it copied).
    fn round(&mut self, round: usize, check: bool) -> Result<Duration> {
        match self {
            Baseline::Memcpy(memcpy) => Ok(memcpy.round(round)),
            Baseline::Tcp(stream) => stream.round(round, check),
        }
    }

    fn finish(self) -> Result<()> {
        match self {
            Baseline::Memcpy(_) => Ok(()),
            Baseline::Tcp(stream) => stream.finish(),
        }
    }
}

const ROUNDS_LINE: &str = "KVX-BENCH-ROUNDS ";
const READER: &str = "bench-reader";

/// Runs the benchmark and prints its table; writes the CSV and the plot when asked.
pub(crate) fn run(args: &BenchArgs) -> Result<()> {
    let pool_blocks = args.pool_blocks.unwrap_or(args.blocks.saturating_mul(2));
    if args.rounds == 0 {
        return Err(Error::invalid_argument("--rounds must be at least 1"));
    }
    let shapes = args
        .sizes
        .iter()
        .map(|&size| Shape::new(size, pool_blocks, args.blocks))
        .collect::<Result<Vec<_>>>()
        .map_err(|e| e.context("--sizes, --blocks and --pool-blocks"))?;
    if args.reader_row {
        return reader_row(args.backend, &args.transport, &shapes, args.rounds, args.stream_batch);
    }
    if let Some(plot) = &args.plot {
        if plot.extension().and_then(|e| e.to_str()) != Some("svg") {
            return Err(Error::invalid_argument(format!(
                "--plot {}: kvx draws SVG only (PNG would need the system's fonts)",
                plot.display()
            )));
        }
    }
    let backends = if args.all { Backend::built() } else { vec![args.backend] };
    for backend in &backends {
        // A backend this kvx lacks, or a NIXL that does not load, fails here with its reason.
        backend.sim_backend(false, &kvx_tcp::TcpConfig::default())?;
    }
    let mut pairs = Vec::new();
    for &backend in &backends {
        for &transport in &args.transport {
            if backend == Backend::Loopback && transport == Transport::Tcp {
                if !args.all {
                    return Err(Error::invalid_argument(
                        "the loopback backend moves bytes inside one process: no tcp transport",
                    ));
                }
                eprintln!("kvx bench: loopback has only in-process memory: no tcp rows for it");
                continue;
            }
            if backend == Backend::Tcp && transport == Transport::Shm {
                if !args.all {
                    return Err(Error::invalid_argument(
                        "the tcp backend moves bytes over TCP only: use --transport tcp",
                    ));
                }
                eprintln!("kvx bench: tcp crosses TCP only: no shm rows for it");
                continue;
            }
            pairs.push((backend, transport));
        }
    }
    println!(
        "kvx bench: READ of {} scattered blocks out of {pool_blocks} per transfer, median (p50) and p99 of {} rounds \
         after a warm-up; GB/s = 1e9 B/s",
        args.blocks, args.rounds
    );
    println!("{TABLE_HEADER}");
    let mut rows = Vec::new();
    let total = pairs.len() * shapes.len();
    for &(backend, transport) in &pairs {
        for &shape in &shapes {
            let what = format!("{} {} {}", backend.name(), transport.name(), size_text(shape.block_len));
            let baseline = transport.baseline_label(args.stream_batch);
            eprintln!(
                "kvx bench: [{}/{total}] {what}: kvx READ and {baseline}, round by round",
                rows.len() + 1
            );
            let measured = match backend {
                Backend::Loopback => loopback_rounds(shape, args.rounds)?,
                native => native_rounds(native, transport, shape, args.rounds, args.stream_batch)?,
            };
            let row = row(backend, transport, shape, baseline, &measured)?;
            println!("{}", row.table_line());
            rows.push(row);
        }
    }
    if let Some(path) = &args.csv {
        let mut csv = format!("{CSV_HEADER}\n");
        for row in &rows {
            let _ = writeln!(csv, "{}", row.cells().join(","));
        }
        std::fs::write(path, csv).map_err(|e| io_error(path, e))?;
        eprintln!("kvx bench: wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        plot(path, &rows)?;
        eprintln!("kvx bench: drew {}", path.display());
    }
    Ok(())
}

fn row(
    backend: Backend,
    transport: Transport,
    shape: Shape,
    baseline: String,
    measured: &Rounds,
) -> Result<Row> {
    let gbps = |d: Duration| shape.read_len() as f64 / d.as_secs_f64() / 1e9;
    let mut times = measured.times.clone();
    times.sort_unstable();
    let mut base = measured.baseline.clone();
    base.sort_unstable();
    let (Some(p50), Some(p99), Some(base_p50)) =
        (percentile(&times, 0.5), percentile(&times, 0.99), percentile(&base, 0.5))
    else {
        return Err(Error::new(ErrorKind::State, "a row without timed rounds"));
    };
    Ok(Row {
        backend,
        transport,
        shape,
        gbps: gbps(p50),
        baseline,
        baseline_gbps: gbps(base_p50),
        p50,
        p99,
        cpu_s_per_gb: measured.cpu.as_secs_f64() / (measured.times.len() * shape.read_len()) as f64 * 1e9,
        verified: measured.verified,
    })
}

/// Runs `rounds` timed READs after a warm-up (every target block read once, then an untimed
/// round), each with a notification (as a decode engine posts them), each right after the same
/// round of `transport`'s baseline, so that both see the same machine; the warm-up round's and
/// the last round's bytes are checked. `service` runs between polls; `cpu_time` tells the CPU
/// time the reader's and the target's processes have used so far.
fn timed_rounds<A: TransferAgent>(
    reader: &Reader<A>,
    transport: Transport,
    stream_batch: u32,
    rounds: usize,
    service: &mut dyn FnMut(XferId) -> Result<()>,
    cpu_time: &dyn Fn() -> Result<Duration>,
) -> Result<Rounds> {
    let mut baseline = Baseline::start(transport, reader.shape(), stream_batch)?;
    let mut measured = Rounds { times: Vec::new(), baseline: Vec::new(), verified: 0, cpu: Duration::ZERO };
    reader.touch_target(service)?;
    for round in 0..=rounds {
        let check = round == 0 || round == rounds;
        let base = baseline.round(round, check)?;
        if check {
            reader.clear();
        }
        let note = format!("round-{round}");
        let cpu_before = cpu_time()?;
        let elapsed = reader.try_read_round(round, Some(note.as_bytes()), service)?;
        if round > 0 {
            measured.cpu += cpu_time()?.saturating_sub(cpu_before);
        }
        if check {
            reader.check(round)?;
            measured.verified += 1;
        }
        if round > 0 {
            measured.times.push(elapsed);
            measured.baseline.push(base);
        }
    }
    baseline.finish()?;
    Ok(measured)
}

/// Two loopback agents of this process, progressed explicitly while the reader polls.
fn loopback_rounds(shape: Shape, rounds: usize) -> Result<Rounds> {
    let fabric = kvx_loopback::Fabric::new();
    let target = fabric.agent("bench-target")?;
    let pool = Arc::new(HostMemory::new(shape.target_len())?);
    shape.fill_target(|offset, bytes| pool.write(offset, bytes))?;
    target.register(pool.clone())?;
    let reader = Reader::open(fabric.agent(READER)?, &target.local_metadata()?, pool.region().addr, shape)?;
    let mut notes = Vec::new();
    let service = &mut |_| {
        reader.agent.progress()?;
        target.progress()?;
        target.drain_notifications(&mut notes)
    };
    timed_rounds(&reader, Transport::Shm, 1, rounds, service, &own_cpu_time)
}

/// A native row: `kvx bench --reader-row` in a process with the transport's `UCX_TLS`, which
/// reads from its own target process, runs the baseline between its READs, and prints the round
/// times of both.
fn native_rounds(
    backend: Backend,
    transport: Transport,
    shape: Shape,
    rounds: usize,
    stream_batch: u32,
) -> Result<Rounds> {
    let args = [
        "bench".to_owned(),
        "--reader-row".to_owned(),
        format!("--backend={}", backend.name()),
        format!("--transport={}", transport.name()),
        format!("--sizes={}", shape.block_len),
        format!("--blocks={}", shape.reads),
        format!("--pool-blocks={}", shape.target_blocks),
        format!("--rounds={rounds}"),
        format!("--stream-batch={stream_batch}"),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut child = SelfChild::spawn(&args, &[("UCX_TLS", transport.ucx_tls())])?;
    // Each round is bounded by the transfer deadline; setup and checks by the process deadline.
    let limit = PROCESS_DEADLINE + TRANSFER_DEADLINE * (rounds as u32 + 1);
    let line = child.wait_line(ROUNDS_LINE, limit)?;
    child.wait_success(PROCESS_DEADLINE)?;
    let bad = || Error::invalid_peer_data(format!("reader's rounds line {line:?}"));
    let mut fields = line.split(' ').map(|f| f.parse::<u64>().map_err(|_| bad()));
    let verified = fields.next().ok_or_else(bad)?? as usize;
    let mut times = fields.map(|ns| ns.map(Duration::from_nanos)).collect::<Result<Vec<_>>>()?;
    if times.len() != 2 * rounds + 1 {
        return Err(bad());
    }
    let cpu = times.pop().ok_or_else(bad)?;
    let baseline = times.split_off(rounds);
    Ok(Rounds { times, baseline, verified, cpu })
}

/// The reader of one native row (`--reader-row`): prints its verified rounds, its READs' and
/// its baseline's round times, and the CPU time of its READs.
fn reader_row(
    backend: Backend,
    transports: &[Transport],
    shapes: &[Shape],
    rounds: usize,
    stream_batch: u32,
) -> Result<()> {
    let ([transport], [shape]) = (transports, shapes) else {
        return Err(Error::invalid_argument("--reader-row takes one transport and one size"));
    };
    let spec = format!("{} {}", backend.name(), transport.name());
    let target = xproc::Target::start(&[], &spec, *shape)?;
    let measured = native_reads(backend, *transport, &target, *shape, rounds, stream_batch)?;
    target.wait_done(READER)?;
    let times: Vec<String> = measured
        .times
        .iter()
        .chain(&measured.baseline)
        .chain([&measured.cpu])
        .map(|t| t.as_nanos().to_string())
        .collect();
    println!("{ROUNDS_LINE}{} {}", measured.verified, times.join(" "));
    Ok(())
}

/// The reads of `backend`'s agent from `target`.
fn native_reads(
    backend: Backend,
    transport: Transport,
    target: &xproc::Target,
    shape: Shape,
    rounds: usize,
    stream_batch: u32,
) -> Result<Rounds> {
    let cpu_time = || -> Result<Duration> { Ok(own_cpu_time()? + target.cpu_time()?) };
    match backend {
        #[cfg(feature = "ucx")]
        Backend::Ucx => {
            let agent = kvx_ucx::UcxAgent::with_config(READER, &kvx_ucx::UcxConfig::default())?;
            read_from(
                Reader::open(agent, &target.metadata, target.base, shape)?,
                transport,
                rounds,
                stream_batch,
                &cpu_time,
            )
        }
        #[cfg(feature = "nixl")]
        Backend::Nixl => {
            let agent = kvx_nixl::NixlAgent::new(READER, &kvx_nixl::NixlConfig::default())?;
            read_from(
                Reader::open(agent, &target.metadata, target.base, shape)?,
                transport,
                rounds,
                stream_batch,
                &cpu_time,
            )
        }
        Backend::Tcp => {
            let agent = kvx_tcp::TcpAgent::with_config(READER, &tcp_config())?;
            let reader = Reader::open(agent, &target.metadata, target.base, shape)?;
            // The agent's I/O threads move the READ: sleep until it ends rather than take a CPU
            // from them polling.
            let wait = &mut |x| reader.agent.wait(x, TRANSFER_DEADLINE).map(drop);
            let measured = timed_rounds(&reader, transport, stream_batch, rounds, wait, &cpu_time)?;
            reader.agent.notify(reader.peer(), xproc::DONE)?;
            Ok(measured)
        }
        other => {
            let _ = (transport, target, shape, rounds, stream_batch, cpu_time);
            Err(Error::new(ErrorKind::Unsupported, format!("no reader process for {}", other.name())))
        }
    }
}

/// The timed rounds from a target in another process, then its [`xproc::DONE`] (the native
/// backends, which progress as their reader polls).
#[cfg(any(feature = "ucx", feature = "nixl"))]
fn read_from<A: TransferAgent>(
    reader: Reader<A>,
    transport: Transport,
    rounds: usize,
    stream_batch: u32,
    cpu_time: &dyn Fn() -> Result<Duration>,
) -> Result<Rounds> {
    let measured = timed_rounds(&reader, transport, stream_batch, rounds, &mut |_| Ok(()), cpu_time)?;
    reader.agent.notify(reader.peer(), xproc::DONE)?;
    Ok(measured)
}

/// If this process was started as a target (`xproc`) or as the TCP baseline's sender, serves in
/// that role and returns how it went; otherwise `None`.
pub(crate) fn serve_child_role() -> Option<Result<()>> {
    if let Some(outcome) = kvx_testkit::baseline::serve_if_child() {
        return Some(outcome);
    }
    let spec = std::env::var(xproc::TARGET_ENV).ok()?;
    let (backend, transport) = spec.split_once(' ').unwrap_or((&spec, ""));
    let transport = match Transport::parse(transport) {
        Ok(t) => t,
        Err(e) => return Some(Err(e)),
    };
    match backend {
        #[cfg(feature = "ucx")]
        "ucx" => xproc::serve_if_child(|_, shape| ucx_target(transport, shape)),
        #[cfg(feature = "nixl")]
        "nixl" => xproc::serve_if_child(|_, shape| {
            let agent = kvx_nixl::NixlAgent::new("bench-target", &kvx_nixl::NixlConfig::default())?;
            let pool = Arc::new(HostMemory::new(shape.target_len())?);
            shape.fill_target(|offset, bytes| pool.write(offset, bytes))?;
            // NIXL progresses when the target drains its notifications: poll hot.
            Ok(xproc::TargetSetup { agent, memory: pool, idle: xproc::Idle::Yield })
        }),
        "tcp" => xproc::serve_if_child(|_, shape| {
            let agent = kvx_tcp::TcpAgent::with_config("bench-target", &tcp_config())?;
            let pool = Arc::new(HostMemory::new(shape.target_len())?);
            shape.fill_target(|offset, bytes| pool.write(offset, bytes))?;
            // The agent's I/O threads serve the READs: park between drains, off the CPUs.
            Ok(xproc::TargetSetup { agent, memory: pool, idle: xproc::Idle::Park(Duration::from_millis(1)) })
        }),
        other => {
            let _ = transport;
            Some(Err(Error::new(ErrorKind::Unsupported, format!("no bench target for backend {other:?}"))))
        }
    }
}

/// kvx-tcp's configuration for a bench process: listening on (and advertising) the bench's host,
/// 127.0.0.1 unless [`HOST_ENV`](kvx_testkit::child::HOST_ENV) names another (the end of a veth
/// pair, `scripts/test-netns.sh across`).
fn tcp_config() -> kvx_tcp::TcpConfig {
    kvx_tcp::TcpConfig::default().with_host(bench_host(), None)
}

/// A UCX target over a UCX-allocated pool: read one-sidedly over shared memory; over TCP, where
/// UCX emulates the READ, its progress thread serves the requests.
#[cfg(feature = "ucx")]
fn ucx_target(transport: Transport, shape: Shape) -> Result<xproc::TargetSetup<kvx_ucx::UcxAgent>> {
    let mut config = kvx_ucx::UcxConfig::default();
    if transport == Transport::Tcp {
        config = config.with_progress_thread(kvx_ucx::ProgressThreadConfig::default());
    }
    let agent = kvx_ucx::UcxAgent::with_config("bench-target", &config)?;
    let pool = agent.alloc_memory(shape.target_len())?;
    shape.fill_target(|offset, bytes| pool.write(offset, bytes))?;
    // The READs need no help from the target's drains: park between them, off the CPUs.
    Ok(xproc::TargetSetup { agent, memory: pool, idle: xproc::Idle::Park(Duration::from_millis(1)) })
}

fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::new(ErrorKind::Io, format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batched_stream_is_named_by_its_batch() {
        assert_eq!(Transport::Tcp.baseline_label(1), "tcp-stream");
        assert_eq!(Transport::Tcp.baseline_label(16), "tcp-stream/16");
        assert_eq!(Transport::Shm.baseline_label(16), "memcpy");
    }

    #[test]
    fn sizes_take_k_and_m_suffixes_and_refuse_the_rest() {
        assert_eq!(parse_size("16K"), Ok(16 << 10));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        for bad in ["", "K", "12X", "0", "12", "-1K", "99999999999999999999M"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }
}
