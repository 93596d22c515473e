//! The UCP context (one per agent) and its configuration.

use std::ffi::CString;
use std::ptr::{self, NonNull};
use std::time::Duration;

use kvx_core::{ErrorKind, Result};
use kvx_ucx_sys as sys;

use crate::status::{check, check_as, error, load};

/// How a [`UcxAgent`](crate::UcxAgent) sets up UCX.
///
/// UCX reads its `UCX_*` environment variables when the agent is created, with kvx's
/// [`ENV_DEFAULTS`](UcxConfig::ENV_DEFAULTS) for those the environment does not set; the options
/// here are applied on top of them for this agent only (`ucp_config_modify`), so two agents in one
/// process can use different transports.
#[derive(Debug, Clone, Default)]
pub struct UcxConfig {
    options: Vec<(String, String)>,
    progress_thread: Option<ProgressThreadConfig>,
    peer_failure: bool,
    read_path: ReadPath,
}

/// How a [`UcxAgent`](crate::UcxAgent) READs a peer's memory, chosen per peer when it is loaded.
///
/// UCX 1.13 has no get over TCP: it emulates one with active messages that copy every byte into
/// and out of UCX's own segments (four copies, about twice a TCP stream's CPU per byte). Reading
/// by rendezvous active messages instead, the target sends each range straight from its
/// registered memory and the reader receives it straight into the slot (`sendmsg` and `recv`
/// on the socket, as a plain TCP stream does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadPath {
    /// [`ActiveMessages`](ReadPath::ActiveMessages) where every lane UCX chose for RMA to the
    /// peer is TCP (`ucp_ep_print_info`), [`Get`](ReadPath::Get) otherwise (shared memory,
    /// RDMA).
    #[default]
    Auto,
    /// One `ucp_get_nbx` per range: one-sided where the transport can read (shared memory,
    /// RDMA), emulated with active messages over TCP.
    Get,
    /// The reader asks, the target answers each range with a rendezvous active message from its
    /// registered memory (checked against its registrations first) into the reader's slot. Like
    /// a get over TCP, the target must progress (a progress thread or regular calls).
    ActiveMessages,
}

impl UcxConfig {
    /// UCX variables kvx sets for UCX, each only where the program's environment does not set it:
    /// the segments of UCX's TCP transport. UCX 1.13 has no get over TCP and emulates a READ with
    /// active messages, by default in 8 KiB segments; segments of 256 KiB (received into 512 KiB
    /// buffers) moved 1000 scattered 64 KiB READs between two processes over TCP 3.3 times
    /// faster here (4.4 against 1.3 GB/s, `cargo bench -p kvx-ucx --bench read_bandwidth`), and
    /// larger ones gained nothing more. They matter only where TCP carries the transfer. They are
    /// transport options, read from the environment: [`with_option`](UcxConfig::with_option)
    /// cannot change them (through `ucp_config_modify` they had no effect: strace counts the same
    /// `sendto` calls with and without it).
    ///
    /// Nothing else is set: socket buffers (`UCX_TCP_SNDBUF`/`RCVBUF`), other segment sizes and
    /// a target without a progress thread were measured against a plain TCP stream in the same
    /// run, and none moved kvx-ucx's share of it (about half at 64 KiB and 1 MiB blocks) beyond
    /// the run-to-run noise; docs/PERFORMANCE.md has the figures and why.
    pub const ENV_DEFAULTS: [(&'static str, &'static str); 2] =
        [("UCX_TCP_TX_SEG_SIZE", "256K"), ("UCX_TCP_RX_SEG_SIZE", "512K")];

    /// Restricts the transports UCX may use, as `UCX_TLS` does: e.g. `"tcp"`, `"sm,self"`, `"^cma"`.
    pub fn with_transports(self, transports: impl Into<String>) -> Self {
        self.with_option("TLS", transports)
    }

    /// Sets any UCP configuration option (the name without the `UCX_` prefix, as
    /// `ucx_info -c` lists it). Applied in order; an unknown name or bad value fails agent creation.
    pub fn with_option(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.push((name.into(), value.into()));
        self
    }

    /// Starts a progress thread with the agent (see [`ProgressThreadConfig`]).
    pub fn with_progress_thread(mut self, config: ProgressThreadConfig) -> Self {
        self.progress_thread = Some(config);
        self
    }

    /// Creates endpoints that detect a failed peer (`UCP_ERR_HANDLING_MODE_PEER`): when a peer
    /// dies, its connection resets or its keepalive times out, its outstanding transfers fail,
    /// later posts and notifications to it fail at once, and the connector's worker handshakes
    /// again. Endpoints need the peer to answer their connection setup, so a reader waits until
    /// the target progresses once (a progress thread or a step); UCX-allocated memory is then still
    /// read one-sidedly.
    ///
    /// Turn it on for TCP: without it, UCX 1.13's TCP transport can crash the process in
    /// `uct_tcp_iface_progress` after a peer goes away. Off by default, so that a reader of
    /// [`UcxAgent::alloc_memory`](crate::UcxAgent::alloc_memory) pools never needs its target to
    /// progress.
    pub fn with_peer_failure_detection(mut self) -> Self {
        self.peer_failure = true;
        self
    }

    /// How READs reach a peer's memory (default [`ReadPath::Auto`]).
    pub fn with_read_path(mut self, path: ReadPath) -> Self {
        self.read_path = path;
        self
    }

    /// How READs reach a peer's memory (see [`UcxConfig::with_read_path`]).
    pub fn read_path(&self) -> ReadPath {
        self.read_path
    }

    /// Whether endpoints detect a failed peer (see [`UcxConfig::with_peer_failure_detection`]).
    pub fn peer_failure_detection(&self) -> bool {
        self.peer_failure
    }

    /// The UCP options set on top of the environment, in order.
    pub fn options(&self) -> &[(String, String)] {
        &self.options
    }

    /// The progress thread's settings, when one is configured.
    pub fn progress_thread(&self) -> Option<&ProgressThreadConfig> {
        self.progress_thread.as_ref()
    }
}

/// Settings of an agent's progress thread.
///
/// On UCX 1.13, memory that UCX did not allocate itself is read and written through messages that
/// the *target* must progress, so an agent that only serves memory (a prefill engine between
/// steps) needs either a progress thread or regular calls to
/// [`TransferAgent::progress`](kvx_core::TransferAgent::progress). Memory from
/// [`UcxAgent::alloc_memory`](crate::UcxAgent::alloc_memory) is read truly one-sidedly over shared
/// memory and needs neither (notifications still arrive only when the target progresses).
///
/// The thread progresses the worker while there is work, yields for a few idle rounds, then sleeps
/// up to `idle_sleep` between rounds, so an idle agent costs little CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgressThreadConfig {
    /// Longest sleep between progress rounds once the worker is idle.
    pub idle_sleep: Duration,
    /// Idle rounds (with a yield between them) before the thread starts sleeping.
    pub idle_spins: u32,
}

impl Default for ProgressThreadConfig {
    fn default() -> Self {
        ProgressThreadConfig { idle_sleep: Duration::from_micros(200), idle_spins: 64 }
    }
}

/// An initialised UCP context. Shared (through `Arc`) by the agent's worker and by every
/// [`UcxMemory`](crate::UcxMemory) mapped in it, so it is cleaned up after all of them.
#[derive(Debug)]
pub(crate) struct Context {
    raw: NonNull<sys::ucp_context>,
}

// SAFETY: the context is created with `mt_workers_shared = 1`, which makes UCP protect the
// context-level calls (memory map/unmap, rkey pack, worker creation) with its own lock, so they may
// be made from any thread, concurrently.
unsafe impl Send for Context {}
// SAFETY: as for Send: every `&Context` call is a thread-safe context-level UCP call.
unsafe impl Sync for Context {}

/// A `ucp_config_t` released on drop.
struct ConfigGuard(*mut sys::ucp_config_t);

impl Drop for ConfigGuard {
    fn drop(&mut self) {
        // SAFETY: the pointer came from a successful ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(self.0) };
    }
}

impl Context {
    /// Loads UCX (once per process, see [`kvx_ucx_sys::load`]), reads its configuration
    /// (environment, with kvx's defaults), applies `config`'s options and initialises a context with RMA and active
    /// messages.
    pub(crate) fn new(config: &UcxConfig, name: &str) -> Result<Self> {
        // UCX reads the environment through a copy of its own: bring it up to date.
        load()?.refresh_environment(&UcxConfig::ENV_DEFAULTS);
        let mut raw_config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: null env prefix and file name mean the defaults; the out-pointer is valid.
        check(unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut raw_config) }, "ucp_config_read")?;
        let ucp_config = ConfigGuard(raw_config);
        for (key, value) in &config.options {
            let c_key = CString::new(key.as_str()).map_err(|_| {
                error(ErrorKind::InvalidArgument, format!("UCX option name {key:?} has a NUL"))
            })?;
            let c_value = CString::new(value.as_str())
                .map_err(|_| error(ErrorKind::InvalidArgument, format!("UCX option {key} has a NUL")))?;
            // SAFETY: the config is live; both strings are NUL-terminated and outlive the call.
            let status = unsafe { sys::ucp_config_modify(ucp_config.0, c_key.as_ptr(), c_value.as_ptr()) };
            check_as(ErrorKind::InvalidArgument, status, &format!("ucp_config_modify({key}={value})"))?;
        }

        let c_name = CString::new(name.replace('\0', "?")).unwrap_or_default();
        // SAFETY: ucp_params_t is a plain C struct for which all-zero is "no fields set".
        let mut params: sys::ucp_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(
            sys::UCP_PARAM_FIELD_FEATURES
                | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED
                | sys::UCP_PARAM_FIELD_NAME,
        );
        params.features = u64::from(sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM);
        params.mt_workers_shared = 1;
        params.name = c_name.as_ptr();
        let mut raw: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: params and config are valid for the call (UCP copies the name); out-pointer valid.
        check(unsafe { sys::ucp_init(&params, ucp_config.0, &mut raw) }, "ucp_init")?;
        let raw =
            NonNull::new(raw).ok_or_else(|| error(ErrorKind::Backend, "ucp_init returned no context"))?;
        Ok(Context { raw })
    }

    pub(crate) fn raw(&self) -> sys::ucp_context_h {
        self.raw.as_ptr()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context was initialised once; every worker and mapping holds an `Arc` to it,
        // so by now all of them are gone.
        unsafe { sys::ucp_cleanup(self.raw.as_ptr()) };
    }
}
