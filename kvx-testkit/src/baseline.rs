//! Baselines that benchmarks measure in the same run as kvx's READs: a plain TCP stream between
//! two processes over 127.0.0.1 (or the [`HOST_ENV`](crate::child::HOST_ENV) address the sender
//! is given, the sender started by [`SelfChild::spawn_peer`]), moving the same scattered blocks as an [`xproc`](crate::xproc)
//! READ of the same [`Shape`]. (Single-thread memcpy of the blocks is [`Shape::memcpy_rounds`].)
//!
//! [`TcpStreamBaseline::start`] starts this executable again as the sender ([`SENDER_ENV`] set;
//! the child calls [`serve_if_child`] first thing). Per round the receiver sends the round's number,
//! the sender writes the round's scattered blocks straight from its memory, one write per block,
//! and the receiver reads each straight into its local slot: the time from request to last byte
//! is what a READ over TCP could take at best with one stream and no framing.
//!
//! With a batch of `n` blocks ([`TcpStreamBaseline::start_batched`]) each system call moves up to
//! `n` blocks instead (`writev` from their scattered places, `readv` into their slots): what a
//! TCP data path of kvx's own could do with fewer system calls per block.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use kvx_core::{Error, ErrorKind, HostMemory, Result};

use crate::child::{SelfChild, bench_host};
use crate::xproc::{PROCESS_DEADLINE, SHAPE_ENV, Shape};

/// Set in the child's environment: the child is a TCP sender.
pub const SENDER_ENV: &str = "KVX_TCP_BASELINE_SENDER";
/// Set in the child's environment: blocks per system call (1 unless set).
const BATCH_ENV: &str = "KVX_TCP_BASELINE_BATCH";

const ADDRESS_LINE: &str = "KVX-TCP-BASELINE-ADDRESS ";

/// If this process is a sender child (started by [`TcpStreamBaseline::start`]), serves one receiver and
/// returns how that went; otherwise returns `None` at once.
pub fn serve_if_child() -> Option<Result<()>> {
    std::env::var_os(SENDER_ENV)?;
    let batch = std::env::var(BATCH_ENV).map_or(Ok(1), |b| {
        b.parse::<usize>()
            .ok()
            .filter(|&b| b > 0)
            .ok_or_else(|| Error::invalid_argument(format!("{BATCH_ENV}={b:?}")))
    });
    Some(Shape::from_env().and_then(|shape| send(shape, batch?)))
}

fn send(shape: Shape, batch: usize) -> Result<()> {
    // HostMemory, as the READs' pools are, so that both sides run on the same kind of pages.
    let mut pool = HostMemory::new(shape.target_len())?;
    let src = pool.as_mut_slice();
    shape.fill_target(|offset, bytes| {
        src[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    })?;
    let src: &[u8] = src;
    let host = bench_host();
    let listener = TcpListener::bind((host.as_str(), 0)).map_err(io("bind"))?;
    let address = listener.local_addr().map_err(io("local_addr"))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{ADDRESS_LINE}{address}").and_then(|()| out.flush()).map_err(io("writing stdout"))?;
    // The receiver connects as soon as it reads the port; a receiver that never comes leaves
    // this child to be killed by its parent's bound.
    let (mut stream, _) = listener.accept().map_err(io("accept"))?;
    stream.set_read_timeout(Some(PROCESS_DEADLINE)).map_err(io("set_read_timeout"))?;
    // Without it a round's last partial segment can wait for a delayed ACK (about 40 ms).
    stream.set_nodelay(true).map_err(io("set_nodelay"))?;
    let bl = shape.block_len;
    let mut request = [0u8; 8];
    // Each request names a round; the receiver closing the connection ends the loop.
    while stream.read_exact(&mut request).is_ok() {
        let round = usize::try_from(u64::from_le_bytes(request))
            .map_err(|_| Error::invalid_peer_data("round number past usize"))?;
        let blocks: Vec<usize> = (0..shape.reads).map(|i| shape.remote_block(i, round) * bl).collect();
        for chunk in blocks.chunks(batch) {
            let mut slices: Vec<IoSlice<'_>> = chunk.iter().map(|&s| IoSlice::new(&src[s..s + bl])).collect();
            let mut slices = &mut slices[..];
            while !slices.is_empty() {
                let n = stream.write_vectored(slices).map_err(io("write"))?;
                if n == 0 {
                    return Err(io("write")(std::io::ErrorKind::WriteZero.into()));
                }
                IoSlice::advance_slices(&mut slices, n);
            }
        }
    }
    Ok(())
}

/// A TCP stream from a sender process, one round at a time (so that a bench can interleave it
/// with its READs, round by round); the sender is killed on drop if still running.
#[derive(Debug)]
pub struct TcpStreamBaseline {
    child: SelfChild,
    stream: TcpStream,
    shape: Shape,
    batch: usize,
    dst: HostMemory,
}

impl TcpStreamBaseline {
    /// Starts the sender (this executable again, `args` selecting its entry point) and connects.
    pub fn start(args: &[&str], shape: Shape) -> Result<TcpStreamBaseline> {
        Self::start_batched(args, shape, 1)
    }

    /// As [`start`](Self::start), with up to `batch` blocks per system call on both sides
    /// (`writev`, `readv`); `batch` is at least 1.
    pub fn start_batched(args: &[&str], shape: Shape, batch: usize) -> Result<TcpStreamBaseline> {
        let batch = batch.max(1);
        let env = [(SENDER_ENV, "1".to_owned()), (SHAPE_ENV, shape.to_env()), (BATCH_ENV, batch.to_string())];
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut child = SelfChild::spawn_peer(args, &env)?;
        let address = child.wait_line(ADDRESS_LINE, PROCESS_DEADLINE)?;
        let address: SocketAddr =
            address.parse().map_err(|_| Error::invalid_peer_data(format!("sender address {address:?}")))?;
        let stream = TcpStream::connect(address).map_err(io("connect"))?;
        stream.set_read_timeout(Some(PROCESS_DEADLINE)).map_err(io("set_read_timeout"))?;
        stream.set_nodelay(true).map_err(io("set_nodelay"))?;
        let dst = HostMemory::new(shape.read_len())?;
        Ok(TcpStreamBaseline { child, stream, shape, batch, dst })
    }

    /// Moves round `round`'s blocks into their slots; returns the time from request to last
    /// byte. `check`: every byte is checked after (untimed).
    pub fn round(&mut self, round: usize, check: bool) -> Result<Duration> {
        let (shape, bl, batch) = (self.shape, self.shape.block_len, self.batch);
        let TcpStreamBaseline { stream, dst, .. } = self;
        let dst = dst.as_mut_slice();
        dst.fill(0);
        // Each slot once, in the order the sender writes them; prepared before the clock starts.
        let mut slots: Vec<Option<&mut [u8]>> = dst.chunks_exact_mut(bl).map(Some).collect();
        let mut wanted = (0..shape.reads)
            .map(|i| {
                let s = shape.local_slot(i);
                let slot = slots.get_mut(s).and_then(Option::take);
                slot.map(IoSliceMut::new).ok_or_else(|| {
                    Error::invalid_argument(format!("TCP baseline: slot {s} read twice or past the end"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let start = Instant::now();
        stream.write_all(&(round as u64).to_le_bytes()).map_err(io("write"))?;
        for mut chunk in wanted.chunks_mut(batch) {
            while !chunk.is_empty() {
                let n = stream.read_vectored(chunk).map_err(io("read"))?;
                if n == 0 {
                    return Err(io("read")(std::io::ErrorKind::UnexpectedEof.into()));
                }
                IoSliceMut::advance_slices(&mut chunk, n);
            }
        }
        let elapsed = start.elapsed();
        if check {
            shape.check_round(round, |slot, block| {
                block.copy_from_slice(&dst[slot * bl..slot * bl + bl]);
                Ok(())
            })?;
        }
        Ok(elapsed)
    }

    /// Closes the stream and waits (bounded) for the sender to exit successfully.
    pub fn finish(self) -> Result<()> {
        let TcpStreamBaseline { child, stream, .. } = self;
        drop(stream);
        child.wait_success(PROCESS_DEADLINE)
    }
}

fn io(what: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::new(ErrorKind::Io, format!("TCP baseline: {what}: {e}"))
}
