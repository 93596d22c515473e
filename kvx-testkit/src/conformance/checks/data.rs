//! Moving data and notifications.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Instant;

use kvx_core::{
    AgentName, ErrorKind, MAX_NOTIFICATION_LEN, NotificationWaker, TransferAgent, XferId, XferOp,
};

use crate::conformance::fixture::Fixture;
use crate::conformance::harness::Harness;
use crate::conformance::support::{
    any_op, assert_no_more_notifications, expect_kind, ok, skip_because, skip_without, wait_done,
    wait_notifications,
};

/// READ of 64 random, non-contiguous block pairs across two regions on each side; every byte of
/// both sides is checked afterwards.
pub fn check_read_scattered<H: Harness + ?Sized>(h: &H) {
    if skip_without(h, "READ", |c| c.read) {
        return;
    }
    scattered(h, XferOp::Read, 0x5eed_0001);
}

/// WRITE of 64 random, non-contiguous block pairs across two regions on each side; every byte of
/// both sides is checked afterwards.
pub fn check_write_scattered<H: Harness + ?Sized>(h: &H) {
    if skip_without(h, "WRITE", |c| c.write) {
        return;
    }
    scattered(h, XferOp::Write, 0x5eed_0002);
}

fn scattered<H: Harness + ?Sized>(h: &H, op: XferOp, seed: u64) {
    let mut f = Fixture::new(h, seed);
    let pairs = f.random_pairs(64);
    let x = ok(f.post(op, &pairs, None), "post");
    wait_done(h, x, "scattered transfer");
    f.apply(op, &pairs);
    f.verify("after a scattered transfer");
    ok(h.initiator().release(x), "release");
}

/// A notification attached to a READ reaches the target exactly once, from the initiator, and only
/// once the data is in the initiator's memory.
pub fn check_notification_with_read<H: Harness + ?Sized>(h: &H) {
    if skip_without(h, "READ with notifications", |c| c.read && c.notifications) {
        return;
    }
    notification_with(h, XferOp::Read, 0x5eed_0003);
}

/// A notification attached to a WRITE reaches the target exactly once, from the initiator, and only
/// once the data is in the target's memory.
pub fn check_notification_with_write<H: Harness + ?Sized>(h: &H) {
    if skip_without(h, "WRITE with notifications", |c| c.write && c.notifications) {
        return;
    }
    notification_with(h, XferOp::Write, 0x5eed_0004);
}

fn notification_with<H: Harness + ?Sized>(h: &H, op: XferOp, seed: u64) {
    let mut f = Fixture::new(h, seed);
    let pairs = f.random_pairs(16);
    let msg = format!("kvx-conformance-{op:?}-{seed:x}").into_bytes();
    let x = ok(f.post(op, &pairs, Some(&msg)), "post with notification");
    f.apply(op, &pairs);
    // Whenever the notification arrives, the data must already be in place.
    wait_notifications(h, std::slice::from_ref(&msg), |_| {
        f.verify("when the transfer's notification arrived")
    });
    wait_done(h, x, "transfer with notification");
    f.verify("after the transfer");
    ok(h.initiator().release(x), "release");
    assert_no_more_notifications(h, "after a transfer's notification (duplicate?)");
}

/// `notify` without data reaches the target, a message of [`MAX_NOTIFICATION_LEN`] bytes intact;
/// notifying an agent that is not loaded is `NotFound`.
pub fn check_standalone_notify<H: Harness + ?Sized>(h: &H) {
    if skip_without(h, "notifications", |c| c.notifications) {
        return;
    }
    let f = Fixture::new(h, 0x5eed_0005);
    let longest: Vec<u8> = (0..MAX_NOTIFICATION_LEN).map(|i| (i % 251) as u8).collect();
    let msgs = [b"kvx-standalone-1".to_vec(), b"kvx-standalone-2".to_vec(), longest];
    for m in &msgs {
        ok(h.initiator().notify(&f.target_name, m), "notify");
    }
    wait_notifications(h, &msgs, |_| {});
    expect_kind(
        h.initiator().notify(&AgentName::new("kvx-no-such-agent"), b"x"),
        ErrorKind::NotFound,
        "notify to an agent that is not loaded",
    );
    assert_no_more_notifications(h, "after standalone notifications");
    f.verify("after notifications (no data may move)");
}

/// A target whose `wake_on_notification` says it wakes calls the waker for a notification while
/// nobody drives it (no drain, no progress of the target), once the notification can be drained;
/// one that says it does not is skipped.
pub fn check_wake_on_notification<H: Harness + ?Sized>(h: &H) {
    if skip_without(h, "notifications", |c| c.notifications) {
        return;
    }
    let f = Fixture::new(h, 0x5eed_000a);
    let woken = Arc::new((Mutex::new(0u32), Condvar::new()));
    let w = woken.clone();
    let wakes = h.target().wake_on_notification(NotificationWaker::new(move || {
        *w.0.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        w.1.notify_all();
    }));
    if !wakes {
        skip_because(&format!(
            "backend {} does not wake on notifications",
            h.target().capabilities().backend
        ));
        return;
    }
    let msg = b"kvx-conformance-wake".to_vec();
    ok(h.initiator().notify(&f.target_name, &msg), "notify");
    let deadline = Instant::now() + h.deadline();
    let (count, cond) = &*woken;
    let mut wakes = count.lock().unwrap_or_else(PoisonError::into_inner);
    while *wakes == 0 {
        let left = deadline.checked_duration_since(Instant::now());
        let left = left.unwrap_or_else(|| panic!("no wake within {:?} of a notification", h.deadline()));
        // The initiator alone is driven (a backend may send from its caller's thread).
        drop(wakes);
        ok(h.initiator().progress(), "progress of the initiator");
        wakes = count.lock().unwrap_or_else(PoisonError::into_inner);
        if *wakes == 0 {
            wakes = cond
                .wait_timeout(wakes, left.min(h.deadline() / 100))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
    drop(wakes);
    wait_notifications(h, &[msg], |_| {});
    assert_no_more_notifications(h, "after a woken notification");
}

/// 32 transfers posted before any is polled all complete, with every byte and every notification.
pub fn check_many_in_flight<H: Harness + ?Sized>(h: &H) {
    let caps = h.initiator().capabilities();
    let op = any_op(caps);
    let mut f = Fixture::new(h, 0x5eed_0006);
    let pairs = f.random_pairs(64);
    let mut posted = Vec::new();
    let mut msgs = Vec::new();
    for (i, chunk) in pairs.chunks(2).enumerate() {
        let msg = format!("kvx-in-flight-{i}").into_bytes();
        let notify = caps.notifications.then_some(msg.as_slice());
        posted.push(ok(f.post(op, chunk, notify), "post"));
        if caps.notifications {
            msgs.push(msg);
        }
    }
    assert_eq!(posted.len(), 32);
    f.apply(op, &pairs);
    for &x in &posted {
        wait_done(h, x, "one of 32 transfers in flight");
    }
    f.verify("after 32 transfers in flight");
    wait_notifications(h, &msgs, |_| {});
    for &x in &posted {
        ok(h.initiator().release(x), "release");
        expect_kind(h.initiator().poll(x), ErrorKind::NotFound, "polling a released transfer");
    }
}

/// Polling or releasing a transfer this agent does not know is `NotFound`; a settled transfer
/// keeps its state until released.
pub fn check_unknown_transfer<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    expect_kind(ini.poll(XferId(u64::MAX)), ErrorKind::NotFound, "polling an unknown transfer");
    expect_kind(ini.release(XferId(u64::MAX)), ErrorKind::NotFound, "releasing an unknown transfer");
    let op = any_op(ini.capabilities());
    let f = Fixture::new(h, 0x5eed_0007);
    let x = ok(f.post(op, &[(0, 0)], None), "post");
    wait_done(h, x, "one-block transfer");
    for _ in 0..3 {
        assert_eq!(ok(ini.poll(x), "poll"), kvx_core::XferState::Done, "Done is final");
    }
    ok(ini.release(x), "release");
    expect_kind(ini.poll(x), ErrorKind::NotFound, "polling a released transfer");
    expect_kind(ini.release(x), ErrorKind::NotFound, "releasing a transfer twice");
}
