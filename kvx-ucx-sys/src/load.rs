//! Opens UCX's libraries in a link-map namespace of their own and resolves the bound functions.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_char, c_void};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use crate::generated::{Functions, UCP_API_MAJOR, UCP_API_MINOR};

/// The environment variable naming the directory UCX's libraries are loaded from, instead of the
/// one pkg-config named when this crate was built.
pub const LIBDIR_VAR: &str = "KVX_UCX_LIBDIR";

/// The library opened by path, and the UCX libraries it loads by soname, which must come from
/// the same directory.
const LIBUCP: &str = "libucp.so.0";
const DEPENDENCIES: [&str; 3] = ["libucs.so.0", "libuct.so.0", "libucm.so.0"];

/// `locale_t`'s `LC_GLOBAL_LOCALE` of `<locale.h>`.
const LC_GLOBAL_LOCALE: libc::locale_t = -1isize as libc::locale_t;

/// The loaded UCX: where it was loaded from, its version and the bound functions.
pub struct Lib {
    dir: PathBuf,
    version: (u32, u32, u32),
    functions: Functions,
    /// `uselocale` of the namespace's own C library (see [`functions`]).
    uselocale: unsafe extern "C" fn(libc::locale_t) -> libc::locale_t,
    /// `environ` of the namespace's own C library (see [`Lib::refresh_environment`]).
    environ: &'static AtomicPtr<*mut c_char>,
    /// The namespace C library's `<stdio.h>` memory streams (see [`Lib::endpoint_info`]).
    stdio: Stdio,
}

/// `open_memstream`, `fclose` and `free` of the namespace's own C library: UCX's C library must
/// write to a stream it made itself (glibc refuses a `FILE` of another C library's instance).
struct Stdio {
    open_memstream: unsafe extern "C" fn(*mut *mut c_char, *mut usize) -> *mut libc::FILE,
    fclose: unsafe extern "C" fn(*mut libc::FILE) -> libc::c_int,
    free: unsafe extern "C" fn(*mut c_void),
}

impl Lib {
    /// The directory the libraries were loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The library's version (`ucp_get_version`), e.g. `(1, 13, 1)`.
    pub fn version(&self) -> (u32, u32, u32) {
        self.version
    }

    /// Gives UCX a copy of the program's environment as it is now.
    ///
    /// UCX reads its `UCX_*` variables (in `ucp_config_read`, or `ucp_init` without a config)
    /// through the namespace's own C library, whose environment is a copy taken by [`load`] and
    /// by each call of this, not the program's: the program's `setenv` may free the array its
    /// own C library reads. A copy is kept for good (UCX may still be reading the previous one on
    /// another thread), and a new one is made only when the environment changed.
    ///
    /// `defaults` are variables UCX sees with these values when the program's environment does
    /// not set them (the program's own environment is left alone).
    pub fn refresh_environment(&self, defaults: &[(&str, &str)]) {
        static GIVEN: Mutex<&'static [CString]> = Mutex::new(&[]);
        let entry = |name: &[u8], value: &[u8]| {
            let mut entry = name.to_vec();
            entry.push(b'=');
            entry.extend_from_slice(value);
            // The environment holds C strings: an entry with a NUL cannot be there.
            CString::new(entry).ok()
        };
        let mut current: Vec<CString> = std::env::vars_os()
            .filter_map(|(name, value)| entry(name.as_bytes(), value.as_bytes()))
            .collect();
        let unset = defaults.iter().filter(|(name, _)| std::env::var_os(name).is_none());
        current.extend(unset.filter_map(|(name, value)| entry(name.as_bytes(), value.as_bytes())));
        // The guarded data is a slice that is only ever replaced whole: never inconsistent.
        let mut given = GIVEN.lock().unwrap_or_else(PoisonError::into_inner);
        if **given == current[..] {
            return;
        }
        let entries: &'static [CString] = Vec::leak(current);
        let array: Vec<*mut c_char> =
            entries.iter().map(|entry| entry.as_ptr().cast_mut()).chain([std::ptr::null_mut()]).collect();
        self.environ.store(Vec::leak(array).as_mut_ptr(), Ordering::Release);
        *given = entries;
    }

    /// What `ucp_ep_print_info` says of `ep`: its lanes (one line each, such as
    /// `lane[0]:  0:tcp/lo.0 md[0] -> md[0]/tcp/sysdev[255] rma_bw#0 am am_bw#0`) and protocol
    /// thresholds. `None` when the namespace's C library could not open a memory stream.
    ///
    /// # Safety
    /// `ep` must be a live endpoint, used as its worker's thread mode allows.
    pub unsafe fn endpoint_info(&self, ep: crate::ucp_ep_h) -> Option<String> {
        let mut buffer: *mut c_char = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: valid out-pointers, which the stream updates until it is closed.
        let stream = unsafe { (self.stdio.open_memstream)(&mut buffer, &mut len) };
        if stream.is_null() {
            return None;
        }
        // SAFETY: a live endpoint (the caller's promise) and an open stream of UCX's C library.
        unsafe { crate::ucp_ep_print_info(ep, stream.cast()) };
        // SAFETY: the stream is open; closing it sets `buffer` and `len` for the last time.
        let closed = unsafe { (self.stdio.fclose)(stream) };
        if buffer.is_null() {
            return None;
        }
        // SAFETY: after fclose, `buffer` holds `len` bytes (plus a NUL); copied at once.
        let text = unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), len) };
        let text = String::from_utf8_lossy(text).into_owned();
        // SAFETY: allocated by the namespace's C library (see above), freed once, by it.
        unsafe { (self.stdio.free)(buffer.cast()) };
        (closed == 0).then_some(text)
    }
}

impl fmt::Debug for Lib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lib").field("dir", &self.dir).field("version", &self.version).finish_non_exhaustive()
    }
}

/// Why UCX could not be loaded: a library missing or not loadable, a function missing, or a
/// version older than the headers these bindings were generated from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    message: String,
}

impl LoadError {
    fn new(message: impl Into<String>) -> Self {
        LoadError { message: message.into() }
    }
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UCX could not be loaded: {}", self.message)
    }
}

impl std::error::Error for LoadError {}

static LIB: OnceLock<Result<Lib, LoadError>> = OnceLock::new();

/// Loads UCX on the first call (later calls return the first call's result): opens `libucp.so.0`
/// by full path from [`LIBDIR_VAR`]'s directory, or else the one pkg-config named at build time,
/// in a new link-map namespace (`dlmopen(LM_ID_NEWLM)`), checks that the UCX libraries it brought
/// in (`libucs`, `libuct`, `libucm`) come from the same directory, resolves every bound function
/// and checks that the library is at least as new as the headers.
///
/// Nothing is unloaded, not even after a failure: UCX's constructors may have started work that
/// an unload would cut off.
pub fn load() -> Result<&'static Lib, LoadError> {
    LIB.get_or_init(open).as_ref().map_err(Clone::clone)
}

thread_local! {
    /// Whether this thread's state in the namespace's C library is set up (see [`functions`]).
    static THREAD_READY: Cell<bool> = const { Cell::new(false) };
}

/// The function table, for the generated wrappers.
///
/// The namespace has its own C library, which sets up its per-thread `<ctype.h>` tables only on
/// the thread that loaded it and on threads it starts itself: on a thread the program started,
/// UCX's first `isspace` would read through a null table. So the first call on each thread sets
/// them, through the namespace's `uselocale(LC_GLOBAL_LOCALE)`.
pub(crate) fn functions() -> &'static Functions {
    let lib = match load() {
        Ok(lib) => lib,
        Err(e) => panic!("{e} (call kvx_ucx_sys::load() first to get this as an error)"),
    };
    if !THREAD_READY.get() {
        // SAFETY: selects the global locale for this thread in the namespace's C library, which
        // also points its ctype tables at the global locale's.
        unsafe { (lib.uselocale)(LC_GLOBAL_LOCALE) };
        THREAD_READY.set(true);
    }
    &lib.functions
}

/// `dlerror()`'s message, or `fallback` when there is none.
fn dl_error(fallback: &str) -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        fallback.to_owned()
    } else {
        // SAFETY: non-null, so a NUL-terminated string (see above).
        unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
    }
}

/// `path` with symbolic links resolved (`/lib` is a link to `/usr/lib` on merged-usr systems).
fn canonical(path: &Path) -> Result<PathBuf, LoadError> {
    path.canonicalize().map_err(|e| LoadError::new(format!("{}: {e}", path.display())))
}

/// The directory that the library `name` (a soname) loaded in `namespace` came from.
fn origin(namespace: libc::Lmid_t, name: &str) -> Result<PathBuf, LoadError> {
    let c_name = CString::new(name).map_err(|_| LoadError::new(format!("{name} has a NUL")))?;
    // SAFETY: a NUL-terminated name; RTLD_NOLOAD only finds an already loaded library.
    let handle = unsafe { libc::dlmopen(namespace, c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return Err(LoadError::new(dl_error(&format!("{LIBUCP} did not load {name}"))));
    }
    let mut buffer = [0 as c_char; libc::PATH_MAX as usize];
    // SAFETY: a live handle; RTLD_DI_ORIGIN copies a directory name (shorter than PATH_MAX) with its
    // NUL into the buffer.
    if unsafe { libc::dlinfo(handle, libc::RTLD_DI_ORIGIN, buffer.as_mut_ptr().cast::<c_void>()) } != 0 {
        return Err(LoadError::new(dl_error(&format!("dlinfo(RTLD_DI_ORIGIN) of {name} failed"))));
    }
    // SAFETY: dlinfo wrote a NUL-terminated string into the buffer.
    let origin = unsafe { CStr::from_ptr(buffer.as_ptr()) };
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(origin.to_bytes())))
}

fn open() -> Result<Lib, LoadError> {
    let dir =
        std::env::var_os(LIBDIR_VAR).map_or_else(|| PathBuf::from(env!("KVX_UCX_SYS_LIBDIR")), PathBuf::from);
    let path = dir.join(LIBUCP);
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| LoadError::new(format!("{} has a NUL", path.display())))?;
    // SAFETY: a NUL-terminated path, opened into a namespace of its own.
    let handle =
        unsafe { libc::dlmopen(libc::LM_ID_NEWLM, c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(LoadError::new(dl_error(&format!("dlmopen({}) failed", path.display()))));
    }
    let mut namespace: libc::Lmid_t = 0;
    // SAFETY: a live handle; RTLD_DI_LMID writes one Lmid_t.
    if unsafe { libc::dlinfo(handle, libc::RTLD_DI_LMID, (&raw mut namespace).cast::<c_void>()) } != 0 {
        return Err(LoadError::new(dl_error("dlinfo(RTLD_DI_LMID) failed")));
    }
    let canonical_dir = canonical(&dir)?;
    for name in DEPENDENCIES {
        let origin = origin(namespace, name)?;
        if canonical(&origin)? != canonical_dir {
            return Err(LoadError::new(format!(
                "{} loaded {name} from {} (LD_LIBRARY_PATH?), not from {}",
                path.display(),
                origin.display(),
                dir.display()
            )));
        }
    }
    // dlsym on libucp's handle searches libucp, then its dependencies (`ucs_status_string` is
    // libucs's).
    let lookup = |name: &'static CStr| {
        // SAFETY: a live handle and a NUL-terminated name.
        let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
        if address.is_null() {
            Err(LoadError::new(format!("{} has no {}", dir.display(), name.to_string_lossy())))
        } else {
            Ok(address)
        }
    };
    // SAFETY: the names are looked up in UCX's own libraries, whose API the bindings declare; a
    // library older than the headers is refused below before any other function is called.
    let functions = unsafe { Functions::resolve(lookup) }?;
    // SAFETY: `uselocale` of the C library that libucp's namespace loaded, whose C type this is.
    let uselocale = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(libc::locale_t) -> libc::locale_t>(lookup(
            c"uselocale",
        )?)
    };
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: writes three integers through valid pointers (a function of every UCP version).
    unsafe { (functions.ucp_get_version)(&mut major, &mut minor, &mut release) };
    if major != UCP_API_MAJOR || minor < UCP_API_MINOR {
        return Err(LoadError::new(format!(
            "{} has UCX {major}.{minor}.{release}; these bindings need {UCP_API_MAJOR}.x >= \
             {UCP_API_MAJOR}.{UCP_API_MINOR}",
            dir.display()
        )));
    }
    // SAFETY: the namespace C library's `environ`, a `char **` variable: an atomic pointer has
    // its size and alignment, and the variable lives as long as the namespace, for good.
    let environ = unsafe { &*lookup(c"environ")?.cast::<AtomicPtr<*mut c_char>>() };
    // SAFETY: the namespace C library's functions of these names, whose C types these are.
    let stdio = unsafe {
        Stdio {
            open_memstream: std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(*mut *mut c_char, *mut usize) -> *mut libc::FILE,
            >(lookup(c"open_memstream")?),
            fclose: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut libc::FILE) -> libc::c_int>(
                lookup(c"fclose")?,
            ),
            free: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void)>(lookup(c"free")?),
        }
    };
    let lib = Lib { dir, version: (major, minor, release), functions, uselocale, environ, stdio };
    // Until now the namespace read the program's own array, which a later `setenv` may free.
    lib.refresh_environment(&[]);
    Ok(lib)
}
