//! Latency samples in bounded memory: a reservoir (Vitter's algorithm R) of at most
//! [`Samples::CAPACITY`] durations, each kept with equal probability, plus exact count and max.
//! Percentiles over the reservoir are unbiased estimates; a worker that runs for days keeps 64 KiB.

use std::time::Duration;

/// Durations sampled into a bounded reservoir.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Samples {
    kept: Vec<Duration>,
    seen: u64,
    max: Duration,
    /// A xorshift state, so that which samples stay is deterministic.
    rng: u64,
}

impl Samples {
    /// The most samples kept.
    pub const CAPACITY: usize = 4096;

    /// Adds a sample.
    pub fn push(&mut self, d: Duration) {
        self.seen += 1;
        self.max = self.max.max(d);
        if self.kept.len() < Self::CAPACITY {
            self.kept.push(d);
            return;
        }
        let slot = self.next_random() % self.seen;
        if let Some(s) = usize::try_from(slot).ok().and_then(|i| self.kept.get_mut(i)) {
            *s = d;
        }
    }

    fn next_random(&mut self) -> u64 {
        let mut x = if self.rng == 0 { 0x9E37_79B9_7F4A_7C15 } else { self.rng };
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }

    /// The samples kept (all of them while fewer than [`CAPACITY`](Self::CAPACITY) came).
    pub fn kept(&self) -> &[Duration] {
        &self.kept
    }

    /// How many samples came in all.
    pub fn count(&self) -> u64 {
        self.seen
    }

    /// The largest sample that came (`ZERO` before any).
    pub fn max(&self) -> Duration {
        self.max
    }

    /// Empties the reservoir and returns the samples it kept.
    pub fn take(&mut self) -> Vec<Duration> {
        let kept = std::mem::take(&mut self.kept);
        *self = Samples { rng: self.rng, ..Samples::default() };
        kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_bounded_and_count_and_max_are_exact() {
        let mut s = Samples::default();
        for i in 0..100_000u64 {
            s.push(Duration::from_micros(i));
        }
        assert_eq!(s.kept().len(), Samples::CAPACITY);
        assert_eq!((s.count(), s.max()), (100_000, Duration::from_micros(99_999)));
        // An unbiased reservoir of 0..100k: its mean is near 50k (4096 samples: sd ~450).
        let mean = s.kept().iter().map(|d| d.as_micros()).sum::<u128>() / s.kept().len() as u128;
        assert!((45_000..55_000).contains(&mean), "mean {mean}");
        assert!(s.kept().iter().any(|d| d.as_micros() >= 90_000), "late samples get in");
        assert_eq!(s.take().len(), Samples::CAPACITY);
        assert_eq!((s.kept().len(), s.count(), s.max()), (0, 0, Duration::ZERO));
    }
}
