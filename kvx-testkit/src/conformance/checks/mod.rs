//! The checks, grouped by concern. Each is a plain `pub fn check_*(h: &H)` that panics with a
//! message on failure, like `assert!`.

pub mod agents;
pub mod blocks;
pub mod completions;
pub mod data;
pub mod failures;
pub mod lifetimes;
pub mod validation;
