//! The whole kvx conformance suite for TcpAgent, one `#[test]` per check: two agents in one
//! process over 127.0.0.1, with the default four connections per peer, with one connection and
//! chunks of 4 KiB (every transfer cut into many chunks on one connection), with the deployment's
//! key, and through `dyn TransferAgent`.
#![allow(clippy::unwrap_used)] // Test setup: a failed unwrap is a failed test.

use std::sync::Arc;

use kvx_core::AuthKey;
use kvx_tcp::{TcpAgent, TcpConfig};
use kvx_testkit::conformance::{Dyn, Pair};

fn pair(test: &str, config: &TcpConfig) -> Pair<TcpAgent> {
    let test = test.rsplit("::").next().unwrap_or(test);
    Pair::new(
        Arc::new(TcpAgent::with_config(format!("decode-{test}"), config).unwrap()),
        Arc::new(TcpAgent::with_config(format!("prefill-{test}"), config).unwrap()),
    )
}

mod default_config {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| Some(pair(test, &TcpConfig::default())));
}

mod one_connection_small_chunks {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| {
        let mut config = TcpConfig::default().with_connections(1);
        config.chunk_bytes = 4096;
        Some(pair(test, &config))
    });
}

mod with_key {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| {
        let key = AuthKey::new(b"kvx-tcp conformance key").unwrap();
        Some(pair(test, &TcpConfig::default().with_auth_key(Some(key))))
    });
}

mod dyn_agents {
    use super::*;
    kvx_testkit::conformance_tests!(|test: &str| Some(Dyn(pair(test, &TcpConfig::default()))));
}
