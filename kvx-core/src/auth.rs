//! The trust primitives: the shared key of an authenticated deployment, and per-hold nonces.
//!
//! - [`AuthKey`] is an optional secret every engine of a deployment is configured with. With it,
//!   side-channel handshakes are challenge-response authenticated in both directions, and the
//!   prefill engine MACs (HMAC-SHA256) the `kv_transfer_params` it hands out, so a decode engine
//!   READs only blocks that a prefill engine of the deployment really offered.
//! - [`Nonce`] is 128 bits per held request: the hold's place in the order its engine made them
//!   (64 bits, see [`nonce_place`]) and 64 unpredictable bits. It travels in the params and comes
//!   back in the notification; a notification frees a hold only when its nonce matches, with or
//!   without a key, so a forged or replayed request id frees nothing.
//!
//! kvx writes no cryptography of its own: HMAC and SHA-256 are RustCrypto's `hmac` and `sha2`,
//! randomness is the OS's (`getrandom`), and tags are compared in constant time by `hmac`.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::Sha256;
use std::fmt;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a MAC tag (HMAC-SHA256).
pub const TAG_LEN: usize = 32;

/// A MAC tag.
pub type Tag = [u8; TAG_LEN];

/// What a tag authenticates: each use has its own label, so a tag made for one purpose never
/// verifies for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A side-channel client proves it holds the key (over both challenges).
    HandshakeRequest,
    /// A side-channel server proves it holds the key and binds the payload it serves.
    HandshakeReply,
    /// The prefill engine's offer in `kv_transfer_params`.
    TransferParams,
    /// A handshake payload published in a registry (kvx-etcd), bound to the key it is stored
    /// under.
    RegistryEntry,
    /// A decode worker's registration of its blocks for a push.
    PushRegistration,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::HandshakeRequest => b"kvx/handshake-request/1",
            Purpose::HandshakeReply => b"kvx/handshake-reply/1",
            Purpose::TransferParams => b"kvx/transfer-params/1",
            Purpose::RegistryEntry => b"kvx/registry-entry/1",
            Purpose::PushRegistration => b"kvx/push-registration/1",
        }
    }
}

/// The shared secret of an authenticated deployment. Its bytes never appear in `Debug` output.
#[derive(Clone)]
pub struct AuthKey {
    key: Arc<[u8]>,
}

impl fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthKey(<redacted>)")
    }
}

impl PartialEq for AuthKey {
    fn eq(&self, other: &Self) -> bool {
        // Constant time: compare the keys' tags over a fixed message.
        self.tag(Purpose::HandshakeRequest, &[b"eq"]) == other.tag(Purpose::HandshakeRequest, &[b"eq"])
    }
}

impl Eq for AuthKey {}

impl AuthKey {
    /// The shortest key accepted, in bytes.
    pub const MIN_LEN: usize = 16;

    /// A key from its bytes (a passphrase's UTF-8 bytes will do): at least [`Self::MIN_LEN`].
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Self> {
        let bytes = bytes.as_ref();
        if bytes.len() < Self::MIN_LEN {
            return Err(Error::invalid_argument(format!(
                "an auth key needs at least {} bytes, got {}",
                Self::MIN_LEN,
                bytes.len()
            )));
        }
        Ok(AuthKey { key: Arc::from(bytes) })
    }

    fn mac(&self, purpose: Purpose, parts: &[&[u8]]) -> HmacSha256 {
        // HMAC takes a key of any length: this cannot fail.
        let mut mac = <HmacSha256 as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
        mac.update(purpose.label());
        // Each part is length-prefixed, so no two different part lists hash alike.
        for part in parts {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }

    /// The tag of `parts` for `purpose`.
    pub fn tag(&self, purpose: Purpose, parts: &[&[u8]]) -> Tag {
        self.mac(purpose, parts).finalize().into_bytes().into()
    }

    /// Checks `tag` against `parts` for `purpose`, in constant time.
    pub fn verify(&self, purpose: Purpose, parts: &[&[u8]], tag: &[u8]) -> Result<()> {
        self.mac(purpose, parts)
            .verify_slice(tag)
            .map_err(|_| Error::new(ErrorKind::Unauthenticated, format!("{purpose:?} MAC does not verify")))
    }
}

/// Fills `buf` from the operating system's random source.
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut buf = [0u8; N];
    getrandom::fill(&mut buf)
        .map_err(|e| Error::new(ErrorKind::Io, format!("the OS random source failed: {e}")))?;
    Ok(buf)
}

/// Fixed-size bytes, written as `2 * N` lowercase hex digits in JSON and on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HexBytes<const N: usize>(pub [u8; N]);

/// A hold's nonce: 128 bits.
pub type Nonce = HexBytes<16>;

/// A digest of a request's prompt, as the engine computes it (kvx does not look inside: equal
/// digests mean the same prompt to the engines that computed them).
pub type PromptDigest = HexBytes<32>;

/// A MAC tag as it travels in `kv_transfer_params`.
pub type MacTag = HexBytes<TAG_LEN>;

impl<const N: usize> HexBytes<N> {
    /// Its bytes.
    pub fn as_bytes(&self) -> &[u8; N] {
        &self.0
    }

    /// Parses exactly `2 * N` hex digits.
    pub fn parse(s: &str) -> Result<Self> {
        let bad =
            || Error::invalid_peer_data(format!("{}: not {} hex digits", crate::error::quote(s), 2 * N));
        let digits = s.as_bytes();
        if digits.len() != 2 * N {
            return Err(bad());
        }
        let mut out = [0u8; N];
        for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
            let hi = char::from(pair[0]).to_digit(16).ok_or_else(bad)?;
            let lo = char::from(pair[1]).to_digit(16).ok_or_else(bad)?;
            *byte = (hi << 4 | lo) as u8;
        }
        Ok(HexBytes(out))
    }
}

impl<const N: usize> fmt::Display for HexBytes<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl<const N: usize> fmt::Debug for HexBytes<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HexBytes({self})")
    }
}

impl<const N: usize> Serialize for HexBytes<N> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de, const N: usize> Deserialize<'de> for HexBytes<N> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        HexBytes::parse(&s).map_err(|e| serde::de::Error::custom(e.message()))
    }
}

/// Where per-hold nonces come from: unpredictable (seeded from the OS) in an engine, or
/// reproducible from a seed in simulations. A nonce is a counter (its first 8 bytes, little-endian:
/// [`nonce_place`]) and the first 8 bytes of HMAC-SHA256 of that counter under a 32-byte seed, so
/// knowing some nonces tells nothing of the others' secret half.
#[derive(Clone)]
pub struct NonceSource {
    seed: AuthKey,
    counter: u64,
}

impl fmt::Debug for NonceSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NonceSource").field("counter", &self.counter).finish_non_exhaustive()
    }
}

impl NonceSource {
    /// Seeded from the operating system's random source.
    pub fn from_entropy() -> Result<Self> {
        Ok(Self::from_seed(random_bytes::<32>()?))
    }

    /// Reproducible: the same seed gives the same nonces (for simulations and tests).
    pub fn from_seed(seed: [u8; 32]) -> Self {
        NonceSource { seed: AuthKey { key: Arc::from(&seed[..]) }, counter: 0 }
    }

    /// The next nonce.
    pub fn next_nonce(&mut self) -> Nonce {
        self.counter += 1;
        let place = self.counter.to_le_bytes();
        let tag = self.seed.tag(Purpose::TransferParams, &[b"nonce", &place]);
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&place);
        bytes[8..].copy_from_slice(&tag[..8]);
        HexBytes(bytes)
    }
}

/// The place of `nonce` in the order its [`NonceSource`] made nonces: 1 for the first. A prefill
/// engine's scheduler hands its holds to the workers in that order, so a worker that has been
/// handed the hold at place `p` has been handed every earlier one (see the worker's holds).
pub(crate) fn nonce_place(nonce: &Nonce) -> u64 {
    let mut place = [0u8; 8];
    place.copy_from_slice(&nonce.as_bytes()[..8]);
    u64::from_le_bytes(place)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_verify_only_for_the_same_key_purpose_and_parts() {
        let k = AuthKey::new("0123456789abcdef").unwrap();
        let other = AuthKey::new("0123456789abcdeF").unwrap();
        let t = k.tag(Purpose::TransferParams, &[b"a", b"bc"]);
        k.verify(Purpose::TransferParams, &[b"a", b"bc"], &t).unwrap();
        for (key, purpose, parts) in [
            (&other, Purpose::TransferParams, &[&b"a"[..], b"bc"][..]),
            (&k, Purpose::HandshakeReply, &[b"a", b"bc"]),
            (&k, Purpose::TransferParams, &[b"ab", b"c"]),
            (&k, Purpose::TransferParams, &[b"abc"]),
        ] {
            let e = key.verify(purpose, parts, &t).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Unauthenticated);
        }
        assert!(k.verify(Purpose::TransferParams, &[b"a", b"bc"], &t[..31]).is_err(), "truncated tag");
        assert_ne!(k, other);
        assert_eq!(k, k.clone());
        assert_eq!(format!("{k:?}"), "AuthKey(<redacted>)");
    }

    #[test]
    fn short_keys_are_refused() {
        assert_eq!(AuthKey::new("short").unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn nonces_round_trip_as_hex_and_refuse_anything_else() {
        let mut src = NonceSource::from_seed([7; 32]);
        let (a, b) = (src.next_nonce(), src.next_nonce());
        assert_ne!(a, b);
        assert_eq!(NonceSource::from_seed([7; 32]).next_nonce(), a, "reproducible from its seed");
        assert_ne!(NonceSource::from_entropy().unwrap().next_nonce(), a);
        let hex = a.to_string();
        assert_eq!(hex.len(), 32);
        assert_eq!(Nonce::parse(&hex).unwrap(), a);
        assert_eq!(serde_json::from_str::<Nonce>(&serde_json::to_string(&a).unwrap()).unwrap(), a);
        for bad in ["", "00", &"g".repeat(32), &"0".repeat(33), "é0000000000000000000000000000000"] {
            assert_eq!(Nonce::parse(bad).unwrap_err().kind(), ErrorKind::InvalidPeerData, "{bad:?}");
        }
    }

    #[test]
    fn a_nonce_names_its_place_and_its_secret_half_depends_on_the_seed() {
        let mut src = NonceSource::from_seed([7; 32]);
        let (a, b) = (src.next_nonce(), src.next_nonce());
        assert_eq!((nonce_place(&a), nonce_place(&b)), (1, 2));
        let other = NonceSource::from_seed([8; 32]).next_nonce();
        assert_eq!(nonce_place(&other), 1);
        assert_ne!(other.as_bytes()[8..], a.as_bytes()[8..], "the same place under another seed");
        assert_ne!(a.as_bytes()[8..], b.as_bytes()[8..]);
    }
}
