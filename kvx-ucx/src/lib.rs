#![doc = include_str!("../README.md")]

mod agent;
mod context;
mod memory;
mod status;
mod wire;

pub use agent::UcxAgent;
pub use context::{ProgressThreadConfig, UcxConfig};
pub use memory::UcxMemory;

/// The UCX library version this process runs (`ucp_get_version`), e.g. `(1, 13, 1)`.
pub fn ucx_version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: writes three integers through valid pointers.
    unsafe { kvx_ucx_sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}
