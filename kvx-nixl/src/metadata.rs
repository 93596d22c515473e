//! What a NixlAgent hands its peers: NIXL's own metadata blob, wrapped with the agent's name and
//! registered regions so that descriptor lists over the peer's memory are checked before NIXL
//! sees them.

use kvx_core::{Error, ErrorKind, MemRegion, Result};
use serde::{Deserialize, Serialize};

use crate::error::error;

/// Marks a kvx-nixl blob; a peer of another backend (or garbage) is refused with a clear error.
const MAGIC: &str = "kvx-nixl";
/// Bumped whenever the envelope changes incompatibly.
const VERSION: u32 = 1;
/// Upper bound on a peer's blob: NIXL metadata is a few KiB per backend and registration.
const MAX_LEN: usize = 64 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Envelope {
    magic: String,
    version: u32,
    /// The agent's name, as NIXL knows it.
    pub(crate) name: String,
    /// The agent's registered memory when the blob was made.
    pub(crate) regions: Vec<MemRegion>,
    /// `nixlAgent::getLocalMD`.
    pub(crate) nixl: Vec<u8>,
}

impl Envelope {
    pub(crate) fn new(name: String, regions: Vec<MemRegion>, nixl: Vec<u8>) -> Self {
        Envelope { magic: MAGIC.to_owned(), version: VERSION, name, regions, nixl }
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        rmp_serde::to_vec(self).map_err(|e| {
            Error::new(ErrorKind::Wire, format!("encoding metadata: {e}"))
                .with_backend(crate::BACKEND)
                .with_source(e)
        })
    }

    /// Decodes and validates a peer's blob.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self> {
        if bytes.len() > MAX_LEN {
            return Err(error(ErrorKind::InvalidPeerData, format!("metadata of {} bytes", bytes.len())));
        }
        // Nesting is bounded: deep arrays under an unknown key would overflow a small stack.
        let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
        de.set_max_depth(kvx_core::wire::MAX_NESTING);
        let envelope = Envelope::deserialize(&mut de).map_err(|e| {
            error(ErrorKind::InvalidPeerData, format!("metadata is not a kvx-nixl blob: {e}")).with_source(e)
        })?;
        if envelope.magic != MAGIC {
            return Err(error(
                ErrorKind::Incompatible,
                format!("metadata of backend {:?}, not {MAGIC}", envelope.magic),
            ));
        }
        if envelope.version != VERSION {
            return Err(error(
                ErrorKind::Incompatible,
                format!("kvx-nixl metadata version {} (this build speaks {VERSION})", envelope.version),
            ));
        }
        if envelope.name.is_empty() || envelope.name.contains('\0') {
            return Err(error(ErrorKind::InvalidPeerData, format!("invalid agent name {:?}", envelope.name)));
        }
        if envelope.regions.iter().any(|r| r.end().is_none()) {
            return Err(error(ErrorKind::InvalidPeerData, "a registered region wraps the address space"));
        }
        if envelope.nixl.is_empty() {
            return Err(error(ErrorKind::InvalidPeerData, "empty NIXL metadata"));
        }
        Ok(envelope)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests fail loudly by unwrapping.
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_garbage() {
        let e = Envelope::new("a".into(), vec![MemRegion::dram(4096, 100)], vec![1, 2, 3]);
        assert_eq!(Envelope::decode(&e.encode().unwrap()).unwrap(), e);
        assert_eq!(Envelope::decode(b"junk").unwrap_err().kind(), ErrorKind::InvalidPeerData);
        let mut other = e.clone();
        other.magic = "kvx-ucx".into();
        assert_eq!(Envelope::decode(&other.encode().unwrap()).unwrap_err().kind(), ErrorKind::Incompatible);
        let mut newer = e.clone();
        newer.version = 2;
        assert_eq!(Envelope::decode(&newer.encode().unwrap()).unwrap_err().kind(), ErrorKind::Incompatible);
        let wrapping = Envelope::new("a".into(), vec![MemRegion::dram(u64::MAX, 2)], vec![1]);
        assert_eq!(
            Envelope::decode(&wrapping.encode().unwrap()).unwrap_err().kind(),
            ErrorKind::InvalidPeerData
        );
        let nul = Envelope::new("a\0b".into(), vec![], vec![1]);
        assert_eq!(Envelope::decode(&nul.encode().unwrap()).unwrap_err().kind(), ErrorKind::InvalidPeerData);
    }
}
