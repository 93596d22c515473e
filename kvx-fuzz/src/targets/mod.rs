//! The fuzz targets: one `pub fn name(data: &[u8])` per decoder of peer or client bytes, which
//! must never panic, and the registry that names them.

mod backends;
mod fixture;
mod lease;
mod net;
mod params;
mod tcp;
mod wire;
mod worker;

pub use backends::{loopback_metadata, nixl_metadata, ucx_metadata};
pub use lease::worker_lease_notifications;
pub use net::net_frames;
pub use params::{nonce, transfer_params};
pub use tcp::{tcp_frame_header, tcp_opening, tcp_request};
pub use wire::wire_envelope;
pub use worker::{
    rank_report_aggregate, worker_connector_metadata, worker_handshake, worker_handshake_fields,
    worker_metadata_fields, worker_notification,
};

use kvx_core::wire::HandshakePayload;
use kvx_core::{
    ConnectorMetadata, HoldRelease, HoldStatus, PushCancel, PushRegistration, PushResult, RankReport,
    RenewLeases,
};
use kvx_net::MetadataRequest;
use kvx_net::session::{SessionReply, SessionRequest};

use crate::seeds::{self, Seed};
use crate::{Native, Target, dict};

/// Every target, in a fixed order. A new [`WireMessage`](kvx_core::wire::WireMessage) type is one
/// `Target::wire` line here (with its samples), then `cargo run -p kvx-fuzz -- seed-corpus`.
pub fn all() -> Vec<Target> {
    vec![
        Target::wire::<HandshakePayload>("wire_handshake", wire::handshake_samples),
        Target::wire::<ConnectorMetadata>("wire_connector_metadata", wire::connector_metadata_samples),
        Target::wire::<RankReport>("wire_rank_report", worker::rank_report_samples),
        Target::wire::<HoldRelease>("wire_hold_release", wire::hold_release_samples),
        Target::wire::<HoldStatus>("wire_hold_status", wire::hold_status_samples),
        Target::wire::<RenewLeases>("wire_renew_leases", wire::renew_leases_samples),
        Target::wire::<PushRegistration>("wire_push_registration", wire::push_registration_samples),
        Target::wire::<PushResult>("wire_push_result", wire::push_result_samples),
        Target::wire::<PushCancel>("wire_push_cancel", wire::push_cancel_samples),
        Target::wire::<MetadataRequest>("wire_metadata_request", wire::metadata_request_samples),
        Target::wire::<SessionRequest>("wire_session_request", wire::session_request_samples),
        Target::wire::<SessionReply>("wire_session_reply", wire::session_reply_samples),
        Target::new(
            "net_frames",
            "a TCP stream of kvx frames (net::frame::read_frame), each body a SessionRequest",
            net_frames,
            net::net_frames_seeds,
        ),
        Target::new(
            "tcp_frame_header",
            "a kvx-tcp frame header at either end (kvx_tcp::wire::decode_header), with a limit on data",
            tcp_frame_header,
            tcp::tcp_frame_header_seeds,
        ),
        Target::new(
            "tcp_request",
            "a kvx-tcp request as its target reads it: header, then ranges (kvx_tcp::wire::decode_request)",
            tcp_request,
            tcp::tcp_request_seeds,
        ),
        Target::new(
            "tcp_opening",
            "a kvx-tcp session opening's body (kvx_tcp::wire::Opening::decode)",
            tcp_opening,
            tcp::tcp_opening_seeds,
        )
        .with_dict(tcp::tcp_opening_dict()),
        Target::new(
            "transfer_params",
            "kv_transfer_params JSON (TransferParams::from_json) through two ConnectorSchedulers",
            transfer_params,
            seeds::transfer_params_json,
        )
        .with_dict(dict::json()),
        Target::new("nonce", "a hold's nonce (Nonce::parse, and as JSON)", nonce, seeds::nonces),
        Target::new(
            "worker_handshake",
            "a peer's handshake payload bytes into ConnectorWorker::handle_handshake",
            worker_handshake,
            worker::worker_handshake_seeds,
        )
        .with_dict(dict::msgpack())
        .with_nest(seeds::ENVELOPE_BODY),
        Target::new(
            "worker_handshake_fields",
            "a valid HandshakePayload with fuzzed fields into ConnectorWorker::handle_handshake",
            worker_handshake_fields,
            worker::worker_handshake_fields_seeds,
        ),
        Target::new(
            "worker_connector_metadata",
            "ConnectorMetadata bytes into a decode ConnectorWorker's start_load_kv",
            worker_connector_metadata,
            worker::worker_connector_metadata_seeds,
        )
        .with_dict(dict::msgpack())
        .with_nest(seeds::ENVELOPE_BODY),
        Target::new(
            "worker_metadata_fields",
            "valid ConnectorMetadata with fuzzed loads and holds, two steps, fuzzed handshake answers",
            worker_metadata_fields,
            worker::worker_metadata_fields_seeds,
        ),
        Target::new(
            "worker_notification",
            "notification bytes to a prefill ConnectorWorker holding requests",
            worker_notification,
            worker::worker_notification_seeds,
        ),
        Target::new(
            "worker_lease_notifications",
            "hostile notifications of every kind to a prefill and a decode ConnectorWorker mid-session",
            worker_lease_notifications,
            lease::worker_lease_notifications_seeds,
        ),
        Target::new(
            "rank_report_aggregate",
            "RankReport bytes into FinishedAggregator and ConnectorScheduler::update_finished",
            rank_report_aggregate,
            wire::rank_report_seeds,
        )
        .with_dict(dict::msgpack())
        .with_nest(seeds::ENVELOPE_BODY),
        Target::new(
            "loopback_metadata",
            "kvx-loopback agent metadata (LoopbackAgent::load_remote)",
            loopback_metadata,
            backends::loopback_metadata_seeds,
        )
        .with_dict(dict::agent_metadata())
        .with_nest(seeds::AGENT_METADATA_BODY),
        Target::new(
            "ucx_metadata",
            "kvx-ucx agent metadata (UcxAgent::load_remote); feature `ucx`",
            ucx_metadata,
            backends::ucx_metadata_seeds,
        )
        .with_dict(dict::agent_metadata())
        .with_nest(seeds::AGENT_METADATA_BODY)
        .with_native(Native::Ucx),
        Target::new(
            "nixl_metadata",
            "kvx-nixl agent metadata (NixlAgent::load_remote); feature `nixl`",
            nixl_metadata,
            backends::nixl_metadata_seeds,
        )
        .with_dict(dict::agent_metadata())
        .with_nest(seeds::AGENT_METADATA_BODY)
        .with_native(Native::Nixl),
    ]
}

pub(crate) use backends::{nixl_available, ucx_available};

/// Seeds of a wire type from its samples (for [`Target::wire`]).
pub(crate) fn wire_type_seeds<T: kvx_core::wire::WireMessage>(
    samples: fn() -> Vec<(&'static str, T)>,
) -> Vec<Seed> {
    seeds::wire_seeds(&samples())
}
