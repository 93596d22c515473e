//! The loopback agent's metadata: the body of kvx-core's agent metadata envelope
//! ([`kvx_core::wire::agent_metadata`]), which `local_metadata` seals and `load_remote` opens and
//! validates.

use serde::{Deserialize, Serialize};

use kvx_core::wire::agent_metadata;
use kvx_core::{AgentName, Error, MemRegion, Result};

use crate::BACKEND;

/// Where the agent lives (fabric and instance) and its registered host memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentMetadata {
    pub(crate) fabric: u64,
    pub(crate) instance: u64,
    pub(crate) regions: Vec<RemoteRegion>,
}

/// One registration of a peer, as its metadata describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RemoteRegion {
    pub(crate) id: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

impl RemoteRegion {
    pub(crate) fn region(&self) -> MemRegion {
        MemRegion::dram(self.addr, self.len)
    }
}

impl AgentMetadata {
    /// Opens and validates a peer's metadata: the peer's name and what it says. Another
    /// backend's metadata or another version is `Incompatible`; anything else malformed is
    /// `InvalidPeerData`, never a panic.
    pub(crate) fn open(bytes: &[u8]) -> Result<(AgentName, Self)> {
        let opened = agent_metadata::open::<Self>(BACKEND, bytes)?;
        let (name, md) = (opened.agent, opened.body);
        let invalid = |msg: String| Error::invalid_peer_data(msg).with_backend(BACKEND);
        let mut ids: Vec<u64> = md.regions.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(invalid(format!("agent {name}: duplicate registration ids")));
        }
        if let Some(r) = md.regions.iter().find(|r| r.len == 0 || r.addr.checked_add(r.len).is_none()) {
            return Err(invalid(format!("agent {name}: invalid region {:#x}+{}", r.addr, r.len)));
        }
        Ok((name, md))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::ErrorKind;

    fn sample() -> AgentMetadata {
        AgentMetadata { fabric: 1, instance: 2, regions: vec![RemoteRegion { id: 3, addr: 4096, len: 8192 }] }
    }

    fn name() -> AgentName {
        AgentName::new("prefill")
    }

    fn kind(md: &AgentMetadata) -> ErrorKind {
        AgentMetadata::open(&agent_metadata::seal(BACKEND, &name(), &md).unwrap()).unwrap_err().kind()
    }

    #[test]
    fn round_trips() {
        let md = sample();
        assert_eq!(
            AgentMetadata::open(&agent_metadata::seal(BACKEND, &name(), &md).unwrap()).unwrap(),
            (name(), md)
        );
    }

    #[test]
    fn rejects_malformed_input_with_typed_errors() {
        let bytes = agent_metadata::seal(BACKEND, &name(), &sample()).unwrap();
        for cut in 0..bytes.len() {
            let e = AgentMetadata::open(&bytes[..cut]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "cut at {cut}");
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert_eq!(AgentMetadata::open(&trailing).unwrap_err().kind(), ErrorKind::InvalidPeerData);
        let other = agent_metadata::seal("ucx", &name(), &sample()).unwrap();
        assert_eq!(AgentMetadata::open(&other).unwrap_err().kind(), ErrorKind::Incompatible);

        let mut md = sample();
        md.regions.push(RemoteRegion { id: 3, addr: 0, len: 1 });
        assert_eq!(kind(&md), ErrorKind::InvalidPeerData);
        let mut md = sample();
        md.regions.push(RemoteRegion { id: 4, addr: u64::MAX, len: 2 });
        assert_eq!(kind(&md), ErrorKind::InvalidPeerData);
        let mut md = sample();
        md.regions.push(RemoteRegion { id: 5, addr: 64, len: 0 });
        assert_eq!(kind(&md), ErrorKind::InvalidPeerData);
    }
}
