//! The router's HTTP routes: the two-stage prefill/decode exchange with its retries, the relay
//! of the decode answer, `/v1/models`, `/health` and `/metrics`.

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};
use std::future::Future;
use std::sync::Arc;
use tokio::time::MissedTickBehavior;

use kvx_core::{Error, ErrorKind, Result};

use super::metrics::{self, Metrics, RequestLabels, RoleLabels, Timer};
use super::server::ServerState;
use super::upstream::{Failure, Lease, Pool, Role};
use super::{Config, Mode};

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The completion routes, each proxied through a prefill and a decode server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Completions,
    ChatCompletions,
}

impl Route {
    fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::ChatCompletions => "/v1/chat/completions",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Route::Completions => "completions",
            Route::ChatCompletions => "chat_completions",
        }
    }
}

/// How a client request ends when it does not end with a decode server's answer.
#[derive(Debug)]
enum Refusal {
    /// The client's body is not a JSON object: 400.
    Invalid(String),
    /// No server of a role was in rotation: 503.
    Unavailable(String),
    /// Servers were tried and failed, or one answered what the router cannot use: 502.
    Failed(String),
    /// A server's client error (HTTP 4xx), passed back unchanged.
    Passthrough(Response),
}

impl Refusal {
    fn outcome(&self) -> &'static str {
        match self {
            Refusal::Invalid(_) => "invalid",
            Refusal::Unavailable(_) => "unavailable",
            Refusal::Failed(_) => "failed",
            Refusal::Passthrough(_) => "client_error",
        }
    }

    fn into_response(self) -> Response {
        let (status, kind, message) = match self {
            Refusal::Invalid(m) => (StatusCode::BAD_REQUEST, "invalid_request_error", m),
            Refusal::Unavailable(m) => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", m),
            Refusal::Failed(m) => (StatusCode::BAD_GATEWAY, "bad_gateway", m),
            Refusal::Passthrough(response) => return response,
        };
        let error = json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
        (status, axum::Json(error)).into_response()
    }
}

/// What one attempt on a server gives besides its answer.
#[derive(Debug)]
enum Stop {
    /// The server failed (and is out of rotation): try another.
    Retry(String),
    /// End the request with this.
    Refuse(Refusal),
}

/// Takes `lease`'s server out of rotation after `failure`; the attempt is retried elsewhere.
fn failed(lease: &Lease, failure: Failure, what: impl std::fmt::Display) -> Stop {
    lease.fail(failure);
    Stop::Retry(format!("{}: {what}", lease.url()))
}

enum ReadError {
    Transport(reqwest::Error),
    TooLarge,
}

/// Reads a whole answer of at most `limit` bytes.
async fn read_limited(response: &mut reqwest::Response, limit: usize) -> Result<Bytes, ReadError> {
    let mut answer = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(ReadError::Transport)? {
        if answer.len() + chunk.len() > limit {
            return Err(ReadError::TooLarge);
        }
        answer.extend_from_slice(&chunk);
    }
    Ok(answer.into())
}

/// Reads a server's whole answer: a transport failure takes the server out of rotation, an answer
/// over `limit` ends the request with a 502.
async fn read_answer(lease: &Lease, response: &mut reqwest::Response, limit: usize) -> Result<Bytes, Stop> {
    read_limited(response, limit).await.map_err(|e| match e {
        ReadError::Transport(e) => failed(lease, Failure::of(&e), e),
        ReadError::TooLarge => {
            Stop::Refuse(Refusal::Failed(format!("{} answered more than {limit} bytes", lease.url())))
        }
    })
}

/// The headers of a server's answer that go back to the client.
fn answer_headers(from: &HeaderMap, request_id: Option<&HeaderValue>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for name in [CONTENT_TYPE, CACHE_CONTROL] {
        if let Some(value) = from.get(&name) {
            headers.insert(name, value.clone());
        }
    }
    if let Some(id) = request_id {
        headers.insert(REQUEST_ID, id.clone());
    }
    headers
}

/// A response to the client with what a server answered.
fn client_response(status: StatusCode, headers: HeaderMap, body: Body) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// The client's `X-Request-Id` when it is a plausible id (1 to 128 of `[A-Za-z0-9._:-]`), a new
/// random one otherwise.
fn request_id(client: &HeaderMap) -> HeaderValue {
    let plausible = |v: &&HeaderValue| {
        let bytes = v.as_bytes();
        (1..=128).contains(&bytes.len())
            && bytes.iter().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(b))
    };
    client.get(REQUEST_ID).filter(plausible).cloned().unwrap_or_else(|| {
        let id = format!("kvx-router-{:032x}", rand::random::<u128>());
        HeaderValue::from_str(&id).unwrap_or(HeaderValue::from_static("kvx-router"))
    })
}

/// The headers of both upstream requests: JSON, the request id and the client's `Authorization`.
fn upstream_headers(client: &HeaderMap, request_id: &HeaderValue) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(REQUEST_ID, request_id.clone());
    if let Some(auth) = client.get(AUTHORIZATION) {
        headers.insert(AUTHORIZATION, auth.clone());
    }
    headers
}

/// The prefill server's body: the client's, computing the prompt and one token, without
/// streaming, with the KV kept for a remote decode (pushed to it in push mode).
fn prefill_body(request: &Map<String, Value>, route: Route, mode: Mode) -> Bytes {
    let mut body = request.clone();
    let mut params = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    });
    if mode == Mode::Push {
        params["transfer_mode"] = "push".into();
    }
    body.insert("kv_transfer_params".into(), params);
    body.insert("stream".into(), Value::Bool(false));
    body.insert("max_tokens".into(), 1.into());
    if route == Route::ChatCompletions {
        body.insert("max_completion_tokens".into(), 1.into());
    }
    // `min_tokens` above 1 would make the one-token request invalid.
    body.remove("min_tokens");
    body.remove("stream_options");
    Value::Object(body).to_string().into()
}

/// The decode server's body: the client's, with the prefill server's `kv_transfer_params`, or
/// without any when it gave none.
fn decode_body(mut request: Map<String, Value>, params: Option<Map<String, Value>>) -> Bytes {
    match params {
        Some(params) => request.insert("kv_transfer_params".into(), Value::Object(params)),
        None => request.remove("kv_transfer_params"),
    };
    Value::Object(request).to_string().into()
}

/// What a decode leg sent before its prefill server answered needs of that server (push mode):
/// the keys of its answers' params that say where its connector is.
const PREFILL_AT: [&str; 4] = ["remote_engine_id", "remote_host", "remote_port", "tp_size"];

/// Where a prefill server's connector is, from its answer's `params` ([`PREFILL_AT`]; the engine
/// id at least).
fn whereabouts(params: &Map<String, Value>) -> Option<Map<String, Value>> {
    let at: Map<String, Value> =
        PREFILL_AT.iter().filter_map(|&k| params.get(k).map(|v| (k.to_owned(), v.clone()))).collect();
    at.get("remote_engine_id").is_some_and(Value::is_string).then_some(at)
}

/// A push's decode leg params: the prefill server's whereabouts from an earlier answer of it.
fn push_params(at: &Map<String, Value>) -> Map<String, Value> {
    let mut params = at.clone();
    params.insert("do_remote_prefill".into(), true.into());
    params.insert("do_remote_decode".into(), false.into());
    params.insert("transfer_mode".into(), "push".into());
    params
}

/// The decode server's answer as the client's response, and its outcome for the metrics.
fn relayed(relay: Relay, request_id: &HeaderValue, timer: Timer) -> (&'static str, Response) {
    let status = relay.response.status();
    let headers = answer_headers(relay.response.headers(), Some(request_id));
    let outcome = if status.is_client_error() { "client_error" } else { "ok" };
    (outcome, client_response(status, headers, relay.body(timer)))
}

/// A decode server's answer whose head and first chunk arrived: from here on it goes to the client.
struct Relay {
    lease: Lease,
    response: reqwest::Response,
    first: Option<Bytes>,
}

impl Relay {
    /// The rest of the answer as the client's body: chunks as they arrive. A decode server that
    /// fails now is taken out of rotation and the client's response ends early. `timer` observes
    /// the request's duration when the body ends.
    fn body(self, timer: Timer) -> Body {
        let stream = futures_util::stream::try_unfold((self, timer), |(mut relay, timer)| async move {
            if let Some(chunk) = relay.first.take() {
                return Ok(Some((chunk, (relay, timer))));
            }
            match relay.response.chunk().await {
                Ok(Some(chunk)) => Ok(Some((chunk, (relay, timer)))),
                Ok(None) => Ok(None),
                Err(e) => {
                    relay.lease.fail(Failure::of(&e));
                    Err(e)
                }
            }
        });
        Body::from_stream(stream)
    }
}

/// What the router shares between its routes: settings, servers, HTTP client, metrics.
#[derive(Debug)]
pub(crate) struct Shared {
    config: Config,
    client: reqwest::Client,
    pub(crate) prefill: Arc<Pool>,
    pub(crate) decode: Arc<Pool>,
    metrics: Metrics,
    server: Arc<ServerState>,
}

impl Shared {
    pub(crate) fn new(config: Config) -> Result<Arc<Self>> {
        let metrics = Metrics::new();
        let prefill = Pool::new(Role::Prefill, &config.prefill, config.unhealthy_after, &metrics)?;
        let decode = Pool::new(Role::Decode, &config.decode, config.unhealthy_after, &metrics)?;
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(config.connect_timeout)
            .timeout(config.request_timeout)
            .build()
            .map_err(|e| Error::new(ErrorKind::Io, format!("router: HTTP client: {e}")))?;
        let server = Arc::new(ServerState::new(
            config.limits,
            config.max_body_bytes,
            config.request_timeout,
            &metrics,
        ));
        Ok(Arc::new(Self { config, client, prefill, decode, metrics, server }))
    }

    /// What the router's servers (the API's and `--metrics-port`'s) share: limits, body budget.
    pub(crate) fn server(&self) -> Arc<ServerState> {
        self.server.clone()
    }

    /// The API: completions, models, health and metrics.
    pub(crate) fn app(self: &Arc<Self>) -> axum::Router {
        axum::Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(serve_metrics))
            .layer(DefaultBodyLimit::max(self.config.max_body_bytes))
            .with_state(self.clone())
    }

    /// `/metrics` alone, for `--metrics-port`.
    pub(crate) fn metrics_app(self: &Arc<Self>) -> axum::Router {
        axum::Router::new().route("/metrics", get(serve_metrics)).with_state(self.clone())
    }

    /// Checks every server's health once.
    pub(crate) async fn check_health(&self) {
        let timeout = self.config.health_timeout;
        tokio::join!(self.prefill.check(&self.client, timeout), self.decode.check(&self.client, timeout));
    }

    /// Checks every server's health every health interval, the first time one interval from now.
    pub(crate) async fn health_loop(self: Arc<Self>) {
        let period = self.config.health_interval;
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            self.check_health().await;
        }
    }

    /// Runs `attempt` on up to `1 + retries` servers of `pool`, none twice, each the healthy one
    /// with the fewest requests outstanding, until one does not ask for a retry.
    async fn with_retries<T, F, Fut>(&self, pool: &Arc<Pool>, mut attempt: F) -> Result<T, Refusal>
    where
        F: FnMut(Lease) -> Fut,
        Fut: Future<Output = Result<T, Stop>>,
    {
        let role = pool.role().name();
        let mut tried = Vec::new();
        let mut last = None;
        while tried.len() <= self.config.retries {
            let Some(lease) = pool.pick(&tried) else { break };
            if !tried.is_empty() {
                self.metrics.retries.get_or_create(&RoleLabels { role }).inc();
            }
            tried.push(lease.index());
            match attempt(lease).await {
                Ok(done) => return Ok(done),
                Err(Stop::Refuse(refusal)) => return Err(refusal),
                Err(Stop::Retry(why)) => last = Some(why),
            }
        }
        Err(match last {
            None => Refusal::Unavailable(format!("no {role} server is healthy")),
            Some(why) => Refusal::Failed(format!("{} {role} server(s) failed; the last: {why}", tried.len())),
        })
    }

    /// Takes a server that answered HTTP 5xx out of rotation, then checks its health before the
    /// request moves on: a failure of one request does not keep a healthy server out.
    async fn server_error(&self, lease: &Lease, status: StatusCode) -> Stop {
        let stop = failed(lease, Failure::ServerError, status);
        lease.recheck(&self.client, self.config.health_timeout).await;
        stop
    }

    /// Posts `body` to `path` on the leased server; a failed exchange or an HTTP 5xx answer takes
    /// the server out of rotation (after a 5xx, unless its health check passes).
    async fn post(
        &self,
        lease: &Lease,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<reqwest::Response, Stop> {
        let url = format!("{}{path}", lease.url());
        let response = self.client.post(url).headers(headers.clone()).body(body).send().await;
        let response = response.map_err(|e| failed(lease, Failure::of(&e), e))?;
        if response.status().is_server_error() {
            return Err(self.server_error(lease, response.status()).await);
        }
        Ok(response)
    }

    /// One prefill attempt: the `kv_transfer_params` of the answer (`None` when it has none). In
    /// push mode the answer also says where the server is (a failure that takes the server out of
    /// rotation forgets it).
    async fn prefill_once(
        &self,
        lease: Lease,
        route: Route,
        headers: &HeaderMap,
        body: Bytes,
        request_id: &HeaderValue,
    ) -> Result<Option<Map<String, Value>>, Stop> {
        let answered = async {
            let mut response = self.post(&lease, route.path(), headers, body).await?;
            let status = response.status();
            let answer = read_answer(&lease, &mut response, self.config.max_body_bytes).await?;
            if status.is_client_error() {
                let headers = answer_headers(response.headers(), Some(request_id));
                return Err(Stop::Refuse(Refusal::Passthrough(client_response(
                    status,
                    headers,
                    answer.into(),
                ))));
            }
            let bad =
                |why: &str| Stop::Refuse(Refusal::Failed(format!("prefill server {}: {why}", lease.url())));
            if !status.is_success() {
                return Err(bad(&format!("answered HTTP {status}")));
            }
            let mut answer: Map<String, Value> = serde_json::from_slice(&answer)
                .map_err(|e| bad(&format!("the answer is not a JSON object: {e}")))?;
            match answer.remove("kv_transfer_params") {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Object(params)) => Ok(Some(params)),
                Some(_) => Err(bad("kv_transfer_params is not an object")),
            }
        }
        .await;
        if let (Mode::Push, Ok(params)) = (self.config.mode, &answered) {
            lease.learn(params.as_ref().and_then(whereabouts));
        }
        answered
    }

    /// One decode attempt: the answer once its head and first chunk arrived.
    async fn decode_once(
        &self,
        lease: Lease,
        route: Route,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Relay, Stop> {
        let mut response = self.post(&lease, route.path(), headers, body).await?;
        match response.chunk().await {
            Ok(first) => Ok(Relay { lease, response, first }),
            Err(e) => Err(failed(&lease, Failure::of(&e), e)),
        }
    }

    /// A completion request through a prefill and a decode server; the outcome for the metrics
    /// with the response.
    async fn complete(
        &self,
        route: Route,
        client: &HeaderMap,
        body: &[u8],
        timer: Timer,
    ) -> Result<(&'static str, Response), Refusal> {
        let request: Map<String, Value> = serde_json::from_slice(body)
            .map_err(|e| Refusal::Invalid(format!("the request body is not a JSON object: {e}")))?;
        let request_id = request_id(client);
        let headers = upstream_headers(client, &request_id);
        let prefill = prefill_body(&request, route, self.config.mode);
        if let Some(relay) = self.together(route, &request, &headers, &prefill, &request_id).await {
            return Ok(relayed(relay?, &request_id, timer));
        }
        let params = self
            .with_retries(&self.prefill, |lease| {
                self.prefill_once(lease, route, &headers, prefill.clone(), &request_id)
            })
            .await?;
        if params.is_none() {
            self.metrics.prefill_without_params.inc();
        }
        let decode = decode_body(request, params);
        let relay = self
            .with_retries(&self.decode, |lease| self.decode_once(lease, route, &headers, decode.clone()))
            .await?;
        Ok(relayed(relay, &request_id, timer))
    }

    /// Push mode, with a prefill server whose whereabouts an earlier answer gave: both legs at
    /// once, the decode leg naming that server. `None` when it cannot (pull mode, no such server
    /// healthy, or its prefill leg failed while the decode leg waited: the decode leg is dropped,
    /// which aborts it at its server, and the request goes on in order).
    async fn together(
        &self,
        route: Route,
        request: &Map<String, Value>,
        headers: &HeaderMap,
        prefill: &Bytes,
        request_id: &HeaderValue,
    ) -> Option<Result<Relay, Refusal>> {
        if self.config.mode != Mode::Push {
            return None;
        }
        let lease = self.prefill.pick(&[])?;
        let at = lease.whereabouts()?;
        self.metrics.dispatched_together.inc();
        let decode = decode_body(request.clone(), Some(push_params(&at)));
        let prefill_leg = self.prefill_once(lease, route, headers, prefill.clone(), request_id);
        let decode_leg =
            self.with_retries(&self.decode, |lease| self.decode_once(lease, route, headers, decode.clone()));
        tokio::pin!(prefill_leg, decode_leg);
        let prefilled = tokio::select! {
            prefilled = &mut prefill_leg => prefilled,
            relay = &mut decode_leg => {
                // The decode leg answered first (its KV came, or it computed the prompt itself):
                // the prefill leg's answer still says where its server is now.
                let _ = prefill_leg.await;
                return Some(relay);
            }
        };
        match prefilled {
            Err(Stop::Retry(_)) => None,
            Ok(None) => {
                self.metrics.prefill_without_params.inc();
                Some(decode_leg.await)
            }
            Ok(Some(_)) | Err(Stop::Refuse(_)) => Some(decode_leg.await),
        }
    }

    async fn completion(&self, route: Route, client: &HeaderMap, body: &[u8]) -> Response {
        let timer = Timer::start(&self.metrics, route.name());
        let (outcome, response) = match self.complete(route, client, body, timer).await {
            Ok(done) => done,
            Err(refusal) => (refusal.outcome(), refusal.into_response()),
        };
        self.metrics.requests.get_or_create(&RequestLabels { route: route.name(), outcome }).inc();
        response
    }

    /// One `GET` attempt, its answer passed back whole.
    async fn get_once(&self, lease: Lease, path: &str) -> Result<Response, Stop> {
        let response = self.client.get(format!("{}{path}", lease.url())).send().await;
        let mut response = response.map_err(|e| failed(&lease, Failure::of(&e), e))?;
        let status = response.status();
        if status.is_server_error() {
            return Err(self.server_error(&lease, status).await);
        }
        let answer = read_answer(&lease, &mut response, self.config.max_body_bytes).await?;
        Ok(client_response(status, answer_headers(response.headers(), None), answer.into()))
    }
}

async fn completions(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    shared.completion(Route::Completions, &headers, &body).await
}

async fn chat_completions(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    shared.completion(Route::ChatCompletions, &headers, &body).await
}

/// `GET /v1/models` from a healthy decode server, or a prefill server when no decode server is.
async fn models(State(shared): State<Arc<Shared>>) -> Response {
    let pool = if shared.decode.healthy() > 0 { &shared.decode } else { &shared.prefill };
    match shared.with_retries(pool, |lease| shared.get_once(lease, "/v1/models")).await {
        Ok(response) => response,
        Err(refusal) => refusal.into_response(),
    }
}

/// 200 while a prefill and a decode server are in rotation, 503 otherwise; the counts either way.
async fn health(State(shared): State<Arc<Shared>>) -> Response {
    let (prefill, decode) = (shared.prefill.healthy(), shared.decode.healthy());
    let status = if prefill > 0 && decode > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(json!({"healthy_prefill_servers": prefill, "healthy_decode_servers": decode})))
        .into_response()
}

async fn serve_metrics(State(shared): State<Arc<Shared>>) -> Response {
    ([(CONTENT_TYPE, metrics::CONTENT_TYPE)], shared.metrics.encode()).into_response()
}
