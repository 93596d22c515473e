//! What a soak counts as it runs, and the report it becomes.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use kvx_core::{Error, ErrorKind};

use super::SoakConfig;
use super::report::{Aborts, InjectedFaults, Lost, ProtocolCounts, SoakReport};
use crate::sim::{SimEngine, mix};

/// Errors kept word for word; the rest are counted.
const MAX_ERRORS: usize = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    Prefill,
    Decode,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        })
    }
}

/// Where a request was when its client aborted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AbortStage {
    Prefill,
    Handoff,
    DecodeWaiting,
    DecodeLoading,
    DecodeRunning,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Finished,
    Recomputed,
    Failed,
    Aborted(AbortStage),
    Lost(Role),
}

impl Outcome {
    /// A number for the digest (0 is "unresolved").
    fn code(self) -> u64 {
        match self {
            Outcome::Finished => 1,
            Outcome::Recomputed => 2,
            Outcome::Failed => 3,
            Outcome::Aborted(stage) => 4 + stage as u64,
            Outcome::Lost(role) => 9 + role as u64,
        }
    }
}

#[derive(Debug)]
pub(super) struct Tally {
    /// Each request's outcome, by number.
    outcomes: Vec<Option<Outcome>>,
    /// Simulated time from arrival to the end of each finished or recomputed request.
    finish_times: Vec<Duration>,
    /// Why requests failed, and why the loads of recomputed ones failed (numbers as `#`).
    failure_reasons: BTreeMap<String, u64>,
    recompute_reasons: BTreeMap<String, u64>,
    /// The kinds of both, in the order first seen.
    failure_kinds: Vec<(ErrorKind, u64)>,
    pub(super) faults: InjectedFaults,
    protocol: ProtocolCounts,
    mismatched: u64,
    pub(super) blocks_leaked: u64,
    pub(super) engines_not_idle: u64,
    pub(super) panics: u64,
    errors: Vec<String>,
    more_errors: u64,
    /// A few requests that never ended, and where they were.
    pub(super) unresolved_examples: Vec<String>,
    pub(super) rounds: u64,
}

impl Tally {
    pub(super) fn new(requests: u64) -> Self {
        Tally {
            outcomes: vec![None; usize::try_from(requests).unwrap_or(usize::MAX)],
            finish_times: Vec::new(),
            failure_reasons: BTreeMap::new(),
            recompute_reasons: BTreeMap::new(),
            failure_kinds: Vec::new(),
            faults: InjectedFaults::default(),
            protocol: ProtocolCounts::default(),
            mismatched: 0,
            blocks_leaked: 0,
            engines_not_idle: 0,
            panics: 0,
            errors: Vec::new(),
            more_errors: 0,
            unresolved_examples: Vec::new(),
            rounds: 0,
        }
    }

    pub(super) fn resolve(&mut self, n: u64, outcome: Outcome, took: Duration) {
        if let Some(slot) = usize::try_from(n).ok().and_then(|n| self.outcomes.get_mut(n)) {
            *slot = Some(outcome);
        }
        if matches!(outcome, Outcome::Finished | Outcome::Recomputed) {
            self.finish_times.push(took);
        }
    }

    /// Counts why a request failed (or its load did, for a recomputed one), by the error's text
    /// and by its kind.
    pub(super) fn reason(&mut self, outcome: Outcome, error: &Error) {
        let reasons = match outcome {
            Outcome::Recomputed => &mut self.recompute_reasons,
            _ => &mut self.failure_reasons,
        };
        *reasons.entry(without_numbers(&error.to_string())).or_insert(0) += 1;
        match self.failure_kinds.iter_mut().find(|(kind, _)| *kind == error.kind()) {
            Some((_, n)) => *n += 1,
            None => self.failure_kinds.push((error.kind(), 1)),
        }
    }

    pub(super) fn error(&mut self, e: String) {
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(e);
        } else {
            self.more_errors += 1;
        }
    }

    /// Keeps what an engine counted before it goes (restarted, or at the end).
    pub(super) fn retire(&mut self, engine: &SimEngine) {
        self.protocol.add_engine(engine);
        self.mismatched += engine.stats().blocks_mismatched;
        for e in engine.errors() {
            self.error(format!("{}: {e}", engine.engine_id()));
        }
    }

    pub(super) fn report(
        self,
        cfg: &SoakConfig,
        faults: InjectedFaults,
        virtual_time: Duration,
    ) -> SoakReport {
        let count = |pred: &dyn Fn(Outcome) -> bool| {
            self.outcomes.iter().filter(|o| o.is_some_and(pred)).count() as u64
        };
        let aborted = |stage| count(&|o| o == Outcome::Aborted(stage));
        let mut report = SoakReport {
            seed: cfg.seed,
            requests: cfg.requests,
            engines: (cfg.prefills, cfg.decodes, cfg.tp),
            lease: cfg.lease,
            finished: count(&|o| o == Outcome::Finished),
            recomputed: count(&|o| o == Outcome::Recomputed),
            failed: count(&|o| o == Outcome::Failed),
            aborted: Aborts {
                prefill: aborted(AbortStage::Prefill),
                handoff: aborted(AbortStage::Handoff),
                decode_waiting: aborted(AbortStage::DecodeWaiting),
                decode_loading: aborted(AbortStage::DecodeLoading),
                decode_running: aborted(AbortStage::DecodeRunning),
            },
            lost: Lost {
                prefill: count(&|o| o == Outcome::Lost(Role::Prefill)),
                decode: count(&|o| o == Outcome::Lost(Role::Decode)),
            },
            unresolved: self.outcomes.iter().filter(|o| o.is_none()).count() as u64,
            unresolved_examples: self.unresolved_examples,
            blocks_mismatched: self.mismatched,
            blocks_leaked: self.blocks_leaked,
            engines_not_idle: self.engines_not_idle,
            panics: self.panics,
            errors: self.errors,
            more_errors: self.more_errors,
            faults,
            protocol: self.protocol,
            failure_reasons: by_count(self.failure_reasons),
            recompute_reasons: by_count(self.recompute_reasons),
            failure_kinds: self.failure_kinds,
            finish_times: percentiles(self.finish_times),
            virtual_time,
            rounds: self.rounds,
            digest: 0,
        };
        let outcomes = self.outcomes.iter().map(|o| o.map_or(0, Outcome::code));
        report.digest = digest(outcomes.chain(figures(&report)));
        report
    }
}

/// Every figure of a report but its digest and its error texts.
fn figures(r: &SoakReport) -> Vec<u64> {
    let (a, l, f, h, p) = (&r.aborted, &r.lost, &r.faults.transport, &r.faults.handshakes, &r.protocol);
    vec![
        r.seed,
        r.requests,
        r.finished,
        r.recomputed,
        r.failed,
        a.prefill,
        a.handoff,
        a.decode_waiting,
        a.decode_loading,
        a.decode_running,
        l.prefill,
        l.decode,
        r.unresolved,
        r.blocks_mismatched,
        r.blocks_leaked,
        r.engines_not_idle,
        r.panics,
        r.errors.len() as u64 + r.more_errors,
        f.transfers_failed,
        f.transfers_delayed,
        f.notifications_dropped,
        f.notifications_duplicated,
        f.notifications_delayed,
        f.stray_notifications,
        h.refused,
        h.delayed,
        h.silent,
        r.faults.prefill_restarts,
        r.faults.decode_restarts,
        r.faults.decode_stalls,
        p.handshakes,
        p.handshake_failures,
        p.reads,
        p.failed_loads,
        p.released_holds,
        p.expired_holds,
        p.early_answers,
        p.stray_notifications,
        p.rejected_notifications,
        p.blocks_verified,
    ]
    .into_iter()
    .chain(p.push)
    .chain([u64::try_from(r.virtual_time.as_nanos()).unwrap_or(u64::MAX), r.rounds])
    .chain(r.finish_times.iter().map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)))
    .collect()
}

/// `reason` with every run of digits replaced by `#`, so that reasons differing only in ids
/// count together.
fn without_numbers(reason: &str) -> String {
    let mut out = String::with_capacity(reason.len());
    for c in reason.chars() {
        if !c.is_ascii_digit() {
            out.push(c);
        } else if !out.ends_with('#') {
            out.push('#');
        }
    }
    out
}

/// Reasons, most frequent first.
fn by_count(reasons: BTreeMap<String, u64>) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = reasons.into_iter().collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// The median, 99th percentile and maximum.
fn percentiles(mut times: Vec<Duration>) -> [Duration; 3] {
    times.sort();
    let at = |p: f64| {
        let i = (times.len().saturating_sub(1) as f64 * p).round() as usize;
        times.get(i).copied().unwrap_or_default()
    };
    [at(0.5), at(0.99), at(1.0)]
}

fn digest(values: impl IntoIterator<Item = u64>) -> u64 {
    values.into_iter().fold(0x6b76_785f_736f_616b, mix)
}
