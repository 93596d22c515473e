//! Hostile peers for network tests: the bytes that once aborted kvx, and a client that sends
//! bytes to a server and waits, bounded, for the server to drop the connection.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

/// The 64-byte ZMTP 3.0 greeting (NULL mechanism) and a long command frame header claiming 2^40
/// bytes: 73 bytes that aborted any process serving or fetching a zeromq side channel.
pub fn zmtp_73() -> Vec<u8> {
    let mut b = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F, 3, 0];
    b.extend(b"NULL");
    b.resize(64, 0);
    b.push(0x06);
    b.extend((1u64 << 40).to_be_bytes());
    b
}

/// Connects to `127.0.0.1:port`, sends `bytes` (then half-closes if `half_close`), and reads
/// until the server closes the connection. `Err(TimedOut)` if it is still open after `limit`.
pub fn attack(port: u16, bytes: &[u8], half_close: bool, limit: Duration) -> std::io::Result<()> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(limit))?;
    // The server may drop the connection before it has read everything: not an error here.
    let _ = s.write_all(bytes);
    if half_close {
        let _ = s.shutdown(Shutdown::Write);
    }
    let mut sink = [0u8; 4096];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("port {port} did not close the connection within {limit:?}"),
                ));
            }
            // A reset: closed with our bytes unread.
            Err(_) => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_zmtp_frame_is_73_bytes_and_claims_two_to_the_forty() {
        let b = zmtp_73();
        assert_eq!(b.len(), 73);
        assert_eq!(b[64], 0x06);
        assert_eq!(u64::from_be_bytes(b[65..].try_into().unwrap_or_default()), 1 << 40);
    }
}
