//! Targets that feed peer bytes to real connector workers: handshake payloads, the scheduler's
//! metadata, notifications, and rank reports.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::wire::{self, HandshakePayload};
use kvx_core::{
    ConnectorMetadata, ConnectorScheduler, ConnectorWorker, Error, ErrorKind, FailedRecv, Finished,
    FinishedAggregator, Heartbeat, HeldRequest, HoldRelease, MAX_NOTIFICATION_LEN, Nonce, Offer, RankReport,
    RecvRequest, RequestId, SchedulerConfig, TransferAgent,
};
use kvx_loopback::Fabric;

use super::fixture::{
    DECODE, DECODE_BLOCKS, Lease, NONCE, PREFILL, PREFILL_BLOCKS, auth_key, caches, config, decode_session,
    must, nonce_of, prefill, prefill_coordinates, recv, unreachable_peer,
};
use crate::input::ByteSource;
use crate::seeds::Seed;

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

fn handshake_session(data: &[u8]) -> Finished {
    let prefill = prefill();
    let meta =
        ConnectorMetadata { reqs_to_recv: handshake_requests(), reqs_to_send: vec![], heartbeats: vec![] };
    decode_session(&prefill, None, &[meta], &[], |_| Some(Ok(data.to_vec())))
}

/// Seeds: the live prefill rank's payload (which passes every check), then the wire seeds.
pub(crate) fn worker_handshake_seeds() -> Vec<Seed> {
    let mut seeds = vec![Seed::new("live-prefill-payload", prefill().payload.clone())];
    seeds.extend(super::wire::handshake_seeds());
    seeds
}

/// A structurally valid payload, encoded by kvx, whose fields the fuzz bytes pick (each field
/// defaults to the live prefill rank's value): validation, not only MessagePack, is exercised.
/// The loads' block ids are picked too. Then a whole handshake session.
pub fn worker_handshake_fields(data: &[u8]) {
    handshake_fields_session(data);
}

fn handshake_fields_session(data: &[u8]) -> Finished {
    let prefill = prefill();
    let valid = prefill.decoded_payload();
    let mut src = ByteSource::new(data);
    let payload = fuzzed_payload(&mut src, &valid, &prefill.stale_metadata);
    let bytes = must(wire::encode(&payload), "encoding a payload");
    let reqs = fuzzed_requests(&mut src);
    let meta = ConnectorMetadata { reqs_to_recv: reqs, reqs_to_send: vec![], heartbeats: vec![] };
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
                r.remote.port = u16::MAX;
            }
            if src.below(4) == 3 {
                r.remote_read_from = src.edgy_u32();
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
    let mut seeds = super::wire::connector_metadata_seeds();
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
                holds: vec![HeldRequest { request_id: "unreachable".into(), nonce: nonce_of("unreachable") }],
            },
            Heartbeat {
                remote: kvx_core::RemoteCoordinates { host: "h".repeat(300), ..prefill_coordinates() },
                holds: vec![HeldRequest { request_id: "ok".into(), nonce: nonce_of("ok") }],
            },
        ],
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

fn metadata_fields_session(data: &[u8]) -> Finished {
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
    let reqs_to_recv = (0..loads)
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
            let engine_id = match src.below(4) {
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
                request_id: request_id.into(),
                remote_request_id,
                local_block_ids,
                remote_block_ids,
                remote_read_from,
                remote: kvx_core::RemoteCoordinates { engine_id, host: "10.0.0.1".into(), port },
                nonce,
                mac: None,
                remote_instance: None,
            };
            if keyed {
                r.mac = match src.below(4) {
                    0 => r.offer().map(|offer| offer.tag(&auth_key())),
                    1 => None,
                    2 => Some(kvx_core::HexBytes([src.u8(); 32])),
                    // A valid tag over another offer (other blocks).
                    _ => r.offer().map(|offer| Offer { block_ids: &[1, 2, 3], ..offer }.tag(&auth_key())),
                };
            }
            leases.push([Lease::Held, Lease::Expired, Lease::OtherNonce, Lease::Missing][src.below(4)]);
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
    ConnectorMetadata { reqs_to_recv, reqs_to_send, heartbeats: vec![] }
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

/// Notification bytes to a prefill rank that holds requests, through a loopback peer's
/// `notify`, twice (a duplicate). If the bytes are a `HoldRelease`, a hold for the request and
/// nonce it names is started afterwards too (a release that came before its hold). Checks:
/// before any hold expires, only a hold that a release names with its nonce is freed (a forged,
/// mangled or wrong-nonce release frees nothing); once every hold expired, each was released at
/// least once, nothing that was not held was, and the worker is idle.
pub fn worker_notification(data: &[u8]) {
    let fabric = Fabric::new();
    let agent = Arc::new(must(fabric.agent("prefill-agent"), "prefill agent"));
    let mut worker = must(ConnectorWorker::new(config(PREFILL), agent.clone()), "prefill worker");
    must(worker.register_kv_caches(&caches(PREFILL_BLOCKS).0), "registering");
    let reader = must(fabric.agent("decode-agent"), "decode agent");
    let prefill_name = must(reader.load_remote(&must(agent.local_metadata(), "metadata")), "loading");

    let now = Instant::now();
    let held: Vec<HeldRequest> = notification_holds();
    worker.start_load_kv(
        now,
        &ConnectorMetadata { reqs_to_recv: vec![], reqs_to_send: held.clone(), heartbeats: vec![] },
    );
    // No backend delivers a notification over the limit: its sender refuses it.
    if data.len() > MAX_NOTIFICATION_LEN {
        return;
    }
    for _ in 0..2 {
        must(reader.notify(&prefill_name, data), "notifying");
    }
    let release = wire::decode::<HoldRelease>(data).ok();
    let releases = |id: &RequestId, holds: &[HeldRequest]| {
        release.as_ref().is_some_and(|r| {
            &r.request_id == id && holds.iter().any(|h| h.request_id == r.request_id && h.nonce == r.nonce)
        })
    };
    let mut released = worker.get_finished(now).sending;
    for id in &released {
        assert!(releases(id, &held), "hold {id:?} freed by a notification that does not release it");
    }
    let late: Vec<HeldRequest> =
        release.iter().map(|r| HeldRequest { request_id: r.request_id.clone(), nonce: r.nonce }).collect();
    worker.start_load_kv(
        now,
        &ConnectorMetadata { reqs_to_recv: vec![], reqs_to_send: late.clone(), heartbeats: vec![] },
    );
    let early = worker.get_finished(now).sending;
    for id in &early {
        assert!(releases(id, &late), "hold {id:?} freed by an early notification that does not release it");
    }
    released.extend(early);
    let later = now + worker.config().lease_duration + Duration::from_secs(1);
    released.extend(worker.get_finished(later).sending);

    let all_held: HashSet<&RequestId> = held.iter().chain(&late).map(|h| &h.request_id).collect();
    for id in &released {
        assert!(all_held.contains(id), "released {id:?}, which was never held");
    }
    for id in all_held {
        assert!(released.contains(id), "hold {id:?} never released");
    }
    assert!(worker.is_idle(), "the prefill worker is not idle at the end: {:?}", worker.stats());
}

/// The holds of `worker_notification`'s prefill rank.
fn notification_holds() -> Vec<HeldRequest> {
    [("req-0", NONCE), ("req-1", NONCE), ("cmpl-7f3a-0", OTHER_NONCE), ("", NONCE)]
        .into_iter()
        .map(|(id, nonce)| HeldRequest { request_id: id.into(), nonce })
        .collect()
}

/// Another hold's nonce.
const OTHER_NONCE: Nonce = kvx_core::HexBytes([0xa5; 16]);

/// Releases: of each hold, with the wrong nonce, of no hold (it comes before its hold), and
/// hostile variants; then bare request ids (what kvx sent before nonces), and other bytes.
pub(crate) fn worker_notification_seeds() -> Vec<Seed> {
    let release = |id: &str, nonce| HoldRelease { request_id: id.into(), nonce, reply_to: None };
    let samples = vec![
        ("releases-a-hold", release("req-0", NONCE)),
        ("releases-a-vllm-hold", release("cmpl-7f3a-0", OTHER_NONCE)),
        ("wrong-nonce", release("req-1", OTHER_NONCE)),
        ("releases-an-unknown-hold", release("cmpl-unknown-9", NONCE)),
        ("empty-id", release("", NONCE)),
        ("over-long-id", release(&"x".repeat(32 << 10), NONCE)),
    ];
    let reply_to = |engine: kvx_core::RemoteCoordinates, instance| HoldRelease {
        reply_to: Some(kvx_core::ReplyTo { engine, instance, token: NONCE }),
        ..release("req-0", NONCE)
    };
    let samples = [
        samples,
        vec![
            ("answer-the-decode-engine", reply_to(super::fixture::decode_side_channel(), 7)),
            ("answer-this-engine", reply_to(prefill_coordinates(), 7)),
            (
                "answer-a-huge-host",
                reply_to(
                    kvx_core::RemoteCoordinates {
                        host: "h".repeat(32 << 10),
                        ..super::fixture::decode_side_channel()
                    },
                    7,
                ),
            ),
            (
                "answer-the-last-port",
                reply_to(
                    kvx_core::RemoteCoordinates { port: u16::MAX, ..super::fixture::decode_side_channel() },
                    u64::MAX,
                ),
            ),
        ],
    ]
    .concat();
    let mut seeds = crate::seeds::wire_seeds(&samples);
    seeds.extend(
        [("bare-id", &b"req-0"[..]), ("not-utf8", b"\xff\xfereq-0"), ("empty", b"")]
            .into_iter()
            .map(|(n, b)| Seed::new(n, b)),
    );
    seeds
}

/// A rank's report as rank 0 receives it: decoded, aggregated with rank 0's own report (the
/// same), and handed to a scheduler. Only ids some rank reported come out.
pub fn rank_report_aggregate(data: &[u8]) {
    let Ok(report) = wire::decode::<RankReport>(data) else { return };
    let mut aggregator = FinishedAggregator::new(2);
    let out = aggregator.aggregate([report.finished.clone(), report.finished.clone()]);
    let reported: HashSet<&RequestId> = report
        .finished
        .sending
        .iter()
        .chain(&report.finished.recving)
        .chain(report.finished.failed_recving.iter().map(|f| &f.request_id))
        .collect();
    for id in out.sending.iter().chain(&out.recving).chain(out.failed_recving.iter().map(|f| &f.request_id)) {
        assert!(reported.contains(id), "aggregated {id}, which no rank reported");
    }
    let mut scheduler = must(
        ConnectorScheduler::new(SchedulerConfig {
            engine_id: PREFILL.into(),
            block_size: 16,
            side_channel_host: "10.0.0.1".into(),
            side_channel_port: 5600,
            auth_key: None,
            lease_duration: Duration::from_secs(30),
            instance: None,
        }),
        "scheduler",
    );
    scheduler.update_finished(&out);
    assert!(scheduler.is_idle());
}

/// Rank reports: empty, typical, with failures.
pub(crate) fn rank_report_samples() -> Vec<(&'static str, RankReport)> {
    vec![
        (
            "typical",
            RankReport {
                rank: 1,
                finished: Finished {
                    sending: vec!["cmpl-p-0".into()],
                    recving: vec!["cmpl-d-0".into(), "cmpl-d-1".into()],
                    failed_recving: vec![FailedRecv {
                        request_id: "cmpl-d-2".into(),
                        error: Error::new(ErrorKind::Transfer, "peer gone")
                            .with_backend("ucx")
                            .with_code(-25),
                    }],
                },
            },
        ),
        ("empty", RankReport::default()),
        (
            "repeated-ids",
            RankReport {
                rank: u32::MAX,
                finished: Finished {
                    sending: vec!["a".into(), "a".into()],
                    recving: vec!["b".into()],
                    failed_recving: vec![FailedRecv {
                        request_id: "b".into(),
                        error: Error::new(ErrorKind::Timeout, String::new()),
                    }],
                },
            },
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(finished: &Finished, id: &str) -> bool {
        finished.recving.iter().any(|r| r.as_str() == id)
    }

    #[test]
    fn the_natural_inputs_load_so_the_targets_reach_the_read() {
        assert!(loaded(&handshake_session(&prefill().payload), "load"));
        assert!(loaded(&handshake_fields_session(&[]), "req-0"));
        let plain = metadata_fields_session(&[]);
        assert!(loaded(&plain, "s0-r0"), "{plain:?}");
        let keyed = metadata_fields_session(&[0, 1]);
        assert!(loaded(&keyed, "s0-r0"), "a valid MAC: {keyed:?}");
        let no_mac = metadata_fields_session(&[[0u8, 1, 0].as_slice(), &[0; 12], &[1]].concat());
        assert!(!loaded(&no_mac, "s0-r0"), "no MAC in a keyed deployment: {no_mac:?}");
        let other_offer = metadata_fields_session(&[[0u8, 1, 0].as_slice(), &[0; 12], &[3]].concat());
        assert!(!loaded(&other_offer, "s0-r0"), "another offer's MAC: {other_offer:?}");
        for lease in 1..4u8 {
            let unheld = metadata_fields_session(&[[0u8, 0, 0].as_slice(), &[0; 12], &[lease]].concat());
            assert!(!loaded(&unheld, "s0-r0"), "lease choice {lease}: {unheld:?}");
            assert_eq!(unheld.failed_recving.len(), 1, "{unheld:?}");
        }
        let shared = [0u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0];
        let two = metadata_fields_session(&[[0u8, 0, 1].as_slice(), &shared, &shared].concat());
        assert_eq!((two.recving.len(), two.failed_recving.len()), (1, 1), "one load per offer: {two:?}");
    }
}
