//! The deterministic fault soak: prefill and decode [`SimEngine`](crate::sim::SimEngine)s on any
//! backend (loopback by default), thousands of requests, and a seeded schedule of every fault the
//! connector must survive; then the figures that must be zero.
//!
//! Everything runs on one thread, in one order, on a [`ManualClock`](kvx_core::ManualClock): an
//! engine step costs [`SoakConfig::step_time`] of simulated time, and when no engine has work the
//! clock jumps to the next deadline (a lease, a handshake timeout, a late message), so a 30 s
//! lease costs no wall time. Handshakes are polled on the step thread
//! ([`Handshakes::OnStepThread`](kvx_net::Handshakes)), hold nonces are seeded, and the faults'
//! fates are functions of the seed and of the event: on loopback, the same seed gives the same
//! run, and the same [`SoakReport::digest`]. Over a real transport ([`run_soak_on`]) time is real
//! for the transfers themselves: a READ completes when the transport completes it, polled by the
//! engines' steps, while leases and timeouts stay in simulated time (an engine with a READ in
//! flight is busy, so the clock only moves a step at a time then). Such a run can differ from one
//! replay to the next in what completes in which step, not in what must be zero.
//!
//! What the schedule injects (rates in [`FaultRates`]):
//! - on every agent, by the [`Chaos`](crate::chaos::Chaos) layer (seeded
//!   [`Faults`](crate::chaos::Faults)): failed and delayed READs; dropped, duplicated and delayed
//!   notifications, and stray ones (garbage, an unknown request's release, a forged nonce);
//! - on the side channel ([`HandshakeFaults`](crate::sim::HandshakeFaults)): refused, late and
//!   unanswered handshakes;
//! - per request: a client abort at a random time, so at every stage (waiting on the prefill
//!   engine, between the engines, waiting on the decode engine, loading, running), and params the
//!   client loses between the engines (in push mode, where both legs go out at once, a lost
//!   decode leg instead: the prefill engine's hold waits for a registration that never comes);
//! - per run: prefill and decode engine restarts (the engine is dropped with its agents and comes
//!   back with the same id and side-channel ports), and decode engines whose steps stall for
//!   longer than a lease. Each happens at least once, at a quarter, half and three quarters of the
//!   arrivals, and more often by chance.
//!
//! Every request must end: finished, recomputed (its load failed and it computed its prompt;
//! decode engines recompute or fail by seed), failed, aborted or lost with an engine that
//! restarted. What must be zero: unresolved requests, received blocks whose bytes differ from
//! the prefill model's, blocks left in any pool, engines not idle at the end, engine errors,
//! panics (each engine step runs under `catch_unwind`).
//!
//! ```
//! use kvx_testkit::soak::{SoakConfig, run_soak};
//! let report = run_soak(&SoakConfig::new(20, 7))?;
//! assert_eq!(report.requests, 20);
//! assert_eq!(report.unresolved, 0);
//! println!("{report}");
//! # Ok::<(), kvx_core::Error>(())
//! ```

mod report;
mod run;
mod slot;
mod tally;
mod workload;

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use kvx_core::{Clock, Result, TransferAgent, TransferMode};
use kvx_loopback::Fabric;

use crate::chaos::Faults;
use crate::sim::{HandshakeFaults, ModelSpec, SimBackend};

pub use report::{Aborts, InjectedFaults, Lost, ProtocolCounts, SoakReport};

/// What a soak runs.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// Requests to run.
    pub requests: u64,
    /// The seed of everything random: the workload, the faults, the nonces.
    pub seed: u64,
    /// Prefill engines.
    pub prefills: usize,
    /// Decode engines.
    pub decodes: usize,
    /// Tensor-parallel ranks of every engine.
    pub tp: u32,
    /// KV blocks in each engine's pool.
    pub num_blocks: u32,
    /// The model.
    pub model: ModelSpec,
    /// Prompt lengths, in tokens (uniform).
    pub prompt_len: RangeInclusive<usize>,
    /// Tokens each request generates on the decode engine (uniform).
    pub max_new_tokens: RangeInclusive<usize>,
    /// Simulated time of one engine step.
    pub step_time: Duration,
    /// Mean time between arrivals (each gap is uniform in `0..=2 * mean`).
    pub mean_arrival_gap: Duration,
    /// The longest a client takes to hand a prefill engine's params to a decode engine.
    pub max_client_delay: Duration,
    /// How long prefill engines hold blocks for a reader.
    pub lease: Duration,
    /// The workers' handshake timeout.
    pub handshake_timeout: Duration,
    /// Chance that a decode engine (each start) recomputes the requests whose loads failed; the
    /// others fail them.
    pub recompute: f64,
    /// How long the run may go on once every request arrived, in simulated time; requests
    /// still live then are unresolved.
    pub max_drain: Duration,
    /// The faults.
    pub faults: FaultRates,
    /// Pull: a request goes to its prefill engine, and its params to a decode engine. Push: both
    /// legs go out at its arrival, the decode leg naming the prefill engine; the transport's
    /// faults then strike registrations (lost, doubled, late), WRITEs (failed, late) and
    /// results.
    pub mode: TransferMode,
}

impl SoakConfig {
    /// `requests` requests with seed `seed`: 2 prefill and 2 decode engines of TP=2, a small model
    /// (2 layers, 4 KV heads of 8, 16-token blocks), 1024 blocks a pool, prompts of 8 to 256
    /// tokens, 1 to 6 new tokens, 10 ms steps, an arrival every 5 ms on average, a 30 s lease,
    /// 5 s handshakes, half the decode engines recomputing, 10 minutes to drain, and
    /// [`FaultRates::default`].
    pub fn new(requests: u64, seed: u64) -> Self {
        SoakConfig {
            requests,
            seed,
            prefills: 2,
            decodes: 2,
            tp: 2,
            num_blocks: 1024,
            model: ModelSpec::standard(2, 4, 8, 16),
            prompt_len: 8..=256,
            max_new_tokens: 1..=6,
            step_time: Duration::from_millis(10),
            mean_arrival_gap: Duration::from_millis(5),
            max_client_delay: Duration::from_millis(50),
            lease: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(5),
            recompute: 0.5,
            max_drain: Duration::from_secs(600),
            faults: FaultRates::default(),
            mode: TransferMode::Pull,
        }
    }
}

/// How often each fault strikes. Chances are per event: per READ, per notification, per
/// handshake fetch, per request, or per arrival for restarts and stalls (which also happen once
/// each at a quarter, half and three quarters of the arrivals unless their chance is zero).
#[derive(Debug, Clone, PartialEq)]
pub struct FaultRates {
    /// A READ fails.
    pub transfer_failure: f64,
    /// A READ completes late, by up to `max_transfer_delay`.
    pub transfer_delay: f64,
    /// The longest late READ.
    pub max_transfer_delay: Duration,
    /// A notification is lost.
    pub notification_drop: f64,
    /// A notification arrives twice.
    pub notification_duplicate: f64,
    /// A notification arrives late, by up to `max_notification_delay`.
    pub notification_delay: f64,
    /// The longest late notification.
    pub max_notification_delay: Duration,
    /// A stray notification follows one: garbage, an unknown request's release, a forged nonce.
    pub stray_notification: f64,
    /// A handshake fetch is refused.
    pub handshake_refusal: f64,
    /// A handshake fetch is answered late, by up to `max_handshake_delay`.
    pub handshake_delay: f64,
    /// The longest late handshake answer.
    pub max_handshake_delay: Duration,
    /// A handshake fetch is never answered (the worker's handshake timeout ends it).
    pub handshake_silence: f64,
    /// A client aborts its request, up to `max_abort_delay` after it arrived.
    pub abort: f64,
    /// The latest abort.
    pub max_abort_delay: Duration,
    /// A client loses the prefill engine's params and never reaches a decode engine.
    pub lost_handoff: f64,
    /// A prefill engine restarts (per arrival).
    pub prefill_restart: f64,
    /// A decode engine restarts (per arrival).
    pub decode_restart: f64,
    /// A decode engine's steps stall for a lease and up to `max_stall_beyond_lease` more (per
    /// arrival).
    pub decode_stall: f64,
    /// The longest stall beyond a lease.
    pub max_stall_beyond_lease: Duration,
    /// The longest time a restarting engine is down.
    pub max_downtime: Duration,
}

impl FaultRates {
    /// The [`Chaos`](crate::chaos::Chaos) layer's faults at these rates, seeded with `seed`.
    fn transport(&self, seed: u64) -> Faults {
        Faults::none()
            .seed(seed)
            .transfer_failures(self.transfer_failure)
            .transfer_delays(self.transfer_delay, self.max_transfer_delay)
            .notification_drops(self.notification_drop)
            .notification_duplicates(self.notification_duplicate)
            .notification_delays(self.notification_delay, self.max_notification_delay)
            .stray_notifications(self.stray_notification)
    }

    /// The in-process side channels' faults at these rates, in `clock`'s time, seeded with `seed`.
    fn side_channel(&self, clock: Arc<dyn Clock>, seed: u64) -> HandshakeFaults {
        HandshakeFaults {
            clock,
            seed,
            refuse: self.handshake_refusal,
            delay: self.handshake_delay,
            max_delay: self.max_handshake_delay,
            silent: self.handshake_silence,
        }
    }

    /// No faults at all.
    pub fn none() -> Self {
        FaultRates {
            transfer_failure: 0.0,
            transfer_delay: 0.0,
            max_transfer_delay: Duration::ZERO,
            notification_drop: 0.0,
            notification_duplicate: 0.0,
            notification_delay: 0.0,
            max_notification_delay: Duration::ZERO,
            stray_notification: 0.0,
            handshake_refusal: 0.0,
            handshake_delay: 0.0,
            max_handshake_delay: Duration::ZERO,
            handshake_silence: 0.0,
            abort: 0.0,
            max_abort_delay: Duration::ZERO,
            lost_handoff: 0.0,
            prefill_restart: 0.0,
            decode_restart: 0.0,
            decode_stall: 0.0,
            max_stall_beyond_lease: Duration::ZERO,
            max_downtime: Duration::ZERO,
        }
    }
}

impl Default for FaultRates {
    /// 1% failed READs, 3% late ones (up to 2 s); 1% lost, 1% doubled, 2% late (up to 1 s) and
    /// 1% stray notifications; 10% refused, 10% late (up to 3 s) and 5% unanswered handshakes; 5%
    /// of requests aborted (within 100 ms), 1% of
    /// params lost; a prefill and a decode restart every 20 000
    /// arrivals and a decode stall (up to 10 s beyond the lease) every 50 000 (about every 100 and
    /// 250 s of simulated time), each engine down for up to 1 s.
    fn default() -> Self {
        FaultRates {
            transfer_failure: 0.01,
            transfer_delay: 0.03,
            max_transfer_delay: Duration::from_secs(2),
            notification_drop: 0.01,
            notification_duplicate: 0.01,
            notification_delay: 0.02,
            max_notification_delay: Duration::from_secs(1),
            stray_notification: 0.01,
            handshake_refusal: 0.1,
            handshake_delay: 0.1,
            max_handshake_delay: Duration::from_secs(3),
            handshake_silence: 0.05,
            abort: 0.05,
            max_abort_delay: Duration::from_millis(100),
            lost_handoff: 0.01,
            prefill_restart: 0.00005,
            decode_restart: 0.00005,
            decode_stall: 0.00002,
            max_stall_beyond_lease: Duration::from_secs(10),
            max_downtime: Duration::from_secs(1),
        }
    }
}

/// Runs a soak on the loopback backend and reports what happened. An `Err` means the soak could
/// not run (an engine did not start); whatever went wrong inside the run is in the report.
pub fn run_soak(config: &SoakConfig) -> Result<SoakReport> {
    let fabric = Fabric::new();
    let backend = SimBackend::new(move |engine, rank| {
        Ok(Arc::new(fabric.agent(format!("{engine}-{rank}"))?) as Arc<dyn TransferAgent>)
    });
    run_soak_on(config, &backend)
}

/// Runs a soak on `backend` (its agents wrapped in the [`Chaos`](crate::chaos::Chaos) layer) and
/// reports what happened, as [`run_soak`]. The backend must let an engine's agents go when the
/// engine is dropped (a restarted engine takes their names again).
pub fn run_soak_on(config: &SoakConfig, backend: &SimBackend) -> Result<SoakReport> {
    run::Soak::new(config, backend)?.run()
}
