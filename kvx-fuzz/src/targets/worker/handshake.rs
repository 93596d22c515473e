//! Handshake payloads into a decode rank: the peer's bytes as they come, and valid payloads with
//! fuzzed fields.

use kvx_core::wire::{self, HandshakePayload};
use kvx_core::{ConnectorMetadata, Finished, RecvRequest};

use crate::input::ByteSource;
use crate::seeds::Seed;
use crate::targets::fixture::{DECODE, DECODE_BLOCKS, PREFILL_BLOCKS, decode_session, must, prefill, recv};

/// The loads every handshake session starts with: a partial prefix hit (2 local blocks, the last
/// 2 of 3 remote ones) and a full prefix hit (notify only).
fn handshake_requests() -> Vec<RecvRequest> {
    vec![recv("load", vec![0, 1], vec![4, 5, 6]), recv("notify-only", vec![], vec![7])]
}

/// `ConnectorWorker::handle_handshake` with `data` as the peer's payload: decoded, validated,
/// its agent metadata loaded, its descriptor list prepared, the waiting loads posted.
pub fn worker_handshake(data: &[u8]) {
    handshake_session(data);
}

pub(super) fn handshake_session(data: &[u8]) -> Finished {
    let prefill = prefill();
    let meta = ConnectorMetadata {
        reqs_to_recv: handshake_requests(),
        reqs_to_send: vec![],
        heartbeats: vec![],
        ..Default::default()
    };
    decode_session(&prefill, None, &[meta], &[], |_| Some(Ok(data.to_vec())))
}

/// Seeds: the live prefill rank's payload (which passes every check), then the wire seeds.
pub(crate) fn worker_handshake_seeds() -> Vec<Seed> {
    let mut seeds = vec![Seed::new("live-prefill-payload", prefill().payload.clone())];
    seeds.extend(crate::targets::wire::handshake_seeds());
    seeds
}

/// A structurally valid payload, encoded by kvx, whose fields the fuzz bytes pick (each field
/// defaults to the live prefill rank's value): validation, not only MessagePack, is exercised.
/// The loads' block ids are picked too. Then a whole handshake session.
pub fn worker_handshake_fields(data: &[u8]) {
    handshake_fields_session(data);
}

pub(super) fn handshake_fields_session(data: &[u8]) -> Finished {
    let prefill = prefill();
    let valid = prefill.decoded_payload();
    let mut src = ByteSource::new(data);
    let payload = fuzzed_payload(&mut src, &valid, &prefill.stale_metadata);
    let bytes = must(wire::encode(&payload), "encoding a payload");
    let reqs = fuzzed_requests(&mut src);
    let meta = ConnectorMetadata {
        reqs_to_recv: reqs,
        reqs_to_send: vec![],
        heartbeats: vec![],
        ..Default::default()
    };
    decode_session(&prefill, None, &[meta], &[], |_| Some(Ok(bytes.clone())))
}

fn fuzzed_payload(src: &mut ByteSource<'_>, valid: &HandshakePayload, stale: &[u8]) -> HandshakePayload {
    let mut p = valid.clone();
    p.engine_id = match src.below(4) {
        0 => p.engine_id,
        1 => DECODE.into(),
        2 => src.string(16).into(),
        _ => "".into(),
    };
    p.rank = match src.below(3) {
        0 => p.rank,
        1 => 1,
        _ => src.edgy_u32(),
    };
    p.world_size = match src.below(3) {
        0 => p.world_size,
        1 => 2,
        _ => src.edgy_u32(),
    };
    p.agent_name = match src.below(4) {
        0 => p.agent_name,
        1 => "decode-agent".into(),
        2 => src.string(16).into(),
        _ => "".into(),
    };
    p.agent_metadata = match src.below(6) {
        0 => p.agent_metadata,
        1 => {
            let mut md = p.agent_metadata;
            for _ in 0..=src.below(4) {
                let (at, b) = (src.u32() as usize, src.u8());
                if let Some(len) = std::num::NonZeroUsize::new(md.len()) {
                    md[at % len.get()] = b;
                }
            }
            md
        }
        2 => stale.to_vec(),
        3 => src.bytes(64).to_vec(),
        4 => Vec::new(),
        _ => {
            let cut = src.u32() as usize % (p.agent_metadata.len() + 1);
            p.agent_metadata[..cut].to_vec()
        }
    };
    p.region_bases = match src.below(6) {
        0 => p.region_bases,
        1 => {
            let mut bases = p.region_bases;
            let i = src.below(bases.len());
            if let Some(b) = bases.get_mut(i) {
                *b = match src.below(3) {
                    0 => b.wrapping_add(u64::from(src.u8())),
                    1 => b.wrapping_sub(u64::from(src.u8())),
                    _ => src.edgy_u64(),
                };
            }
            bases
        }
        2 => [p.region_bases.clone(), p.region_bases[..1].to_vec()].concat(),
        3 => p.region_bases[..p.region_bases.len().saturating_sub(1)].to_vec(),
        4 => vec![u64::MAX - 7; p.region_bases.len()],
        _ => (0..src.below(9)).map(|_| src.edgy_u64()).collect(),
    };
    p.num_blocks = match src.below(4) {
        0 => p.num_blocks,
        1 => [0, 1, DECODE_BLOCKS, PREFILL_BLOCKS + 1, u32::MAX, u32::MAX / 4 + 1, 1 << 30][src.below(7)],
        2 => src.edgy_u32(),
        _ => src.u32(),
    };
    p.block_len = match src.below(3) {
        0 => p.block_len,
        1 => [0, 1, 7, 16, u64::MAX][src.below(5)],
        _ => src.u64(),
    };
    p.compat_hash = match src.below(2) {
        0 => p.compat_hash,
        _ => src.u64(),
    };
    p.instance = match src.below(2) {
        0 => p.instance,
        _ => src.edgy_u64(),
    };
    p
}

/// `len` block ids of a pool of `pool` blocks: in range from `first`, the last, one past the end,
/// or an edge value.
fn block_ids(src: &mut ByteSource<'_>, len: usize, first: usize, pool: u32) -> Vec<u32> {
    (0..len)
        .map(|k| match src.below(4) {
            0 => (first + k) as u32,
            1 => pool - 1,
            2 => pool,
            _ => src.edgy_u32(),
        })
        .collect()
}

fn fuzzed_requests(src: &mut ByteSource<'_>) -> Vec<RecvRequest> {
    let n = 1 + src.below(3);
    (0..n)
        .map(|i| {
            let local_len = match src.below(4) {
                0 => 2,
                k => k - 1,
            };
            let remote_len = local_len + src.below(3);
            let local = block_ids(src, local_len, i * 4, DECODE_BLOCKS);
            let remote = block_ids(src, remote_len, i * 5, PREFILL_BLOCKS);
            let mut r = recv(&format!("req-{i}"), local, remote);
            if src.below(4) == 3 {
                r.remote = kvx_core::RemoteCoordinates::at(r.remote.engine_id, "10.0.0.1", u16::MAX);
            }
            if src.below(4) == 3 {
                r.local_block_ids[0].first = src.edgy_u32();
            }
            r
        })
        .collect()
}

/// Seeds: no choice (every field valid), then each single field changed.
pub(crate) fn worker_handshake_fields_seeds() -> Vec<Seed> {
    let mut seeds = vec![Seed::new("all-valid", Vec::new())];
    for field in 0..10 {
        let mut choice = vec![0u8; field];
        choice.push(1);
        seeds.push(Seed::new(format!("field-{field}-changed"), choice));
    }
    seeds.push(Seed::new("stale-agent-metadata", [0, 0, 0, 0, 2]));
    seeds.push(Seed::new("num-blocks-too-large-for-u32-descriptors", [0, 0, 0, 0, 0, 0, 1, 5]));
    seeds.push(Seed::new("region-base-near-the-top", [0, 0, 0, 0, 0, 4]));
    seeds
}
