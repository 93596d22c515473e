//! `--discovery`: how the engines of `kvx prefill` and `kvx decode` find each other's handshake
//! payloads.

use clap::Args;

use kvx_core::{AuthKey, Error, Result};
#[cfg(feature = "etcd")]
use kvx_core::{EngineId, MetadataExchange};
use kvx_testkit::sim::SideChannel;

/// Where the workers publish and find handshake payloads.
#[derive(Debug, Clone)]
pub(crate) enum Discovery {
    /// Each rank's TCP side channel, at the host and port the params carry.
    Tcp,
    /// An etcd cluster (feature `etcd`): engines find each other by id, the params carry no host
    /// or port.
    #[cfg(feature = "etcd")]
    Etcd(kvx_etcd::EtcdUrl),
}

impl Discovery {
    /// `tcp`, or `etcd://HOST:PORT[,HOST:PORT]`.
    fn parse(value: &str) -> Result<Self> {
        if value == "tcp" {
            return Ok(Discovery::Tcp);
        }
        if !value.starts_with("etcd://") {
            return Err(Error::invalid_argument(format!(
                "--discovery {}: expected tcp or etcd://HOST:PORT[,HOST:PORT]",
                kvx_core::error::quote(value)
            )));
        }
        #[cfg(feature = "etcd")]
        return kvx_etcd::EtcdUrl::parse(value).map(Discovery::Etcd);
        #[cfg(not(feature = "etcd"))]
        Err(Error::new(
            kvx_core::ErrorKind::NotAvailable,
            "this kvx was built without the etcd feature: --discovery etcd:// needs it",
        ))
    }

    /// The side channel of an engine: TCP ones bound on `host` from `port` and advertised at
    /// `advertise_host` (`host` when `None`), or this etcd cluster's exchanges, whose entries
    /// `auth_key` seals (the TCP side channels take the engine's key).
    pub(crate) fn side_channel(
        &self,
        (host, advertise_host): (&str, Option<&str>),
        port: u16,
        #[cfg_attr(
            not(feature = "etcd"),
            expect(unused_variables, reason = "only etcd entries take the key")
        )]
        auth_key: Option<AuthKey>,
    ) -> SideChannel {
        match self {
            Discovery::Tcp => SideChannel::Tcp {
                host: host.to_owned(),
                port,
                advertise_host: advertise_host.map(str::to_owned),
            },
            #[cfg(feature = "etcd")]
            Discovery::Etcd(url) => SideChannel::ById(etcd_exchanges(url, auth_key)),
        }
    }

    /// Where the engine's handshakes go, for its first line: the side channels' ports and the
    /// host they are `advertised` at, or the etcd cluster.
    pub(crate) fn describe(&self, base_port: u16, ranks: u32, advertised: &str) -> String {
        match self {
            Discovery::Tcp => format!(
                "side channels on ports {base_port}-{}; advertised as {advertised}",
                u32::from(base_port) + ranks.saturating_sub(1)
            ),
            #[cfg(feature = "etcd")]
            Discovery::Etcd(url) => format!("handshakes through {url}"),
        }
    }
}

#[cfg(feature = "etcd")]
fn etcd_exchanges(url: &kvx_etcd::EtcdUrl, auth_key: Option<AuthKey>) -> kvx_testkit::sim::Exchanges {
    let config = kvx_etcd::EtcdConfig { auth_key, ..kvx_etcd::EtcdConfig::new(url.clone()) };
    kvx_testkit::sim::Exchanges::new(move |engine: &EngineId, rank, runtime| {
        let exchange = runtime.block_on(kvx_etcd::EtcdExchange::connect(config.clone(), engine, rank))?;
        Ok(std::sync::Arc::new(exchange) as std::sync::Arc<dyn MetadataExchange>)
    })
}

/// `--discovery`, shared by `kvx prefill` and `kvx decode`.
#[derive(Debug, Clone, Args)]
pub(crate) struct DiscoveryArgs {
    /// How the engines find each other's handshake payloads: `tcp` (each rank's TCP side
    /// channel, at the host and port in the params) or `etcd://HOST:PORT[,HOST:PORT]` (an etcd
    /// cluster: engines find each other by id, and the params carry no host or port; needs the
    /// `etcd` feature).
    #[arg(long, env = "KVX_DISCOVERY", default_value = "tcp", value_parser = Discovery::parse)]
    pub(crate) discovery: Discovery,
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::ErrorKind;

    #[test]
    fn discovery_is_tcp_or_an_etcd_url() {
        assert!(matches!(Discovery::parse("tcp"), Ok(Discovery::Tcp)));
        for bad in ["", "TCP", "zmq://h:1", "h:2379"] {
            assert_eq!(Discovery::parse(bad).unwrap_err().kind(), ErrorKind::InvalidArgument, "{bad}");
        }
        let etcd = Discovery::parse("etcd://127.0.0.1:2379,[::1]:2379");
        #[cfg(feature = "etcd")]
        assert_eq!(etcd.unwrap().describe(0, 2, "h"), "handshakes through etcd://127.0.0.1:2379,[::1]:2379");
        #[cfg(not(feature = "etcd"))]
        assert_eq!(etcd.unwrap_err().kind(), ErrorKind::NotAvailable);
        #[cfg(feature = "etcd")]
        assert_eq!(Discovery::parse("etcd://h").unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
}
