//! Baselines that benchmarks measure in the same run as kvx's READs: a plain TCP stream between
//! two processes over 127.0.0.1, moving the same scattered blocks as an [`xproc`](crate::xproc)
//! READ of the same [`Shape`]. (Single-thread memcpy of the blocks is [`Shape::memcpy_rounds`].)
//!
//! [`tcp_stream_rounds`] starts this executable again as the sender ([`SENDER_ENV`] set; the
//! child calls [`serve_if_child`] first thing). Per round the receiver sends the round's number,
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

/// If this process is a sender child (started by [`tcp_stream_rounds`]), serves one receiver and
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

/// Times of `rounds` transfers of `shape`'s scattered blocks over a TCP stream from a sender
/// process (one untimed warm-up round first); the first and last rounds' bytes are checked.
/// `args` select the child's entry point, as for [`Target::start`](crate::xproc::Target::start).
pub fn tcp_stream_rounds(args: &[&str], shape: Shape, rounds: usize) -> Result<Vec<Duration>> {
    let mut child = SelfChild::spawn(args, &[(SENDER_ENV, "1"), (SHAPE_ENV, &shape.to_env())])?;
    let port = child.wait_line(PORT_LINE, PROCESS_DEADLINE)?;
    let port: u16 = port.parse().map_err(|_| Error::invalid_peer_data(format!("sender port {port:?}")))?;
    let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).map_err(io("connect"))?;
    stream.set_read_timeout(Some(PROCESS_DEADLINE)).map_err(io("set_read_timeout"))?;
    let bl = shape.block_len;
    let mut dst = vec![0u8; shape.read_len()];
    let mut times = Vec::new();
    for round in 0..=rounds {
        dst.fill(0);
        let start = Instant::now();
        stream.write_all(&(round as u64).to_le_bytes()).map_err(io("write"))?;
        for i in 0..shape.reads {
            let d = shape.local_slot(i) * bl;
            stream.read_exact(&mut dst[d..d + bl]).map_err(io("read"))?;
        }
        let elapsed = start.elapsed();
        if round == 0 || round == rounds {
            shape.check_round(round, |slot, block| {
                block.copy_from_slice(&dst[slot * bl..slot * bl + bl]);
                Ok(())
            })?;
        }
        if round > 0 {
            times.push(elapsed);
        }
    }
    drop(stream);
    child.wait_success(PROCESS_DEADLINE)?;
    Ok(times)
}

fn io(what: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::new(ErrorKind::Io, format!("TCP baseline: {what}: {e}"))
}
