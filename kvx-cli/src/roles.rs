//! `kvx prefill` and `kvx decode`: the two engines as two processes.
//!
//! The engines find each other as in a real deployment: the decode workers fetch the prefill
//! workers' handshake payloads over the ZeroMQ side channel (the port in the params), then READ the
//! blocks with the chosen backend. In place of a router, the prefill process serves a tiny request
//! API on a ZeroMQ ROUTER socket (REQ/REP style): the decode process sends each prompt, the prefill engine runs it
//! with `do_remote_decode` and answers with the request's `kv_transfer_params` (vLLM's JSON), which
//! the decode process submits with the prompt. Last, the decode process says it is done; the
//! prefill process answers once every hold is released, with its errors and leaked blocks.

use clap::Args;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;
use zeromq::{ReqSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use kvx_core::{Error, ErrorKind, RequestId, Result, TransferParams};
use kvx_testkit::sim::{EngineConfig, SideChannel, SimEngine};

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

fn engine_config(id: &str, host: &str, model: &ModelArgs) -> EngineConfig {
    EngineConfig {
        engine_id: id.into(),
        tp: model.tp,
        num_blocks: model.blocks,
        model: model.model(),
        side_channel: SideChannel::Zmq { host: host.to_owned() },
        handshake_timeout: Duration::from_secs(10),
        hold_timeout: Duration::from_secs(60),
        auth_key: None,
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
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
}

type Pending = (ApiRequest, tokio::sync::oneshot::Sender<ApiReply>);

/// Runs the prefill engine until the decode process is done with it.
pub(crate) fn prefill(args: &PrefillArgs) -> Result<Summary> {
    let backend = args.backend.sim_backend(true)?;
    let mut engine = SimEngine::new(engine_config("prefill", &args.host, &args.model), &backend)?;
    let rt = runtime()?;
    let (tx, rx) = mpsc::channel::<Pending>();
    let mut socket = RouterSocket::new();
    let ep = format!("tcp://{}:{}", args.host, args.api_port);
    let bound = rt.block_on(socket.bind(&ep)).map_err(|e| api_error(&format!("binding {ep}"), e))?;
    // The line a launcher waits for.
    println!(
        "kvx prefill: {} backend, {}; request API on {bound}",
        args.backend.name(),
        args.model.describe()
    );
    let server = rt.spawn(serve(socket, tx));

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
                // The server stops once that reply is sent; wait for it (bounded) before the
                // runtime goes with this function.
                let wait = deadline.saturating_duration_since(Instant::now());
                let _ = rt.block_on(async { tokio::time::timeout(wait, server).await });
            }
            println!("kvx prefill: served {served} requests");
            return Ok(summary);
        }
        std::thread::yield_now();
    }
}

/// Answers API requests one at a time, handing each to the engine loop, until it has sent the
/// final `Finished` reply. A ROUTER socket (as
/// kvx-core's side channel uses) answers REQ clients: the reply goes back with the request's
/// routing frames.
async fn serve(mut socket: RouterSocket, tx: mpsc::Sender<Pending>) {
    loop {
        let Ok(msg) = socket.recv().await else { continue };
        let mut frames = msg.into_vec();
        let Some(body) = frames.pop() else { continue };
        let reply = match serde_json::from_slice::<ApiRequest>(&body) {
            Ok(request) => {
                let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
                if tx.send((request, reply_tx)).is_err() {
                    return;
                }
                reply_rx.await.unwrap_or_else(|_| ApiReply::Error("the prefill engine stopped".into()))
            }
            Err(e) => ApiReply::Error(format!("malformed request: {e}")),
        };
        let last = matches!(reply, ApiReply::Finished { .. });
        frames.push(serde_json::to_vec(&reply).unwrap_or_default().into());
        if let Ok(reply) = ZmqMessage::try_from(frames) {
            // A client that went away is not the server's failure.
            let _ = socket.send(reply).await;
        }
        if last {
            return;
        }
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
    /// The prefill process's request API.
    #[arg(long, default_value = "tcp://127.0.0.1:5600")]
    prefill: String,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
}

/// Runs the workload through the prefill process and this decode engine.
pub(crate) fn decode(args: &DecodeArgs) -> Result<Summary> {
    let backend = args.backend.sim_backend(true)?;
    let mut engine = SimEngine::new(engine_config("decode", &args.host, &args.model), &backend)?;
    println!(
        "kvx decode: {} backend, {}; prefill at {}",
        args.backend.name(),
        args.model.describe(),
        args.prefill
    );
    let rt = runtime()?;
    let limit = Duration::from_secs(args.workload.timeout);
    let deadline = Instant::now() + limit;
    // One REQ socket per exchange, as kvx-core's side channel does: a fresh connection each time
    // keeps a lost reply from wedging the REQ state machine.
    let ask = |request: &ApiRequest| -> Result<ApiReply> {
        let body = serde_json::to_vec(request).map_err(|e| api_error("encoding", e))?;
        let wait = deadline.saturating_duration_since(Instant::now());
        let reply = rt
            .block_on(async {
                let exchange = async {
                    let mut socket = ReqSocket::new();
                    socket.connect(&args.prefill).await?;
                    socket.send(ZmqMessage::from(body)).await?;
                    socket.recv().await
                };
                tokio::time::timeout(wait, exchange).await
            })
            .map_err(|_| api_error("waiting for the prefill process", "timed out"))?
            .map_err(|e| api_error(&format!("exchanging with {}", args.prefill), e))?;
        let body = reply.into_vec().pop().unwrap_or_default();
        serde_json::from_slice(&body).map_err(|e| api_error("decoding the reply", e))
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
