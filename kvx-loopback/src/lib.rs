#![doc = include_str!("../README.md")]
#![deny(unsafe_code)] // Only `copy` (the loopback memcpy) opts out, with reasons.

mod agent;
mod copy;
mod fabric;
mod metadata;

pub use agent::{AgentOptions, LoopbackAgent};
pub use fabric::Fabric;

use std::sync::{Mutex, MutexGuard};

use kvx_core::{Error, ErrorKind, Result};

/// The backend name in capabilities and errors.
pub const BACKEND: &str = "loopback";

/// Locks `mutex`; a lock poisoned by a panicking thread is a `State` error, not a panic.
fn lock<'a, T>(mutex: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>> {
    mutex.lock().map_err(|_| {
        Error::new(ErrorKind::State, format!("the {what} lock is poisoned: a thread panicked holding it"))
            .with_backend(BACKEND)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_a_state_error() {
        let m = std::sync::Arc::new(Mutex::new(0));
        let held = m.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.lock();
            panic!("poison the lock");
        })
        .join();
        let e = lock(&m, "test").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::State);
        assert_eq!(e.backend(), Some(BACKEND));
    }
}

/// The workspace README's example of an engine using kvx-core with a backend, compiled and run as
/// a doctest here (the crate that has both).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct WorkspaceReadme;
