//! [`WorkerDriver`]: the thin layer that connects a [`ConnectorWorker`] to its
//! [`MetadataExchange`] and [`ParallelGroup`], on a tokio runtime it is given.
//!
//! The engine calls it from its step thread; nothing it does waits on the network except
//! registration (which publishes the payload) and the group's bounded gather. Handshakes run as
//! tasks on the runtime and their results are fed to the worker at the next call, or, for
//! simulations, are polled on the step thread itself ([`Handshakes::OnStepThread`]). The time the
//! worker sees comes from a [`Clock`] (the system's by default).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

use kvx_core::clock::{Clock, system_clock};
use kvx_core::error::Result;
use kvx_core::exchange::MetadataExchange;
use kvx_core::group::ParallelGroup;
use kvx_core::ids::EngineId;
use kvx_core::layout::LayerCache;
use kvx_core::meta::{ConnectorMetadata, Finished};
use kvx_core::worker::{
    AggregatorLimits, AggregatorStats, ConnectorWorker, FinishedAggregator, WorkerCommand,
};

/// A fetch's result, with the peer (engine and rank) it is of.
type HandshakeResult = ((EngineId, u32), Result<Vec<u8>>);
type Fetch = Pin<Box<dyn Future<Output = Result<Vec<u8>>> + Send>>;

/// Where a driver runs its handshake fetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Handshakes {
    /// As tasks on the runtime; results are fed to the worker at the next call (an engine).
    #[default]
    Background,
    /// Polled on the step thread at every call of the driver, never waited for: the order of
    /// everything is the order of the calls, so a simulation on a [`ManualClock`] replays
    /// exactly. For exchanges whose fetches complete without the runtime waking them (in-process
    /// ones), since nothing else polls them.
    ///
    /// [`ManualClock`]: kvx_core::ManualClock
    OnStepThread,
}

/// Drives one worker. See the crate's `docs/CONTRACT.md` for the call order.
pub struct WorkerDriver {
    worker: ConnectorWorker,
    exchange: Arc<dyn MetadataExchange>,
    group: Arc<dyn ParallelGroup>,
    aggregator: FinishedAggregator,
    runtime: Handle,
    clock: Arc<dyn Clock>,
    handshakes: Handshakes,
    /// [`Handshakes::OnStepThread`]: fetches not yet complete, in the order they started.
    polled: Vec<((EngineId, u32), Fetch)>,
    results_tx: Sender<HandshakeResult>,
    results_rx: Receiver<HandshakeResult>,
}

impl fmt::Debug for WorkerDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerDriver")
            .field("worker", &self.worker)
            .field("clock", &self.clock)
            .field("handshakes", &self.handshakes)
            .field("polled", &self.polled.len())
            .finish_non_exhaustive()
    }
}

impl WorkerDriver {
    /// A driver for `worker`; `runtime` must be a multi-threaded tokio runtime. Handshakes run in
    /// the background and time is the system's.
    pub fn new(
        worker: ConnectorWorker,
        exchange: Arc<dyn MetadataExchange>,
        group: Arc<dyn ParallelGroup>,
        runtime: Handle,
    ) -> Self {
        let (results_tx, results_rx) = mpsc::channel();
        let aggregator = FinishedAggregator::new(group.world_size());
        WorkerDriver {
            worker,
            exchange,
            group,
            aggregator,
            runtime,
            clock: system_clock(),
            handshakes: Handshakes::default(),
            polled: Vec::new(),
            results_tx,
            results_rx,
        }
    }

    /// The same driver taking the worker's `now` from `clock`.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The same driver keeping rank 0's partial reports within `limits` (default
    /// [`AggregatorLimits::default`]).
    pub fn with_aggregator_limits(mut self, limits: AggregatorLimits) -> Self {
        self.aggregator = FinishedAggregator::with_limits(self.group.world_size(), limits);
        self
    }

    /// The same driver running its handshake fetches as `handshakes` says.
    pub fn with_handshakes(mut self, handshakes: Handshakes) -> Self {
        self.handshakes = handshakes;
        self
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
        self.worker.start_load_kv(self.clock.now(), meta);
        self.dispatch();
    }

    /// This step's finished requests: on rank 0 those every rank has finished, on other ranks
    /// nothing (their reports went to rank 0).
    pub fn get_finished(&mut self) -> Result<Finished> {
        self.feed_handshakes();
        let local = self.worker.get_finished(self.clock.now());
        self.dispatch();
        Ok(match self.group.gather_finished(local)? {
            Some(reports) => self.aggregator.aggregate(self.clock.now(), reports),
            None => Finished::default(),
        })
    }

    /// When the worker next has work due without any input (a lease to end, a load or handshake
    /// timing out, an early notification to drop): an engine that idles between steps steps again
    /// by then. `None`: nothing is due until something arrives.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.worker.next_deadline()
    }

    /// Whether the worker has nothing in flight and rank 0 holds no partial report.
    pub fn is_idle(&self) -> bool {
        self.worker.is_idle() && self.aggregator.num_partial() == 0
    }

    /// Rank 0: the ids some but not all ranks have reported.
    pub fn num_partial_reports(&self) -> usize {
        self.aggregator.num_partial()
    }

    /// Rank 0: the aggregation's counters (partial ids, and those dropped by expiry or the cap).
    pub fn aggregator_stats(&self) -> AggregatorStats {
        self.aggregator.stats()
    }

    fn feed_handshakes(&mut self) {
        self.poll_fetches();
        while let Ok(((engine_id, rank), result)) = self.results_rx.try_recv() {
            self.worker.handle_handshake(self.clock.now(), &engine_id, rank, result);
            tracing::debug!(%engine_id, rank, "handshake result applied");
        }
    }

    fn dispatch(&mut self) {
        let timeout = self.worker.config().handshake_timeout;
        while let Some(cmd) = self.worker.poll_command() {
            match cmd {
                WorkerCommand::FetchHandshake(peer) => {
                    let exchange = Arc::clone(&self.exchange);
                    let engine_id = (peer.engine_id.clone(), peer.rank);
                    let fetch = async move { exchange.fetch(&peer, timeout).await };
                    match self.handshakes {
                        Handshakes::Background => {
                            let tx = self.results_tx.clone();
                            self.runtime.spawn(async move {
                                // The driver may be gone; then nobody waits for the result.
                                let _ = tx.send((engine_id, fetch.await));
                            });
                        }
                        Handshakes::OnStepThread => self.polled.push((engine_id, Box::pin(fetch))),
                    }
                }
            }
        }
        // A fetch that is ready at once is fed at the next call, as a background one would be.
        self.poll_fetches();
    }

    /// Polls the step-thread fetches once each, in the order they started; the finished ones'
    /// results join the queue the worker is fed from.
    fn poll_fetches(&mut self) {
        if self.polled.is_empty() {
            return;
        }
        let _in_runtime = self.runtime.enter();
        let mut cx = Context::from_waker(Waker::noop());
        let mut i = 0;
        while i < self.polled.len() {
            if let Poll::Ready(result) = self.polled[i].1.as_mut().poll(&mut cx) {
                let (engine_id, _) = self.polled.remove(i);
                // The receiver lives in `self`: the send cannot fail.
                let _ = self.results_tx.send((engine_id, result));
            } else {
                i += 1;
            }
        }
    }

    /// Waits until a handshake result arrives, `timeout` passes or the worker's
    /// [next deadline](Self::next_deadline) comes, then feeds what arrived. For engines that idle
    /// between steps; a step loop never needs it. With [`Handshakes::OnStepThread`] it polls the
    /// fetches once and waits for nothing.
    pub fn wait_for_handshakes(&mut self, timeout: Duration) {
        if self.handshakes == Handshakes::Background {
            let due = self.next_deadline().map(|d| d.saturating_duration_since(self.clock.now()));
            let timeout = due.map_or(timeout, |due| due.min(timeout));
            if let Ok(((engine_id, rank), result)) = self.results_rx.recv_timeout(timeout) {
                self.worker.handle_handshake(self.clock.now(), &engine_id, rank, result);
            }
        }
        self.feed_handshakes();
    }
}
