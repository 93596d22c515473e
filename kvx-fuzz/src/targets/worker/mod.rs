//! Targets that feed peer bytes to real connector workers: handshake payloads, the scheduler's
//! metadata, notifications, and rank reports.

mod handshake;
mod metadata;
mod notification;
mod rank_report;

pub use handshake::{worker_handshake, worker_handshake_fields};
pub use metadata::{worker_connector_metadata, worker_metadata_fields};
pub use notification::worker_notification;
pub use rank_report::rank_report_aggregate;

pub(crate) use handshake::{worker_handshake_fields_seeds, worker_handshake_seeds};
pub(crate) use metadata::{worker_connector_metadata_seeds, worker_metadata_fields_seeds};
pub(crate) use notification::worker_notification_seeds;
pub(crate) use rank_report::rank_report_samples;

#[cfg(test)]
mod tests {
    use kvx_core::Finished;

    use super::handshake::{handshake_fields_session, handshake_session};
    use super::metadata::metadata_fields_session;
    use crate::targets::fixture::prefill;

    fn loaded(finished: &Finished, id: &str) -> bool {
        finished.recving.iter().any(|r| r.as_str() == id)
    }

    #[test]
    fn the_natural_inputs_load_so_the_targets_reach_the_read() {
        assert!(loaded(&handshake_session(&prefill().payload), "load"));
        assert!(loaded(&handshake_fields_session(&[]), "req-0"));
        let plain = metadata_fields_session(&[]);
        assert!(loaded(&plain, "s0-r0"), "{plain:?}");
        let keyed = metadata_fields_session(&[0, 1]);
        assert!(loaded(&keyed, "s0-r0"), "a valid MAC: {keyed:?}");
        let no_mac = metadata_fields_session(&[[0u8, 1, 0].as_slice(), &[0; 12], &[1]].concat());
        assert!(!loaded(&no_mac, "s0-r0"), "no MAC in a keyed deployment: {no_mac:?}");
        let other_offer = metadata_fields_session(&[[0u8, 1, 0].as_slice(), &[0; 12], &[3]].concat());
        assert!(!loaded(&other_offer, "s0-r0"), "another offer's MAC: {other_offer:?}");
        for lease in 1..4u8 {
            let unheld = metadata_fields_session(&[[0u8, 0, 0].as_slice(), &[0; 12], &[lease]].concat());
            assert!(!loaded(&unheld, "s0-r0"), "lease choice {lease}: {unheld:?}");
            assert_eq!(unheld.failed_recving.len(), 1, "{unheld:?}");
        }
        let shared = [0u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0];
        let two = metadata_fields_session(&[[0u8, 0, 1].as_slice(), &shared, &shared].concat());
        assert_eq!((two.recving.len(), two.failed_recving.len()), (1, 1), "one load per offer: {two:?}");
    }
}
