//! [`Clock`]: where the drivers around the sans-IO state machines take `now` from.
//!
//! The connector's state machines take `now` as an argument; whoever drives them asks a clock.
//! An engine uses [`SystemClock`]; a simulation uses a [`ManualClock`] that it moves forward
//! itself, so a 30 s lease costs no wall time and a run replays exactly.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A source of the current time.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current time.
    fn now(&self) -> Instant;
}

/// The operating system's monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that stands still until it is moved: a fixed base instant plus an offset that only
/// grows. Clones share the offset, so every engine of a simulation sees the same time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    base: Instant,
    /// Nanoseconds since `base` (584 years fit).
    offset_ns: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at the present instant, standing still.
    pub fn new() -> Self {
        ManualClock { base: Instant::now(), offset_ns: Arc::new(AtomicU64::new(0)) }
    }

    /// Time elapsed on this clock since it was created.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.offset_ns.load(Ordering::Acquire))
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .offset_ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |ns| Some(ns.saturating_add(by)));
    }

    /// Moves the clock forward to `to`; a time in its past changes nothing (the clock never goes
    /// back).
    pub fn advance_to(&self, to: Instant) {
        let ns = u64::try_from(to.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX);
        self.offset_ns.fetch_max(ns, Ordering::AcqRel);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + self.elapsed()
    }
}

/// The system clock, shared: the default of the drivers.
pub fn system_clock() -> Arc<dyn Clock> {
    Arc::new(SystemClock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_forward_and_its_clones_follow() {
        let clock = ManualClock::new();
        let shared = clock.clone();
        let t0 = clock.now();
        assert_eq!(clock.now(), t0, "it stands still");
        clock.advance(Duration::from_secs(30));
        assert_eq!(shared.now(), t0 + Duration::from_secs(30));
        shared.advance_to(t0 + Duration::from_secs(10));
        assert_eq!(clock.now(), t0 + Duration::from_secs(30), "never back");
        clock.advance_to(t0 + Duration::from_secs(45));
        assert_eq!(clock.elapsed(), Duration::from_secs(45));
        assert!(SystemClock.now() >= t0);
    }
}

/// A rate limit for logs: [`due`](Self::due) says yes at most once per period of the time it is
/// given (a sans-IO state machine's `now`, or `Instant::now()`).
#[derive(Debug, Clone)]
pub struct Every {
    period: Duration,
    last: Option<Instant>,
}

impl Every {
    /// Says yes at most once per `period`.
    pub fn new(period: Duration) -> Self {
        Every { period, last: None }
    }

    /// Whether the period has passed since the last yes (yes the first time); a yes starts a new
    /// period.
    pub fn due(&mut self, now: Instant) -> bool {
        let due = self.last.is_none_or(|last| now.saturating_duration_since(last) >= self.period);
        if due {
            self.last = Some(now);
        }
        due
    }
}
