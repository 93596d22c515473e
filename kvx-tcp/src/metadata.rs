//! The TCP agent's metadata: the body of kvx-core's agent metadata envelope
//! ([`kvx_core::wire::agent_metadata`]), which `local_metadata` seals and `load_remote` opens and
//! validates: where the agent listens, its instance, and its registered host memory.

use serde::{Deserialize, Serialize};

use kvx_core::wire::agent_metadata;
use kvx_core::{AgentName, Error, MemRegion, Result};

use crate::BACKEND;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentMetadata {
    /// Random per agent: a connection opened with stale metadata (a restarted agent on the same
    /// port) is refused.
    pub(crate) instance: u64,
    /// The host peers connect to (an address or a name).
    pub(crate) host: String,
    pub(crate) port: u16,
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

/// The longest host name a peer may give (DNS names are at most 253 bytes).
const MAX_HOST_LEN: usize = 255;

impl AgentMetadata {
    /// Opens and validates a peer's metadata. Another backend's or version is `Incompatible`;
    /// anything else malformed is `InvalidPeerData`.
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
        if md.host.is_empty() || md.host.len() > MAX_HOST_LEN || md.port == 0 {
            return Err(invalid(format!(
                "agent {name}: invalid address (a host of {} bytes, port {})",
                md.host.len(),
                md.port
            )));
        }
        Ok((name, md))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::ErrorKind;

    fn sample() -> AgentMetadata {
        AgentMetadata {
            instance: 2,
            host: "127.0.0.1".into(),
            port: 5900,
            regions: vec![RemoteRegion { id: 3, addr: 4096, len: 8192 }],
        }
    }

    fn seal(md: &AgentMetadata) -> Vec<u8> {
        agent_metadata::seal(BACKEND, &AgentName::new("prefill"), md).unwrap()
    }

    fn kind(md: &AgentMetadata) -> ErrorKind {
        AgentMetadata::open(&seal(md)).unwrap_err().kind()
    }

    #[test]
    fn round_trips() {
        let md = sample();
        assert_eq!(AgentMetadata::open(&seal(&md)).unwrap(), (AgentName::new("prefill"), md));
    }

    #[test]
    fn rejects_malformed_input_with_typed_errors() {
        let bytes = seal(&sample());
        for cut in 0..bytes.len() {
            assert_eq!(
                AgentMetadata::open(&bytes[..cut]).unwrap_err().kind(),
                ErrorKind::InvalidPeerData,
                "{cut}"
            );
        }
        let other = agent_metadata::seal("ucx", &AgentName::new("prefill"), &sample()).unwrap();
        assert_eq!(AgentMetadata::open(&other).unwrap_err().kind(), ErrorKind::Incompatible);
        let bad: [fn(&mut AgentMetadata); 5] = [
            |md| md.regions.push(RemoteRegion { id: 3, addr: 0, len: 1 }),
            |md| md.regions.push(RemoteRegion { id: 4, addr: u64::MAX, len: 2 }),
            |md| md.regions.push(RemoteRegion { id: 5, addr: 64, len: 0 }),
            |md| md.host = String::new(),
            |md| md.port = 0,
        ];
        for edit in bad {
            let mut md = sample();
            edit(&mut md);
            assert_eq!(kind(&md), ErrorKind::InvalidPeerData, "{md:?}");
        }
    }
}
