//! kvx's background threads inside an engine that pins its compute threads.
//!
//! vLLM's CPU worker binds its step thread (OpenMP's first thread) to one core, and a thread
//! inherits its creator's CPU mask: without care, kvx's tokio runtime and the transport's own
//! threads (NIXL's UCX thread pool, kvx-ucx's progress thread) all land on that one core, next to
//! the step thread, which spins while it waits for work. On a small machine the side channel then
//! cannot answer and connection setup stalls (measured on 2 vCPUs: handshakes timed out and one
//! NIXL connect took 170 s). The Python connector also moves the step thread to the cores vLLM
//! reserves for KV transfer, as vLLM's NixlConnector does; with both, the same P/D requests take
//! about a second.

use pyo3::PyResult;
use pyo3::exceptions::PyRuntimeError;

/// Runs `f` on a helper thread whose CPU mask is every CPU this process may use, and returns its
/// result: threads that `f` starts inherit that mask instead of the calling thread's pinning.
///
/// The kernel restricts the mask to the process's cpuset, so this never reaches beyond what the
/// process was given. If the mask cannot be set, `f` still runs and the reason is logged.
pub fn unpinned<T: Send>(f: impl FnOnce() -> T + Send) -> PyResult<T> {
    std::thread::scope(|s| {
        let helper = std::thread::Builder::new()
            .name("kvx-setup".into())
            .spawn_scoped(s, || {
                if let Err(e) = allow_all_cpus() {
                    tracing::warn!(error = %e, "kvx's threads keep the engine thread's CPU pinning");
                }
                f()
            })
            .map_err(|e| PyRuntimeError::new_err(format!("starting kvx's setup thread: {e}")))?;
        helper.join().map_err(|_| PyRuntimeError::new_err("kvx's setup thread panicked"))
    })
}

#[cfg(target_os = "linux")]
fn allow_all_cpus() -> std::io::Result<()> {
    // SAFETY: `cpu_set_t` is a plain bit array of exactly this size, valid for any bit pattern;
    // all ones names every CPU.
    let set: libc::cpu_set_t = unsafe { std::mem::transmute([0xffu8; size_of::<libc::cpu_set_t>()]) };
    // SAFETY: `set` is an initialised cpu_set_t that outlives the call, its size is passed with
    // it, and pid 0 names the calling thread; the kernel only reads the mask.
    let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

#[cfg(not(target_os = "linux"))]
fn allow_all_cpus() -> std::io::Result<()> {
    Ok(())
}
