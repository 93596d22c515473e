//! Transfers that fail after they were posted.

use kvx_core::{ErrorKind, TransferAgent, XferState};

use crate::conformance::fixture::Fixture;
use crate::conformance::harness::Harness;
use crate::conformance::support::{any_op, ok, skip_because, wait_done, wait_settled};

/// A transfer that fails in its transport (injected by [`Harness::fail_next_transfer`]) ends
/// `Failed` with a typed error: kind `Transfer`, the backend's name. The state is final, and the
/// agent keeps working.
pub fn check_failed_transfer_is_typed<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let caps = ini.capabilities();
    let op = any_op(caps);
    let mut f = Fixture::new(h, 0x5eed_0015);
    if !ok(h.fail_next_transfer(), "fail_next_transfer") {
        return skip_because(&format!("the harness cannot make a {} transfer fail", caps.backend));
    }
    let pairs = f.random_pairs(8);
    let x = ok(f.post(op, &pairs, None), "post of a transfer that will fail");
    let XferState::Failed(e) = wait_settled(h, x, "a transfer made to fail") else {
        panic!("a transfer made to fail ended Done");
    };
    assert_eq!(e.kind(), ErrorKind::Transfer, "{e}");
    assert_eq!(e.backend(), Some(caps.backend), "{e}");
    assert_eq!(ok(ini.poll(x), "poll"), XferState::Failed(e), "Failed is final");
    ok(ini.release(x), "release");
    f.resync(); // the failed transfer's destination holds unspecified bytes

    let pairs = f.random_pairs(8);
    let x = ok(f.post(op, &pairs, None), "post after a failed transfer");
    wait_done(h, x, "a transfer after a failed one");
    f.apply(op, &pairs);
    f.verify("after a transfer following a failed one");
    ok(ini.release(x), "release");
}
