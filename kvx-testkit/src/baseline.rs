//! Baselines that benchmarks measure in the same run as kvx's READs: a plain TCP stream between
//! two processes over 127.0.0.1, moving the same scattered blocks as an [`xproc`](crate::xproc)
//! READ of the same [`Shape`]. (Single-thread memcpy of the blocks is [`Shape::memcpy_rounds`].)
//!
//! [`TcpStreamBaseline::start`] starts this executable again as the sender ([`SENDER_ENV`] set;
//! the child calls [`serve_if_child`] first thing). Per round the receiver sends the round's number,
//! the sender writes the round's scattered blocks straight from its memory, one write per block,
//! and the receiver reads each straight into its local slot: the time from request to last byte
//! is what a READ over TCP could take at best with one stream and no framing.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use kvx_core::{Error, ErrorKind, Result};

use crate::child::SelfChild;
use crate::xproc::{PROCESS_DEADLINE, SHAPE_ENV, Shape};

/// Set in the child's environment: the child is a TCP sender.
pub const SENDER_ENV: &str = "KVX_TCP_BASELINE_SENDER";

const PORT_LINE: &str = "KVX-TCP-BASELINE-PORT ";

/// If this process is a sender child (started by [`TcpStreamBaseline::start`]), serves one receiver and
/// returns how that went; otherwise returns `None` at once.
pub fn serve_if_child() -> Option<Result<()>> {
    std::env::var_os(SENDER_ENV)?;
    Some(Shape::from_env().and_then(send))
}

fn send(shape: Shape) -> Result<()> {
    let mut src = vec![0u8; shape.target_len()];
    shape.fill_target(|offset, bytes| {
        src[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    })?;
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io("bind 127.0.0.1"))?;
    let port = listener.local_addr().map_err(io("local_addr"))?.port();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{PORT_LINE}{port}").and_then(|()| out.flush()).map_err(io("writing stdout"))?;
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
        for i in 0..shape.reads {
            let s = shape.remote_block(i, round) * bl;
            stream.write_all(&src[s..s + bl]).map_err(io("write"))?;
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
    dst: Vec<u8>,
}

impl TcpStreamBaseline {
    /// Starts the sender (this executable again, `args` selecting its entry point) and connects.
    pub fn start(args: &[&str], shape: Shape) -> Result<TcpStreamBaseline> {
        let mut child = SelfChild::spawn(args, &[(SENDER_ENV, "1"), (SHAPE_ENV, &shape.to_env())])?;
        let port = child.wait_line(PORT_LINE, PROCESS_DEADLINE)?;
        let port: u16 =
            port.parse().map_err(|_| Error::invalid_peer_data(format!("sender port {port:?}")))?;
        let stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).map_err(io("connect"))?;
        stream.set_read_timeout(Some(PROCESS_DEADLINE)).map_err(io("set_read_timeout"))?;
        stream.set_nodelay(true).map_err(io("set_nodelay"))?;
        Ok(TcpStreamBaseline { child, stream, shape, dst: vec![0u8; shape.read_len()] })
    }

    /// Moves round `round`'s blocks into their slots; returns the time from request to last
    /// byte. `check`: every byte is checked after (untimed).
    pub fn round(&mut self, round: usize, check: bool) -> Result<Duration> {
        let (shape, bl) = (self.shape, self.shape.block_len);
        self.dst.fill(0);
        let start = Instant::now();
        self.stream.write_all(&(round as u64).to_le_bytes()).map_err(io("write"))?;
        for i in 0..shape.reads {
            let d = shape.local_slot(i) * bl;
            self.stream.read_exact(&mut self.dst[d..d + bl]).map_err(io("read"))?;
        }
        let elapsed = start.elapsed();
        if check {
            shape.check_round(round, |slot, block| {
                block.copy_from_slice(&self.dst[slot * bl..slot * bl + bl]);
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
