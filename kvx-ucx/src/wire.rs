//! The UCX agent's metadata: the body of kvx-core's agent metadata envelope
//! ([`kvx_core::wire::agent_metadata`]), which `local_metadata` seals and `load_remote` opens and
//! validates before UCX sees any of it.

use serde::{Deserialize, Serialize};

use kvx_core::wire::agent_metadata;
use kvx_core::{AgentName, ErrorKind, Result};

use crate::status::{BACKEND, error};

/// Bounds on what a peer may send; far above real values (a worker address is a few hundred
/// bytes, a packed rkey about a hundred).
const MAX_BLOB: usize = 64 << 10;
const MAX_REGIONS: usize = 1 << 16;

/// What a peer needs to reach an agent and its registered memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentMetadata {
    /// `ucp_worker_get_address`.
    #[serde(with = "serde_bytes")]
    pub(crate) worker_address: Vec<u8>,
    pub(crate) regions: Vec<RegionMetadata>,
}

/// One registered region: where it is in the owner's address space and its packed rkey.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RegionMetadata {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// `ucp_rkey_pack`.
    #[serde(with = "serde_bytes")]
    pub(crate) rkey: Vec<u8>,
}

impl AgentMetadata {
    /// Opens and validates a peer's metadata: the peer's name and what it says. Another
    /// backend's metadata or another version is `Incompatible`; anything else malformed is
    /// `InvalidPeerData`.
    pub(crate) fn open(bytes: &[u8]) -> Result<(AgentName, Self)> {
        let opened = agent_metadata::open::<Self>(BACKEND, bytes)?;
        let (name, meta) = (opened.agent, opened.body);
        let bad =
            |what: String| error(ErrorKind::InvalidPeerData, format!("UCX agent metadata of {name}: {what}"));
        if meta.worker_address.is_empty() || meta.worker_address.len() > MAX_BLOB {
            return Err(bad(format!("worker address of {} bytes", meta.worker_address.len())));
        }
        if meta.regions.len() > MAX_REGIONS {
            return Err(bad(format!("{} regions", meta.regions.len())));
        }
        for (i, r) in meta.regions.iter().enumerate() {
            if r.len == 0 || r.addr.checked_add(r.len).is_none() {
                return Err(bad(format!("region {i} at {:#x} of {} bytes", r.addr, r.len)));
            }
            if r.rkey.is_empty() || r.rkey.len() > MAX_BLOB {
                return Err(bad(format!("region {i} has an rkey of {} bytes", r.rkey.len())));
            }
        }
        Ok((name, meta))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMetadata {
        AgentMetadata {
            worker_address: vec![7; 300],
            regions: vec![RegionMetadata { addr: 0x1000, len: 4096, rkey: vec![1, 2, 3] }],
        }
    }

    fn name() -> AgentName {
        AgentName::new("prefill-0")
    }

    #[test]
    fn round_trips() {
        let m = sample();
        assert_eq!(
            AgentMetadata::open(&agent_metadata::seal(BACKEND, &name(), &m).unwrap()).unwrap(),
            (name(), m)
        );
    }

    #[test]
    fn rejects_garbage_truncation_and_trailing_bytes() {
        let blob = agent_metadata::seal(BACKEND, &name(), &sample()).unwrap();
        for cut in 0..blob.len() {
            let e = AgentMetadata::open(&blob[..cut]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "cut at {cut}: {e}");
        }
        let mut long = blob.clone();
        long.push(0);
        assert_eq!(AgentMetadata::open(&long).unwrap_err().kind(), ErrorKind::InvalidPeerData);
        for seed in 0..200u32 {
            let junk: Vec<u8> = (0..seed).map(|i| (i.wrapping_mul(2654435761) >> 7) as u8).collect();
            assert!(AgentMetadata::open(&junk).is_err());
        }
        // Every single-byte corruption is refused or decodes to something that passes validation:
        // never a panic.
        for i in 0..blob.len() {
            let mut b = blob.clone();
            b[i] ^= 0xff;
            let _ = AgentMetadata::open(&b);
        }
    }

    #[test]
    fn rejects_bad_fields_and_other_backends() {
        let check = |m: AgentMetadata, kind: ErrorKind| {
            let e = AgentMetadata::open(&agent_metadata::seal(BACKEND, &name(), &m).unwrap()).unwrap_err();
            assert_eq!(e.kind(), kind, "{e}");
        };
        let nixl = agent_metadata::seal("nixl", &name(), &sample()).unwrap();
        assert_eq!(AgentMetadata::open(&nixl).unwrap_err().kind(), ErrorKind::Incompatible);
        check(AgentMetadata { worker_address: vec![], ..sample() }, ErrorKind::InvalidPeerData);
        let region = |addr, len, rkey: Vec<u8>| AgentMetadata {
            regions: vec![RegionMetadata { addr, len, rkey }],
            ..sample()
        };
        check(region(u64::MAX, 2, vec![1]), ErrorKind::InvalidPeerData);
        check(region(0x1000, 0, vec![1]), ErrorKind::InvalidPeerData);
        check(region(0x1000, 1, vec![]), ErrorKind::InvalidPeerData);
        check(region(0x1000, 1, vec![1; MAX_BLOB + 1]), ErrorKind::InvalidPeerData);
    }
}
