#![doc = include_str!("../README.md")]
#![deny(unsafe_code)] // Only `memory` (the KvMemory contract and HostMemory) opts out, with reasons.

pub mod auth;
pub mod clock;
pub mod error;
pub mod exchange;
pub mod group;
pub mod host;
pub mod ids;
pub mod layout;
pub mod memory;
pub mod meta;
pub mod params;
pub mod post;
pub mod scheduler;
pub mod tp;
pub mod transfer;
pub mod wire;
pub mod worker;

pub use auth::{AuthKey, HexBytes, MacTag, Nonce, NonceSource, PromptDigest};
pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{Error, ErrorKind, Result};
pub use exchange::{MetadataExchange, PeerLocator};
pub use group::{InProcessGroup, ParallelGroup, SingleRank};
pub use host::HostScope;
pub use ids::{AgentName, BlockId, EngineId, GroupBlocks, RequestId};
pub use layout::{AttentionKind, KvCacheLayout, LayerCache};
pub use memory::{ByteAccess, HostMemory, KvMemory, MemKind, MemRegion};
pub use meta::{
    ConnectorMetadata, FailedRecv, Finished, Heartbeat, HeldRequest, HoldRelease, HoldStatus, PushCancel,
    PushHold, PushRegistration, PushResult, RankReport, RecvRequest, RenewLeases, ReplyTo,
};
pub use params::{Endpoint, Offer, RemoteCoordinates, TransferMode, TransferParams};
pub use post::{BlockPlan, BlockPostRequest, PostPlan, PostRequest};
pub use scheduler::{ConnectorScheduler, FinishOutcome, FinishReason, MatchedTokens, SchedulerConfig};
pub use transfer::{
    BlockList, BlockPost, Capabilities, DlistId, DlistOwner, MAX_NOTIFICATION_LEN, Notification,
    NotificationWaker, RegionBlocks, RegistrationId, TransferAgent, XferId, XferOp, XferState,
};
pub use worker::{
    AggregatorLimits, AggregatorStats, ConnectorWorker, FinishedAggregator, Histogram, LoadTimes, Samples,
    TransferRecord, WorkerCommand, WorkerConfig, WorkerStats,
};

/// Test doubles of `TransferAgent` (feature `testing`).
#[cfg(any(test, feature = "testing"))]
pub mod testing;

/// mockall mocks of the three traits (feature `mock`).
#[cfg(any(test, feature = "mock"))]
pub mod mock {
    pub use crate::exchange::MockMetadataExchange;
    pub use crate::group::MockParallelGroup;
    pub use crate::transfer::MockTransferAgent;
}
