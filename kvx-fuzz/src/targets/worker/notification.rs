//! Notification bytes to a prefill rank that holds requests.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::wire;
use kvx_core::{
    ConnectorMetadata, ConnectorWorker, HeldRequest, HoldRelease, MAX_NOTIFICATION_LEN, Nonce,
    PushRegistration, RequestId, TransferAgent,
};
use kvx_loopback::Fabric;

use crate::seeds::Seed;
use crate::targets::fixture::{
    DECODE, NONCE, PREFILL, PREFILL_BLOCKS, caches, config, decode_side_channel, must, prefill_coordinates,
};

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
        &ConnectorMetadata {
            reqs_to_recv: vec![],
            reqs_to_send: held.clone(),
            heartbeats: vec![],
            ..Default::default()
        },
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
        &ConnectorMetadata {
            reqs_to_recv: vec![],
            reqs_to_send: late.clone(),
            heartbeats: vec![],
            ..Default::default()
        },
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
    let release = |id: &str, nonce| HoldRelease {
        request_id: id.into(),
        nonce,
        reply_to: None,
        reader: 0,
        readers: 1,
        instance: None,
    };
    let samples = vec![
        ("releases-a-hold", release("req-0", NONCE)),
        ("releases-a-vllm-hold", release("cmpl-7f3a-0", OTHER_NONCE)),
        ("wrong-nonce", release("req-1", OTHER_NONCE)),
        ("releases-an-unknown-hold", release("cmpl-unknown-9", NONCE)),
        ("empty-id", release("", NONCE)),
        ("over-long-id", release(&"x".repeat(32 << 10), NONCE)),
        ("first-of-two-readers", HoldRelease { reader: 1, readers: 2, ..release("req-0", NONCE) }),
        ("absurd-readers", HoldRelease { reader: u32::MAX, readers: u32::MAX, ..release("req-0", NONCE) }),
    ];
    let reply_to = |engine: kvx_core::RemoteCoordinates, instance| HoldRelease {
        reply_to: Some(kvx_core::ReplyTo { engine, rank: 0, instance, token: NONCE }),
        ..release("req-0", NONCE)
    };
    let samples = [
        samples,
        vec![
            ("answer-the-decode-engine", reply_to(decode_side_channel(), 7)),
            ("answer-this-engine", reply_to(prefill_coordinates(), 7)),
            (
                "answer-a-huge-host",
                reply_to(kvx_core::RemoteCoordinates::at(DECODE, "h".repeat(32 << 10), 5700), 7),
            ),
            (
                "answer-the-last-port",
                reply_to(kvx_core::RemoteCoordinates::at(DECODE, "10.0.0.2", u16::MAX), u64::MAX),
            ),
        ],
    ]
    .concat();
    let mut seeds = crate::seeds::wire_seeds(&samples);
    // Push messages to a rank that holds these requests for a pull: refused, nothing freed.
    for (name, reg) in crate::targets::wire::push_registration_samples() {
        let reg = PushRegistration { request_id: "req-0".into(), ..reg };
        seeds.push(Seed::new(format!("push-registration-{name}"), must(wire::encode(&reg), "encoding")));
    }
    for (name, msg) in crate::targets::wire::push_cancel_samples() {
        seeds.push(Seed::new(format!("push-cancel-{name}"), must(wire::encode(&msg), "encoding")));
    }
    seeds.extend(
        [("bare-id", &b"req-0"[..]), ("not-utf8", b"\xff\xfereq-0"), ("empty", b"")]
            .into_iter()
            .map(|(n, b)| Seed::new(n, b)),
    );
    seeds
}
