//! `kv_transfer_params`: what the prefill engine hands back and the decode engine receives, in
//! exactly vLLM's JSON shape.

use serde::{Deserialize, Deserializer, Serialize};

use crate::auth::{AuthKey, HexBytes, MacTag, Nonce, PromptDigest, Purpose};

/// An engine instance's id in params: 8 bytes in hex.
pub type InstanceId = HexBytes<8>;
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{BlockId, EngineId, GroupBlocks, RequestId};

/// vLLM's `kv_transfer_params`. Keys vLLM adds that kvx does not know are kept in `extra`, so a
/// round trip through kvx loses nothing.
///
/// `remote_block_ids` is per KV-cache group in vLLM 0.32 (`[[b0, b1, ..]], one list per group`);
/// kvx reads that shape and a flat list (one group), and writes the nested shape. A group whose
/// list does not start at block position 0 (a sliding-window group that dropped the blocks before
/// its window) has its first position in `kvx_group_first`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TransferParams {
    /// Decode side: load this request's prompt KV from a remote prefill engine. `null` reads as
    /// false, as vLLM reads it.
    #[serde(default, deserialize_with = "null_is_false")]
    pub do_remote_prefill: bool,
    /// Prefill side: keep the blocks after finishing, for a remote decode engine to read. `null`
    /// reads as false.
    #[serde(default, deserialize_with = "null_is_false")]
    pub do_remote_decode: bool,
    /// The prefill engine's blocks holding the prompt's full blocks, one list per KV-cache group.
    #[serde(default, with = "groups")]
    pub remote_block_ids: Option<Vec<Vec<BlockId>>>,
    /// kvx: the block position of each group's first block in `remote_block_ids`; absent: every
    /// group starts at position 0.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kvx_group_first: Vec<u32>,
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
    /// The prefill engine's tensor-parallel size (vLLM's key). A decode engine of another size
    /// reads each rank's heads from the prefill ranks that hold them; absent: the decode
    /// engine's own size. Checked against the prefill workers' handshakes; under the offer's MAC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    /// kvx: the nonce of the prefill engine's hold. The notification that frees the hold must
    /// carry it, so a forged or replayed request id frees nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvx_hold_nonce: Option<Nonce>,
    /// kvx, authenticated deployments: the prefill engine's MAC over its [`Offer`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvx_offer_mac: Option<MacTag>,
    /// kvx: the instance of the prefill engine that made the offer (hex, as JSON numbers past
    /// 2^53 do not survive every client). A decode worker connected to another instance of that
    /// engine handshakes again before reading, and fails the load if the instance is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvx_instance: Option<InstanceId>,
    /// How the KV moves (vLLM's key): absent or `pull`, the decode engine READs the blocks the
    /// prefill engine offers; `push`, the decode engine registers the blocks it allocated with
    /// the prefill engine named here, which WRITEs into them once it has computed the prompt.
    /// Any other value is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_mode: Option<TransferMode>,
    /// Push mode: a digest of the request's prompt, which the engine sets itself on each leg
    /// when the request arrives (replacing whatever a client sent). The prefill engine writes a
    /// registration only into a decode request of the same prompt, so two requests a router sent
    /// under one id cannot be paired: neither receives the other's KV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvx_prompt_digest: Option<PromptDigest>,
    /// Keys kvx does not interpret.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// How a request's KV moves between the engines (vLLM's `transfer_mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransferMode {
    /// The prefill engine holds its blocks and hands their ids back; the decode engine READs them.
    #[default]
    Pull,
    /// The decode engine allocates first and registers its blocks with the prefill engine, which
    /// WRITEs into them when it finishes: the two legs of a request can be dispatched together.
    Push,
}

/// An engine's side channel: host and base port (rank `r` serves on `port + r`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Endpoint {
    /// The side-channel host.
    pub host: String,
    /// The side-channel port.
    pub port: u16,
}

impl Endpoint {
    /// The endpoint `host:port`.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Endpoint { host: host.into(), port }
    }
}

/// Where a remote engine is: its id, and its side channel unless the engines find each other by
/// id (a [`MetadataExchange`](crate::MetadataExchange) over a registry such as etcd).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RemoteCoordinates {
    /// The remote engine.
    pub engine_id: EngineId,
    /// Its side channel (base port); `None`: found by engine id.
    pub endpoint: Option<Endpoint>,
}

impl RemoteCoordinates {
    /// The coordinates of `engine_id` with the side channel at `host:port`.
    pub fn at(engine_id: impl Into<EngineId>, host: impl Into<String>, port: u16) -> Self {
        RemoteCoordinates { engine_id: engine_id.into(), endpoint: Some(Endpoint::new(host, port)) }
    }

    /// The coordinates of `engine_id`, found by id.
    pub fn by_id(engine_id: impl Into<EngineId>) -> Self {
        RemoteCoordinates { engine_id: engine_id.into(), endpoint: None }
    }
}

/// The longest request or engine id kvx accepts from a peer or a client, in bytes.
pub const MAX_ID_LEN: usize = 1024;

/// The most KV-cache groups kvx accepts in params (vLLM's hybrid models have a few; Gemma 3 has six).
pub const MAX_GROUPS: usize = 256;

/// The longest side-channel host kvx accepts from a client (a DNS name is at most 253).
pub const MAX_HOST_LEN: usize = 255;

impl RemoteCoordinates {
    /// Refuses a host over [`MAX_HOST_LEN`] or an engine id over [`MAX_ID_LEN`].
    pub fn check(&self) -> Result<()> {
        if let Some(endpoint) = self.endpoint.as_ref().filter(|e| e.host.len() > MAX_HOST_LEN) {
            return Err(Error::invalid_peer_data(format!(
                "remote host {} is over {MAX_HOST_LEN} bytes",
                crate::error::quote(&endpoint.host)
            )));
        }
        if self.engine_id.as_str().len() > MAX_ID_LEN {
            return Err(Error::invalid_peer_data(format!(
                "remote engine id {} is over {MAX_ID_LEN} bytes",
                crate::error::quote(self.engine_id.as_str())
            )));
        }
        Ok(())
    }
}

impl TransferParams {
    /// The params a prefill engine returns for a finished request whose blocks it keeps.
    pub fn for_decode(groups: Vec<GroupBlocks>, remote: RemoteCoordinates) -> Self {
        let (remote_host, remote_port) = match remote.endpoint {
            Some(Endpoint { host, port }) => (Some(host), Some(port)),
            None => (None, None),
        };
        TransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            kvx_group_first: if groups.iter().all(|g| g.first == 0) {
                Vec::new()
            } else {
                groups.iter().map(|g| g.first).collect()
            },
            remote_block_ids: Some(groups.into_iter().map(|g| g.ids).collect()),
            remote_request_id: None,
            remote_engine_id: Some(remote.engine_id),
            remote_host,
            remote_port,
            tp_size: None,
            kvx_hold_nonce: None,
            kvx_offer_mac: None,
            kvx_instance: None,
            transfer_mode: None,
            kvx_prompt_digest: None,
            extra: Default::default(),
        }
    }

    /// The params a router hands a decode engine for a push, at the same time as it sends the
    /// prompt to the prefill engine `remote` under `request_id` (with
    /// [`for_push_prefill`](Self::for_push_prefill)): no blocks and no nonce, only where the
    /// prefill engine is, its id of the request and its tensor-parallel size. A router that knows
    /// the prefill engine's instance (from an earlier answer of it) sets
    /// [`kvx_instance`](Self::kvx_instance) too, so that a decode engine still connected to an
    /// earlier instance connects again before it registers.
    pub fn for_push(remote: RemoteCoordinates, request_id: RequestId, tp_size: Option<u32>) -> Self {
        TransferParams {
            remote_request_id: Some(request_id),
            tp_size,
            transfer_mode: Some(TransferMode::Push),
            ..TransferParams::for_decode(Vec::new(), remote)
        }
    }

    /// The params a router sends a prefill engine with a prompt whose KV it pushes.
    pub fn for_push_prefill() -> Self {
        TransferParams {
            do_remote_decode: true,
            transfer_mode: Some(TransferMode::Push),
            ..Default::default()
        }
    }

    /// How the KV moves: [`TransferMode::Pull`] unless the params say `push`.
    pub fn mode(&self) -> TransferMode {
        self.transfer_mode.unwrap_or_default()
    }

    /// The remote engine with its host and port, or without both (found by id); `None` without
    /// an engine id, or with only one of host and port (or an empty host).
    pub fn coordinates(&self) -> Option<RemoteCoordinates> {
        let engine_id = self.remote_engine_id.clone()?;
        match (&self.remote_host, self.remote_port) {
            (Some(host), Some(port)) if !host.is_empty() => {
                Some(RemoteCoordinates::at(engine_id, host, port))
            }
            (None, None) => Some(RemoteCoordinates::by_id(engine_id)),
            _ => None,
        }
    }

    /// Whether the params offer any remote block.
    pub fn has_remote_blocks(&self) -> bool {
        self.remote_block_ids.iter().flatten().any(|g| !g.is_empty())
    }

    /// The remote blocks of each KV-cache group with their first positions (none without
    /// `remote_block_ids`); refused as [`from_json`](Self::from_json) refuses them.
    pub fn remote_groups(&self) -> Result<Vec<GroupBlocks>> {
        self.check_groups()?;
        let first = |i: usize| self.kvx_group_first.get(i).copied().unwrap_or(0);
        let groups = self.remote_block_ids.iter().flatten().enumerate();
        Ok(groups.map(|(i, ids)| GroupBlocks::new(first(i), ids.clone())).collect())
    }

    /// Parses vLLM's JSON.
    pub fn from_json(json: &str) -> Result<Self> {
        let params: Self = serde_json::from_str(json)
            .map_err(|e| Error::new(ErrorKind::Wire, format!("kv_transfer_params: {e}")).with_source(e))?;
        params.check_groups()?;
        Ok(params)
    }

    /// Renders vLLM's JSON.
    pub fn to_json(&self) -> String {
        // Serialising plain data with string keys cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Refuses more than [`MAX_GROUPS`] groups, group positions that do not match the groups, or a
    /// group that runs past the last block position.
    fn check_groups(&self) -> Result<()> {
        let groups = self.remote_block_ids.as_deref().unwrap_or(&[]);
        let firsts = &self.kvx_group_first;
        let wrong = |msg: String| Err(Error::new(ErrorKind::Wire, format!("kv_transfer_params: {msg}")));
        if groups.len() > MAX_GROUPS {
            return wrong(format!("{} KV-cache groups, over kvx's {MAX_GROUPS}", groups.len()));
        }
        if !firsts.is_empty() && firsts.len() != groups.len() {
            return wrong(format!(
                "kvx_group_first names {} positions for {} KV-cache groups",
                firsts.len(),
                groups.len()
            ));
        }
        for (i, ids) in groups.iter().enumerate() {
            let first = firsts.get(i).copied().unwrap_or(0);
            if u64::from(first) + ids.len() as u64 > u64::from(u32::MAX) {
                return wrong(format!("KV-cache group {i} runs from block position {first} past 2^32"));
            }
        }
        Ok(())
    }
}

/// What a prefill engine offers a decode engine for one held request: what the MAC in
/// [`TransferParams::kvx_offer_mac`] covers. That is every field of the params that steers the
/// decode engine's connection or what it reads: the engine, its side channel's host and port,
/// its tensor-parallel size (which prefill ranks, so which ports, are handshaken), the request
/// id, every group's first position and block ids, the hold's nonce and the engine's instance.
/// The MAC's input starts with the layout's version ([`OFFER_VERSION`]), then every field, each
/// length-prefixed (an absent one empty), so no two different offers share a tag.
#[derive(Debug, Clone, Copy)]
pub struct Offer<'a> {
    /// The prefill engine and its side channel.
    pub remote: &'a RemoteCoordinates,
    /// The prefill engine's id of the request.
    pub request_id: &'a RequestId,
    /// The held blocks of each KV-cache group, in token order.
    pub groups: &'a [GroupBlocks],
    /// The hold's nonce.
    pub nonce: &'a Nonce,
    /// The prefill engine's instance, when it names one.
    pub instance: Option<&'a InstanceId>,
    /// The prefill engine's tensor-parallel size, when it names one (`tp_size`).
    pub tp_size: Option<u32>,
}

/// The first part of an offer's MAC input: the version of the layout of the parts after it.
pub const OFFER_VERSION: &[u8] = b"offer/2";

impl Offer<'_> {
    fn with_parts<T>(&self, f: impl FnOnce(&[&[u8]]) -> T) -> T {
        let blocks = GroupBlocks::mac_bytes(self.groups);
        // Without an endpoint, an empty host and an empty port: no 2-byte port is empty. So are
        // an absent instance (8 bytes) and TP size (4 bytes).
        let (host, port) = match &self.remote.endpoint {
            Some(e) => (e.host.as_bytes(), e.port.to_le_bytes().to_vec()),
            None => (&[][..], Vec::new()),
        };
        let instance = self.instance.map_or(&[][..], |i| i.as_bytes());
        let tp_size = self.tp_size.map(u32::to_le_bytes);
        f(&[
            OFFER_VERSION,
            self.remote.engine_id.as_str().as_bytes(),
            host,
            &port,
            self.request_id.as_str().as_bytes(),
            &blocks,
            self.nonce.as_bytes(),
            instance,
            tp_size.as_ref().map_or(&[][..], |t| t.as_slice()),
        ])
    }

    /// The offer's MAC under `key`.
    pub fn tag(&self, key: &AuthKey) -> MacTag {
        crate::auth::HexBytes(self.with_parts(|parts| key.tag(Purpose::TransferParams, parts)))
    }

    /// Checks what came from a client before anything touches the network: the ids and host are
    /// not over kvx's limits ([`MAX_ID_LEN`], [`MAX_HOST_LEN`]), and with a key, the MAC verifies.
    pub fn check(&self, key: Option<&AuthKey>, mac: Option<&MacTag>) -> Result<()> {
        if let Some(key) = key {
            self.verify(key, mac)?;
        }
        if self.request_id.as_str().len() > MAX_ID_LEN {
            return Err(Error::invalid_peer_data(format!(
                "remote request id {} is over {MAX_ID_LEN} bytes",
                crate::error::quote(self.request_id.as_str())
            )));
        }
        self.remote.check()
    }

    /// Checks `mac` (absent: refused) against the offer under `key`.
    pub fn verify(&self, key: &AuthKey, mac: Option<&MacTag>) -> Result<()> {
        let Some(mac) = mac else {
            return Err(Error::new(
                ErrorKind::Unauthenticated,
                "kv_transfer_params carry no kvx_offer_mac, and this engine requires one",
            ));
        };
        self.with_parts(|parts| key.verify(Purpose::TransferParams, parts, mac.as_bytes())).map_err(|e| {
            e.context(format!("the offer of request {}", crate::error::quote(self.request_id.as_str())))
        })
    }
}

/// `null` (what Python clients send for an unset flag) reads as false.
fn null_is_false<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// `remote_block_ids` per KV-cache group: written `[[..], ..]`, read as `[[..], ..]` (an empty
/// outer list is no groups) or as a flat list (one group).
mod groups {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use serde_json::Value;

    use crate::error::quote;
    use crate::ids::BlockId;

    pub(super) fn serialize<S: Serializer>(ids: &Option<Vec<Vec<BlockId>>>, s: S) -> Result<S::Ok, S::Error> {
        ids.serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<Vec<BlockId>>>, D::Error> {
        match Option::<Value>::deserialize(d)? {
            None => Ok(None),
            Some(v) => groups(&v).map(Some).map_err(serde::de::Error::custom),
        }
    }

    /// `[[..], ..]` or a flat list; says what is wrong and where otherwise.
    fn groups(v: &Value) -> Result<Vec<Vec<BlockId>>, String> {
        let Value::Array(items) = v else {
            return Err(format!("remote_block_ids is {}, not a list of block ids", shown(v)));
        };
        match items.as_slice() {
            [] => Ok(Vec::new()),
            [Value::Array(_), ..] => {
                items.iter().enumerate().map(|(i, g)| ids(g, &format!("remote_block_ids[{i}]"))).collect()
            }
            _ => ids(v, "remote_block_ids").map(|ids| vec![ids]),
        }
    }

    fn ids(v: &Value, path: &str) -> Result<Vec<BlockId>, String> {
        let Value::Array(items) = v else {
            return Err(format!("{path} is {}, not a list of block ids", shown(v)));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_u64().and_then(|n| BlockId::try_from(n).ok()).ok_or_else(|| {
                    format!(
                        "{path}[{i}] is {}: a block id is a whole number from 0 to {}",
                        shown(x),
                        BlockId::MAX
                    )
                })
            })
            .collect()
    }

    fn shown(v: &Value) -> String {
        quote(&v.to_string())
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
        assert_eq!(p.remote_groups().unwrap(), [GroupBlocks::whole(vec![1, 2, 3])]);
        assert_eq!(p.remote_request_id, Some("cmpl-1-0".into()));
        assert_eq!(p.coordinates(), Some(RemoteCoordinates::at("prefill-0", "10.0.0.1", 5600)));
        let back: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
        let orig: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(back, orig);
    }

    #[test]
    fn reads_flat_and_per_group_block_ids_and_writes_per_group() {
        for json in [r#"{"remote_block_ids":[7,8]}"#, r#"{"remote_block_ids":[[7,8]]}"#] {
            let p = TransferParams::from_json(json).unwrap();
            assert_eq!(p.remote_block_ids, Some(vec![vec![7, 8]]));
            let v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
            assert_eq!(v["remote_block_ids"], serde_json::json!([[7, 8]]));
        }
        let none = TransferParams::from_json(r#"{"remote_block_ids":null}"#).unwrap();
        assert_eq!(none.remote_block_ids, None);
        assert!(!TransferParams::from_json(r#"{"remote_block_ids":[]}"#).unwrap().has_remote_blocks());
        let empty_group = TransferParams::from_json(r#"{"remote_block_ids":[[]]}"#).unwrap();
        assert_eq!(empty_group.remote_block_ids, Some(vec![vec![]]));
        assert!(!empty_group.has_remote_blocks());
    }

    #[test]
    fn emits_exactly_vllms_keys() {
        let p =
            TransferParams::for_decode(vec![GroupBlocks::whole(vec![4])], RemoteCoordinates::at("e", "h", 1));
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
        assert!(p.do_remote_decode && p.coordinates().is_none() && !p.has_remote_blocks());
        assert!(TransferParams::from_json(r#"{"remote_port": 70000}"#).is_err());
        let at = TransferParams::for_decode(vec![], RemoteCoordinates::at("e", "h", 1));
        let no_host = TransferParams { remote_host: Some(String::new()), ..at.clone() };
        assert!(no_host.coordinates().is_none());
        assert!(TransferParams { remote_host: None, ..at.clone() }.coordinates().is_none(), "port only");
        assert!(TransferParams { remote_port: None, ..at.clone() }.coordinates().is_none(), "host only");
        assert!(TransferParams { remote_engine_id: None, ..at }.coordinates().is_none());
    }

    #[test]
    fn params_without_host_and_port_name_the_engine_to_find_by_id() {
        let p = TransferParams::for_decode(
            vec![GroupBlocks::whole(vec![3])],
            RemoteCoordinates::by_id("prefill-0"),
        );
        let back = TransferParams::from_json(&p.to_json()).unwrap();
        assert_eq!(back.coordinates(), Some(RemoteCoordinates::by_id("prefill-0")));
        assert_eq!((back.remote_host, back.remote_port), (None, None));
    }

    #[test]
    fn null_flags_read_as_false_as_vllm_reads_them() {
        let p = TransferParams::from_json(
            r#"{"do_remote_prefill": null, "do_remote_decode": null, "remote_block_ids": null}"#,
        )
        .unwrap();
        assert!(!p.do_remote_prefill && !p.do_remote_decode);
        assert!(TransferParams::from_json(r#"{"do_remote_prefill": 1}"#).is_err(), "not a bool");
    }

    #[test]
    fn bad_block_ids_say_what_is_wrong_and_where() {
        for (json, says) in [
            (r#"{"remote_block_ids": [-1]}"#, "remote_block_ids[0] is \"-1\": a block id is a whole number"),
            (r#"{"remote_block_ids": [3, 1.5]}"#, "remote_block_ids[1] is \"1.5\""),
            (r#"{"remote_block_ids": [[0, 4294967296]]}"#, "remote_block_ids[0][1] is \"4294967296\""),
            (r#"{"remote_block_ids": [[1], 2]}"#, "remote_block_ids[1] is \"2\", not a list"),
            (r#"{"remote_block_ids": [1, [2]]}"#, "remote_block_ids[1] is \"[2]\""),
            (r#"{"remote_block_ids": "7"}"#, "remote_block_ids is \"\\\"7\\\"\", not a list"),
            (r#"{"remote_block_ids": [["x"]]}"#, "remote_block_ids[0][0] is"),
        ] {
            let e = TransferParams::from_json(json).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Wire);
            assert!(e.to_string().contains(says), "{json}: {e}");
            assert!(!e.to_string().contains("untagged"), "{e}");
        }
        let huge = format!(r#"{{"remote_block_ids": ["{}"]}}"#, "x".repeat(10 << 20));
        let e = TransferParams::from_json(&huge).unwrap_err();
        assert!(e.to_string().len() < 400, "a 10 MB id is quoted short: {} bytes", e.to_string().len());
    }

    #[test]
    fn a_huge_host_gives_a_short_error_not_a_huge_one() {
        let p = TransferParams::from_json(&format!(r#"{{"remote_port": "{}"}}"#, "9".repeat(10 << 20)));
        assert!(p.unwrap_err().to_string().len() <= crate::error::MAX_MESSAGE_LEN + 64);
    }

    #[test]
    fn an_offer_verifies_only_unchanged_and_under_the_same_key() {
        let key = AuthKey::new("a deployment's shared secret").unwrap();
        let remote = RemoteCoordinates::at("p", "h", 5600);
        let (id, nonce) = (RequestId::new("r1"), Nonce::parse(&"ab".repeat(16)).unwrap());
        let groups = [GroupBlocks::whole(vec![1, 2])];
        let instance = InstanceId::parse("0102030405060708").unwrap();
        let offer = Offer {
            remote: &remote,
            request_id: &id,
            groups: &groups,
            nonce: &nonce,
            instance: Some(&instance),
            tp_size: Some(2),
        };
        let mac = offer.tag(&key);
        offer.verify(&key, Some(&mac)).unwrap();
        let other_id = RequestId::new("r2");
        let other_remote = RemoteCoordinates::at("p", "h", 5601);
        let by_id = RemoteCoordinates::by_id("p");
        let empty_host = RemoteCoordinates::at("p", "", 5600);
        let other_nonce = Nonce::parse(&"cd".repeat(16)).unwrap();
        let other_instance = InstanceId::parse("0102030405060709").unwrap();
        for changed in [
            Offer { request_id: &other_id, ..offer },
            Offer { groups: &[GroupBlocks::whole(vec![1, 3])], ..offer },
            Offer { groups: &[GroupBlocks::whole(vec![1, 2, 3])], ..offer },
            Offer { groups: &[GroupBlocks::new(1, vec![1, 2])], ..offer },
            Offer { groups: &[GroupBlocks::whole(vec![1]), GroupBlocks::whole(vec![2])], ..offer },
            Offer { groups: &[GroupBlocks::whole(vec![1, 2]), GroupBlocks::whole(vec![])], ..offer },
            Offer { remote: &other_remote, ..offer },
            Offer { remote: &by_id, ..offer },
            Offer { remote: &empty_host, ..offer },
            Offer { nonce: &other_nonce, ..offer },
            Offer { instance: Some(&other_instance), ..offer },
            Offer { instance: None, ..offer },
            Offer { tp_size: Some(4), ..offer },
            Offer { tp_size: None, ..offer },
        ] {
            assert_eq!(changed.verify(&key, Some(&mac)).unwrap_err().kind(), ErrorKind::Unauthenticated);
        }
        let wrong_key = AuthKey::new("another deployment's secret").unwrap();
        assert_eq!(offer.verify(&wrong_key, Some(&mac)).unwrap_err().kind(), ErrorKind::Unauthenticated);
        assert_eq!(offer.verify(&key, None).unwrap_err().kind(), ErrorKind::Unauthenticated);
        let json =
            TransferParams { kvx_hold_nonce: Some(nonce), kvx_offer_mac: Some(mac), ..Default::default() };
        let back = TransferParams::from_json(&json.to_json()).unwrap();
        assert_eq!((back.kvx_hold_nonce, back.kvx_offer_mac), (Some(nonce), Some(mac)));
        let e = TransferParams::from_json(r#"{"kvx_hold_nonce": "zz"}"#).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Wire, "{e}");
        assert!(e.to_string().contains("not 32 hex digits"), "{e}");
    }

    #[test]
    fn groups_round_trip_with_their_first_positions_and_bad_positions_are_refused() {
        let groups = vec![GroupBlocks::new(2, vec![5, 6]), GroupBlocks::whole(vec![1, 2, 3, 4])];
        let p = TransferParams::for_decode(groups.clone(), RemoteCoordinates::at("e", "h", 1));
        let v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
        assert_eq!(v["remote_block_ids"], serde_json::json!([[5, 6], [1, 2, 3, 4]]));
        assert_eq!(v["kvx_group_first"], serde_json::json!([2, 0]));
        let back = TransferParams::from_json(&p.to_json()).unwrap();
        assert_eq!(back.remote_groups().unwrap(), groups);
        // Every group from position 0: vLLM's shape, no kvx key.
        let flat =
            TransferParams::for_decode(vec![GroupBlocks::whole(vec![1])], RemoteCoordinates::by_id("e"));
        assert!(!flat.to_json().contains("kvx_group_first"));
        for (json, says) in [
            (r#"{"remote_block_ids": [[1], [2]], "kvx_group_first": [1]}"#, "names 1 positions for 2"),
            (r#"{"remote_block_ids": [[1]], "kvx_group_first": [0, 0]}"#, "names 2 positions for 1"),
            (r#"{"remote_block_ids": [[1, 2]], "kvx_group_first": [4294967295]}"#, "past 2^32"),
            (r#"{"remote_block_ids": [[1]], "kvx_group_first": [-1]}"#, "expected u32"),
        ] {
            let e = TransferParams::from_json(json).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Wire, "{json}");
            assert!(e.to_string().contains(says), "{json}: {e}");
        }
        let many = format!(r#"{{"remote_block_ids": [{}]}}"#, vec!["[]"; MAX_GROUPS + 1].join(","));
        assert!(TransferParams::from_json(&many).unwrap_err().to_string().contains("KV-cache groups, over"));
        // Built in code with mismatched positions: refused where they are read.
        let odd = TransferParams { kvx_group_first: vec![1, 2], ..flat };
        assert_eq!(odd.remote_groups().unwrap_err().kind(), ErrorKind::Wire);
    }
}
