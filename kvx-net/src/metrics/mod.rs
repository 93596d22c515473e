//! Prometheus metrics of the connector (feature `metrics`): what each worker and side channel
//! counts, in a [`prometheus_client`] registry, and a small HTTP server for it ([`serve`]).
//!
//! Nothing is counted twice: the workers count in their [`WorkerStats`] as always, and a
//! [`WorkerMetrics`] brings the registry up to date from them when asked
//! ([`WorkerMetrics::observe`], once per step or less: it copies a few hundred bytes). Counters add
//! what changed since the last call, so they stay monotonic across calls, across a
//! [`take_latencies`](ConnectorWorker::take_latencies) (the histograms read
//! [`Samples::histogram`](kvx_core::Samples::histogram), which it leaves alone) and across a new
//! worker under the same labels. The names, types and labels are in `docs/METRICS.md`.

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
use kvx_core::worker::{ConnectorWorker, Histogram, WorkerStats};

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

/// A worker counter: its name (before the `kvx_` prefix and the `_total` suffix), help, unit,
/// and where it comes from.
struct CounterDef {
    name: &'static str,
    help: &'static str,
    unit: Option<Unit>,
    read: fn(&WorkerStats) -> u64,
}

const COUNTERS: [CounterDef; 18] = [
    CounterDef {
        name: "reads_posted",
        help: "READs posted to the transfer agent",
        unit: None,
        read: |s| s.reads_posted,
    },
    CounterDef {
        name: "reads_done",
        help: "Posted READs that completed",
        unit: None,
        read: |s| s.read_latencies.histogram().count(),
    },
    CounterDef {
        name: "reads_failed",
        help: "Posted READs that failed, timed out or were cancelled at close",
        unit: None,
        read: |s| s.reads_failed,
    },
    CounterDef {
        name: "read",
        help: "Bytes read by READs that completed and whose hold the prefill engine confirmed",
        unit: Some(Unit::Bytes),
        read: |s| s.bytes_read,
    },
    CounterDef {
        name: "read_descriptors",
        help: "Descriptors in posted READs after coalescing (per region, one per run of blocks contiguous on both sides)",
        unit: None,
        read: |s| s.descriptors,
    },
    CounterDef {
        name: "read_block_descriptors",
        help: "Descriptors (block x region) in posted READs before coalescing",
        unit: None,
        read: |s| s.block_descriptors,
    },
    CounterDef {
        name: "loads_failed",
        help: "Loads that failed (validation, post, transfer, handshake, lease)",
        unit: None,
        read: |s| s.failed_loads,
    },
    CounterDef {
        name: "lease_failures",
        help: "Decode side: loads whose READ completed after the prefill engine's hold had ended",
        unit: None,
        read: |s| s.lease_failures,
    },
    CounterDef { name: "handshakes", help: "Handshakes that completed", unit: None, read: |s| s.handshakes },
    CounterDef {
        name: "handshake_failures",
        help: "Handshakes that failed or timed out",
        unit: None,
        read: |s| s.handshake_failures,
    },
    CounterDef {
        name: "peer_restarts",
        help: "Handshakes that found a peer engine restarted",
        unit: None,
        read: |s| s.peer_restarts,
    },
    CounterDef {
        name: "holds_released",
        help: "Prefill side: holds their reader released",
        unit: None,
        read: |s| s.notifications,
    },
    CounterDef {
        name: "holds_expired",
        help: "Prefill side: holds freed because their lease ran out",
        unit: None,
        read: |s| s.expired_holds,
    },
    CounterDef {
        name: "leases_renewed",
        help: "Prefill side: leases extended by a heartbeat",
        unit: None,
        read: |s| s.leases_renewed,
    },
    CounterDef {
        name: "notifications_early",
        help: "Prefill side: releases that came before their hold",
        unit: None,
        read: |s| s.early_notifications,
    },
    CounterDef {
        name: "notifications_early_dropped",
        help: "Prefill side: releases that came before their hold and were dropped to keep the early releases bounded",
        unit: None,
        read: |s| s.early_notifications_dropped,
    },
    CounterDef {
        name: "notifications_stray",
        help: "Notifications that did not decode, were duplicated, or matched no hold or load",
        unit: None,
        read: |s| s.stray_notifications,
    },
    CounterDef {
        name: "notifications_rejected",
        help: "Notifications that named a held request with the wrong nonce",
        unit: None,
        read: |s| s.rejected_notifications,
    },
];

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

/// A worker histogram: its name (before `_seconds`), help and samples.
struct HistogramDef {
    name: &'static str,
    help: &'static str,
    read: fn(&WorkerStats) -> &Histogram,
}

const HISTOGRAMS: [HistogramDef; 5] = [
    HistogramDef {
        name: "read_duration",
        help: "From posting a READ to the step that found it done",
        read: |s| s.read_latencies.histogram(),
    },
    HistogramDef {
        name: "transfer_duration",
        help: "From posting a READ to the prefill engine's confirmation that its hold lived through it",
        read: |s| s.transfer_latencies.histogram(),
    },
    HistogramDef {
        name: "handshake_duration",
        help: "From a handshake's start to the peer being ready",
        read: |s| s.handshake_times.histogram(),
    },
    HistogramDef {
        name: "post_wait_duration",
        help: "From a load's admission to its READ's post (the handshake, when one was needed), per completed load",
        read: |s| s.post_waits.histogram(),
    },
    HistogramDef {
        name: "confirm_duration",
        help: "From the step that found a READ done to the prefill engine's confirmation, per completed load",
        read: |s| s.confirm_waits.histogram(),
    },
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
            counters: Vec::with_capacity(COUNTERS.len()),
            gauges: Vec::with_capacity(GAUGES.len()),
            histograms: Vec::with_capacity(HISTOGRAMS.len()),
            accepted: Family::default(),
            refused: Family::default(),
        };
        for def in &COUNTERS {
            let family = Family::default();
            match &def.unit {
                Some(unit) => registry.register_with_unit(def.name, def.help, unit.clone(), family.clone()),
                None => registry.register(def.name, def.help, family.clone()),
            }
            families.counters.push(family);
        }
        for def in &GAUGES {
            let family = Family::default();
            registry.register(def.name, def.help, family.clone());
            families.gauges.push(family);
        }
        for def in &HISTOGRAMS {
            let family = Family::default();
            registry.register_with_unit(def.name, def.help, Unit::Seconds, family.clone());
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
    counters: [u64; COUNTERS.len()],
    histograms: [Histogram; HISTOGRAMS.len()],
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
                counters: [0; COUNTERS.len()],
                histograms: Default::default(),
            }),
        };
        for ((def, counter), seen) in COUNTERS.iter().zip(&self.counters).zip(&mut last.counters) {
            let now = (def.read)(stats);
            if now > *seen {
                counter.inc_by(now - *seen);
            }
            *seen = now;
        }
        for ((def, histogram), seen) in HISTOGRAMS.iter().zip(&self.histograms).zip(&mut last.histograms) {
            let now = (def.read)(stats);
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
