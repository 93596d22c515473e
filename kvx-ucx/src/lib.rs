#![doc = include_str!("../README.md")]

mod agent;
mod context;
mod memory;
mod status;
mod wire;

pub use agent::UcxAgent;
pub use context::{ProgressThreadConfig, ReadPath, UcxConfig};
pub use memory::UcxMemory;

/// The UCX library version this process runs (`ucp_get_version`), e.g. `(1, 13, 1)`; loads UCX
/// first ([`ErrorKind::NotAvailable`](kvx_core::ErrorKind::NotAvailable) when it cannot be loaded).
pub fn ucx_version() -> kvx_core::Result<(u32, u32, u32)> {
    status::load().map(kvx_ucx_sys::Lib::version)
}
