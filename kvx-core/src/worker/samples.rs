//! Latency samples in bounded memory: a reservoir (Vitter's algorithm R) of at most
//! [`Samples::CAPACITY`] durations, each kept with equal probability, plus exact count and max;
//! and a cumulative [`Histogram`] of every sample, which taking the reservoir leaves alone.
//! Percentiles over the reservoir are unbiased estimates; a worker that runs for days keeps 64 KiB.

use std::time::Duration;

/// Durations sampled into a bounded reservoir, and counted into a [`Histogram`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Samples {
    kept: Vec<Duration>,
    seen: u64,
    max: Duration,
    /// A xorshift state, so that which samples stay is deterministic.
    rng: u64,
    histogram: Histogram,
}

/// Every sample since the start, counted into buckets by duration (Prometheus-style: bucket `i`
/// counts the samples at most [`BOUNDS[i]`](Self::BOUNDS), the last one the samples above all
/// bounds), with their exact count and sum. Never reset: metrics read it as running totals.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Histogram {
    buckets: [u64; Histogram::BOUNDS.len() + 1],
    count: u64,
    sum: Duration,
}

impl Histogram {
    /// The buckets' upper bounds, from 100 µs to 60 s.
    pub const BOUNDS: [Duration; 18] = [
        Duration::from_micros(100),
        Duration::from_micros(250),
        Duration::from_micros(500),
        Duration::from_millis(1),
        Duration::from_micros(2_500),
        Duration::from_millis(5),
        Duration::from_millis(10),
        Duration::from_millis(25),
        Duration::from_millis(50),
        Duration::from_millis(100),
        Duration::from_millis(250),
        Duration::from_millis(500),
        Duration::from_secs(1),
        Duration::from_millis(2_500),
        Duration::from_secs(5),
        Duration::from_secs(10),
        Duration::from_secs(30),
        Duration::from_secs(60),
    ];

    /// Counts a sample.
    pub fn push(&mut self, d: Duration) {
        let bucket = Self::BOUNDS.partition_point(|&b| b < d);
        if let Some(n) = self.buckets.get_mut(bucket) {
            *n += 1;
        }
        self.count += 1;
        self.sum = self.sum.saturating_add(d);
    }

    /// The samples in each bucket (not cumulative): one per bound, then those above all bounds.
    pub fn buckets(&self) -> &[u64; Histogram::BOUNDS.len() + 1] {
        &self.buckets
    }

    /// How many samples came.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Their sum (saturating at `Duration::MAX`).
    pub fn sum(&self) -> Duration {
        self.sum
    }
}

impl Samples {
    /// The most samples kept.
    pub const CAPACITY: usize = 4096;

    /// Adds a sample.
    pub fn push(&mut self, d: Duration) {
        self.histogram.push(d);
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

    /// Every sample since the start, in buckets ([`take`](Self::take) keeps it).
    pub fn histogram(&self) -> &Histogram {
        &self.histogram
    }

    /// How many samples came since the last [`take`](Self::take).
    pub fn count(&self) -> u64 {
        self.seen
    }

    /// The largest sample that came since the last [`take`](Self::take) (`ZERO` before any).
    pub fn max(&self) -> Duration {
        self.max
    }

    /// Empties the reservoir and returns the samples it kept; count and max start again, the
    /// histogram stays.
    pub fn take(&mut self) -> Vec<Duration> {
        let kept = std::mem::take(&mut self.kept);
        (self.seen, self.max) = (0, Duration::ZERO);
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
        assert_eq!(s.histogram().count(), 100_000, "taking the reservoir keeps the histogram");
    }

    #[test]
    fn histogram_buckets_are_inclusive_upper_bounds_and_the_sum_is_exact() {
        let mut h = Histogram::default();
        for d in [
            Duration::ZERO,
            Duration::from_micros(100),
            Duration::from_micros(101),
            Duration::from_secs(60),
            Duration::from_secs(61),
        ] {
            h.push(d);
        }
        let b = h.buckets();
        assert_eq!((b[0], b[1], b[Histogram::BOUNDS.len() - 1], b[Histogram::BOUNDS.len()]), (2, 1, 1, 1));
        assert_eq!(b.iter().sum::<u64>(), h.count());
        assert_eq!(h.sum(), Duration::from_micros(121_000_201));
        assert!(Histogram::BOUNDS.windows(2).all(|w| w[0] < w[1]), "bounds ascend");
    }
}
