//! What the scheduler hands the workers each step, and what the workers hand back.

use serde::{Deserialize, Serialize};
use std::borrow::Cow;

use crate::auth::{AuthKey, MacTag, Nonce, PromptDigest, Purpose};
use crate::error::{Error, Result};
use crate::ids::{BlockId, GroupBlocks, RequestId};
use crate::params::{InstanceId, Offer, RemoteCoordinates};
use crate::tp::Slice;
use crate::wire::{MessageKind, WireMessage};

/// The block pairs of a READ: local blocks and the remote blocks they are read from, index by index.
pub type BlockPairs<'a> = (Cow<'a, [BlockId]>, Cow<'a, [BlockId]>);

/// One request whose KV the decode workers load from a prefill engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecvRequest {
    /// The request.
    pub request_id: RequestId,
    /// The prefill engine's id of the request, when it differs from `request_id` (vLLM gives
    /// each engine's request its own id); the notification names it.
    #[serde(default)]
    pub remote_request_id: Option<RequestId>,
    /// Local blocks to fill, per KV-cache group, at their block positions: each is read from the
    /// remote block at the same position of the same group. No block: nothing to read, only tell
    /// the prefill engine to free.
    pub local_block_ids: Vec<GroupBlocks>,
    /// The prefill engine's held blocks per group, exactly as its params offered them (what
    /// their MAC covers).
    pub remote_block_ids: Vec<GroupBlocks>,
    /// Where the prefill engine is.
    pub remote: RemoteCoordinates,
    /// The prefill engine's nonce for its hold (from the params); the notification carries it.
    #[serde(default)]
    pub nonce: Option<Nonce>,
    /// The prefill engine's MAC over its offer (authenticated deployments).
    #[serde(default)]
    pub mac: Option<MacTag>,
    /// The instance of the prefill engine that made the offer, when the params name it.
    #[serde(default)]
    pub remote_instance: Option<InstanceId>,
    /// The prefill engine's tensor-parallel size, when the params name it (`None`: the decode
    /// engine's own).
    #[serde(default)]
    pub remote_tp_size: Option<u32>,
    /// Push mode: the digest of the request's prompt its engine computed
    /// ([`TransferParams::kvx_prompt_digest`](crate::TransferParams::kvx_prompt_digest)); the
    /// registration carries it.
    #[serde(default)]
    pub prompt: Option<PromptDigest>,
}

impl RecvRequest {
    /// Whether this entry only notifies the prefill engine (nothing to read).
    pub fn is_notify_only(&self) -> bool {
        self.local_block_ids.iter().all(|g| g.ids.is_empty())
    }

    /// The READ's block pairs: each group's local blocks and the offered blocks at the same
    /// positions of the same group, the groups one after another (borrowed for one group);
    /// refused when a group to load is not offered at those positions.
    pub fn read_pairs(&self) -> Result<BlockPairs<'_>> {
        block_pairs(
            &self.local_block_ids,
            &self.remote_block_ids,
            "to load",
            ("offered", "the remote offers"),
        )
    }

    /// The id the prefill engine holds the blocks under.
    pub fn prefill_request_id(&self) -> &RequestId {
        self.remote_request_id.as_ref().unwrap_or(&self.request_id)
    }

    /// The prefill engine's instance the params named, as its workers publish it.
    pub fn prefill_instance(&self) -> Option<u64> {
        self.remote_instance.map(|i| u64::from_le_bytes(*i.as_bytes()))
    }

    /// The prefill engine's offer, as its MAC covers it (once the params carried a nonce).
    pub fn offer(&self) -> Option<Offer<'_>> {
        Some(Offer {
            remote: &self.remote,
            request_id: self.prefill_request_id(),
            groups: &self.remote_block_ids,
            nonce: self.nonce.as_ref()?,
            instance: self.remote_instance.as_ref(),
            tp_size: self.remote_tp_size,
        })
    }
}

/// The blocks of `wanted` paired with those of `offered` at the same positions of the same group,
/// the groups one after another (borrowed for one group); refused when `offered` lacks a position
/// `wanted` names. `wanted_as` and `offered_as` (the count's word, the positions' words) say in the
/// error which side is which.
pub(crate) fn block_pairs<'a>(
    wanted: &'a [GroupBlocks],
    offered: &'a [GroupBlocks],
    wanted_as: &str,
    (count_as, positions_as): (&str, &str),
) -> Result<BlockPairs<'a>> {
    if wanted.len() != offered.len() {
        return Err(Error::invalid_peer_data(format!(
            "{} KV-cache groups {wanted_as}, but {} {count_as}",
            wanted.len(),
            offered.len()
        )));
    }
    let at = |w: &GroupBlocks, o: &'a GroupBlocks| -> Result<&'a [BlockId]> {
        o.at(u64::from(w.first), w.end()).ok_or_else(|| {
            Error::invalid_peer_data(format!(
                "block positions {}..{} {wanted_as}, but {positions_as} {}..{}",
                w.first,
                w.end(),
                o.first,
                o.end()
            ))
        })
    };
    if let ([w], [o]) = (wanted, offered) {
        return Ok((Cow::Borrowed(w.ids.as_slice()), Cow::Borrowed(at(w, o)?)));
    }
    let (mut wanted_ids, mut offered_ids) = (Vec::new(), Vec::new());
    for (w, o) in wanted.iter().zip(offered) {
        wanted_ids.extend_from_slice(&w.ids);
        offered_ids.extend_from_slice(at(w, o)?);
    }
    Ok((Cow::Owned(wanted_ids), Cow::Owned(offered_ids)))
}

/// A request whose blocks the prefill engine now holds for a reader, and the hold's nonce.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldRequest {
    /// The request (the prefill engine's id).
    pub request_id: RequestId,
    /// The nonce handed out in its params; only a notification carrying it frees the hold.
    pub nonce: Nonce,
}

/// The notification a decode worker sends the prefill engine: free the hold of `request_id`,
/// whose params carried `nonce`. Sent after the READ completed (with `reply_to`: the decode worker
/// waits for the [`HoldStatus`] answer before it reports the load done), after it failed, or
/// instead of one (nothing to read).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldRelease {
    /// The prefill engine's id of the request.
    pub request_id: RequestId,
    /// The hold's nonce, from the params.
    pub nonce: Nonce,
    /// Where to answer whether the hold was still alive; `None`: no answer wanted.
    #[serde(default)]
    pub reply_to: Option<ReplyTo>,
    /// The decode rank that sends it: each reader of a hold releases it once.
    #[serde(default)]
    pub reader: u32,
    /// How many decode ranks release this prefill rank's hold (more than one when the decode
    /// engine has more ranks than the prefill engine): the hold ends with the last of them.
    #[serde(default = "one")]
    pub readers: u32,
    /// The prefill engine's instance that the READ's params named (`None`: they named none). A
    /// prefill worker of that instance that has not been handed the hold yet answers at once
    /// (see CONTRACT.md, "The lease lifecycle").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<u64>,
}

fn one() -> u32 {
    1
}

impl WireMessage for HoldRelease {
    const KIND: MessageKind = MessageKind::HoldRelease;
}

/// The decode worker that wants a [`HoldStatus`]: its engine's side channel and the instance of
/// its worker (a restarted decode engine has a new one, so the prefill engine handshakes again).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplyTo {
    /// The decode engine and its side channel (base port; the decode worker's rank is added).
    pub engine: RemoteCoordinates,
    /// The decode worker's tensor-parallel rank: the answer goes to that rank.
    #[serde(default)]
    pub rank: u32,
    /// The decode worker's instance id (from its handshake payload).
    pub instance: u64,
    /// Random for each READ, echoed in the answer: only the release the READ itself carried can
    /// confirm it (a release sent by anyone else who knows the nonce gets an answer the decode
    /// worker does not take).
    pub token: Nonce,
}

/// The prefill worker's answer to a [`HoldRelease`] with `reply_to`: whether the hold was still
/// alive when the release arrived. The release is sent only after the READ completed, so `held`
/// means the lease covered the whole READ; otherwise the blocks may have been reused and the
/// decode worker fails the load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldStatus {
    /// The prefill engine's id of the request.
    pub request_id: RequestId,
    /// The hold's nonce.
    pub nonce: Nonce,
    /// Whether the hold was alive (and is now released).
    pub held: bool,
    /// The release's [`ReplyTo::token`].
    pub token: Nonce,
}

impl WireMessage for HoldStatus {
    const KIND: MessageKind = MessageKind::HoldStatus;
}

/// A decode worker's heartbeat: extend the leases of these holds (each named with its nonce, so
/// nobody without the params can keep blocks pinned).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenewLeases {
    /// The holds, by the prefill engine's request id and nonce.
    pub holds: Vec<HeldRequest>,
    /// Push holds, by the prefill engine's request id: requests whose decode leg waits for its
    /// blocks (each push hold is renewed to at most ten leases from its start).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pushes: Vec<RequestId>,
}

impl WireMessage for RenewLeases {
    const KIND: MessageKind = MessageKind::RenewLeases;
}

/// The scheduler's heartbeat for one prefill engine: the holds of requests still waiting for
/// their KV, whose leases the workers renew.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The prefill engine.
    pub remote: RemoteCoordinates,
    /// Its tensor-parallel size, when the params named it (`None`: the decode engine's own):
    /// decode rank `d` of `D` renews the holds of prefill ranks `d, d + D, ..`.
    #[serde(default)]
    pub remote_tp_size: Option<u32>,
    /// Its holds to renew.
    pub holds: Vec<HeldRequest>,
    /// Its push holds to renew, by its request ids.
    #[serde(default)]
    pub pushes: Vec<RequestId>,
}

/// A request whose blocks the prefill engine now holds for a push: its workers WRITE them into
/// the blocks a decode engine registered for the request. Without blocks (the request was
/// aborted, failed, or computed no full block) nothing is held and the registrations for it are
/// refused at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushHold {
    /// The request: the prefill engine's id, which its workers report the hold freed under.
    pub request_id: RequestId,
    /// The id the decode engines' registrations, cancels and heartbeats name the request by:
    /// `request_id`, unless the router gave both legs a shared id (the prefill leg's
    /// `remote_request_id`), as it must where engines rename requests on arrival (vLLM adds a
    /// random suffix to each engine's id).
    pub registered_as: RequestId,
    /// The held blocks of each KV-cache group, at their block positions.
    pub groups: Vec<GroupBlocks>,
    /// The digest of the request's prompt its engine computed: with one, only a registration
    /// carrying the same is written.
    #[serde(default)]
    pub prompt: Option<PromptDigest>,
}

impl PushHold {
    /// The hold of `request_id`'s blocks `groups`, registered for under the same id, of a prompt
    /// whose digest is not known.
    pub fn new(request_id: RequestId, groups: Vec<GroupBlocks>) -> Self {
        PushHold { registered_as: request_id.clone(), request_id, groups, prompt: None }
    }
}

/// A decode worker's registration, in push mode, of the blocks it allocated for one request with
/// one prefill rank: WRITE your heads of the blocks at these positions into mine, then tell me
/// with a [`PushResult`] carrying `reply_to.token`. With a deployment key it carries a MAC over
/// every field ([`PushRegistration::tag`]), so only a member of the deployment can register.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushRegistration {
    /// The request, by the id the prefill engine's hold is registered under
    /// ([`PushHold::registered_as`]).
    pub request_id: RequestId,
    /// The decode worker (engine, rank, instance) to WRITE into and answer, and the
    /// registration's random token, which the result must carry.
    pub reply_to: ReplyTo,
    /// The decode worker's blocks per KV-cache group, at their block positions: each receives the
    /// prefill engine's block at the same position of the same group. No block: nothing to
    /// write, only free the hold.
    pub groups: Vec<GroupBlocks>,
    /// Which heads: `remote_head` is the first head in the prefill rank's block, `local_head`
    /// the first in the decode rank's (the decode rank's view, as it would READ them).
    pub heads: Option<Slice>,
    /// The decode rank that registers (each of a prefill rank's readers registers once).
    pub reader: u32,
    /// How many decode ranks register with this prefill rank: its hold ends with the last.
    pub readers: u32,
    /// The prefill instance the decode engine expects, when it knows one.
    #[serde(default)]
    pub instance: Option<u64>,
    /// How long after it arrives the prefill engine may still post the WRITE, in milliseconds:
    /// the decode worker's wait left, which it ends, when no answer came, by giving its blocks
    /// up. Past it the registration is refused and a WRITE of it still in flight cancelled.
    #[serde(default)]
    pub valid_ms: u64,
    /// The digest of the decode request's prompt, when its engine computed one: a hold with a
    /// digest writes only a registration of the same.
    #[serde(default)]
    pub prompt: Option<PromptDigest>,
    /// With a deployment key: the MAC over the registration ([`tag`](Self::tag)).
    #[serde(default)]
    pub mac: Option<MacTag>,
}

/// The first part of a registration's MAC input: the version of the layout after it.
const REGISTRATION_VERSION: &[u8] = b"push-registration/1";

impl PushRegistration {
    fn with_parts<T>(&self, f: impl FnOnce(&[&[u8]]) -> T) -> T {
        let blocks = GroupBlocks::mac_bytes(&self.groups);
        let engine = &self.reply_to.engine;
        let (host, port) = match &engine.endpoint {
            Some(e) => (e.host.as_bytes(), e.port.to_le_bytes().to_vec()),
            None => (&[][..], Vec::new()),
        };
        let heads: Vec<u8> = self
            .heads
            .iter()
            .flat_map(|s| [s.remote_head, s.local_head, s.heads])
            .flat_map(u32::to_le_bytes)
            .collect();
        let ranks: Vec<u8> =
            [self.reply_to.rank, self.reader, self.readers].into_iter().flat_map(u32::to_le_bytes).collect();
        let instances: Vec<u8> =
            std::iter::once(self.reply_to.instance).chain(self.instance).flat_map(u64::to_le_bytes).collect();
        let valid = self.valid_ms.to_le_bytes();
        let prompt: &[u8] = self.prompt.as_ref().map_or(&[], |p| p.as_bytes());
        f(&[
            REGISTRATION_VERSION,
            engine.engine_id.as_str().as_bytes(),
            host,
            &port,
            self.request_id.as_str().as_bytes(),
            &blocks,
            &heads,
            &ranks,
            &instances,
            &valid,
            self.reply_to.token.as_bytes(),
            prompt,
        ])
    }

    /// The registration's MAC under `key` (every field but the MAC).
    pub fn tag(&self, key: &AuthKey) -> MacTag {
        crate::auth::HexBytes(self.with_parts(|parts| key.tag(Purpose::PushRegistration, parts)))
    }

    /// Checks the MAC (absent: refused) under `key`.
    pub fn verify(&self, key: &AuthKey) -> Result<()> {
        let Some(mac) = &self.mac else {
            return Err(Error::new(
                crate::error::ErrorKind::Unauthenticated,
                "a push registration without a MAC, and this engine requires one",
            ));
        };
        self.with_parts(|parts| key.verify(Purpose::PushRegistration, parts, mac.as_bytes()))
    }
}

impl WireMessage for PushRegistration {
    const KIND: MessageKind = MessageKind::PushRegistration;
}

/// The prefill worker's word on a [`PushRegistration`]: `written`, sent with the WRITE itself
/// (the transport delivers it after the data), or not, sent alone once no WRITE of it is in
/// flight and none will be posted: the decode worker may then reuse its blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushResult {
    /// The prefill engine's id of the request.
    pub request_id: RequestId,
    /// The registration's token.
    pub token: Nonce,
    /// Whether the blocks were written.
    pub written: bool,
    /// Why not, for the decode engine's error (bounded by the notification's size).
    #[serde(default)]
    pub reason: String,
}

impl WireMessage for PushResult {
    const KIND: MessageKind = MessageKind::PushResult;
}

/// A decode worker that waited too long for a WRITE: do not write this registration. Answered
/// with a [`PushResult`]: `written: false` when no WRITE of it was posted (none will be), else the
/// WRITE's own result when it ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushCancel {
    /// The prefill engine's id of the request.
    pub request_id: RequestId,
    /// The decode worker, and the registration's token.
    pub reply_to: ReplyTo,
}

impl WireMessage for PushCancel {
    const KIND: MessageKind = MessageKind::PushCancel;
}

/// The scheduler's output for the workers of one engine step. Serialisable: in a real engine it
/// crosses from the scheduler process to the worker processes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectorMetadata {
    /// Decode side: requests to load now.
    pub reqs_to_recv: Vec<RecvRequest>,
    /// Prefill side: requests whose blocks are now held for a remote reader.
    pub reqs_to_send: Vec<HeldRequest>,
    /// Decode side: leases to renew, per prefill engine (at most every sixth of a lease).
    #[serde(default)]
    pub heartbeats: Vec<Heartbeat>,
    /// Decode side: requests whose blocks to register with their prefill engine for a push
    /// (their `remote_block_ids`, `nonce` and `mac` are empty: the decode engine was dispatched
    /// before the prefill engine had blocks).
    #[serde(default)]
    pub reqs_to_register: Vec<RecvRequest>,
    /// Prefill side: requests whose blocks are now held for a push.
    #[serde(default)]
    pub reqs_to_push: Vec<PushHold>,
}

impl ConnectorMetadata {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.reqs_to_recv.is_empty()
            && self.reqs_to_send.is_empty()
            && self.heartbeats.is_empty()
            && self.reqs_to_register.is_empty()
            && self.reqs_to_push.is_empty()
    }
}

impl WireMessage for ConnectorMetadata {
    const KIND: MessageKind = MessageKind::ConnectorMetadata;
}

/// A load that failed, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedRecv {
    /// The request.
    pub request_id: RequestId,
    /// What went wrong: its kind, backend and status code stay across ranks (the error's
    /// `Display` is the human-readable reason).
    pub error: Error,
}

/// Requests that finished moving KV since the last report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finished {
    /// Prefill side: the reader is done (or the hold expired); the blocks may be freed.
    pub sending: Vec<RequestId>,
    /// Decode side: the KV is in place; the request may run.
    pub recving: Vec<RequestId>,
    /// Decode side: the load failed; the request must fail or recompute its prefill. Its local
    /// blocks are no longer written to and may be freed.
    pub failed_recving: Vec<FailedRecv>,
}

impl Finished {
    /// Whether nothing finished.
    pub fn is_empty(&self) -> bool {
        self.sending.is_empty() && self.recving.is_empty() && self.failed_recving.is_empty()
    }

    /// Appends `other`.
    pub fn extend(&mut self, other: Finished) {
        self.sending.extend(other.sending);
        self.recving.extend(other.recving);
        self.failed_recving.extend(other.failed_recving);
    }
}

/// A rank's [`Finished`] on its way to rank 0.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankReport {
    /// The sending rank.
    pub rank: u32,
    /// What finished on it.
    pub finished: Finished,
}

impl WireMessage for RankReport {
    const KIND: MessageKind = MessageKind::FinishedReport;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::wire;

    #[test]
    fn a_failed_load_crosses_ranks_with_its_kind_backend_and_code() {
        let error = Error::new(ErrorKind::Transfer, "peer gone").with_backend("ucx").with_code(-25);
        let report = RankReport {
            rank: 1,
            finished: Finished {
                failed_recving: vec![FailedRecv { request_id: "r".into(), error: error.clone() }],
                ..Finished::default()
            },
        };
        let back: RankReport = wire::decode(&wire::encode(&report).unwrap()).unwrap();
        assert_eq!(back, report);
        let failed = &back.finished.failed_recving[0].error;
        assert_eq!(
            (failed.kind(), failed.backend(), failed.code()),
            (ErrorKind::Transfer, Some("ucx"), Some(-25))
        );
        assert_eq!(failed.to_string(), error.to_string());
    }
}
