//! Length-prefixed frames: a 4-byte big-endian length, then that many bytes.
//!
//! The length is checked against the reader's limit as soon as its 4 bytes are in, before any
//! buffer for the body exists; the body is then read into a buffer that grows with the bytes that
//! really arrive (at most 64 KiB reserved ahead), so a peer that claims a large frame and sends
//! little costs little. Writes go out as one buffer (header and body together), so Nagle's
//! algorithm never holds a header back from its body.

use std::fmt;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::timeout;

/// Bytes of a frame's header.
pub const HEADER_LEN: usize = 4;

/// The most a body buffer is reserved ahead of the bytes that arrived.
const RESERVE_AHEAD: usize = 64 << 10;

/// Why a frame could not be read or written.
#[derive(Debug)]
pub enum FrameError {
    /// The peer closed the connection before the frame began (a clean end between frames).
    Closed,
    /// No frame began within the idle wait.
    Idle,
    /// A frame began but did not complete (or a write was not taken) within the exchange timeout.
    Slow,
    /// The header claims more bytes than the reader accepts.
    Oversize {
        /// The length the header claims.
        len: u64,
        /// The reader's limit.
        max: usize,
    },
    /// The connection ended in the middle of a frame.
    Truncated {
        /// Bytes of the frame (header included) that arrived.
        got: usize,
    },
    /// A socket error.
    Io(std::io::Error),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::Closed => f.write_str("the peer closed the connection"),
            FrameError::Idle => f.write_str("no frame began within the idle timeout"),
            FrameError::Slow => f.write_str("the frame was not completed within the exchange timeout"),
            FrameError::Oversize { len, max } => {
                write!(f, "a frame of {len} bytes is over the limit of {max} bytes")
            }
            FrameError::Truncated { got } => {
                write!(f, "the connection ended in the middle of a frame (after {got} bytes)")
            }
            FrameError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Reads one frame of at most `max` bytes. Waits up to `idle` for its first byte, then up to
/// `exchange` for the rest.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    max: usize,
    idle: Duration,
    exchange: Duration,
) -> Result<Vec<u8>, FrameError> {
    let mut header = [0u8; HEADER_LEN];
    let first = match timeout(idle, reader.read(&mut header)).await {
        Err(_) => return Err(FrameError::Idle),
        Ok(Err(e)) => return Err(FrameError::Io(e)),
        Ok(Ok(0)) => return Err(FrameError::Closed),
        Ok(Ok(n)) => n,
    };
    match timeout(exchange, read_rest(reader, header, first, max)).await {
        Ok(result) => result,
        Err(_) => Err(FrameError::Slow),
    }
}

async fn read_rest<R: AsyncRead + Unpin>(
    reader: &mut R,
    mut header: [u8; HEADER_LEN],
    mut got: usize,
    max: usize,
) -> Result<Vec<u8>, FrameError> {
    while got < HEADER_LEN {
        match reader.read(&mut header[got..]).await {
            Ok(0) => return Err(FrameError::Truncated { got }),
            Ok(n) => got += n,
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let len = u32::from_be_bytes(header);
    let len_usize = usize::try_from(len).unwrap_or(usize::MAX);
    if len_usize > max {
        return Err(FrameError::Oversize { len: u64::from(len), max });
    }
    let mut body = Vec::with_capacity(len_usize.min(RESERVE_AHEAD));
    let read = (&mut *reader).take(u64::from(len)).read_to_end(&mut body).await.map_err(FrameError::Io)?;
    if read < len_usize {
        return Err(FrameError::Truncated { got: HEADER_LEN + read });
    }
    Ok(body)
}

/// Writes one frame; the peer must take it within `limit`. A body longer than `u32::MAX` cannot
/// be framed (`Oversize`).
pub async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    body: &[u8],
    limit: Duration,
) -> Result<(), FrameError> {
    let len = u32::try_from(body.len())
        .map_err(|_| FrameError::Oversize { len: body.len() as u64, max: u32::MAX as usize })?;
    let mut buf = Vec::with_capacity(HEADER_LEN + body.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(body);
    match timeout(limit, async {
        writer.write_all(&buf).await?;
        writer.flush().await
    })
    .await
    {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(FrameError::Io(e)),
        Err(_) => Err(FrameError::Slow),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);

    async fn read(bytes: &[u8], max: usize) -> Result<Vec<u8>, FrameError> {
        let mut r = bytes;
        read_frame(&mut r, max, T, T).await
    }

    #[tokio::test]
    async fn frames_round_trip_and_bad_ones_are_refused_before_allocation() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"hello", T).await.unwrap();
        write_frame(&mut buf, b"", T).await.unwrap();
        assert_eq!(&buf[..4], &5u32.to_be_bytes());
        let mut r = &buf[..];
        assert_eq!(read_frame(&mut r, 16, T, T).await.unwrap(), b"hello");
        assert_eq!(read_frame(&mut r, 16, T, T).await.unwrap(), b"");
        assert!(matches!(read_frame(&mut r, 16, T, T).await, Err(FrameError::Closed)));

        assert!(matches!(read(&buf[..9], 4).await, Err(FrameError::Oversize { len: 5, max: 4 })));
        let huge = u32::MAX.to_be_bytes();
        assert!(matches!(read(&huge, 16 << 20).await, Err(FrameError::Oversize { .. })));
        assert!(matches!(read(&buf[..2], 16).await, Err(FrameError::Truncated { got: 2 })));
        assert!(matches!(read(&buf[..7], 16).await, Err(FrameError::Truncated { got: 7 })));
    }
}
