//! [`WorkerStats`], what one worker counts, declared once together with the names and help
//! texts under which it is exported: [`WorkerStats::COUNTERS`] and [`WorkerStats::TIMINGS`] list
//! every counter and every latency of the struct (the macro below writes the struct and both
//! tables from one declaration, so neither can miss a field). kvx-net's Prometheus registry,
//! kvx-vllm's `Worker.stats()` and the vLLM connector's own metrics all read these tables.

use super::Samples;

/// What a [`StatCounter`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterUnit {
    /// Events (READs, handshakes, notifications).
    Events,
    /// Bytes.
    Bytes,
}

/// One counter of [`WorkerStats`], as metrics export it.
#[derive(Debug, Clone, Copy)]
pub struct StatCounter {
    /// Its key: the field's name (or, for a counter derived from a latency, its own name), which
    /// kvx-vllm's `Worker.stats()` and vLLM's `vllm:kvx_<key>_total` use.
    pub key: &'static str,
    /// Its name in kvx's Prometheus registry, without the `kvx_` prefix and the unit's and
    /// `_total` suffixes (`read` in [`CounterUnit::Bytes`] is `kvx_read_bytes_total`).
    pub metric: &'static str,
    /// What it counts.
    pub unit: CounterUnit,
    /// Its help text.
    pub help: &'static str,
    /// Its value (since the worker started).
    pub read: fn(&WorkerStats) -> u64,
}

/// One latency of [`WorkerStats`] ([`Samples`], with a cumulative histogram), as metrics export
/// it.
#[derive(Debug, Clone, Copy)]
pub struct StatTiming {
    /// Its key: kvx-vllm's `Worker.stats()` reports it as `<key>_count`, `<key>_seconds` and
    /// `<key>_max_seconds`.
    pub key: &'static str,
    /// Its histogram's name in kvx's Prometheus registry, without the `kvx_` prefix and the
    /// `_seconds` suffix.
    pub metric: &'static str,
    /// Its help text.
    pub help: &'static str,
    /// Its samples.
    pub read: fn(&WorkerStats) -> &Samples,
}

/// Declares [`WorkerStats`] with a `u64` field per counter and a [`Samples`] field per timing,
/// and its tables [`WorkerStats::COUNTERS`] (the fields' counters, then the derived ones) and
/// [`WorkerStats::TIMINGS`], in the declaration's order.
macro_rules! worker_stats {
    (
        $(#[$meta:meta])*
        pub struct WorkerStats {
            counters {
                $(
                    $(#[$counter_doc:meta])*
                    $counter:ident => $counter_metric:literal $([$unit:ident])?: $counter_help:literal,
                )*
            }
            derived {
                $( $derived:ident => $derived_metric:literal: $derived_help:literal = $derived_read:expr, )*
            }
            timings {
                $(
                    $(#[$timing_doc:meta])*
                    $timing:ident as $timing_key:ident => $timing_metric:literal: $timing_help:literal,
                )*
            }
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Default, PartialEq)]
        pub struct WorkerStats {
            $( $(#[$counter_doc])* pub $counter: u64, )*
            $( $(#[$timing_doc])* pub $timing: Samples, )*
        }

        impl WorkerStats {
            /// Every counter: one per `u64` field, then those derived from a latency.
            pub const COUNTERS: &[StatCounter] = &[
                $(
                    StatCounter {
                        key: stringify!($counter),
                        metric: $counter_metric,
                        unit: worker_stats!(@unit $($unit)?),
                        help: $counter_help,
                        read: |s| s.$counter,
                    },
                )*
                $(
                    StatCounter {
                        key: stringify!($derived),
                        metric: $derived_metric,
                        unit: CounterUnit::Events,
                        help: $derived_help,
                        read: $derived_read,
                    },
                )*
            ];

            /// Every latency: one per [`Samples`] field.
            pub const TIMINGS: &[StatTiming] = &[
                $(
                    StatTiming {
                        key: stringify!($timing_key),
                        metric: $timing_metric,
                        help: $timing_help,
                        read: |s| &s.$timing,
                    },
                )*
            ];
        }
    };
    (@unit) => { CounterUnit::Events };
    (@unit $unit:ident) => { CounterUnit::$unit };
}

worker_stats! {
    /// Counters of one worker, for metrics and the demo's summary. [`COUNTERS`](Self::COUNTERS)
    /// and [`TIMINGS`](Self::TIMINGS) list them with their metric names and help texts.
    pub struct WorkerStats {
        counters {
            /// Handshakes that completed.
            handshakes => "handshakes": "Handshakes that completed",
            /// Handshakes that failed or timed out.
            handshake_failures => "handshake_failures": "Handshakes that failed or timed out",
            /// Handshakes that found a peer engine restarted (a new instance of an engine seen
            /// before).
            peer_restarts => "peer_restarts": "Handshakes that found a peer engine restarted",
            /// Peers dropped after a failed transfer, notification or confirmation: the next
            /// request for them handshakes again.
            peers_invalidated => "peers_invalidated":
                "Peers dropped after a failed transfer, notification or confirmation (the next request handshakes again)",
            /// READs posted. Each one that ends is counted in `read_latencies` (done) or
            /// `reads_failed`.
            reads_posted => "reads_posted": "READs posted to the transfer agent",
            /// Posted READs that failed, timed out or were cancelled at close.
            reads_failed => "reads_failed": "Posted READs that failed, timed out or were cancelled at close",
            /// Descriptors in posted READs after coalescing: per region, one per run of blocks
            /// contiguous on both sides (a backend may merge whole regions further).
            descriptors => "read_descriptors":
                "Descriptors in posted READs after coalescing (per region, one per run of blocks contiguous on both sides)",
            /// Descriptors (block × region) in posted READs before coalescing.
            block_descriptors => "read_block_descriptors":
                "Descriptors (block x region) in posted READs before coalescing",
            /// Bytes read by completed and confirmed READs.
            bytes_read => "read" [Bytes]:
                "Bytes read by READs that completed and whose hold the prefill engine confirmed",
            /// Loads that failed (validation, post, transfer, handshake, lease).
            failed_loads => "loads_failed":
                "Loads that failed (validation, post, transfer, handshake, lease)",
            /// Loads whose READ completed but whose hold had ended before the release reached the
            /// prefill engine (or that got no answer): failed, their bytes unused.
            lease_failures => "lease_failures":
                "Decode side: loads whose READ completed after the prefill engine's hold had ended",
            /// Notify-only requests (full local prefix hit).
            notify_only => "loads_notify_only":
                "Decode side: requests that needed no READ (full local prefix hit), only a release",
            /// Heartbeats (lease renewals) sent, one per hold.
            renewals_sent => "renewals_sent": "Decode side: heartbeats (lease renewals) sent, one per hold",
            /// Prefill side: releases received for held requests, one for each reader (a hold is
            /// freed by its last reader's).
            notifications => "holds_released": "Prefill side: holds their reader released",
            /// Prefill side: releases that came before their hold (kept until it comes or they
            /// expire).
            early_notifications => "notifications_early":
                "Prefill side: releases that came before their hold",
            /// Prefill side: releases that came before their hold and were dropped before it came
            /// to keep what is kept bounded (pushed out of their sender's budget, with an evicted
            /// sender, or past the readers of one hold). Each is also counted in
            /// `stray_notifications`.
            early_notifications_dropped => "notifications_early_dropped":
                "Prefill side: releases that came before their hold and were dropped to keep the early releases bounded",
            /// Notifications that did not decode, were duplicated, or never matched a hold or a
            /// load (expired or pushed out of a buffer).
            stray_notifications => "notifications_stray":
                "Notifications that did not decode, were duplicated, or matched no hold or load",
            /// Notifications that named a held request with the wrong nonce: forged or replayed.
            /// The hold stays.
            rejected_notifications => "notifications_rejected":
                "Notifications that named a held request with the wrong nonce",
            /// Prefill side: leases extended by a heartbeat.
            leases_renewed => "leases_renewed": "Prefill side: leases extended by a heartbeat",
            /// Prefill side: holds released because their lease ran out.
            expired_holds => "holds_expired": "Prefill side: holds freed because their lease ran out",
            /// Prefill side: answers sent to decode workers ("held" or "not held").
            hold_answers => "hold_answers": "Prefill side: answers sent to decode workers (held or not held)",
            /// Prefill side: answers to releases whose hold this worker had not been handed yet
            /// ("held") or had been handed and forgotten ("not held"), sent without waiting for
            /// the hold. Each is also counted in `hold_answers` once sent.
            early_answers => "hold_answers_early":
                "Prefill side: answers sent at once to releases that came before their hold (or long after it)",
            /// Decode side: push registrations sent, one per prefill rank a push load registers
            /// with.
            push_registrations => "push_registrations":
                "Decode side: push registrations sent, one per prefill rank",
            /// Decode side: registrations whose prefill rank wrote them (its WRITE's notification
            /// came).
            pushes_written => "pushes_written":
                "Decode side: push registrations the prefill rank wrote",
            /// Decode side: registrations cancelled because no WRITE came in time.
            push_cancels => "push_cancels":
                "Decode side: push registrations cancelled because no WRITE came in time",
            /// Decode side: cancels the prefill rank did not answer either: its peer was dropped.
            push_cancels_unanswered => "push_cancels_unanswered":
                "Decode side: push cancels the prefill rank did not answer (its peer dropped)",
            /// Prefill side: push WRITEs posted.
            writes_posted => "writes_posted": "Prefill side: push WRITEs posted to the transfer agent",
            /// Prefill side: push WRITEs that could not be posted, failed, or whose decode worker
            /// could not be reached.
            writes_failed => "writes_failed":
                "Prefill side: push WRITEs not posted, failed, or whose decode worker was unreachable",
            /// Prefill side: bytes written by push WRITEs that completed.
            bytes_written => "written" [Bytes]: "Prefill side: bytes written by push WRITEs that completed",
            /// Prefill side: registrations answered "not written" (refused, failed, cancelled).
            push_refusals => "push_refusals":
                "Prefill side: push registrations answered not written (refused, failed or cancelled)",
            /// Prefill side: answers given again to a registration or cancel whose decode worker
            /// asked again (its first answer may have been lost).
            push_answers_again => "push_answers_again":
                "Prefill side: push answers given again to a decode worker that asked again",
            /// Decode side: registrations sent again while no answer came.
            push_resends => "push_resends": "Decode side: push registrations sent again while no answer came",
            /// Messages for a peer dropped because its handshake failed or the send failed.
            unsent_messages => "messages_unsent":
                "Messages for a peer dropped because its handshake failed or the send failed",
        }
        derived {
            reads_done => "reads_done": "Posted READs that completed" =
                |s| s.read_latencies.histogram().count(),
        }
        timings {
            /// Time from a handshake's start to the peer being ready.
            handshake_times as handshake => "handshake_duration":
                "From a handshake's start to the peer being ready",
            /// From posting a READ to the step that found it done, for each READ that completed:
            /// the transfer itself, plus at most the interval between the caller's steps (the
            /// worker drains the agent's completions once per step).
            read_latencies as read => "read_duration": "From posting a READ to the step that found it done",
            /// From posting a READ to the prefill engine's confirmation, for each completed load:
            /// the READ, the release's round trip to the prefill engine, and the steps between.
            transfer_latencies as transfer => "transfer_duration":
                "From posting a READ to the prefill engine's confirmation that its hold lived through it",
            /// From a load's admission (the step that handed it to the worker) to its READ's post,
            /// for each completed load: the handshake with its peer when one was needed.
            post_waits as post_wait => "post_wait_duration":
                "From a load's admission to its READ's post (the handshake, when one was needed), per completed load",
            /// From the step that found a READ done to the prefill engine's confirmation, for each
            /// completed load: the release's round trip and the steps between.
            confirm_waits as confirm => "confirm_duration":
                "From the step that found a READ done to the prefill engine's confirmation, per completed load",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::time::Duration;

    fn counter(stats: &WorkerStats, key: &str) -> u64 {
        let c =
            WorkerStats::COUNTERS.iter().find(|c| c.key == key).unwrap_or_else(|| panic!("no counter {key}"));
        (c.read)(stats)
    }

    /// The tables read the fields they name; derived counters read their latency.
    #[test]
    fn the_tables_read_their_fields() {
        let mut stats = WorkerStats { bytes_read: 7, notifications: 3, ..WorkerStats::default() };
        stats.read_latencies.push(Duration::from_millis(1));
        stats.read_latencies.push(Duration::from_millis(2));
        stats.confirm_waits.push(Duration::from_millis(3));
        assert_eq!((counter(&stats, "bytes_read"), counter(&stats, "notifications")), (7, 3));
        assert_eq!(counter(&stats, "reads_done"), 2);
        let moved: Vec<_> =
            WorkerStats::COUNTERS.iter().filter(|c| (c.read)(&stats) != 0).map(|c| c.key).collect();
        assert_eq!(moved, ["bytes_read", "notifications", "reads_done"]);
        let counts: Vec<_> = WorkerStats::TIMINGS.iter().map(|t| (t.key, (t.read)(&stats).count())).collect();
        assert_eq!(
            counts,
            [("handshake", 0), ("read", 2), ("transfer", 0), ("post_wait", 0), ("confirm", 1)]
        );
        assert_eq!(
            WorkerStats::COUNTERS.iter().find(|c| c.key == "bytes_read").map(|c| c.unit),
            Some(CounterUnit::Bytes)
        );
    }

    /// No two exported names collide: kvx-vllm's `stats()` keys (counters' keys and each
    /// timing's `_count`, `_seconds`, `_max_seconds`) and kvx's Prometheus names.
    #[test]
    fn exported_names_are_unique() {
        let mut keys: Vec<String> = WorkerStats::COUNTERS.iter().map(|c| c.key.to_owned()).collect();
        for t in WorkerStats::TIMINGS {
            keys.extend(["count", "seconds", "max_seconds"].map(|what| format!("{}_{what}", t.key)));
        }
        let mut metrics: Vec<String> = WorkerStats::COUNTERS
            .iter()
            .map(|c| match c.unit {
                CounterUnit::Events => format!("{}_total", c.metric),
                CounterUnit::Bytes => format!("{}_bytes_total", c.metric),
            })
            .collect();
        metrics.extend(WorkerStats::TIMINGS.iter().map(|t| format!("{}_seconds", t.metric)));
        for names in [keys, metrics] {
            let unique: HashSet<_> = names.iter().collect();
            assert_eq!(unique.len(), names.len(), "{names:?}");
        }
    }
}
