//! The router's own Prometheus metrics (prefix `kvx_router_`), in the OpenMetrics text format.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::time::Instant;

/// The content type of [`Metrics::encode`]'s text.
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    pub(crate) route: &'static str,
    pub(crate) outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RouteLabels {
    pub(crate) route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RoleLabels {
    pub(crate) role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct UpstreamLabels {
    pub(crate) role: &'static str,
    pub(crate) upstream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct FailureLabels {
    pub(crate) role: &'static str,
    pub(crate) upstream: String,
    pub(crate) reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabels {
    pub(crate) reason: &'static str,
}

fn duration_histogram() -> Histogram {
    // 5 ms to about 160 s.
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

/// Every metric of the router, registered in its own registry.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    /// Client requests by route and outcome (see `Outcome`).
    pub(crate) requests: Family<RequestLabels, Counter>,
    /// Attempts on a further server after one failed, by stage.
    pub(crate) retries: Family<RoleLabels, Counter>,
    /// Prefill answers without `kv_transfer_params`: their decode server computes the prompt again
    /// (many mean a prefill server not configured as a KV producer).
    pub(crate) prefill_without_params: Counter,
    /// Push mode: requests whose prefill and decode legs went out together.
    pub(crate) dispatched_together: Counter,
    /// Failed requests and health checks per server, by reason.
    pub(crate) failures: Family<FailureLabels, Counter>,
    /// Requests in flight per server through this router.
    pub(crate) outstanding: Family<UpstreamLabels, Gauge>,
    /// 1 while a server is in rotation, 0 while it is out.
    pub(crate) healthy: Family<UpstreamLabels, Gauge>,
    /// Time from a client request's arrival to the last byte of its answer, by route.
    pub(crate) duration: Family<RouteLabels, Histogram, fn() -> Histogram>,
    /// Client connections dropped or refused by the router's own limits, by reason (see
    /// `server::Dropped`).
    pub(crate) connections_dropped: Family<ReasonLabels, Counter>,
    /// Client connections open now.
    pub(crate) open_connections: Gauge,
    /// Bytes of request bodies drawn from the shared body budget now.
    pub(crate) buffered_body_bytes: Gauge,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("kvx_router");
        let requests = Family::default();
        let retries = Family::default();
        let prefill_without_params = Counter::default();
        let dispatched_together = Counter::default();
        let failures = Family::default();
        let outstanding = Family::default();
        let healthy = Family::default();
        let duration = Family::new_with_constructor(duration_histogram as fn() -> Histogram);
        let connections_dropped = Family::default();
        let open_connections = Gauge::default();
        let buffered_body_bytes = Gauge::default();
        registry.register("requests", "Client requests by route and outcome", requests.clone());
        registry.register("retries", "Attempts on a further server after one failed", retries.clone());
        registry.register(
            "prefill_without_params",
            "Prefill answers without kv_transfer_params (the decode server computes the prompt again)",
            prefill_without_params.clone(),
        );
        registry.register(
            "dispatched_together",
            "Push mode: requests whose prefill and decode legs went out together",
            dispatched_together.clone(),
        );
        registry.register(
            "upstream_failures",
            "Failed requests and health checks per server, by reason",
            failures.clone(),
        );
        registry.register("upstream_outstanding", "Requests in flight per server", outstanding.clone());
        registry.register(
            "upstream_healthy",
            "1 while a server is in rotation, 0 while out",
            healthy.clone(),
        );
        registry.register_with_unit(
            "request_duration",
            "Time from a request's arrival to the last byte of its answer",
            prometheus_client::registry::Unit::Seconds,
            duration.clone(),
        );
        registry.register(
            "connections_dropped",
            "Client connections dropped or refused by the router's limits, by reason",
            connections_dropped.clone(),
        );
        registry.register("open_connections", "Client connections open now", open_connections.clone());
        registry.register_with_unit(
            "buffered_body",
            "Request body bytes drawn from the shared body budget now",
            prometheus_client::registry::Unit::Bytes,
            buffered_body_bytes.clone(),
        );
        Self {
            registry,
            requests,
            retries,
            prefill_without_params,
            dispatched_together,
            failures,
            outstanding,
            healthy,
            duration,
            connections_dropped,
            open_connections,
            buffered_body_bytes,
        }
    }

    /// The metrics in the OpenMetrics text format.
    pub(crate) fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// Observes a client request's duration when dropped: with the response when it has no body to
/// stream, with the relayed body when its last byte went out (or the client left).
#[derive(Debug)]
pub(crate) struct Timer {
    histogram: Histogram,
    start: Instant,
}

impl Timer {
    pub(crate) fn start(metrics: &Metrics, route: &'static str) -> Self {
        Self {
            histogram: metrics.duration.get_or_create(&RouteLabels { route }).clone(),
            start: Instant::now(),
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}
