//! One engine's place in a soak's deployment.

use std::any::Any;
use std::time::Instant;

use super::tally::Role;
use crate::sim::SimEngine;

/// One engine's place in the deployment: the engine while it is up, its side-channel ports
/// (kept across restarts), and what holds it back.
pub(super) struct Slot {
    pub(super) role: Role,
    pub(super) index: usize,
    pub(super) engine: Option<SimEngine>,
    pub(super) port: Option<u16>,
    pub(super) down_until: Option<Instant>,
    pub(super) stalled_until: Option<Instant>,
}

impl Slot {
    pub(super) fn name(&self) -> String {
        format!("{}-{}", self.role, self.index)
    }

    /// The engine, when it is up and its steps are not stalled at `now`.
    pub(super) fn running(&mut self, now: Instant) -> Option<&mut SimEngine> {
        if self.stalled_until.is_some_and(|t| t > now) { None } else { self.engine.as_mut() }
    }
}

/// What a caught panic said.
pub(super) fn panic_message(panic: &(dyn Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_owned(),
        (_, Some(s)) => s.clone(),
        _ => "a panic without a message".to_owned(),
    }
}
