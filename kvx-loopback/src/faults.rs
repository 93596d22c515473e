//! Fault injection: make transfers fail or lag, notifications vanish or double, handshakes fail.

/// Faults to inject, set on a whole [`Fabric`](crate::Fabric) or on one
/// [`LoopbackAgent`](crate::LoopbackAgent).
///
/// Counts start when the faults are set. Faults set on an agent count that agent's posts and
/// notifications; faults set on the fabric count those of all its agents. When both are set, a
/// fault of either applies (delays add up).
///
/// ```
/// use kvx_loopback::Faults;
/// // The second transfer posted from now on fails, and every transfer completes only on the
/// // third progress pass after it was posted.
/// let faults = Faults::none().fail_nth_transfer(2).delay_completion(2);
/// # let _ = faults;
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    fail_transfer: Option<u64>,
    delay_passes: u32,
    drop_notification: Option<u64>,
    duplicate_notification: Option<u64>,
    refuse_handshakes: bool,
}

impl Faults {
    /// No faults.
    pub fn none() -> Self {
        Faults::default()
    }

    /// The `n`-th transfer posted (counting from 1) fails when progress runs it: its state becomes
    /// `Failed`, no byte moves and no notification is sent.
    pub fn fail_nth_transfer(mut self, n: u64) -> Self {
        self.fail_transfer = Some(n);
        self
    }

    /// Every transfer stays `Pending` through `passes` progress passes and completes on the next.
    /// A pass is one call of `progress`, `poll` or `drain_notifications` (or one round of the
    /// progress thread).
    pub fn delay_completion(mut self, passes: u32) -> Self {
        self.delay_passes = passes;
        self
    }

    /// The `n`-th notification sent (counting from 1; with a transfer or alone) is lost. The
    /// transfer itself completes.
    pub fn drop_nth_notification(mut self, n: u64) -> Self {
        self.drop_notification = Some(n);
        self
    }

    /// The `n`-th notification sent (counting from 1) is delivered twice.
    pub fn duplicate_nth_notification(mut self, n: u64) -> Self {
        self.duplicate_notification = Some(n);
        self
    }

    /// Handshakes fail with `ErrorKind::Handshake`: on an agent, its `load_remote` and every peer's
    /// `load_remote` of its metadata; on the fabric, every `load_remote`.
    pub fn refuse_handshakes(mut self) -> Self {
        self.refuse_handshakes = true;
        self
    }
}

/// What happens to one notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    Drop,
    Once,
    Twice,
}

/// Faults plus the counters they refer to.
#[derive(Debug, Default)]
pub(crate) struct FaultPlan {
    faults: Faults,
    transfers: u64,
    notifications: u64,
}

/// What the plans decided for one posted transfer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TransferFate {
    pub(crate) fail: Option<u64>,
    pub(crate) delay_passes: u32,
}

impl FaultPlan {
    pub(crate) fn set(&mut self, faults: Faults) {
        *self = FaultPlan { faults, transfers: 0, notifications: 0 };
    }

    pub(crate) fn refuses_handshakes(&self) -> bool {
        self.faults.refuse_handshakes
    }

    /// Counts one posted transfer and says what becomes of it.
    pub(crate) fn next_transfer(&mut self) -> TransferFate {
        self.transfers = self.transfers.saturating_add(1);
        TransferFate {
            fail: (self.faults.fail_transfer == Some(self.transfers)).then_some(self.transfers),
            delay_passes: self.faults.delay_passes,
        }
    }

    /// Counts one sent notification and says how it is delivered.
    pub(crate) fn next_notification(&mut self) -> Delivery {
        self.notifications = self.notifications.saturating_add(1);
        if self.faults.drop_notification == Some(self.notifications) {
            Delivery::Drop
        } else if self.faults.duplicate_notification == Some(self.notifications) {
            Delivery::Twice
        } else {
            Delivery::Once
        }
    }
}

impl TransferFate {
    pub(crate) fn combine(self, other: TransferFate) -> TransferFate {
        TransferFate {
            fail: self.fail.or(other.fail),
            delay_passes: self.delay_passes.saturating_add(other.delay_passes),
        }
    }
}

impl Delivery {
    pub(crate) fn combine(self, other: Delivery) -> Delivery {
        match (self, other) {
            (Delivery::Drop, _) | (_, Delivery::Drop) => Delivery::Drop,
            (Delivery::Twice, _) | (_, Delivery::Twice) => Delivery::Twice,
            _ => Delivery::Once,
        }
    }

    pub(crate) fn copies(self) -> usize {
        match self {
            Delivery::Drop => 0,
            Delivery::Once => 1,
            Delivery::Twice => 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_count_from_one_after_being_set() {
        let mut plan = FaultPlan::default();
        plan.set(Faults::none().fail_nth_transfer(2).drop_nth_notification(1).duplicate_nth_notification(2));
        assert_eq!(plan.next_transfer().fail, None);
        assert_eq!(plan.next_transfer().fail, Some(2));
        assert_eq!(plan.next_transfer().fail, None);
        assert_eq!(plan.next_notification(), Delivery::Drop);
        assert_eq!(plan.next_notification(), Delivery::Twice);
        assert_eq!(plan.next_notification(), Delivery::Once);
        plan.set(Faults::none().fail_nth_transfer(1));
        assert_eq!(plan.next_transfer().fail, Some(1));
    }

    #[test]
    fn combined_fates_take_the_worst() {
        let a = TransferFate { fail: None, delay_passes: 2 };
        let b = TransferFate { fail: Some(3), delay_passes: 1 };
        assert_eq!(a.combine(b), TransferFate { fail: Some(3), delay_passes: 3 });
        assert_eq!(Delivery::Twice.combine(Delivery::Drop), Delivery::Drop);
        assert_eq!(Delivery::Once.combine(Delivery::Twice).copies(), 2);
    }
}
