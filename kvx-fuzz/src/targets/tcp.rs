//! kvx-tcp's decoders of a peer's bytes ([`kvx_tcp::wire`]): a data connection's frame headers
//! at either end, a request's ranges as the target checks them, and the session opening's body.

use kvx_core::{AgentName, ErrorKind, MAX_NOTIFICATION_LEN};
use kvx_tcp::wire::{self, HEADER_LEN, Header, Kind, OK, Opening, REFUSED, Side};

use crate::seeds::{self, Seed};

/// The limits the targets pick from (the first byte of a header input): none, a byte, a page,
/// the default chunk, the default `max_frame`, and none at all.
const MAX_DATA: [u64; 6] = [0, 1, 4096, 1 << 20, 16 << 20, u64::MAX];
/// The target's limit in `tcp_request` (the default `max_frame`).
const MAX_FRAME: u64 = 16 << 20;
/// The most ranges of one request.
const MAX_RANGES: u32 = kvx_tcp::MAX_RANGES as u32;

fn refused_as_peer_data(e: &kvx_core::Error, what: &str) {
    assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "{what} refused with another kind: {e}");
}

/// Whatever `decode_header` accepts is within its limits, of a kind `side` takes, with counts and
/// lengths that agree, and encodes back to the same 40 bytes.
fn check_header(h: &Header, bytes: &[u8; HEADER_LEN], side: Side, max_data: u64) {
    assert_eq!(&h.encode(), bytes, "{h:?} does not encode back to its bytes");
    assert!(h.data_len <= max_data, "{h:?} passed a limit of {max_data} bytes of data");
    assert_eq!(h.kind.to_target(), side == Side::Target, "{h:?} accepted at the {side:?}");
    let indices = || (1..=MAX_RANGES).contains(&h.count) && h.first.checked_add(h.count - 1).is_some();
    match h.kind {
        Kind::ReadRequest | Kind::WriteRequest => {
            assert!(indices() && h.status == OK, "{h:?}");
            assert_eq!(h.meta_len as u64, u64::from(h.count) * 16, "{h:?}: ranges and count disagree");
            assert!(h.kind == Kind::WriteRequest || h.data_len == 0, "a READ request with data: {h:?}");
        }
        Kind::ReadData | Kind::WriteAck => {
            assert!(indices() && h.meta_len == 0 && matches!(h.status, OK | REFUSED), "{h:?}");
            assert!(
                h.kind == Kind::ReadData && h.status == OK || h.data_len == 0,
                "data where none is: {h:?}"
            );
        }
        Kind::Notify => {
            assert!(h.meta_len as usize <= MAX_NOTIFICATION_LEN, "{h:?}: an oversize notification");
            assert!(h.status == OK && h.count == 0 && h.data_len == 0, "{h:?}");
        }
    }
}

/// A frame header as either end reads it: the first byte picks the end (bit 7) and the limit on
/// data (`MAX_DATA`), the next 40 are the header. What decodes obeys [`Header`]'s rules and
/// encodes back to the same bytes; what does not is `InvalidPeerData`.
pub fn tcp_frame_header(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else { return };
    let Some(bytes) = rest.get(..HEADER_LEN).and_then(|b| <&[u8; HEADER_LEN]>::try_from(b).ok()) else {
        return;
    };
    let side = if pick & 0x80 == 0 { Side::Target } else { Side::Initiator };
    let max_data = MAX_DATA[usize::from(pick & 0x7f) % MAX_DATA.len()];
    match wire::decode_header(bytes, side, max_data) {
        Ok(h) => check_header(&h, bytes, side, max_data),
        Err(e) => refused_as_peer_data(&e, "a header"),
    }
}

/// A request as the target reads it (its `max_frame` 16 MiB): a header, then its `meta_len` bytes
/// of metadata; a request's ranges are checked as the target checks them before it looks at its
/// memory. Accepted ranges are `count` non-empty ranges inside the address space, within the
/// limit in all, a WRITE's data as long as they are, and encode back to the metadata. The ranges
/// are also decoded from all the bytes after the header (a metadata length the header did not
/// announce), which must be refused unless it is the announced length.
pub fn tcp_request(data: &[u8]) {
    let Some(bytes) = data.get(..HEADER_LEN).and_then(|b| <&[u8; HEADER_LEN]>::try_from(b).ok()) else {
        return;
    };
    let header = match wire::decode_header(bytes, Side::Target, MAX_FRAME) {
        Ok(h) => h,
        Err(e) => return refused_as_peer_data(&e, "a header"),
    };
    check_header(&header, bytes, Side::Target, MAX_FRAME);
    if header.kind == Kind::Notify {
        return;
    }
    let after = &data[HEADER_LEN..];
    if let Ok((ranges, _)) = wire::decode_request(&header, after, MAX_FRAME) {
        assert_eq!(after.len(), header.meta_len as usize, "ranges of a length the header did not announce");
        assert_eq!(ranges.len(), header.count as usize);
    }
    let Some(meta) = after.get(..header.meta_len as usize) else { return };
    match wire::decode_request(&header, meta, MAX_FRAME) {
        Ok((ranges, total)) => {
            assert_eq!(ranges.len(), header.count as usize, "{header:?}: {} ranges", ranges.len());
            let mut sum = 0u64;
            for &(addr, len) in &ranges {
                assert!(len > 0 && addr.checked_add(len).is_some(), "range {addr:#x}+{len} accepted");
                sum = sum.saturating_add(len);
            }
            assert!(sum == total && total <= MAX_FRAME, "ranges of {sum} bytes, total {total}");
            assert!(header.kind == Kind::ReadRequest || header.data_len == total, "{header:?}: {total}");
            assert_eq!(wire::encode_ranges(&ranges), meta, "ranges do not encode back to the metadata");
        }
        Err(e) => refused_as_peer_data(&e, "a request's ranges"),
    }
}

/// A session opening's body (`Opening::decode`, before the target compares the agent and
/// instance it names with its own): what decodes names a valid sender and survives a round trip.
pub fn tcp_opening(data: &[u8]) {
    match Opening::decode(data) {
        Ok(opening) => {
            let name = AgentName::new(opening.agent.as_str());
            assert!(
                kvx_core::wire::agent_metadata::check_agent_name(&name).is_ok(),
                "an opening from an invalid agent name {:?} accepted",
                opening.agent
            );
            let again = rmp_serde::to_vec_named(&opening).ok().map(|b| Opening::decode(&b));
            assert!(
                matches!(&again, Some(Ok(o)) if *o == opening),
                "{opening:?} does not survive a round trip: {again:?}"
            );
        }
        Err(e) => refused_as_peer_data(&e, "an opening"),
    }
}

fn request(kind: Kind, ranges: &[(u64, u64)]) -> Vec<u8> {
    let count = ranges.len() as u32;
    let data_len = if kind == Kind::WriteRequest { ranges.iter().map(|r| r.1).sum() } else { 0 };
    let header = Header {
        kind,
        status: OK,
        count,
        xfer: 7,
        nonce: 0x5eed_5eed,
        first: 3,
        meta_len: count * 16,
        data_len,
    };
    [&header.encode()[..], &wire::encode_ranges(ranges)].concat()
}

fn answer(kind: Kind, status: u8, data_len: u64) -> [u8; HEADER_LEN] {
    Header { kind, status, count: 4, xfer: 7, nonce: 9, first: 0, meta_len: 0, data_len }.encode()
}

/// Seeds: every kind of header at the end that takes it (and at the other), hostile counts,
/// lengths and limits.
pub(crate) fn tcp_frame_header_seeds() -> Vec<Seed> {
    let at = |pick: u8, bytes: &[u8]| [&[pick][..], &bytes[..HEADER_LEN]].concat();
    let notify = Header {
        kind: Kind::Notify,
        status: OK,
        count: 0,
        xfer: 0,
        nonce: 0,
        first: 0,
        meta_len: 5,
        data_len: 0,
    };
    let read = request(Kind::ReadRequest, &[(0x1000, 64), (0x2000, 64)]);
    let write = request(Kind::WriteRequest, &[(0x1000, 4096)]);
    let mut bad_magic = read.clone();
    bad_magic[0] ^= 0xff;
    let huge_count = Header { count: u32::MAX, meta_len: u32::MAX, ..notify }.encode();
    vec![
        Seed::new("read-request", at(4, &read)),
        Seed::new("write-request", at(4, &write)),
        Seed::new("notify", at(4, &notify.encode())),
        Seed::new("read-data", at(0x83, &answer(Kind::ReadData, OK, 4096))),
        Seed::new("read-refused", at(0x83, &answer(Kind::ReadData, REFUSED, 0))),
        Seed::new("write-ack", at(0x83, &answer(Kind::WriteAck, OK, 0))),
        Seed::new("hostile-answer-at-the-target", at(4, &answer(Kind::ReadData, OK, 16))),
        Seed::new("hostile-request-at-the-initiator", at(0x84, &read)),
        Seed::new("hostile-data-over-the-limit", at(2, &answer(Kind::ReadData, OK, 4097))),
        Seed::new("hostile-bad-magic", at(4, &bad_magic)),
        Seed::new("hostile-huge-count", at(4, &huge_count)),
        Seed::new("hostile-short", at(4, &read)[..20].to_vec()),
    ]
}

/// Seeds: READ and WRITE requests with their ranges, a notification, and hostile ranges.
pub(crate) fn tcp_request_seeds() -> Vec<Seed> {
    let ranges: Vec<(u64, u64)> = (0..16).map(|i| (0x10_0000 + i * 0x1_0000, 0x1_0000)).collect();
    let mut max = request(Kind::ReadRequest, &vec![(0x1000, 16); MAX_RANGES as usize]);
    max.truncate(HEADER_LEN + 32);
    let mut short_data = request(Kind::WriteRequest, &[(0x1000, 64)]);
    short_data[32] = 63;
    vec![
        Seed::new("read-16-ranges", request(Kind::ReadRequest, &ranges)),
        Seed::new("write-one-range", request(Kind::WriteRequest, &[(0x1000, 4096)])),
        Seed::new(
            "notify",
            [
                &Header {
                    kind: Kind::Notify,
                    status: OK,
                    count: 0,
                    xfer: 0,
                    nonce: 0,
                    first: 0,
                    meta_len: 3,
                    data_len: 0,
                }
                .encode()[..],
                b"hi!",
            ]
            .concat(),
        ),
        Seed::new("hostile-empty-range", request(Kind::ReadRequest, &[(0x1000, 0)])),
        Seed::new("hostile-range-past-the-address-space", request(Kind::ReadRequest, &[(u64::MAX - 3, 8)])),
        Seed::new(
            "hostile-ranges-over-the-limit",
            request(Kind::ReadRequest, &[(0, 1 << 40), (1 << 41, 1 << 40)]),
        ),
        Seed::new(
            "hostile-total-overflows",
            request(Kind::ReadRequest, &[(0, u64::MAX / 2), (0, u64::MAX / 2 + 2)]),
        ),
        Seed::new("hostile-write-data-shorter-than-ranges", short_data),
        Seed::new("hostile-truncated-ranges", max),
    ]
}

/// Seeds: an agent's opening, and hostile ones (MessagePack's, an unknown field, bad names).
pub(crate) fn tcp_opening_seeds() -> Vec<Seed> {
    let encode = |agent: &str| {
        let opening =
            Opening { agent: agent.to_owned(), target: "prefill-tp0".to_owned(), instance: 0x1234_5678 };
        rmp_serde::to_vec_named(&opening).unwrap_or_default()
    };
    let valid = encode("decode-tp0");
    let mut out = vec![Seed::new("opening", valid.clone())];
    out.push(Seed::new("hostile-unknown-field", seeds::with_unknown_key(&valid, &[0x01])));
    out.push(Seed::new("hostile-empty-name", encode("")));
    out.push(Seed::new("hostile-long-name", encode(&"a".repeat(4096))));
    out.push(Seed::new("hostile-name-with-a-newline", encode("decode\ntp0")));
    out.extend(seeds::msgpack_hostile(&valid));
    out
}

/// Dictionary: the opening's field names.
pub(crate) fn tcp_opening_dict() -> Vec<Vec<u8>> {
    ["agent", "target", "instance"].iter().filter_map(|w| rmp_serde::to_vec(w).ok()).collect()
}
