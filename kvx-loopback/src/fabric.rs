//! The [`Fabric`]: the "network" that loopback agents of one process share.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use kvx_core::clock::system_clock;
use kvx_core::wire::agent_metadata;
use kvx_core::{AgentName, Clock, Error, ErrorKind, Result};

use crate::agent::{AgentOptions, AgentShared, LoopbackAgent};
use crate::faults::{FaultCounts, FaultPlan, Faults};
use crate::{BACKEND, lock};

static NEXT_FABRIC: AtomicU64 = AtomicU64::new(1);

/// The in-process network of loopback agents: agents created from one fabric (or its clones) can
/// load each other's metadata and move bytes between each other's registered memory.
///
/// Cheap to clone; clones are the same fabric. Agents keep their fabric alive; the fabric does
/// not keep agents alive.
#[derive(Clone)]
pub struct Fabric {
    pub(crate) inner: Arc<FabricInner>,
}

pub(crate) struct FabricInner {
    pub(crate) id: u64,
    next_instance: AtomicU64,
    /// Live agents by name, with the instance number that tells a restarted agent from the old one.
    agents: Mutex<HashMap<AgentName, (u64, Weak<AgentShared>)>>,
    pub(crate) faults: Mutex<FaultPlan>,
    /// Faults injected so far, by the fabric's faults and its agents'.
    pub(crate) injected: Mutex<FaultCounts>,
    /// The time of time-based faults.
    pub(crate) clock: Arc<dyn Clock>,
}

impl Fabric {
    /// A new, empty fabric on the system clock.
    pub fn new() -> Self {
        Fabric::with_clock(system_clock())
    }

    /// A new, empty fabric whose time-based faults (delayed transfers and notifications) follow
    /// `clock`: a simulation's [`ManualClock`](kvx_core::ManualClock), say.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Fabric {
            inner: Arc::new(FabricInner {
                id: NEXT_FABRIC.fetch_add(1, Ordering::Relaxed),
                next_instance: AtomicU64::new(1),
                agents: Mutex::new(HashMap::new()),
                faults: Mutex::new(FaultPlan::default()),
                injected: Mutex::new(FaultCounts::default()),
                clock,
            }),
        }
    }

    /// A new agent named `name`, progressed explicitly (by `progress`, `drain_completions` and
    /// `drain_notifications`): deterministic, for tests.
    ///
    /// A name that a live agent of this fabric has is a `State` error; once that agent is dropped
    /// the name can be used again (a restarted peer, with new metadata). A name that agent
    /// metadata cannot carry (`agent_metadata::check_agent_name`) is an `InvalidArgument` error.
    pub fn agent(&self, name: impl Into<AgentName>) -> Result<LoopbackAgent> {
        self.agent_with(name, AgentOptions::default())
    }

    /// A new agent with options (e.g. a background progress thread).
    pub fn agent_with(&self, name: impl Into<AgentName>, options: AgentOptions) -> Result<LoopbackAgent> {
        let name = name.into();
        agent_metadata::check_agent_name(&name).map_err(|e| e.with_backend(BACKEND))?;
        let mut agents = lock(&self.inner.agents, "fabric's agent table")?;
        if agents.get(&name).is_some_and(|(_, weak)| weak.strong_count() > 0) {
            return Err(Error::new(ErrorKind::State, format!("agent {name} already exists on this fabric"))
                .with_backend(BACKEND));
        }
        let instance = self.inner.next_instance.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(AgentShared::new(name.clone(), instance, self.inner.clone()));
        agents.insert(name, (instance, Arc::downgrade(&shared)));
        drop(agents);
        LoopbackAgent::start(shared, options)
    }

    /// Sets faults for every agent of this fabric, replacing earlier fabric faults and restarting
    /// their counts. [`Faults::none`] clears them.
    pub fn set_faults(&self, faults: Faults) -> Result<()> {
        lock(&self.inner.faults, "fabric's faults")?.set(faults);
        Ok(())
    }

    /// The faults injected on this fabric so far (by its faults and by its agents').
    pub fn fault_counts(&self) -> Result<FaultCounts> {
        Ok(*lock(&self.inner.injected, "fabric fault counts")?)
    }

    /// The earliest time at which an agent of this fabric has something to do: the clock's now
    /// when a transfer waits for a progress pass or a notification for its target to drain it,
    /// else when the first delayed transfer or notification is due; `None` when nothing waits.
    /// A simulation on a manual clock may jump to it.
    pub fn next_event(&self) -> Result<Option<Instant>> {
        let agents: Vec<Arc<AgentShared>> = lock(&self.inner.agents, "fabric's agent table")?
            .values()
            .filter_map(|(_, w)| w.upgrade())
            .collect();
        let now = self.inner.clock.now();
        let mut next = None;
        for agent in agents {
            next = next.into_iter().chain(agent.next_event(now)?).min();
        }
        Ok(next)
    }
}

impl Default for Fabric {
    fn default() -> Self {
        Fabric::new()
    }
}

impl FabricInner {
    /// The live agent `name`, if it is still the `instance` that a peer's metadata described.
    pub(crate) fn lookup(&self, name: &AgentName, instance: u64) -> Result<Option<Arc<AgentShared>>> {
        let agents = lock(&self.agents, "fabric's agent table")?;
        Ok(agents.get(name).filter(|(i, _)| *i == instance).and_then(|(_, weak)| weak.upgrade()))
    }

    /// Removes `name` from the table when that entry is still `instance` (the dropped agent).
    pub(crate) fn remove(&self, name: &AgentName, instance: u64) {
        // Runs in Drop: a poisoned table is still a valid map, so clean it up anyway.
        let mut agents = self.agents.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if agents.get(name).is_some_and(|(i, _)| *i == instance) {
            agents.remove(name);
        }
    }
}

impl fmt::Debug for Fabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let agents = self.inner.agents.lock().map(|a| a.len()).unwrap_or(0);
        f.debug_struct("Fabric").field("id", &self.inner.id).field("agents", &agents).finish()
    }
}

impl fmt::Debug for FabricInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FabricInner").field("id", &self.id).finish_non_exhaustive()
    }
}
