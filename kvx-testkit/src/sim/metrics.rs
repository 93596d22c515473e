//! A simulated engine in kvx-net's Prometheus metrics (feature `metrics`).

use kvx_net::metrics::{Metrics, SideChannelMetrics, WorkerMetrics};

use super::SimEngine;

/// Brings the metrics of one engine's workers and TCP side channels up to date
/// ([`observe`](Self::observe)), labelled with its engine id and each rank.
#[derive(Debug)]
pub struct EngineMetrics {
    workers: Vec<WorkerMetrics>,
    side_channels: Vec<SideChannelMetrics>,
}

impl EngineMetrics {
    /// Handles for each of `engine`'s ranks in `metrics`.
    pub fn new(metrics: &Metrics, engine: &SimEngine) -> Self {
        let id = engine.engine_id().as_str();
        let ranks = 0..engine.config().tp;
        EngineMetrics {
            workers: ranks.clone().map(|r| metrics.worker(id, r)).collect(),
            side_channels: ranks.map(|r| metrics.side_channel(id, r)).collect(),
        }
    }

    /// Adds what `engine`'s workers and side channels counted since the last call. Cheap enough
    /// for every step.
    pub fn observe(&mut self, engine: &SimEngine) {
        for (handle, worker) in self.workers.iter_mut().zip(engine.workers()) {
            handle.observe(worker);
        }
        for (handle, stats) in self.side_channels.iter_mut().zip(engine.side_channel_stats()) {
            handle.observe(&stats);
        }
    }
}
