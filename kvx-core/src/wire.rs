//! Wire formats: MessagePack (`rmp-serde`) inside a versioned envelope.
//!
//! Every message that crosses a process boundary is an [`Envelope`]: a magic tag, the wire
//! version and the message kind, then the body. A peer speaking another version is refused with
//! [`ErrorKind::Incompatible`] before its body is looked at.
//!
//! A transfer agent's metadata travels inside a [`HandshakePayload`] in an envelope of its own,
//! [`agent_metadata`], which names the backend that made it.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::ids::{AgentName, EngineId};

pub mod agent_metadata;

/// The wire-format version. Bump it on any incompatible change of a message.
pub const WIRE_VERSION: u16 = 6;

const MAGIC: [u8; 4] = *b"KVX1";

/// The kinds of kvx messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MessageKind {
    /// A worker's [`HandshakePayload`].
    Handshake,
    /// The scheduler's per-step `ConnectorMetadata`.
    ConnectorMetadata,
    /// A rank's finished ids, sent to rank 0.
    FinishedReport,
    /// A request for a worker's handshake payload over the side channel.
    MetadataRequest,
    /// A decode worker's notification that frees a prefill engine's hold.
    HoldRelease,
    /// A client's frame on a kvx TCP connection (`net::session`).
    SessionRequest,
    /// A server's frame on a kvx TCP connection (`net::session`).
    SessionReply,
    /// A rank's message to rank 0 of a `net::TcpGroup`.
    GroupReport,
    /// A prefill worker's answer to a release: was the hold alive.
    HoldStatus,
    /// A decode worker's heartbeat: renew these leases.
    RenewLeases,
    /// A decode worker's registration of its blocks for a push.
    PushRegistration,
    /// A prefill worker's word on a registration: written, or not.
    PushResult,
    /// A decode worker's request not to write a registration.
    PushCancel,
}

/// A message type that travels inside an [`Envelope`].
pub trait WireMessage: Serialize + DeserializeOwned {
    /// Its kind tag.
    const KIND: MessageKind;
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    #[serde(with = "serde_bytes")]
    magic: Vec<u8>,
    version: u16,
    kind: MessageKind,
    #[serde(with = "serde_bytes")]
    body: Vec<u8>,
}

/// Encodes a message in its envelope.
pub fn encode<T: WireMessage>(msg: &T) -> Result<Vec<u8>> {
    let body = rmp_serde::to_vec_named(msg).map_err(|e| wire_error("encode", e))?;
    let env = Envelope { magic: MAGIC.to_vec(), version: WIRE_VERSION, kind: T::KIND, body };
    rmp_serde::to_vec_named(&env).map_err(|e| wire_error("encode", e))
}

/// The deepest nesting of arrays and maps a peer's MessagePack may have. kvx's messages nest a
/// few levels; rmp-serde's default (1024) lets a 2 KB message of nested arrays under an unknown
/// key overflow a 2 MiB thread stack in a debug build (found by kvx-fuzz). Backends decoding
/// their own metadata use it too.
pub const MAX_NESTING: usize = 32;

/// `rmp_serde::from_slice` with nesting bounded by [`MAX_NESTING`].
fn from_slice_bounded<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
) -> std::result::Result<T, rmp_serde::decode::Error> {
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_NESTING);
    T::deserialize(&mut de)
}

/// Decodes one `T` that must take all of `bytes`, which came from a peer: nesting is bounded by
/// [`MAX_NESTING`], a declared length allocates no more than the bytes present, and bytes after
/// the value are refused. Every failure is [`ErrorKind::InvalidPeerData`], its message naming
/// `what` is decoded. For formats whose every byte must be accounted for (agent metadata).
pub fn decode_exact<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T> {
    // A reader over the slice that advances as it is read, so what is left can be checked.
    let mut de = rmp_serde::Deserializer::new(bytes);
    de.set_max_depth(MAX_NESTING);
    let value = T::deserialize(&mut de)
        .map_err(|e| Error::invalid_peer_data(format!("malformed {what}: {e}")).with_source(e))?;
    match de.get_ref().len() {
        0 => Ok(value),
        left => Err(Error::invalid_peer_data(format!("bytes after the {what}: {left}"))),
    }
}

/// Decodes a message from bytes that came from a peer: checks magic, version and kind first.
pub fn decode<T: WireMessage>(bytes: &[u8]) -> Result<T> {
    open(bytes)?.decode()
}

/// A message whose envelope checked (magic and version) and whose body is not decoded yet: for
/// receivers that take several kinds on one channel (a worker's notifications).
#[derive(Debug)]
pub struct Opened {
    kind: MessageKind,
    body: Vec<u8>,
}

impl Opened {
    /// The message's kind.
    pub fn kind(&self) -> MessageKind {
        self.kind
    }

    /// The body as a `T`; an error if the kind is another.
    pub fn decode<T: WireMessage>(&self) -> Result<T> {
        if self.kind != T::KIND {
            return Err(Error::new(
                ErrorKind::Wire,
                format!("expected a {:?} message, got {:?}", T::KIND, self.kind),
            ));
        }
        from_slice_bounded(&self.body).map_err(|e| wire_error("decode body", e))
    }
}

/// Checks the envelope of bytes that came from a peer (magic, then version).
pub fn open(bytes: &[u8]) -> Result<Opened> {
    let env: Envelope = from_slice_bounded(bytes).map_err(|e| wire_error("decode envelope", e))?;
    if env.magic != MAGIC {
        return Err(Error::new(ErrorKind::Wire, "not a kvx message (bad magic)"));
    }
    if env.version != WIRE_VERSION {
        return Err(Error::new(
            ErrorKind::Incompatible,
            format!("peer speaks wire version {}, this build speaks {WIRE_VERSION}", env.version),
        ));
    }
    Ok(Opened { kind: env.kind, body: env.body })
}

fn wire_error(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::new(ErrorKind::Wire, format!("{what}: {e}")).with_source(e)
}

/// What a worker publishes on its side channel for peers to handshake with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandshakePayload {
    /// The engine this worker belongs to.
    pub engine_id: EngineId,
    /// The worker's tensor-parallel rank.
    pub rank: u32,
    /// The engine's tensor-parallel size.
    pub world_size: u32,
    /// KV heads of the whole model (MLA: 1); the rank's blocks hold its share of them.
    pub kv_heads: u32,
    /// The transfer agent's name.
    pub agent_name: AgentName,
    /// The transfer agent's metadata (`TransferAgent::local_metadata`).
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    /// Base address of every region, in layout order.
    pub region_bases: Vec<u64>,
    /// Blocks per region.
    pub num_blocks: u32,
    /// Bytes per block of one region.
    pub block_len: u64,
    /// `KvCacheLayout::compat_hash` of the worker's layout and model tag.
    pub compat_hash: u64,
    /// Chosen at random when the worker starts: a restarted engine publishes a new one, so its
    /// peers tell it from the engine they knew.
    pub instance: u64,
}

impl WireMessage for HandshakePayload {
    const KIND: MessageKind = MessageKind::Handshake;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload() -> HandshakePayload {
        HandshakePayload {
            engine_id: "p".into(),
            rank: 1,
            world_size: 2,
            kv_heads: 8,
            agent_name: "a".into(),
            agent_metadata: vec![1, 2, 3],
            region_bases: vec![4096, 8192],
            num_blocks: 10,
            block_len: 256,
            compat_hash: 42,
            instance: 7,
        }
    }

    #[test]
    fn round_trip() {
        let bytes = encode(&payload()).unwrap();
        assert_eq!(decode::<HandshakePayload>(&bytes).unwrap(), payload());
    }

    #[test]
    fn refuses_other_versions_garbage_and_wrong_kinds() {
        let body = rmp_serde::to_vec_named(&payload()).unwrap();
        let env =
            Envelope { magic: MAGIC.to_vec(), version: WIRE_VERSION + 1, kind: MessageKind::Handshake, body };
        let err = decode::<HandshakePayload>(&rmp_serde::to_vec_named(&env).unwrap()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Incompatible);

        assert_eq!(decode::<HandshakePayload>(b"\xff\x00garbage").unwrap_err().kind(), ErrorKind::Wire);
        assert_eq!(decode::<HandshakePayload>(&[]).unwrap_err().kind(), ErrorKind::Wire);

        let mut bytes = encode(&payload()).unwrap();
        bytes.truncate(bytes.len() - 3);
        assert_eq!(decode::<HandshakePayload>(&bytes).unwrap_err().kind(), ErrorKind::Wire);
    }

    #[test]
    fn deep_nesting_under_an_unknown_key_is_an_error_not_a_stack_overflow() {
        // The envelope map with one more key whose value is 2000 nested arrays.
        let mut bytes = encode(&payload()).unwrap();
        bytes[0] += 1;
        bytes.extend_from_slice(&[0xa1, b'x']);
        bytes.extend(std::iter::repeat_n(0x91, 2000));
        bytes.push(0xc0);
        let decoded = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || decode::<HandshakePayload>(&bytes).map_err(|e| e.kind()))
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(decoded.unwrap_err(), ErrorKind::Wire);
    }
}
