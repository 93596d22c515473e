//! Rank reports into rank 0's aggregation and its scheduler.

use std::collections::HashSet;
use std::time::Duration;

use kvx_core::wire;
use kvx_core::{
    ConnectorScheduler, Error, ErrorKind, FailedRecv, Finished, FinishedAggregator, RankReport, RequestId,
    SchedulerConfig,
};

use crate::targets::fixture::{PREFILL, must};

/// A rank's report as rank 0 receives it: decoded, aggregated with rank 0's own report (the
/// same), and handed to a scheduler. Only ids some rank reported come out.
pub fn rank_report_aggregate(data: &[u8]) {
    let Ok(report) = wire::decode::<RankReport>(data) else { return };
    let mut aggregator = FinishedAggregator::new(2);
    let ranks = [0, 1].map(|rank| RankReport { rank, finished: report.finished.clone() });
    let out = aggregator.aggregate(std::time::Instant::now(), ranks);
    let reported: HashSet<&RequestId> = report
        .finished
        .sending
        .iter()
        .chain(&report.finished.recving)
        .chain(report.finished.failed_recving.iter().map(|f| &f.request_id))
        .collect();
    for id in out.sending.iter().chain(&out.recving).chain(out.failed_recving.iter().map(|f| &f.request_id)) {
        assert!(reported.contains(id), "aggregated {id}, which no rank reported");
    }
    let mut scheduler = must(
        ConnectorScheduler::new(SchedulerConfig {
            engine_id: PREFILL.into(),
            block_size: 16,
            side_channel: Some(kvx_core::Endpoint::new("10.0.0.1", 5600)),
            auth_key: None,
            lease_duration: Duration::from_secs(30),
            instance: None,
            tp_size: 1,
            group_windows: Vec::new(),
        }),
        "scheduler",
    );
    scheduler.update_finished(&out);
    assert!(scheduler.is_idle());
}

/// Rank reports: empty, typical, with failures.
pub(crate) fn rank_report_samples() -> Vec<(&'static str, RankReport)> {
    vec![
        (
            "typical",
            RankReport {
                rank: 1,
                finished: Finished {
                    sending: vec!["cmpl-p-0".into()],
                    recving: vec!["cmpl-d-0".into(), "cmpl-d-1".into()],
                    failed_recving: vec![FailedRecv {
                        request_id: "cmpl-d-2".into(),
                        error: Error::new(ErrorKind::Transfer, "peer gone")
                            .with_backend("ucx")
                            .with_code(-25),
                    }],
                },
            },
        ),
        ("empty", RankReport::default()),
        (
            "repeated-ids",
            RankReport {
                rank: u32::MAX,
                finished: Finished {
                    sending: vec!["a".into(), "a".into()],
                    recving: vec!["b".into()],
                    failed_recving: vec![FailedRecv {
                        request_id: "b".into(),
                        error: Error::new(ErrorKind::Timeout, String::new()),
                    }],
                },
            },
        ),
    ]
}
