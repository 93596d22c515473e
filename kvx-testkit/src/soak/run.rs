//! The soak's run: engines in slots that restart, each request from its arrival to its end, and
//! the clock.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{Clock, FinishReason, ManualClock, RequestId, Result, TransferMode, TransferParams};
use kvx_net::Handshakes;

use super::SoakConfig;
use super::report::{InjectedFaults, SoakReport};
use super::slot::{Slot, panic_message};
use super::tally::{AbortStage, Outcome, Role, Tally};
use super::workload::{plan, request_id};
use crate::chaos::ChaosNet;
use crate::sim::{
    EndedRequest, EngineConfig, InProcessSideChannels, LoadFailurePolicy, RequestState, SideChannel,
    SimBackend, SimEngine, SimRng,
};

/// Streams of the seed besides the requests' own (request `n` draws from stream `n`).
const ARRIVALS: u64 = u64::MAX;
const CHAOS: u64 = u64::MAX - 1;
const STARTS: u64 = u64::MAX - 2;
const FAULTS: u64 = u64::MAX - 3;
/// Where a live request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Prefill(usize),
    /// Params on their way to a decode engine, arriving at this time.
    Handoff(Instant),
    Decode(usize),
    /// Push: at both engines at once (its prefill leg until it ends there). The request ends
    /// with its decode leg.
    Both {
        prefill: Option<usize>,
        decode: usize,
    },
}

#[derive(Debug)]
struct Live {
    n: u64,
    arrived: Instant,
    place: Place,
    aborting: Option<AbortStage>,
}

/// A soak in progress.
pub(super) struct Soak<'c> {
    cfg: &'c SoakConfig,
    clock: ManualClock,
    transport: ChaosNet,
    net: InProcessSideChannels,
    backend: SimBackend,
    slots: Vec<Slot>,
    live: HashMap<RequestId, Live>,
    /// Params on their way to a decode engine, by arrival time.
    handoffs: BTreeMap<(Instant, u64), TransferParams>,
    /// Client aborts, by time.
    aborts: BTreeSet<(Instant, u64)>,
    arrived: u64,
    next_arrival: Instant,
    arrivals: SimRng,
    chaos: SimRng,
    starts: SimRng,
    tally: Tally,
}

impl<'c> Soak<'c> {
    pub(super) fn new(cfg: &'c SoakConfig, backend: &SimBackend) -> Result<Self> {
        let clock = ManualClock::new();
        let mut seeds = SimRng::stream(cfg.seed, FAULTS);
        let chaos = ChaosNet::with_clock(Arc::new(clock.clone()));
        chaos.set_faults(cfg.faults.transport(seeds.next_u64()))?;
        let side_channel_faults = cfg.faults.side_channel(Arc::new(clock.clone()), seeds.next_u64());
        let net = InProcessSideChannels::with_faults(side_channel_faults);
        let backend = chaos.backend(backend.clone());
        let slot = |role, index| Slot {
            role,
            index,
            engine: None,
            port: None,
            down_until: None,
            stalled_until: None,
        };
        let slots = (0..cfg.prefills)
            .map(|i| slot(Role::Prefill, i))
            .chain((0..cfg.decodes).map(|i| slot(Role::Decode, i)))
            .collect();
        let mut soak = Soak {
            cfg,
            next_arrival: clock.now(),
            clock,
            transport: chaos,
            net,
            backend,
            slots,
            live: HashMap::new(),
            handoffs: BTreeMap::new(),
            aborts: BTreeSet::new(),
            arrived: 0,
            arrivals: SimRng::stream(cfg.seed, ARRIVALS),
            chaos: SimRng::stream(cfg.seed, CHAOS),
            starts: SimRng::stream(cfg.seed, STARTS),
            tally: Tally::new(cfg.requests),
        };
        for s in 0..soak.slots.len() {
            soak.start(s)?;
        }
        Ok(soak)
    }

    pub(super) fn run(mut self) -> Result<SoakReport> {
        let mut drain_started = None;
        loop {
            self.round();
            if self.is_done() {
                break;
            }
            if self.arrived == self.cfg.requests {
                let now = self.clock.now();
                let since = *drain_started.get_or_insert(now);
                if now.saturating_duration_since(since) > self.cfg.max_drain {
                    break;
                }
            }
        }
        self.finish()
    }

    fn slot_index(&self, role: Role, index: usize) -> usize {
        match role {
            Role::Prefill => index,
            Role::Decode => self.cfg.prefills + index,
        }
    }

    fn first_slot(&self, role: Role) -> usize {
        self.slot_index(role, 0)
    }

    fn count(&self, role: Role) -> usize {
        match role {
            Role::Prefill => self.cfg.prefills,
            Role::Decode => self.cfg.decodes,
        }
    }

    /// Starts the engine of slot `s`, on the side-channel ports of its earlier starts.
    fn start(&mut self, s: usize) -> Result<()> {
        let cfg = self.cfg;
        let recompute = self.starts.chance(cfg.recompute);
        let seed = self.starts.next_u64();
        let slot = &mut self.slots[s];
        let load_failure = match slot.role {
            Role::Decode if recompute => LoadFailurePolicy::Recompute,
            _ => LoadFailurePolicy::Fail,
        };
        let config = EngineConfig {
            engine_id: slot.name().into(),
            tp: cfg.tp,
            num_blocks: cfg.num_blocks,
            model: cfg.model.clone(),
            side_channel: SideChannel::InProcess(self.net.clone()),
            auth_key: None,
            handshake_timeout: cfg.handshake_timeout,
            lease_duration: cfg.lease,
            clock: Arc::new(self.clock.clone()),
            handshakes: Handshakes::OnStepThread,
            seed: Some(seed),
            load_failure,
            side_channel_port: slot.port,
        };
        let engine = SimEngine::new(config, &self.backend)?;
        slot.port = Some(engine.side_channel_port());
        slot.engine = Some(engine);
        slot.down_until = None;
        Ok(())
    }

    /// Takes slot `s`'s engine down until `until`: its requests are lost, what it counted is kept.
    fn take_down(&mut self, s: usize, until: Instant) {
        let slot = &mut self.slots[s];
        let Some(engine) = slot.engine.take() else { return };
        slot.down_until = Some(until);
        slot.stalled_until = None;
        let (role, index) = (slot.role, slot.index);
        self.tally.retire(&engine);
        drop(engine);
        // A push whose prefill engine went down goes on at its decode engine, whose load fails.
        for live in self.live.values_mut() {
            if let Place::Both { prefill, .. } = &mut live.place {
                if role == Role::Prefill && *prefill == Some(index) {
                    *prefill = None;
                }
            }
        }
        let lost: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, l)| match (role, l.place) {
                (Role::Prefill, Place::Prefill(i))
                | (Role::Decode, Place::Decode(i))
                | (Role::Decode, Place::Both { decode: i, .. }) => i == index,
                _ => false,
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in lost {
            self.resolve(&id, Outcome::Lost(role));
        }
    }

    fn round(&mut self) {
        self.tally.rounds += 1;
        self.bring_up();
        self.arrive();
        self.abort_due();
        for s in self.first_slot(Role::Prefill)..self.first_slot(Role::Prefill) + self.cfg.prefills {
            self.step(s);
        }
        self.hand_over();
        for s in self.first_slot(Role::Decode)..self.first_slot(Role::Decode) + self.cfg.decodes {
            self.step(s);
        }
        self.advance_clock();
    }

    fn bring_up(&mut self) {
        let now = self.clock.now();
        for s in 0..self.slots.len() {
            if self.slots[s].down_until.is_some_and(|t| t <= now) {
                if let Err(e) = self.start(s) {
                    let name = self.slots[s].name();
                    self.tally.error(format!("{name} did not restart: {e}"));
                    self.slots[s].down_until = None;
                }
            }
        }
    }

    /// The first slot of `role` that is up, from `from` round the ring.
    fn up(&self, role: Role, from: usize) -> Option<usize> {
        let n = self.count(role);
        (0..n).map(|k| self.slot_index(role, (from + k) % n)).find(|&s| self.slots[s].engine.is_some())
    }

    fn arrive(&mut self) {
        let now = self.clock.now();
        while self.arrived < self.cfg.requests && self.next_arrival <= now {
            let n = self.arrived;
            let plan = plan(self.cfg, n);
            let Some(s) = self.up(Role::Prefill, plan.prefill) else { return };
            let push = self.cfg.mode == TransferMode::Push;
            let decode = if push {
                let Some(d) = self.up(Role::Decode, plan.decode) else { return };
                Some(d)
            } else {
                None
            };
            let params = match push {
                true => TransferParams::for_push_prefill(),
                false => TransferParams { do_remote_decode: true, ..Default::default() },
            };
            let place = match decode {
                Some(d) => Place::Both { prefill: Some(self.slots[s].index), decode: self.slots[d].index },
                None => Place::Prefill(self.slots[s].index),
            };
            self.live.insert(plan.id.clone(), Live { n, arrived: now, place, aborting: None });
            if let Some(engine) = self.slots[s].engine.as_mut() {
                if let Err(e) = engine.add_request(plan.id.clone(), &plan.prompt, 1, Some(params)) {
                    self.tally.error(format!("request {}: prefill refused it: {e}", plan.id));
                    self.resolve(&plan.id, Outcome::Failed);
                }
            }
            if let Some(d) = decode {
                self.push_decode_leg(s, d, n);
            }
            if let Some(after) = plan.abort_after {
                self.aborts.insert((now + after, n));
            }
            self.arrived += 1;
            let gap = self.arrivals.duration(Duration::ZERO, self.cfg.mean_arrival_gap * 2);
            self.next_arrival += gap;
            self.chaos(n);
        }
    }

    /// Push: the decode leg of request `n`, naming the prefill engine of slot `s`, goes to slot
    /// `d`'s engine at once (unless its client loses it: the prefill engine's hold then waits for
    /// a registration that never comes).
    fn push_decode_leg(&mut self, s: usize, d: usize, n: u64) {
        let plan = plan(self.cfg, n);
        if plan.lost_handoff {
            self.resolve(&plan.id, Outcome::Aborted(AbortStage::Handoff));
            return;
        }
        let Some(prefill) = self.slots[s].engine.as_ref() else { return };
        let params = TransferParams::for_push(
            prefill.coordinates().clone(),
            plan.id.clone(),
            Some(prefill.config().tp),
        );
        if let Some(engine) = self.slots[d].engine.as_mut() {
            if let Err(e) =
                engine.add_request(plan.id.clone(), &plan.prompt, plan.max_new_tokens, Some(params))
            {
                self.tally.error(format!("request {}: decode refused it: {e}", plan.id));
                self.resolve(&plan.id, Outcome::Failed);
            }
        }
    }

    /// Restarts and stalls, by chance at each arrival and once each at a quarter, half and three
    /// quarters of the arrivals.
    fn chaos(&mut self, n: u64) {
        let (f, q) = (&self.cfg.faults, self.cfg.requests);
        let now = self.clock.now();
        let draws = [
            (self.chaos.chance(f.prefill_restart), f.prefill_restart > 0.0 && n == q / 4),
            (self.chaos.chance(f.decode_restart), f.decode_restart > 0.0 && n == q / 2),
            (self.chaos.chance(f.decode_stall), f.decode_stall > 0.0 && n == 3 * q / 4),
        ];
        let prefill = self.chaos.below(self.cfg.prefills as u64) as usize;
        let decode = self.chaos.below(self.cfg.decodes as u64) as usize;
        let downtime = self.chaos.duration(Duration::ZERO, f.max_downtime);
        let stall = self.cfg.lease + self.chaos.duration(Duration::from_millis(1), f.max_stall_beyond_lease);
        if draws[0].0 || draws[0].1 {
            let s = self.slot_index(Role::Prefill, prefill);
            if self.slots[s].engine.is_some() {
                self.tally.faults.prefill_restarts += 1;
                self.take_down(s, now + downtime);
            }
        }
        if draws[1].0 || draws[1].1 {
            let s = self.slot_index(Role::Decode, decode);
            if self.slots[s].engine.is_some() {
                self.tally.faults.decode_restarts += 1;
                self.take_down(s, now + downtime);
            }
        }
        if draws[2].0 || draws[2].1 {
            let s = self.slot_index(Role::Decode, decode);
            if self.slots[s].engine.is_some() && self.slots[s].stalled_until.is_none_or(|t| t <= now) {
                self.tally.faults.decode_stalls += 1;
                self.slots[s].stalled_until = Some(now + stall);
            }
        }
    }

    /// Client aborts that are due, wherever their requests are. An engine whose steps stall takes
    /// its aborts when it steps again.
    fn abort_due(&mut self) {
        let now = self.clock.now();
        while let Some(&(at, n)) = self.aborts.first() {
            if at > now {
                break;
            }
            self.aborts.pop_first();
            let id = request_id(n);
            let Some(place) = self.live.get(&id).map(|l| l.place) else { continue };
            let (s, stage) = match place {
                Place::Handoff(due) => {
                    self.handoffs.remove(&(due, n));
                    self.resolve(&id, Outcome::Aborted(AbortStage::Handoff));
                    continue;
                }
                Place::Prefill(i) => (self.slot_index(Role::Prefill, i), None),
                Place::Decode(i) => (self.slot_index(Role::Decode, i), Some(())),
                // A client that goes away closes both legs; the request ends with its decode leg.
                Place::Both { prefill, decode } => {
                    let p = prefill.map(|i| self.slot_index(Role::Prefill, i));
                    if let Some(engine) = p.and_then(|p| self.slots[p].running(now)) {
                        engine.abort(&id);
                    }
                    if let Some(p) = p {
                        self.collect(p);
                    }
                    (self.slot_index(Role::Decode, decode), Some(()))
                }
            };
            if let Some(until) = self.slots[s].stalled_until.filter(|t| *t > now) {
                self.aborts.insert((until, n));
                continue;
            }
            let Some(engine) = self.slots[s].engine.as_mut() else { continue };
            let stage = match (stage, engine.state(&id)) {
                (None, _) => AbortStage::Prefill,
                (Some(()), Some(RequestState::Waiting)) => AbortStage::DecodeWaiting,
                (Some(()), Some(RequestState::WaitingForRemoteKv)) => AbortStage::DecodeLoading,
                (Some(()), _) => AbortStage::DecodeRunning,
            };
            engine.abort(&id);
            if let Some(live) = self.live.get_mut(&id) {
                live.aborting = Some(stage);
            }
            self.collect(s);
        }
    }

    /// One step of slot `s`'s engine, if it is up and not stalled, under `catch_unwind`: a panic
    /// takes the engine down as a crash.
    fn step(&mut self, s: usize) {
        let now = self.clock.now();
        let Some(engine) = self.slots[s].running(now) else { return };
        match catch_unwind(AssertUnwindSafe(|| engine.step())) {
            Ok(Ok(())) => self.collect(s),
            Ok(Err(e)) => {
                let name = self.slots[s].name();
                self.tally.error(format!("{name}: step failed: {e}"));
                self.collect(s);
            }
            Err(panic) => {
                let name = self.slots[s].name();
                self.tally.panics += 1;
                self.tally.error(format!("{name}: step panicked: {}", panic_message(panic.as_ref())));
                self.take_down(s, now);
            }
        }
    }

    /// What slot `s`'s engine ended and handed out.
    fn collect(&mut self, s: usize) {
        let role = self.slots[s].role;
        let Some(engine) = self.slots[s].engine.as_mut() else { return };
        let ended = engine.take_ended();
        let params = engine.take_transfer_params();
        for e in ended {
            self.ended(role, e);
        }
        for (id, params) in params {
            self.handed_out(&id, params);
        }
    }

    fn ended(&mut self, role: Role, e: EndedRequest) {
        let Some(live) = self.live.get_mut(&e.id) else { return };
        if let (Role::Prefill, Place::Both { prefill, .. }) = (role, &mut live.place) {
            // A push's prefill leg ended (with its blocks held, or not): the decode leg goes on.
            *prefill = None;
            return;
        }
        let live = &*live;
        let outcome = match (role, &e.state) {
            // A prefill's params follow, from the same step.
            (Role::Prefill, RequestState::Finished(FinishReason::LengthCapped | FinishReason::Stopped)) => {
                return;
            }
            (_, RequestState::Finished(FinishReason::Aborted)) => match live.aborting {
                Some(stage) => Outcome::Aborted(stage),
                None => {
                    self.tally.error(format!("request {} aborted by nobody", e.id));
                    Outcome::Failed
                }
            },
            (Role::Decode, RequestState::Finished(_)) => match &e.load_failure {
                Some(error) => {
                    self.tally.reason(Outcome::Recomputed, error);
                    Outcome::Recomputed
                }
                None => Outcome::Finished,
            },
            (_, RequestState::Failed(error)) => {
                self.tally.reason(Outcome::Failed, error);
                Outcome::Failed
            }
            (Role::Prefill, RequestState::Finished(_)) => Outcome::Failed,
            (_, state) => {
                self.tally.error(format!("request {} ended in state {state:?}", e.id));
                Outcome::Failed
            }
        };
        self.resolve(&e.id, outcome);
    }

    fn handed_out(&mut self, id: &RequestId, params: TransferParams) {
        if self.cfg.mode == TransferMode::Push {
            // Its decode leg went out with it.
            return;
        }
        let Some(n) = self.live.get(id).map(|l| l.n) else { return };
        let plan = plan(self.cfg, n);
        if plan.lost_handoff {
            self.resolve(id, Outcome::Aborted(AbortStage::Handoff));
            return;
        }
        let due = self.clock.now() + plan.client_delay;
        self.handoffs.insert((due, n), params);
        if let Some(live) = self.live.get_mut(id) {
            live.place = Place::Handoff(due);
        }
    }

    /// Params whose time has come go to their decode engine (another one when it is down).
    fn hand_over(&mut self) {
        let now = self.clock.now();
        while let Some(entry) = self.handoffs.first_entry() {
            let (due, n) = *entry.key();
            if due > now {
                break;
            }
            let params = entry.remove();
            let plan = plan(self.cfg, n);
            let Some(s) = self.up(Role::Decode, plan.decode) else {
                let later = now + self.cfg.step_time;
                self.handoffs.insert((later, n), params);
                if let Some(live) = self.live.get_mut(&plan.id) {
                    live.place = Place::Handoff(later);
                }
                break;
            };
            let index = self.slots[s].index;
            if let Some(live) = self.live.get_mut(&plan.id) {
                live.place = Place::Decode(index);
            }
            if let Some(engine) = self.slots[s].engine.as_mut() {
                if let Err(e) =
                    engine.add_request(plan.id.clone(), &plan.prompt, plan.max_new_tokens, Some(params))
                {
                    self.tally.error(format!("request {}: decode refused it: {e}", plan.id));
                    self.resolve(&plan.id, Outcome::Failed);
                }
            }
        }
    }

    fn resolve(&mut self, id: &RequestId, outcome: Outcome) {
        if let Some(live) = self.live.remove(id) {
            let took = self.clock.now().saturating_duration_since(live.arrived);
            self.tally.resolve(live.n, outcome, took);
        }
    }

    /// One step of time; when no engine has work, a jump to whatever is due first.
    fn advance_clock(&mut self) {
        let now = self.clock.now();
        let mut next = now + self.cfg.step_time;
        let busy = self.slots.iter_mut().any(|s| s.running(now).is_some_and(|e| e.is_busy()));
        if !busy {
            let transport = self.transport.next_event().unwrap_or(Some(now));
            let net = self.net.next_event().unwrap_or(Some(now));
            let arrival = (self.arrived < self.cfg.requests).then_some(self.next_arrival);
            let slots = self.slots.iter().flat_map(|s| {
                let deadline = s.engine.as_ref().and_then(SimEngine::next_deadline);
                [deadline, s.down_until, s.stalled_until.filter(|t| *t > now)]
            });
            let due = [
                transport,
                net,
                arrival,
                self.handoffs.keys().next().map(|k| k.0),
                self.aborts.first().map(|a| a.0),
            ]
            .into_iter()
            .chain(slots)
            .flatten()
            .min();
            if let Some(due) = due {
                next = next.max(due);
            }
        }
        self.clock.advance_to(next);
    }

    fn is_done(&mut self) -> bool {
        let now = self.clock.now();
        self.arrived == self.cfg.requests
            && self.live.is_empty()
            && self.handoffs.is_empty()
            && self.slots.iter().all(|s| s.down_until.is_none() && s.stalled_until.is_none_or(|t| t <= now))
            && self.slots.iter().all(|s| s.engine.as_ref().is_none_or(SimEngine::is_idle))
    }

    fn finish(mut self) -> Result<SoakReport> {
        let mut stuck: Vec<(u64, String)> = self
            .live
            .iter()
            .map(|(id, l)| {
                let state = match l.place {
                    Place::Prefill(i) => self.slots[self.slot_index(Role::Prefill, i)].engine.as_ref(),
                    Place::Decode(i) | Place::Both { decode: i, .. } => {
                        self.slots[self.slot_index(Role::Decode, i)].engine.as_ref()
                    }
                    Place::Handoff(_) => None,
                }
                .and_then(|e| e.state(id).cloned());
                (l.n, format!("{id}: {:?}, {state:?}", l.place))
            })
            .collect();
        stuck.sort();
        self.tally.unresolved_examples = stuck.into_iter().take(5).map(|(_, e)| e).collect();
        for slot in &mut self.slots {
            match slot.engine.take() {
                Some(engine) => {
                    let pool = engine.pool();
                    self.tally.blocks_leaked += u64::from(pool.num_blocks()) - pool.num_free() as u64;
                    if !engine.is_idle() {
                        self.tally.engines_not_idle += 1;
                        let why = engine.not_idle_reasons().join(", ");
                        self.tally.error(format!("{} is not idle at the end: {why}", slot.name()));
                    }
                    self.tally.retire(&engine);
                }
                None => self.tally.engines_not_idle += 1,
            }
        }
        let faults = InjectedFaults {
            transport: self.transport.fault_counts()?,
            handshakes: self.net.fault_counts()?,
            ..self.tally.faults
        };
        Ok(self.tally.report(self.cfg, faults, self.clock.elapsed()))
    }
}
