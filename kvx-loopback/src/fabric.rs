//! The [`Fabric`]: the "network" that loopback agents of one process share.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use kvx_core::wire::agent_metadata;
use kvx_core::{AgentName, Error, ErrorKind, Result};

use crate::agent::{AgentOptions, AgentShared, LoopbackAgent};
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
}

impl Fabric {
    /// A new, empty fabric.
    pub fn new() -> Self {
        Fabric {
            inner: Arc::new(FabricInner {
                id: NEXT_FABRIC.fetch_add(1, Ordering::Relaxed),
                next_instance: AtomicU64::new(1),
                agents: Mutex::new(HashMap::new()),
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
