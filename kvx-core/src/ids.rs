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
