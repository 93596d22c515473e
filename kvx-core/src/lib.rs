#![doc = include_str!("../README.md")]
#![deny(unsafe_code)] // Only `memory` (the KvMemory contract and HostMemory) opts out, with reasons.

pub mod error;
pub mod ids;
pub mod memory;
pub mod transfer;

pub use error::{Error, ErrorKind, Result};
pub use ids::{AgentName, BlockId, EngineId, RequestId};
pub use memory::{HostMemory, KvMemory, MemKind, MemRegion};
pub use transfer::{
    BlockList, Capabilities, DlistId, DlistOwner, Notification, RegistrationId, TransferAgent, XferId, XferOp,
    XferState,
};
