//! The router against stub vLLM servers: axum apps on 127.0.0.1:0 that answer as prefill servers
//! (with `kv_transfer_params`) and decode servers (that check they got them), held open, failing
//! or streaming as each test says. Waits are on events, each bounded by [`LIMIT`] as a failure
//! bound.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Mutex, Semaphore, mpsc};

use super::upstream::Role;
use super::{Config, Limits, Mode, Shared};

mod floods;
mod push;

const LIMIT: Duration = Duration::from_secs(30);

async fn within<F: Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f).await.unwrap_or_else(|_| panic!("{what} did not happen within {LIMIT:?}"))
}

/// A completion request as a stub received it.
#[derive(Debug)]
struct Arrival {
    request_id: Option<String>,
    body: Value,
}

type Chunk = std::io::Result<Bytes>;

/// A stub vLLM server; the test changes how it answers while it runs.
struct Stub {
    name: String,
    url: String,
    role: Role,
    /// Status of the completion answers.
    status: AtomicU16,
    /// Status of `GET /health`.
    health: AtomicU16,
    /// Whether a prefill answer carries `kv_transfer_params`.
    with_params: AtomicBool,
    /// Completion requests received.
    requests: AtomicUsize,
    /// A completion request takes a permit before it answers: none to hold requests open.
    gate: Semaphore,
    arrived: mpsc::UnboundedSender<Arrival>,
    arrivals: Mutex<mpsc::UnboundedReceiver<Arrival>>,
    /// The chunks of the next streamed decode answer, sent by the test (an error breaks the
    /// connection); fixed chunks when unset.
    chunks: Mutex<Option<mpsc::UnboundedReceiver<Chunk>>>,
}

impl Stub {
    async fn next_arrival(&self) -> Arrival {
        let mut arrivals = self.arrivals.lock().await;
        within(&format!("a request at {}", self.name), arrivals.recv()).await.unwrap()
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// The params this stub answers with as a prefill server.
    fn params(&self) -> Value {
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": self.name,
            "remote_block_ids": [1, 2, 3],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
        })
    }

    fn streamed(&self, chunks: Option<mpsc::UnboundedReceiver<Chunk>>) -> Response {
        let body = match chunks {
            Some(rx) => Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|chunk| (chunk, rx))
            })),
            None => Body::from(FIXED_CHUNKS.concat()),
        };
        ([(axum::http::header::CONTENT_TYPE, "text/event-stream")], body).into_response()
    }
}

const FIXED_CHUNKS: [&str; 3] = [
    "data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
    "data: {\"choices\":[{\"text\":\"b\"}]}\n\n",
    "data: [DONE]\n\n",
];

async fn stub_completion(State(stub): State<Arc<Stub>>, headers: HeaderMap, body: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap();
    stub.requests.fetch_add(1, Ordering::SeqCst);
    let request_id = headers.get("x-request-id").map(|v| v.to_str().unwrap().to_owned());
    let _ = stub.arrived.send(Arrival { request_id, body: body.clone() });
    stub.gate.acquire().await.unwrap().forget();
    let status = StatusCode::from_u16(stub.status.load(Ordering::SeqCst)).unwrap();
    if !status.is_success() {
        return (status, axum::Json(json!({"error": {"message": format!("{} refuses", stub.name)}})))
            .into_response();
    }
    match stub.role {
        Role::Prefill => {
            let params = if stub.with_params.load(Ordering::SeqCst) { stub.params() } else { Value::Null };
            axum::Json(json!({"choices": [{"text": "x"}], "kv_transfer_params": params})).into_response()
        }
        // No params: the decode server computes the prompt itself; params must be a prefill's.
        Role::Decode
            if body.get("kv_transfer_params").is_some_and(|p| p["do_remote_prefill"] != json!(true)) =>
        {
            (StatusCode::UNPROCESSABLE_ENTITY, "kv_transfer_params not from a prefill server").into_response()
        }
        Role::Decode if body["stream"] == json!(true) => {
            let chunks = stub.chunks.lock().await.take();
            stub.streamed(chunks)
        }
        Role::Decode => {
            axum::Json(json!({"choices": [{"text": format!("decoded by {}", stub.name)}]})).into_response()
        }
    }
}

async fn stub_health(State(stub): State<Arc<Stub>>) -> StatusCode {
    StatusCode::from_u16(stub.health.load(Ordering::SeqCst)).unwrap()
}

async fn stub_models(State(stub): State<Arc<Stub>>) -> Response {
    axum::Json(json!({"object": "list", "data": [{"id": "stub-model", "owned_by": stub.name}]}))
        .into_response()
}

/// Starts a stub on `listener`, answering at once (no gate).
async fn stub_on(name: &str, role: Role, listener: TcpListener) -> Arc<Stub> {
    let (arrived, arrivals) = mpsc::unbounded_channel();
    let stub = Arc::new(Stub {
        name: name.to_owned(),
        url: format!("http://{}", listener.local_addr().unwrap()),
        role,
        status: AtomicU16::new(200),
        health: AtomicU16::new(200),
        with_params: AtomicBool::new(true),
        requests: AtomicUsize::new(0),
        gate: Semaphore::new(Semaphore::MAX_PERMITS),
        arrived,
        arrivals: Mutex::new(arrivals),
        chunks: Mutex::new(None),
    });
    let app = axum::Router::new()
        .route("/v1/completions", post(stub_completion))
        .route("/v1/chat/completions", post(stub_completion))
        .route("/v1/models", get(stub_models))
        .route("/health", get(stub_health))
        .with_state(stub.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    stub
}

async fn stub(name: &str, role: Role) -> Arc<Stub> {
    stub_on(name, role, TcpListener::bind("127.0.0.1:0").await.unwrap()).await
}

/// A stub whose completion requests wait until the test lets them go with `gate.add_permits`.
async fn held_stub(name: &str, role: Role) -> Arc<Stub> {
    let stub = stub(name, role).await;
    stub.gate.forget_permits(Semaphore::MAX_PERMITS);
    stub
}

/// A port nothing listens on (connections are refused).
async fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().port()
}

/// The router in front of `prefill` and `decode`, on 127.0.0.1:0; its health loop does not run
/// (the tests check health when they mean to).
async fn router(prefill: &[&str], decode: &[&str]) -> (Arc<Shared>, String) {
    router_with(prefill, decode, Limits::default(), 1 << 20).await
}

/// [`router`] with `limits` and `max_body_bytes`.
async fn router_with(
    prefill: &[&str],
    decode: &[&str],
    limits: Limits,
    max_body_bytes: usize,
) -> (Arc<Shared>, String) {
    router_in(Mode::Pull, prefill, decode, limits, max_body_bytes).await
}

/// [`router_with`] in `mode`.
async fn router_in(
    mode: Mode,
    prefill: &[&str],
    decode: &[&str],
    limits: Limits,
    max_body_bytes: usize,
) -> (Arc<Shared>, String) {
    let config = Config {
        mode,
        prefill: prefill.iter().map(|s| s.to_string()).collect(),
        decode: decode.iter().map(|s| s.to_string()).collect(),
        request_timeout: LIMIT,
        connect_timeout: LIMIT,
        health_interval: LIMIT,
        health_timeout: LIMIT,
        unhealthy_after: 3,
        retries: 2,
        max_body_bytes,
        limits,
    };
    let shared = Shared::new(config).unwrap();
    let listener = super::bind("127.0.0.1", 0).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    serve(listener, &shared, shared.app());
    (shared, url)
}

/// Serves `app` on `listener` with the router's server until the test's runtime ends.
fn serve(listener: TcpListener, shared: &Shared, app: axum::Router) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let server = super::server::serve(listener, app, shared.server(), stopped);
    // The sender lives as long as the server: it is never told to stop.
    tokio::spawn(async move {
        let _stop = stop;
        server.await
    });
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

async fn complete(router: &str, body: Value) -> reqwest::Response {
    send(completion_request(router, &body)).await
}

async fn json_of(response: reqwest::Response) -> Value {
    let text = within("the router's body", response.text()).await.unwrap();
    serde_json::from_str(&text).unwrap()
}

async fn metrics(url: &str) -> String {
    let response = within("/metrics", client().get(format!("{url}/metrics")).send()).await.unwrap();
    assert_eq!(response.status(), 200);
    within("/metrics body", response.text()).await.unwrap()
}

/// The value of the metric line that starts with `series` (name and labels), 0 when absent.
fn metric(text: &str, series: &str) -> f64 {
    text.lines().find_map(|line| line.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

#[tokio::test]
async fn a_completion_goes_to_prefill_then_to_decode_with_the_prefill_params() {
    let (p, d) = (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await);
    let (_router, url) = router(&[&p.url], &[&d.url]).await;
    let request = json!({
        "model": "m", "prompt": "hello", "max_tokens": 7, "min_tokens": 3,
        "stream": false, "stream_options": {"include_usage": true},
    });
    let response = complete(&url, request.clone()).await;
    assert_eq!(response.status(), 200);
    let request_id = response.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(json_of(response).await["choices"][0]["text"], "decoded by d0");

    let prefilled = p.next_arrival().await;
    let mut expected = request.clone();
    let fields = expected.as_object_mut().unwrap();
    fields.remove("stream_options");
    fields.remove("min_tokens");
    fields.insert("max_tokens".into(), json!(1));
    fields.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    assert_eq!(prefilled.body, expected);

    let decoded = d.next_arrival().await;
    let mut expected = request;
    expected.as_object_mut().unwrap().insert("kv_transfer_params".into(), p.params());
    assert_eq!(decoded.body, expected);
    assert_eq!(prefilled.request_id.as_deref(), Some(request_id.as_str()));
    assert_eq!(decoded.request_id.as_deref(), Some(request_id.as_str()));
}

#[tokio::test]
async fn a_prefill_answer_without_params_sends_the_client_body_to_decode_as_it_is() {
    let (p, d) = (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await);
    p.with_params.store(false, Ordering::SeqCst);
    let (_router, url) = router(&[&p.url], &[&d.url]).await;
    let request = json!({"model": "m", "prompt": "hello", "max_tokens": 7});
    assert_eq!(complete(&url, request.clone()).await.status(), 200);
    assert_eq!(d.next_arrival().await.body, request);
    assert_eq!(metric(&metrics(&url).await, "kvx_router_prefill_without_params_total"), 1.0);
}

#[tokio::test]
async fn a_chat_completion_prefills_one_token_and_streams_the_decode_answer() {
    let (p, d) = (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await);
    let (_router, url) = router(&[&p.url], &[&d.url]).await;
    let request = json!({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 9, "stream": true, "stream_options": {"include_usage": true},
    });
    let send = post_json(&format!("{url}/v1/chat/completions"), &request).send();
    let response = within("the router's answer", send).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert_eq!(within("the stream", response.text()).await.unwrap(), FIXED_CHUNKS.concat());

    let prefilled = p.next_arrival().await.body;
    assert_eq!(prefilled["max_tokens"], 1);
    assert_eq!(prefilled["max_completion_tokens"], 1);
    assert_eq!(prefilled["stream"], false);
    assert_eq!(prefilled["kv_transfer_params"]["do_remote_decode"], true);
    assert!(prefilled.get("stream_options").is_none(), "{prefilled}");
    let decoded = d.next_arrival().await.body;
    assert_eq!(decoded["max_completion_tokens"], 9);
    assert_eq!(decoded["stream_options"], request["stream_options"]);
    assert_eq!(decoded["kv_transfer_params"], p.params());
}

/// Which of two stubs the next completion request arrives at.
async fn arrival_at(stubs: &[Arc<Stub>; 2]) -> usize {
    within("a request at either stub", async {
        tokio::select! {
            _ = stubs[0].next_arrival() => 0,
            _ = stubs[1].next_arrival() => 1,
        }
    })
    .await
}

#[tokio::test]
async fn requests_go_to_the_server_with_the_fewest_outstanding() {
    let prefill = [held_stub("p0", Role::Prefill).await, held_stub("p1", Role::Prefill).await];
    let decode = [held_stub("d0", Role::Decode).await, held_stub("d1", Role::Decode).await];
    let (_router, url) = router(&[&prefill[0].url, &prefill[1].url], &[&decode[0].url, &decode[1].url]).await;
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 4});
    let request = || tokio::spawn(send(completion_request(&url, &body)));

    // Request 1 is held at prefill server h, request 2 goes to the other one, x.
    let first = request();
    let h = arrival_at(&prefill).await;
    let second = request();
    let x = arrival_at(&prefill).await;
    assert_ne!(h, x);
    // Request 2 goes on to decode server a (and is held there): x is free again. Round-robin would
    // now pick h; the fewest outstanding is x.
    prefill[x].gate.add_permits(1);
    let a = arrival_at(&decode).await;
    let third = request();
    assert_eq!(arrival_at(&prefill).await, x);

    // Request 3 goes to the other decode server, b, and ends there: b is free again. Round-robin
    // would now pick a, which still holds request 2; the fewest outstanding is b.
    prefill[x].gate.add_permits(1);
    let b = arrival_at(&decode).await;
    assert_ne!(a, b);
    decode[b].gate.add_permits(1);
    let third = within("request 3", third).await.unwrap();
    assert_eq!(third.status(), 200);
    within("request 3's body", third.text()).await.unwrap();
    prefill[h].gate.add_permits(1);
    assert_eq!(arrival_at(&decode).await, b);

    decode[a].gate.add_permits(1);
    decode[b].gate.add_permits(1);
    for request in [first, second] {
        assert_eq!(within("a held request", request).await.unwrap().status(), 200);
    }
    assert_eq!((prefill[h].requests(), prefill[x].requests()), (1, 2));
    assert_eq!((decode[a].requests(), decode[b].requests()), (1, 2));
}

/// Sends `request` and waits for the head of its answer.
async fn send(request: reqwest::RequestBuilder) -> reqwest::Response {
    within("the router's answer", request.send()).await.unwrap()
}

fn post_json(url: &str, body: &Value) -> reqwest::RequestBuilder {
    client().post(url).header("content-type", "application/json").body(body.to_string())
}

fn completion_request(router: &str, body: &Value) -> reqwest::RequestBuilder {
    post_json(&format!("{router}/v1/completions"), body)
}

#[tokio::test]
async fn failed_servers_leave_rotation_and_return_after_a_passed_health_check() {
    let dead_port = closed_port().await;
    let dead = format!("http://127.0.0.1:{dead_port}");
    let p = stub("p1", Role::Prefill).await;
    let (failing, d) = (stub("d0", Role::Decode).await, stub("d1", Role::Decode).await);
    failing.status.store(500, Ordering::SeqCst);
    failing.health.store(503, Ordering::SeqCst);
    let (router, url) = router(&[&dead, &p.url], &[&failing.url, &d.url]).await;
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 4});

    // Ties go to the first server: the dead prefill and the failing decode, each retried.
    let response = complete(&url, body.clone()).await;
    assert_eq!(response.status(), 200);
    assert_eq!(json_of(response).await["choices"][0]["text"], "decoded by d1");
    assert_eq!(failing.requests(), 1);
    assert!(!router.prefill.is_healthy(0) && router.prefill.is_healthy(1));
    assert!(!router.decode.is_healthy(0) && router.decode.is_healthy(1));

    // Out of rotation: the next request goes straight to the others.
    assert_eq!(complete(&url, body.clone()).await.status(), 200);
    assert_eq!((failing.requests(), p.requests(), d.requests()), (1, 2, 2));

    let text = metrics(&url).await;
    assert_eq!(metric(&text, r#"kvx_router_requests_total{route="completions",outcome="ok"}"#), 2.0);
    assert_eq!(metric(&text, r#"kvx_router_retries_total{role="prefill"}"#), 1.0);
    assert_eq!(metric(&text, r#"kvx_router_retries_total{role="decode"}"#), 1.0);
    let failures = format!(
        r#"kvx_router_upstream_failures_total{{role="prefill",upstream="{dead}",reason="unreachable"}}"#
    );
    assert_eq!(metric(&text, &failures), 1.0);
    let failures = format!(
        r#"kvx_router_upstream_failures_total{{role="decode",upstream="{}",reason="server_error"}}"#,
        failing.url
    );
    assert_eq!(metric(&text, &failures), 1.0);
    let healthy = format!(r#"kvx_router_upstream_healthy{{role="decode",upstream="{}"}}"#, failing.url);
    assert_eq!(metric(&text, &healthy), 0.0);
    assert_eq!(metric(&text, r#"kvx_router_request_duration_seconds_count{route="completions"}"#), 2.0);

    // A failing health check keeps them out; passing ones bring them back.
    router.check_health().await;
    assert!(!router.prefill.is_healthy(0) && !router.decode.is_healthy(0));
    let revived =
        stub_on("p0", Role::Prefill, TcpListener::bind(("127.0.0.1", dead_port)).await.unwrap()).await;
    failing.status.store(200, Ordering::SeqCst);
    failing.health.store(200, Ordering::SeqCst);
    router.check_health().await;
    assert!(router.prefill.is_healthy(0) && router.decode.is_healthy(0));
    let healthy_now = metric(&metrics(&url).await, &healthy);
    assert_eq!(healthy_now, 1.0);

    // Back in rotation: with nothing outstanding, ties alternate, so two requests use both.
    for _ in 0..2 {
        assert_eq!(complete(&url, body.clone()).await.status(), 200);
    }
    assert_eq!((revived.requests(), failing.requests()), (1, 2));
}

#[tokio::test]
async fn a_server_leaves_rotation_after_unhealthy_after_failed_checks_in_a_row() {
    let (p, d) = (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await);
    let (router, _) = router(&[&p.url], &[&d.url]).await;
    // Not checked yet: on probation, the first failed check takes it out.
    p.health.store(503, Ordering::SeqCst);
    router.check_health().await;
    assert!(!router.prefill.is_healthy(0));
    // Once a check passed, it takes three failed checks in a row (unhealthy_after).
    p.health.store(200, Ordering::SeqCst);
    router.check_health().await;
    assert!(router.prefill.is_healthy(0));
    p.health.store(503, Ordering::SeqCst);
    router.check_health().await;
    router.check_health().await;
    assert!(router.prefill.is_healthy(0), "two failed checks keep it in rotation");
    p.health.store(200, Ordering::SeqCst);
    router.check_health().await;
    p.health.store(503, Ordering::SeqCst);
    router.check_health().await;
    router.check_health().await;
    assert!(router.prefill.is_healthy(0), "a passed check starts the count again");
    router.check_health().await;
    assert!(!router.prefill.is_healthy(0), "the third failed check in a row takes it out");
    assert!(router.decode.is_healthy(0));
}

#[tokio::test]
async fn a_server_error_from_a_server_whose_health_check_passes_keeps_it_in_rotation() {
    // One decode server, as vLLM answers 500 when one request's KV load failed.
    let (p, d) = (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await);
    d.status.store(500, Ordering::SeqCst);
    let (router, url) = router(&[&p.url], &[&d.url]).await;
    let body = json!({"model": "m", "prompt": "hello"});

    let response = complete(&url, body.clone()).await;
    assert_eq!(response.status(), 502);
    assert!(router.decode.is_healthy(0), "its health check passed before the 502");
    d.status.store(200, Ordering::SeqCst);
    assert_eq!(complete(&url, body).await.status(), 200);
    assert_eq!(d.requests(), 2);
    let text = metrics(&url).await;
    let failures = format!(
        r#"kvx_router_upstream_failures_total{{role="decode",upstream="{}",reason="server_error"}}"#,
        d.url
    );
    assert_eq!(metric(&text, &failures), 1.0);
}

#[tokio::test]
async fn streamed_chunks_reach_the_client_as_the_decode_server_sends_them() {
    let (p, d) = (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await);
    let (tx, rx) = mpsc::unbounded_channel();
    *d.chunks.lock().await = Some(rx);
    let (_router, url) = router(&[&p.url], &[&d.url]).await;
    let chunks = ["data: {\"n\":0}\n\n", "data: {\"n\":1}\n\n", "data: {\"n\":2}\n\n", "data: [DONE]\n\n"];

    tx.send(Ok(Bytes::from_static(chunks[0].as_bytes()))).unwrap();
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 3, "stream": true});
    let mut response = complete(&url, body).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    // The stub has sent only the first chunk: the client has it before the stub sends the rest.
    let first = within("the first chunk", response.chunk()).await.unwrap().unwrap();
    assert_eq!(first, chunks[0]);
    for chunk in &chunks[1..] {
        tx.send(Ok(Bytes::from_static(chunk.as_bytes()))).unwrap();
    }
    drop(tx);
    let rest = within("the rest of the stream", response.text()).await.unwrap();
    assert_eq!(rest, chunks[1..].concat());
}

#[tokio::test]
async fn a_decode_server_breaking_mid_stream_ends_the_answer_and_leaves_rotation() {
    let p = stub("p0", Role::Prefill).await;
    let decode = [stub("d0", Role::Decode).await, stub("d1", Role::Decode).await];
    let (tx, rx) = mpsc::unbounded_channel();
    *decode[0].chunks.lock().await = Some(rx);
    let (router, url) = router(&[&p.url], &[&decode[0].url, &decode[1].url]).await;
    let body = json!({"model": "m", "prompt": "hello", "stream": true});

    tx.send(Ok(Bytes::from_static(b"data: {}\n\n"))).unwrap();
    let mut response = complete(&url, body.clone()).await;
    assert_eq!(response.status(), 200);
    assert_eq!(within("the first chunk", response.chunk()).await.unwrap().unwrap(), "data: {}\n\n");
    tx.send(Err(std::io::Error::other("the decode server dies"))).unwrap();
    // The byte already went out: no retry, the client's answer breaks off.
    assert!(within("the broken stream", response.text()).await.is_err());
    assert!(!router.decode.is_healthy(0) && router.decode.is_healthy(1));
    assert_eq!(complete(&url, body).await.status(), 200);
    assert_eq!((decode[0].requests(), decode[1].requests()), (1, 1));
    let text = metrics(&url).await;
    let broken = format!(
        r#"kvx_router_upstream_failures_total{{role="decode",upstream="{}",reason="broken"}}"#,
        decode[0].url
    );
    assert_eq!(metric(&text, &broken), 1.0);
}

#[tokio::test]
async fn client_errors_are_passed_back_and_not_retried() {
    let prefill = [stub("p0", Role::Prefill).await, stub("p1", Role::Prefill).await];
    let d = stub("d0", Role::Decode).await;
    prefill[0].status.store(400, Ordering::SeqCst);
    let (router, url) = router(&[&prefill[0].url, &prefill[1].url], &[&d.url]).await;

    let response = complete(&url, json!({"model": "m", "prompt": "too long"})).await;
    assert_eq!(response.status(), 400);
    assert_eq!(json_of(response).await["error"]["message"], "p0 refuses");
    assert_eq!((prefill[0].requests(), prefill[1].requests(), d.requests()), (1, 0, 0));
    assert!(router.prefill.is_healthy(0));

    // A body that is not a JSON object is the router's own 400.
    let response = within("an answer", completion_request(&url, &json!([1, 2])).send()).await.unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(json_of(response).await["error"]["type"], "invalid_request_error");
    // A body over the limit is refused before it is read whole.
    let long = json!({"model": "m", "prompt": "x".repeat(1 << 20)});
    let response = within("an answer", completion_request(&url, &long).send()).await.unwrap();
    assert_eq!(response.status(), 413);
    assert_eq!((prefill[0].requests(), prefill[1].requests()), (1, 0));

    let text = metrics(&url).await;
    assert_eq!(
        metric(&text, r#"kvx_router_requests_total{route="completions",outcome="client_error"}"#),
        1.0
    );
    assert_eq!(metric(&text, r#"kvx_router_requests_total{route="completions",outcome="invalid"}"#), 1.0);
    assert!(text.contains("kvx_router_retries_total{role=\"prefill\"} 0\n"), "{text}");
}

#[tokio::test]
async fn with_every_server_down_requests_fail_with_a_json_error() {
    let prefill = [
        format!("http://127.0.0.1:{}", closed_port().await),
        format!("http://127.0.0.1:{}", closed_port().await),
    ];
    let decode = format!("http://127.0.0.1:{}", closed_port().await);
    let (router, url) = router(&[&prefill[0], &prefill[1]], &[&decode]).await;
    let body = json!({"model": "m", "prompt": "hello"});

    // Both prefill servers are tried and refuse: 502.
    let response = complete(&url, body.clone()).await;
    assert_eq!(response.status(), 502);
    let error = json_of(response).await;
    assert_eq!(error["error"]["type"], "bad_gateway");
    assert!(error["error"]["message"].as_str().unwrap().contains("2 prefill server(s) failed"), "{error}");
    // Now none is in rotation: 503 without trying, and the router reports itself unhealthy.
    let response = complete(&url, body).await;
    assert_eq!(response.status(), 503);
    assert_eq!(json_of(response).await["error"]["message"], "no prefill server is healthy");
    let health = within("/health", client().get(format!("{url}/health")).send()).await.unwrap();
    assert_eq!(health.status(), 503);
    router.check_health().await;
    assert_eq!((router.prefill.healthy(), router.decode.healthy()), (0, 0));
    let text = metrics(&url).await;
    assert_eq!(metric(&text, r#"kvx_router_requests_total{route="completions",outcome="failed"}"#), 1.0);
    assert_eq!(metric(&text, r#"kvx_router_requests_total{route="completions",outcome="unavailable"}"#), 1.0);
}

#[tokio::test]
async fn models_and_health_come_from_healthy_servers() {
    let (p, d) = (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await);
    let (router, url) = router(&[&p.url], &[&d.url]).await;
    let get = |path: &str| client().get(format!("{url}{path}")).send();

    let health = within("/health", get("/health")).await.unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(json_of(health).await, json!({"healthy_prefill_servers": 1, "healthy_decode_servers": 1}));
    let models = within("/v1/models", get("/v1/models")).await.unwrap();
    assert_eq!(models.status(), 200);
    assert_eq!(json_of(models).await["data"][0]["owned_by"], "d0");

    // With the decode server out, /v1/models comes from the prefill server and /health says 503.
    d.health.store(503, Ordering::SeqCst);
    router.check_health().await;
    assert_eq!(within("/health", get("/health")).await.unwrap().status(), 503);
    let models = within("/v1/models", get("/v1/models")).await.unwrap();
    assert_eq!(json_of(models).await["data"][0]["owned_by"], "p0");
}

#[tokio::test]
async fn the_metrics_port_serves_the_same_metrics() {
    let (p, d) = (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await);
    let (router, url) = router(&[&p.url], &[&d.url]).await;
    assert_eq!(complete(&url, json!({"model": "m", "prompt": "hi"})).await.status(), 200);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_url = format!("http://{}", listener.local_addr().unwrap());
    serve(listener, &router, router.metrics_app());
    let text = metrics(&metrics_url).await;
    assert_eq!(metric(&text, r#"kvx_router_requests_total{route="completions",outcome="ok"}"#), 1.0);
    let outstanding = format!(r#"kvx_router_upstream_outstanding{{role="decode",upstream="{}"}}"#, d.url);
    assert!(text.contains(&outstanding), "{text}");
    assert_eq!(metric(&text, &outstanding), 0.0);
}
