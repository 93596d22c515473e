//! [`Cluster`]: prefill engines, decode engines and the router between them.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{Clock, Error, ErrorKind, ManualClock, RequestId, Result, TransferMode, TransferParams};
use kvx_net::Handshakes;

use super::config::{EngineConfig, RequestState};
use super::engine::SimEngine;
use super::side_channel::InProcessSideChannels;
use crate::chaos::ChaosNet;

/// A request a client hands the decode engine: id, prompt, tokens to generate, params.
pub type ClientRequest = (RequestId, Vec<u32>, usize, TransferParams);

/// What a client does with a prefill engine's params before the decode engine gets them: the
/// requests it submits instead (for tests of hostile clients: forged, replayed or edited params).
pub type ClientHook = Box<dyn FnMut(ClientRequest) -> Vec<ClientRequest> + Send>;

/// When something outside the engines happens next on a [`SimTime`]'s clock (a chaos net's
/// transfers in flight and late notifications, an in-process side channel's late answers);
/// `None` when nothing waits.
pub type NextEvent = Arc<dyn Fn() -> Result<Option<Instant>> + Send + Sync>;

/// Simulated time for a [`Cluster`]: the manual clock its engines (and their fabric and side
/// channels) run on, moved by the cluster itself. Each step moves it `step` forward; after a step
/// that leaves no engine with work ([`SimEngine::is_busy`]), it moves at once to the earliest
/// deadline of an engine or event, so a lease or a timeout is waited out in steps, not in wall
/// time.
///
/// Only for engines whose handshakes are done on the step thread, in the clock's time: in-process
/// side channels and [`Handshakes::OnStepThread`](kvx_net::Handshakes). Over TCP side channels,
/// simulated time would pass while a handshake is still on its way. Transfers may use a real
/// transport: time is real for the transfer itself, and while one is in flight an engine is busy
/// (and a [`ChaosNet`] reports it), so the clock moves a step at a time then, never jumping past
/// its completion.
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

    /// Time for engines whose agents are on `chaos` (a net of `clock`) and on the in-process side
    /// channels `net`, `step` per cluster step: never moved past the transfers in flight and late
    /// notifications of the net or the side channels' late answers.
    pub fn chaos(clock: ManualClock, step: Duration, chaos: &ChaosNet, net: &InProcessSideChannels) -> Self {
        let (chaos, net) = (chaos.clone(), net.clone());
        SimTime::new(clock, step)
            .with_events(move || chaos.next_event())
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

/// Prefill engines feeding decode engines through a router, as a disaggregated deployment (xPyD)
/// runs: a request goes with `do_remote_decode` to the prefill engine with the fewest outstanding
/// requests; when that engine hands back its params, the router submits the request with them to
/// the decode engine with the fewest outstanding requests. Ties go round robin.
///
/// A request is outstanding at its prefill engine until its params come back (or it ends there
/// without any: aborted or failed), and at its decode engine until it finishes or fails there.
pub struct Cluster {
    /// The prefill engines.
    pub prefills: Vec<SimEngine>,
    /// The decode engines.
    pub decodes: Vec<SimEngine>,
    /// Requests at a prefill engine: the engine's index, prompt and tokens to generate.
    in_prefill: HashMap<RequestId, (usize, Vec<u32>, usize)>,
    /// Requests the router handed to a decode engine, and its index.
    in_decode: HashMap<RequestId, usize>,
    /// Where the next round-robin scan for the least-loaded prefill and decode engine starts.
    next: (usize, usize),
    client: Option<ClientHook>,
    /// Simulated time, or `None`: the engines' clocks move on their own.
    time: Option<SimTime>,
    /// Pull: the decode leg goes out with the prefill engine's params. Push: both legs go out at
    /// once.
    mode: TransferMode,
}

/// Whether a request is over at an engine: it finished or failed, or the engine no longer knows
/// it (it was [taken](SimEngine::take_ended), or the engine was replaced).
fn is_over(state: Option<&RequestState>) -> bool {
    !matches!(state, Some(RequestState::Waiting | RequestState::WaitingForRemoteKv | RequestState::Running))
}

/// Requests per engine of `engines`, from the engine index of each outstanding request.
fn count(engines: usize, outstanding: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut counts = vec![0; engines];
    for engine in outstanding {
        if let Some(n) = counts.get_mut(engine) {
            *n += 1;
        }
    }
    counts
}

/// The engine with the fewest requests of `counts`; on a tie the first from `start` on (round
/// robin); `None` when there is no engine.
fn least_outstanding(counts: &[usize], start: usize) -> Option<usize> {
    let n = counts.len();
    (0..n).map(|i| (start + i) % n).min_by_key(|&i| counts[i])
}

impl Cluster {
    /// A cluster of at least one prefill engine and a decode engine.
    pub fn new(prefills: Vec<SimEngine>, decode: SimEngine) -> Result<Self> {
        Cluster::xpyd(prefills, vec![decode])
    }

    /// A cluster of at least one prefill engine and at least one decode engine.
    pub fn xpyd(prefills: Vec<SimEngine>, decodes: Vec<SimEngine>) -> Result<Self> {
        if prefills.is_empty() || decodes.is_empty() {
            return Err(Error::invalid_argument("a cluster needs a prefill and a decode engine"));
        }
        Ok(Cluster {
            prefills,
            decodes,
            in_prefill: HashMap::new(),
            in_decode: HashMap::new(),
            next: (0, 0),
            client: None,
            time: None,
            mode: TransferMode::Pull,
        })
    }

    /// Moves KV by `mode`: [`TransferMode::Push`] dispatches both legs of a request at once (the
    /// decode engine gets the prefill engine's coordinates from the router, as vLLM's router
    /// hands them out), and the prefill engine's params go nowhere.
    pub fn with_mode(mut self, mode: TransferMode) -> Self {
        self.mode = mode;
        self
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

    /// Every engine: the prefill engines, then the decode engines.
    pub fn engines(&self) -> impl Iterator<Item = &SimEngine> {
        self.prefills.iter().chain(&self.decodes)
    }

    /// Routes every prefill engine's params through `hook` (a client between the engines): the
    /// decode engines get the requests it returns.
    pub fn with_client(
        mut self,
        hook: impl FnMut(ClientRequest) -> Vec<ClientRequest> + Send + 'static,
    ) -> Self {
        self.client = Some(Box::new(hook));
        self
    }

    /// Requests outstanding at each prefill engine, by index.
    pub fn prefill_outstanding(&self) -> Vec<usize> {
        count(self.prefills.len(), self.in_prefill.values().map(|r| r.0))
    }

    /// Requests outstanding at each decode engine, by index (those the router handed it).
    pub fn decode_outstanding(&self) -> Vec<usize> {
        count(self.decodes.len(), self.in_decode.values().copied())
    }

    /// Sends a request to the prefill engine with the fewest outstanding requests; a decode engine
    /// generates `max_new_tokens`.
    pub fn submit(&mut self, id: RequestId, prompt: Vec<u32>, max_new_tokens: usize) -> Result<()> {
        let Some(p) = least_outstanding(&self.prefill_outstanding(), self.next.0) else {
            return Err(Error::new(ErrorKind::State, "the cluster has no prefill engine"));
        };
        if self.in_prefill.contains_key(&id) || self.in_decode.contains_key(&id) {
            return Err(Error::invalid_argument(format!("request {id} is already in the cluster")));
        }
        if self.mode == TransferMode::Push {
            self.prefills[p].add_request(id.clone(), &prompt, 1, Some(TransferParams::for_push_prefill()))?;
            self.next.0 = p + 1;
            let prefill = &self.prefills[p];
            let params = TransferParams::for_push(
                prefill.coordinates().clone(),
                id.clone(),
                Some(prefill.config().tp),
            );
            self.in_prefill.insert(id.clone(), (p, Vec::new(), 0));
            return self.route_to_decode((id, prompt, max_new_tokens, params));
        }
        let params = TransferParams { do_remote_decode: true, ..Default::default() };
        self.prefills[p].add_request(id.clone(), &prompt, 1, Some(params))?;
        self.next.0 = p + 1;
        self.in_prefill.insert(id, (p, prompt, max_new_tokens));
        Ok(())
    }

    /// Aborts a request wherever the router sent it last (as a client disconnect does): it is no
    /// longer outstanding there (in push mode: at both engines). A request the cluster does not
    /// know is left alone.
    pub fn abort(&mut self, id: &RequestId) {
        if let Some(&d) = self.in_decode.get(id) {
            if let Some(e) = self.decodes.get_mut(d) {
                e.abort(id);
            }
        }
        let both = self.mode == TransferMode::Push;
        if both || !self.in_decode.contains_key(id) {
            if let Some(&(p, ..)) = self.in_prefill.get(id) {
                if let Some(e) = self.prefills.get_mut(p) {
                    e.abort(id);
                }
            }
        }
        self.forget_ended();
    }

    /// Hands a request with its params to the decode engine with the fewest outstanding requests.
    fn route_to_decode(&mut self, (id, prompt, max_new_tokens, params): ClientRequest) -> Result<()> {
        let Some(d) = least_outstanding(&self.decode_outstanding(), self.next.1) else {
            return Err(Error::new(ErrorKind::State, "the cluster has no decode engine"));
        };
        self.decodes[d].add_request(id.clone(), &prompt, max_new_tokens, Some(params))?;
        self.next.1 = d + 1;
        self.in_decode.insert(id, d);
        Ok(())
    }

    /// Steps every engine once and routes finished prefills to the decode engines; in simulated
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
        for p in 0..self.prefills.len() {
            self.prefills[p].step()?;
            for (id, params) in self.prefills[p].take_transfer_params() {
                let Some((_, prompt, max_new_tokens)) = self.in_prefill.remove(&id) else {
                    return Err(Error::new(ErrorKind::State, format!("params for unknown request {id}")));
                };
                if self.mode == TransferMode::Push {
                    // Its decode leg went out with the prompt.
                    continue;
                }
                let request = (id, prompt, max_new_tokens, params);
                let requests = match &mut self.client {
                    Some(hook) => hook(request),
                    None => vec![request],
                };
                for request in requests {
                    self.route_to_decode(request)?;
                }
            }
        }
        for decode in &mut self.decodes {
            decode.step()?;
        }
        self.forget_ended();
        Ok(())
    }

    /// Drops from the outstanding requests those that ended without params at their prefill
    /// engine (aborted or failed there) and those that ended at their decode engine.
    fn forget_ended(&mut self) {
        let (prefills, decodes) = (&self.prefills, &self.decodes);
        self.in_prefill.retain(|id, (p, ..)| !is_over(prefills.get(*p).and_then(|e| e.state(id))));
        self.in_decode.retain(|id, d| !is_over(decodes.get(*d).and_then(|e| e.state(id))));
    }

    /// Whether every request went through and every engine is idle.
    pub fn is_idle(&self) -> bool {
        self.in_prefill.is_empty() && self.in_decode.is_empty() && self.engines().all(SimEngine::is_idle)
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
            .field("decodes", &self.decodes)
            .field("in_prefill", &self.in_prefill.len())
            .field("in_decode", &self.in_decode.len())
            .field("client", &self.client.is_some())
            .field("time", &self.time)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_outstanding_engine_wins_and_ties_go_round_robin() {
        let counts = count(3, [0, 0, 2, 0, 2].into_iter());
        assert_eq!(counts, [3, 0, 2]);
        assert_eq!(least_outstanding(&counts, 0), Some(1));
        assert_eq!(least_outstanding(&counts, 2), Some(1));
        assert_eq!(least_outstanding(&[1, 0, 0], 0), Some(1));
        assert_eq!(least_outstanding(&[1, 0, 0], 2), Some(2));
        assert_eq!(least_outstanding(&[0, 0, 0], 4), Some(1));
        assert_eq!(least_outstanding(&[], 0), None);
        // An index past the engines (one that was removed) counts nowhere.
        assert_eq!(count(2, [5, 1].into_iter()), [0, 1]);
    }
}
