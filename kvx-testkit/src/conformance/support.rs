//! Waiting, expectations and randomness for the checks. Every wait drives
//! [`Harness::progress`] and is bounded by [`Harness::deadline`].

use std::fmt;
use std::time::Instant;

use kvx_core::{
    BlockList, Capabilities, Error, ErrorKind, Notification, Result, TransferAgent, XferId, XferOp, XferState,
};

use super::harness::{Harness, TestBuffer};

/// Polls `x` on the initiator, driving both agents, until it is `Done`; panics on `Failed` or
/// when the deadline passes.
#[track_caller]
pub(crate) fn wait_done<H: Harness + ?Sized>(h: &H, x: XferId, what: &str) {
    if let XferState::Failed(e) = wait_settled(h, x, what) {
        panic!("{what}: transfer {x} failed: {e}");
    }
}

/// Polls `x` on the initiator, driving both agents, until it is `Done` or `Failed`; panics when
/// the deadline passes.
#[track_caller]
pub(crate) fn wait_settled<H: Harness + ?Sized>(h: &H, x: XferId, what: &str) -> XferState {
    let deadline = Instant::now() + h.deadline();
    loop {
        ok(h.progress(), "progress");
        match ok(h.initiator().poll(x), "poll") {
            XferState::Pending => {}
            settled => return settled,
        }
        assert!(Instant::now() < deadline, "{what}: transfer {x} still pending after {:?}", h.deadline());
    }
}

/// Drives both agents until `done` holds; panics when the deadline passes.
#[track_caller]
pub(crate) fn wait_until<H: Harness + ?Sized>(h: &H, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + h.deadline();
    while !done() {
        ok(h.progress(), "progress");
        assert!(Instant::now() < deadline, "{what}: not within {:?}", h.deadline());
    }
}

/// Drains the target until every message of `want` has arrived (in any order), calling
/// `on_arrival` as each arrives; each must come from the initiator, and nothing else may arrive.
pub(crate) fn wait_notifications<H: Harness + ?Sized>(
    h: &H,
    want: &[Vec<u8>],
    mut on_arrival: impl FnMut(&[u8]),
) {
    let deadline = Instant::now() + h.deadline();
    let mut missing: Vec<&[u8]> = want.iter().map(Vec::as_slice).collect();
    let mut got: Vec<Notification> = Vec::new();
    while !missing.is_empty() {
        ok(h.progress(), "progress");
        ok(h.target().drain_notifications(&mut got), "drain_notifications");
        for n in got.drain(..) {
            assert_eq!(&n.from, h.initiator().name(), "notification from an unexpected agent");
            match missing.iter().position(|m| *m == n.msg.as_slice()) {
                Some(i) => {
                    missing.swap_remove(i);
                    on_arrival(&n.msg);
                }
                None => panic!("unexpected or duplicate notification {:?}", String::from_utf8_lossy(&n.msg)),
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} notification(s) missing after {:?}, e.g. {:?}",
            missing.len(),
            h.deadline(),
            missing.first().map(|m| String::from_utf8_lossy(m))
        );
    }
}

/// Drives progress a few rounds and checks that no notification arrives at either agent.
pub(crate) fn assert_no_more_notifications<H: Harness + ?Sized>(h: &H, when: &str) {
    let mut got = Vec::new();
    for _ in 0..20 {
        ok(h.progress(), "progress");
        ok(h.target().drain_notifications(&mut got), "drain_notifications");
        ok(h.initiator().drain_notifications(&mut got), "drain_notifications");
    }
    assert!(got.is_empty(), "{when}: unexpected notifications {got:?}");
}

/// Whether to skip a check because the backend lacks what it needs (said on stderr).
pub(crate) fn skip_without<H: Harness + ?Sized>(
    h: &H,
    what: &str,
    has: impl Fn(&Capabilities) -> bool,
) -> bool {
    let caps = h.initiator().capabilities();
    let skip = !has(&caps);
    if skip {
        skip_because(&format!("backend {} does not support {what}", caps.backend));
    }
    skip
}

/// Says on stderr why a check is skipped.
pub(crate) fn skip_because(why: &str) {
    eprintln!("kvx-testkit: SKIPPED a check: {why}");
}

/// The operations the backend supports.
pub(crate) fn ops(caps: Capabilities) -> impl Iterator<Item = XferOp> {
    [(XferOp::Read, caps.read), (XferOp::Write, caps.write)]
        .into_iter()
        .filter(|&(_, on)| on)
        .map(|(op, _)| op)
}

/// READ if the backend supports it, else WRITE.
pub(crate) fn any_op(caps: Capabilities) -> XferOp {
    if caps.read { XferOp::Read } else { XferOp::Write }
}

/// A list of `num_blocks` equal blocks covering the start of `buf`.
pub(crate) fn whole(buf: &TestBuffer, num_blocks: u32) -> BlockList {
    let r = buf.region();
    BlockList {
        kind: r.kind,
        device: r.device,
        bases: vec![r.addr],
        num_blocks,
        block_len: r.len / u64::from(num_blocks.max(1)),
    }
}

#[track_caller]
pub(crate) fn ok<T>(r: Result<T>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{what}: unexpected error: {e}"),
    }
}

/// The error of `r`, which must be of `kind`.
#[track_caller]
pub(crate) fn expect_kind<T: fmt::Debug>(r: Result<T>, kind: ErrorKind, what: &str) -> Error {
    match r {
        Ok(v) => panic!("{what}: expected an error of kind {kind:?}, got Ok({v:?})"),
        Err(e) => {
            assert_eq!(e.kind(), kind, "{what}: expected an error of kind {kind:?}, got: {e}");
            e
        }
    }
}

/// SplitMix64: a small seeded generator, so every run moves the same blocks.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(crate) fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// `k` distinct values below `n`, in random order (a partial Fisher-Yates shuffle).
    pub(crate) fn distinct(&mut self, n: u32, k: usize) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        let k = k.min(v.len());
        for i in 0..k {
            let span = (v.len() - i) as u64;
            let j = i + (self.next_u64() % span) as usize;
            v.swap(i, j);
        }
        v.truncate(k);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixture::{PAD, Shape};
    use super::*;

    #[test]
    fn distinct_values_are_distinct_and_in_range() {
        let mut rng = SplitMix(7);
        let mut v = rng.distinct(128, 64);
        assert_eq!(v.len(), 64);
        assert!(v.iter().all(|&x| x < 128));
        v.sort_unstable();
        v.dedup();
        assert_eq!(v.len(), 64);
        assert_eq!(rng.distinct(3, 10).len(), 3);
    }

    #[test]
    fn shape_locates_descriptors_region_major() {
        let s = Shape::DEFAULT;
        assert_eq!(s.len(), 128);
        assert_eq!(s.locate(0), (0, PAD));
        assert_eq!(s.locate(65), (1, PAD + 4096));
    }
}
