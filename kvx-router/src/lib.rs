//! kvx-router, the `kvx router` command: an OpenAI-compatible HTTP proxy in front of several vLLM prefill servers and
//! decode servers (xPyD), what vLLM's disaggregated-serving toy proxy does, with health checks,
//! failover and bounds.
//!
//! For each `POST /v1/completions` or `/v1/chat/completions` the router
//! 1. picks a prefill server: the healthy one with the fewest requests outstanding through this
//!    router (ties go round-robin);
//! 2. sends it the client's JSON body with `kv_transfer_params` set to
//!    `{"do_remote_decode": true, "do_remote_prefill": false, ...}`, `"stream": false`,
//!    `max_tokens` 1 (and `max_completion_tokens` 1 on the chat route), without `stream_options`
//!    and `min_tokens`, and reads the `kv_transfer_params` of its JSON answer;
//! 3. sends the client's own body with those `kv_transfer_params` to a decode server picked the
//!    same way (a prefill answer without them, as vLLM gives when the request ended before its
//!    length cap, sends the body without them: the decode server then computes the prompt
//!    itself), and relays the decode server's answer to the client as it arrives, with its
//!    status code and content type: server-sent events when the client asked `"stream": true`,
//!    JSON otherwise.
//!
//! Both requests carry the same `X-Request-Id` (the client's when it sent a valid one) and the
//! client's `Authorization` header.
//!
//! With `--mode push` the prefill request's `kv_transfer_params` also say `"transfer_mode":
//! "push"`: the prefill server WRITEs the prompt's KV into blocks the decode server registered.
//! The router keeps, per prefill server, what its last answer's params said of where it is
//! (`remote_engine_id`, `remote_host`, `remote_port`, `tp_size`); once it knows, it sends both
//! legs of a request together, the decode leg with
//! `{"do_remote_prefill": true, "transfer_mode": "push", ...}` and those four, so the transfer
//! starts the moment the prefill ends. Until a prefill server has answered once (and after it
//! failed), its requests go in the order above (the decode server then registers on arrival).
//! kvx's vLLM connector pairs the two legs by the shared `X-Request-Id`. A prefill leg that
//! fails while its decode leg waits aborts the decode leg, and the request is retried in order
//! on another prefill server.
//!
//! The router checks every server's health (`GET /health`, bounded by `--health-timeout`) before it
//! serves, then every `--health-interval`. A server that fails a request (connection refused or
//! reset, a timeout, an HTTP 5xx answer) is taken out of rotation at once, one that fails
//! `--unhealthy-after` health checks in a row (3: a loaded vLLM server misses one now and then)
//! too, and one that has not passed a check yet at its first failed one; it returns once a health
//! check passes again. One that answered 5xx is checked at once, before the request moves on: vLLM
//! answers 500 for a single request's failure too (a KV load that failed under
//! `kv_load_failure_policy` `fail`), which must not take a healthy server out.
//!
//! A request whose prefill server failed is retried on another prefill server; one whose decode
//! server failed before the first byte of the answer went to the client is retried on another
//! decode server with the same `kv_transfer_params`. Each stage tries at most `1 + --retries`
//! servers, none twice; then the client gets a JSON error: 502 when servers were tried and failed,
//! 503 when none was healthy. Client errors (HTTP 4xx) from a server go back to the client
//! unchanged and are not retried. Every upstream exchange is bounded by `--connect-timeout` and
//! `--request-timeout` (the whole exchange, the streamed answer included), request bodies by
//! `--max-body-bytes` (413 beyond), prefill and `/v1/models` answers by the same size.
//!
//! Its own clients are bounded as well ([`server`]): connection slots are shared out by kvx-core's
//! admission policy (a newcomer evicts the oldest half-sent or the idlest connection rather than
//! being refused), new connections must send their first request's headers within
//! `--header-timeout`, kept-alive ones their next within `--idle-timeout`, bodies must arrive
//! within `--body-timeout`, connections close after `--max-connection-lifetime`, and all bodies
//! being buffered share `--max-buffered-body-bytes` (503 beyond).
//!
//! `GET /v1/models` is answered by a healthy server (decode first); `GET /health` answers 200 while
//! at least one prefill and one decode server are healthy, 503 otherwise; `GET /metrics` serves
//! the router's Prometheus metrics (also on `--metrics-port` when given): requests by route and
//! outcome, retries, upstream failures by reason, prefill answers without `kv_transfer_params`,
//! outstanding requests and health per upstream, request durations. A line on stderr says when a
//! server leaves or returns to rotation.
//!
//! What it does not do: TLS (plain HTTP only), authentication of its own clients (their
//! `Authorization` goes to the servers, which check it), prefix- or KV-cache-aware routing, retries
//! once a byte of the answer went to the client (a decode server failing mid-stream ends the
//! client's response early), and queueing: with no healthy server of a role a request fails at
//! once. A retried decode reads the KV that the prefill server still holds for the request; should
//! it be gone already (released after the failed decode server's READ), the new decode server's
//! load fails and its `kv_load_failure_policy` decides: compute the prompt again, or fail.

mod metrics;
mod proxy;
mod server;
#[cfg(test)]
mod tests;
mod upstream;

use clap::Args;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

use kvx_core::{Error, ErrorKind, Result};

pub(crate) use proxy::Shared;
pub(crate) use server::Limits;

/// `kvx router`'s options.
#[derive(Debug, Args)]
pub struct RouterArgs {
    /// Address the OpenAI-compatible API listens on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port of the API (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// A vLLM prefill server (`kv_role` producer or both), as http://HOST:PORT; repeat for several.
    #[arg(long = "prefill", required = true, value_name = "URL")]
    prefill: Vec<String>,
    /// A vLLM decode server (`kv_role` consumer or both), as http://HOST:PORT; repeat for several.
    #[arg(long = "decode", required = true, value_name = "URL")]
    decode: Vec<String>,
    /// Serve `/metrics` on this port too, on the same host (it is always on the API port).
    #[arg(long)]
    metrics_port: Option<u16>,
    /// Bound in seconds on one exchange with a server, its whole streamed answer included.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    request_timeout: u64,
    /// Bound in seconds on opening a connection to a server.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    connect_timeout: u64,
    /// Seconds between health checks of every server.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    health_interval: u64,
    /// Bound in seconds on one health check (a loaded vLLM server can take seconds to answer).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    health_timeout: u64,
    /// Consecutive failed health checks that take a server in rotation out of it (a failed
    /// request takes it out at once).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    unhealthy_after: u32,
    /// Further servers a request may try per stage (prefill, decode) after its first one failed.
    #[arg(long, default_value_t = 2)]
    retries: usize,
    /// How the KV moves: `pull` (the decode server READs it after the prefill answered) or `push`
    /// (the prefill server WRITEs it into blocks the decode server registered; once a prefill
    /// server's answer named it, its requests' two legs go out together).
    #[arg(long, value_enum, default_value_t = Mode::Pull)]
    mode: Mode,
    /// Largest request body, and largest prefill or `/v1/models` answer, in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    max_body_bytes: usize,
    /// Bytes of request bodies buffered at once, all clients together, beyond each body's first
    /// 64 KiB: a body that finds them spent gets a 503 at once.
    #[arg(long, default_value_t = 256 << 20)]
    max_buffered_body_bytes: usize,
    /// Seconds a request's body may take to arrive after its headers (408 and closed beyond).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    body_timeout: u64,
    /// Seconds a new connection may take to send its first request's headers.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    header_timeout: u64,
    /// Seconds a kept-alive connection may wait after an answer for its next request's headers.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout: u64,
    /// Seconds after which a connection is closed, once its answer in progress is done.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    max_connection_lifetime: u64,
    /// Client connections held at once (first request's headers complete); a newcomer evicts the
    /// idlest one when they are all taken.
    #[arg(long, default_value_t = 1024, value_parser = at_least_one())]
    max_connections: usize,
    /// Client connections held at once from one source (IPv4 address, IPv6 /64).
    #[arg(long, default_value_t = 512, value_parser = at_least_one())]
    max_connections_per_source: usize,
    /// Client connections not done sending their first request's headers; a newcomer evicts the
    /// oldest one when they are all taken.
    #[arg(long, default_value_t = 128, value_parser = at_least_one())]
    max_pending_connections: usize,
    /// Connections held open but unserved at once, after they made way for others (so that a
    /// flood does not reconnect as fast as the router accepts); the oldest is closed beyond.
    #[arg(long, default_value_t = 16_384)]
    max_parked_connections: usize,
}

/// A count of at least 1.
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

/// How the KV of a request moves between its servers (kvx's `transfer_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
    /// The decode server READs the blocks the prefill server's answer offers.
    Pull,
    /// The prefill server WRITEs into the blocks the decode server registered.
    Push,
}

/// The router's settings, apart from where it listens.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) mode: Mode,
    pub(crate) prefill: Vec<String>,
    pub(crate) decode: Vec<String>,
    pub(crate) request_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) health_interval: Duration,
    pub(crate) health_timeout: Duration,
    pub(crate) unhealthy_after: u32,
    pub(crate) retries: usize,
    pub(crate) max_body_bytes: usize,
    /// The client connections' limits.
    pub(crate) limits: Limits,
}

impl RouterArgs {
    fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.request_timeout)
    }

    fn config(&self) -> Config {
        Config {
            mode: self.mode,
            prefill: self.prefill.clone(),
            decode: self.decode.clone(),
            request_timeout: self.request_timeout(),
            connect_timeout: Duration::from_secs(self.connect_timeout),
            health_interval: Duration::from_secs(self.health_interval),
            health_timeout: Duration::from_secs(self.health_timeout),
            unhealthy_after: self.unhealthy_after,
            retries: self.retries,
            max_body_bytes: self.max_body_bytes,
            limits: Limits {
                max_connections: self.max_connections,
                max_per_source: self.max_connections_per_source,
                max_pending: self.max_pending_connections,
                header_timeout: Duration::from_secs(self.header_timeout),
                idle_timeout: Duration::from_secs(self.idle_timeout),
                body_timeout: Duration::from_secs(self.body_timeout),
                max_lifetime: Duration::from_secs(self.max_connection_lifetime),
                max_buffered_bytes: self.max_buffered_body_bytes,
                max_parked: self.max_parked_connections,
            },
        }
    }
}

fn io_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Io, format!("router: {what}: {e}"))
}

async fn bind(host: &str, port: u16) -> Result<TcpListener> {
    kvx_net::listen(host, port).await.map_err(|e| io_error(&format!("cannot listen on {host}:{port}"), e))
}

fn local_addr(listener: &TcpListener) -> Result<SocketAddr> {
    listener.local_addr().map_err(|e| io_error("listener address", e))
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| io_error("SIGTERM handler", e))?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.map_err(|e| io_error("SIGINT handler", e)),
        _ = term.recv() => Ok(()),
    }
}

/// Runs `kvx router` until SIGINT or SIGTERM.
pub fn run(args: &RouterArgs) -> Result<()> {
    let shared = Shared::new(args.config())?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let api = bind(&args.host, args.port).await?;
        let metrics = match args.metrics_port {
            Some(port) => Some(bind(&args.host, port).await?),
            None => None,
        };
        shared.check_health().await;
        println!(
            "kvx router: serving on http://{} ({}/{} prefill and {}/{} decode servers healthy)",
            local_addr(&api)?,
            shared.prefill.healthy(),
            args.prefill.len(),
            shared.decode.healthy(),
            args.decode.len()
        );
        if let Some(listener) = &metrics {
            println!("kvx router: metrics on http://{}/metrics", local_addr(listener)?);
        }
        let (stop, stopped) = watch::channel(false);
        let health = tokio::spawn(shared.clone().health_loop());
        let metrics_server =
            metrics.map(|l| server::serve(l, shared.metrics_app(), shared.server(), stopped.clone()));
        let api_server = server::serve(api, shared.app(), shared.server(), stopped);
        let servers = async {
            match metrics_server {
                Some(metrics_server) => tokio::try_join!(api_server, metrics_server).map(|_| ()),
                None => api_server.await,
            }
        };
        let outcome = stopping(servers, &stop, args.request_timeout()).await;
        health.abort();
        outcome
    })
}

/// Drives `servers` and tells them to stop on SIGINT or SIGTERM; ends when they do, or `drain`
/// after the signal with requests still in flight (a client that stopped reading holds its
/// response).
async fn stopping(
    servers: impl Future<Output = Result<()>>,
    stop: &watch::Sender<bool>,
    drain: Duration,
) -> Result<()> {
    tokio::pin!(servers);
    tokio::select! {
        r = &mut servers => r,
        signal = shutdown_signal() => {
            signal?;
            eprintln!("kvx router: stopping; waiting up to {drain:?} for the requests in flight");
            stop.send_replace(true);
            tokio::time::timeout(drain, servers).await.unwrap_or(Ok(()))
        }
    }
}
