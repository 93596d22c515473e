//! The boundary with the NIXL library: is it there, is it the right one, and what must not run
//! concurrently.
//!
//! nixl-sys (feature `stub-api`) `dlopen`s `libnixl_capi.so` on first use and forwards each call;
//! if the library or one of its symbols is missing, that call **aborts the process**. So before the
//! first NIXL call, [`check_library`] loads the library itself, checks every symbol kvx-nixl reaches
//! through nixl-sys, and confirms with [`nixl_sys::is_stub`] that nixl-sys found it too. Failures are
//! an [`ErrorKind::NotAvailable`] error, never an abort.

use std::ffi::{CStr, CString};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use kvx_core::{ErrorKind, Result};

use crate::error::error;

/// The file nixl-sys `dlopen`s.
const CAPI_LIBRARY: &str = "libnixl_capi.so";

/// Every C function that kvx-nixl's calls into nixl-sys reach (nixl-sys resolves each one lazily
/// and aborts if it is missing, so all of them are checked up front).
const REQUIRED_SYMBOLS: &[&str] = &[
    "nixl_capi_create_configured_agent",
    "nixl_capi_destroy_agent",
    "nixl_capi_get_plugin_params",
    "nixl_capi_create_backend",
    "nixl_capi_destroy_backend",
    "nixl_capi_get_backend_params",
    "nixl_capi_destroy_params",
    "nixl_capi_destroy_mem_list",
    "nixl_capi_mem_list_size",
    "nixl_capi_mem_list_get",
    "nixl_capi_create_reg_dlist",
    "nixl_capi_reg_dlist_add_desc",
    "nixl_capi_reg_dlist_clear",
    "nixl_capi_destroy_reg_dlist",
    "nixl_capi_register_mem",
    "nixl_capi_deregister_mem",
    "nixl_capi_create_opt_args",
    "nixl_capi_destroy_opt_args",
    "nixl_capi_opt_args_set_has_notif",
    "nixl_capi_opt_args_set_notif_msg",
    "nixl_capi_get_local_md",
    "nixl_capi_load_remote_md",
    "nixl_capi_invalidate_remote_md",
    "nixl_capi_create_xfer_dlist",
    "nixl_capi_xfer_dlist_add_desc",
    "nixl_capi_xfer_dlist_clear",
    "nixl_capi_destroy_xfer_dlist",
    "nixl_capi_prep_xfer_dlist",
    "nixl_capi_release_xfer_dlist_handle",
    "nixl_capi_make_xfer_req",
    "nixl_capi_post_xfer_req",
    "nixl_capi_get_xfer_status",
    "nixl_capi_release_xfer_req",
    "nixl_capi_destroy_xfer_req",
    "nixl_capi_gen_notif",
    "nixl_capi_create_notif_map",
    "nixl_capi_destroy_notif_map",
    "nixl_capi_get_notifs",
    "nixl_capi_notif_map_size",
    "nixl_capi_notif_map_get_agent_at",
    "nixl_capi_notif_map_get_notifs_size",
    "nixl_capi_notif_map_get_notif",
];

/// `UCX_MODULES` value that keeps NIXL's bundled UCX away from the system's InfiniBand modules.
const UCX_MODULES_DEFAULT: &str = "^ib*";

/// Whether the real NIXL library is usable, checked once per process.
///
/// On the first call this also sets `UCX_MODULES='^ib*'` if it is unset (see the crate docs), then
/// loads `libnixl_capi.so` and checks its symbols. Returns [`ErrorKind::NotAvailable`] if the
/// library cannot be loaded (not installed, not on `LD_LIBRARY_PATH`) or lacks a symbol (a
/// different NIXL version). [`NixlAgent::new`](crate::NixlAgent::new) calls it first.
pub fn check_library() -> Result<()> {
    static CHECKED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    CHECKED
        .get_or_init(|| {
            let _guard = lifecycle_lock();
            set_ucx_modules_default();
            load_and_check()
        })
        .clone()
        .map_err(|message| error(ErrorKind::NotAvailable, message))
}

/// Serialises the creation and destruction of NIXL agents in this process: NIXL agents created
/// concurrently can deadlock (NIXL's own tests run single-threaded for this reason).
pub(crate) fn lifecycle_lock() -> MutexGuard<'static, ()> {
    static LIFECYCLE: Mutex<()> = Mutex::new(());
    // The guarded data is `()`: a panic while it was held leaves nothing inconsistent.
    LIFECYCLE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn set_ucx_modules_default() {
    if std::env::var_os("UCX_MODULES").is_some() {
        return;
    }
    tracing::info!("UCX_MODULES unset: setting it to '{UCX_MODULES_DEFAULT}' before loading NIXL");
    // SAFETY: `set_var` races with threads that read the environment through libc without Rust's
    // environment lock. It runs once, before this process has loaded NIXL or UCX (the threads
    // that read `UCX_*`), under the lifecycle lock. Processes that start their own C threads
    // earlier should set UCX_MODULES themselves (scripts/nixl-env.sh does), which skips this.
    unsafe { std::env::set_var("UCX_MODULES", UCX_MODULES_DEFAULT) };
}

fn load_and_check() -> std::result::Result<(), String> {
    let name = CString::new(CAPI_LIBRARY).map_err(|e| e.to_string())?;
    // SAFETY: `name` is a valid C string. Loading runs the library's initialisers, which is what
    // nixl-sys would do on its first call anyway; the handle is deliberately never closed, so the
    // library stays loaded for nixl-sys (which holds its own handle to the same object).
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(format!(
            "{CAPI_LIBRARY} could not be loaded ({}); install NIXL with scripts/install-nixl.sh and \
             `source scripts/nixl-env.sh` (puts the wheel's library directory on LD_LIBRARY_PATH)",
            dlerror_message()
        ));
    }
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        .filter(|symbol| {
            let Ok(c_symbol) = CString::new(*symbol) else { return true };
            // SAFETY: `handle` is a live handle from dlopen and `c_symbol` a valid C string; dlsym
            // only looks the name up.
            unsafe { libc::dlsym(handle, c_symbol.as_ptr()) }.is_null()
        })
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{CAPI_LIBRARY} lacks {missing:?}: a NIXL C API other than the one nixl-sys 1.5.2 binds \
             (use the nixl-cu12 1.5.1 wheel)"
        ));
    }
    // nixl-sys's stub keeps its own dlopen result; with the library loadable it must agree.
    if nixl_sys::is_stub() {
        return Err(format!("nixl-sys could not load {CAPI_LIBRARY} although kvx-nixl could"));
    }
    Ok(())
}

fn dlerror_message() -> String {
    // SAFETY: dlerror returns null or a C string valid until the next dl* call on this thread,
    // which we copy out at once.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        return "no dlerror message".to_owned();
    }
    // SAFETY: non-null, NUL-terminated string from dlerror (see above).
    unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
}
