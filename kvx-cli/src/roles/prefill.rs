//! `kvx prefill`: the prefill engine behind the request API.

use async_trait::async_trait;
use clap::Args;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use kvx_core::{Error, ErrorKind, RequestId, Result, TransferParams};
use kvx_net::{Caller, NetConfig, Server, Service};
use kvx_testkit::sim::SimEngine;

use crate::backend::Backend;
use crate::summary::Summary;
use crate::workload::ModelArgs;
use kvx_tcp::TcpConfig;

use super::metrics::{MetricsArgs, RoleMetrics};
use super::{ApiReply, ApiRequest, AuthArgs, advertised_host, api_error, engine_config, runtime};
use crate::discovery::DiscoveryArgs;

/// Options of `kvx prefill`.
#[derive(Debug, Args)]
pub(crate) struct PrefillArgs {
    /// Transfer backend (one that crosses processes).
    #[arg(long, value_enum, default_value_t = Backend::Ucx)]
    backend: Backend,
    /// Host of the side channel and the request API (`0.0.0.0`: every interface, which needs
    /// `--advertise-host`).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The address decode engines reach this host at, put into the `kv_transfer_params` (default:
    /// `--host`). Decode engines on other hosts need an address of this host they can route to,
    /// not a loopback one.
    #[arg(long)]
    advertise_host: Option<String>,
    /// Port of the request API (0: any free port, printed on start).
    #[arg(long, default_value_t = 5600)]
    api_port: u16,
    /// The address of the decode process (repeat for more): only a connection from it may end
    /// this process with the request API's `Done` (with a key, only an authenticated one). Prompts
    /// are taken from anyone who may connect.
    #[arg(long = "api-client", default_values_t = [IpAddr::from([127, 0, 0, 1]), IpAddr::from(Ipv6Addr::LOCALHOST)])]
    api_clients: Vec<IpAddr>,
    /// Port of rank 0's side channel; rank r serves on this port + r (0: free ports, printed on
    /// start). Give the ports a process had to restart it in its place.
    #[arg(long, default_value_t = 0)]
    side_channel_port: u16,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    auth: AuthArgs,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    discovery: DiscoveryArgs,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Seconds a hold of blocks for a decode engine lasts unless renewed (the deployment's lease:
    /// give `kvx decode` the same).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    lease: u64,
}

type Pending = (ApiRequest, tokio::sync::oneshot::Sender<ApiReply>);

/// The request API: hands each request to the engine loop and answers with what it replies.
/// `Done` ends the process, so it is taken only from the configured clients' addresses (and, with
/// a key, from an authenticated connection; every connection is one then); any other is refused
/// and counted.
struct Api {
    engine: mpsc::Sender<Pending>,
    clients: Vec<IpAddr>,
    refused_control: Arc<AtomicU64>,
}

impl Api {
    fn may_control(&self, caller: &Caller) -> bool {
        let ip = caller.peer.ip().to_canonical();
        self.clients.iter().any(|c| c.to_canonical() == ip)
    }
}

#[async_trait]
impl Service for Api {
    async fn call(&self, caller: &Caller, request: Vec<u8>) -> Result<Vec<u8>> {
        let request = serde_json::from_slice::<ApiRequest>(&request)
            .map_err(|e| Error::new(ErrorKind::Wire, format!("malformed API request: {e}")))?;
        if matches!(request, ApiRequest::Done) && !self.may_control(caller) {
            self.refused_control.fetch_add(1, Ordering::Relaxed);
            return Err(Error::new(
                ErrorKind::Unauthenticated,
                format!(
                    "Done is taken only from the decode process (--api-client), not from {}",
                    caller.peer.ip()
                ),
            ));
        }
        let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
        self.engine
            .send((request, reply_tx))
            .map_err(|_| Error::new(ErrorKind::State, "the prefill engine stopped"))?;
        let reply = reply_rx.await.unwrap_or_else(|_| ApiReply::Error("the prefill engine stopped".into()));
        serde_json::to_vec(&reply).map_err(|e| api_error("encoding a reply", e))
    }
}

/// Runs the prefill engine until the decode process is done with it.
pub(crate) fn prefill(args: &PrefillArgs) -> Result<Summary> {
    let (advertised, warning) =
        advertised_host(&args.host, args.advertise_host.as_deref(), "decode engines")?;
    if let Some(warning) = warning {
        eprintln!("kvx prefill: warning: {warning}");
    }
    let key = args.auth.key()?;
    let tcp =
        TcpConfig::default().with_host(&args.host, Some(advertised.to_owned())).with_auth_key(key.clone());
    let backend = args.backend.sim_backend(true, &tcp)?;
    let bind = (args.host.as_str(), Some(advertised));
    let side_channel = args.discovery.discovery.side_channel(bind, args.side_channel_port, key.clone());
    let config = engine_config("prefill", side_channel, &args.model, key.clone(), args.lease);
    let mut engine = SimEngine::new(config, &backend)?;
    let rt = runtime()?;
    let (tx, rx) = mpsc::channel::<Pending>();
    let api = NetConfig::with_key(key);
    let refused_control = Arc::new(AtomicU64::new(0));
    let service =
        Api { engine: tx, clients: args.api_clients.clone(), refused_control: Arc::clone(&refused_control) };
    let server = rt.block_on(Server::bind("request API", &args.host, args.api_port, &api, service))?;
    let handshakes = args.discovery.discovery.describe(engine.side_channel_port(), args.model.tp, advertised);
    let instance = format!("{:016x}", rand::random::<u64>());
    // The line a launcher waits for (the request API's endpoint comes last).
    println!(
        "kvx prefill: {} backend, {}; instance {instance}; {handshakes}; request API on tcp://{}",
        args.backend.name(),
        args.model.describe(),
        server.local_addr()
    );
    let mut metrics = RoleMetrics::start(&args.metrics, "prefill", &args.host, &engine)?;

    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.timeout);
    let mut waiting: HashMap<RequestId, tokio::sync::oneshot::Sender<ApiReply>> = HashMap::new();
    let mut done: Option<tokio::sync::oneshot::Sender<ApiReply>> = None;
    let mut served: usize = 0;
    loop {
        if Instant::now() > deadline {
            return Err(Error::new(ErrorKind::Timeout, "the decode process did not finish in time"));
        }
        // With nothing to do, wait for the next API request; otherwise only look.
        let next = if engine.is_idle() && waiting.is_empty() && done.is_none() {
            rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).ok()
        } else {
            rx.try_recv().ok()
        };
        match next {
            Some((ApiRequest::Prefill { id, prompt }, reply)) => {
                let id = RequestId::new(id);
                let params = TransferParams { do_remote_decode: true, ..Default::default() };
                match engine.add_request(id.clone(), &prompt, 1, Some(params)) {
                    Ok(()) => {
                        waiting.insert(id, reply);
                        served += 1;
                    }
                    Err(e) => {
                        let _ = reply.send(ApiReply::Error(e.to_string()));
                    }
                }
            }
            Some((ApiRequest::Done, reply)) => done = Some(reply),
            None => {}
        }
        engine.step()?;
        metrics.observe(&engine);
        for (id, params) in engine.take_transfer_params() {
            if let Some(reply) = waiting.remove(&id) {
                let _ = reply.send(ApiReply::Params { params: Box::new(params), instance: instance.clone() });
            }
        }
        if done.is_some() && waiting.is_empty() && engine.is_idle() {
            let summary = Summary::of_engine(&engine, served, start.elapsed());
            if let Some(reply) = done.take() {
                let (leaked, errors) = (summary.leaked(), summary.errors().to_vec());
                let _ = reply.send(ApiReply::Finished { leaked, errors, instance: instance.clone() });
                // Let the server write that reply (and close idle connections) before the
                // runtime goes with this function; bounded.
                let wait = deadline.saturating_duration_since(Instant::now()).min(Duration::from_secs(10));
                if let Err(e) = rt.block_on(server.shutdown(wait)) {
                    eprintln!("kvx prefill: {e}");
                }
            }
            println!("kvx prefill: served {served} requests");
            let refused = refused_control.load(Ordering::Relaxed);
            if refused > 0 {
                println!("kvx prefill: refused {refused} Done from addresses other than --api-client");
            }
            metrics.finish("prefill", &engine);
            return Ok(summary);
        }
        std::thread::yield_now();
    }
}
