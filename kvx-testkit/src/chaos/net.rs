//! [`ChaosNet`]: the agents of the chaos layer that share faults, a clock and counts.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Instant;

use kvx_core::clock::system_clock;
use kvx_core::{AgentName, Clock, Error, ErrorKind, Result, TransferAgent};

use super::Chaos;
use super::faults::{FaultCounts, FaultPlan, Faults};
use super::state::Shared;
use crate::sim::SimBackend;

/// Locks `mutex`; a lock poisoned by a panicking thread is a `State` error, not a panic.
pub(super) fn lock<'a, T>(mutex: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>> {
    mutex.lock().map_err(|_| {
        Error::new(ErrorKind::State, format!("the chaos {what} lock is poisoned: a thread panicked"))
    })
}

/// The agents whose faults, clock and counts are shared: faults set on the net strike every
/// agent of it, and an agent that refuses handshakes is refused by every agent of it.
///
/// Cheap to clone; clones are the same net.
#[derive(Clone)]
pub struct ChaosNet {
    pub(super) inner: Arc<NetInner>,
}

pub(super) struct NetInner {
    /// The time of late transfers and notifications.
    pub(super) clock: Arc<dyn Clock>,
    pub(super) faults: Mutex<FaultPlan>,
    /// Faults injected so far, by the net's faults and its agents'.
    pub(super) injected: Mutex<FaultCounts>,
    /// The live agents, by name.
    pub(super) agents: Mutex<HashMap<AgentName, Weak<Shared>>>,
    /// How many times each notification (by its key) was sent so far: a copy sent again meets a
    /// fate of its own, as a retransmission does on a real network.
    pub(super) sent_keys: Mutex<HashMap<u64, u64>>,
}

impl ChaosNet {
    /// A net on the system clock, without faults.
    pub fn new() -> Self {
        ChaosNet::with_clock(system_clock())
    }

    /// A net whose late transfers and notifications follow `clock`: a simulation's
    /// [`ManualClock`](kvx_core::ManualClock), say.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        ChaosNet {
            inner: Arc::new(NetInner {
                clock,
                faults: Mutex::new(FaultPlan::default()),
                injected: Mutex::new(FaultCounts::default()),
                agents: Mutex::new(HashMap::new()),
                sent_keys: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Sets faults for every agent of this net, replacing earlier net faults and restarting their
    /// counts. [`Faults::none`] clears them.
    pub fn set_faults(&self, faults: Faults) -> Result<()> {
        lock(&self.inner.faults, "net faults")?.set(faults);
        Ok(())
    }

    /// Sets the faults of the live agent named `agent` (as [`Chaos::set_faults`]); a `NotFound`
    /// error when this net has none.
    pub fn set_agent_faults(&self, agent: &str, faults: Faults) -> Result<()> {
        let shared = self.live(agent)?.ok_or_else(|| {
            Error::new(ErrorKind::NotFound, format!("no live chaos agent {agent} on this net"))
        })?;
        lock(&shared.faults, "agent faults")?.set(faults);
        Ok(())
    }

    /// The faults injected so far (by the net's faults and by its agents').
    pub fn fault_counts(&self) -> Result<FaultCounts> {
        Ok(*lock(&self.inner.injected, "fault counts")?)
    }

    /// The earliest time at which an agent of this net has something to do: the clock's now when
    /// a transfer is in flight, a completion waits to be drained or a notification sent to an
    /// agent of the net has not been drained yet, else when the first late transfer or
    /// notification is due; `None` when nothing waits. A simulation on a manual clock may jump to
    /// it.
    pub fn next_event(&self) -> Result<Option<Instant>> {
        let agents: Vec<Arc<Shared>> =
            lock(&self.inner.agents, "agent table")?.values().filter_map(Weak::upgrade).collect();
        let now = self.inner.clock.now();
        let mut next = None;
        for agent in agents {
            let unread = (agent.unread.load(Ordering::Relaxed) > 0).then_some(now);
            let own = lock(&agent.state, "agent state")?.next_event(now);
            next = next.into_iter().chain(unread).chain(own).min();
        }
        Ok(next)
    }

    /// `backend` with every agent wrapped in a [`Chaos`] of this net (its memory unchanged).
    pub fn backend(&self, backend: SimBackend) -> SimBackend {
        let (net, agents) = (self.clone(), backend.clone());
        SimBackend::new(move |engine, rank| {
            Ok(Arc::new(Chaos::new(agents.agent(engine, rank)?, &net)) as Arc<dyn TransferAgent>)
        })
        .with_memory(move |engine, rank, len| backend.memory(engine, rank, len))
    }

    /// Knows `shared` as the agent `name` from now on (and forgets the dropped agents).
    pub(super) fn join(&self, name: &AgentName, shared: &Arc<Shared>) {
        // A poisoned table is still a valid map.
        let mut agents = self.inner.agents.lock().unwrap_or_else(PoisonError::into_inner);
        agents.retain(|_, w| w.strong_count() > 0);
        agents.insert(name.clone(), Arc::downgrade(shared));
    }

    /// Forgets the agent `name` when it is still `shared` (a later agent may have taken the name).
    pub(super) fn leave(&self, name: &AgentName, shared: &Arc<Shared>) {
        let mut agents = self.inner.agents.lock().unwrap_or_else(PoisonError::into_inner);
        if agents.get(name).is_some_and(|w| w.as_ptr() == Arc::as_ptr(shared)) {
            agents.remove(name);
        }
    }

    pub(super) fn live(&self, agent: &str) -> Result<Option<Arc<Shared>>> {
        Ok(lock(&self.inner.agents, "agent table")?.get(&AgentName::new(agent)).and_then(Weak::upgrade))
    }

    pub(super) fn refuses_handshakes(&self) -> Result<bool> {
        Ok(lock(&self.inner.faults, "net faults")?.refuses_handshakes())
    }
}

impl Default for ChaosNet {
    fn default() -> Self {
        ChaosNet::new()
    }
}

impl fmt::Debug for ChaosNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let agents = self.inner.agents.lock().map(|a| a.len()).unwrap_or(0);
        f.debug_struct("ChaosNet").field("agents", &agents).finish_non_exhaustive()
    }
}
