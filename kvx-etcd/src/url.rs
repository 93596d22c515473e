//! [`EtcdUrl`]: the `etcd://host:port[,host:port]` form that selects etcd discovery.

use std::fmt;
use std::str::FromStr;

use kvx_core::error::quote;
use kvx_core::{Error, Result};
use kvx_net::{endpoint, parse_endpoint};

/// The scheme of an etcd discovery URL.
pub const SCHEME: &str = "etcd://";

/// The etcd cluster of a deployment: one or more client endpoints, from
/// `etcd://host:port[,host:port]` (an IPv6 host in brackets: `etcd://[::1]:2379`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdUrl {
    endpoints: Vec<(String, u16)>,
}

impl EtcdUrl {
    /// Parses `etcd://host:port[,host:port]`: every endpoint has a host and a port; no path, user
    /// or empty endpoint. A wrong form is an `InvalidArgument` error that quotes the URL.
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |why: String| Error::invalid_argument(format!("discovery URL {}: {why}", quote(url)));
        let rest = url.strip_prefix(SCHEME).ok_or_else(|| bad(format!("expected {SCHEME}host:port")))?;
        if rest.contains(['/', '@', '?', '#']) {
            return Err(bad("expected only host:port endpoints after the scheme".into()));
        }
        let endpoints = rest
            .split(',')
            .map(|endpoint| {
                if endpoint.starts_with("tcp://") {
                    return Err(bad(format!("endpoint {} has a scheme of its own", quote(endpoint))));
                }
                parse_endpoint(endpoint).map_err(|e| bad(e.message().to_owned()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(EtcdUrl { endpoints })
    }

    /// The endpoints as etcd's client takes them (`http://host:port`).
    pub fn client_endpoints(&self) -> Vec<String> {
        self.endpoints.iter().map(|(host, port)| format!("http://{}", endpoint(host, *port))).collect()
    }
}

impl FromStr for EtcdUrl {
    type Err = Error;

    fn from_str(url: &str) -> Result<Self> {
        Self::parse(url)
    }
}

impl fmt::Display for EtcdUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let endpoints: Vec<String> = self.endpoints.iter().map(|(h, p)| endpoint(h, *p)).collect();
        write!(f, "{SCHEME}{}", endpoints.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::ErrorKind;

    #[test]
    fn one_or_more_endpoints_parse_and_print_back() {
        for url in ["etcd://127.0.0.1:2379", "etcd://a:1,b:2", "etcd://[::1]:2379,10.0.0.1:2379"] {
            assert_eq!(EtcdUrl::parse(url).unwrap().to_string(), url);
        }
        let u: EtcdUrl = "etcd://[::1]:2379,h:7".parse().unwrap();
        assert_eq!(u.client_endpoints(), ["http://[::1]:2379", "http://h:7"]);
    }

    #[test]
    fn every_malformed_url_is_a_typed_error_naming_it() {
        for bad in [
            "",
            "127.0.0.1:2379",
            "tcp://h:1",
            "etcd://",
            "etcd://h",
            "etcd://h:",
            "etcd://:2379",
            "etcd://h:99999",
            "etcd://h:1,",
            "etcd://h:1,,h:2",
            "etcd://h:1/kvx",
            "etcd://user@h:1",
            "etcd://tcp://h:1",
            "ETCD://h:1",
        ] {
            let e = EtcdUrl::parse(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad}: {e}");
            assert!(e.to_string().contains(&quote(bad)), "{bad}: {e}");
        }
    }
}
