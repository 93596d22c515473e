//! The envelope around every backend's agent metadata: what `TransferAgent::local_metadata`
//! returns and `TransferAgent::load_remote` takes.
//!
//! The envelope is a MessagePack map of four keys:
//!
//! | key | type | value |
//! |---|---|---|
//! | `backend` | string | the backend that made it: its `Capabilities::backend` (`"loopback"`, `"ucx"`, `"nixl"`) |
//! | `version` | u32 | [`VERSION`] |
//! | `agent` | string | the agent's name (see [`check_agent_name`]) |
//! | `body` | bin | the backend's own metadata: a MessagePack map that only that backend decodes |
//!
//! [`open`] checks, in this order: the length ([`MAX_LEN`]); the backend and the version, decoded
//! first on their own, so that metadata of another backend, or of another version whatever its
//! other keys, is [`ErrorKind::Incompatible`]; then the whole envelope (no other key, no byte
//! after it), the agent's name, and the body, decoded as strictly (no byte after it; a body type
//! with `#[serde(deny_unknown_fields)]` refuses other keys). Every other failure is
//! [`ErrorKind::InvalidPeerData`], and every error names the backend that opened it. What the
//! body says (addresses, lengths, keys) is the backend's to validate.
//!
//! ```
//! use kvx_core::wire::agent_metadata::{open, seal};
//! use kvx_core::{AgentName, ErrorKind};
//!
//! #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
//! struct Body {
//!     regions: Vec<u64>,
//! }
//!
//! let sealed = seal("ucx", &AgentName::new("prefill-0"), &Body { regions: vec![4096] }).unwrap();
//! let opened = open::<Body>("ucx", &sealed).unwrap();
//! assert_eq!(opened.agent.as_str(), "prefill-0");
//! assert_eq!(opened.body, Body { regions: vec![4096] });
//! assert_eq!(open::<Body>("nixl", &sealed).unwrap_err().kind(), ErrorKind::Incompatible);
//! ```

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::decode_exact;
use crate::error::{Error, ErrorKind, Result, quote};
use crate::ids::AgentName;

/// The envelope's version. Bump it on any incompatible change of the envelope or of any
/// backend's body: the backends of a kvx build are versioned together.
pub const VERSION: u32 = 1;

/// The largest envelope, in bytes, that [`seal`] makes and [`open`] decodes. Far above real
/// metadata (kilobytes: a worker address and a packed key per registration); the side channel's
/// frame limit (16 MiB by default) bounds what a peer can send before this does.
pub const MAX_LEN: usize = 64 << 20;

/// The longest agent name, in bytes.
pub const MAX_AGENT_NAME: usize = 256;

/// What [`open`] found in a peer's agent metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerMetadata<T> {
    /// The peer agent's name (checked as [`check_agent_name`] does).
    pub agent: AgentName,
    /// The backend's own metadata, decoded.
    pub body: T,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    backend: String,
    version: u32,
    agent: AgentName,
    #[serde(with = "serde_bytes")]
    body: Vec<u8>,
}

/// The two keys every version keeps, decoded before the rest (other keys are skipped).
#[derive(Deserialize)]
struct Header {
    backend: String,
    version: u32,
}

/// Checks a name that an agent is to be created with: not empty, at most [`MAX_AGENT_NAME`]
/// bytes, no NUL (NIXL passes names as C strings). An error is
/// [`ErrorKind::InvalidArgument`]. Backends check this where an agent is created, so that its
/// metadata can always be sealed.
pub fn check_agent_name(name: &AgentName) -> Result<()> {
    match name_problem(name.as_str()) {
        Some(problem) => Err(Error::invalid_argument(problem)),
        None => Ok(()),
    }
}

fn name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        Some("the agent name is empty".to_owned())
    } else if name.len() > MAX_AGENT_NAME {
        Some(format!("an agent name of {} bytes, more than {MAX_AGENT_NAME}", name.len()))
    } else if name.contains('\0') {
        Some(format!("the agent name {} contains a NUL", quote(name)))
    } else {
        None
    }
}

/// Seals `body`, the backend's own metadata (encoded as a MessagePack map), for agent `agent`
/// of `backend`. An invalid name, or an envelope over [`MAX_LEN`], is
/// [`ErrorKind::InvalidArgument`]: peers would refuse it.
pub fn seal<T: Serialize>(backend: &'static str, agent: &AgentName, body: &T) -> Result<Vec<u8>> {
    check_agent_name(agent).map_err(|e| e.with_backend(backend))?;
    let encoding = |e: rmp_serde::encode::Error| {
        Error::new(ErrorKind::Wire, format!("encoding agent metadata: {e}"))
            .with_backend(backend)
            .with_source(e)
    };
    let body = rmp_serde::to_vec_named(body).map_err(encoding)?;
    let envelope = Envelope { backend: backend.to_owned(), version: VERSION, agent: agent.clone(), body };
    let bytes = rmp_serde::to_vec_named(&envelope).map_err(encoding)?;
    if bytes.len() > MAX_LEN {
        return Err(Error::invalid_argument(format!(
            "agent metadata of {} bytes, more than {MAX_LEN}: peers would refuse it",
            bytes.len()
        ))
        .with_backend(backend));
    }
    Ok(bytes)
}

/// Opens a peer's agent metadata for an agent of `backend`: the peer's name and its body,
/// decoded as a `T`. Another backend's metadata or another [`VERSION`] is
/// [`ErrorKind::Incompatible`]; anything else wrong (over [`MAX_LEN`], truncated, bytes after
/// the envelope or the body, another key, an invalid name, a body that is not a `T`, garbage) is
/// [`ErrorKind::InvalidPeerData`].
pub fn open<T: DeserializeOwned>(backend: &'static str, bytes: &[u8]) -> Result<PeerMetadata<T>> {
    let fail = |e: Error| e.with_backend(backend).context("agent metadata");
    if bytes.len() > MAX_LEN {
        let oversize = format!("{} bytes, more than {MAX_LEN}", bytes.len());
        return Err(fail(Error::invalid_peer_data(oversize)));
    }
    let header: Header = decode_exact("envelope", bytes).map_err(fail)?;
    if header.backend != backend {
        let other = format!("made by backend {}, not {backend}", quote(&header.backend));
        return Err(fail(Error::new(ErrorKind::Incompatible, other)));
    }
    if header.version != VERSION {
        let other = format!("version {}, this build speaks {VERSION}", header.version);
        return Err(fail(Error::new(ErrorKind::Incompatible, other)));
    }
    let envelope: Envelope = decode_exact("envelope", bytes).map_err(fail)?;
    if let Some(problem) = name_problem(envelope.agent.as_str()) {
        return Err(fail(Error::invalid_peer_data(problem)));
    }
    let body = decode_exact(&format!("{backend} body"), &envelope.body).map_err(fail)?;
    Ok(PeerMetadata { agent: envelope.agent, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        regions: Vec<u64>,
    }

    fn body() -> Body {
        Body { key: vec![7; 40], regions: vec![4096, 8192] }
    }

    fn body_bytes() -> Vec<u8> {
        rmp_serde::to_vec_named(&body()).unwrap()
    }

    fn sealed() -> Vec<u8> {
        seal("ucx", &AgentName::new("prefill-0"), &body()).unwrap()
    }

    fn kind(bytes: &[u8]) -> ErrorKind {
        open::<Body>("ucx", bytes).unwrap_err().kind()
    }

    /// An envelope with any fields and body bytes, as `seal` would not make it.
    fn raw(backend: &str, version: u32, agent: &str, body: Vec<u8>) -> Vec<u8> {
        let envelope = Envelope { backend: backend.into(), version, agent: agent.into(), body };
        rmp_serde::to_vec_named(&envelope).unwrap()
    }

    fn position(bytes: &[u8], part: &[u8]) -> Option<usize> {
        bytes.windows(part.len()).position(|w| w == part)
    }

    #[test]
    fn round_trips_with_the_body_as_msgpack_bin() {
        let bytes = sealed();
        let opened = open::<Body>("ucx", &bytes).unwrap();
        assert_eq!(opened, PeerMetadata { agent: AgentName::new("prefill-0"), body: body() });
        // bin 8 (0xc4) with its length, then the body's bytes as they are: not an array of ints.
        let inner = body_bytes();
        let bin = [&[0xc4, u8::try_from(inner.len()).unwrap()][..], &inner].concat();
        assert!(position(&bytes, &bin).is_some(), "the body is not a MessagePack bin");
        assert_eq!(bytes, raw("ucx", VERSION, "prefill-0", inner));
    }

    #[test]
    fn another_backend_or_version_is_incompatible() {
        let e = open::<Body>("nixl", &sealed()).unwrap_err();
        assert_eq!((e.kind(), e.backend()), (ErrorKind::Incompatible, Some("nixl")));
        assert!(e.message().contains("\"ucx\""), "{e}");
        assert_eq!(kind(&raw("UCX", VERSION, "a", body_bytes())), ErrorKind::Incompatible);
        assert_eq!(kind(&raw("ucx", VERSION + 1, "a", body_bytes())), ErrorKind::Incompatible);
        assert_eq!(kind(&raw("ucx", 0, "a", body_bytes())), ErrorKind::Incompatible);
        // Another version may have other keys: it is still Incompatible, not malformed.
        #[derive(Serialize)]
        struct Later {
            backend: &'static str,
            version: u32,
            peers: Vec<Vec<u32>>,
        }
        let later = Later { backend: "ucx", version: VERSION + 1, peers: vec![vec![1, 2]] };
        assert_eq!(kind(&rmp_serde::to_vec_named(&later).unwrap()), ErrorKind::Incompatible);
    }

    #[test]
    fn truncation_at_every_length_and_trailing_bytes_are_invalid_peer_data() {
        let bytes = sealed();
        for cut in 0..bytes.len() {
            let e = open::<Body>("ucx", &bytes[..cut]).unwrap_err();
            assert_eq!(
                (e.kind(), e.backend()),
                (ErrorKind::InvalidPeerData, Some("ucx")),
                "cut at {cut}: {e}"
            );
        }
        for extra in [&[0u8][..], &[0xc0], &sealed()] {
            let e = open::<Body>("ucx", &[&bytes[..], extra].concat()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "{e}");
            assert!(e.message().contains("after the envelope"), "{e}");
        }
        // The same inside the envelope: the body cut short, or followed by a byte.
        let inner = body_bytes();
        for cut in 0..inner.len() {
            let e = open::<Body>("ucx", &raw("ucx", VERSION, "a", inner[..cut].to_vec())).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "body cut at {cut}: {e}");
        }
        let e = open::<Body>("ucx", &raw("ucx", VERSION, "a", [&inner[..], &[0]].concat())).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPeerData);
        assert!(e.message().contains("after the ucx body"), "{e}");
    }

    #[test]
    fn garbage_other_keys_and_huge_declared_lengths_are_invalid_peer_data() {
        let bytes = sealed();
        // The first byte is a fixmap of 4: one more key, whatever its value, is refused.
        assert_eq!(bytes[0], 0x84);
        let extra_key = [&[0x85][..], &bytes[1..], &[0xa1, b'x', 0x01]].concat();
        assert_eq!(kind(&extra_key), ErrorKind::InvalidPeerData);
        for garbage in [&b""[..], b"\x00", b"not agent metadata", b"\xc1", b"\x94\xa3ucx\x01\xa1a\xc4\x00"] {
            assert_eq!(kind(garbage), ErrorKind::InvalidPeerData, "{garbage:?}");
        }
        // Keys of the right names with values of the wrong types.
        assert_eq!(kind(b"\x82\xa7backend\x01\xa7version\x01"), ErrorKind::InvalidPeerData);
        assert_eq!(kind(b"\x82\xa7backend\xa3ucx\xa7version\xa1x"), ErrorKind::InvalidPeerData);
        // A body of another shape, or with a key its type does not have.
        for other in [&b"\x81\xa1x\x01"[..], b"\xc0", b""] {
            assert_eq!(kind(&raw("ucx", VERSION, "a", other.to_vec())), ErrorKind::InvalidPeerData);
        }
        let inner = body_bytes();
        let extra_body_key = [&[inner[0] + 1][..], &inner[1..], &[0xa1, b'x', 0x01]].concat();
        assert_eq!(kind(&raw("ucx", VERSION, "a", extra_body_key)), ErrorKind::InvalidPeerData);
        // The envelope's body, the name, the map itself, the body's key and a lone array
        // declaring 2^32 - 1 with a few bytes behind them: refused without allocating what they
        // claim.
        let widen = |bytes: &[u8], marker: &[u8], wide: u8| {
            let at = position(bytes, marker).unwrap();
            [&bytes[..at], &[wide, 0xff, 0xff, 0xff, 0xff], &bytes[at + marker.len()..]].concat()
        };
        let huge_body = widen(&bytes, &[0xc4, u8::try_from(inner.len()).unwrap()], 0xc6);
        let huge_name = widen(&bytes, &[0xa9], 0xdb);
        let huge_map = widen(&bytes, &[0x84], 0xdf);
        let huge_key = raw("ucx", VERSION, "a", widen(&inner, &[0xc4, 40], 0xc6));
        for huge in [huge_body, huge_name, huge_map, huge_key, vec![0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0]] {
            assert_eq!(kind(&huge), ErrorKind::InvalidPeerData);
        }
        let e = open::<Body>("ucx", &vec![0; MAX_LEN + 1]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPeerData);
        assert!(e.message().contains("more than"), "refused on its length: {e}");
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        let nested = [&[0xa1, b'x'][..], &[0x91; 5000], &[0xc0]].concat();
        let deep = [&[0x85][..], &sealed()[1..], &nested].concat();
        let inner = body_bytes();
        let deep_body = raw("ucx", VERSION, "a", [&[inner[0] + 1][..], &inner[1..], &nested].concat());
        let bare = [&[0x91; 5000][..], &[0xc0]].concat();
        let kinds = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || [kind(&deep), kind(&deep_body), kind(&bare)])
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(kinds, [ErrorKind::InvalidPeerData; 3]);
    }

    #[test]
    fn names_are_checked_on_both_sides() {
        let long = "n".repeat(MAX_AGENT_NAME + 1);
        for bad in ["", "a\0b", long.as_str()] {
            let e = seal("ucx", &AgentName::new(bad), &body()).unwrap_err();
            assert_eq!((e.kind(), e.backend()), (ErrorKind::InvalidArgument, Some("ucx")), "{bad:?}");
            assert_eq!(
                check_agent_name(&AgentName::new(bad)).unwrap_err().kind(),
                ErrorKind::InvalidArgument
            );
            assert_eq!(kind(&raw("ucx", VERSION, bad, body_bytes())), ErrorKind::InvalidPeerData, "{bad:?}");
        }
        let longest = AgentName::new("n".repeat(MAX_AGENT_NAME));
        assert_eq!(open::<Body>("ucx", &seal("ucx", &longest, &body()).unwrap()).unwrap().agent, longest);
    }

    #[test]
    fn a_body_too_large_to_open_is_not_sealed() {
        let huge = Body { key: vec![0; MAX_LEN], regions: vec![] };
        let e = seal("nixl", &AgentName::new("a"), &huge).unwrap_err();
        assert_eq!((e.kind(), e.backend()), (ErrorKind::InvalidArgument, Some("nixl")));
    }
}
