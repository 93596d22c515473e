//! [`NixlAgent`]: kvx's [`TransferAgent`] over a NIXL agent with the UCX backend.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::mem::ManuallyDrop;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kvx_core::post::{DlistView, check_notification};
use kvx_core::wire::agent_metadata;
use kvx_core::{
    AgentName, BlockList, Capabilities, DlistId, DlistOwner, ErrorKind, KvMemory, MAX_NOTIFICATION_LEN,
    MemKind, MemRegion, Notification, PostRequest, RegistrationId, Result, TransferAgent, XferId, XferOp,
    XferState,
};
use nixl_sys as nixl;

use crate::BACKEND;
use crate::error::{NixlResultExt, error, nixl_error};
use crate::library::{check_library, lifecycle_lock};
use crate::metadata::AgentMetadata;

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
    /// notifications progress when [`TransferAgent::poll`], [`TransferAgent::progress`] or
    /// [`TransferAgent::drain_notifications`] is called.
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
/// Memory is registered as NIXL DRAM or VRAM (by [`MemRegion::kind`]); descriptor lists are
/// prepared once per side (`prepXferDlist`) and each [`post`](TransferAgent::post) is a
/// `makeXferReq` over indices into them plus `postXferReq`, with the notification attached.
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
/// complete, so the initiator must keep calling `poll`, `progress` or `drain_notifications` until
/// then (kvx's decode side polls anyway). `local_metadata` lists the registrations made so far: a
/// peer must load it again (forget, then load) to see memory registered later.
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

impl TransferAgent for NixlAgent {
    fn name(&self) -> &AgentName {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    fn register(&self, memory: Arc<dyn KvMemory>) -> Result<RegistrationId> {
        let region = memory.region();
        let kind_supported = self.capabilities.supports(region.kind);
        self.require(kind_supported, &format!("{:?} memory", region.kind))?;
        if region.len == 0 || region.end().is_none() {
            return Err(error(ErrorKind::InvalidArgument, format!("cannot register {region:?}")));
        }
        let descriptor = RegionDescriptor::new(region)?;
        let mut state = self.lock();
        let handle = state
            .nixl
            .agent
            .register_memory(&descriptor, None)
            .nixl(ErrorKind::Backend, "registering memory")?;
        let id = RegistrationId(state.next_id());
        state
            .registrations
            .insert(id, Registration { handle, region, _memory: memory, users: 0, retired: false });
        Ok(id)
    }

    fn deregister(&self, registration: RegistrationId) -> Result<()> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Some(reg) = state.registrations.get_mut(&registration).filter(|r| !r.retired) else {
            return Err(error(ErrorKind::NotFound, format!("{registration} is not registered")));
        };
        reg.retired = true;
        let in_use = reg.users > 0;
        state.dlists.retain(|_, d| !d.registrations.contains(&registration));
        if in_use {
            // The transfers over it keep it: the last to settle deregisters it (`release_uses`).
            return Ok(());
        }
        let Some(mut reg) = state.registrations.remove(&registration) else { return Ok(()) };
        // Deregister first; `reg` (and with it the memory) goes at the end of this scope.
        reg.handle.deregister().nixl(ErrorKind::Backend, "deregistering memory")
    }

    fn local_metadata(&self) -> Result<Vec<u8>> {
        let state = self.lock();
        let nixl_md = state.nixl.agent.get_local_md().nixl(ErrorKind::Backend, "getting local metadata")?;
        let regions = state.registrations.values().filter(|r| !r.retired).map(|r| r.region).collect();
        agent_metadata::seal(BACKEND, &self.name, &AgentMetadata { regions, nixl: nixl_md })
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<AgentName> {
        let (name, meta) = AgentMetadata::open(metadata)?;
        if name == self.name {
            return Err(error(
                ErrorKind::InvalidPeerData,
                format!("peer metadata carries this agent's own name {name}"),
            ));
        }
        let mut guard = self.lock();
        let state = &mut *guard;
        // A remote forgotten while transfers to it are in flight keeps its NIXL metadata until they
        // settle: the same metadata again just makes it loaded again.
        match state.remotes.get_mut(&name) {
            Some(remote) if !remote.forgotten => {
                return Err(error(
                    ErrorKind::State,
                    format!("remote {name} is already loaded; forget it first"),
                ));
            }
            Some(remote) if remote.nixl_md == meta.nixl => {
                remote.forgotten = false;
                remote.regions = meta.regions;
                return Ok(name);
            }
            _ => {}
        }
        let agent = &state.nixl.agent;
        // nixl-sys unwraps the UTF-8 conversion of the name NIXL parsed out of the blob: a peer's
        // bad bytes must not panic through us.
        let loaded = catch_unwind(AssertUnwindSafe(|| agent.load_remote_md(&meta.nixl)))
            .map_err(|_| error(ErrorKind::InvalidPeerData, "NIXL metadata carries a non-UTF-8 agent name"));
        let loaded = match (loaded, state.remotes.get_mut(&name)) {
            (Ok(Ok(loaded)), _) => loaded,
            // NIXL keeps one connection per remote name: a restarted peer cannot be loaded while
            // transfers to its previous instance are in flight.
            (Ok(Err(e)), Some(_)) => {
                return Err(nixl_error(
                    ErrorKind::State,
                    &format!("loading {name} while transfers posted before it was forgotten are in flight"),
                    e,
                ));
            }
            (Ok(Err(e)), None) => {
                return Err(nixl_error(ErrorKind::InvalidPeerData, "loading remote metadata", e));
            }
            (Err(e), _) => return Err(e),
        };
        if loaded != name.as_str() {
            if let Err(e) = agent.invalidate_remote_md(&loaded) {
                tracing::warn!(remote = %loaded, error = %e, "invalidating mislabelled remote metadata failed");
            }
            return Err(error(
                ErrorKind::InvalidPeerData,
                format!("metadata names agent {:?} but NIXL's part is for {loaded:?}", name.as_str()),
            ));
        }
        let AgentMetadata { regions, nixl: nixl_md } = meta;
        match state.remotes.get_mut(&name) {
            Some(remote) => {
                remote.forgotten = false;
                remote.regions = regions;
                remote.nixl_md = nixl_md;
            }
            None => {
                state.remotes.insert(name.clone(), Remote { regions, nixl_md, users: 0, forgotten: false });
            }
        }
        Ok(name)
    }

    fn forget_remote(&self, agent: &AgentName) -> Result<()> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Some(remote) = state.remotes.get_mut(agent).filter(|r| !r.forgotten) else {
            return Err(error(ErrorKind::NotFound, format!("remote {agent} is not loaded")));
        };
        remote.forgotten = true;
        let in_use = remote.users > 0;
        state.dlists.retain(|_, d| d.owner != DlistOwner::Remote(agent.clone()));
        if in_use {
            // A request in flight uses the remote's metadata (its keys) inside NIXL, and NIXL
            // cannot reliably cancel: the last transfer to settle invalidates it (`release_uses`).
            return Ok(());
        }
        state.remotes.remove(agent);
        state
            .nixl
            .agent
            .invalidate_remote_md(agent.as_str())
            .nixl(ErrorKind::Backend, "invalidating remote metadata")
    }

    fn prep_dlist(&self, owner: &DlistOwner, blocks: &BlockList) -> Result<DlistId> {
        let bad = match owner {
            DlistOwner::Local => ErrorKind::InvalidArgument,
            DlistOwner::Remote(_) => ErrorKind::InvalidPeerData,
        };
        let kind_supported = self.capabilities.supports(blocks.kind);
        self.require(kind_supported, &format!("{:?} memory", blocks.kind))?;
        if u32::try_from(blocks.len()).ok().filter(|&n| i32::try_from(n).is_ok()).is_none() {
            return Err(error(bad, format!("{} descriptors is more than NIXL indexes", blocks.len())));
        }
        if blocks.block_len == 0 {
            return Err(error(bad, "blocks of zero bytes"));
        }

        let mut state = self.lock();
        // Every region must lie inside one registration of the owner.
        let (owned, nixl_owner): (Vec<(Option<RegistrationId>, MemRegion)>, &str) = match owner {
            DlistOwner::Local => (
                state
                    .registrations
                    .iter()
                    .filter(|(_, r)| !r.retired)
                    .map(|(id, r)| (Some(*id), r.region))
                    .collect(),
                LOCAL_AGENT,
            ),
            DlistOwner::Remote(name) => {
                let remote = state.loaded(name)?;
                (remote.regions.iter().map(|r| (None, *r)).collect(), name.as_str())
            }
        };
        // A local list: the registration holding each region.
        let mut registrations = Vec::new();
        for (index, region) in blocks.regions().enumerate() {
            let region =
                region.ok_or_else(|| error(bad, format!("region {index} wraps the address space")))?;
            let (id, _) =
                owned.iter().find(|(_, registered)| registered.contains(&region)).ok_or_else(|| {
                    error(bad, format!("region {index} ({region:?}) is not inside registered memory"))
                })?;
            registrations.extend(*id);
        }

        let mut descs = nixl::XferDescList::new(mem_type(blocks.kind))
            .nixl(ErrorKind::Backend, "creating a descriptor list")?;
        for &base in &blocks.bases {
            for block in 0..u64::from(blocks.num_blocks) {
                // In range: the whole region was checked above, so this cannot overflow.
                let addr = base + block * blocks.block_len;
                descs.add_desc(to_usize(addr)?, to_usize(blocks.block_len)?, u64::from(blocks.device));
            }
        }
        let handle = state
            .nixl
            .agent
            .prepare_xfer_dlist(nixl_owner, &descs, None)
            .nixl(bad, "preparing a descriptor list")?;
        let id = DlistId(state.next_id());
        state.dlists.insert(
            id,
            Dlist {
                handle: PreparedDlist(handle),
                owner: owner.clone(),
                blocks: blocks.clone(),
                registrations,
            },
        );
        Ok(id)
    }

    fn release_dlist(&self, dlist: DlistId) -> Result<()> {
        let mut state = self.lock();
        match state.dlists.remove(&dlist) {
            Some(_) => Ok(()),
            None => Err(error(ErrorKind::NotFound, format!("{dlist} is not prepared"))),
        }
    }

    fn post(
        &self,
        op: XferOp,
        local: DlistId,
        local_descs: &[u32],
        remote: DlistId,
        remote_descs: &[u32],
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let request = PostRequest { op, local, local_descs, remote, remote_descs, notify };
        let plan = request.check(&self.capabilities, |id| state.dlists.get(&id).map(Dlist::view))?;
        let (Some(local_list), Some(remote_list)) = (state.dlists.get(&local), state.dlists.get(&remote))
        else {
            return Err(error(ErrorKind::Backend, "a checked post's lists vanished"));
        };
        let mut local_indices = Vec::with_capacity(plan.pairs().len());
        let mut remote_indices = Vec::with_capacity(plan.pairs().len());
        let mut registrations = Vec::new();
        for (l, r) in plan.pairs() {
            local_indices.push(nixl_index(l.index)?);
            remote_indices.push(nixl_index(r.index)?);
            registrations.extend(local_list.registrations.get(l.region).copied());
        }
        registrations.sort_unstable();
        registrations.dedup();

        let options = match notify {
            Some(msg) => {
                let mut options =
                    nixl::OptArgs::new().nixl(ErrorKind::Backend, "creating transfer options")?;
                options.set_has_notification(true).nixl(ErrorKind::Backend, "attaching a notification")?;
                options.set_notification_message(msg).nixl(ErrorKind::Backend, "attaching a notification")?;
                Some(options)
            }
            None => None,
        };
        let agent = &state.nixl.agent;
        let request = agent
            .make_xfer_req(
                nixl_op(op),
                &local_list.handle.0,
                &local_indices,
                &remote_list.handle.0,
                &remote_indices,
                options.as_ref(),
            )
            .nixl(ErrorKind::Backend, "making a transfer request")?;
        let in_flight =
            agent.post_xfer_req(&request, None).nixl(ErrorKind::Transfer, "posting a transfer")?;
        let uses = Uses { registrations, remote: plan.peer().clone() };
        state.take_uses(&uses);
        let mut xfer =
            Xfer { state: XferState::Pending, request: Some(request), uses: Some(uses), reported: false };
        if !in_flight {
            xfer.state = XferState::Done;
            if let Some(uses) = xfer.settle() {
                state.release_uses(uses);
            }
        }
        let id = XferId(state.next_id());
        state.xfers.insert(id, xfer);
        Ok(id)
    }

    fn poll(&self, xfer: XferId) -> Result<XferState> {
        self.lock().refreshed(xfer)
    }

    fn release(&self, xfer: XferId) -> Result<()> {
        let mut state = self.lock();
        state.refreshed(xfer)?;
        let Some(entry) = state.xfers.remove(&xfer) else { return Ok(()) };
        // NIXL cannot reliably cancel a transfer in flight, and releasing its request early would
        // let the memory go while the transport still writes it: keep the request, complete it in
        // the background (every `progress` and `drain_notifications` checks it), and count it as
        // using its memory and its remote until then.
        if entry.state == XferState::Pending {
            state.detached.push(entry);
        }
        Ok(())
    }

    fn notify(&self, agent: &AgentName, msg: &[u8]) -> Result<()> {
        check_notification(&self.capabilities, msg)?;
        let state = self.lock();
        state.loaded(agent)?;
        state
            .nixl
            .agent
            .send_notification(agent.as_str(), msg, None)
            .nixl(ErrorKind::Backend, "sending a notification")
    }

    fn drain_notifications(&self, out: &mut Vec<Notification>) -> Result<()> {
        let mut guard = self.lock();
        let state = &mut *guard;
        state.refresh_pending();
        out.append(&mut state.received);
        fetch_notifications(&state.nixl.agent, out)
    }

    /// NIXL has no completion queue: one status check per transfer still pending (as
    /// `progress`), then the settled transfers not yet reported. Linear in the transfers posted
    /// and not yet released.
    fn drain_completions(&self, out: &mut Vec<XferId>) -> Result<()> {
        let mut guard = self.lock();
        let state = &mut *guard;
        state.refresh_pending();
        for (&id, xfer) in &mut state.xfers {
            if xfer.state != XferState::Pending && !xfer.reported {
                xfer.reported = true;
                out.push(id);
            }
        }
        fetch_notifications(&state.nixl.agent, &mut state.received)
    }

    fn progress(&self) -> Result<()> {
        // NIXL has no separate progress call. Checking a transfer's status progresses it (and
        // NIXL's UCX backend sends a transfer's notification from there once the data is in
        // place); fetching notifications progresses the rest. Keep what arrives for the next
        // `drain_notifications`.
        let mut guard = self.lock();
        let state = &mut *guard;
        state.refresh_pending();
        fetch_notifications(&state.nixl.agent, &mut state.received)
    }
}

/// Everything behind the agent's mutex. nixl-sys marks its agent and request handles `Send` and
/// `Sync` without saying why; kvx-nixl does not rely on that for correctness: every NIXL call and
/// every drop of a NIXL handle happens with this mutex held (or, in `Drop`, with exclusive
/// access). Field order is drop order; [`State`]'s `Drop` first empties the tables in dependency
/// order, and the NIXL agent itself goes last.
struct State {
    next_id: u64,
    xfers: HashMap<XferId, Xfer>,
    /// Released while in flight: completed in the background, then dropped.
    detached: Vec<Xfer>,
    dlists: HashMap<DlistId, Dlist>,
    /// Loaded remotes, and remotes forgotten while transfers to them are in flight.
    remotes: HashMap<AgentName, Remote>,
    /// Registrations, and registrations deregistered while transfers over them are in flight.
    registrations: BTreeMap<RegistrationId, Registration>,
    /// Notifications fetched by `progress` and not yet drained.
    received: Vec<Notification>,
    nixl: NixlHandle,
}

impl State {
    fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// A loaded remote (not one forgotten while transfers to it are in flight); `NotFound` if none.
    fn loaded(&self, name: &AgentName) -> Result<&Remote> {
        self.remotes
            .get(name)
            .filter(|r| !r.forgotten)
            .ok_or_else(|| error(ErrorKind::NotFound, format!("remote {name} is not loaded")))
    }

    /// A posted transfer's state, brought up to date; `NotFound` for an unknown id.
    fn refreshed(&mut self, xfer: XferId) -> Result<XferState> {
        let entry = self
            .xfers
            .get_mut(&xfer)
            .ok_or_else(|| error(ErrorKind::NotFound, format!("{xfer} is not posted")))?;
        let settled = entry.refresh(&self.nixl.agent);
        let state = entry.state.clone();
        if let Some(uses) = settled {
            self.release_uses(uses);
        }
        Ok(state)
    }

    /// Updates every transfer still pending, and drops detached ones that have settled.
    fn refresh_pending(&mut self) {
        let agent = &self.nixl.agent;
        let mut settled: Vec<Uses> = self.xfers.values_mut().filter_map(|x| x.refresh(agent)).collect();
        self.detached.retain_mut(|x| match x.refresh(agent) {
            Some(uses) => {
                settled.push(uses);
                false
            }
            None => x.state == XferState::Pending,
        });
        for uses in settled {
            self.release_uses(uses);
        }
    }

    /// Counts a new transfer as using its registrations and remote.
    fn take_uses(&mut self, uses: &Uses) {
        for id in &uses.registrations {
            if let Some(reg) = self.registrations.get_mut(id) {
                reg.users += 1;
            }
        }
        if let Some(remote) = self.remotes.get_mut(&uses.remote) {
            remote.users += 1;
        }
    }

    /// A transfer settled: it no longer uses its registrations and remote. Deregistrations and
    /// forgets that waited for it happen now.
    fn release_uses(&mut self, uses: Uses) {
        for id in uses.registrations {
            let Some(reg) = self.registrations.get_mut(&id) else { continue };
            reg.users -= 1;
            if reg.retired && reg.users == 0 {
                if let Some(mut reg) = self.registrations.remove(&id) {
                    if let Err(e) = reg.handle.deregister() {
                        tracing::warn!(registration = %id, error = %e, "deferred deregistration failed");
                    }
                }
            }
        }
        let Some(remote) = self.remotes.get_mut(&uses.remote) else { return };
        remote.users -= 1;
        if remote.forgotten && remote.users == 0 {
            self.remotes.remove(&uses.remote);
            if let Err(e) = self.nixl.agent.invalidate_remote_md(uses.remote.as_str()) {
                tracing::warn!(remote = %uses.remote, error = %e, "deferred invalidation of a remote failed");
            }
        }
    }

    fn any_in_flight(&self) -> bool {
        !self.detached.is_empty() || self.xfers.values().any(|x| x.state == XferState::Pending)
    }
}

impl Drop for State {
    fn drop(&mut self) {
        // Transfers in flight read or write registered memory: give them a bounded time to finish.
        let deadline = Instant::now() + TEARDOWN_WAIT;
        loop {
            self.refresh_pending();
            if !self.any_in_flight() || Instant::now() >= deadline {
                break;
            }
            let mut ignored = Vec::new();
            if let Err(e) = fetch_notifications(&self.nixl.agent, &mut ignored) {
                tracing::debug!(error = %e, "progress during teardown failed");
            }
            std::thread::yield_now();
        }
        if self.any_in_flight() {
            tracing::warn!("dropping a NIXL agent with transfers still in flight after {TEARDOWN_WAIT:?}");
        }
        self.xfers.clear();
        self.detached.clear();
        self.dlists.clear();
        for name in self.remotes.keys() {
            if let Err(e) = self.nixl.agent.invalidate_remote_md(name.as_str()) {
                tracing::warn!(remote = %name, error = %e, "invalidating remote metadata at teardown failed");
            }
        }
        self.remotes.clear();
        for (id, mut reg) in std::mem::take(&mut self.registrations) {
            if let Err(e) = reg.handle.deregister() {
                tracing::warn!(registration = %id, error = %e, "deregistering at teardown failed");
            }
        }
    }
}

/// The NIXL agent, destroyed under the process-wide lifecycle lock.
struct NixlHandle {
    agent: ManuallyDrop<nixl::Agent>,
}

impl Drop for NixlHandle {
    fn drop(&mut self) {
        let _guard = lifecycle_lock();
        // SAFETY: dropped exactly once, here, and never used afterwards. By now `State::drop` has
        // dropped every registration, prepared list and request, so this is the last reference
        // to the NIXL agent and its destruction happens under the lock.
        unsafe { ManuallyDrop::drop(&mut self.agent) };
    }
}

/// A memory registration: the NIXL handle and the memory it covers. `handle` is declared before
/// `_memory`, so even without an explicit deregistration the memory outlives the registration.
struct Registration {
    handle: nixl::RegistrationHandle,
    region: MemRegion,
    _memory: Arc<dyn KvMemory>,
    /// Transfers in flight over it.
    users: usize,
    /// Deregistered: gone for new calls, deregistered from NIXL when `users` drops to zero.
    retired: bool,
}

/// A remote agent whose metadata is loaded.
struct Remote {
    /// Its registered memory, from its metadata: remote descriptor lists must lie inside.
    regions: Vec<MemRegion>,
    /// NIXL's part of its metadata, as loaded.
    nixl_md: Vec<u8>,
    /// Transfers in flight to it.
    users: usize,
    /// Forgotten: gone for new calls, its NIXL metadata invalidated when `users` drops to zero.
    forgotten: bool,
}

/// A prepared descriptor list (`nixlDlistH`).
struct PreparedDlist(nixl::XferDlistHandle);

// SAFETY: the handle points to a NIXL-owned list with no thread affinity; NIXL only requires that
// calls on one agent do not run concurrently. The handle is used, and released (in its Drop), only
// by methods of `State`, that is with the owning agent's mutex held, and always before the NIXL
// agent is destroyed (see `State`'s Drop).
unsafe impl Send for PreparedDlist {}

struct Dlist {
    handle: PreparedDlist,
    owner: DlistOwner,
    blocks: BlockList,
    /// A local list: the registration holding each of its regions (empty for a remote list).
    registrations: Vec<RegistrationId>,
}

impl Dlist {
    fn view(&self) -> DlistView<'_> {
        DlistView { owner: &self.owner, blocks: &self.blocks }
    }
}

/// What a transfer in flight uses: its local registrations and its remote.
struct Uses {
    registrations: Vec<RegistrationId>,
    remote: AgentName,
}

struct Xfer {
    /// `Pending` until NIXL reports completion or failure; then fixed.
    state: XferState,
    /// Released (and cancelled if in flight) when dropped; dropped when the transfer settles.
    request: Option<nixl::XferRequest>,
    /// Until the transfer settles.
    uses: Option<Uses>,
    /// `drain_completions` has reported it (once settled).
    reported: bool,
}

impl Xfer {
    /// Asks NIXL where the transfer stands; returns what it used once it has just settled.
    fn refresh(&mut self, agent: &nixl::Agent) -> Option<Uses> {
        let request = self.request.as_ref().filter(|_| self.state == XferState::Pending)?;
        self.state = match agent.get_xfer_status(request) {
            Ok(nixl::XferStatus::Success) => XferState::Done,
            Ok(nixl::XferStatus::InProgress) => return None,
            Err(e) => XferState::Failed(nixl_error(ErrorKind::Transfer, "the NIXL transfer failed", e)),
        };
        self.settle()
    }

    /// Lets the request go once the transfer has settled; returns what it used.
    fn settle(&mut self) -> Option<Uses> {
        self.request = None;
        self.uses.take()
    }
}

/// A registration's region as nixl-sys's descriptor trait.
#[derive(Debug)]
struct RegionDescriptor {
    addr: usize,
    len: usize,
    region: MemRegion,
}

impl RegionDescriptor {
    fn new(region: MemRegion) -> Result<Self> {
        Ok(RegionDescriptor { addr: to_usize(region.addr)?, len: to_usize(region.len)?, region })
    }
}

impl nixl::MemoryRegion for RegionDescriptor {
    unsafe fn as_ptr(&self) -> *const u8 {
        // Only an address for NIXL's descriptor; never dereferenced by kvx.
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl nixl::NixlDescriptor for RegionDescriptor {
    fn mem_type(&self) -> nixl::MemType {
        mem_type(self.region.kind)
    }

    fn device_id(&self) -> u64 {
        u64::from(self.region.device)
    }
}

fn mem_type(kind: MemKind) -> nixl::MemType {
    match kind {
        MemKind::Dram => nixl::MemType::Dram,
        MemKind::Vram => nixl::MemType::Vram,
    }
}

fn nixl_op(op: XferOp) -> nixl::XferOp {
    match op {
        XferOp::Read => nixl::XferOp::Read,
        XferOp::Write => nixl::XferOp::Write,
    }
}

fn to_usize(value: u64) -> Result<usize> {
    usize::try_from(value)
        .map_err(|_| error(ErrorKind::InvalidArgument, format!("{value} does not fit an address")))
}

/// A descriptor index as NIXL's `int`. Every list's length fits one (checked when it was
/// prepared), so every index in range does too.
fn nixl_index(index: u32) -> Result<i32> {
    i32::try_from(index)
        .map_err(|_| error(ErrorKind::InvalidArgument, format!("descriptor {index} is past NIXL's indices")))
}

/// Moves the notifications NIXL has received into `out`, with their senders.
fn fetch_notifications(agent: &nixl::Agent, out: &mut Vec<Notification>) -> Result<()> {
    // A fresh map per call: nixl-sys offers no way to clear one without converting every payload
    // to a String, and NIXL appends to the map it is given.
    let mut map = nixl::NotificationMap::new().nixl(ErrorKind::Backend, "creating a notification map")?;
    agent.get_notifications(&mut map, None).nixl(ErrorKind::Backend, "getting notifications")?;
    if map.is_empty().nixl(ErrorKind::Backend, "reading notifications")? {
        return Ok(());
    }
    let senders: Vec<String> = map
        .agents()
        .map(|sender| sender.map(str::to_owned))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| nixl_error(ErrorKind::InvalidPeerData, "a notification's sender name", e))?;
    for sender in senders {
        let from = AgentName::new(sender.as_str());
        for msg in map.get_notifications(&sender).nixl(ErrorKind::Backend, "reading notifications")? {
            let msg = msg.nixl(ErrorKind::Backend, "reading a notification")?;
            if msg.len() > MAX_NOTIFICATION_LEN {
                // No kvx agent sends one: a peer's bug, dropped rather than failing the receiver.
                tracing::warn!(from = %from, len = msg.len(), "dropping a notification over the limit");
                continue;
            }
            out.push(Notification { from: from.clone(), msg });
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests fail loudly by unwrapping.
mod tests {
    use super::*;

    #[test]
    fn indices_past_nixls_int_are_refused() {
        assert_eq!(nixl_index(7).unwrap(), 7);
        let e = nixl_index(u32::MAX).unwrap_err();
        assert_eq!((e.kind(), e.backend()), (ErrorKind::InvalidArgument, Some("nixl")));
    }

    #[test]
    fn config_defaults_to_no_progress_thread() {
        let config = NixlConfig::default();
        assert!(!config.progress_thread);
        assert!(NixlConfig::default().with_progress_thread(true, Duration::from_micros(50)).progress_thread);
    }
}
