//! The loopback agent's metadata: what `local_metadata` encodes and `load_remote` validates.

use serde::{Deserialize, Serialize};

use kvx_core::{AgentName, Error, ErrorKind, MemRegion, Result};

use crate::BACKEND;

const MAGIC: &str = "kvx-loopback";
const VERSION: u32 = 1;

/// The agent's name, where it lives (fabric and instance) and its registered host memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AgentMetadata {
    magic: String,
    version: u32,
    pub(crate) fabric: u64,
    pub(crate) instance: u64,
    pub(crate) name: AgentName,
    pub(crate) regions: Vec<RemoteRegion>,
}

/// One registration of a peer, as its metadata describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
    pub(crate) fn new(fabric: u64, instance: u64, name: AgentName, regions: Vec<RemoteRegion>) -> Self {
        AgentMetadata { magic: MAGIC.to_owned(), version: VERSION, fabric, instance, name, regions }
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        rmp_serde::to_vec_named(self).map_err(|e| {
            Error::new(ErrorKind::Wire, format!("encoding agent metadata: {e}"))
                .with_backend(BACKEND)
                .with_source(e)
        })
    }

    /// Decodes and validates a peer's metadata: every malformed input is `InvalidPeerData` (or
    /// `Incompatible` for another version), never a panic.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self> {
        let invalid = |msg: String| Error::invalid_peer_data(msg).with_backend(BACKEND);
        let mut de = rmp_serde::Deserializer::new(bytes);
        // Deep nesting under an unknown key would otherwise overflow a small stack.
        de.set_max_depth(kvx_core::wire::MAX_NESTING);
        let md = AgentMetadata::deserialize(&mut de)
            .map_err(|e| invalid(format!("malformed agent metadata: {e}")).with_source(e))?;
        if !de.get_ref().is_empty() {
            return Err(invalid(format!("{} trailing bytes after agent metadata", de.get_ref().len())));
        }
        if md.magic != MAGIC {
            return Err(invalid(format!("not loopback agent metadata (magic {:?})", md.magic)));
        }
        if md.version != VERSION {
            return Err(Error::new(
                ErrorKind::Incompatible,
                format!("loopback metadata version {} (this build speaks {VERSION})", md.version),
            )
            .with_backend(BACKEND));
        }
        if md.name.as_str().is_empty() {
            return Err(invalid("agent metadata with an empty name".to_owned()));
        }
        let mut ids: Vec<u64> = md.regions.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(invalid(format!("agent {}: duplicate registration ids", md.name)));
        }
        if let Some(r) = md.regions.iter().find(|r| r.len == 0 || r.addr.checked_add(r.len).is_none()) {
            return Err(invalid(format!("agent {}: invalid region {:#x}+{}", md.name, r.addr, r.len)));
        }
        Ok(md)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMetadata {
        AgentMetadata::new(
            1,
            2,
            AgentName::new("prefill"),
            vec![RemoteRegion { id: 3, addr: 4096, len: 8192 }],
        )
    }

    #[test]
    fn round_trips() {
        let md = sample();
        assert_eq!(AgentMetadata::decode(&md.encode().unwrap()).unwrap(), md);
    }

    #[test]
    fn rejects_malformed_input_with_typed_errors() {
        let bytes = sample().encode().unwrap();
        for cut in 0..bytes.len() {
            let e = AgentMetadata::decode(&bytes[..cut]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "cut at {cut}");
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert_eq!(AgentMetadata::decode(&trailing).unwrap_err().kind(), ErrorKind::InvalidPeerData);

        let mut md = sample();
        md.version = 99;
        assert_eq!(AgentMetadata::decode(&md.encode().unwrap()).unwrap_err().kind(), ErrorKind::Incompatible);
        let mut md = sample();
        md.magic = "nixl".into();
        assert_eq!(
            AgentMetadata::decode(&md.encode().unwrap()).unwrap_err().kind(),
            ErrorKind::InvalidPeerData
        );
        let mut md = sample();
        md.name = AgentName::new("");
        assert_eq!(
            AgentMetadata::decode(&md.encode().unwrap()).unwrap_err().kind(),
            ErrorKind::InvalidPeerData
        );
        let mut md = sample();
        md.regions.push(RemoteRegion { id: 3, addr: 0, len: 1 });
        assert_eq!(
            AgentMetadata::decode(&md.encode().unwrap()).unwrap_err().kind(),
            ErrorKind::InvalidPeerData
        );
        let mut md = sample();
        md.regions.push(RemoteRegion { id: 4, addr: u64::MAX, len: 2 });
        assert_eq!(
            AgentMetadata::decode(&md.encode().unwrap()).unwrap_err().kind(),
            ErrorKind::InvalidPeerData
        );
        let mut md = sample();
        md.regions.push(RemoteRegion { id: 5, addr: 64, len: 0 });
        assert_eq!(
            AgentMetadata::decode(&md.encode().unwrap()).unwrap_err().kind(),
            ErrorKind::InvalidPeerData
        );
    }
}
