//! [`WorkerDriver`]: the thin layer that connects a [`ConnectorWorker`] to its
//! [`MetadataExchange`] and [`ParallelGroup`], on a tokio runtime it is given.
//!
//! The engine calls it from its step thread; nothing it does waits on the network except
//! registration (which publishes the payload) and the group's bounded gather. Handshakes run as
//! tasks on the runtime and their results are fed to the worker at the next call.

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

use crate::error::Result;
use crate::exchange::MetadataExchange;
use crate::group::ParallelGroup;
use crate::ids::EngineId;
use crate::layout::LayerCache;
use crate::meta::{ConnectorMetadata, Finished};
use crate::worker::{ConnectorWorker, FinishedAggregator, WorkerCommand};

type HandshakeResult = (EngineId, Result<Vec<u8>>);

/// Drives one worker. See the crate's `docs/CONTRACT.md` for the call order.
#[derive(Debug)]
pub struct WorkerDriver {
    worker: ConnectorWorker,
    exchange: Arc<dyn MetadataExchange>,
    group: Arc<dyn ParallelGroup>,
    aggregator: FinishedAggregator,
    runtime: Handle,
    results_tx: Sender<HandshakeResult>,
    results_rx: Receiver<HandshakeResult>,
}

impl WorkerDriver {
    /// A driver for `worker`; `runtime` must be a multi-threaded tokio runtime.
    pub fn new(
        worker: ConnectorWorker,
        exchange: Arc<dyn MetadataExchange>,
        group: Arc<dyn ParallelGroup>,
        runtime: Handle,
    ) -> Self {
        let (results_tx, results_rx) = mpsc::channel();
        let aggregator = FinishedAggregator::new(group.world_size());
        WorkerDriver { worker, exchange, group, aggregator, runtime, results_tx, results_rx }
    }

    /// The worker.
    pub fn worker(&self) -> &ConnectorWorker {
        &self.worker
    }

    /// The worker, mutably (for taking statistics).
    pub fn worker_mut(&mut self) -> &mut ConnectorWorker {
        &mut self.worker
    }

    /// Registers the KV caches and publishes the handshake payload on the side channel.
    pub fn register_kv_caches(&mut self, caches: &[LayerCache]) -> Result<()> {
        let payload = self.worker.register_kv_caches(caches)?;
        let exchange = Arc::clone(&self.exchange);
        self.runtime.block_on(async move { exchange.publish(payload).await })
    }

    /// Starts this step's loads; handshakes they need start in the background.
    pub fn start_load_kv(&mut self, meta: &ConnectorMetadata) {
        self.feed_handshakes();
        self.worker.start_load_kv(Instant::now(), meta);
        self.dispatch();
    }

    /// This step's finished requests: on rank 0 those every rank has finished, on other ranks
    /// nothing (their reports went to rank 0).
    pub fn get_finished(&mut self) -> Result<Finished> {
        self.feed_handshakes();
        let local = self.worker.get_finished(Instant::now());
        self.dispatch();
        Ok(match self.group.gather_finished(local)? {
            Some(reports) => self.aggregator.aggregate(reports),
            None => Finished::default(),
        })
    }

    /// Whether the worker has nothing in flight and rank 0 holds no partial report.
    pub fn is_idle(&self) -> bool {
        self.worker.is_idle() && self.aggregator.num_partial() == 0
    }

    fn feed_handshakes(&mut self) {
        while let Ok((engine_id, result)) = self.results_rx.try_recv() {
            let start = Instant::now();
            self.worker.handle_handshake(start, &engine_id, result);
            tracing::debug!(%engine_id, took = ?start.elapsed(), "handshake result applied");
        }
    }

    fn dispatch(&mut self) {
        let timeout = self.worker.config().handshake_timeout;
        while let Some(cmd) = self.worker.poll_command() {
            match cmd {
                WorkerCommand::FetchHandshake { engine_id, host, port } => {
                    let exchange = Arc::clone(&self.exchange);
                    let tx = self.results_tx.clone();
                    self.runtime.spawn(async move {
                        let result = exchange.fetch(&host, port, timeout).await;
                        // The driver may be gone; then nobody waits for the result.
                        let _ = tx.send((engine_id, result));
                    });
                }
            }
        }
    }

    /// Waits until a handshake result arrives or `timeout` passes, then feeds what arrived. For
    /// engines that idle between steps; a step loop never needs it.
    pub fn wait_for_handshakes(&mut self, timeout: Duration) {
        if let Ok((engine_id, result)) = self.results_rx.recv_timeout(timeout) {
            self.worker.handle_handshake(Instant::now(), &engine_id, result);
        }
        self.feed_handshakes();
    }
}
