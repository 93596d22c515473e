//! Identifiers: engines, requests, blocks, agents.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Wraps a string.
            pub fn new(s: impl Into<String>) -> Self {
                $name(s.into())
            }

            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                $name(s.to_owned())
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                $name(s)
            }
        }
    };
}

string_id!(
    /// An inference engine instance (one per prefill or decode deployment, shared by its TP ranks).
    EngineId
);
string_id!(
    /// A request, as the engine names it. Its UTF-8 bytes are the transfer notification.
    RequestId
);
string_id!(
    /// A transport agent's name, unique among the agents that talk to each other.
    AgentName
);

/// A block index in an engine's paged KV cache.
pub type BlockId = u32;

/// A request's blocks in one KV-cache group, in token order: `ids[i]` holds the tokens of block
/// position `first + i` (position `p` holds tokens `p * block_size ..`). A full-attention group
/// starts at position 0; a sliding-window group that dropped the blocks before its window, or a
/// newly allocated part of a request, starts later. vLLM's hybrid models have one group per
/// attention type (`remote_block_ids` has one list per group).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct GroupBlocks {
    /// The block position of `ids[0]`.
    pub first: u32,
    /// The blocks.
    pub ids: Vec<BlockId>,
}

impl GroupBlocks {
    /// The blocks `ids` from position `first` on.
    pub fn new(first: u32, ids: Vec<BlockId>) -> Self {
        GroupBlocks { first, ids }
    }

    /// The blocks `ids` from position 0 on (a full-attention group, a model with one group).
    pub fn whole(ids: Vec<BlockId>) -> Self {
        GroupBlocks { first: 0, ids }
    }

    /// One past the last position.
    pub fn end(&self) -> u64 {
        u64::from(self.first) + self.ids.len() as u64
    }

    /// `groups` as a MAC's input: each group's first position, its length and its blocks, as
    /// little-endian u32s (so no two group splits of the same blocks share bytes).
    pub fn mac_bytes(groups: &[GroupBlocks]) -> Vec<u8> {
        groups
            .iter()
            .flat_map(|g| {
                [g.first, g.ids.len() as u32]
                    .into_iter()
                    .chain(g.ids.iter().copied())
                    .flat_map(u32::to_le_bytes)
            })
            .collect()
    }

    /// The blocks at positions `from..to`, if the group has every one of them.
    pub fn at(&self, from: u64, to: u64) -> Option<&[BlockId]> {
        let skip = usize::try_from(from.checked_sub(u64::from(self.first))?).ok()?;
        let take = usize::try_from(to.checked_sub(from)?).ok()?;
        self.ids.get(skip..skip.checked_add(take)?)
    }
}
