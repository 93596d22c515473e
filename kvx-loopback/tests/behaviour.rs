//! kvx-loopback's own behaviour beyond the conformance suite: copy-time checks, peers that go away,
//! progress threads, lock ordering. (Fault injection is kvx-testkit's chaos layer, tested there.)

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::wire::agent_metadata;
use kvx_core::{
    AgentName, BlockList, DlistId, DlistOwner, ErrorKind, HostMemory, KvMemory, MemKind, MemRegion,
    Notification, RegistrationId, TransferAgent, XferId, XferOp, XferState,
};
use kvx_loopback::{AgentOptions, Fabric, LoopbackAgent};

const BLOCKS: u32 = 8;
const BLOCK: u64 = 256;

/// Decode (initiator) and prefill (target), one registered buffer of 8 blocks each, prefill's
/// block b filled with byte b + 1, loaded and with one list per side.
struct Setup {
    fabric: Fabric,
    decode: LoopbackAgent,
    prefill: LoopbackAgent,
    decode_mem: Arc<HostMemory>,
    prefill_mem: Arc<HostMemory>,
    decode_reg: RegistrationId,
    prefill_reg: RegistrationId,
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
        Self::with(AgentOptions::explicit())
    }

    fn with(options: AgentOptions) -> Self {
        let fabric = Fabric::new();
        let decode = fabric.agent_with("decode", options.clone()).unwrap();
        let prefill = fabric.agent_with("prefill", options).unwrap();
        let len = (u64::from(BLOCKS) * BLOCK) as usize;
        let decode_mem = Arc::new(HostMemory::new(len).unwrap());
        let prefill_mem = Arc::new(HostMemory::new(len).unwrap());
        for b in 0..BLOCKS as usize {
            prefill_mem.fill(b * BLOCK as usize, BLOCK as usize, b as u8 + 1).unwrap();
        }
        let decode_reg = decode.register(decode_mem.clone()).unwrap();
        let prefill_reg = prefill.register(prefill_mem.clone()).unwrap();
        let peer = decode.load_remote(&prefill.local_metadata().unwrap()).unwrap();
        let local = decode.prep_dlist(&DlistOwner::Local, &list(&decode_mem)).unwrap();
        let remote = decode.prep_dlist(&DlistOwner::Remote(peer), &list(&prefill_mem)).unwrap();
        Setup { fabric, decode, prefill, decode_mem, prefill_mem, decode_reg, prefill_reg, local, remote }
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

    fn decode_untouched(&self) -> bool {
        self.decode_mem.to_vec().iter().all(|&b| b == 0)
    }

    fn notes(&self) -> Vec<Notification> {
        let mut out = Vec::new();
        self.prefill.drain_notifications(&mut out).unwrap();
        out
    }
}

/// Progresses the agent until the transfer leaves `Pending`, within 10 s.
fn settle(agent: &LoopbackAgent, x: XferId) -> XferState {
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
fn memory_the_peer_deregisters_fails_a_queued_transfer_but_local_memory_stays_pinned() {
    let s = Setup::new();
    let x = s.read(&[0], &[1], Some(b"never"));
    s.prefill.deregister(s.prefill_reg).unwrap();
    match settle(&s.decode, x) {
        XferState::Failed(e) => {
            assert_eq!((e.kind(), e.backend()), (ErrorKind::Transfer, Some("loopback")), "{e}")
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    assert!(s.decode_untouched());
    assert!(s.notes().is_empty());

    let s = Setup::new();
    let x = s.read(&[0], &[1], Some(b"kept"));
    s.decode.deregister(s.decode_reg).unwrap();
    assert_eq!(Arc::strong_count(&s.decode_mem), 2, "the queued transfer holds the memory");
    assert_eq!(settle(&s.decode, x), XferState::Done);
    assert_eq!(s.decode_block(0), Some(2));
    assert_eq!(Arc::strong_count(&s.decode_mem), 1, "released once the transfer settled");
    assert_eq!(msgs(&s.notes()), [&b"kept"[..]]);
}

#[test]
fn registration_keeps_memory_alive() {
    let fabric = Fabric::new();
    let (decode, prefill) = (fabric.agent("decode").unwrap(), fabric.agent("prefill").unwrap());
    let src = Arc::new(HostMemory::new(4096).unwrap());
    src.fill(0, 4096, 0x5a).unwrap();
    let blocks = list(&src);
    prefill.register(src).unwrap(); // the only Arc now lives in the agent
    let dst = Arc::new(HostMemory::new(4096).unwrap());
    decode.register(dst.clone()).unwrap();
    let peer = decode.load_remote(&prefill.local_metadata().unwrap()).unwrap();
    let local = decode.prep_dlist(&DlistOwner::Local, &list(&dst)).unwrap();
    let remote = decode.prep_dlist(&DlistOwner::Remote(peer), &blocks).unwrap();
    let all: Vec<u32> = (0..BLOCKS).collect();
    let x = decode.post(XferOp::Read, local, &all, remote, &all, None).unwrap();
    assert_eq!(settle(&decode, x), XferState::Done);
    assert!(dst.to_vec()[..(u64::from(BLOCKS) * BLOCK) as usize].iter().all(|&b| b == 0x5a));
}

#[test]
fn a_dropped_peer_fails_transfers_and_its_metadata_goes_stale() {
    let s = Setup::new();
    let md = s.prefill.local_metadata().unwrap();
    let x = s.read(&[0], &[0], None);
    let Setup { fabric, decode, prefill, decode_mem, .. } = s;
    drop(prefill);
    assert!(matches!(settle(&decode, x), XferState::Failed(e) if e.kind() == ErrorKind::Transfer));
    assert!(decode_mem.to_vec().iter().all(|&b| b == 0));
    assert_eq!(decode.notify(&AgentName::new("prefill"), b"x").unwrap_err().kind(), ErrorKind::Transfer);

    // A restarted peer has the same name and new metadata; the old metadata is refused.
    let restarted = fabric.agent("prefill").unwrap();
    decode.forget_remote(&AgentName::new("prefill")).unwrap();
    assert_eq!(decode.load_remote(&md).unwrap_err().kind(), ErrorKind::Handshake);
    assert_eq!(decode.load_remote(&restarted.local_metadata().unwrap()).unwrap().as_str(), "prefill");
}

#[test]
fn names_are_unique_per_fabric_and_fabrics_are_separate() {
    let fabric = Fabric::new();
    let a = fabric.agent("a").unwrap();
    assert_eq!(fabric.agent("a").unwrap_err().kind(), ErrorKind::State);
    assert_eq!(fabric.clone().agent("a").unwrap_err().kind(), ErrorKind::State, "clones are one fabric");
    assert_eq!(fabric.agent("").unwrap_err().kind(), ErrorKind::InvalidArgument);
    let elsewhere = Fabric::new().agent("a").unwrap();
    let e = elsewhere.load_remote(&a.local_metadata().unwrap()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Handshake, "metadata of another fabric is unreachable");
    drop(a);
    fabric.agent("a").unwrap();
}

/// Agent metadata is kvx-core's envelope: another backend's is `Incompatible`, a byte after it
/// `InvalidPeerData`, and neither loads anything. Names the envelope cannot carry make no agent.
#[test]
fn metadata_of_another_backend_is_incompatible_and_bytes_after_it_are_invalid() {
    let fabric = Fabric::new();
    let (a, b) = (fabric.agent("a").unwrap(), fabric.agent("b").unwrap());
    let md = b.local_metadata().unwrap();
    for backend in ["ucx", "nixl"] {
        let other = agent_metadata::seal(backend, b.name(), &()).unwrap();
        let e = a.load_remote(&other).unwrap_err();
        assert_eq!((e.kind(), e.backend()), (ErrorKind::Incompatible, Some("loopback")), "{backend}: {e}");
    }
    let e = a.load_remote(&[&md[..], &[0]].concat()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "{e}");
    assert_eq!(a.load_remote(&md).unwrap().as_str(), "b", "nothing was half-loaded");
    for bad in ["n".repeat(agent_metadata::MAX_AGENT_NAME + 1), "a\0".to_owned()] {
        assert_eq!(fabric.agent(bad).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
}

/// Host memory that claims to be GPU memory: the loopback must refuse it without touching it.
#[derive(Debug)]
struct LabelledVram(HostMemory);

// SAFETY: the region is the inner HostMemory's live allocation (only its kind is relabelled), which
// lives, unmoved, as long as this value.
unsafe impl KvMemory for LabelledVram {
    fn region(&self) -> MemRegion {
        MemRegion { kind: MemKind::Vram, device: 0, ..self.0.region() }
    }
}

#[test]
fn only_host_memory_registers() {
    let agent = Fabric::new().agent("a").unwrap();
    assert!(!agent.capabilities().vram);
    let vram = Arc::new(LabelledVram(HostMemory::new(64).unwrap()));
    assert_eq!(agent.register(vram).unwrap_err().kind(), ErrorKind::Unsupported);
}

#[test]
fn lists_of_zero_length_blocks_are_refused() {
    let s = Setup::new();
    let empty = BlockList { block_len: 0, ..list(&s.decode_mem) };
    assert_eq!(
        s.decode.prep_dlist(&DlistOwner::Local, &empty).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}

#[test]
fn releasing_a_queued_transfer_cancels_it() {
    let s = Setup::new();
    let x = s.read(&[0], &[0], Some(b"cancelled"));
    s.decode.release(x).unwrap();
    s.decode.progress().unwrap();
    assert!(s.decode_untouched());
    assert!(s.notes().is_empty());
    assert_eq!(s.decode.poll(x).unwrap_err().kind(), ErrorKind::NotFound);
}

#[test]
fn forgetting_a_peer_leaves_its_queued_transfers_to_run() {
    let s = Setup::new();
    let x = s.read(&[0], &[0], Some(b"after forget"));
    s.decode.forget_remote(s.prefill.name()).unwrap();
    assert_eq!(
        s.decode.post(XferOp::Read, s.local, &[1], s.remote, &[1], None).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    assert_eq!(settle(&s.decode, x), XferState::Done);
    assert_eq!(s.decode_block(0), Some(1));
    assert_eq!(msgs(&s.notes()), [&b"after forget"[..]]);
}

#[test]
fn an_agent_can_load_itself_and_copy_between_its_own_registrations() {
    let fabric = Fabric::new();
    let agent = fabric.agent("solo").unwrap();
    let (a, b) = (Arc::new(HostMemory::new(4096).unwrap()), Arc::new(HostMemory::new(4096).unwrap()));
    a.fill(0, 4096, 9).unwrap();
    agent.register(a.clone()).unwrap();
    agent.register(b.clone()).unwrap();
    let me = agent.load_remote(&agent.local_metadata().unwrap()).unwrap();
    let local = agent.prep_dlist(&DlistOwner::Local, &list(&b)).unwrap();
    let remote = agent.prep_dlist(&DlistOwner::Remote(me.clone()), &list(&a)).unwrap();
    let x = agent.post(XferOp::Read, local, &[3], remote, &[0], Some(b"self")).unwrap();
    assert_eq!(settle(&agent, x), XferState::Done);
    assert_eq!(b.to_vec()[3 * BLOCK as usize], 9);
    let mut notes = Vec::new();
    agent.drain_notifications(&mut notes).unwrap();
    assert_eq!(notes, [Notification { from: me, msg: b"self".to_vec() }]);
}

#[test]
fn progress_thread_completes_transfers_and_joins_on_drop() {
    let s = Setup::with(AgentOptions::progress_thread());
    let x = s.read(&[1], &[3], Some(b"threaded"));
    // poll only observes here: the thread runs the passes.
    assert_eq!(settle(&s.decode, x), XferState::Done);
    assert_eq!(s.decode_block(1), Some(4));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut notes = Vec::new();
    while notes.is_empty() {
        s.prefill.drain_notifications(&mut notes).unwrap();
        assert!(Instant::now() < deadline);
    }
    assert_eq!(msgs(&notes), [&b"threaded"[..]]);
    drop(s); // joins both threads; the test would hang (and time out) otherwise
}

/// Two agents READ from each other from two threads, both with progress threads: the lock order
/// (never one agent's state while taking the other's) means no deadlock.
#[test]
fn crossing_transfers_from_two_threads_do_not_deadlock() {
    let s = Arc::new(Setup::with(AgentOptions::progress_thread()));
    let peer = s.prefill.load_remote(&s.decode.local_metadata().unwrap()).unwrap();
    let p_local = s.prefill.prep_dlist(&DlistOwner::Local, &list(&s.prefill_mem)).unwrap();
    let p_remote = s.prefill.prep_dlist(&DlistOwner::Remote(peer), &list(&s.decode_mem)).unwrap();
    let other = s.clone();
    let reader = std::thread::spawn(move || {
        for i in 0..200u32 {
            let x = other.read(&[i % 4], &[4 + i % 4], None);
            assert_eq!(settle(&other.decode, x), XferState::Done);
            other.decode.release(x).unwrap();
        }
    });
    for i in 0..200u32 {
        let x = s.prefill.post(XferOp::Read, p_local, &[i % 4], p_remote, &[4 + i % 4], None).unwrap();
        assert_eq!(settle(&s.prefill, x), XferState::Done);
        s.prefill.release(x).unwrap();
    }
    reader.join().unwrap();
    // decode's blocks 0..4 hold prefill's blocks 4..8; prefill's 0..4 hold decode's 4..8 (zero).
    assert_eq!((0..4).map(|b| s.decode_block(b)).collect::<Vec<_>>(), [Some(5), Some(6), Some(7), Some(8)]);
}
