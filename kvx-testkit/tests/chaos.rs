//! The chaos layer (`kvx_testkit::chaos`) over loopback agents: each fault it injects, what a
//! caller sees of it, the net's clock and counts.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{
    BlockList, Clock, DlistId, DlistOwner, ErrorKind, HostMemory, KvMemory, ManualClock, MemKind,
    Notification, TransferAgent, XferId, XferOp, XferState,
};
use kvx_loopback::{Fabric, LoopbackAgent};
use kvx_testkit::chaos::{Chaos, ChaosNet, Faults};

const BLOCKS: u32 = 8;
const BLOCK: u64 = 256;

type Agent = Chaos<LoopbackAgent>;

/// Decode (initiator) and prefill (target) on one chaos net, one registered buffer of 8 blocks
/// each, prefill's block b filled with byte b + 1, loaded and with one list per side.
struct Setup {
    net: ChaosNet,
    decode: Agent,
    prefill: Agent,
    decode_mem: Arc<HostMemory>,
    prefill_mem: Arc<HostMemory>,
    local: DlistId,
    remote: DlistId,
}

fn list(mem: &HostMemory) -> BlockList {
    BlockList {
        kind: MemKind::Dram,
        device: 0,
        bases: vec![mem.region().addr],
        num_blocks: BLOCKS,
        block_len: BLOCK,
    }
}

impl Setup {
    fn new() -> Self {
        Self::on(ChaosNet::new())
    }

    fn on(net: ChaosNet) -> Self {
        let fabric = Fabric::new();
        let decode = Chaos::new(Arc::new(fabric.agent("decode").unwrap()), &net);
        let prefill = Chaos::new(Arc::new(fabric.agent("prefill").unwrap()), &net);
        let len = (u64::from(BLOCKS) * BLOCK) as usize;
        let decode_mem = Arc::new(HostMemory::new(len).unwrap());
        let prefill_mem = Arc::new(HostMemory::new(len).unwrap());
        for b in 0..BLOCKS as usize {
            prefill_mem.fill(b * BLOCK as usize, BLOCK as usize, b as u8 + 1).unwrap();
        }
        decode.register(decode_mem.clone()).unwrap();
        prefill.register(prefill_mem.clone()).unwrap();
        let peer = decode.load_remote(&prefill.local_metadata().unwrap()).unwrap();
        let local = decode.prep_dlist(&DlistOwner::Local, &list(&decode_mem)).unwrap();
        let remote = decode.prep_dlist(&DlistOwner::Remote(peer), &list(&prefill_mem)).unwrap();
        Setup { net, decode, prefill, decode_mem, prefill_mem, local, remote }
    }

    fn read(&self, local: &[u32], remote: &[u32], msg: Option<&[u8]>) -> XferId {
        self.decode.post(XferOp::Read, self.local, local, self.remote, remote, msg).unwrap()
    }

    /// The byte every position of decode's block `b` holds, or `None` if the block is mixed.
    fn decode_block(&self, b: u32) -> Option<u8> {
        let v = self.decode_mem.to_vec();
        let block = &v[(u64::from(b) * BLOCK) as usize..(u64::from(b + 1) * BLOCK) as usize];
        block.iter().all(|&x| x == block[0]).then_some(block[0])
    }

    fn notes(&self) -> Vec<Notification> {
        let mut out = Vec::new();
        self.prefill.drain_notifications(&mut out).unwrap();
        out
    }
}

/// Progresses the agent until the transfer leaves `Pending`, within 10 s.
fn settle(agent: &Agent, x: XferId) -> XferState {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        agent.progress().unwrap();
        match agent.poll(x).unwrap() {
            XferState::Pending => assert!(Instant::now() < deadline, "transfer {x} pending for 10 s"),
            state => return state,
        }
    }
}

fn msgs(notes: &[Notification]) -> Vec<&[u8]> {
    notes.iter().map(|n| n.msg.as_slice()).collect()
}

#[test]
fn nth_transfer_fails_without_moving_data_or_notifying() {
    let s = Setup::new();
    s.decode.set_faults(Faults::none().fail_nth_transfer(2)).unwrap();
    let x1 = s.read(&[0], &[5], Some(b"one"));
    let x2 = s.read(&[1], &[6], Some(b"two"));
    let x3 = s.read(&[2], &[7], Some(b"three"));
    assert_eq!(settle(&s.decode, x1), XferState::Done);
    match settle(&s.decode, x2) {
        XferState::Failed(e) => {
            assert_eq!((e.kind(), e.backend()), (ErrorKind::Transfer, Some("loopback")), "{e}")
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    assert_eq!(settle(&s.decode, x3), XferState::Done);
    assert_eq!((s.decode_block(0), s.decode_block(1), s.decode_block(2)), (Some(6), Some(0), Some(8)));
    assert_eq!(msgs(&s.notes()), [&b"one"[..], b"three"]);
    let mut done = Vec::new();
    s.decode.drain_completions(&mut done).unwrap();
    done.sort();
    assert_eq!(done, [x1, x2, x3], "each ended transfer is drained once, the failed one too");
}

#[test]
fn net_faults_count_posts_of_every_agent() {
    let s = Setup::new();
    // prefill loads decode too, so both agents post.
    let peer = s.prefill.load_remote(&s.decode.local_metadata().unwrap()).unwrap();
    let p_local = s.prefill.prep_dlist(&DlistOwner::Local, &list(&s.prefill_mem)).unwrap();
    let p_remote = s.prefill.prep_dlist(&DlistOwner::Remote(peer), &list(&s.decode_mem)).unwrap();
    s.net.set_faults(Faults::none().fail_nth_transfer(2)).unwrap();
    let x1 = s.read(&[0], &[0], None);
    let x2 = s.prefill.post(XferOp::Write, p_local, &[1], p_remote, &[1], None).unwrap();
    assert_eq!(settle(&s.decode, x1), XferState::Done);
    assert!(matches!(settle(&s.prefill, x2), XferState::Failed(_)), "the net's second post fails");
    assert_eq!(s.decode_block(1), Some(0), "the failed WRITE moved nothing");
    s.net.set_faults(Faults::none()).unwrap();
    let x3 = s.prefill.post(XferOp::Write, p_local, &[1], p_remote, &[1], None).unwrap();
    assert_eq!(settle(&s.prefill, x3), XferState::Done);
    assert_eq!(s.decode_block(1), Some(2));
    assert_eq!(s.net.fault_counts().unwrap().transfers_failed, 1);
}

#[test]
fn delayed_completion_takes_k_passes_of_any_kind() {
    let s = Setup::new();
    s.decode.set_faults(Faults::none().delay_completion(3)).unwrap();
    let x = s.read(&[4], &[2], Some(b"late"));
    let mut done = Vec::new();
    s.decode.drain_completions(&mut done).unwrap(); // pass 1
    s.decode.progress().unwrap(); // pass 2
    s.decode.drain_notifications(&mut Vec::new()).unwrap(); // pass 3
    assert_eq!(s.decode.poll(x).unwrap(), XferState::Pending, "a poll is no pass");
    assert!(done.is_empty(), "nothing completed");
    assert!(s.notes().is_empty(), "no notification before the transfer completes");
    s.decode.drain_completions(&mut done).unwrap(); // pass 4
    assert_eq!(done, [x]);
    assert_eq!(s.decode.poll(x).unwrap(), XferState::Done);
    assert_eq!(s.decode_block(4), Some(3));
    assert_eq!(msgs(&s.notes()), [&b"late"[..]]);
}

#[test]
fn nth_notification_is_dropped_or_duplicated() {
    let s = Setup::new();
    s.decode.set_faults(Faults::none().drop_nth_notification(1).duplicate_nth_notification(3)).unwrap();
    let x = s.read(&[0], &[0], Some(b"lost"));
    assert_eq!(settle(&s.decode, x), XferState::Done, "the transfer completes without its notification");
    assert_eq!(s.decode_block(0), Some(1));
    s.decode.notify(s.prefill.name(), b"kept").unwrap();
    s.decode.notify(s.prefill.name(), b"twice").unwrap();
    s.decode.notify(s.prefill.name(), b"once").unwrap();
    let notes = s.notes();
    assert_eq!(msgs(&notes), [&b"kept"[..], b"twice", b"twice", b"once"]);
    assert!(notes.iter().all(|n| n.from.as_str() == "decode"));
}

#[test]
fn seeded_delays_follow_the_net_clock_and_next_event_says_when() {
    let clock = ManualClock::new();
    let s = Setup::on(ChaosNet::with_clock(Arc::new(clock.clone())));
    assert_eq!(s.net.next_event().unwrap(), None, "nothing waits");
    let max = Duration::from_secs(40);
    s.net.set_faults(Faults::none().seed(3).transfer_delays(1.0, max).notification_delays(1.0, max)).unwrap();
    let t0 = clock.now();
    let x = s.read(&[0], &[3], Some(b"late"));
    assert_eq!(s.net.next_event().unwrap(), Some(t0), "a transfer in flight: now");
    let mut done = Vec::new();
    for _ in 0..100 {
        s.decode.drain_completions(&mut done).unwrap();
    }
    assert!(done.is_empty(), "passes do not end a delay in time");
    assert_eq!(s.decode.poll(x).unwrap(), XferState::Pending);
    let due = s.net.next_event().unwrap().unwrap();
    assert!(due > t0 && due <= t0 + max, "{:?}", due - t0);
    clock.advance_to(due);
    s.decode.drain_completions(&mut done).unwrap();
    assert_eq!(done, [x]);
    assert_eq!(s.decode.poll(x).unwrap(), XferState::Done);
    assert_eq!(s.decode_block(0), Some(4));
    s.decode.release(x).unwrap();
    // Its notification goes once the transfer completed, and is late too: the decode agent sends
    // it at its first pass after its time.
    let note_due = s.net.next_event().unwrap().unwrap();
    assert!(note_due > due);
    s.decode.progress().unwrap();
    assert!(s.notes().is_empty());
    clock.advance_to(note_due);
    assert!(s.notes().is_empty(), "the sender has not passed since");
    s.decode.progress().unwrap();
    assert_eq!(msgs(&s.notes()), [&b"late"[..]]);
    assert_eq!(s.net.next_event().unwrap(), None);
    let counts = s.net.fault_counts().unwrap();
    assert_eq!((counts.transfers_delayed, counts.notifications_delayed, counts.transfers_failed), (1, 1, 0));
}

#[test]
fn seeded_notification_faults_drop_double_or_add_a_stray() {
    let s = Setup::new();
    let faults = Faults::none().seed(5);
    s.net.set_faults(faults.clone().stray_notifications(1.0)).unwrap();
    s.decode.notify(s.prefill.name(), b"real").unwrap();
    let notes = s.notes();
    assert_eq!(notes.len(), 2);
    assert_eq!((notes[0].msg.as_slice(), notes[1].from.as_str()), (&b"real"[..], "decode"));
    assert_ne!(notes[1].msg, b"real", "the stray follows the real one");
    s.net.set_faults(faults.clone().notification_drops(1.0).notification_duplicates(1.0)).unwrap();
    s.decode.notify(s.prefill.name(), b"gone").unwrap();
    assert!(s.notes().is_empty(), "a drop wins over a duplicate");
    s.net.set_faults(faults.clone().notification_duplicates(1.0)).unwrap();
    s.decode.notify(s.prefill.name(), b"twice").unwrap();
    assert_eq!(msgs(&s.notes()), [&b"twice"[..], b"twice"]);
    // A transfer's notification: taken off the transfer and sent twice once it is done.
    let x = s.read(&[0], &[0], Some(b"read"));
    assert_eq!(settle(&s.decode, x), XferState::Done);
    assert_eq!(msgs(&s.notes()), [&b"read"[..], b"read"]);
    let counts = s.net.fault_counts().unwrap();
    assert_eq!(
        (counts.stray_notifications, counts.notifications_dropped, counts.notifications_duplicated),
        (1, 1, 2)
    );
}

#[test]
fn refused_handshakes_fail_with_handshake_errors() {
    let (fabric, net) = (Fabric::new(), ChaosNet::new());
    let a = Chaos::new(Arc::new(fabric.agent("a").unwrap()), &net);
    let b = Chaos::new(Arc::new(fabric.agent("b").unwrap()), &net);
    let md_b = b.local_metadata().unwrap();
    let md_a = a.local_metadata().unwrap();

    b.set_faults(Faults::none().refuse_handshakes()).unwrap();
    assert_eq!(a.load_remote(&md_b).unwrap_err().kind(), ErrorKind::Handshake, "loading a refusing peer");
    assert_eq!(b.load_remote(&md_a).unwrap_err().kind(), ErrorKind::Handshake, "a refusing agent loading");
    net.set_agent_faults("b", Faults::none()).unwrap();

    net.set_faults(Faults::none().refuse_handshakes()).unwrap();
    let e = a.load_remote(&md_b).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Handshake);
    assert!(e.is_retryable());
    net.set_faults(Faults::none()).unwrap();
    assert_eq!(a.load_remote(&md_b).unwrap().as_str(), "b");
    drop(b);
    let e = net.set_agent_faults("b", Faults::none()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "a dropped agent leaves the net");
}
