//! [`SimRng`]: the seeded random numbers of simulations (splitmix64), so that a seed replays a
//! run exactly without a dependency.

use std::time::Duration;

use super::model::mix;

/// A small seeded generator (splitmix64). Not for anything that needs unpredictability.
#[derive(Debug, Clone)]
pub struct SimRng {
    state: u64,
}

impl SimRng {
    /// A generator whose numbers are a function of `seed`.
    pub fn new(seed: u64) -> Self {
        SimRng { state: mix(seed, 0x7369_6d72_6e67) }
    }

    /// A generator for the stream `stream` of `seed`: independent of the other streams, so that
    /// drawing more from one leaves the others as they were.
    pub fn stream(seed: u64, stream: u64) -> Self {
        SimRng::new(mix(seed, stream))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.state, 0)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64 }
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo).saturating_add(1))
    }

    /// True with probability `p` (clamped to `0..=1`).
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p.clamp(0.0, 1.0)
    }

    /// Uniform in `lo..=hi`, at nanosecond resolution.
    pub fn duration(&mut self, lo: Duration, hi: Duration) -> Duration {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(self.range(ns(lo), ns(hi)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_and_draws_stay_in_range() {
        let mut a = SimRng::new(1);
        let mut b = SimRng::new(1);
        let xs: Vec<u64> = (0..100).map(|_| a.below(10)).collect();
        assert_eq!(xs, (0..100).map(|_| b.below(10)).collect::<Vec<_>>());
        assert!(xs.iter().all(|&x| x < 10) && xs.contains(&9));
        assert_ne!(SimRng::new(2).next_u64(), SimRng::new(1).next_u64());
        assert_ne!(SimRng::stream(1, 1).next_u64(), SimRng::stream(1, 2).next_u64());
        let mut r = SimRng::new(3);
        let hits = (0..10_000).filter(|_| r.chance(0.25)).count();
        assert!((2250..2750).contains(&hits), "{hits}");
        assert!(!r.chance(0.0) && r.chance(1.0));
        let d = r.duration(Duration::from_millis(5), Duration::from_millis(6));
        assert!(d >= Duration::from_millis(5) && d <= Duration::from_millis(6));
        assert_eq!(r.range(7, 7), 7);
    }
}
