//! Prometheus metrics of the connector (feature `metrics`): what each worker and side channel
//! counts, in a [`prometheus_client`] registry, and a small HTTP server for it ([`serve`]).
//!
//! Nothing is counted twice: the workers count in their [`WorkerStats`] as always, and a
//! [`WorkerMetrics`] brings the registry up to date from them when asked
//! ([`WorkerMetrics::observe`], once per step or less: it copies a few hundred bytes). Counters add
//! what changed since the last call, so they stay monotonic across calls, across a
//! [`take_latencies`](ConnectorWorker::take_latencies) (the histograms read
//! [`Samples::histogram`](kvx_core::Samples::histogram), which it leaves alone) and across a new
//! worker under the same labels. The worker's counters and histograms, with their names and help
//! texts, are [`WorkerStats::COUNTERS`] and [`WorkerStats::TIMINGS`]; the names, types and labels
//! are in `docs/METRICS.md`.

mod histogram;
mod server;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use std::fmt;
use std::sync::Arc;

use crate::ServerStats;
use kvx_core::worker::{ConnectorWorker, CounterUnit, Histogram, WorkerStats};

use histogram::DurationHistogram;
pub use server::{CONTENT_TYPE, MetricsServer, serve};

/// The labels of a worker's metrics: its engine and tensor-parallel rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WorkerLabels {
    engine: String,
    rank: u32,
}

/// The labels of a side channel's refusals: its engine and rank, and why.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RefusalLabels {
    engine: String,
    rank: u32,
    reason: &'static str,
}

/// A worker gauge: its name, help and value.
struct GaugeDef {
    name: &'static str,
    help: &'static str,
    read: fn(&ConnectorWorker) -> usize,
}

const GAUGES: [GaugeDef; 3] = [
    GaugeDef {
        name: "holds_live",
        help: "Prefill side: holds whose blocks are held now",
        read: ConnectorWorker::num_holds,
    },
    GaugeDef {
        name: "loads_in_flight",
        help: "Decode side: loads waiting for a handshake, reading or waiting for confirmation",
        read: ConnectorWorker::num_in_flight,
    },
    GaugeDef { name: "peers", help: "Peers handshaken and ready", read: ConnectorWorker::num_peers },
];

/// One of a server's counters.
type ServerCounter = fn(&ServerStats) -> u64;

/// Why a side channel refused or dropped a connection: the label and the counter.
const REFUSALS: [(&str, ServerCounter); 9] = [
    ("limit", |s| s.refused.saturating_add(s.full)),
    ("evicted", |s| s.evicted),
    ("unproven", |s| s.unproven),
    ("expired", |s| s.expired),
    ("unauthenticated", |s| s.unauthenticated),
    ("malformed", |s| s.malformed),
    ("rejected", |s| s.rejected),
    ("oversize", |s| s.oversize),
    ("timeout", |s| s.idle.saturating_add(s.slow)),
];

/// The families, shared with the registry.
#[derive(Debug, Clone)]
struct Families {
    counters: Vec<Family<WorkerLabels, Counter>>,
    gauges: Vec<Family<WorkerLabels, Gauge>>,
    histograms: Vec<Family<WorkerLabels, DurationHistogram>>,
    accepted: Family<WorkerLabels, Counter>,
    refused: Family<RefusalLabels, Counter>,
}

/// kvx's metrics: a registry of every family (prefixed `kvx_`), and handles that bring it up to
/// date from workers and side channels. Cheap to clone: clones share the registry.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    families: Families,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::with_registry(Registry::with_prefix("kvx"))
    }
}

impl Metrics {
    /// Every family in a new registry.
    pub fn new() -> Self {
        Metrics::default()
    }

    /// The same, with a `role` label on every metric (`kvx prefill` and `kvx decode` name
    /// theirs).
    pub fn with_role(role: &str) -> Self {
        let labels = [("role".into(), role.to_owned().into())];
        Metrics::with_registry(Registry::with_prefix_and_labels("kvx", labels.into_iter()))
    }

    fn with_registry(mut registry: Registry) -> Self {
        let mut families = Families {
            counters: Vec::with_capacity(WorkerStats::COUNTERS.len()),
            gauges: Vec::with_capacity(GAUGES.len()),
            histograms: Vec::with_capacity(WorkerStats::TIMINGS.len()),
            accepted: Family::default(),
            refused: Family::default(),
        };
        for def in WorkerStats::COUNTERS {
            let family = Family::default();
            match def.unit {
                CounterUnit::Bytes => {
                    registry.register_with_unit(def.metric, def.help, Unit::Bytes, family.clone())
                }
                CounterUnit::Events => registry.register(def.metric, def.help, family.clone()),
            }
            families.counters.push(family);
        }
        for def in &GAUGES {
            let family = Family::default();
            registry.register(def.name, def.help, family.clone());
            families.gauges.push(family);
        }
        for def in WorkerStats::TIMINGS {
            let family = Family::default();
            registry.register_with_unit(def.metric, def.help, Unit::Seconds, family.clone());
            families.histograms.push(family);
        }
        registry.register(
            "side_channel_accepted",
            "Side-channel connections accepted",
            families.accepted.clone(),
        );
        registry.register(
            "side_channel_refused",
            "Side-channel connections refused or dropped, by reason: limit (no connection could make way), \
             evicted (made way for another), unproven (no proof or first request within the handshake timeout), \
             expired (max lifetime), unauthenticated, malformed, rejected, oversize (frame), timeout (idle or slow)",
            families.refused.clone(),
        );
        Metrics { registry: Arc::new(registry), families }
    }

    /// The registry, for [`serve`] or for encoding it elsewhere.
    pub fn registry(&self) -> Arc<Registry> {
        Arc::clone(&self.registry)
    }

    /// The registry in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        encode(&self.registry)
    }

    /// A handle that brings the metrics labelled with `engine` and `rank` up to date from a
    /// worker (one handle per worker and labels). Their series exist from now on (at zero).
    pub fn worker(&self, engine: &str, rank: u32) -> WorkerMetrics {
        let labels = WorkerLabels { engine: engine.to_owned(), rank };
        let f = &self.families;
        WorkerMetrics {
            counters: f.counters.iter().map(|c| c.get_or_create_owned(&labels)).collect(),
            gauges: f.gauges.iter().map(|g| g.get_or_create_owned(&labels)).collect(),
            histograms: f.histograms.iter().map(|h| h.get_or_create_owned(&labels)).collect(),
            last: None,
        }
    }

    /// A handle that brings the side-channel metrics labelled with `engine` and `rank` up to date
    /// from its server's counters. Their series exist from now on (at zero).
    pub fn side_channel(&self, engine: &str, rank: u32) -> SideChannelMetrics {
        let labels = WorkerLabels { engine: engine.to_owned(), rank };
        let refused = |reason| RefusalLabels { engine: engine.to_owned(), rank, reason };
        SideChannelMetrics {
            accepted: self.families.accepted.get_or_create_owned(&labels),
            refused: REFUSALS.map(|(reason, _)| self.families.refused.get_or_create_owned(&refused(reason))),
            last: ServerStats::default(),
        }
    }
}

/// `registry` in the OpenMetrics text format (ending in `# EOF`).
fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing into a String cannot fail; the families' encoders fail only with the writer.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, registry) {
        tracing::warn!(error = %e, "encoding the metrics failed");
    }
    text
}

/// What a worker had counted at the last [`WorkerMetrics::observe`].
#[derive(Debug)]
struct Observed {
    instance: u64,
    counters: [u64; WorkerStats::COUNTERS.len()],
    histograms: [Histogram; WorkerStats::TIMINGS.len()],
}

/// Brings one worker's metrics up to date ([`observe`](Self::observe)): its series, in the order
/// of their definitions.
#[derive(Debug)]
pub struct WorkerMetrics {
    counters: Vec<Counter>,
    gauges: Vec<Gauge>,
    histograms: Vec<DurationHistogram>,
    last: Option<Observed>,
}

impl WorkerMetrics {
    /// Adds what `worker` counted since the last call (everything at the first call, or when
    /// `worker` is a new worker: another instance) and sets the gauges. Cheap: atomic adds and a
    /// few hundred bytes copied, no lock but a histogram's when it changed, no allocation.
    pub fn observe(&mut self, worker: &ConnectorWorker) {
        let stats = worker.stats();
        let last = match &mut self.last {
            Some(last) if last.instance == worker.instance() => last,
            slot => slot.insert(Observed {
                instance: worker.instance(),
                counters: [0; WorkerStats::COUNTERS.len()],
                histograms: Default::default(),
            }),
        };
        for ((def, counter), seen) in WorkerStats::COUNTERS.iter().zip(&self.counters).zip(&mut last.counters)
        {
            let now = (def.read)(stats);
            if now > *seen {
                counter.inc_by(now - *seen);
            }
            *seen = now;
        }
        for ((def, histogram), seen) in
            WorkerStats::TIMINGS.iter().zip(&self.histograms).zip(&mut last.histograms)
        {
            let now = (def.read)(stats).histogram();
            if now.count() != seen.count() {
                histogram.add(now, seen);
                seen.clone_from(now);
            }
        }
        for (def, gauge) in GAUGES.iter().zip(&self.gauges) {
            gauge.set(i64::try_from((def.read)(worker)).unwrap_or(i64::MAX));
        }
    }
}

/// Brings one side channel's metrics up to date ([`observe`](Self::observe)).
#[derive(Debug)]
pub struct SideChannelMetrics {
    accepted: Counter,
    /// One per reason of [`REFUSALS`], in order.
    refused: [Counter; REFUSALS.len()],
    last: ServerStats,
}

impl SideChannelMetrics {
    /// Adds what the side channel's server counted since the last call (`stats` from
    /// [`SideChannel::stats`](crate::SideChannel::stats)). A counter below the last call's
    /// (another server) counts from zero.
    pub fn observe(&mut self, stats: &ServerStats) {
        let added = |read: ServerCounter| {
            let (now, seen) = (read(stats), read(&self.last));
            now.checked_sub(seen).unwrap_or(now)
        };
        self.accepted.inc_by(added(|s| s.accepted));
        for ((_, read), counter) in REFUSALS.iter().zip(&self.refused) {
            counter.inc_by(added(*read));
        }
        self.last = *stats;
    }
}

#[cfg(test)]
mod tests;
