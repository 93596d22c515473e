//! What a NixlAgent hands its peers: the body of kvx-core's agent metadata envelope
//! ([`kvx_core::wire::agent_metadata`]), NIXL's own metadata blob with the agent's registered
//! regions, so that descriptor lists over the peer's memory are checked before NIXL sees them.

use kvx_core::wire::agent_metadata;
use kvx_core::{AgentName, ErrorKind, MemRegion, Result};
use serde::{Deserialize, Serialize};

use crate::BACKEND;
use crate::error::error;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentMetadata {
    /// The agent's registered memory when the metadata was made.
    pub(crate) regions: Vec<MemRegion>,
    /// `nixlAgent::getLocalMD`.
    #[serde(with = "serde_bytes")]
    pub(crate) nixl: Vec<u8>,
}

impl AgentMetadata {
    /// Opens and validates a peer's metadata: the peer's name and what it says. Another
    /// backend's metadata or another version is `Incompatible`; anything else malformed is
    /// `InvalidPeerData`.
    pub(crate) fn open(bytes: &[u8]) -> Result<(AgentName, Self)> {
        let opened = agent_metadata::open::<Self>(BACKEND, bytes)?;
        let (name, meta) = (opened.agent, opened.body);
        if meta.regions.iter().any(|r| r.end().is_none()) {
            return Err(error(
                ErrorKind::InvalidPeerData,
                format!("{name}: a registered region wraps the address space"),
            ));
        }
        if meta.nixl.is_empty() {
            return Err(error(ErrorKind::InvalidPeerData, format!("{name}: empty NIXL metadata")));
        }
        Ok((name, meta))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests fail loudly by unwrapping.
mod tests {
    use super::*;

    fn sample() -> AgentMetadata {
        AgentMetadata { regions: vec![MemRegion::dram(4096, 100)], nixl: vec![1, 2, 3] }
    }

    fn name() -> AgentName {
        AgentName::new("a")
    }

    fn kind(bytes: &[u8]) -> ErrorKind {
        AgentMetadata::open(bytes).unwrap_err().kind()
    }

    #[test]
    fn round_trips_with_nixls_blob_as_bytes_and_refuses_garbage() {
        let sealed = agent_metadata::seal(BACKEND, &name(), &sample()).unwrap();
        assert_eq!(AgentMetadata::open(&sealed).unwrap(), (name(), sample()));
        // NIXL's blob is a MessagePack bin (0xc4, its length, the bytes), not an array of ints.
        assert!(sealed.windows(5).any(|w| w == [0xc4, 3, 1, 2, 3]), "{sealed:x?}");
        assert_eq!(kind(b"junk"), ErrorKind::InvalidPeerData);
        for cut in 0..sealed.len() {
            assert_eq!(kind(&sealed[..cut]), ErrorKind::InvalidPeerData, "cut at {cut}");
        }
        assert_eq!(kind(&[&sealed[..], &[0]].concat()), ErrorKind::InvalidPeerData);
        let other = agent_metadata::seal("ucx", &name(), &sample()).unwrap();
        assert_eq!(kind(&other), ErrorKind::Incompatible);
        let wrapping = AgentMetadata { regions: vec![MemRegion::dram(u64::MAX, 2)], nixl: vec![1] };
        assert_eq!(
            kind(&agent_metadata::seal(BACKEND, &name(), &wrapping).unwrap()),
            ErrorKind::InvalidPeerData
        );
        let empty = AgentMetadata { nixl: vec![], ..sample() };
        assert_eq!(
            kind(&agent_metadata::seal(BACKEND, &name(), &empty).unwrap()),
            ErrorKind::InvalidPeerData
        );
    }

    #[test]
    fn a_key_a_region_does_not_have_is_refused() {
        #[derive(Serialize)]
        struct Region {
            addr: u64,
            len: u64,
            kind: kvx_core::MemKind,
            device: u32,
            extra: u8,
        }
        #[derive(Serialize)]
        struct Body {
            regions: Vec<Region>,
            #[serde(with = "serde_bytes")]
            nixl: Vec<u8>,
        }
        let region = Region { addr: 4096, len: 100, kind: kvx_core::MemKind::Dram, device: 0, extra: 1 };
        let body = Body { regions: vec![region], nixl: vec![1] };
        assert_eq!(kind(&agent_metadata::seal(BACKEND, &name(), &body).unwrap()), ErrorKind::InvalidPeerData);
    }
}
