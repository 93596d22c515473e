//! The frames of a kvx-tcp data connection, after the session opening: a fixed 40-byte header,
//! then `meta_len` bytes of metadata (ranges, or a notification), then `data_len` bytes of data
//! (the ranges' bytes). Every integer is little-endian.
//!
//! ```text
//! magic u16 | kind u8 | status u8 | count u32 | xfer u64 | nonce u64 | first u32 | meta_len u32 | data_len u64
//! ```
//!
//! The reader checks a header ([`Header::check`]) before it reads or allocates anything after
//! it: the kind must be one its end takes, the counts and lengths must agree, and `meta_len` and
//! `data_len` must be within the limits. A request's ranges ([`decode_ranges`]) are `count`
//! `(address u64, length u64)` pairs, each non-empty and inside the address space.

use kvx_core::MAX_NOTIFICATION_LEN;

use crate::error::TcpError;

/// Bytes of a header.
pub const HEADER_LEN: usize = 40;
/// The first two bytes of every header ("kt").
const MAGIC: u16 = 0x746b;
/// Ranges per request at most (16 bytes each).
pub(crate) const MAX_RANGES: usize = 1024;
/// Bytes of one range in a request.
const RANGE_LEN: usize = 16;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Initiator to target: send me these ranges of your memory (meta: ranges).
    ReadRequest = 1,
    /// Target to initiator: the ranges of a READ request (data), or its refusal (no data).
    ReadData = 2,
    /// Initiator to target: put these bytes (data) into these ranges of your memory (meta).
    WriteRequest = 3,
    /// Target to initiator: a WRITE request's bytes are in place, or it was refused.
    WriteAck = 4,
    /// Either way round on the sender's connection: a notification (meta: its payload).
    Notify = 5,
}

impl Kind {
    fn of(byte: u8) -> Option<Kind> {
        [Kind::ReadRequest, Kind::ReadData, Kind::WriteRequest, Kind::WriteAck, Kind::Notify]
            .into_iter()
            .find(|k| *k as u8 == byte)
    }

    /// Whether the target (the listening end of a connection) takes this kind.
    pub fn to_target(self) -> bool {
        matches!(self, Kind::ReadRequest | Kind::WriteRequest | Kind::Notify)
    }
}

/// An answer's status.
pub const OK: u8 = 0;
/// An answer's status: the target refused the request (a range outside its live registrations).
pub const REFUSED: u8 = 1;

/// One frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub kind: Kind,
    /// [`OK`] or [`REFUSED`] in answers; 0 otherwise.
    pub status: u8,
    /// Ranges the request names, or the answer answers.
    pub count: u32,
    /// The transfer's id at its initiator.
    pub xfer: u64,
    /// The random nonce the initiator drew for the transfer.
    pub nonce: u64,
    /// The index of the first range, in the transfer's ranges.
    pub first: u32,
    /// Bytes of metadata after the header (ranges, or a notification).
    pub meta_len: u32,
    /// Bytes of data after the metadata.
    pub data_len: u64,
}

/// What a reader accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The most data bytes of one frame.
    pub(crate) max_data: u64,
}

impl Header {
    /// A header of `kind` for chunk `first..first + count` of transfer `xfer`, with no payload.
    pub(crate) fn new(kind: Kind, xfer: u64, nonce: u64, first: u32, count: u32) -> Self {
        Header { kind, status: OK, count, xfer, nonce, first, meta_len: 0, data_len: 0 }
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = self.kind as u8;
        out[3] = self.status;
        out[4..8].copy_from_slice(&self.count.to_le_bytes());
        out[8..16].copy_from_slice(&self.xfer.to_le_bytes());
        out[16..24].copy_from_slice(&self.nonce.to_le_bytes());
        out[24..28].copy_from_slice(&self.first.to_le_bytes());
        out[28..32].copy_from_slice(&self.meta_len.to_le_bytes());
        out[32..].copy_from_slice(&self.data_len.to_le_bytes());
        out
    }

    /// Decodes and checks a header (see [`check`](Self::check)).
    pub(crate) fn decode(bytes: &[u8; HEADER_LEN], limits: Limits) -> Result<Header, TcpError> {
        let u32_at = |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let u64_at = |i: usize| (u64::from(u32_at(i + 4)) << 32) | u64::from(u32_at(i));
        let magic = u16::from_le_bytes([bytes[0], bytes[1]]);
        if magic != MAGIC {
            return Err(TcpError::Malformed(format!("magic {magic:#06x}: not a kvx-tcp frame")));
        }
        let kind = Kind::of(bytes[2]).ok_or_else(|| TcpError::Malformed(format!("kind {}", bytes[2])))?;
        let header = Header {
            kind,
            status: bytes[3],
            count: u32_at(4),
            xfer: u64_at(8),
            nonce: u64_at(16),
            first: u32_at(24),
            meta_len: u32_at(28),
            data_len: u64_at(32),
        };
        header.check(limits)?;
        Ok(header)
    }

    /// Checks that the counts and lengths agree for the kind, and bounds what follows the header.
    fn check(&self, limits: Limits) -> Result<(), TcpError> {
        let malformed = |why: &str| Err(TcpError::Malformed(format!("{:?}: {why}", self.kind)));
        let oversize = |what, len, max| Err(TcpError::Oversize { what, len, max });
        let ranges = |h: &Header| {
            let count = h.count as usize;
            (1..=MAX_RANGES).contains(&count) && h.first.checked_add(h.count - 1).is_some()
        };
        if self.data_len > limits.max_data {
            return oversize("data", self.data_len, limits.max_data);
        }
        match self.kind {
            Kind::ReadRequest | Kind::WriteRequest => {
                if self.meta_len as usize > MAX_RANGES * RANGE_LEN {
                    return oversize("ranges", u64::from(self.meta_len), (MAX_RANGES * RANGE_LEN) as u64);
                }
                if self.status != OK
                    || !ranges(self)
                    || self.meta_len as usize != self.count as usize * RANGE_LEN
                {
                    return malformed("count, first and ranges disagree");
                }
                if self.kind == Kind::ReadRequest && self.data_len != 0 {
                    return malformed("a READ request carries no data");
                }
            }
            Kind::ReadData | Kind::WriteAck => {
                if self.meta_len != 0 || !ranges(self) || !matches!(self.status, OK | REFUSED) {
                    return malformed("count, first, status or metadata");
                }
                if (self.kind == Kind::WriteAck || self.status == REFUSED) && self.data_len != 0 {
                    return malformed("data where there is none");
                }
            }
            Kind::Notify => {
                if self.meta_len as usize > MAX_NOTIFICATION_LEN {
                    return oversize("notification", u64::from(self.meta_len), MAX_NOTIFICATION_LEN as u64);
                }
                if self.status != OK || self.count != 0 || self.data_len != 0 {
                    return malformed("a notification has its payload only");
                }
            }
        }
        Ok(())
    }
}

/// Which end of a connection reads a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The listening end: it takes requests and notifications.
    Target,
    /// The connecting end: it takes answers.
    Initiator,
}

/// Decodes and checks a header that `side` read: [`Header::check`]'s checks, and a kind that
/// `side` takes.
pub(crate) fn read_header(bytes: &[u8; HEADER_LEN], side: Side, limits: Limits) -> Result<Header, TcpError> {
    let header = Header::decode(bytes, limits)?;
    if header.kind.to_target() != (side == Side::Target) {
        return Err(TcpError::Malformed(format!("a {:?} sent to the {side:?}", header.kind)));
    }
    Ok(header)
}

/// A request's ranges, checked as the target serves them: [`decode_ranges`], at most
/// `max_data` bytes in all, and a WRITE's data exactly as long as its ranges. Returns the
/// ranges and their total length.
pub(crate) fn request_ranges(
    header: &Header,
    meta: &[u8],
    max_data: u64,
) -> Result<(Vec<(u64, u64)>, u64), TcpError> {
    let ranges = decode_ranges(header, meta)?;
    let total = ranges.iter().try_fold(0u64, |sum, &(_, len)| sum.checked_add(len));
    let total = total.filter(|&t| t <= max_data).ok_or(TcpError::Oversize {
        what: "ranges",
        len: u64::MAX,
        max: max_data,
    })?;
    if header.kind == Kind::WriteRequest && header.data_len != total {
        return Err(TcpError::Malformed(format!(
            "{} bytes of data for {total} bytes of ranges",
            header.data_len
        )));
    }
    Ok((ranges, total))
}

/// A request's metadata: `(address, length)` of each range.
pub(crate) fn encode_ranges(ranges: impl Iterator<Item = (u64, u64)>) -> Vec<u8> {
    let mut out = Vec::new();
    for (addr, len) in ranges {
        out.extend_from_slice(&addr.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
    }
    out
}

/// A request's ranges, from its checked header's `count` and its metadata: each non-empty and
/// inside the address space.
pub(crate) fn decode_ranges(header: &Header, meta: &[u8]) -> Result<Vec<(u64, u64)>, TcpError> {
    if meta.len() != header.count as usize * RANGE_LEN {
        return Err(TcpError::Malformed(format!(
            "{} bytes of ranges for {} ranges",
            meta.len(),
            header.count
        )));
    }
    meta.chunks_exact(RANGE_LEN)
        .map(|c| {
            let (addr, len) = c.split_at(8);
            let addr = u64::from_le_bytes(addr.try_into().unwrap_or_default());
            let len = u64::from_le_bytes(len.try_into().unwrap_or_default());
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(TcpError::Malformed(format!("range {addr:#x}+{len}")));
            }
            Ok((addr, len))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { max_data: 1 << 20 };

    fn round_trip(h: Header) -> Result<Header, TcpError> {
        Header::decode(&h.encode(), LIMITS)
    }

    fn request(count: u32) -> Header {
        Header { meta_len: count * RANGE_LEN as u32, ..Header::new(Kind::ReadRequest, 7, 0x5eed, 3, count) }
    }

    #[test]
    fn headers_round_trip() {
        let cases = [
            request(2),
            Header { data_len: 4096, ..request(1) }.with_kind(Kind::WriteRequest),
            Header { data_len: 4096, ..Header::new(Kind::ReadData, u64::MAX, 1, u32::MAX, 1) },
            Header { status: REFUSED, ..Header::new(Kind::ReadData, 1, 2, 0, 5) },
            Header::new(Kind::WriteAck, 1, 2, 0, 5),
            Header { meta_len: MAX_NOTIFICATION_LEN as u32, ..Header::new(Kind::Notify, 0, 0, 0, 0) },
        ];
        for h in cases {
            assert_eq!(round_trip(h).unwrap(), h);
        }
    }

    impl Header {
        fn with_kind(self, kind: Kind) -> Header {
            Header { kind, ..self }
        }
    }

    #[test]
    fn malformed_headers_are_refused() {
        let mut bad_magic = request(1).encode();
        bad_magic[0] ^= 1;
        assert!(matches!(Header::decode(&bad_magic, LIMITS), Err(TcpError::Malformed(_))));
        let mut bad_kind = request(1).encode();
        bad_kind[2] = 9;
        assert!(matches!(Header::decode(&bad_kind, LIMITS), Err(TcpError::Malformed(_))));
        for h in [
            request(0),                                                        // no ranges
            Header { meta_len: 15, ..request(1) },                             // count and ranges disagree
            Header { data_len: 1, ..request(1) },                              // a READ request with data
            Header { first: u32::MAX, ..request(2) },                          // indices past 32 bits
            Header { status: 2, ..request(1) },                                // a status in a request
            Header { status: 2, ..Header::new(Kind::ReadData, 1, 2, 0, 1) },   // an unknown status
            Header { meta_len: 1, ..Header::new(Kind::ReadData, 1, 2, 0, 1) }, // an answer with ranges
            Header { status: REFUSED, data_len: 8, ..Header::new(Kind::ReadData, 1, 2, 0, 1) },
            Header { data_len: 8, ..Header::new(Kind::WriteAck, 1, 2, 0, 1) },
            Header { count: 1, ..Header::new(Kind::Notify, 0, 0, 0, 0) },
        ] {
            assert!(matches!(round_trip(h), Err(TcpError::Malformed(_))), "{h:?}");
        }
    }

    /// Oversize frames are refused from their header, before anything is read or allocated.
    #[test]
    fn oversize_frames_are_refused_from_their_header() {
        let over = |h: Header| matches!(round_trip(h), Err(TcpError::Oversize { .. }));
        assert!(over(Header { data_len: LIMITS.max_data + 1, ..Header::new(Kind::ReadData, 1, 2, 0, 1) }));
        assert!(over(Header { data_len: u64::MAX, ..request(1) }.with_kind(Kind::WriteRequest)));
        assert!(over(Header { meta_len: u32::MAX, count: u32::MAX, ..request(1) }));
        let note =
            Header { meta_len: MAX_NOTIFICATION_LEN as u32 + 1, ..Header::new(Kind::Notify, 0, 0, 0, 0) };
        assert!(over(note));
        assert!(
            round_trip(Header { data_len: LIMITS.max_data, ..Header::new(Kind::ReadData, 1, 2, 0, 1) })
                .is_ok()
        );
    }

    #[test]
    fn ranges_round_trip_and_bad_ones_are_refused() {
        let ranges = [(0x1000, 64), (0x2000, 32)];
        let meta = encode_ranges(ranges.into_iter());
        assert_eq!(decode_ranges(&request(2), &meta).unwrap(), ranges);
        assert!(decode_ranges(&request(1), &meta).is_err());
        assert!(decode_ranges(&request(2), &meta[..31]).is_err());
        for bad in [(0x1000, 0), (u64::MAX - 3, 4)] {
            assert!(decode_ranges(&request(1), &encode_ranges([bad].into_iter())).is_err(), "{bad:?}");
        }
    }

    /// Arbitrary headers: decoding never panics, and whatever it accepts is within the limits.
    #[test]
    fn arbitrary_headers_decode_within_limits_or_not_at_all() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut accepted = 0;
        for _ in 0..50_000 {
            let mut bytes = [0u8; HEADER_LEN];
            bytes.iter_mut().for_each(|b| *b = next() as u8);
            bytes[..2].copy_from_slice(&MAGIC.to_le_bytes());
            bytes[2] = (next() % 7) as u8;
            bytes[3] = (next() % 3) as u8;
            if next() % 2 == 0 {
                bytes[4..8].copy_from_slice(&((next() % 4) as u32).to_le_bytes());
                bytes[28..32].copy_from_slice(&((next() % 4) as u32 * 16).to_le_bytes());
                bytes[32..].copy_from_slice(&(next() % (2 * LIMITS.max_data)).to_le_bytes());
            }
            let Ok(h) = Header::decode(&bytes, LIMITS) else { continue };
            accepted += 1;
            assert!(h.data_len <= LIMITS.max_data);
            assert!(h.meta_len as usize <= (MAX_RANGES * RANGE_LEN).max(MAX_NOTIFICATION_LEN));
        }
        assert!(accepted > 0, "no arbitrary header was well-formed: the test draws nothing useful");
    }
}
