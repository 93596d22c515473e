//! The transfer backends the `kvx` command can run on.

use clap::ValueEnum;
use std::sync::Arc;

use kvx_core::{Error, ErrorKind, Result, TransferAgent};
use kvx_loopback::Fabric;
use kvx_tcp::{TcpAgent, TcpConfig};
use kvx_testkit::sim::SimBackend;

/// A transfer backend. Backends not built into this binary yet fail with a clear error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Backend {
    /// In-process memcpy between agents of one process (needs nothing installed).
    Loopback,
    /// UCX one-sided get/put (feature `ucx`), across processes.
    Ucx,
    /// NIXL (feature `nixl`), across processes.
    Nixl,
    /// Plain TCP, in pure Rust (always built), across processes and hosts.
    Tcp,
}

impl Backend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Loopback => "loopback",
            Backend::Ucx => "ucx",
            Backend::Nixl => "nixl",
            Backend::Tcp => "tcp",
        }
    }

    /// Every backend this binary was built with.
    pub(crate) fn built() -> Vec<Backend> {
        let mut built = vec![Backend::Loopback];
        if cfg!(feature = "ucx") {
            built.push(Backend::Ucx);
        }
        if cfg!(feature = "nixl") {
            built.push(Backend::Nixl);
        }
        built.push(Backend::Tcp);
        built
    }

    /// Agents for engines of this process. `cross_process`: the peers live in other processes.
    /// `tcp`: where the tcp backend's agents listen (each on a free port), and the deployment's
    /// key its connections prove.
    pub(crate) fn sim_backend(self, cross_process: bool, tcp: &TcpConfig) -> Result<SimBackend> {
        match self {
            Backend::Loopback if cross_process => Err(Error::new(
                ErrorKind::Unsupported,
                "the loopback backend moves bytes inside one process: use `kvx demo`, or a backend that \
                 crosses processes (ucx, nixl) for `kvx prefill` / `kvx decode`",
            )),
            Backend::Loopback => {
                let fabric = Fabric::new();
                Ok(SimBackend::new(move |engine, rank| {
                    Ok(Arc::new(fabric.agent(format!("{engine}-{rank}"))?) as Arc<dyn TransferAgent>)
                }))
            }
            #[cfg(feature = "ucx")]
            Backend::Ucx => Ok(ucx_backend(cross_process)),
            #[cfg(not(feature = "ucx"))]
            Backend::Ucx => Err(Error::new(
                ErrorKind::NotAvailable,
                "this kvx was built without the ucx feature: use --backend loopback",
            )),
            #[cfg(feature = "nixl")]
            Backend::Nixl => {
                // Fail here, with NIXL's reason, rather than at the first engine.
                kvx_nixl::check_library()?;
                Ok(SimBackend::new(|engine, rank| {
                    let agent = kvx_nixl::NixlAgent::new(format!("{engine}-{rank}"), &Default::default())?;
                    Ok(Arc::new(agent) as Arc<dyn TransferAgent>)
                }))
            }
            #[cfg(not(feature = "nixl"))]
            Backend::Nixl => Err(Error::new(
                ErrorKind::NotAvailable,
                "this kvx was built without the nixl feature: use --backend loopback",
            )),
            Backend::Tcp => {
                let config = tcp.clone();
                Ok(SimBackend::new(move |engine, rank| {
                    Ok(Arc::new(TcpAgent::with_config(format!("{engine}-{rank}"), &config)?)
                        as Arc<dyn TransferAgent>)
                }))
            }
        }
    }
}

/// UCX agents whose KV pools UCX allocates itself (`UCP_MEM_MAP_ALLOCATE`): reads of them are
/// truly one-sided over shared memory, so an engine that only serves its blocks need not progress.
///
/// `cross_process` (`kvx prefill`, `kvx decode`): the agents detect failed peers
/// ([`UcxConfig::with_peer_failure_detection`](kvx_ucx::UcxConfig::with_peer_failure_detection)),
/// so a peer process that dies fails its transfers instead of crashing this one, as UCX 1.13's
/// TCP transport can (`UCX_TLS=tcp`, engines on two hosts). Its one cost, a reader waiting for its
/// target to progress once, does not apply there: a prefill process steps its engine as long as it
/// holds blocks for a reader, and a decode process while it has loads.
/// `kvx demo`'s engines share one process and go without it, keeping reads of an engine that does
/// not step one-sided.
#[cfg(feature = "ucx")]
fn ucx_backend(cross_process: bool) -> SimBackend {
    use kvx_core::EngineId;
    use kvx_testkit::conformance::TestBuffer;
    use kvx_ucx::{UcxAgent, UcxConfig};
    use std::collections::HashMap;
    use std::sync::Mutex;

    type Agents = Mutex<HashMap<(EngineId, u32), Arc<UcxAgent>>>;
    let agents: Arc<Agents> = Arc::default();
    let created = Arc::clone(&agents);
    let poisoned = || Error::new(ErrorKind::State, "UCX agent registry poisoned");
    let config =
        if cross_process { UcxConfig::default().with_peer_failure_detection() } else { UcxConfig::default() };
    SimBackend::new(move |engine, rank| {
        let agent = Arc::new(UcxAgent::with_config(format!("{engine}-{rank}"), &config)?);
        created.lock().map_err(|_| poisoned())?.insert((engine.clone(), rank), Arc::clone(&agent));
        Ok(agent as Arc<dyn TransferAgent>)
    })
    .with_memory(move |engine, rank, len| {
        let agent = agents.lock().map_err(|_| poisoned())?.get(&(engine.clone(), rank)).cloned();
        let agent = agent
            .ok_or_else(|| Error::new(ErrorKind::State, format!("no UCX agent for {engine} rank {rank}")))?;
        Ok(TestBuffer::new(agent.alloc_memory(len)?))
    })
}
