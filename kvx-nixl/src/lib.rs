#![doc = include_str!("../README.md")]

mod agent;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod library;
mod metadata;

pub use agent::{NixlAgent, NixlConfig};
#[cfg(feature = "cuda")]
pub use cuda::CudaMemory;
pub use library::check_library;

/// The backend name in errors and [`kvx_core::Capabilities::backend`].
pub const BACKEND: &str = "nixl";
