//! What the chaos layer keeps for each agent: its faults, its transfers, its late notifications.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::sync::atomic::AtomicI64;
use std::time::Instant;

use kvx_core::{AgentName, DlistId, XferId};

use super::faults::{Delivery, FaultPlan};

/// The part of a [`Chaos`] agent that its net reaches.
#[derive(Default)]
pub(super) struct Shared {
    pub(super) faults: Mutex<FaultPlan>,
    pub(super) state: Mutex<State>,
    /// Notifications agents of the net sent it, less those it drained: while above zero, some
    /// wait to be drained. (Apart from the state: senders add to it holding their own state.)
    pub(super) unread: AtomicI64,
}

/// A transfer of the layer.
#[derive(Debug)]
pub(super) struct Xfer {
    /// The wrapped agent's transfer; none for a transfer made to fail.
    pub(super) inner: Option<XferId>,
    /// Why it fails, when a fault made it.
    pub(super) fail: Option<String>,
    /// The pass after which it may complete, when it waits for passes.
    pub(super) after_pass: Option<u64>,
    /// When it may complete, when it waits for the clock.
    pub(super) not_before: Option<Instant>,
    /// Its transport is done with it.
    pub(super) inner_ended: bool,
    /// It completed for the caller (and went to `ended`).
    pub(super) visible: bool,
    /// The notification the layer sends once it is done, taken off the transfer by faults.
    pub(super) notification: Option<Outgoing>,
    /// Where the notification that the transfer carries itself goes.
    pub(super) carried_to: Option<AgentName>,
}

/// A notification faults struck, and what they decided.
#[derive(Debug)]
pub(super) struct Outgoing {
    pub(super) to: AgentName,
    pub(super) msg: Vec<u8>,
    pub(super) key: u64,
    pub(super) delivery: Delivery,
}

#[derive(Debug, Default)]
pub(super) struct State {
    /// Progress passes so far.
    pub(super) passes: u64,
    pub(super) next_id: u64,
    pub(super) xfers: HashMap<u64, Xfer>,
    /// The layer's transfer of each transfer of the wrapped agent.
    pub(super) by_inner: HashMap<XferId, u64>,
    /// Transfers whose transport is done but whose completion waits.
    pub(super) waiting: BTreeSet<u64>,
    /// Transfers that completed and that `drain_completions` has not reported yet.
    pub(super) ended: Vec<u64>,
    /// The peer of each remote list.
    pub(super) remote_lists: HashMap<DlistId, AgentName>,
    /// Late notifications: when, their key (which orders those due together), to whom, what.
    pub(super) late: Vec<(Instant, u64, AgentName, Vec<u8>)>,
}

impl State {
    pub(super) fn ready(&self, x: &Xfer, now: Instant) -> bool {
        x.inner_ended && x.after_pass.is_none_or(|p| self.passes > p) && x.not_before.is_none_or(|t| t <= now)
    }

    pub(super) fn next_event(&self, now: Instant) -> Option<Instant> {
        let transfers =
            self.xfers.values().filter(|x| !x.visible).map(|x| match (x.inner_ended, x.after_pass) {
                (true, None) => x.not_before.unwrap_or(now).max(now),
                _ => now,
            });
        let ended = (!self.ended.is_empty()).then_some(now);
        let late = self.late.iter().map(|(due, ..)| (*due).max(now));
        transfers.chain(ended).chain(late).min()
    }
}
