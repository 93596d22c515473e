//! [`SoakReport`]: what a soak did, what it injected, and the figures that must be zero.

use std::fmt;
use std::time::Duration;

use crate::chaos::FaultCounts;
use crate::sim::{HandshakeFaultCounts, SimEngine};
use kvx_core::{ErrorKind, WorkerStats};

/// Requests aborted by their client, by where they were.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Aborts {
    /// Waiting on the prefill engine, before its params were handed out.
    pub prefill: u64,
    /// Between the engines: params handed out, not yet at a decode engine (aborted, or lost by
    /// the client).
    pub handoff: u64,
    /// Waiting on the decode engine.
    pub decode_waiting: u64,
    /// Waiting for its remote KV.
    pub decode_loading: u64,
    /// Running on the decode engine.
    pub decode_running: u64,
}

impl Aborts {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.prefill + self.handoff + self.decode_waiting + self.decode_loading + self.decode_running
    }
}

/// Requests lost with an engine that restarted (or panicked), by the engine's role.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lost {
    /// In a prefill engine.
    pub prefill: u64,
    /// In a decode engine.
    pub decode: u64,
}

/// The faults a soak injected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InjectedFaults {
    /// By the [`Chaos`](crate::chaos::Chaos) layer over the transport: READs and notifications.
    pub transport: FaultCounts,
    /// On the side channel: handshake fetches.
    pub handshakes: HandshakeFaultCounts,
    /// Prefill engine restarts.
    pub prefill_restarts: u64,
    /// Decode engine restarts.
    pub decode_restarts: u64,
    /// Decode engines stalled for longer than a lease.
    pub decode_stalls: u64,
}

/// What the connector did, summed over every engine that ran (restarted ones too).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProtocolCounts {
    /// Handshakes completed.
    pub handshakes: u64,
    /// Handshakes failed or timed out.
    pub handshake_failures: u64,
    /// READs posted.
    pub reads: u64,
    /// Loads failed, per rank.
    pub failed_loads: u64,
    /// Holds released by a notification.
    pub released_holds: u64,
    /// Holds released because their lease ran out.
    pub expired_holds: u64,
    /// Releases answered at once, before their hold came or long after it ended.
    pub early_answers: u64,
    /// Notifications that matched no hold, or did not decode.
    pub stray_notifications: u64,
    /// Notifications refused for a wrong nonce.
    pub rejected_notifications: u64,
    /// Received blocks checked byte for byte (per rank and region).
    pub blocks_verified: u64,
    /// Push: registrations sent, WRITEs posted, WRITEs failed, registrations answered "not
    /// written", registrations cancelled after their wait (of them unanswered).
    pub push: [u64; 6],
}

impl ProtocolCounts {
    pub(super) fn add_engine(&mut self, engine: &SimEngine) {
        for w in engine.worker_stats() {
            self.add_worker(&w);
        }
        self.blocks_verified += engine.stats().blocks_verified;
    }

    fn add_worker(&mut self, w: &WorkerStats) {
        self.handshakes += w.handshakes;
        self.handshake_failures += w.handshake_failures;
        self.reads += w.reads_posted;
        self.failed_loads += w.failed_loads;
        self.released_holds += w.notifications;
        self.expired_holds += w.expired_holds;
        self.early_answers += w.early_answers;
        self.stray_notifications += w.stray_notifications;
        self.rejected_notifications += w.rejected_notifications;
        let push = [
            w.push_registrations,
            w.writes_posted,
            w.writes_failed,
            w.push_refusals,
            w.push_cancels,
            w.push_cancels_unanswered,
        ];
        for (sum, n) in self.push.iter_mut().zip(push) {
            *sum += n;
        }
    }
}

/// What a soak did. [`is_clean`](Self::is_clean) when every must-be-zero figure is zero.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SoakReport {
    /// The seed that replays the run.
    pub seed: u64,
    /// Requests run.
    pub requests: u64,
    /// `prefills` and `decodes` engines of `tp` ranks each.
    pub engines: (usize, usize, u32),
    /// The prefill engines' lease.
    pub lease: Duration,
    /// Finished on a decode engine with the KV it loaded (or needed none).
    pub finished: u64,
    /// Finished after their load failed, computing their prompt themselves.
    pub recomputed: u64,
    /// Failed (their load failed on a decode engine that fails such requests, or an engine
    /// failed them).
    pub failed: u64,
    /// Aborted by their client.
    pub aborted: Aborts,
    /// Lost with an engine that restarted.
    pub lost: Lost,
    /// Requests that never ended. Must be 0.
    pub unresolved: u64,
    /// The first few of them, with where they were (engine and state).
    pub unresolved_examples: Vec<String>,
    /// Received blocks whose bytes differ from what the prefill model wrote. Must be 0.
    pub blocks_mismatched: u64,
    /// Blocks not free in the engines' pools at the end. Must be 0.
    pub blocks_leaked: u64,
    /// Engines with requests, holds or loads left at the end. Must be 0.
    pub engines_not_idle: u64,
    /// Panics in engine steps. Must be 0.
    pub panics: u64,
    /// Engine errors (a pool misuse, wrong bytes, a failed step), panics' messages, engines that
    /// did not restart. Must be empty.
    pub errors: Vec<String>,
    /// Errors beyond the first ones kept in `errors`.
    pub more_errors: u64,
    /// What was injected.
    pub faults: InjectedFaults,
    /// What the connector did.
    pub protocol: ProtocolCounts,
    /// Why requests failed (the errors' `Display` form), most frequent first, with numbers as `#`.
    pub failure_reasons: Vec<(String, u64)>,
    /// Why the loads of recomputed requests failed, as [`failure_reasons`](Self::failure_reasons).
    pub recompute_reasons: Vec<(String, u64)>,
    /// The kinds of those errors (of failed requests and of recomputed requests' loads), each
    /// with its count, in the order first seen.
    pub failure_kinds: Vec<(ErrorKind, u64)>,
    /// Simulated time from arrival to the end of finished and recomputed requests: median, 99th
    /// percentile, maximum.
    pub finish_times: [Duration; 3],
    /// Simulated time the run took.
    pub virtual_time: Duration,
    /// Rounds of engine steps.
    pub rounds: u64,
    /// A digest of every request's outcome and of every figure above: equal for equal runs.
    pub digest: u64,
}

impl SoakReport {
    /// Whether every must-be-zero figure is zero.
    pub fn is_clean(&self) -> bool {
        self.unresolved == 0
            && self.blocks_mismatched == 0
            && self.blocks_leaked == 0
            && self.engines_not_idle == 0
            && self.panics == 0
            && self.errors.is_empty()
    }

    /// The must-be-zero figures that are not, by name.
    pub fn violations(&self) -> Vec<&'static str> {
        [
            ("unresolved requests", self.unresolved),
            ("blocks mismatched", self.blocks_mismatched),
            ("blocks leaked", self.blocks_leaked),
            ("engines not idle", self.engines_not_idle),
            ("panics", self.panics),
            ("engine errors", self.errors.len() as u64 + self.more_errors),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, _)| name)
        .collect()
    }
}

fn secs(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

/// The most frequent reasons, one line each, under a figure.
fn reasons(reasons: &[(String, u64)]) -> impl Iterator<Item = (&'static str, String)> + '_ {
    const SHOWN: usize = 4;
    let more = reasons.len().saturating_sub(SHOWN);
    let shown = reasons.iter().take(SHOWN).map(|(reason, n)| ("", format!("  {n} {reason}")));
    shown.chain((more > 0).then(|| ("", format!("  {more} other reasons"))))
}

impl fmt::Display for SoakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (p, d, tp) = self.engines;
        writeln!(
            f,
            "kvx soak: seed {}, {} requests, {p} prefill and {d} decode engines of TP={tp}, lease {}",
            self.seed,
            self.requests,
            secs(self.lease)
        )?;
        let (a, l, fl, hs, pc) =
            (&self.aborted, &self.lost, &self.faults.transport, &self.faults.handshakes, &self.protocol);
        let must = |n: u64| format!("{n} (must be 0)");
        let [p50, p99, max] = self.finish_times;
        let mut rows = vec![("finished", self.finished.to_string())];
        rows.push(("recomputed", self.recomputed.to_string()));
        rows.extend(reasons(&self.recompute_reasons));
        rows.push(("failed", self.failed.to_string()));
        rows.extend(reasons(&self.failure_reasons));
        rows.extend([
            (
                "aborted",
                format!(
                    "{} (prefill {}, between engines {}, decode waiting {}, loading {}, running {})",
                    a.total(),
                    a.prefill,
                    a.handoff,
                    a.decode_waiting,
                    a.decode_loading,
                    a.decode_running
                ),
            ),
            (
                "lost to restarts",
                format!("{} (prefill {}, decode {})", l.prefill + l.decode, l.prefill, l.decode),
            ),
            ("unresolved", must(self.unresolved)),
            ("blocks mismatched", must(self.blocks_mismatched)),
            ("blocks leaked", must(self.blocks_leaked)),
            ("engines not idle", must(self.engines_not_idle)),
            ("panics", must(self.panics)),
            ("engine errors", must(self.errors.len() as u64 + self.more_errors)),
            ("time to finish", format!("p50 {}, p99 {}, max {}", secs(p50), secs(p99), secs(max))),
            ("faults: transfers", format!("{} failed, {} late", fl.transfers_failed, fl.transfers_delayed)),
            (
                "faults: notifications",
                format!(
                    "{} lost, {} doubled, {} late, {} strays",
                    fl.notifications_dropped,
                    fl.notifications_duplicated,
                    fl.notifications_delayed,
                    fl.stray_notifications
                ),
            ),
            (
                "faults: handshakes",
                format!("{} refused, {} late, {} unanswered", hs.refused, hs.delayed, hs.silent),
            ),
            (
                "faults: engines",
                format!(
                    "{} prefill restarts, {} decode restarts, {} decode stalls beyond the lease",
                    self.faults.prefill_restarts, self.faults.decode_restarts, self.faults.decode_stalls
                ),
            ),
            ("handshakes", format!("{} ({} failed)", pc.handshakes, pc.handshake_failures)),
            ("READs", format!("{} posted, {} loads failed (per rank)", pc.reads, pc.failed_loads)),
            (
                "pushes",
                format!(
                    "{} registered, {} WRITEs posted ({} failed), {} answered not written, {} cancelled \
                     ({} unanswered)",
                    pc.push[0], pc.push[1], pc.push[2], pc.push[3], pc.push[4], pc.push[5]
                ),
            ),
            (
                "holds",
                format!(
                    "{} released, {} expired, {} releases answered before their hold came (or long after)",
                    pc.released_holds, pc.expired_holds, pc.early_answers
                ),
            ),
            (
                "notifications",
                format!(
                    "{} stray, {} refused (wrong nonce)",
                    pc.stray_notifications, pc.rejected_notifications
                ),
            ),
            ("blocks verified", pc.blocks_verified.to_string()),
            ("simulated time", format!("{} in {} rounds", secs(self.virtual_time), self.rounds)),
            ("digest", format!("{:016x}", self.digest)),
        ]);
        for (name, value) in rows {
            writeln!(f, "  {name:<22} {value}")?;
        }
        for e in &self.errors {
            writeln!(f, "  error: {e}")?;
        }
        for u in &self.unresolved_examples {
            writeln!(f, "  never ended: {u}")?;
        }
        if self.more_errors > 0 {
            writeln!(f, "  ... and {} more errors", self.more_errors)?;
        }
        Ok(())
    }
}
