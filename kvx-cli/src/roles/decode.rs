//! `kvx decode`: the workload through the prefill process's request API and this decode engine.

use clap::{Args, ValueEnum};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

use kvx_core::{Error, ErrorKind, HostScope, RequestId, Result, TransferParams};
use kvx_net::{Connection, NetConfig, parse_endpoint};
use kvx_testkit::sim::{RequestState, SimEngine};

use crate::backend::Backend;
use crate::summary::{PrefillLosses, Summary};
use crate::workload::{ModelArgs, WorkloadArgs};
use kvx_tcp::TcpConfig;

use super::metrics::{MetricsArgs, RoleMetrics};
use super::{ApiReply, ApiRequest, AuthArgs, advertised_host, api_error, engine_config, runtime};
use crate::discovery::DiscoveryArgs;

/// What `kvx decode` does with a request whose KV load failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OnLoadFailure {
    /// The request fails, and so does the run: no load should fail.
    Error,
    /// The request fails. The run still succeeds when every failed request was in flight when the
    /// prefill process was lost (its request API went away or a new instance answered).
    Fail,
    /// The decode engine computes the request's prompt itself, without remote KV (vLLM's
    /// `recompute` policy). The run still succeeds when every failed load was of a request in
    /// flight when the prefill process was lost, and every recompute finished.
    Recompute,
}

/// Options of `kvx decode`.
#[derive(Debug, Args)]
pub(crate) struct DecodeArgs {
    /// Transfer backend (one that crosses processes).
    #[arg(long, value_enum, default_value_t = Backend::Ucx)]
    backend: Backend,
    /// Host of this engine's side channel and of its transfer agent's listener, for the backends
    /// that listen (tcp): prefill engines connect to it to tell this one that its holds are
    /// released (`0.0.0.0`: every interface, which needs `--advertise-host`).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The address prefill engines reach this host at, put into this engine's handshake payload
    /// and agent metadata (default: `--host`). Prefill engines on other hosts need an address of
    /// this host they can route to, not a loopback one.
    #[arg(long)]
    advertise_host: Option<String>,
    /// The prefill process's request API (`tcp://host:port` or `host:port`).
    #[arg(long, default_value = "tcp://127.0.0.1:5600")]
    prefill: String,
    /// What a failed KV load means: `error` fails the run; `fail` and `recompute` (compute the
    /// prompt here) accept the failed loads of requests in flight when the prefill process was
    /// lost.
    #[arg(long, value_enum, default_value_t = OnLoadFailure::Error)]
    on_load_failure: OnLoadFailure,
    /// At most this many requests in this engine at once (0: no limit): the next prompt goes to
    /// the prefill process when one has finished.
    #[arg(long, default_value_t = 0)]
    max_in_flight: usize,
    /// Give up when the request API stays unreachable this many seconds (connections refused or
    /// reset: a prefill process that is down or restarting); retried with a back-off meanwhile.
    #[arg(long, default_value_t = 30)]
    reconnect_timeout: u64,
    /// Seconds a prefill engine's hold lasts unless renewed (the deployment's lease, as given to
    /// `kvx prefill`): a request waiting for its KV has it renewed every sixth of it.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    lease: u64,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    auth: AuthArgs,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    discovery: DiscoveryArgs,
}

/// Failed requests named on stderr, at most.
const FAILURES_SHOWN: usize = 20;

/// First and longest pause between two attempts to reach the request API.
const RETRY_FIRST: Duration = Duration::from_millis(10);
const RETRY_MAX: Duration = Duration::from_millis(500);

/// The decode side of the request API: one connection per request, so that a lost reply cannot
/// wedge the next one.
struct ApiClient {
    rt: Runtime,
    host: String,
    port: u16,
    net: NetConfig,
}

impl ApiClient {
    /// One exchange within `wait`. An unreachable prefill process (refused, reset, closed without a
    /// reply) fails with `Handshake`.
    fn exchange(&self, request: &ApiRequest, wait: Duration) -> Result<ApiReply> {
        let body = serde_json::to_vec(request).map_err(|e| api_error("encoding", e))?;
        let reply = self
            .rt
            .block_on(async {
                let exchange = async {
                    let mut conn = Connection::connect(&self.host, self.port, &self.net).await?;
                    conn.request(body).await
                };
                tokio::time::timeout(wait, exchange).await
            })
            .map_err(|_| Error::new(ErrorKind::Timeout, "request API: the prefill process did not answer"))?
            .map_err(|e| e.context("request API"))?;
        serde_json::from_slice(&reply)
            .map_err(|e| Error::invalid_peer_data(format!("request API: decoding the reply: {e}")))
    }
}

/// The workload's requests in the decode engine, and what became of them; which of them were in
/// flight when the prefill process was lost.
#[derive(Debug)]
struct Tracker {
    policy: OnLoadFailure,
    max_new_tokens: usize,
    /// Requests of the workload the engine has not ended, with their prompts (for a recompute).
    unfinished: HashMap<RequestId, Vec<u32>>,
    /// Local recomputes of failed loads (the recompute's id to the request's).
    recomputing: HashMap<RequestId, RequestId>,
    /// The unfinished requests right after the last reply of the prefill process: all the
    /// requests a loss after it can affect.
    in_flight_at_reply: Vec<RequestId>,
    /// Requests in flight at a loss of the prefill process.
    excused: HashSet<RequestId>,
    /// Requests whose load failed.
    failed_loads: Vec<RequestId>,
    /// Requests whose params this engine refused (never submitted).
    refused: usize,
    /// The prefill instance that answered last.
    instance: Option<String>,
    /// Whether the prefill process is unreachable now (a loss is counted once).
    lost: bool,
    losses: usize,
    in_flight_at_losses: usize,
    completed: u64,
    failed: u64,
    recomputed: u64,
    recomputes_failed: usize,
}

impl Tracker {
    fn new(policy: OnLoadFailure, max_new_tokens: usize) -> Self {
        Tracker {
            policy,
            max_new_tokens,
            unfinished: HashMap::new(),
            recomputing: HashMap::new(),
            in_flight_at_reply: Vec::new(),
            excused: HashSet::new(),
            failed_loads: Vec::new(),
            refused: 0,
            instance: None,
            lost: false,
            losses: 0,
            in_flight_at_losses: 0,
            completed: 0,
            failed: 0,
            recomputed: 0,
            recomputes_failed: 0,
        }
    }

    /// Requests in the engine: the workload's not yet ended, and recomputes.
    fn in_flight(&self) -> usize {
        self.unfinished.len() + self.recomputing.len()
    }

    /// A request the engine took, with params from the prefill process that answered last.
    fn added(&mut self, id: RequestId, prompt: Vec<u32>) {
        self.unfinished.insert(id, prompt);
        self.in_flight_at_reply = self.unfinished.keys().cloned().collect();
    }

    /// The prefill process is unreachable: the requests in flight after its last reply may fail.
    fn prefill_lost(&mut self, why: &str) {
        if self.lost {
            return;
        }
        self.lost = true;
        if self.instance.is_none() {
            // Not up yet: nothing of it was in flight.
            println!("kvx decode: waiting for the request API ({why})");
            return;
        }
        self.losses += 1;
        let in_flight = std::mem::take(&mut self.in_flight_at_reply);
        self.in_flight_at_losses += in_flight.len();
        println!("kvx decode: prefill lost ({why}); {} requests were in flight", in_flight.len());
        self.excused.extend(in_flight);
    }

    /// A reply from prefill instance `instance`; another instance than the last one means the
    /// process restarted (its predecessor's holds are gone).
    fn prefill_answered(&mut self, instance: &str) {
        if let Some(last) = self.instance.clone().filter(|last| last != instance) {
            self.prefill_lost(&format!("instance {last} replaced by {instance}"));
        }
        if self.lost && self.instance.is_some() {
            println!("kvx decode: request API back, prefill instance {instance}");
        }
        self.lost = false;
        self.instance = Some(instance.to_owned());
    }

    /// Records the requests `engine` ended; with `recompute`, submits failed loads again without
    /// params.
    fn sweep(&mut self, engine: &mut SimEngine) {
        let ended = |engine: &SimEngine, id: &RequestId| match engine.state(id) {
            Some(RequestState::Finished(reason)) => Some(Ok(*reason)),
            Some(RequestState::Failed(why)) => Some(Err(why.clone())),
            _ => None,
        };
        let done: Vec<_> =
            self.unfinished.keys().filter_map(|id| Some((id.clone(), ended(engine, id)?))).collect();
        for (id, outcome) in done {
            let prompt = self.unfinished.remove(&id).unwrap_or_default();
            let why = match outcome {
                Ok(_) => {
                    self.completed += 1;
                    continue;
                }
                Err(why) => why,
            };
            self.report(&id, &why);
            self.failed_loads.push(id.clone());
            if self.policy != OnLoadFailure::Recompute {
                self.failed += 1;
                continue;
            }
            let again = RequestId::new(format!("{id}/recompute"));
            match engine.add_request(again.clone(), &prompt, self.max_new_tokens, None) {
                Ok(()) => {
                    self.recomputing.insert(again, id);
                }
                Err(e) => {
                    self.report(&again, &e);
                    self.failed += 1;
                    self.recomputes_failed += 1;
                }
            }
        }
        let done: Vec<_> =
            self.recomputing.keys().filter_map(|id| Some((id.clone(), ended(engine, id)?))).collect();
        for (again, outcome) in done {
            self.recomputing.remove(&again);
            match outcome {
                Ok(_) => self.recomputed += 1,
                Err(why) => {
                    self.report(&again, &why);
                    self.failed += 1;
                    self.recomputes_failed += 1;
                }
            }
        }
    }

    /// A request whose params were refused: it fails, and no prefill loss explains it.
    fn refused(&mut self, id: &RequestId, why: &Error) {
        self.report(id, why);
        self.refused += 1;
        self.failed += 1;
    }

    /// Says why a request failed, on stderr: the first [`FAILURES_SHOWN`]; the summary counts all.
    fn report(&self, id: &RequestId, why: &Error) {
        let shown = self.failed_loads.len() + self.recomputes_failed + self.refused;
        if shown < FAILURES_SHOWN {
            eprintln!("kvx decode: request {id} failed: {why}");
        } else if shown == FAILURES_SHOWN {
            eprintln!("kvx decode: request {id} failed: {why} (further failures only counted)");
        }
    }

    /// Losses, and the failures they do not explain.
    fn losses(&self) -> PrefillLosses {
        let outside = self.failed_loads.iter().filter(|id| !self.excused.contains(*id)).count();
        PrefillLosses {
            tolerated: self.policy != OnLoadFailure::Error,
            losses: self.losses,
            in_flight: self.in_flight_at_losses,
            load_failures: self.failed_loads.len(),
            unexpected: outside + self.recomputes_failed + self.refused,
        }
    }
}

/// Refuses params that send this engine to its own machine (a loopback or unspecified side-channel
/// host) from a prefill engine reached at another one (`api_host`, the request API's host): that
/// prefill engine advertises an address only its own host can use, so a load would reach this
/// host's loopback (another process, or nothing) instead of it.
fn check_remote_host(api_host: &str, params: &TransferParams) -> Result<()> {
    let Some(remote) = params.remote_host.as_deref() else { return Ok(()) };
    if HostScope::of(api_host).is_local() || !HostScope::of(remote).is_local() {
        return Ok(());
    }
    Err(Error::invalid_peer_data(format!(
        "misconfigured prefill engine: reached at {api_host}, it names side-channel host {} in its \
         params, which is this machine: start it with --advertise-host set to an address this host \
         can reach",
        kvx_core::error::quote(remote)
    )))
}

/// A decode run: the engine, the request API, and the bookkeeping of both.
struct DecodeRun {
    engine: SimEngine,
    api: ApiClient,
    tracker: Tracker,
    deadline: Instant,
    limit: Duration,
    reconnect: Duration,
    metrics: RoleMetrics,
}

impl DecodeRun {
    fn check_deadline(&self) -> Result<()> {
        if Instant::now() > self.deadline {
            let mut stuck: Vec<String> = (self.tracker.unfinished.keys())
                .chain(self.tracker.recomputing.keys())
                .map(|id| format!("{id} {:?}", self.engine.state(id)))
                .collect();
            stuck.sort();
            stuck.truncate(8);
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "decode run not done after {:?}; {} requests in the engine ({})",
                    self.limit,
                    self.tracker.in_flight(),
                    stuck.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// One engine step, then what it ended.
    fn step(&mut self) -> Result<()> {
        self.engine.step()?;
        self.metrics.observe(&self.engine);
        self.tracker.sweep(&mut self.engine);
        Ok(())
    }

    /// Steps until fewer than `max` requests are in the engine (no limit with 0).
    fn wait_for_room(&mut self, max: usize) -> Result<()> {
        while max > 0 && self.tracker.in_flight() >= max {
            self.check_deadline()?;
            self.step()?;
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Steps until the engine is idle: every request ended, recomputes included.
    fn drain(&mut self) -> Result<()> {
        loop {
            self.step()?;
            if self.engine.is_idle() {
                return Ok(());
            }
            self.check_deadline()?;
            std::thread::yield_now();
        }
    }

    /// Asks the prefill process, again while it is unreachable (the same request: one whose round
    /// trip was lost is resubmitted), pausing with a growing back-off during which the engine
    /// keeps stepping: loads in flight end or fail meanwhile. Bounded by the run's deadline and
    /// by `--reconnect-timeout` of unreachability.
    fn ask(&mut self, request: &ApiRequest) -> Result<ApiReply> {
        let mut backoff = RETRY_FIRST;
        let mut unreachable_since: Option<Instant> = None;
        loop {
            let wait = self.deadline.saturating_duration_since(Instant::now());
            let e = match self.api.exchange(request, wait) {
                Ok(reply) => {
                    match &reply {
                        ApiReply::Params { instance, .. } | ApiReply::Finished { instance, .. } => {
                            self.tracker.prefill_answered(instance)
                        }
                        ApiReply::Error(_) => {}
                    }
                    return Ok(reply);
                }
                Err(e) if e.kind() == ErrorKind::Handshake => e,
                Err(e) => return Err(e),
            };
            self.tracker.prefill_lost(e.message());
            let since = *unreachable_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= self.reconnect {
                return Err(e.context(format!("unreachable for {:?}", self.reconnect)));
            }
            let until = Instant::now() + backoff;
            loop {
                self.check_deadline()?;
                self.step()?;
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                std::thread::sleep(left.min(Duration::from_millis(2)));
            }
            backoff = (backoff * 2).min(RETRY_MAX);
        }
    }
}

/// Runs the workload through the prefill process and this decode engine.
pub(crate) fn decode(args: &DecodeArgs) -> Result<Summary> {
    let (advertised, warning) =
        advertised_host(&args.host, args.advertise_host.as_deref(), "prefill engines")?;
    if let Some(warning) = warning {
        eprintln!("kvx decode: warning: {warning}");
    }
    let key = args.auth.key()?;
    let tcp =
        TcpConfig::default().with_host(&args.host, Some(advertised.to_owned())).with_auth_key(key.clone());
    let backend = args.backend.sim_backend(true, &tcp)?;
    let (api_host, api_port) = parse_endpoint(&args.prefill)?;
    let bind = (args.host.as_str(), Some(advertised));
    let side_channel = args.discovery.discovery.side_channel(bind, 0, key.clone());
    let config = engine_config("decode", side_channel, &args.model, key.clone(), args.lease);
    let engine = SimEngine::new(config, &backend)?;
    println!(
        "kvx decode: {} backend, {}; prefill at {}",
        args.backend.name(),
        args.model.describe(),
        args.prefill
    );
    let metrics = RoleMetrics::start(&args.metrics, "decode", &args.host, &engine)?;
    let api = ApiClient { rt: runtime()?, host: api_host, port: api_port, net: NetConfig::with_key(key) };
    let limit = Duration::from_secs(args.workload.timeout);
    let mut run = DecodeRun {
        engine,
        api,
        tracker: Tracker::new(args.on_load_failure, args.workload.max_new_tokens),
        deadline: Instant::now() + limit,
        limit,
        reconnect: Duration::from_secs(args.reconnect_timeout),
        metrics,
    };
    let start = Instant::now();
    let total = args.workload.requests;
    // About ten progress lines a run.
    let every = total.div_ceil(10).max(1);
    for (sent, (id, prompt)) in args.workload.prompts().into_iter().enumerate() {
        run.wait_for_room(args.max_in_flight)?;
        let params = match run.ask(&ApiRequest::Prefill { id: id.to_string(), prompt: prompt.clone() })? {
            ApiReply::Params { params, .. } => *params,
            other => return Err(api_error("unexpected reply", format!("{other:?}"))),
        };
        match check_remote_host(&run.api.host, &params) {
            Ok(()) => {
                run.engine.add_request(id.clone(), &prompt, args.workload.max_new_tokens, Some(params))?;
                run.tracker.added(id, prompt);
            }
            Err(e) => run.tracker.refused(&id, &e),
        }
        run.step()?;
        if (sent + 1) % every == 0 {
            println!("kvx decode: {} of {total} requests sent", sent + 1);
        }
    }
    run.drain()?;
    let mut summary = Summary::of_engine(&run.engine, total, start.elapsed());
    let t = &run.tracker;
    summary.set_outcomes(t.completed, t.failed, t.recomputed);
    // The prefill process answers once its holds are released: a hold whose release never
    // reached it lasts until its lease ends. Without an answer the summary still counts the run.
    match run.ask(&ApiRequest::Done) {
        Ok(ApiReply::Finished { leaked, errors, .. }) => summary.add_remote("prefill", leaked, errors),
        Ok(other) => return Err(api_error("unexpected reply", format!("{other:?}"))),
        Err(e) => summary.add_remote("prefill", 0, vec![format!("no answer to Done (leaks unknown): {e}")]),
    }
    // After the last reply: a restart noticed only by the last one counts too.
    summary.set_losses(run.tracker.losses());
    run.metrics.finish("decode", &run.engine);
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_count_the_requests_in_flight_after_the_last_reply_once_per_outage() {
        let mut t = Tracker::new(OnLoadFailure::Fail, 1);
        // Unreachable before any reply: waiting for the prefill process, not a loss.
        t.prefill_lost("refused");
        t.prefill_answered("one");
        assert_eq!(t.losses, 0);
        t.added("a".into(), vec![1]);
        t.added("b".into(), vec![1]);
        t.prefill_lost("reset");
        t.prefill_lost("refused");
        assert_eq!((t.losses, t.in_flight_at_losses), (1, 2));
        // The new instance answers: the outage ends; it is not a second loss.
        t.prefill_answered("two");
        assert_eq!(t.losses, 1);
        t.unfinished.clear();
        t.added("c".into(), vec![1]);
        // A restart seen only by the instance id is a loss too.
        t.prefill_answered("three");
        assert_eq!((t.losses, t.in_flight_at_losses), (2, 3));
        t.added("d".into(), vec![1]);
        t.failed_loads = vec!["a".into(), "c".into(), "d".into()];
        let l = t.losses();
        assert_eq!((l.tolerated, l.load_failures, l.unexpected), (true, 3, 1), "d came after the losses");
    }

    fn params_at(host: &str) -> TransferParams {
        TransferParams::for_decode(vec![], kvx_core::RemoteCoordinates::at("prefill", host, 5700))
    }

    #[test]
    fn params_naming_this_machine_from_a_prefill_engine_elsewhere_are_refused() {
        for remote in ["127.0.0.1", "::1", "localhost", "0.0.0.0"] {
            let e = check_remote_host("10.0.0.1", &params_at(remote)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "{remote}");
            assert!(e.message().contains("misconfigured prefill engine"), "{e}");
        }
        // A prefill engine on this machine may advertise loopback; one elsewhere its own address.
        for (api, remote) in [("127.0.0.1", "127.0.0.1"), ("localhost", "::1"), ("10.0.0.1", "10.0.0.1")] {
            assert_eq!(check_remote_host(api, &params_at(remote)), Ok(()), "{api} {remote}");
        }
        assert_eq!(check_remote_host("10.0.0.1", &TransferParams::default()), Ok(()));
    }

    #[test]
    fn a_refused_request_fails_the_run_whatever_the_load_failure_policy() {
        let mut t = Tracker::new(OnLoadFailure::Recompute, 1);
        t.prefill_answered("one");
        t.refused(&"a".into(), &check_remote_host("10.0.0.1", &params_at("127.0.0.1")).unwrap_err());
        let l = t.losses();
        assert_eq!((t.failed, l.tolerated, l.unexpected), (1, true, 1));
    }
}
