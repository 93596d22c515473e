//! The events the fuzz bytes pick between the ranks' steps: time passing, releases,
//! heartbeats, answers, garbage and messages of other kinds, from a third agent or the peers.

use std::time::Duration;

use kvx_core::wire::{self, MessageKind};
use kvx_core::worker::{MAX_HOST_LEN, MAX_ID_LEN};
use kvx_core::{
    ConnectorMetadata, Heartbeat, HeldRequest, HoldRelease, HoldStatus, Nonce, RemoteCoordinates,
    RenewLeases, ReplyTo, RequestId,
};

use super::session::{Session, To};
use crate::input::ByteSource;
use crate::targets::fixture::{NONCE, decode_side_channel, must, other_nonce, prefill_coordinates};

impl Session {
    /// A request id the bytes pick: one of the loads' (as the prefill engine names it), an
    /// unknown one, an empty one or one over kvx's limit.
    fn pick_id(&self, src: &mut ByteSource<'_>) -> (RequestId, Option<usize>) {
        match src.below(6) {
            i @ 0..3 => (self.loads[i].prefill_request_id().clone(), Some(i)),
            3 => ("cmpl-unknown".into(), None),
            4 => ("".into(), None),
            _ => ("x".repeat(MAX_ID_LEN + 1).into(), None),
        }
    }

    /// A nonce for `load`: its own, another, a shared or an arbitrary one.
    fn pick_nonce(&self, src: &mut ByteSource<'_>, load: Option<usize>) -> Nonce {
        let own = load.and_then(|i| self.loads[i].nonce).unwrap_or(NONCE);
        match src.below(4) {
            0 => own,
            1 => other_nonce(&own),
            2 => NONCE,
            _ => kvx_core::HexBytes([src.u8(); 16]),
        }
    }

    fn pick_reply_to(&self, src: &mut ByteSource<'_>) -> Option<ReplyTo> {
        let instance = self.decode.worker.instance();
        let decode = decode_side_channel();
        let (engine, instance) = match src.below(9) {
            0 => return None,
            1 => (decode, instance),
            2 => (decode, instance ^ 1),
            3 => (prefill_coordinates(), instance),
            4 => (RemoteCoordinates::at(decode.engine_id, "h".repeat(MAX_HOST_LEN + 1), 5700), instance),
            5 => (RemoteCoordinates::at(decode.engine_id, "h".repeat(MAX_HOST_LEN), 5700), instance),
            6 => (RemoteCoordinates::at(decode.engine_id, "10.0.0.2", u16::MAX), instance),
            7 => (RemoteCoordinates { engine_id: "elsewhere".into(), ..decode }, instance),
            _ => (RemoteCoordinates { engine_id: "e".repeat(MAX_ID_LEN + 1).into(), ..decode }, src.u64()),
        };
        Some(ReplyTo { engine, rank: 0, instance, token: kvx_core::HexBytes([src.u8(); 16]) })
    }

    /// A release of `request_id` under `nonce` by someone who knows the offer: asking for an
    /// answer somewhere, naming no prefill instance, the prefill rank's own (so that it may be
    /// answered before its hold comes) or another.
    fn forged_release(&self, src: &mut ByteSource<'_>, request_id: RequestId, nonce: Nonce) -> HoldRelease {
        let reply_to = self.pick_reply_to(src);
        let own = self.prefill.worker.instance();
        let instance = [None, Some(own), Some(own ^ 1)][src.below(3)];
        HoldRelease { request_id, nonce, reply_to, reader: 0, readers: 1, instance }
    }

    pub(super) fn event(&mut self, src: &mut ByteSource<'_>) {
        match src.below(8) {
            0 => {
                let lease = self.model.lease;
                let confirm = self.decode.worker.config().confirm_timeout;
                let dt = [
                    Duration::ZERO,
                    Duration::from_secs(1),
                    lease / 2,
                    lease + Duration::from_secs(1),
                    confirm,
                ][src.below(5)];
                self.now += dt;
                self.both_step();
            }
            1 => {
                let (request_id, load) = self.pick_id(src);
                let nonce = self.pick_nonce(src, load);
                // Released by someone who knows the offer, asking for the answer at the decode
                // engine: the answer carries this release's token, not the READ's.
                let msg = must(wire::encode(&self.forged_release(src, request_id, nonce)), "encoding");
                let from_peer = src.below(4) == 3;
                self.send(To::Prefill, from_peer, &msg);
            }
            2 => {
                let count = [1, 3, 128, 2000][src.below(4)];
                let mut holds = Vec::with_capacity(count);
                for _ in 0..count.min(4) {
                    let (request_id, load) = self.pick_id(src);
                    let nonce = self.pick_nonce(src, load);
                    holds.push(HeldRequest { request_id, nonce });
                }
                while holds.len() < count {
                    let k = holds.len();
                    holds.push(HeldRequest { request_id: format!("r-{k}").into(), nonce: NONCE });
                }
                let msg = must(wire::encode(&RenewLeases { holds, pushes: Vec::new() }), "encoding");
                self.send(To::Prefill, src.below(4) == 3, &msg);
            }
            3 => {
                let (request_id, load) = self.pick_id(src);
                let nonce = self.pick_nonce(src, load);
                let held = src.below(2) == 0;
                let from_peer = src.below(2) == 1;
                // Even from the peer's agent, an answer without the READ's token confirms nothing.
                let msg = must(
                    wire::encode(&HoldStatus {
                        request_id,
                        nonce,
                        held,
                        token: kvx_core::HexBytes([src.u8(); 16]),
                    }),
                    "encoding",
                );
                self.send(To::Decode, from_peer, &msg);
            }
            4 => {
                let to = if src.below(2) == 0 { To::Prefill } else { To::Decode };
                let msg = src.bytes(64).to_vec();
                self.send(to, src.below(2) == 1, &msg);
            }
            5 => {
                // The wrong way: answers to the prefill rank, releases and heartbeats to the decode
                // rank.
                let (request_id, load) = self.pick_id(src);
                let nonce = self.pick_nonce(src, load);
                let (to, msg) = match src.below(3) {
                    0 => (
                        To::Prefill,
                        wire::encode(&HoldStatus {
                            request_id,
                            nonce,
                            held: true,
                            token: kvx_core::HexBytes([src.u8(); 16]),
                        }),
                    ),
                    1 => (To::Decode, wire::encode(&self.forged_release(src, request_id, nonce))),
                    _ => (
                        To::Decode,
                        wire::encode(&RenewLeases {
                            holds: vec![HeldRequest { request_id, nonce }],
                            pushes: Vec::new(),
                        }),
                    ),
                };
                let msg = must(msg, "encoding");
                self.send(to, src.below(2) == 1, &msg);
            }
            6 => {
                // Other kinds and versions: a payload, metadata, a release of another wire version.
                let to = if src.below(2) == 0 { To::Prefill } else { To::Decode };
                let msg = match src.below(3) {
                    0 => self.prefill.payload.clone(),
                    1 => must(wire::encode(&ConnectorMetadata::default()), "encoding"),
                    _ => {
                        let body = rmp_serde::to_vec_named(&HoldStatus {
                            request_id: self.loads[0].prefill_request_id().clone(),
                            nonce: self.loads[0].nonce.unwrap_or(NONCE),
                            held: true,
                            token: NONCE,
                        })
                        .unwrap_or_default();
                        crate::seeds::raw_envelope(
                            b"KVX1",
                            wire::WIRE_VERSION + 1,
                            MessageKind::HoldStatus,
                            &body,
                        )
                    }
                };
                self.send(to, src.below(2) == 1, &msg);
            }
            _ => {
                // The decode scheduler's heartbeat for the loads still waiting.
                let holds = self
                    .loads
                    .iter()
                    .filter_map(|r| {
                        Some(HeldRequest { request_id: r.prefill_request_id().clone(), nonce: r.nonce? })
                    })
                    .collect();
                let remote = match src.below(3) {
                    0 => prefill_coordinates(),
                    1 => RemoteCoordinates { engine_id: "elsewhere".into(), ..prefill_coordinates() },
                    _ => RemoteCoordinates::at(prefill_coordinates().engine_id, "10.0.0.1", u16::MAX),
                };
                let meta = ConnectorMetadata {
                    heartbeats: vec![Heartbeat { remote, remote_tp_size: None, holds, pushes: Vec::new() }],
                    ..Default::default()
                };
                self.decode.worker.start_load_kv(self.now, &meta);
                self.answer_decode_fetches();
            }
        }
    }
}
