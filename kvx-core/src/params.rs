//! `kv_transfer_params`: what the prefill engine hands back and the decode engine receives, in
//! exactly vLLM's JSON shape.

use serde::{Deserialize, Serialize};

use crate::ids::{BlockId, EngineId, RequestId};

/// vLLM's `kv_transfer_params`. Keys vLLM adds that kvx does not know are kept in `extra`, so a
/// round trip through kvx loses nothing.
///
/// `remote_block_ids` is per KV-cache group in vLLM 0.32 (`[[b0, b1, ..]]`); kvx moves one group
/// (full attention), reads both that shape and a flat list, and writes the nested shape.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TransferParams {
    /// Decode side: load this request's prompt KV from a remote prefill engine.
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// Prefill side: keep the blocks after finishing, for a remote decode engine to read.
    #[serde(default)]
    pub do_remote_decode: bool,
    /// The prefill engine's blocks holding the prompt's full blocks.
    #[serde(default, with = "one_group")]
    pub remote_block_ids: Option<Vec<BlockId>>,
    /// The prefill engine's id of the request (the decode engine's id differs): named in the
    /// notification that frees the prefill engine's blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<RequestId>,
    /// The prefill engine.
    #[serde(default)]
    pub remote_engine_id: Option<EngineId>,
    /// Host of the prefill engine's side channel.
    #[serde(default)]
    pub remote_host: Option<String>,
    /// Base port of the prefill engine's side channel (rank `r` listens on `port + r`).
    #[serde(default)]
    pub remote_port: Option<u16>,
    /// Keys kvx does not interpret.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Where a prefill engine's blocks are: complete remote coordinates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteCoordinates {
    /// The prefill engine.
    pub engine_id: EngineId,
    /// Its side-channel host.
    pub host: String,
    /// Its side-channel base port.
    pub port: u16,
}

impl TransferParams {
    /// The params a prefill engine returns for a finished request whose blocks it keeps.
    pub fn for_decode(block_ids: Vec<BlockId>, engine_id: EngineId, host: String, port: u16) -> Self {
        TransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_block_ids: Some(block_ids),
            remote_request_id: None,
            remote_engine_id: Some(engine_id),
            remote_host: Some(host),
            remote_port: Some(port),
            extra: Default::default(),
        }
    }

    /// The remote engine, host and port, if all three are present (and the host is not empty).
    pub fn coordinates(&self) -> Option<RemoteCoordinates> {
        match (&self.remote_engine_id, &self.remote_host, self.remote_port) {
            (Some(engine_id), Some(host), Some(port)) if !host.is_empty() => {
                Some(RemoteCoordinates { engine_id: engine_id.clone(), host: host.clone(), port })
            }
            _ => None,
        }
    }

    /// The remote block ids, or none.
    pub fn remote_blocks(&self) -> &[BlockId] {
        self.remote_block_ids.as_deref().unwrap_or(&[])
    }

    /// Parses vLLM's JSON.
    pub fn from_json(json: &str) -> crate::Result<Self> {
        serde_json::from_str(json).map_err(|e| {
            crate::Error::new(crate::ErrorKind::Wire, format!("kv_transfer_params: {e}")).with_source(e)
        })
    }

    /// Renders vLLM's JSON.
    pub fn to_json(&self) -> String {
        // Serialising plain data with string keys cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// `remote_block_ids` as one KV-cache group: written `[[..]]`, read as `[[..]]` (exactly one
/// group; an empty outer list is no blocks) or as a flat list.
mod one_group {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::ids::BlockId;

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Shape {
        Flat(Vec<BlockId>),
        Groups(Vec<Vec<BlockId>>),
    }

    pub(super) fn serialize<S: Serializer>(ids: &Option<Vec<BlockId>>, s: S) -> Result<S::Ok, S::Error> {
        ids.as_ref().map(std::slice::from_ref).serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<BlockId>>, D::Error> {
        match Option::<Shape>::deserialize(d)? {
            None => Ok(None),
            Some(Shape::Flat(ids)) => Ok(Some(ids)),
            Some(Shape::Groups(mut groups)) if groups.len() <= 1 => {
                Ok(Some(groups.pop().unwrap_or_default()))
            }
            Some(Shape::Groups(groups)) => Err(serde::de::Error::custom(format!(
                "remote_block_ids has {} KV-cache groups; kvx moves one",
                groups.len()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_a_vllm_shaped_object() {
        let json = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3]],"remote_engine_id":"prefill-0","remote_request_id":"cmpl-1-0","remote_host":"10.0.0.1","remote_port":5600,"tp_size":2}"#;
        let p = TransferParams::from_json(json).unwrap();
        assert!(p.do_remote_prefill && !p.do_remote_decode);
        assert_eq!(p.remote_blocks(), &[1, 2, 3]);
        assert_eq!(p.remote_request_id, Some("cmpl-1-0".into()));
        assert_eq!(
            p.coordinates(),
            Some(RemoteCoordinates { engine_id: "prefill-0".into(), host: "10.0.0.1".into(), port: 5600 })
        );
        let back: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
        let orig: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(back, orig);
    }

    #[test]
    fn reads_flat_and_per_group_block_ids_and_writes_per_group() {
        for json in [r#"{"remote_block_ids":[7,8]}"#, r#"{"remote_block_ids":[[7,8]]}"#] {
            let p = TransferParams::from_json(json).unwrap();
            assert_eq!(p.remote_blocks(), &[7, 8]);
            let v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
            assert_eq!(v["remote_block_ids"], serde_json::json!([[7, 8]]));
        }
        let none = TransferParams::from_json(r#"{"remote_block_ids":null}"#).unwrap();
        assert_eq!(none.remote_block_ids, None);
        assert!(TransferParams::from_json(r#"{"remote_block_ids":[]}"#).unwrap().remote_blocks().is_empty());
        let empty_group = TransferParams::from_json(r#"{"remote_block_ids":[[]]}"#).unwrap();
        assert_eq!(empty_group.remote_block_ids, Some(vec![]));
    }

    #[test]
    fn emits_exactly_vllms_keys() {
        let p = TransferParams::for_decode(vec![4], "e".into(), "h".into(), 1);
        let v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
        let mut keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "do_remote_decode",
                "do_remote_prefill",
                "remote_block_ids",
                "remote_engine_id",
                "remote_host",
                "remote_port"
            ]
        );
    }

    #[test]
    fn prefill_request_params_and_bad_input() {
        let p = TransferParams::from_json(r#"{"do_remote_decode": true}"#).unwrap();
        assert!(p.do_remote_decode && p.coordinates().is_none() && p.remote_blocks().is_empty());
        assert!(TransferParams::from_json(r#"{"remote_port": 70000}"#).is_err());
        assert!(TransferParams::from_json(r#"{"remote_block_ids": [-1]}"#).is_err());
        assert!(TransferParams::from_json(r#"{"remote_block_ids": [[1], [2]]}"#).is_err(), "two groups");
        let no_host = TransferParams {
            remote_host: Some(String::new()),
            ..TransferParams::for_decode(vec![], "e".into(), "h".into(), 1)
        };
        assert!(no_host.coordinates().is_none());
    }
}
