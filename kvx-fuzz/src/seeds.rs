//! Real inputs to start from: messages encoded by kvx itself (from live schedulers, workers and
//! agents where there is one), vLLM-shaped `kv_transfer_params`, and hostile variants. The
//! targets replay them before mutating; `kvx-fuzz seed-corpus` writes them to the committed
//! corpus.

use serde::{Deserialize, Serialize};

use kvx_core::wire::{self, MessageKind, WIRE_VERSION, WireMessage};

/// One named input. Names starting `hostile-` are inputs that must be refused; the engine
/// mutates the others more often (mutating garbage mostly makes more garbage).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    /// A file-name-safe name (`[a-z0-9._-]`).
    pub name: String,
    /// The bytes.
    pub bytes: Vec<u8>,
}

impl Seed {
    /// A seed; `name` is made file-name-safe.
    pub fn new(name: impl AsRef<str>, bytes: impl Into<Vec<u8>>) -> Self {
        let name =
            name.as_ref()
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                        c.to_ascii_lowercase()
                    } else {
                        '_'
                    }
                })
                .collect();
        Seed { name, bytes: bytes.into() }
    }
}

/// The envelope as `kvx_core::wire` writes it, for making envelopes `wire::encode` would not:
/// another version, kind or magic, a body of any bytes.
#[derive(Serialize)]
struct RawEnvelope<'a> {
    #[serde(with = "serde_bytes")]
    magic: &'a [u8],
    version: u16,
    kind: MessageKind,
    #[serde(with = "serde_bytes")]
    body: &'a [u8],
}

/// The same envelope, read back (any magic, version and kind).
#[derive(Deserialize)]
struct OwnedEnvelope {
    magic: serde_bytes::ByteBuf,
    version: u16,
    kind: MessageKind,
    body: serde_bytes::ByteBuf,
}

/// `bytes` as a `T`, nesting bounded as kvx bounds it; `None` if they are not one.
fn read_bounded<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(wire::MAX_NESTING);
    T::deserialize(&mut de).ok()
}

fn read_envelope(bytes: &[u8]) -> Option<OwnedEnvelope> {
    read_bounded(bytes)
}

/// A format nested inside a target's input, which the engine mutates in place and wraps again:
/// a byte inserted into a wire message's body then does not just break the envelope's length.
#[derive(Debug, Clone, Copy)]
pub struct Nest {
    /// The inner bytes, if the input has the outer format.
    pub unwrap: fn(&[u8]) -> Option<Vec<u8>>,
    /// `outer` with its inner bytes replaced by `inner`.
    pub wrap: fn(outer: &[u8], inner: &[u8]) -> Vec<u8>,
}

/// The body of a kvx wire envelope.
pub const ENVELOPE_BODY: Nest = Nest {
    unwrap: |bytes| read_envelope(bytes).map(|e| e.body.into_vec()),
    wrap: |outer, inner| match read_envelope(outer) {
        Some(e) => raw_envelope(&e.magic, e.version, e.kind, inner),
        None => outer.to_vec(),
    },
};

/// An envelope around `body`, with `version`, `kind` and `magic` as given.
pub fn raw_envelope(magic: &[u8], version: u16, kind: MessageKind, body: &[u8]) -> Vec<u8> {
    rmp_serde::to_vec_named(&RawEnvelope { magic, version, kind, body }).unwrap_or_default()
}

/// Agent metadata's envelope as `kvx_core::wire::agent_metadata` writes it, for making and
/// reading envelopes that `seal` would not: any backend, version, name and body bytes.
#[derive(Clone, Serialize, Deserialize)]
struct RawAgentEnvelope {
    backend: String,
    version: u32,
    agent: String,
    body: serde_bytes::ByteBuf,
}

fn read_agent_envelope(bytes: &[u8]) -> Option<RawAgentEnvelope> {
    read_bounded(bytes)
}

fn write_agent_envelope(envelope: &RawAgentEnvelope) -> Vec<u8> {
    rmp_serde::to_vec_named(envelope).unwrap_or_default()
}

/// The body of an agent metadata envelope: a backend's own metadata.
pub const AGENT_METADATA_BODY: Nest = Nest {
    unwrap: |bytes| read_agent_envelope(bytes).map(|e| e.body.into_vec()),
    wrap: |outer, inner| match read_agent_envelope(outer) {
        Some(e) => write_agent_envelope(&RawAgentEnvelope { body: inner.to_vec().into(), ..e }),
        None => outer.to_vec(),
    },
};

/// Hostile variants of a backend's valid agent metadata, `valid` in its envelope: the whole's
/// [`msgpack_hostile`] variants; the envelope under another backend's name, of another version,
/// with an empty agent name or one with a NUL; the body's [`msgpack_hostile`] variants in the
/// envelope (`hostile-body-*`).
pub fn agent_metadata_hostile(valid: &[u8]) -> Vec<Seed> {
    let mut seeds = msgpack_hostile(valid);
    let Some(envelope) = read_agent_envelope(valid) else { return seeds };
    let variant = |name: &str, edit: &dyn Fn(&mut RawAgentEnvelope)| {
        let mut e = envelope.clone();
        edit(&mut e);
        Seed::new(name, write_agent_envelope(&e))
    };
    let other = if envelope.backend == "loopback" { "ucx" } else { "loopback" };
    seeds.push(variant("hostile-other-backend", &|e| e.backend = other.into()));
    seeds.push(variant("hostile-other-version", &|e| e.version += 1));
    seeds.push(variant("hostile-empty-agent-name", &|e| e.agent.clear()));
    seeds.push(variant("hostile-agent-name-with-nul", &|e| e.agent.push('\0')));
    for body in msgpack_hostile(&envelope.body) {
        let what = body.name.trim_start_matches("hostile-");
        seeds.push(variant(&format!("hostile-body-{what}"), &|e| e.body = body.bytes.clone().into()));
    }
    seeds
}

/// Seeds of one wire message type: each sample encoded, then hostile variants of the first.
pub fn wire_seeds<T: WireMessage>(samples: &[(&str, T)]) -> Vec<Seed> {
    let mut seeds = Vec::new();
    for (name, msg) in samples {
        match wire::encode(msg) {
            Ok(bytes) => seeds.push(Seed::new(*name, bytes)),
            Err(e) => panic!("encoding the sample {name}: {e}"),
        }
    }
    let Some((_, first)) = samples.first() else { return seeds };
    let body = rmp_serde::to_vec_named(first).unwrap_or_default();
    let valid = raw_envelope(b"KVX1", WIRE_VERSION, T::KIND, &body);
    let other_kind = match T::KIND {
        MessageKind::Handshake => MessageKind::ConnectorMetadata,
        _ => MessageKind::Handshake,
    };
    seeds.push(Seed::new("hostile-other-version", raw_envelope(b"KVX1", WIRE_VERSION + 1, T::KIND, &body)));
    seeds.push(Seed::new("hostile-other-kind", raw_envelope(b"KVX1", WIRE_VERSION, other_kind, &body)));
    seeds.push(Seed::new("hostile-bad-magic", raw_envelope(b"KVX0", WIRE_VERSION, T::KIND, &body)));
    seeds.push(Seed::new("hostile-empty-body", raw_envelope(b"KVX1", WIRE_VERSION, T::KIND, &[])));
    for variant in msgpack_hostile(&body) {
        let env = raw_envelope(b"KVX1", WIRE_VERSION, T::KIND, &variant.bytes);
        let what = variant.name.trim_start_matches("hostile-");
        seeds.push(Seed::new(format!("hostile-body-{what}"), env));
    }
    seeds.extend(msgpack_hostile(&valid));
    seeds.push(Seed::new("hostile-unknown-key-deeply-nested", with_unknown_key(&valid, &deep_array(2000))));
    seeds
}

/// MessagePack `[[[..[nil]..]]]`, `depth` arrays deep.
pub fn deep_array(depth: usize) -> Vec<u8> {
    let mut v = vec![0x91; depth];
    v.push(0xc0);
    v
}

/// `valid` (a MessagePack map) with one more key, `"x"`, whose value is `value`.
pub fn with_unknown_key(valid: &[u8], value: &[u8]) -> Vec<u8> {
    let mut out = valid.to_vec();
    match out.first().copied() {
        Some(m @ 0x80..=0x8e) => out[0] = m + 1,
        _ => return out,
    }
    out.extend_from_slice(&[0xa1, b'x']);
    out.extend_from_slice(value);
    out
}

/// Hostile variants of a valid MessagePack encoding: truncated, a trailing byte, the first
/// container's and the first bin's and string's lengths set to 2^32 - 1, and lone 2^32 - 1 headers.
pub fn msgpack_hostile(valid: &[u8]) -> Vec<Seed> {
    let mut seeds = vec![
        Seed::new("hostile-empty", Vec::new()),
        Seed::new("hostile-truncated-half", &valid[..valid.len() / 2]),
        Seed::new("hostile-truncated-last-byte", &valid[..valid.len().saturating_sub(1)]),
        Seed::new("hostile-trailing-byte", [valid, &[0]].concat()),
        Seed::new("hostile-array32-of-2pow32-minus-1", vec![0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0]),
        Seed::new("hostile-map32-of-2pow32-minus-1", vec![0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, b'a', 0xc0]),
        Seed::new("hostile-bin32-of-2pow32-minus-1", vec![0xc6, 0xff, 0xff, 0xff, 0xff, 1, 2, 3]),
        Seed::new("hostile-nested-arrays-2000-deep", deep_array(2000)),
    ];
    let mut widen = |name: &str, is_marker: fn(u8) -> bool, wide: fn(u8) -> u8, skip: fn(u8) -> usize| {
        // Every input gets every seed name, so that the committed corpus does not depend on the
        // bytes of a live agent's blob (which differ between runs): without a marker, the seed is
        // the valid input unchanged.
        let out = match valid.iter().position(|&b| is_marker(b)) {
            Some(at) => {
                let mut out = valid[..at].to_vec();
                out.push(wide(valid[at]));
                out.extend_from_slice(&[0xff, 0xff, 0xff, 0xff]);
                out.extend_from_slice(&valid[(at + 1 + skip(valid[at])).min(valid.len())..]);
                out
            }
            None => valid.to_vec(),
        };
        seeds.push(Seed::new(name, out));
    };
    widen(
        "hostile-first-container-2pow32-minus-1",
        |b| matches!(b, 0x80..=0x9f | 0xdc..=0xdf),
        |b| if matches!(b, 0x80..=0x8f | 0xde | 0xdf) { 0xdf } else { 0xdd },
        |b| match b {
            0xdc | 0xde => 2,
            0xdd | 0xdf => 4,
            _ => 0,
        },
    );
    widen(
        "hostile-first-bin-2pow32-minus-1",
        |b| matches!(b, 0xc4..=0xc6),
        |_| 0xc6,
        |b| match b {
            0xc4 => 1,
            0xc5 => 2,
            _ => 4,
        },
    );
    widen(
        "hostile-first-str-2pow32-minus-1",
        |b| matches!(b, 0xa0..=0xbf | 0xd9..=0xdb),
        |_| 0xdb,
        |b| match b {
            0xd9 => 1,
            0xda => 2,
            0xdb => 4,
            _ => 0,
        },
    );
    seeds
}

/// `kv_transfer_params` as vLLM and kvx write them, and as a careless or hostile client might.
pub fn transfer_params_json() -> Vec<Seed> {
    let deep = format!("{{\"remote_block_ids\":{}1{}}}", "[".repeat(200), "]".repeat(200));
    let deep_extra = format!("{{\"do_remote_decode\":true,\"x\":{}{}}}", "[".repeat(100), "]".repeat(100));
    let long_ids = format!(
        "{{\"do_remote_prefill\":true,\"remote_block_ids\":[[{}]],\"remote_engine_id\":\"prefill\",\
         \"remote_host\":\"h\",\"remote_port\":5600}}",
        (0..1000).map(|i| i.to_string()).collect::<Vec<_>>().join(",")
    );
    let cases: Vec<(&str, String)> = vec![
        (
            "vllm-0.32-decode-request",
            r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3]],"remote_engine_id":"prefill-0","remote_request_id":"cmpl-1-0","remote_host":"10.0.0.1","remote_port":5600,"tp_size":2}"#.into(),
        ),
        (
            "flat-block-ids",
            r#"{"do_remote_prefill":true,"remote_block_ids":[7,8,9],"remote_engine_id":"e","remote_host":"h","remote_port":5600}"#.into(),
        ),
        ("prefill-request", r#"{"do_remote_decode":true}"#.into()),
        (
            "proxy-request-with-nulls",
            r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#.into(),
        ),
        ("empty-object", "{}".into()),
        (
            "extra-keys-nested",
            r#"{"do_remote_prefill":true,"remote_block_ids":[[4,5]],"remote_engine_id":"p","remote_host":"h","remote_port":1,"tp_size":8,"remote_dp_size":1,"x":{"a":[1,{"b":null}],"c":"d"}}"#.into(),
        ),
        ("huge-block-ids", r#"{"remote_block_ids":[[4294967295,4294967296]]}"#.into()),
        ("hostile-port-out-of-range", r#"{"remote_port":65536}"#.into()),
        ("hostile-negative-block-id", r#"{"remote_block_ids":[-1]}"#.into()),
        ("huge-extra-numbers", r#"{"x":18446744073709551616,"y":-9223372036854775809,"z":1e308}"#.into()),
        ("hostile-number-out-of-range", r#"{"x":1e999}"#.into()),
        ("two-groups", r#"{"remote_block_ids":[[1],[2]]}"#.into()),
        (
            "hybrid-groups",
            r#"{"do_remote_prefill":true,"remote_block_ids":[[21,22],[1,2,3,4]],"kvx_group_first":[2,0],"remote_engine_id":"p","remote_host":"h","remote_port":1}"#.into(),
        ),
        ("hostile-group-first-count", r#"{"remote_block_ids":[[1],[2]],"kvx_group_first":[4]}"#.into()),
        ("hostile-group-past-end", r#"{"remote_block_ids":[[1,2]],"kvx_group_first":[4294967295]}"#.into()),
        ("empty-group", r#"{"remote_block_ids":[[]]}"#.into()),
        ("empty-list", r#"{"remote_block_ids":[]}"#.into()),
        ("hostile-nested-groups", r#"{"remote_block_ids":[[[[[1]]]]]}"#.into()),
        ("hostile-ids-as-string", r#"{"remote_block_ids":"1,2"}"#.into()),
        ("hostile-duplicate-key", r#"{"remote_port":1,"remote_port":2}"#.into()),
        ("duplicate-extra-key", r#"{"x":1,"x":[2]}"#.into()),
        (
            "unicode-host",
            r#"{"do_remote_prefill":true,"remote_block_ids":[1],"remote_engine_id":"\u00e9","remote_host":"\ud83d\ude00","remote_port":2}"#.into(),
        ),
        ("hostile-lone-surrogate", r#"{"remote_host":"\ud800"}"#.into()),
        ("empty-host", r#"{"do_remote_prefill":true,"remote_block_ids":[1],"remote_engine_id":"e","remote_host":"","remote_port":2}"#.into()),
        ("hostile-not-an-object-array", "[]".into()),
        ("hostile-not-an-object-null", "null".into()),
        ("hostile-not-an-object-number", "123".into()),
        ("hostile-trailing-garbage", "{}x".into()),
        ("hostile-truncated", r#"{"do_remote_prefill":true,"remote_block_ids":[[1,2"#.into()),
        ("hostile-deeply-nested-ids", deep),
        ("hostile-deeply-nested-extra", deep_extra),
        ("a-thousand-block-ids", long_ids),
        ("hostile-bool-as-string", r#"{"do_remote_prefill":"true"}"#.into()),
        (
            "kvx-offer-with-nonce-and-mac",
            format!(
                r#"{{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3]],"remote_engine_id":"prefill-0","remote_request_id":"cmpl-1-0","remote_host":"10.0.0.1","remote_port":5600,"kvx_hold_nonce":"{}","kvx_offer_mac":"{}"}}"#,
                "5a".repeat(16),
                "c3".repeat(32)
            ),
        ),
        ("hostile-nonce-not-hex", r#"{"kvx_hold_nonce":"not-a-nonce"}"#.into()),
        ("hostile-mac-too-short", r#"{"kvx_offer_mac":"00ff"}"#.into()),
        ("null-bools", r#"{"do_remote_prefill":null,"do_remote_decode":null}"#.into()),
    ];
    let mut seeds: Vec<Seed> = cases.into_iter().map(|(n, j)| Seed::new(n, j.into_bytes())).collect();
    // The same decode request, with scheduler choices after a NUL (see `transfer_params`).
    let base = r#"{"do_remote_prefill":true,"remote_block_ids":[[1,2,3]],"remote_engine_id":"prefill-0","remote_host":"h","remote_port":5600}"#;
    for (name, controls) in [
        ("controls-block-size-1", &[1u8][..]),
        ("controls-prompt-max", &[0, 3][..]),
        ("controls-computed-max", &[0, 0, 3][..]),
        ("controls-external-arbitrary", &[0, 0, 0, 3, 0xff, 0xff, 0xff, 0xff][..]),
        ("controls-aborted", &[0, 0, 0, 0, 0, 0, 1][..]),
    ] {
        seeds.push(Seed::new(name, [base.as_bytes(), &[0], controls].concat()));
    }
    seeds
}

/// Nonces as they travel (32 hex digits), and near misses.
pub fn nonces() -> Vec<Seed> {
    [
        ("valid", "00112233445566778899aabbccddeeff"),
        ("uppercase", "00112233445566778899AABBCCDDEEFF"),
        ("json-string", "\"00112233445566778899aabbccddeeff\""),
        ("hostile-31-digits", "00112233445566778899aabbccddeef"),
        ("hostile-33-digits", "00112233445566778899aabbccddeeff0"),
        ("hostile-non-hex", "g0112233445566778899aabbccddeeff"),
        ("hostile-multibyte", "\u{e9}0112233445566778899aabbccddeef"),
        ("empty", ""),
    ]
    .into_iter()
    .map(|(n, s)| Seed::new(n, s.as_bytes()))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::RankReport;

    #[test]
    fn hostile_variants_are_refused_and_the_samples_decode() {
        let seeds = wire_seeds(&[("r", RankReport::default())]);
        assert!(wire::decode::<RankReport>(&seeds[0].bytes).is_ok());
        // A widening with nothing to widen leaves the sample as it is (and decodes).
        let changed = |s: &&Seed| s.bytes != seeds[0].bytes;
        for s in
            seeds.iter().filter(changed).filter(|s| s.name.contains("2pow32") || s.name.contains("truncated"))
        {
            assert!(wire::decode::<RankReport>(&s.bytes).is_err(), "{} decodes", s.name);
        }
        let names: Vec<&str> = seeds.iter().map(|s| s.name.as_str()).collect();
        assert!(names.contains(&"hostile-first-container-2pow32-minus-1"), "{names:?}");
        assert!(names.contains(&"hostile-body-first-container-2pow32-minus-1"), "{names:?}");
    }

    #[test]
    fn envelope_bodies_unwrap_and_wrap_again() {
        let bytes = wire::encode(&RankReport { rank: 3, ..Default::default() }).unwrap();
        let body = (ENVELOPE_BODY.unwrap)(&bytes).unwrap();
        assert_eq!((ENVELOPE_BODY.wrap)(&bytes, &body), bytes);
        let other = rmp_serde::to_vec_named(&RankReport { rank: 4, ..Default::default() }).unwrap();
        let back: RankReport = wire::decode(&(ENVELOPE_BODY.wrap)(&bytes, &other)).unwrap();
        assert_eq!(back.rank, 4);
        assert_eq!((ENVELOPE_BODY.unwrap)(b"junk"), None);
    }

    #[test]
    fn agent_metadata_variants_are_refused_and_bodies_unwrap_and_wrap_again() {
        use kvx_core::wire::agent_metadata;
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Body {
            regions: Vec<u64>,
        }
        let valid = agent_metadata::seal("ucx", &"a".into(), &Body { regions: vec![1, 2] }).unwrap();
        let body = (AGENT_METADATA_BODY.unwrap)(&valid).unwrap();
        assert_eq!((AGENT_METADATA_BODY.wrap)(&valid, &body), valid);
        let other = rmp_serde::to_vec_named(&Body { regions: vec![3] }).unwrap();
        let opened =
            agent_metadata::open::<Body>("ucx", &(AGENT_METADATA_BODY.wrap)(&valid, &other)).unwrap();
        assert_eq!(opened.body, Body { regions: vec![3] });
        let seeds = agent_metadata_hostile(&valid);
        let names: Vec<&str> = seeds.iter().map(|s| s.name.as_str()).collect();
        for name in ["hostile-other-backend", "hostile-other-version", "hostile-body-trailing-byte"] {
            assert!(names.contains(&name), "{names:?}");
        }
        for seed in seeds.iter().filter(|s| s.bytes != valid) {
            assert!(agent_metadata::open::<Body>("ucx", &seed.bytes).is_err(), "{} opens", seed.name);
        }
    }

    #[test]
    fn names_are_file_name_safe() {
        assert_eq!(Seed::new("A b/c..d", vec![]).name, "a_b_c..d");
    }
}
