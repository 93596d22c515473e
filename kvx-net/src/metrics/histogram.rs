//! A Prometheus histogram fed with the changes of a worker's cumulative [`Histogram`]s: the
//! worker already put every sample in its bucket, so the metric adds bucket counts instead of
//! observing samples one by one.

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};
use std::sync::{Arc, Mutex, PoisonError};

use kvx_core::worker::Histogram;

const BUCKETS: usize = Histogram::BOUNDS.len() + 1;

/// Bucket counts (not cumulative, the last above every bound), count and sum in seconds. Clones
/// share them (as prometheus-client's metrics do).
#[derive(Debug, Clone, Default)]
pub(super) struct DurationHistogram {
    inner: Arc<Mutex<Totals>>,
}

#[derive(Debug, Default)]
struct Totals {
    buckets: [u64; BUCKETS],
    count: u64,
    sum: f64,
}

impl DurationHistogram {
    /// Adds what `now` counted beyond `before` (an earlier state of the same histogram).
    pub(super) fn add(&self, now: &Histogram, before: &Histogram) {
        let mut t = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        for ((total, n), b) in t.buckets.iter_mut().zip(now.buckets()).zip(before.buckets()) {
            *total += n.saturating_sub(*b);
        }
        t.count += now.count().saturating_sub(before.count());
        t.sum += now.sum().saturating_sub(before.sum()).as_secs_f64();
    }
}

impl TypedMetric for DurationHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for DurationHistogram {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = {
            let t = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            (t.sum, t.count, t.buckets)
        };
        // prometheus-client writes an infinite upper bound as +Inf.
        let bounds = Histogram::BOUNDS.iter().map(|b| b.as_secs_f64()).chain([f64::INFINITY]);
        let buckets: Vec<(f64, u64)> = bounds.zip(buckets).collect();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}
