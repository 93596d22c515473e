//! The decoders of what a peer sends on a kvx-tcp connection, public so that kvx-fuzz can feed
//! them arbitrary bytes: a session opening's body, a frame's header, and a request's ranges.
//! They are the very functions the agent's connections run (the wire format and its checks are
//! in the [crate documentation](crate#wire-format)); every refusal is an `InvalidPeerData` error.

use kvx_core::Result;

pub use crate::frame::{HEADER_LEN, Header, Kind, OK, REFUSED, Side};
pub use crate::link::Opening;

use crate::frame::{self, Limits};

/// Decodes and checks a header that `side` read, with at most `max_data` bytes of data (the
/// target's `max_frame`, the initiator's `chunk_bytes`).
pub fn decode_header(bytes: &[u8; HEADER_LEN], side: Side, max_data: u64) -> Result<Header> {
    Ok(frame::read_header(bytes, side, Limits { max_data })?)
}

/// A request's ranges `(address, length)` from its checked header and its `meta_len` bytes of
/// metadata, as the target checks them before it looks at its memory: `count` ranges, each
/// non-empty and inside the address space, at most `max_data` bytes in all, and a WRITE's data
/// exactly as long. Returns the ranges and their total length.
pub fn decode_request(header: &Header, meta: &[u8], max_data: u64) -> Result<(Vec<(u64, u64)>, u64)> {
    Ok(frame::request_ranges(header, meta, max_data)?)
}

/// A request's metadata for `ranges`, as the initiator sends it.
pub fn encode_ranges(ranges: &[(u64, u64)]) -> Vec<u8> {
    frame::encode_ranges(ranges.iter().copied())
}
