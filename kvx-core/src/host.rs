//! What a host names: this machine only (loopback), every interface (unspecified), or something
//! else. A prefill engine that advertises a loopback or unspecified address to decode engines on
//! other hosts sends them to their own machine: the classic misconfiguration of a disaggregated
//! deployment, which the engines detect with [`HostScope::of`].

use std::net::IpAddr;

/// The scope of a host as written in a configuration or in `kv_transfer_params`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostScope {
    /// This machine only: `127.0.0.0/8`, `::1` (also IPv4-mapped, `::ffff:127.0.0.1`),
    /// `localhost` and names under it (RFC 6761).
    Loopback,
    /// No particular address: `0.0.0.0` or `::`. Bound, it means every interface; connected to, it
    /// reaches this machine.
    Unspecified,
    /// Anything else: another address, or a name (names other than `localhost` are not resolved).
    Other,
}

impl HostScope {
    /// The scope of `host`: an IPv4 or IPv6 address (IPv6 with or without brackets) or a name,
    /// without a port. Case does not matter, nor a trailing dot of a name.
    pub fn of(host: &str) -> Self {
        let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        match bare.parse::<IpAddr>() {
            Ok(ip) => {
                let ip = ip.to_canonical();
                if ip.is_loopback() {
                    HostScope::Loopback
                } else if ip.is_unspecified() {
                    HostScope::Unspecified
                } else {
                    HostScope::Other
                }
            }
            Err(_) => {
                let name = bare.strip_suffix('.').unwrap_or(bare).to_ascii_lowercase();
                if name == "localhost" || name.ends_with(".localhost") {
                    HostScope::Loopback
                } else {
                    HostScope::Other
                }
            }
        }
    }

    /// Whether a connection to such a host stays on this machine (loopback or unspecified).
    pub fn is_local(self) -> bool {
        self != HostScope::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_classified_for_ipv4_ipv6_and_localhost() {
        let cases = [
            ("127.0.0.1", HostScope::Loopback),
            ("127.255.3.4", HostScope::Loopback),
            ("::1", HostScope::Loopback),
            ("[::1]", HostScope::Loopback),
            ("::ffff:127.0.0.1", HostScope::Loopback),
            ("localhost", HostScope::Loopback),
            ("LocalHost.", HostScope::Loopback),
            ("engine.localhost", HostScope::Loopback),
            ("0.0.0.0", HostScope::Unspecified),
            ("::", HostScope::Unspecified),
            ("[::]", HostScope::Unspecified),
            ("::ffff:0.0.0.0", HostScope::Unspecified),
            ("10.0.0.2", HostScope::Other),
            ("128.0.0.1", HostScope::Other),
            ("fe80::1", HostScope::Other),
            ("::ffff:10.1.2.3", HostScope::Other),
            ("prefill-0.cluster.local", HostScope::Other),
            ("notlocalhost", HostScope::Other),
            ("localhost.example.com", HostScope::Other),
            ("127.0.0.1:5600", HostScope::Other),
            ("", HostScope::Other),
        ];
        for (host, scope) in cases {
            assert_eq!(HostScope::of(host), scope, "{host:?}");
        }
        assert!(HostScope::Loopback.is_local() && HostScope::Unspecified.is_local());
        assert!(!HostScope::Other.is_local());
    }
}
