//! [`Cluster`]: prefill engines, one decode engine and the router between them.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{Clock, Error, ErrorKind, Handshakes, ManualClock, RequestId, Result, TransferParams};
use kvx_loopback::Fabric;

use super::config::EngineConfig;
use super::engine::SimEngine;
use super::side_channel::InProcessSideChannels;

/// A request a client hands the decode engine: id, prompt, tokens to generate, params.
pub type ClientRequest = (RequestId, Vec<u32>, usize, TransferParams);

/// What a client does with a prefill engine's params before the decode engine gets them: the
/// requests it submits instead (for tests of hostile clients: forged, replayed or edited params).
pub type ClientHook = Box<dyn FnMut(ClientRequest) -> Vec<ClientRequest> + Send>;

/// When something outside the engines happens next on a [`SimTime`]'s clock (the loopback
/// fabric's delayed transfers and notifications, an in-process side channel's late answers);
/// `None` when nothing waits.
pub type NextEvent = Arc<dyn Fn() -> Result<Option<Instant>> + Send + Sync>;

/// Simulated time for a [`Cluster`]: the manual clock its engines (and their fabric and side
/// channels) run on, moved by the cluster itself. Each step moves it `step` forward; after a step
/// that leaves no engine with work ([`SimEngine::is_busy`]), it moves at once to the earliest
/// deadline of an engine or event, so a lease or a timeout is waited out in steps, not in wall
/// time.
///
/// Only for engines whose network work is done on the step thread, in the clock's time: the
/// loopback backend on a fabric of this clock, in-process side channels, and
/// [`Handshakes::OnStepThread`](kvx_core::Handshakes). Over a real transport or TCP side
/// channels, simulated time would pass while a transfer or a handshake is still on its way.
#[derive(Clone)]
pub struct SimTime {
    clock: ManualClock,
    step: Duration,
    events: Vec<NextEvent>,
}

impl SimTime {
    /// Time on `clock`, `step` of it per cluster step.
    pub fn new(clock: ManualClock, step: Duration) -> Self {
        SimTime { clock, step, events: Vec::new() }
    }

    /// The same time, never moved past what `next_event` says is due.
    pub fn with_events(
        mut self,
        next_event: impl Fn() -> Result<Option<Instant>> + Send + Sync + 'static,
    ) -> Self {
        self.events.push(Arc::new(next_event));
        self
    }

    /// Time for engines on the loopback `fabric` of `clock` and the in-process side channels
    /// `net`, `step` per cluster step: never moved past the fabric's delayed transfers and
    /// notifications or the side channels' late answers.
    pub fn loopback(
        clock: ManualClock,
        step: Duration,
        fabric: &Fabric,
        net: &InProcessSideChannels,
    ) -> Self {
        let (fabric, net) = (fabric.clone(), net.clone());
        SimTime::new(clock, step)
            .with_events(move || fabric.next_event())
            .with_events(move || net.next_event())
    }

    /// The clock.
    pub fn clock(&self) -> &ManualClock {
        &self.clock
    }

    /// `config` on this time: the clock, and handshakes polled on the step thread.
    pub fn configure(&self, config: EngineConfig) -> EngineConfig {
        EngineConfig { clock: Arc::new(self.clock.clone()), handshakes: Handshakes::OnStepThread, ..config }
    }

    /// Moves the clock after a step: `step` forward, or to the earliest of `deadlines` and the
    /// events when `idle` and that is later.
    fn advance(&self, idle: bool, deadlines: impl Iterator<Item = Instant>) -> Result<()> {
        let now = self.clock.now();
        let mut next = now + self.step;
        if idle {
            let mut due = deadlines.min();
            for event in &self.events {
                due = due.into_iter().chain(event()?).min();
            }
            next = next.max(due.unwrap_or(next));
        }
        self.clock.advance_to(next);
        Ok(())
    }
}

impl fmt::Debug for SimTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimTime")
            .field("elapsed", &self.clock.elapsed())
            .field("step", &self.step)
            .field("events", &self.events.len())
            .finish()
    }
}

/// Prefill engines feeding one decode engine through a router, as a disaggregated deployment
/// runs: a request goes to a prefill engine (round robin) with `do_remote_decode`; when that
/// engine hands back its params, the router submits the request with them to the decode engine.
pub struct Cluster {
    /// The prefill engines.
    pub prefills: Vec<SimEngine>,
    /// The decode engine.
    pub decode: SimEngine,
    /// Requests not yet handed to the decode engine: prompt and tokens to generate.
    in_prefill: HashMap<RequestId, (Vec<u32>, usize)>,
    next_prefill: usize,
    client: Option<ClientHook>,
    /// Simulated time, or `None`: the engines' clocks move on their own.
    time: Option<SimTime>,
}

impl Cluster {
    /// A cluster of at least one prefill engine and a decode engine.
    pub fn new(prefills: Vec<SimEngine>, decode: SimEngine) -> Result<Self> {
        if prefills.is_empty() {
            return Err(Error::invalid_argument("a cluster needs a prefill engine"));
        }
        Ok(Cluster {
            prefills,
            decode,
            in_prefill: HashMap::new(),
            next_prefill: 0,
            client: None,
            time: None,
        })
    }

    /// Runs the cluster in simulated time: every engine must run on `time`'s clock
    /// ([`EngineConfig::clock`](super::EngineConfig::clock)), as must the engines that later join.
    pub fn with_sim_time(mut self, time: SimTime) -> Result<Self> {
        let now = time.clock.now();
        if let Some(e) = self.engines().find(|e| e.config().clock.now() != now) {
            return Err(Error::invalid_argument(format!(
                "engine {} does not run on the simulated clock",
                e.engine_id()
            )));
        }
        self.time = Some(time);
        Ok(self)
    }

    fn engines(&self) -> impl Iterator<Item = &SimEngine> {
        self.prefills.iter().chain([&self.decode])
    }

    /// Routes every prefill engine's params through `hook` (a client between the engines): the
    /// decode engine gets the requests it returns.
    pub fn with_client(
        mut self,
        hook: impl FnMut(ClientRequest) -> Vec<ClientRequest> + Send + 'static,
    ) -> Self {
        self.client = Some(Box::new(hook));
        self
    }

    /// Sends a request to the next prefill engine; the decode engine generates `max_new_tokens`.
    pub fn submit(&mut self, id: RequestId, prompt: Vec<u32>, max_new_tokens: usize) -> Result<()> {
        let n = self.prefills.len();
        let engine = &mut self.prefills[self.next_prefill % n];
        self.next_prefill += 1;
        let params = TransferParams { do_remote_decode: true, ..Default::default() };
        engine.add_request(id.clone(), &prompt, 1, Some(params))?;
        self.in_prefill.insert(id, (prompt, max_new_tokens));
        Ok(())
    }

    /// Steps every engine once and routes finished prefills to the decode engine; in simulated
    /// time, then moves the clock (see [`SimTime`]).
    pub fn step(&mut self) -> Result<()> {
        self.step_engines()?;
        match &self.time {
            Some(time) => {
                let idle = !self.engines().any(SimEngine::is_busy);
                time.advance(idle, self.engines().filter_map(SimEngine::next_deadline))
            }
            None => Ok(()),
        }
    }

    fn step_engines(&mut self) -> Result<()> {
        for engine in &mut self.prefills {
            engine.step()?;
            for (id, params) in engine.take_transfer_params() {
                let Some((prompt, max_new_tokens)) = self.in_prefill.remove(&id) else {
                    return Err(Error::new(ErrorKind::State, format!("params for unknown request {id}")));
                };
                let request = (id, prompt, max_new_tokens, params);
                let requests = match &mut self.client {
                    Some(hook) => hook(request),
                    None => vec![request],
                };
                for (id, prompt, max_new_tokens, params) in requests {
                    self.decode.add_request(id, &prompt, max_new_tokens, Some(params))?;
                }
            }
        }
        self.decode.step()
    }

    /// Whether every request went through and every engine is idle.
    pub fn is_idle(&self) -> bool {
        self.in_prefill.is_empty() && self.engines().all(SimEngine::is_idle)
    }

    /// Steps until idle, calling `on_step` after each step; a `Timeout` error after `limit` of
    /// wall time, a bound on a failing run only (in simulated time the leases and timeouts the run
    /// waits out cost steps, not wall time). Yields the thread between steps, so that handshakes
    /// on the engines' runtimes go on.
    pub fn run_until_idle_with(&mut self, limit: Duration, mut on_step: impl FnMut(&Cluster)) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            self.step()?;
            on_step(self);
            if self.is_idle() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("cluster not idle after {limit:?}: {self:?}"),
                ));
            }
            std::thread::yield_now();
        }
    }

    /// Steps until idle; a `Timeout` error after `limit`.
    pub fn run_until_idle(&mut self, limit: Duration) -> Result<()> {
        self.run_until_idle_with(limit, |_| {})
    }

    /// Blocks not free in any engine's pool (0 once idle, unless something leaked).
    pub fn blocks_in_use(&self) -> usize {
        self.engines().map(|e| e.pool().num_blocks() as usize - e.pool().num_free()).sum()
    }
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("prefills", &self.prefills)
            .field("decode", &self.decode)
            .field("in_prefill", &self.in_prefill.len())
            .field("client", &self.client.is_some())
            .field("time", &self.time)
            .finish()
    }
}
