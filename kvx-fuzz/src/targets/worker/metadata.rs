//! The scheduler's per-step metadata into a decode rank: its bytes as they come, and valid
//! metadata with fuzzed loads and holds.

use kvx_core::wire::{self, HandshakePayload};
use kvx_core::{
    ConnectorMetadata, Finished, GroupBlocks, Heartbeat, HeldRequest, Offer, RecvRequest, RequestId,
};

use crate::input::ByteSource;
use crate::seeds::Seed;
use crate::targets::fixture::{
    DECODE, DECODE_BLOCKS, Lease, NONCE, PREFILL, PREFILL_BLOCKS, auth_key, decode_session, must, nonce_of,
    prefill, prefill_coordinates, recv, unreachable_peer,
};

/// The scheduler's per-step metadata as a worker receives it (from the scheduler process):
/// decoded, then started on a decode rank that also holds its `reqs_to_send`; handshakes with
/// the prefill engine succeed, with any other engine fail.
pub fn worker_connector_metadata(data: &[u8]) {
    let Ok(meta) = wire::decode::<ConnectorMetadata>(data) else { return };
    let prefill = prefill();
    let payload = prefill.payload.clone();
    decode_session(&prefill, None, &[meta], &[], |engine| {
        Some(if engine.as_str() == PREFILL { Ok(payload.clone()) } else { Err(unreachable_peer(engine)) })
    });
}

/// Seeds: the wire seeds of `ConnectorMetadata`, whose loads target the fixture's engines.
pub(crate) fn worker_connector_metadata_seeds() -> Vec<Seed> {
    let mut seeds = crate::targets::wire::connector_metadata_seeds();
    let both = ConnectorMetadata {
        reqs_to_recv: vec![
            recv("ok", vec![0, 1], vec![30, 31]),
            recv("remote-out-of-range", vec![2], vec![PREFILL_BLOCKS]),
            recv("local-out-of-range", vec![DECODE_BLOCKS], vec![1]),
            recv("duplicate-local", vec![3, 3], vec![1, 2]),
            recv("fewer-remote", vec![4, 5], vec![1]),
            recv("notify", vec![], vec![9]),
            RecvRequest {
                remote: kvx_core::RemoteCoordinates {
                    engine_id: DECODE.into(),
                    ..recv("", vec![], vec![]).remote
                },
                ..recv("self", vec![6], vec![6])
            },
            RecvRequest {
                remote: kvx_core::RemoteCoordinates {
                    engine_id: "elsewhere".into(),
                    ..recv("", vec![], vec![]).remote
                },
                ..recv("unreachable", vec![7], vec![7])
            },
        ],
        reqs_to_send: ["held-a", "held-b"]
            .into_iter()
            .map(|id| HeldRequest { request_id: id.into(), nonce: NONCE })
            .collect(),
        heartbeats: vec![
            Heartbeat {
                remote: prefill_coordinates(),
                remote_tp_size: None,
                pushes: Vec::new(),
                holds: vec![
                    HeldRequest { request_id: "ok".into(), nonce: nonce_of("ok") },
                    HeldRequest { request_id: "ok".into(), nonce: NONCE },
                    HeldRequest { request_id: "never-held".into(), nonce: NONCE },
                ],
            },
            Heartbeat {
                remote: kvx_core::RemoteCoordinates {
                    engine_id: "elsewhere".into(),
                    ..prefill_coordinates()
                },
                remote_tp_size: Some(4),
                holds: vec![HeldRequest { request_id: "unreachable".into(), nonce: nonce_of("unreachable") }],
                pushes: vec!["unreachable".into()],
            },
            Heartbeat {
                remote: kvx_core::RemoteCoordinates::at(PREFILL, "h".repeat(300), 5600),
                remote_tp_size: Some(u32::MAX),
                pushes: Vec::new(),
                holds: vec![HeldRequest { request_id: "ok".into(), nonce: nonce_of("ok") }],
            },
        ],
        ..Default::default()
    };
    seeds.push(Seed::new("every-kind-of-load", must(wire::encode(&both), "encoding")));
    seeds
}

/// Loads and holds that the fuzz bytes pick, in two engine steps (the second after the
/// handshake, so that loads also go to a peer that is already ready), into a decode worker; the
/// bytes also pick how the prefill engine answers the handshake (its payload, an error, never,
/// another engine's payload, half a payload). The metadata is always valid MessagePack: the
/// worker's own checks (block ranges, duplicates, its own engine, ports, repeated ids) are what
/// is exercised, and `decode_session`'s guarantees are checked.
pub fn worker_metadata_fields(data: &[u8]) {
    metadata_fields_session(data);
}

pub(super) fn metadata_fields_session(data: &[u8]) -> Finished {
    let prefill = prefill();
    let mut src = ByteSource::new(data);
    let answer = src.below(5);
    let keyed = src.below(2) == 1;
    let mut leases = Vec::new();
    let steps =
        [fuzzed_metadata(&mut src, 0, keyed, &mut leases), fuzzed_metadata(&mut src, 1, keyed, &mut leases)];
    let key = keyed.then(auth_key);
    let payload = prefill.payload.clone();
    let other_engine = HandshakePayload { engine_id: "elsewhere".into(), ..prefill.decoded_payload() };
    let other = must(wire::encode(&other_engine), "encoding a payload");
    decode_session(&prefill, key, &steps, &leases, |engine| match answer {
        0 => {
            Some(if engine.as_str() == PREFILL { Ok(payload.clone()) } else { Err(unreachable_peer(engine)) })
        }
        1 => Some(Err(unreachable_peer(engine))),
        2 => None,
        3 => Some(Ok(other.clone())),
        _ => Some(Ok(payload[..payload.len() / 2].to_vec())),
    })
}

/// One step's metadata: by default one load of two fresh blocks from the prefill engine in the
/// first step, nothing in the second. In a keyed deployment the offers carry a MAC (by default
/// a valid one). Last, how the prefill engine holds each load's offer (pushed to `leases`; by
/// default held throughout).
fn fuzzed_metadata(
    src: &mut ByteSource<'_>,
    step: usize,
    keyed: bool,
    leases: &mut Vec<Lease>,
) -> ConnectorMetadata {
    let loads = if step == 0 { 1 + src.below(4) } else { src.below(4) };
    let mut reqs_to_recv: Vec<RecvRequest> = (0..loads)
        .map(|i| {
            let request_id = match src.below(4) {
                0 => format!("s{step}-r{i}"),
                1 => "s0-r0".to_owned(),
                2 => src.string(8),
                _ => String::new(),
            };
            let local_len = match src.below(5) {
                0 => 2,
                n => n - 1,
            };
            let offset = (step * 8 + i * 2) as u32;
            let local_block_ids = (0..local_len as u32)
                .map(|k| match src.below(5) {
                    0 => offset + k,
                    1 => DECODE_BLOCKS - 1,
                    2 => DECODE_BLOCKS,
                    3 => offset,
                    _ => src.edgy_u32(),
                })
                .collect();
            let remote_len = local_len + src.below(3);
            let remote_block_ids = (0..remote_len as u32)
                .map(|k| match src.below(4) {
                    0 => PREFILL_BLOCKS - 1 - (offset + k) % PREFILL_BLOCKS,
                    1 => PREFILL_BLOCKS,
                    2 => u32::MAX,
                    _ => src.edgy_u32(),
                })
                .collect();
            let engine_id: kvx_core::EngineId = match src.below(4) {
                0 => PREFILL.into(),
                1 => DECODE.into(),
                2 => "elsewhere".into(),
                _ => src.string(8).into(),
            };
            let port = [5600, u16::MAX, 0][src.below(3)];
            let remote_request_id = match src.below(3) {
                0 => None,
                1 => Some(format!("cmpl-p-{i}").into()),
                _ => Some(src.string(8).into()),
            };
            let remote_read_from = match src.below(4) {
                3 => src.edgy_u32(),
                _ => (remote_len - local_len) as u32,
            };
            let prefill_id: RequestId =
                remote_request_id.clone().unwrap_or_else(|| request_id.as_str().into());
            let nonce = match src.below(4) {
                0 => Some(nonce_of(prefill_id.as_str())),
                1 => None,
                // The offer of another load (a replayed or shared nonce).
                2 => Some(NONCE),
                _ => Some(kvx_core::HexBytes([src.u8(); 16])),
            };
            let mut r = RecvRequest {
                prompt: None,
                request_id: request_id.into(),
                remote_request_id,
                local_block_ids: vec![GroupBlocks::new(remote_read_from, local_block_ids)],
                remote_block_ids: vec![GroupBlocks::whole(remote_block_ids)],
                remote: kvx_core::RemoteCoordinates::at(engine_id, "10.0.0.1", port),
                nonce,
                mac: None,
                remote_instance: None,
                remote_tp_size: None,
            };
            if keyed {
                r.mac = match src.below(4) {
                    0 => r.offer().map(|offer| offer.tag(&auth_key())),
                    1 => None,
                    2 => Some(kvx_core::HexBytes([src.u8(); 32])),
                    // A valid tag over another offer (other blocks).
                    _ => r.offer().map(|offer| {
                        Offer { groups: &[GroupBlocks::whole(vec![1, 2, 3])], ..offer }.tag(&auth_key())
                    }),
                };
            }
            leases.push([Lease::Held, Lease::Expired, Lease::OtherNonce, Lease::Missing][src.below(4)]);
            if src.below(4) == 3 {
                // A second KV-cache group (a hybrid model): a block at a position the offer may
                // or may not have.
                r.local_block_ids.push(GroupBlocks::new(src.below(3) as u32, vec![offset + 1]));
                let (first, offered) = (src.below(2) as u32, vec![PREFILL_BLOCKS - 2, PREFILL_BLOCKS - 3]);
                reoffer(&mut r, keyed, |r| r.remote_block_ids.push(GroupBlocks::new(first, offered)));
            }
            r
        })
        .collect();
    let reqs_to_send = (0..src.below(4))
        .map(|k| {
            let request_id = match src.below(3) {
                0 => format!("held-{step}-{k}"),
                1 => "held-0-0".to_owned(),
                _ => src.string(8),
            };
            HeldRequest { request_id: request_id.into(), nonce: NONCE }
        })
        .collect();
    // Drawn last, so that the inputs drawn before keep their meaning: mostly the decode engine's
    // own size; sometimes another, possibly impossible one.
    for r in &mut reqs_to_recv {
        if src.below(4) == 3 {
            let tp_size = Some(u32::from(src.u8() % 9));
            reoffer(r, keyed, |r| r.remote_tp_size = tp_size);
        }
    }
    ConnectorMetadata { reqs_to_recv, reqs_to_send, heartbeats: vec![], ..Default::default() }
}

/// Changes the offer of `r` with `edit`, as the prefill engine would have offered it: a valid MAC
/// is taken again over the changed offer (an invalid or missing one stays as it is).
fn reoffer(r: &mut RecvRequest, keyed: bool, edit: impl FnOnce(&mut RecvRequest)) {
    let valid = keyed && r.mac.is_some() && r.mac == r.offer().map(|offer| offer.tag(&auth_key()));
    edit(r);
    if valid {
        r.mac = r.offer().map(|offer| offer.tag(&auth_key()));
    }
}

/// Seeds: no choice (one valid load), each answer, and a few loads with one field changed.
pub(crate) fn worker_metadata_fields_seeds() -> Vec<Seed> {
    // Bytes: the answer, keyed or not, then per step the loads (each 13 choices, 14 keyed: the
    // MAC before the last, the lease) and the holds.
    let mut seeds = vec![Seed::new("one-valid-load", Vec::new())];
    for answer in 1..5u8 {
        seeds.push(Seed::new(format!("answer-{answer}"), [answer]));
    }
    for field in 0..13 {
        // Answer 0, no key, 4 loads, then `field` zero choices and a 1.
        let mut choice = vec![0u8, 0, 3];
        choice.extend(std::iter::repeat_n(0, field));
        choice.push(1);
        seeds.push(Seed::new(format!("four-loads-field-{field}-changed"), choice));
    }
    let one_load = [0u8; 13];
    seeds.push(Seed::new("loads-in-both-steps", [&[0, 0, 0][..], &one_load, &[0, 2]].concat()));
    seeds.push(Seed::new("keyed-valid-mac", [0, 1]));
    for (mac, name) in [(1u8, "keyed-no-mac"), (2, "keyed-garbage-mac"), (3, "keyed-mac-of-another-offer")] {
        seeds.push(Seed::new(name, [&[0, 1, 0][..], &one_load[..12], &[mac]].concat()));
    }
    for (lease, name) in [(1u8, "lease-expired"), (2, "lease-other-nonce"), (3, "lease-missing")] {
        seeds.push(Seed::new(name, [&[0, 0, 0][..], &one_load[..12], &[lease]].concat()));
    }
    // Two loads of one offer (the same nonce), the second's blocks elsewhere.
    let shared = [0u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0];
    seeds.push(Seed::new("two-loads-of-one-offer", [&[0, 0, 1][..], &shared, &shared].concat()));
    seeds
}
