#![doc = include_str!("../README.md")]
#![deny(unsafe_code)] // Only `memio` (vectored I/O over registered memory) opts out, with reasons.

mod agent;
mod config;
mod error;
mod frame;
mod inner;
mod link;
mod listener;
mod memio;
mod metadata;
pub mod wire;

pub use agent::{TcpAgent, TcpStats};
pub use config::TcpConfig;

/// The backend name in capabilities and errors.
pub const BACKEND: &str = "tcp";

/// The most ranges one request names; a transfer's ranges are cut into chunks of at most this
/// many (and at most [`TcpConfig::chunk_bytes`] bytes).
pub const MAX_RANGES: usize = frame::MAX_RANGES;

#[cfg(test)]
mod tests;
