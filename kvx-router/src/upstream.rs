//! The servers of one role (prefill or decode): which are in rotation, how many requests each has
//! outstanding, the choice of the next one, and their health checks.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::{Map, Value};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kvx_core::{Error, ErrorKind, Result};

use super::metrics::{FailureLabels, Metrics, RoleLabels, UpstreamLabels};

/// The role of a server behind the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Why a server was taken out of rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The connection was refused or could not be opened in time.
    Unreachable,
    /// The exchange ran past the request timeout.
    Timeout,
    /// The server answered HTTP 5xx.
    ServerError,
    /// The connection broke, or the answer was cut or malformed at the HTTP level.
    Broken,
    /// `GET /health` failed.
    HealthCheck,
}

impl Failure {
    pub(crate) fn of(e: &reqwest::Error) -> Self {
        if e.is_connect() {
            Failure::Unreachable
        } else if e.is_timeout() {
            Failure::Timeout
        } else {
            Failure::Broken
        }
    }

    fn name(self) -> &'static str {
        match self {
            Failure::Unreachable => "unreachable",
            Failure::Timeout => "timeout",
            Failure::ServerError => "server_error",
            Failure::Broken => "broken",
            Failure::HealthCheck => "health_check",
        }
    }
}

/// Validates a server's base URL: plain `http://HOST:PORT` with an optional path prefix; returns
/// it without a trailing `/`.
pub(crate) fn base_url(url: &str) -> Result<String> {
    let invalid =
        |why: &str| Error::new(ErrorKind::InvalidArgument, format!("router: server {url:?}: {why}"));
    let parsed = reqwest::Url::parse(url).map_err(|e| invalid(&e.to_string()))?;
    if parsed.scheme() != "http" {
        return Err(invalid("only http:// is supported (the router speaks no TLS)"));
    }
    if parsed.host_str().is_none() {
        return Err(invalid("no host"));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() || !parsed.username().is_empty() {
        return Err(invalid("a base URL takes no query, fragment or user"));
    }
    Ok(parsed.as_str().trim_end_matches('/').to_owned())
}

#[derive(Debug)]
struct Slot {
    outstanding: usize,
    healthy: bool,
    /// Health checks failed in a row.
    failed_checks: u32,
    outstanding_gauge: Gauge,
    healthy_gauge: Gauge,
    /// Push mode: where the server's KV connector is, as its last answer's params said; gone
    /// when it leaves rotation (it may come back as another engine).
    whereabouts: Option<Map<String, Value>>,
}

#[derive(Debug)]
struct PoolState {
    slots: Vec<Slot>,
    /// Where the next scan for the least-outstanding server starts: ties go round-robin.
    next: usize,
}

/// The servers of one role. All start in rotation (`kvx router` checks them before it serves).
#[derive(Debug)]
pub(crate) struct Pool {
    role: Role,
    urls: Vec<String>,
    state: Mutex<PoolState>,
    failures: Family<FailureLabels, Counter>,
    /// Failed health checks in a row that take a server in rotation out.
    unhealthy_after: u32,
}

impl Pool {
    pub(crate) fn new(
        role: Role,
        urls: &[String],
        unhealthy_after: u32,
        metrics: &Metrics,
    ) -> Result<Arc<Self>> {
        if urls.is_empty() {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("router: no {} server", role.name())));
        }
        let urls = urls.iter().map(|u| base_url(u)).collect::<Result<Vec<_>>>()?;
        for (i, url) in urls.iter().enumerate() {
            if urls[..i].contains(url) {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("router: {} server {url} given twice", role.name()),
                ));
            }
        }
        // The role's retries show as 0 from the start.
        let _ = metrics.retries.get_or_create(&RoleLabels { role: role.name() });
        let slots = urls
            .iter()
            .map(|url| {
                let labels = UpstreamLabels { role: role.name(), upstream: url.clone() };
                let healthy_gauge = metrics.healthy.get_or_create(&labels).clone();
                healthy_gauge.set(1);
                Slot {
                    outstanding: 0,
                    healthy: true,
                    // On probation until a check passes: the first failed one takes it out.
                    failed_checks: unhealthy_after.saturating_sub(1),
                    outstanding_gauge: metrics.outstanding.get_or_create(&labels).clone(),
                    healthy_gauge,
                    whereabouts: None,
                }
            })
            .collect();
        Ok(Arc::new(Self {
            role,
            urls,
            state: Mutex::new(PoolState { slots, next: 0 }),
            failures: metrics.failures.clone(),
            unhealthy_after,
        }))
    }

    pub(crate) fn role(&self) -> Role {
        self.role
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        // The state stays consistent under every lock: a panicking holder leaves nothing half done.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leases the healthy server with the fewest outstanding requests that is not in `tried`
    /// (indices of servers this request already tried); `None` when there is none.
    pub(crate) fn pick(self: &Arc<Self>, tried: &[usize]) -> Option<Lease> {
        let mut state = self.state();
        let n = state.slots.len();
        let start = state.next;
        let index = (0..n)
            .map(|k| (start + k) % n)
            .filter(|i| state.slots[*i].healthy && !tried.contains(i))
            .min_by_key(|i| state.slots[*i].outstanding)?;
        let slot = &mut state.slots[index];
        slot.outstanding += 1;
        slot.outstanding_gauge.inc();
        state.next = (index + 1) % n;
        Some(Lease { pool: self.clone(), index })
    }

    /// Takes server `index` out of rotation after `failure`; says so on stderr when it was in.
    fn fail(&self, index: usize, failure: Failure) {
        let mut state = self.state();
        let slot = &mut state.slots[index];
        let was_healthy = std::mem::replace(&mut slot.healthy, false);
        slot.healthy_gauge.set(0);
        slot.whereabouts = None;
        drop(state);
        if was_healthy {
            eprintln!(
                "kvx router: {} server {} out of rotation ({})",
                self.role.name(),
                self.urls[index],
                failure.name()
            );
        }
        self.count(index, failure);
    }

    /// Counts `failure` of server `index` in the metrics.
    fn count(&self, index: usize, failure: Failure) {
        self.failures
            .get_or_create(&FailureLabels {
                role: self.role.name(),
                upstream: self.urls[index].clone(),
                reason: failure.name(),
            })
            .inc();
    }

    /// Puts server `index` back in rotation after a passed health check; says so on stderr when it
    /// was out.
    fn recover(&self, index: usize) {
        let mut state = self.state();
        let slot = &mut state.slots[index];
        slot.failed_checks = 0;
        let was_healthy = std::mem::replace(&mut slot.healthy, true);
        slot.healthy_gauge.set(1);
        drop(state);
        if !was_healthy {
            eprintln!("kvx router: {} server {} back in rotation", self.role.name(), self.urls[index]);
        }
    }

    /// How many servers are in rotation.
    pub(crate) fn healthy(&self) -> usize {
        self.state().slots.iter().filter(|s| s.healthy).count()
    }

    /// Whether server `index` is in rotation.
    #[cfg(test)]
    pub(crate) fn is_healthy(&self, index: usize) -> bool {
        self.state().slots[index].healthy
    }

    /// Checks every server's `GET /health` at once, each within `timeout`.
    pub(crate) async fn check(&self, client: &reqwest::Client, timeout: Duration) {
        let checks = (0..self.urls.len()).map(|index| self.check_one(index, client, timeout));
        futures_util::future::join_all(checks).await;
    }

    /// Checks server `index`'s `GET /health` within `timeout`: a success (2xx) puts it in
    /// rotation; anything else is counted, and keeps it out of rotation or, the
    /// `unhealthy_after`-th time in a row, takes it out.
    async fn check_one(&self, index: usize, client: &reqwest::Client, timeout: Duration) {
        let url = format!("{}/health", self.urls[index]);
        match client.get(url).timeout(timeout).send().await {
            Ok(response) if response.status().is_success() => self.recover(index),
            _ => self.failed_check(index),
        }
    }

    fn failed_check(&self, index: usize) {
        let mut state = self.state();
        let slot = &mut state.slots[index];
        slot.failed_checks = slot.failed_checks.saturating_add(1);
        let out = !slot.healthy || slot.failed_checks >= self.unhealthy_after;
        drop(state);
        if out {
            self.fail(index, Failure::HealthCheck);
        } else {
            self.count(index, Failure::HealthCheck);
        }
    }
}

/// One request's hold on a server: counted outstanding until dropped.
#[derive(Debug)]
pub(crate) struct Lease {
    pool: Arc<Pool>,
    index: usize,
}

impl Lease {
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    pub(crate) fn url(&self) -> &str {
        &self.pool.urls[self.index]
    }

    /// Where this server's KV connector is, if an answer of it said so since it last came into
    /// rotation.
    pub(crate) fn whereabouts(&self) -> Option<Map<String, Value>> {
        self.pool.state().slots[self.index].whereabouts.clone()
    }

    /// Records where this server's KV connector is (`None`: its answer did not say).
    pub(crate) fn learn(&self, whereabouts: Option<Map<String, Value>>) {
        self.pool.state().slots[self.index].whereabouts = whereabouts;
    }

    /// Takes this server out of rotation after `failure` of the request.
    pub(crate) fn fail(&self, failure: Failure) {
        self.pool.fail(self.index, failure);
    }

    /// Checks this server's health now. For a server that answered HTTP 5xx, which vLLM also does
    /// for one request's failure (a KV load that failed under `kv_load_failure_policy` `fail`),
    /// the check decides whether it stays out of rotation.
    pub(crate) async fn recheck(&self, client: &reqwest::Client, timeout: Duration) {
        self.pool.check_one(self.index, client, timeout).await;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut state = self.pool.state();
        let slot = &mut state.slots[self.index];
        slot.outstanding -= 1;
        slot.outstanding_gauge.dec();
    }
}
