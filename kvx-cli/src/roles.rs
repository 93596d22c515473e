//! `kvx prefill` and `kvx decode`: the two engines as two processes.
//!
//! The engines find each other as in a real deployment: the decode workers fetch the prefill
//! workers' handshake payloads over the TCP side channel (the port in the params), then READ the
//! blocks with the chosen backend. In place of a router, the prefill process serves a tiny request
//! API on kvx's bounded request/response server (`kvx_core::net::Server`, the one the side
//! channels run on, with the same limits): the decode process sends each prompt, the prefill
//! engine runs it with `do_remote_decode` and answers with the request's `kv_transfer_params`
//! (vLLM's JSON), which the decode process submits with the prompt. Last, the decode process says
//! it is done; the prefill process answers once every hold is released, with its errors and leaked
//! blocks. With `--auth-key` (or `KVX_AUTH_KEY`), the side channels and the API authenticate every
//! connection with the key.

use async_trait::async_trait;
use clap::Args;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

use kvx_core::net::{Connection, NetConfig, Server, Service, parse_endpoint};
use kvx_core::{AuthKey, Error, ErrorKind, Handshakes, RequestId, Result, SystemClock, TransferParams};
use kvx_testkit::sim::{EngineConfig, LoadFailurePolicy, SideChannel, SimEngine};

use crate::backend::Backend;
use crate::summary::Summary;
use crate::workload::{ModelArgs, WorkloadArgs};

/// What the decode process asks the prefill process.
#[derive(Debug, Serialize, Deserialize)]
enum ApiRequest {
    /// Run this prompt with `do_remote_decode` and answer with its params.
    Prefill { id: String, prompt: Vec<u32> },
    /// No more prompts: answer once every hold is released.
    Done,
}

/// What the prefill process answers.
#[derive(Debug, Serialize, Deserialize)]
enum ApiReply {
    Params(TransferParams),
    Finished { leaked: usize, errors: Vec<String> },
    Error(String),
}

fn api_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Io, format!("request API: {what}: {e}"))
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

fn engine_config(id: &str, host: &str, model: &ModelArgs, auth_key: Option<AuthKey>) -> EngineConfig {
    EngineConfig {
        engine_id: id.into(),
        tp: model.tp,
        num_blocks: model.blocks,
        model: model.model(),
        side_channel: SideChannel::Tcp { host: host.to_owned() },
        auth_key,
        handshake_timeout: Duration::from_secs(10),
        lease_duration: Duration::from_secs(60),
        clock: Arc::new(SystemClock),
        handshakes: Handshakes::Background,
        nonce_seed: None,
        load_failure: LoadFailurePolicy::Fail,
        side_channel_port: None,
    }
}

/// Options of `kvx prefill`.
#[derive(Debug, Args)]
pub(crate) struct PrefillArgs {
    /// Transfer backend (one that crosses processes).
    #[arg(long, value_enum, default_value_t = Backend::Ucx)]
    backend: Backend,
    /// Host of the side channel and the request API.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port of the request API (0: any free port, printed on start).
    #[arg(long, default_value_t = 5600)]
    api_port: u16,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    auth: AuthArgs,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
}

type Pending = (ApiRequest, tokio::sync::oneshot::Sender<ApiReply>);

/// The request API: hands each request to the engine loop and answers with what it replies.
struct Api {
    engine: mpsc::Sender<Pending>,
}

#[async_trait]
impl Service for Api {
    async fn call(&self, request: Vec<u8>) -> Result<Vec<u8>> {
        let request = serde_json::from_slice::<ApiRequest>(&request)
            .map_err(|e| Error::new(ErrorKind::Wire, format!("malformed API request: {e}")))?;
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
    let backend = args.backend.sim_backend(true)?;
    let key = args.auth.key()?;
    let config = engine_config("prefill", &args.host, &args.model, key.clone());
    let mut engine = SimEngine::new(config, &backend)?;
    let rt = runtime()?;
    let (tx, rx) = mpsc::channel::<Pending>();
    let api = NetConfig::with_key(key);
    let server =
        rt.block_on(Server::bind("request API", &args.host, args.api_port, &api, Api { engine: tx }))?;
    let base = engine.side_channel_port();
    let last = u32::from(base) + args.model.tp.saturating_sub(1);
    // The line a launcher waits for (the request API's endpoint comes last).
    println!(
        "kvx prefill: {} backend, {}; side channels on ports {base}-{last}; request API on tcp://{}",
        args.backend.name(),
        args.model.describe(),
        server.local_addr()
    );

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
        for (id, params) in engine.take_transfer_params() {
            if let Some(reply) = waiting.remove(&id) {
                let _ = reply.send(ApiReply::Params(params));
            }
        }
        if done.is_some() && waiting.is_empty() && engine.is_idle() {
            let summary = Summary::of_engine(&engine, served, start.elapsed());
            if let Some(reply) = done.take() {
                let (leaked, errors) = (summary.leaked(), summary.errors().to_vec());
                let _ = reply.send(ApiReply::Finished { leaked, errors });
                // Let the server write that reply (and close idle connections) before the
                // runtime goes with this function; bounded.
                let wait = deadline.saturating_duration_since(Instant::now()).min(Duration::from_secs(10));
                if let Err(e) = rt.block_on(server.shutdown(wait)) {
                    eprintln!("kvx prefill: {e}");
                }
            }
            println!("kvx prefill: served {served} requests");
            return Ok(summary);
        }
        std::thread::yield_now();
    }
}

/// Options of `kvx decode`.
#[derive(Debug, Args)]
pub(crate) struct DecodeArgs {
    /// Transfer backend (one that crosses processes).
    #[arg(long, value_enum, default_value_t = Backend::Ucx)]
    backend: Backend,
    /// Host of this engine's side channel.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The prefill process's request API (`tcp://host:port` or `host:port`).
    #[arg(long, default_value = "tcp://127.0.0.1:5600")]
    prefill: String,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    auth: AuthArgs,
}

/// Runs the workload through the prefill process and this decode engine.
pub(crate) fn decode(args: &DecodeArgs) -> Result<Summary> {
    let backend = args.backend.sim_backend(true)?;
    let key = args.auth.key()?;
    let (api_host, api_port) = parse_endpoint(&args.prefill)?;
    let mut engine = SimEngine::new(engine_config("decode", &args.host, &args.model, key.clone()), &backend)?;
    println!(
        "kvx decode: {} backend, {}; prefill at {}",
        args.backend.name(),
        args.model.describe(),
        args.prefill
    );
    let rt = runtime()?;
    let api = NetConfig::with_key(key);
    let limit = Duration::from_secs(args.workload.timeout);
    let deadline = Instant::now() + limit;
    // One connection per request: a lost reply cannot wedge the next one.
    let ask = |request: &ApiRequest| -> Result<ApiReply> {
        let body = serde_json::to_vec(request).map_err(|e| api_error("encoding", e))?;
        let wait = deadline.saturating_duration_since(Instant::now());
        let reply = rt
            .block_on(async {
                let exchange = async {
                    let mut conn = Connection::connect(&api_host, api_port, &api).await?;
                    conn.request(body).await
                };
                tokio::time::timeout(wait, exchange).await
            })
            .map_err(|_| Error::new(ErrorKind::Timeout, "request API: the prefill process did not answer"))?
            .map_err(|e| e.context("request API"))?;
        serde_json::from_slice(&reply)
            .map_err(|e| Error::invalid_peer_data(format!("request API: decoding the reply: {e}")))
    };
    let start = Instant::now();
    for (id, prompt) in args.workload.prompts() {
        let params = match ask(&ApiRequest::Prefill { id: id.to_string(), prompt: prompt.clone() })? {
            ApiReply::Params(params) => params,
            other => return Err(api_error("unexpected reply", format!("{other:?}"))),
        };
        engine.add_request(id, &prompt, args.workload.max_new_tokens, Some(params))?;
        engine.step()?;
    }
    while !engine.is_idle() {
        if Instant::now() > deadline {
            return Err(Error::new(ErrorKind::Timeout, format!("decode engine not idle after {limit:?}")));
        }
        engine.step()?;
        std::thread::yield_now();
    }
    let mut summary = Summary::of_engine(&engine, args.workload.requests, start.elapsed());
    match ask(&ApiRequest::Done)? {
        ApiReply::Finished { leaked, errors } => summary.add_remote("prefill", leaked, errors),
        other => return Err(api_error("unexpected reply", format!("{other:?}"))),
    }
    Ok(summary)
}
