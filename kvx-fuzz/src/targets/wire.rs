//! The wire envelope of every [`WireMessage`] type, and real messages of each to start from.

use std::fmt;

use kvx_core::wire::{self, HandshakePayload, WireMessage};
use kvx_core::{
    ConnectorMetadata, ConnectorScheduler, ErrorKind, FinishReason, GroupBlocks, HeldRequest, HoldRelease,
    HoldStatus, PushCancel, PushRegistration, PushResult, RecvRequest, RemoteCoordinates, RenewLeases,
    ReplyTo, SchedulerConfig, TransferParams,
};
use kvx_net::MetadataRequest;
use kvx_net::session::{Refusal, SessionReply, SessionRequest};

use super::fixture::{NONCE, auth_key, must, prefill};
use crate::seeds::{Seed, wire_seeds};

/// `wire::decode::<T>` of peer bytes: an error is `Wire` or `Incompatible`, and what decodes
/// re-encodes and decodes to the same message (nothing lost or invented on the way).
pub fn wire_envelope<T: WireMessage + PartialEq + fmt::Debug>(data: &[u8]) {
    let msg = match wire::decode::<T>(data) {
        Ok(msg) => msg,
        Err(e) => {
            assert!(
                matches!(e.kind(), ErrorKind::Wire | ErrorKind::Incompatible),
                "decoding a {:?} failed with an error of kind {:?}: {e}",
                T::KIND,
                e.kind()
            );
            return;
        }
    };
    let bytes = match wire::encode(&msg) {
        Ok(bytes) => bytes,
        Err(e) => panic!("a decoded {:?} does not encode again: {e}", T::KIND),
    };
    match wire::decode::<T>(&bytes) {
        Ok(back) => assert_eq!(back, msg, "a {:?} changed on a round trip", T::KIND),
        Err(e) => panic!("a re-encoded {:?} does not decode: {e}", T::KIND),
    }
}

/// Handshake payloads: the live prefill rank's, then made-up ones at the edges.
pub(crate) fn handshake_samples() -> Vec<(&'static str, HandshakePayload)> {
    let live = prefill().decoded_payload();
    vec![
        ("live-loopback-prefill", live.clone()),
        (
            "tp2-rank1",
            HandshakePayload {
                engine_id: "prefill-0".into(),
                rank: 1,
                world_size: 2,
                kv_heads: 8,
                agent_name: "prefill-0-rank-1".into(),
                agent_metadata: live.agent_metadata.clone(),
                region_bases: vec![0x7f00_0000_0000, 0x7f00_0010_0000, 0x7f00_0020_0000, 0x7f00_0030_0000],
                num_blocks: 1024,
                block_len: 16 << 10,
                compat_hash: 0x9e37_79b9_7f4a_7c15,
                instance: 1,
            },
        ),
        (
            "empty-fields",
            HandshakePayload {
                engine_id: "".into(),
                rank: 0,
                world_size: 0,
                kv_heads: 0,
                agent_name: "".into(),
                agent_metadata: vec![],
                region_bases: vec![],
                num_blocks: 0,
                block_len: 0,
                compat_hash: 0,
                instance: 0,
            },
        ),
        (
            "maxima",
            HandshakePayload {
                engine_id: "e".repeat(300).into(),
                rank: u32::MAX,
                world_size: u32::MAX,
                kv_heads: u32::MAX,
                agent_name: "a".into(),
                agent_metadata: vec![0xff; 300],
                region_bases: vec![u64::MAX; 17],
                num_blocks: u32::MAX,
                block_len: u64::MAX,
                compat_hash: u64::MAX,
                instance: u64::MAX,
            },
        ),
    ]
}

pub(crate) fn handshake_seeds() -> Vec<Seed> {
    wire_seeds(&handshake_samples())
}

fn scheduler(engine: &str) -> ConnectorScheduler {
    must(
        ConnectorScheduler::new(SchedulerConfig {
            engine_id: engine.into(),
            block_size: 4,
            side_channel: Some(kvx_core::Endpoint::new("10.0.0.1", 5600)),
            auth_key: Some(auth_key()),
            lease_duration: std::time::Duration::from_secs(30),
            instance: None,
            tp_size: 1,
            group_windows: Vec::new(),
        }),
        "scheduler",
    )
}

/// Connector metadata made by real schedulers: a prefill engine finishes a request and hands out
/// its params; the decode engine loads (or, on a full prefix hit, only notifies); plus edges.
pub(crate) fn connector_metadata_samples() -> Vec<(&'static str, ConnectorMetadata)> {
    let mut prefill = scheduler("prefill");
    let held = TransferParams { do_remote_decode: true, ..Default::default() };
    let out = prefill.request_finished(
        &"cmpl-p-0".into(),
        Some(&held),
        FinishReason::LengthCapped,
        4 * 3 + 1,
        &[GroupBlocks::whole(vec![28, 29, 30, 31])],
    );
    let prefill_meta = prefill.build_connector_meta(std::time::Instant::now());
    let json = out.params.unwrap_or_default().to_json();
    let mut params = must(TransferParams::from_json(&json), "params");
    let mut decode = scheduler("decode");
    must(
        decode.update_state_after_alloc(
            &"cmpl-d-0".into(),
            4 * 3 + 1,
            Some(&mut params.clone()),
            &[GroupBlocks::whole(vec![0, 1, 2])],
            0,
            12,
        ),
        "alloc",
    );
    must(
        decode.update_state_after_alloc(
            &"cmpl-d-1".into(),
            4 * 3 + 1,
            Some(&mut params),
            &[GroupBlocks::new(3, vec![9])],
            12,
            0,
        ),
        "alloc",
    );
    let decode_meta = decode.build_connector_meta(std::time::Instant::now());
    vec![
        ("decode-step", decode_meta),
        ("prefill-step", prefill_meta),
        ("empty", ConnectorMetadata::default()),
        (
            "edges",
            ConnectorMetadata {
                reqs_to_recv: vec![RecvRequest {
                    prompt: None,
                    request_id: "".into(),
                    remote_request_id: Some("\u{1F600}".into()),
                    local_block_ids: vec![GroupBlocks::new(u32::MAX, vec![u32::MAX, 0])],
                    remote_block_ids: vec![GroupBlocks::whole(vec![])],
                    remote: RemoteCoordinates::at("prefill", "10.0.0.1", u16::MAX),
                    nonce: None,
                    mac: Some(kvx_core::HexBytes([0; 32])),
                    remote_instance: Some(kvx_core::HexBytes([0xff; 8])),
                    remote_tp_size: Some(u32::MAX),
                }],
                reqs_to_send: vec![HeldRequest { request_id: "".into(), nonce: NONCE }; 2],
                heartbeats: vec![kvx_core::Heartbeat {
                    remote: RemoteCoordinates::at("prefill", "h".repeat(300), 5600),
                    remote_tp_size: Some(8),
                    holds: vec![HeldRequest { request_id: "x".into(), nonce: NONCE }; 3],
                    pushes: vec!["p".into()],
                }],
                reqs_to_push: vec![kvx_core::PushHold {
                    request_id: "p-1a2b3c4d".into(),
                    registered_as: "p".into(),
                    groups: vec![GroupBlocks::new(u32::MAX, vec![u32::MAX])],
                    prompt: Some(kvx_core::HexBytes([7; 32])),
                }],
                ..Default::default()
            },
        ),
    ]
}

pub(crate) fn connector_metadata_seeds() -> Vec<Seed> {
    wire_seeds(&connector_metadata_samples())
}

pub(crate) fn rank_report_seeds() -> Vec<Seed> {
    wire_seeds(&super::worker::rank_report_samples())
}

/// Hold releases: a typical one, an empty id, one after a READ (answer wanted), one whose
/// `reply_to` is at the edges.
pub(crate) fn hold_release_samples() -> Vec<(&'static str, HoldRelease)> {
    let decode = super::fixture::decode_side_channel();
    vec![
        (
            "typical",
            HoldRelease {
                request_id: "cmpl-7f3a-0".into(),
                nonce: NONCE,
                reply_to: None,
                reader: 0,
                readers: 1,
                instance: None,
            },
        ),
        (
            "empty-id",
            HoldRelease {
                request_id: "".into(),
                nonce: kvx_core::HexBytes([0; 16]),
                reply_to: None,
                reader: 0,
                readers: 1,
                instance: None,
            },
        ),
        (
            "after-a-read",
            HoldRelease {
                request_id: "cmpl-7f3a-0".into(),
                nonce: NONCE,
                reply_to: Some(ReplyTo {
                    engine: decode.clone(),
                    rank: 3,
                    instance: 0x0123_4567_89ab_cdef,
                    token: NONCE,
                }),
                reader: 3,
                readers: 4,
                instance: Some(0x0fed_cba9_8765_4321),
            },
        ),
        (
            "reply-to-edges",
            HoldRelease {
                request_id: "r".into(),
                nonce: NONCE,
                reply_to: Some(ReplyTo {
                    engine: RemoteCoordinates::at("", "h".repeat(300), u16::MAX),
                    rank: u32::MAX,
                    instance: u64::MAX,
                    token: kvx_core::HexBytes([0xff; 16]),
                }),
                reader: u32::MAX,
                readers: u32::MAX,
                instance: Some(u64::MAX),
            },
        ),
    ]
}

/// A prefill rank's answers to a release: held, not held, empty fields.
pub(crate) fn hold_status_samples() -> Vec<(&'static str, HoldStatus)> {
    vec![
        ("held", HoldStatus { request_id: "cmpl-7f3a-0".into(), nonce: NONCE, held: true, token: NONCE }),
        (
            "not-held",
            HoldStatus { request_id: "cmpl-7f3a-0".into(), nonce: NONCE, held: false, token: NONCE },
        ),
        (
            "empty-id",
            HoldStatus {
                request_id: "".into(),
                nonce: kvx_core::HexBytes([0; 16]),
                held: true,
                token: NONCE,
            },
        ),
    ]
}

/// A decode rank's heartbeats: a few holds, none, a full message (the worker sends at most 128
/// holds per message).
pub(crate) fn renew_leases_samples() -> Vec<(&'static str, RenewLeases)> {
    let held = |k: usize| HeldRequest {
        request_id: format!("cmpl-{k:04x}-0").into(),
        nonce: super::fixture::nonce_of(&k.to_string()),
    };
    vec![
        ("typical", RenewLeases { holds: (0..3).map(held).collect(), pushes: vec!["p".into()] }),
        ("empty", RenewLeases { holds: vec![], pushes: vec![] }),
        ("a-full-message", RenewLeases { holds: (0..128).map(held).collect(), pushes: vec![] }),
    ]
}

/// A decode worker's push registrations: a typical one, one of several groups and heads, one
/// that only frees, and hostile variants (huge ids, absurd readers and waits, an empty MAC).
pub(crate) fn push_registration_samples() -> Vec<(&'static str, PushRegistration)> {
    let reply_to = ReplyTo {
        engine: RemoteCoordinates::at("decode", "10.0.0.2", 5700),
        rank: 1,
        instance: 7,
        token: NONCE,
    };
    let typical = PushRegistration {
        prompt: Some(kvx_core::HexBytes([0x5a; 32])),
        request_id: "cmpl-1-0".into(),
        reply_to: reply_to.clone(),
        groups: vec![GroupBlocks::whole(vec![3, 4, 5])],
        heads: Some(kvx_core::tp::Slice { remote_head: 0, local_head: 0, heads: 2 }),
        reader: 1,
        readers: 2,
        instance: Some(9),
        valid_ms: 60_000,
        mac: None,
    };
    vec![
        ("typical", typical.clone()),
        (
            "groups-and-heads",
            PushRegistration {
                groups: vec![GroupBlocks::new(2, vec![7]), GroupBlocks::whole(vec![1, 2, 3])],
                heads: Some(kvx_core::tp::Slice { remote_head: 4, local_head: 1, heads: 1 }),
                mac: Some(kvx_core::HexBytes([0x5a; 32])),
                ..typical.clone()
            },
        ),
        ("frees-only", PushRegistration { groups: vec![], heads: None, ..typical.clone() }),
        (
            "hostile",
            PushRegistration {
                request_id: "x".repeat(4096).into(),
                reader: u32::MAX,
                readers: u32::MAX,
                valid_ms: u64::MAX,
                groups: vec![GroupBlocks::new(u32::MAX, vec![u32::MAX; 4])],
                ..typical
            },
        ),
    ]
}

/// A prefill worker's answers to a registration: written, not written with its reason.
pub(crate) fn push_result_samples() -> Vec<(&'static str, PushResult)> {
    let written =
        PushResult { request_id: "cmpl-1-0".into(), token: NONCE, written: true, reason: String::new() };
    vec![
        ("written", written.clone()),
        ("not-written", PushResult { written: false, reason: "the modes differ".into(), ..written.clone() }),
        ("long-reason", PushResult { written: false, reason: "r".repeat(4096), ..written }),
    ]
}

/// A decode worker's cancels.
pub(crate) fn push_cancel_samples() -> Vec<(&'static str, PushCancel)> {
    let reply_to = ReplyTo {
        engine: RemoteCoordinates::at("decode", "10.0.0.2", 5700),
        rank: 0,
        instance: 7,
        token: NONCE,
    };
    vec![
        ("typical", PushCancel { request_id: "cmpl-1-0".into(), reply_to: reply_to.clone() }),
        ("empty-id", PushCancel { request_id: "".into(), reply_to }),
    ]
}

/// A side channel's request for the payload (it has no fields).
pub(crate) fn metadata_request_samples() -> Vec<(&'static str, MetadataRequest)> {
    vec![("the-request", MetadataRequest {})]
}

/// A client's session frames: hello, proof with the first request, a later request.
pub(crate) fn session_request_samples() -> Vec<(&'static str, SessionRequest)> {
    let request = wire::encode(&MetadataRequest {}).unwrap_or_default();
    vec![
        ("request", SessionRequest::Request { body: request.clone() }),
        ("hello", SessionRequest::Hello { challenge: vec![0x11; 16] }),
        ("proof", SessionRequest::Proof { tag: vec![0x22; 32], body: request }),
        ("empty-hello", SessionRequest::Hello { challenge: vec![] }),
    ]
}

/// A server's session frames: challenge, first reply with its tag, a later reply, refusals.
pub(crate) fn session_reply_samples() -> Vec<(&'static str, SessionReply)> {
    let payload = prefill().payload.clone();
    vec![
        ("reply", SessionReply::Reply { body: payload.clone(), tag: None }),
        ("challenge", SessionReply::Challenge { challenge: vec![0x33; 16] }),
        ("tagged-reply", SessionReply::Reply { body: payload, tag: Some(vec![0x44; 32]) }),
        ("refused", SessionReply::Refused { refusal: Refusal::Unauthenticated, reason: "no key".into() }),
        ("refused-malformed", SessionReply::Refused { refusal: Refusal::Malformed, reason: String::new() }),
    ]
}
