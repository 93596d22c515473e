//! The conformance suite: plain `check_*` functions that any pair of [`TransferAgent`]s must
//! pass, and [`conformance_tests!`](crate::conformance_tests) to run each as its own `#[test]`.
//!
//! Each check takes a [`Harness`]: two agents (the *initiator* posts transfers, the *target*'s
//! memory is read and written), a way to allocate memory they can register, and a way to drive
//! both agents' progress. Checks panic with a message on failure, like `assert!`, and expect
//! exactly one [`ErrorKind`](kvx_core::ErrorKind) for each call that must fail: the one
//! [`TransferAgent`]'s documentation names. They leave the agents as they found them
//! (registrations, loaded remotes and descriptor lists are undone, also when a check panics).
//!
//! Every wait is a bounded loop that calls [`Harness::progress`] (both agents) until
//! [`Harness::deadline`] passes: no sleeps. Capability differences are read from
//! [`TransferAgent::capabilities`]: a check whose capability is missing says so on stderr and
//! returns.
//!
//! - [`checks::agents`]: capabilities, registrations, metadata, descriptor lists.
//! - [`checks::data`]: READ and WRITE of scattered blocks, notifications, many transfers in flight.
//! - [`checks::validation`]: every argument `post` refuses, with its kind.
//! - [`checks::blocks`]: `post_blocks` of runs, scattered blocks, windows and whole regions,
//!   every byte checked, and what it refuses.
//! - [`checks::lifetimes`]: deregistering, forgetting and releasing, also while transfers are in
//!   flight.
//! - [`checks::failures`]: a transfer that fails in its transport reports a typed error.
//! - [`checks::completions`]: `drain_completions` reports each transfer once, done or failed,
//!   and never a released one.
//!
//! [`TransferAgent`]: kvx_core::TransferAgent
//! [`TransferAgent::capabilities`]: kvx_core::TransferAgent::capabilities

pub mod checks;
mod fixture;
mod harness;
mod support;

// Every check at `conformance::check_*`: the checks are listed once, in `conformance_tests!`.
pub use checks::{agents::*, blocks::*, completions::*, data::*, failures::*, lifetimes::*, validation::*};
pub use harness::{Dyn, Harness, Pair, Side, TestBuffer};
pub use kvx_core::ByteAccess;

/// One `#[test]` per check of the suite, named after the check. `$setup` is called with the
/// test's path (`module::check_name`) and returns the [`Harness`](crate::conformance::Harness) to
/// run it on (a new one for each test), or `None` to skip it (after saying why, loudly).
///
/// Invoke it once per configuration of a backend, each in its own module:
///
/// ```ignore
/// mod tcp {
///     use super::*;
///     kvx_testkit::conformance_tests!(|_test: &str| Some(Pair::new(agent("a"), agent("b"))));
/// }
/// ```
///
/// `cargo test --test conformance -- --list` then names every check of every configuration
/// (`tcp::check_read_scattered`, ...), and a failure names the check that failed.
#[macro_export]
macro_rules! conformance_tests {
    ($setup:expr) => {
        $crate::conformance_tests!(@each $setup;
            check_capabilities,
            check_unsupported_operations,
            check_registration,
            check_metadata_round_trip,
            check_garbage_metadata,
            check_dlist_outside_registration,
            check_read_scattered,
            check_write_scattered,
            check_notification_with_read,
            check_notification_with_write,
            check_standalone_notify,
            check_wake_on_notification,
            check_many_in_flight,
            check_unknown_transfer,
            check_unknown_dlist,
            check_wrong_dlist_owner_rejected,
            check_unequal_lengths_rejected,
            check_empty_post_rejected,
            check_unequal_block_lengths_rejected,
            check_out_of_range_rejected,
            check_oversized_notification_rejected,
            check_block_post_contiguous,
            check_block_post_scattered,
            check_block_post_windowed,
            check_block_post_whole_regions,
            check_block_post_rejects_like_post,
            check_forget_remote,
            check_deregister_in_flight,
            check_release_in_flight,
            check_forget_remote_in_flight,
            check_failed_transfer_is_typed,
            check_completions_reported_once,
            check_failed_completion_reported_once,
            check_released_transfers_not_reported,
        );
    };
    (@each $setup:expr; $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                let test = ::std::concat!(::std::module_path!(), "::", ::std::stringify!($check));
                if let ::std::option::Option::Some(harness) = ($setup)(test) {
                    $crate::conformance::$check(&harness);
                }
            }
        )*
    };
}

#[cfg(test)]
mod tests {
    /// `conformance_tests!` names every `pub fn check_*` of `checks`, each once: the macro's list
    /// is the suite's only list, so a check left out of it would run nowhere.
    #[test]
    fn conformance_tests_runs_every_check() {
        let sources = [
            include_str!("checks/agents.rs"),
            include_str!("checks/blocks.rs"),
            include_str!("checks/completions.rs"),
            include_str!("checks/data.rs"),
            include_str!("checks/failures.rs"),
            include_str!("checks/lifetimes.rs"),
            include_str!("checks/validation.rs"),
        ];
        let name =
            |rest: &str| rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().map(str::to_owned);
        let mut defined: Vec<String> =
            sources.iter().flat_map(|s| s.split("pub fn check_").skip(1)).filter_map(name).collect();
        let this = include_str!("mod.rs");
        let list = this.split("@each $setup;").nth(1).and_then(|l| l.split(");").next()).unwrap_or_default();
        let mut run: Vec<String> =
            list.split(',').filter_map(|c| c.trim().strip_prefix("check_")).filter_map(name).collect();
        defined.sort();
        run.sort();
        assert!(!run.is_empty(), "no checks found in conformance_tests!");
        assert_eq!(defined, run);
    }
}
