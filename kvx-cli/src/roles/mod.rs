//! `kvx prefill` and `kvx decode`: the two engines as two processes.
//!
//! The engines find each other as in a real deployment: the decode workers fetch the prefill
//! workers' handshake payloads over the TCP side channel (the port in the params), or with
//! `--discovery etcd://HOST:PORT` from etcd by engine id (the params carry no host or port), then
//! READ the blocks with the chosen backend. In place of a router, the prefill process serves a tiny request
//! API on kvx's bounded request/response server (`kvx_net::Server`, the one the side
//! channels run on, with the same limits): the decode process sends each prompt, the prefill
//! engine runs it with `do_remote_decode` and answers with the request's `kv_transfer_params`
//! (vLLM's JSON), which the decode process submits with the prompt. Last, the decode process says
//! it is done; the prefill process answers once every hold is released, with its errors and leaked
//! blocks. With `--auth-key` (or `KVX_AUTH_KEY`), the side channels and the API authenticate every
//! connection with the key.
//!
//! A prefill process may die and be started again on the same ports (`--api-port`,
//! `--side-channel-port`). The decode process then retries the request API with a bounded back-off
//! (resubmitting the prompt whose round trip was lost), notices a restart by the new process's
//! instance id in its replies, and counts the requests that were in flight when the prefill
//! process was lost: with `--on-load-failure fail` or `recompute` their failed loads are expected
//! (counted failed, or computed again by the decode engine), any other failure still fails the run.

mod decode;
mod metrics;
mod prefill;

use clap::Args;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::Runtime;

use kvx_core::{AuthKey, Error, ErrorKind, HostScope, Result, SystemClock, TransferParams};
use kvx_net::Handshakes;
use kvx_testkit::sim::{EngineConfig, LoadFailurePolicy, SideChannel};

use crate::workload::ModelArgs;

/// What the decode process asks the prefill process.
#[derive(Debug, Serialize, Deserialize)]
enum ApiRequest {
    /// Run this prompt with `do_remote_decode` and answer with its params.
    Prefill { id: String, prompt: Vec<u32> },
    /// No more prompts: answer once every hold is released.
    Done,
}

/// What the prefill process answers. `instance` is random per prefill process: a new one after a
/// restart tells the decode process that the holds of the old one are gone.
#[derive(Debug, Serialize, Deserialize)]
enum ApiReply {
    Params { params: Box<TransferParams>, instance: String },
    Finished { leaked: usize, errors: Vec<String>, instance: String },
    Error(String),
}

fn api_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Io, format!("request API: {what}: {e}"))
}

/// The host an engine bound to `host` gives its `peers` (in its params, its side channel's and its
/// agent's metadata): `advertise` or else `host`, with a warning when peers on other hosts cannot
/// use it. An unspecified address (`0.0.0.0`, `::`) is refused: a peer would connect to its own
/// machine.
fn advertised_host<'a>(
    host: &'a str,
    advertise: Option<&'a str>,
    peers: &str,
) -> Result<(&'a str, Option<String>)> {
    let advertised = advertise.unwrap_or(host);
    let warning = match (HostScope::of(host), HostScope::of(advertised)) {
        (_, HostScope::Unspecified) if advertise.is_none() => {
            return Err(Error::invalid_argument(format!(
                "--host {host} binds every interface, which is no address to hand to {peers}: \
                 give the one they reach this host at with --advertise-host"
            )));
        }
        (_, HostScope::Unspecified) => {
            return Err(Error::invalid_argument(format!(
                "--advertise-host {advertised} is no address {peers} can connect to"
            )));
        }
        (HostScope::Other | HostScope::Unspecified, HostScope::Loopback) => Some(format!(
            "advertising loopback address {advertised} while binding {host}: {peers} on other hosts \
             will connect to their own machine, not to this one (set --advertise-host)"
        )),
        (HostScope::Loopback, HostScope::Other) => Some(format!(
            "advertising {advertised} while binding loopback address {host}: {peers} cannot reach \
             the side channels there (set --host)"
        )),
        _ => None,
    };
    Ok((advertised, warning))
}

fn runtime() -> Result<Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?)
}

/// The deployment's shared key, from `--auth-key` or `KVX_AUTH_KEY`.
#[derive(Debug, Clone, Args)]
pub(crate) struct AuthArgs {
    /// Shared key of the deployment (at least 16 bytes): the side channels and the request API
    /// authenticate every connection with it and refuse peers without it. Prefer the
    /// environment variable: a command line is visible to other users.
    #[arg(long, env = "KVX_AUTH_KEY", hide_env_values = true)]
    auth_key: Option<String>,
}

impl AuthArgs {
    pub(crate) fn key(&self) -> Result<Option<AuthKey>> {
        self.auth_key.as_deref().map(AuthKey::new).transpose()
    }
}

/// An engine on `side_channel`, with holds leased for `lease_secs`.
fn engine_config(
    id: &str,
    side_channel: SideChannel,
    model: &ModelArgs,
    auth_key: Option<AuthKey>,
    lease_secs: u64,
) -> EngineConfig {
    EngineConfig {
        engine_id: id.into(),
        tp: model.tp,
        num_blocks: model.blocks,
        model: model.model(),
        side_channel,
        auth_key,
        handshake_timeout: Duration::from_secs(10),
        lease_duration: Duration::from_secs(lease_secs),
        clock: Arc::new(SystemClock),
        handshakes: Handshakes::Background,
        seed: None,
        load_failure: LoadFailurePolicy::Fail,
        side_channel_port: None,
    }
}

pub(crate) use decode::{DecodeArgs, decode};
pub(crate) use prefill::{PrefillArgs, prefill};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unspecified_host_needs_an_address_to_advertise_and_loopback_ones_are_warned_about() {
        assert_eq!(advertised_host("10.0.0.1", None, "peers").unwrap(), ("10.0.0.1", None));
        assert_eq!(advertised_host("127.0.0.1", None, "peers").unwrap(), ("127.0.0.1", None));
        assert_eq!(advertised_host("0.0.0.0", Some("10.0.0.1"), "peers").unwrap(), ("10.0.0.1", None));
        for (host, advertise) in
            [("0.0.0.0", None), ("::", None), ("0.0.0.0", Some("::")), ("10.0.0.1", Some("0.0.0.0"))]
        {
            let e = advertised_host(host, advertise, "peers").unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{host} {advertise:?}");
        }
        assert!(
            advertised_host("0.0.0.0", None, "peers").unwrap_err().message().contains("--advertise-host")
        );
        for (host, advertise) in
            [("10.0.0.1", Some("127.0.0.1")), ("0.0.0.0", Some("localhost")), ("127.0.0.1", Some("10.0.0.1"))]
        {
            let (advertised, warning) = advertised_host(host, advertise, "peers").unwrap();
            assert_eq!(Some(advertised), advertise);
            assert!(warning.is_some_and(|w| w.contains(host)), "{host} {advertise:?}");
        }
    }
}
