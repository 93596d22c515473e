//! The run summary the `kvx` command prints, and whether the run was correct.

use std::fmt;
use std::time::Duration;

use kvx_core::{Samples, WorkerStats};
use kvx_testkit::sim::SimEngine;

/// What a run moved and checked, from the decode engines' point of view, plus leak checks.
#[derive(Debug, Default)]
pub(crate) struct Summary {
    pub(crate) requests: usize,
    finished: u64,
    failed: u64,
    bytes_moved: u64,
    wall: Duration,
    /// Post to the poll that found the READ done, sorted.
    read_latencies: Vec<Duration>,
    /// Post to the prefill engine's confirmation, sorted.
    confirmed_latencies: Vec<Duration>,
    handshake: Option<Duration>,
    blocks_verified: u64,
    bytes_verified: u64,
    mismatched: u64,
    errors: Vec<String>,
    leaked: usize,
    /// Requests whose load failed and that the decode engine computed itself.
    recomputed: u64,
    /// `kvx decode`: prefill processes lost and the failures they explain.
    losses: Option<PrefillLosses>,
    /// Requests each engine served, by engine id (empty: no such row).
    served: Vec<(String, u64)>,
    /// Each KV-cache group's window (tokens; `None`: full attention) and the block positions the
    /// decode engines loaded of it.
    groups: Vec<(Option<u32>, u64)>,
}

/// What a `kvx decode` run saw of its prefill process going away (its request API unreachable, or
/// a new instance answering), and which load failures that explains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PrefillLosses {
    /// Failed loads of requests in flight at a loss are accepted (`--on-load-failure fail` or
    /// `recompute`); otherwise every failed request fails the run.
    pub(crate) tolerated: bool,
    /// Times the prefill process was lost.
    pub(crate) losses: usize,
    /// Requests in the decode engine at those times (summed): at most this many can fail of it.
    pub(crate) in_flight: usize,
    /// Loads that failed.
    pub(crate) load_failures: usize,
    /// Failures no loss explains: failed loads of requests not in flight at a loss, and failed
    /// recomputes.
    pub(crate) unexpected: usize,
}

impl Summary {
    /// An engine's view of a run of `requests` requests that took `wall` (the decode engine's
    /// view is the whole story: it moves and checks the bytes).
    pub(crate) fn of_engine(decode: &SimEngine, requests: usize, wall: Duration) -> Self {
        Summary::of_engines(std::slice::from_ref(decode), requests, wall)
    }

    /// The decode engines' view of a run of `requests` requests that took `wall`, summed over
    /// them.
    pub(crate) fn of_engines(decodes: &[SimEngine], requests: usize, wall: Duration) -> Self {
        let workers: Vec<WorkerStats> = decodes.iter().flat_map(SimEngine::worker_stats).collect();
        let sorted = |samples: fn(&WorkerStats) -> &Samples| {
            let mut v: Vec<Duration> =
                workers.iter().flat_map(|w| samples(w).kept().iter().copied()).collect();
            v.sort();
            v
        };
        let read_latencies = sorted(|w| &w.read_latencies);
        let confirmed_latencies = sorted(|w| &w.transfer_latencies);
        let mut s = Summary {
            requests,
            bytes_moved: workers.iter().map(|w| w.bytes_read).sum(),
            wall,
            read_latencies,
            confirmed_latencies,
            handshake: workers
                .iter()
                .filter(|w| w.handshake_times.count() > 0)
                .map(|w| w.handshake_times.max())
                .max(),
            ..Summary::default()
        };
        for decode in decodes {
            let stats = decode.stats();
            let windows = &decode.config().model.groups;
            s.groups.resize(windows.len(), (None, 0));
            for ((group, &window), &loaded) in
                s.groups.iter_mut().zip(windows).zip(&stats.group_blocks_loaded)
            {
                *group = (window, group.1 + loaded);
            }
            s.finished += stats.finished;
            s.failed += stats.failed;
            s.blocks_verified += stats.blocks_verified;
            s.bytes_verified += stats.bytes_verified;
            s.mismatched += stats.blocks_mismatched;
            s.check(decode);
        }
        s
    }

    /// Adds a row of how many requests each engine served: its id and the requests that finished
    /// or failed on it.
    pub(crate) fn set_served<'a>(&mut self, engines: impl IntoIterator<Item = &'a SimEngine>) {
        self.served = engines
            .into_iter()
            .map(|e| (e.engine_id().to_string(), e.stats().finished + e.stats().failed))
            .collect();
    }

    /// Adds an engine's errors and leaked blocks.
    pub(crate) fn check(&mut self, engine: &SimEngine) {
        let pool = engine.pool();
        self.leaked += pool.num_blocks() as usize - pool.num_free();
        self.errors.extend(engine.errors().iter().map(|e| format!("{}: {e}", engine.engine_id())));
    }

    /// Adds the bytes a prefill engine's push WRITEs moved.
    pub(crate) fn add_written(&mut self, prefill: &SimEngine) {
        self.bytes_moved += prefill.worker_stats().iter().map(|w| w.bytes_written).sum::<u64>();
    }

    /// Adds another process's leaked blocks and errors.
    pub(crate) fn add_remote(&mut self, who: &str, leaked: usize, errors: Vec<String>) {
        self.leaked += leaked;
        self.errors.extend(errors.into_iter().map(|e| format!("{who}: {e}")));
    }

    /// The decode side's count of the workload's requests: finished with the prefill engine's
    /// KV, failed, and computed again by the decode engine after a failed load.
    pub(crate) fn set_outcomes(&mut self, finished: u64, failed: u64, recomputed: u64) {
        (self.finished, self.failed, self.recomputed) = (finished, failed, recomputed);
    }

    /// What the decode process saw of prefill losses.
    pub(crate) fn set_losses(&mut self, losses: PrefillLosses) {
        self.losses = Some(losses);
    }

    /// Blocks not free at the end.
    pub(crate) fn leaked(&self) -> usize {
        self.leaked
    }

    /// Whether every byte matched, no block leaked, and every request finished; or, where failed
    /// loads of requests in flight at a prefill loss are accepted, every request finished, failed
    /// or was recomputed and no other failure happened.
    pub(crate) fn is_correct(&self) -> bool {
        let requests = self.requests as u64;
        let accounted = match &self.losses {
            Some(l) if l.tolerated => {
                l.unexpected == 0 && self.finished + self.failed + self.recomputed == requests
            }
            _ => self.failed == 0 && self.recomputed == 0 && self.finished == requests,
        };
        accounted && self.mismatched == 0 && self.leaked == 0 && self.errors.is_empty()
    }

    /// The errors, for stderr.
    pub(crate) fn errors(&self) -> &[String] {
        &self.errors
    }
}

/// The `p` quantile of sorted durations.
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    let n = sorted.len();
    (n > 0).then(|| sorted[((n - 1) as f64 * p).round() as usize])
}

/// p50 and p99 of sorted durations, in milliseconds.
fn ms2(sorted: &[Duration]) -> String {
    format!("{} / {}", ms(percentile(sorted, 0.5)), ms(percentile(sorted, 0.99)))
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_owned(), |d| format!("{:.3} ms", d.as_secs_f64() * 1e3))
}

fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.wall.as_secs_f64().max(1e-9);
        let tolerated = self.losses.as_ref().is_some_and(|l| l.tolerated);
        let mut requests = format!("{} ({} finished, {} failed", self.requests, self.finished, self.failed);
        if tolerated || self.recomputed > 0 {
            requests += &format!(", {} recomputed", self.recomputed);
        }
        requests.push(')');
        let rows = [
            ("requests", requests),
            ("bytes moved", mb(self.bytes_moved)),
            ("wall time", format!("{:.3} s", self.wall.as_secs_f64())),
            (
                "throughput",
                format!("{:.2} GB/s (bytes moved / wall time)", self.bytes_moved as f64 / secs / 1e9),
            ),
            ("READ p50 / p99", ms2(&self.read_latencies)),
            ("confirmed p50 / p99", ms2(&self.confirmed_latencies)),
            ("handshake time", ms(self.handshake)),
            ("blocks verified", format!("{} ({} checked)", self.blocks_verified, mb(self.bytes_verified))),
            ("blocks mismatched", self.mismatched.to_string()),
            ("blocks leaked", self.leaked.to_string()),
        ];
        for (name, value) in rows {
            writeln!(f, "  {name:<22} {value}")?;
        }
        if self.groups.len() > 1 {
            let groups: Vec<String> = self
                .groups
                .iter()
                .map(|(window, loaded)| match window {
                    Some(w) => format!("{loaded} ({w}-token window)"),
                    None => format!("{loaded} (full)"),
                })
                .collect();
            writeln!(f, "  {:<22} {}", "blocks loaded by group", groups.join(", "))?;
        }
        if !self.served.is_empty() {
            let served: Vec<String> = self.served.iter().map(|(id, n)| format!("{id} {n}")).collect();
            writeln!(f, "  {:<22} {}", "requests per engine", served.join(", "))?;
        }
        // The decode side, when a prefill process was lost or failed loads are accepted.
        if let Some(l) = self.losses.as_ref().filter(|l| l.tolerated || l.losses > 0) {
            let rows = [
                ("prefill losses", format!("{} ({} requests in flight)", l.losses, l.in_flight)),
                ("load failures", l.load_failures.to_string()),
                ("unexpected failures", l.unexpected.to_string()),
            ];
            for (name, value) in rows {
                writeln!(f, "  {name:<22} {value}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_summary(finished: u64, failed: u64, recomputed: u64, losses: Option<PrefillLosses>) -> Summary {
        let mut s = Summary { requests: 10, ..Summary::default() };
        s.set_outcomes(finished, failed, recomputed);
        if let Some(l) = losses {
            s.set_losses(l);
        }
        s
    }

    fn lost(tolerated: bool, load_failures: usize, unexpected: usize) -> Option<PrefillLosses> {
        Some(PrefillLosses { tolerated, losses: 1, in_flight: 4, load_failures, unexpected })
    }

    #[test]
    fn failed_requests_fail_a_run_unless_a_prefill_loss_explains_them() {
        assert!(decode_summary(10, 0, 0, None).is_correct());
        assert!(!decode_summary(9, 1, 0, None).is_correct());
        // `--on-load-failure error`: a loss explains nothing.
        assert!(!decode_summary(9, 1, 0, lost(false, 1, 0)).is_correct());
        // `fail` / `recompute`: failures of requests in flight at the loss are accepted...
        assert!(decode_summary(8, 1, 1, lost(true, 2, 0)).is_correct());
        // ...others are not, nor requests unaccounted for.
        assert!(!decode_summary(8, 1, 1, lost(true, 2, 1)).is_correct());
        assert!(!decode_summary(8, 1, 0, lost(true, 1, 0)).is_correct());
    }

    #[test]
    fn the_served_row_names_every_engine_in_order() {
        let mut s = decode_summary(10, 0, 0, None);
        assert!(!s.to_string().contains("requests per engine"));
        s.served = vec![("prefill-0".into(), 6), ("prefill-1".into(), 4), ("decode".into(), 10)];
        let text = s.to_string();
        assert!(text.contains("  requests per engine    prefill-0 6, prefill-1 4, decode 10\n"), "{text}");
    }

    #[test]
    fn wrong_bytes_and_leaks_fail_a_run_whatever_the_policy() {
        let mut wrong = decode_summary(9, 0, 1, lost(true, 1, 0));
        wrong.mismatched = 1;
        assert!(!wrong.is_correct());
        let mut leaky = decode_summary(9, 0, 1, lost(true, 1, 0));
        leaky.add_remote("prefill", 3, Vec::new());
        assert!(!leaky.is_correct());
    }

    #[test]
    fn the_decode_rows_name_every_outcome() {
        let text = decode_summary(8, 1, 1, lost(true, 2, 0)).to_string();
        assert!(text.contains("requests               10 (8 finished, 1 failed, 1 recomputed)"), "{text}");
        assert!(text.contains("prefill losses         1 (4 requests in flight)"), "{text}");
        assert!(text.contains("load failures          2\n"), "{text}");
        assert!(text.contains("unexpected failures    0\n"), "{text}");
        // Without losses or a tolerant policy, the demo's rows only.
        let plain = decode_summary(10, 0, 0, Some(PrefillLosses::default())).to_string();
        assert!(
            plain.contains("10 (10 finished, 0 failed)\n") && !plain.contains("prefill losses"),
            "{plain}"
        );
    }
}
