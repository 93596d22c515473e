//! The agent metadata blob: MessagePack (rmp-serde) in a versioned envelope, validated on load.

use serde::{Deserialize, Serialize};

use kvx_core::{AgentName, ErrorKind, Result};

use crate::status::error;

/// Identifies the blob's producer, so that another backend's metadata is refused clearly.
const FORMAT: &str = "kvx-ucx";
/// Bumped on any incompatible change of [`AgentMetadata`].
pub(crate) const VERSION: u32 = 1;

/// Bounds on what a peer may send; far above real values (a worker address is a few hundred
/// bytes, a packed rkey about a hundred).
pub(crate) const MAX_METADATA: usize = 16 << 20;
pub(crate) const MAX_NAME: usize = 256;
const MAX_BLOB: usize = 64 << 10;
const MAX_REGIONS: usize = 1 << 16;

/// What a peer needs to reach an agent and its registered memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AgentMetadata {
    pub(crate) format: String,
    pub(crate) version: u32,
    pub(crate) name: String,
    /// `ucp_worker_get_address`.
    #[serde(with = "serde_bytes")]
    pub(crate) worker_address: Vec<u8>,
    pub(crate) regions: Vec<RegionMetadata>,
}

/// One registered region: where it is in the owner's address space and its packed rkey.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RegionMetadata {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// `ucp_rkey_pack`.
    #[serde(with = "serde_bytes")]
    pub(crate) rkey: Vec<u8>,
}

impl AgentMetadata {
    pub(crate) fn new(name: &AgentName, worker_address: Vec<u8>, regions: Vec<RegionMetadata>) -> Self {
        AgentMetadata {
            format: FORMAT.into(),
            version: VERSION,
            name: name.to_string(),
            worker_address,
            regions,
        }
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        rmp_serde::to_vec(self)
            .map_err(|e| error(ErrorKind::Wire, format!("encoding UCX agent metadata: {e}")))
    }

    /// Decodes and validates a peer's blob. Anything malformed is `InvalidPeerData`; another format
    /// or version is `Incompatible`.
    pub(crate) fn decode(blob: &[u8]) -> Result<Self> {
        let bad = |what: String| error(ErrorKind::InvalidPeerData, format!("UCX agent metadata: {what}"));
        if blob.len() > MAX_METADATA {
            return Err(bad(format!("{} bytes, more than {MAX_METADATA}", blob.len())));
        }
        // A reader over the slice: declared lengths cannot make it allocate more than the blob
        // holds. Nesting is bounded: deep arrays under an unknown key would overflow a small stack.
        let mut de = rmp_serde::Deserializer::from_read_ref(blob);
        de.set_max_depth(kvx_core::wire::MAX_NESTING);
        let meta = AgentMetadata::deserialize(&mut de).map_err(|e| bad(format!("undecodable: {e}")))?;
        if meta.format != FORMAT || meta.version != VERSION {
            return Err(error(
                ErrorKind::Incompatible,
                format!(
                    "UCX agent metadata: format {:?} version {}, expected {FORMAT:?} version {VERSION}",
                    meta.format, meta.version
                ),
            ));
        }
        // Our encoder is the only producer: anything that does not re-encode to the same length
        // has trailing or smuggled bytes.
        if meta.encode()?.len() != blob.len() {
            return Err(bad("trailing bytes or non-canonical encoding".into()));
        }
        if meta.name.is_empty() || meta.name.len() > MAX_NAME {
            return Err(bad(format!("agent name of {} bytes", meta.name.len())));
        }
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
        Ok(meta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMetadata {
        AgentMetadata::new(
            &AgentName::new("prefill-0"),
            vec![7; 300],
            vec![RegionMetadata { addr: 0x1000, len: 4096, rkey: vec![1, 2, 3] }],
        )
    }

    #[test]
    fn round_trips() {
        let m = sample();
        assert_eq!(AgentMetadata::decode(&m.encode().unwrap()).unwrap(), m);
    }

    #[test]
    fn rejects_garbage_truncation_and_trailing_bytes() {
        let blob = sample().encode().unwrap();
        for cut in 0..blob.len() {
            let e = AgentMetadata::decode(&blob[..cut]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "cut at {cut}: {e}");
        }
        let mut long = blob.clone();
        long.push(0);
        assert_eq!(AgentMetadata::decode(&long).unwrap_err().kind(), ErrorKind::InvalidPeerData);
        for seed in 0..200u32 {
            let junk: Vec<u8> = (0..seed).map(|i| (i.wrapping_mul(2654435761) >> 7) as u8).collect();
            assert!(AgentMetadata::decode(&junk).is_err());
        }
        // Every single-byte corruption is refused or decodes to something that passes validation:
        // never a panic.
        for i in 0..blob.len() {
            let mut b = blob.clone();
            b[i] ^= 0xff;
            let _ = AgentMetadata::decode(&b);
        }
    }

    #[test]
    fn rejects_bad_fields_and_other_versions() {
        let check = |m: AgentMetadata, kind: ErrorKind| {
            let e = AgentMetadata::decode(&m.encode().unwrap()).unwrap_err();
            assert_eq!(e.kind(), kind, "{e}");
        };
        check(AgentMetadata { version: 2, ..sample() }, ErrorKind::Incompatible);
        check(AgentMetadata { format: "nixl".into(), ..sample() }, ErrorKind::Incompatible);
        check(AgentMetadata { name: String::new(), ..sample() }, ErrorKind::InvalidPeerData);
        check(AgentMetadata { worker_address: vec![], ..sample() }, ErrorKind::InvalidPeerData);
        let region = |addr, len, rkey: Vec<u8>| AgentMetadata {
            regions: vec![RegionMetadata { addr, len, rkey }],
            ..sample()
        };
        check(region(u64::MAX, 2, vec![1]), ErrorKind::InvalidPeerData);
        check(region(0x1000, 0, vec![1]), ErrorKind::InvalidPeerData);
        check(region(0x1000, 1, vec![]), ErrorKind::InvalidPeerData);
    }
}
