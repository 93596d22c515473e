//! [`NixlAgent`]: kvx's [`TransferAgent`] over a NIXL agent with the UCX backend.
//!
//! [`TransferAgent`]: kvx_core::TransferAgent

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kvx_core::wire::agent_metadata;
use kvx_core::{AgentName, Capabilities, ErrorKind, Result};
use nixl_sys as nixl;

use crate::BACKEND;
use crate::error::{NixlResultExt, error};
use crate::library::{check_library, lifecycle_lock};

mod convert;
mod state;
mod transfer;

use state::{NixlHandle, State};

/// The NIXL plugin kvx-nixl uses.
const UCX_PLUGIN: &str = "UCX";
/// NIXL's name for "this agent" in `prepXferDlist`.
const LOCAL_AGENT: &str = "";
/// How long dropping an agent waits for its transfers still in flight before cancelling them.
const TEARDOWN_WAIT: Duration = Duration::from_secs(2);

/// How a [`NixlAgent`] is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NixlConfig {
    /// Run NIXL's progress thread, which progresses transfers and receives notifications in the
    /// background. Off by default: with a zero delay it busy-spins a core, which on small machines
    /// costs more than it saves (measured in the crate README). Without it, transfers and
    /// notifications progress when `drain_completions`, `poll`, `progress` or `drain_notifications`
    /// of the [`TransferAgent`] is called.
    ///
    /// [`TransferAgent`]: kvx_core::TransferAgent
    pub progress_thread: bool,
    /// Pause between two iterations of the progress thread (NIXL's `pthr_delay_us`).
    pub progress_thread_delay: Duration,
    /// Threads of the UCX backend's thread-pool engine (NIXL's `num_threads`, as in NIXL's Python
    /// `nixl_agent_config`); 0, the default, is the single-worker engine. With threads, NIXL's UCX
    /// workers progress on their own (event-driven, no busy core), so connection setup and the
    /// target side of a transfer do not wait for this agent's next call: what an engine that
    /// only calls in between steps needs (vLLM's NixlConnector uses 4).
    pub num_threads: u32,
}

impl Default for NixlConfig {
    fn default() -> Self {
        NixlConfig { progress_thread: false, progress_thread_delay: Duration::ZERO, num_threads: 0 }
    }
}

impl NixlConfig {
    /// The default configuration with NIXL's progress thread switched on or off.
    pub fn with_progress_thread(mut self, on: bool, delay: Duration) -> Self {
        self.progress_thread = on;
        self.progress_thread_delay = delay;
        self
    }

    /// The configuration with the UCX backend's thread-pool engine of `n` threads (0: none).
    pub fn with_threads(mut self, n: u32) -> Self {
        self.num_threads = n;
        self
    }
}

/// A kvx [`TransferAgent`] over one NIXL agent with the UCX backend.
///
/// Memory is registered as NIXL DRAM or VRAM (by [`MemRegion::kind`]). `prep_dlist` has NIXL
/// check the list with one descriptor per region (`prepXferDlist`), in O(regions): a new peer
/// costs no per-block work. [`post_blocks`][`TransferAgent::post_blocks`] builds each transfer's
/// descriptor lists from kvx-core's coalesced plan, one descriptor per run of blocks contiguous on
/// both sides per region (`createXferReq`); [`post`][`TransferAgent::post`] is a `makeXferReq`
/// over indices into per-block lists that NIXL prepares when a `post` first uses the list. Either
/// way `postXferReq` follows, with the notification attached.
///
/// # Threading
/// Every NIXL call for this agent is made with the agent's own mutex held, so NIXL (whose agents
/// default to no internal locking) never sees two concurrent calls on one agent; agents are
/// created and destroyed under one process-wide lock, because NIXL agents created concurrently can
/// deadlock. So any number of `NixlAgent`s may be used from any threads, tests included.
///
/// # Lifetimes
/// A registration owns its `Arc<dyn KvMemory>` and deregisters before releasing it. As the
/// [`TransferAgent`] contract says, `deregister` and `forget_remote` succeed at once, also while
/// transfers use the memory or the remote: their lists are released and new calls naming them
/// fail, but the agent counts which transfers use which registration and remote, and deregisters
/// the memory from NIXL (then lets it go) or invalidates the remote's NIXL metadata only when the
/// last of them settles. NIXL cannot reliably cancel a transfer: releasing one in flight detaches
/// it, and the agent completes it in the background (in every `progress` and
/// `drain_notifications`). NIXL keeps one connection per remote name, so a restarted peer (new
/// metadata under the same name) cannot be loaded while transfers to its previous instance are in
/// flight (`State`); the same metadata loads again at once. Dropping the agent waits (up to two
/// seconds) for transfers in flight, then releases transfers, lists, remotes and registrations in
/// that order, and only then destroys the NIXL agent.
///
/// # Notifications
/// NIXL's UCX backend sends a transfer's notification when the initiator observes the transfer
/// complete, so the initiator must keep calling `drain_completions`, `poll`, `progress` or
/// `drain_notifications` until then (kvx's decode side drains its completions every step).
/// `local_metadata` lists the registrations made so far: a
/// peer must load it again (forget, then load) to see memory registered later.
///
/// [`TransferAgent`]: kvx_core::TransferAgent
/// [`MemRegion::kind`]: kvx_core::MemRegion::kind
/// [`TransferAgent::post`]: kvx_core::TransferAgent::post
/// [`TransferAgent::post_blocks`]: kvx_core::TransferAgent::post_blocks
pub struct NixlAgent {
    name: AgentName,
    capabilities: Capabilities,
    state: Mutex<State>,
}

// Compile-time check that the agent can be shared as `Arc<dyn TransferAgent>`.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<NixlAgent>();
};

impl NixlAgent {
    /// Creates a NIXL agent named `name` with a UCX backend.
    ///
    /// Checks first that the real NIXL library is loadable ([`check_library`](crate::check_library)):
    /// without it this returns [`ErrorKind::NotAvailable`] instead of letting NIXL abort the
    /// process. A missing UCX plugin is `NotAvailable` too. A name that agent metadata cannot
    /// carry (`agent_metadata::check_agent_name`) is an `InvalidArgument` error.
    pub fn new(name: impl Into<AgentName>, config: &NixlConfig) -> Result<Self> {
        check_library()?;
        let name = name.into();
        agent_metadata::check_agent_name(&name).map_err(|e| e.with_backend(BACKEND))?;
        let nixl_config = nixl::AgentConfig {
            enable_prog_thread: config.progress_thread,
            enable_listen_thread: false,
            pthr_delay_us: u64::try_from(config.progress_thread_delay.as_micros()).unwrap_or(u64::MAX),
            ..nixl::AgentConfig::default()
        };

        let guard = lifecycle_lock();
        let agent = nixl::Agent::new_configured(name.as_str(), &nixl_config)
            .nixl(ErrorKind::Backend, "creating agent")?;
        // From here on, an early return drops `agent` before `guard`: destruction stays serialised.
        let (_plugin_mems, mut params) = agent
            .get_plugin_params(UCX_PLUGIN)
            .nixl(ErrorKind::NotAvailable, "NIXL's UCX plugin (set NIXL_PLUGIN_DIR)")?;
        if config.num_threads > 0 {
            params
                .set("num_threads", &config.num_threads.to_string())
                .nixl(ErrorKind::InvalidArgument, "setting the UCX backend's num_threads")?;
        }
        let backend = agent
            .create_backend(UCX_PLUGIN, &params)
            .nixl(ErrorKind::NotAvailable, "creating the UCX backend")?;
        let (mems, _params) =
            agent.get_backend_params(&backend).nixl(ErrorKind::Backend, "querying the UCX backend")?;
        let kinds: Vec<nixl::MemType> = mems.iter().filter_map(std::result::Result::ok).collect();
        drop(guard);

        let capabilities = Capabilities {
            backend: BACKEND,
            dram: kinds.contains(&nixl::MemType::Dram),
            vram: kinds.contains(&nixl::MemType::Vram),
            read: true,
            write: true,
            notifications: true,
        };
        tracing::debug!(agent = %name, ?capabilities, "NIXL agent created");
        let state = State {
            next_id: 1,
            xfers: HashMap::new(),
            detached: Vec::new(),
            dlists: HashMap::new(),
            remotes: HashMap::new(),
            registrations: BTreeMap::new(),
            received: Vec::new(),
            nixl: NixlHandle { agent: ManuallyDrop::new(agent) },
        };
        Ok(NixlAgent { name, capabilities, state: Mutex::new(state) })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No method panics between two consistent states of `State` (nixl-sys panics are caught),
        // so a poisoned lock still guards consistent tables.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn require(&self, capability: bool, what: &str) -> Result<()> {
        if capability {
            Ok(())
        } else {
            Err(error(ErrorKind::Unsupported, format!("{what} is not supported by NIXL's UCX backend here")))
        }
    }
}

impl fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("NixlAgent");
        s.field("name", &self.name).field("capabilities", &self.capabilities);
        if let Ok(state) = self.state.try_lock() {
            s.field("registrations", &state.registrations.len())
                .field("remotes", &state.remotes.keys().collect::<Vec<_>>())
                .field("dlists", &state.dlists.len())
                .field("xfers", &state.xfers.len());
        }
        s.finish_non_exhaustive()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests fail loudly by unwrapping.
mod tests {
    use super::*;

    #[test]
    fn config_defaults_to_no_progress_thread() {
        let config = NixlConfig::default();
        assert!(!config.progress_thread);
        assert!(NixlConfig::default().with_progress_thread(true, Duration::from_micros(50)).progress_thread);
    }
}
