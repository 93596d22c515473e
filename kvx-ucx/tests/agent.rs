//! UCX-specific behaviour beyond the conformance suite: one-sidedness, the progress thread,
//! transfers outliving their handles, and errors.
#![allow(clippy::unwrap_used)] // Test helpers outside #[test] fns panic on failure, like asserts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::wire::agent_metadata;
use kvx_core::{
    BlockList, DlistId, DlistOwner, ErrorKind, HostMemory, KvMemory, MemKind, RegistrationId, TransferAgent,
    XferId, XferOp, XferState,
};
use kvx_ucx::{ProgressThreadConfig, ReadPath, UcxAgent, UcxConfig};

const BLOCK: usize = 64 << 10;
const DEADLINE: Duration = Duration::from_secs(20);

fn list(base: u64, num_blocks: u32) -> BlockList {
    BlockList { kind: MemKind::Dram, device: 0, bases: vec![base], num_blocks, block_len: BLOCK as u64 }
}

/// Byte `i` of block `b` of a pattern that differs per block and per offset.
fn pattern(b: usize, i: usize) -> u8 {
    (b.wrapping_mul(131) ^ i.wrapping_mul(7) ^ (i >> 8)) as u8
}

fn fill_blocks(write: impl Fn(usize, &[u8]), blocks: usize) {
    for b in 0..blocks {
        let data: Vec<u8> = (0..BLOCK).map(|i| pattern(b, i)).collect();
        write(b * BLOCK, &data);
    }
}

/// Polls only the initiator until the transfer settles: the target is never progressed here.
fn wait_initiator_only(agent: &UcxAgent, x: XferId) -> XferState {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let state = agent.poll(x).unwrap();
        if state != XferState::Pending {
            return state;
        }
        assert!(Instant::now() < deadline, "transfer still pending after {DEADLINE:?}");
    }
}

struct Reader {
    agent: UcxAgent,
    local: Arc<HostMemory>,
    registration: RegistrationId,
    local_list: DlistId,
    remote_list: DlistId,
}

fn reader(name: &str, config: &UcxConfig, target: &UcxAgent, remote_base: u64, blocks: u32) -> Reader {
    let agent = UcxAgent::with_config(name, config).unwrap();
    let local = Arc::new(HostMemory::new(blocks as usize * BLOCK).unwrap());
    let registration = agent.register(local.clone()).unwrap();
    agent.load_remote(&target.local_metadata().unwrap()).unwrap();
    let local_list = agent.prep_dlist(&DlistOwner::Local, &list(local.region().addr, blocks)).unwrap();
    let remote_list =
        agent.prep_dlist(&DlistOwner::Remote(target.name().clone()), &list(remote_base, blocks)).unwrap();
    Reader { agent, local, registration, local_list, remote_list }
}

fn verify_reversed(local: &HostMemory, blocks: usize) {
    let got = local.to_vec();
    for (slot, chunk) in got.chunks(BLOCK).enumerate() {
        let b = blocks - 1 - slot;
        assert!(
            chunk.iter().enumerate().all(|(i, &v)| v == pattern(b, i)),
            "block {b} in slot {slot} differs"
        );
    }
}

/// The fast path: memory UCX allocated is read over shared memory while its owner never
/// progresses (no thread, no calls).
#[test]
fn read_of_ucx_allocated_memory_needs_no_target_progress() {
    let target = UcxAgent::new("idle-target").unwrap();
    let blocks = 32u32;
    let pool = target.alloc_memory(blocks as usize * BLOCK).unwrap();
    fill_blocks(|off, d| pool.write(off, d).unwrap(), blocks as usize);
    target.register(pool.clone()).unwrap();
    let r = reader("reader", &UcxConfig::default(), &target, pool.as_ptr() as u64, blocks);
    assert_eq!(r.agent.read_path(target.name()).unwrap(), ReadPath::Get);
    let local: Vec<u32> = (0..blocks).collect();
    let remote: Vec<u32> = (0..blocks).rev().collect();
    let x = r.agent.post(XferOp::Read, r.local_list, &local, r.remote_list, &remote, None).unwrap();
    assert_eq!(wait_initiator_only(&r.agent, x), XferState::Done);
    verify_reversed(&r.local, blocks as usize);
}

/// Memory UCX allocated is mapped into a reader on the same host (`ucp_rkey_ptr`): WRITEs land
/// in it as READs come out of it, block for block, with the target never progressed, up to its
/// last byte.
#[test]
fn write_into_ucx_allocated_memory_needs_no_target_progress() {
    let target = UcxAgent::new("written-target").unwrap();
    let blocks = 32u32;
    let pool = target.alloc_memory(blocks as usize * BLOCK).unwrap();
    target.register(pool.clone()).unwrap();
    let w = reader("writer", &UcxConfig::default(), &target, pool.as_ptr() as u64, blocks);
    fill_blocks(|off, d| w.local.write(off, d).unwrap(), blocks as usize);
    let local: Vec<u32> = (0..blocks).collect();
    let remote: Vec<u32> = (0..blocks).rev().collect();
    let x =
        w.agent.post(XferOp::Write, w.local_list, &local, w.remote_list, &remote, Some(b"written")).unwrap();
    assert_eq!(wait_initiator_only(&w.agent, x), XferState::Done);
    let written = HostMemory::new(pool.len()).unwrap();
    written.write(0, &pool.to_vec()).unwrap();
    verify_reversed(&written, blocks as usize);
}

/// Heap memory over TCP is emulated with messages: the target's progress thread serves it while
/// the test only polls the initiator.
#[test]
fn progress_thread_serves_heap_memory_over_tcp() {
    let tcp = UcxConfig::default().with_transports("tcp");
    let served = tcp.clone().with_progress_thread(ProgressThreadConfig::default());
    let target = UcxAgent::with_config("served-target", &served).unwrap();
    let blocks = 16u32;
    let heap = Arc::new(HostMemory::new(blocks as usize * BLOCK).unwrap());
    fill_blocks(|off, d| heap.write(off, d).unwrap(), blocks as usize);
    target.register(heap.clone()).unwrap();
    let r = reader("tcp-reader", &tcp, &target, heap.region().addr, blocks);
    // Every lane to the target is TCP: the target answers the READ by active messages.
    assert_eq!(r.agent.read_path(target.name()).unwrap(), ReadPath::ActiveMessages);
    let local: Vec<u32> = (0..blocks).collect();
    let remote: Vec<u32> = (0..blocks).rev().collect();
    let x = r.agent.post(XferOp::Read, r.local_list, &local, r.remote_list, &remote, Some(b"done")).unwrap();
    assert_eq!(wait_initiator_only(&r.agent, x), XferState::Done);
    verify_reversed(&r.local, blocks as usize);
    // The progress thread received the notification too; draining hands it out.
    let deadline = Instant::now() + DEADLINE;
    let mut notes = Vec::new();
    while notes.is_empty() {
        target.drain_notifications(&mut notes).unwrap();
        assert!(Instant::now() < deadline, "no notification");
    }
    assert_eq!(notes[0].from.as_str(), "tcp-reader");
    assert_eq!(notes[0].msg, b"done");
}

/// Progresses the target too until the transfer settles.
fn wait_both(agent: &UcxAgent, target: &UcxAgent, x: XferId) -> XferState {
    let deadline = Instant::now() + DEADLINE;
    loop {
        target.progress().unwrap();
        let state = agent.poll(x).unwrap();
        if state != XferState::Pending {
            return state;
        }
        assert!(Instant::now() < deadline, "transfer still pending after {DEADLINE:?}");
    }
}

/// A READ by active messages of memory that the target no longer has registered (deregistered
/// after the reader loaded its metadata) is refused range by range: the READ fails with
/// `Transfer`, nothing is written, and the target goes on serving the memory it still has.
#[test]
fn a_target_refuses_to_answer_from_memory_it_does_not_have_registered() {
    let tcp = UcxConfig::default().with_transports("tcp");
    let target = UcxAgent::with_config("strict-target", &tcp).unwrap();
    let blocks = 8u32;
    let kept = Arc::new(HostMemory::new(blocks as usize * BLOCK).unwrap());
    let gone = Arc::new(HostMemory::new(blocks as usize * BLOCK).unwrap());
    fill_blocks(|off, d| kept.write(off, d).unwrap(), blocks as usize);
    fill_blocks(|off, d| gone.write(off, d).unwrap(), blocks as usize);
    target.register(kept.clone()).unwrap();
    let gone_reg = target.register(gone.clone()).unwrap();
    let r = reader("asker", &tcp, &target, gone.region().addr, blocks);
    assert_eq!(r.agent.read_path(target.name()).unwrap(), ReadPath::ActiveMessages);
    target.deregister(gone_reg).unwrap();

    let local: Vec<u32> = (0..blocks).collect();
    let remote: Vec<u32> = (0..blocks).rev().collect();
    let x = r.agent.post(XferOp::Read, r.local_list, &local, r.remote_list, &remote, Some(b"x")).unwrap();
    match wait_both(&r.agent, &target, x) {
        XferState::Failed(e) => assert_eq!(e.kind(), ErrorKind::Transfer, "{e}"),
        other => panic!("a READ of deregistered memory ended {other:?}"),
    }
    assert!(r.local.to_vec().iter().all(|&v| v == 0), "a refused READ wrote into its slots");
    assert_eq!(target.refused_read_messages(), u64::from(blocks));
    let mut notes = Vec::new();
    target.drain_notifications(&mut notes).unwrap();
    assert!(notes.is_empty(), "a failed READ notified {notes:?}");

    let kept_list = r
        .agent
        .prep_dlist(&DlistOwner::Remote(target.name().clone()), &list(kept.region().addr, blocks))
        .unwrap();
    let x = r.agent.post(XferOp::Read, r.local_list, &local, kept_list, &remote, None).unwrap();
    assert_eq!(wait_both(&r.agent, &target, x), XferState::Done);
    verify_reversed(&r.local, blocks as usize);
    assert_eq!(r.agent.refused_read_messages(), 0);
}

/// With peer failure detection, a peer that goes away fails what is sent to it instead of
/// leaving it pending (or crashing UCX's TCP transport): the next READ and notification fail with
/// `Transfer` naming the dead peer, the endpoint is closed without a flush, and the reader's memory
/// is released.
#[test]
fn a_dead_peer_fails_transfers_with_peer_failure_detection() {
    let config = UcxConfig::default()
        .with_transports("tcp")
        .with_peer_failure_detection()
        .with_progress_thread(ProgressThreadConfig::default());
    assert!(config.peer_failure_detection());
    let target = UcxAgent::with_config("doomed-target", &config).unwrap();
    let blocks = 8u32;
    let heap = Arc::new(HostMemory::new(blocks as usize * BLOCK).unwrap());
    fill_blocks(|off, d| heap.write(off, d).unwrap(), blocks as usize);
    target.register(heap.clone()).unwrap();
    let r = reader("survivor", &config, &target, heap.region().addr, blocks);
    let local: Vec<u32> = (0..blocks).collect();
    let remote: Vec<u32> = (0..blocks).rev().collect();
    let x = r.agent.post(XferOp::Read, r.local_list, &local, r.remote_list, &remote, None).unwrap();
    assert_eq!(wait_initiator_only(&r.agent, x), XferState::Done);
    verify_reversed(&r.local, blocks as usize);
    r.agent.release(x).unwrap();

    drop(target);
    let deadline = Instant::now() + DEADLINE;
    while r.agent.failed_endpoints() == 0 {
        r.agent.progress().unwrap();
        assert!(Instant::now() < deadline, "UCX never reported the dead peer");
    }
    let failure = loop {
        match r.agent.post(XferOp::Read, r.local_list, &local, r.remote_list, &remote, None) {
            Err(e) => break e,
            Ok(x) => match wait_initiator_only(&r.agent, x) {
                XferState::Failed(why) => {
                    r.agent.release(x).unwrap();
                    assert!(Instant::now() < deadline, "still posting to a dead peer: {why}");
                }
                state => panic!("a READ of a dropped agent ended {state:?}"),
            },
        }
    };
    assert_eq!((failure.kind(), failure.backend()), (ErrorKind::Transfer, Some("ucx")), "{failure}");
    assert!(failure.code().is_some_and(|c| c < 0), "UCX's status is kept: {failure}");
    assert!(failure.message().contains("agent doomed-target is gone"), "{failure}");
    let e = r.agent.notify(&"doomed-target".into(), b"late").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transfer, "{e}");
    r.agent.forget_remote(&"doomed-target".into()).unwrap();
    drop(r.agent);
    assert_eq!(Arc::strong_count(&r.local), 1, "the reader's memory was released, not leaked");
    assert_eq!(Arc::strong_count(&heap), 1);
}

/// Released, deregistered and forgotten while running: the transfer keeps its memory, rkeys and
/// endpoint until UCX is done, sends no notification, and lets the memory go when it ends.
#[test]
fn handles_outlive_running_transfers() {
    // Gets: UCX cannot cancel them (a READ by active messages stops at release, below).
    let tcp = UcxConfig::default().with_transports("tcp").with_read_path(ReadPath::Get);
    let target = UcxAgent::with_config("slow-target", &tcp).unwrap();
    let blocks = 64u32;
    let heap = Arc::new(HostMemory::new(blocks as usize * BLOCK).unwrap());
    fill_blocks(|off, d| heap.write(off, d).unwrap(), blocks as usize);
    target.register(heap.clone()).unwrap();
    let r = reader("impatient", &tcp, &target, heap.region().addr, blocks);
    let idx: Vec<u32> = (0..blocks).collect();
    // The target does not progress yet, so over TCP the READ cannot finish.
    let x = r.agent.post(XferOp::Read, r.local_list, &idx, r.remote_list, &idx, Some(b"never")).unwrap();
    assert_eq!(r.agent.poll(x).unwrap(), XferState::Pending);
    r.agent.release(x).unwrap();
    assert_eq!(r.agent.poll(x).unwrap_err().kind(), ErrorKind::NotFound);
    r.agent.forget_remote(target.name()).unwrap();
    r.agent.deregister(r.registration).unwrap();
    assert_eq!(Arc::strong_count(&r.local), 2, "the running READ keeps the memory it writes");
    // Both sides run until the orphaned READ completes and lets the memory go.
    let deadline = Instant::now() + DEADLINE;
    let mut notes = Vec::new();
    while Arc::strong_count(&r.local) > 1 {
        assert!(Instant::now() < deadline, "the released READ did not end within {DEADLINE:?}");
        target.drain_notifications(&mut notes).unwrap();
        r.agent.progress().unwrap();
    }
    let mut block = vec![0u8; BLOCK];
    r.local.read(5 * BLOCK, &mut block).unwrap();
    assert!(block.iter().enumerate().all(|(i, &v)| v == pattern(5, i)), "the READ completed");
    // Its notification was dropped when it was released, before anything could send it.
    target.drain_notifications(&mut notes).unwrap();
    assert!(notes.is_empty(), "a released transfer sent {notes:?}");
    drop(target);
    assert_eq!(Arc::strong_count(&heap), 1, "the target released its memory on drop");
}

/// Thousands of ranges in flight at once, in several transfers over TCP, while the target serves
/// nothing until the reader drains: `drain_completions` reports every transfer exactly once and
/// a released one never, every block arrives, and the released one ends (gets: on their own, the
/// blocks written; active messages: at release, nothing written) and lets the reader's memory go.
#[test]
fn thousands_of_outstanding_gets_complete_exactly_once() {
    thousands_of_outstanding_reads(ReadPath::Get);
}

#[test]
fn thousands_of_outstanding_reads_by_active_messages_complete_exactly_once() {
    thousands_of_outstanding_reads(ReadPath::ActiveMessages);
}

fn thousands_of_outstanding_reads(path: ReadPath) {
    const SMALL: usize = 4 << 10;
    const XFERS: usize = 8;
    const PER_XFER: usize = 512;
    const RELEASED: usize = 3;
    let blocks = XFERS * PER_XFER;
    let small_list = |base: u64| BlockList {
        kind: MemKind::Dram,
        device: 0,
        bases: vec![base],
        num_blocks: blocks as u32,
        block_len: SMALL as u64,
    };
    let tcp = UcxConfig::default().with_transports("tcp").with_read_path(path);
    let target = UcxAgent::with_config("busy-target", &tcp).unwrap();
    let heap = Arc::new(HostMemory::new(blocks * SMALL).unwrap());
    for b in 0..blocks {
        heap.write(b * SMALL, &(0..SMALL).map(|i| pattern(b, i)).collect::<Vec<u8>>()).unwrap();
    }
    target.register(heap.clone()).unwrap();
    let agent = UcxAgent::with_config("many-gets", &tcp).unwrap();
    let local = Arc::new(HostMemory::new(blocks * SMALL).unwrap());
    let registration = agent.register(local.clone()).unwrap();
    agent.load_remote(&target.local_metadata().unwrap()).unwrap();
    assert_eq!(agent.read_path(target.name()).unwrap(), path);
    let local_list = agent.prep_dlist(&DlistOwner::Local, &small_list(local.region().addr)).unwrap();
    let remote_list = agent
        .prep_dlist(&DlistOwner::Remote(target.name().clone()), &small_list(heap.region().addr))
        .unwrap();

    // Slot s receives remote block `blocks - 1 - s`; transfer t fills slots t*PER_XFER.. .
    let mut xfers = Vec::new();
    for t in 0..XFERS {
        let slots: Vec<u32> = (t * PER_XFER..(t + 1) * PER_XFER).map(|s| s as u32).collect();
        let remote: Vec<u32> = slots.iter().map(|&s| (blocks - 1) as u32 - s).collect();
        xfers.push(agent.post(XferOp::Read, local_list, &slots, remote_list, &remote, None).unwrap());
    }
    // Over TCP the target serves the emulated gets: until it progresses, all of them wait.
    assert!(xfers.iter().all(|&x| agent.poll(x).unwrap() == XferState::Pending));
    agent.release(xfers[RELEASED]).unwrap();

    let mut reported: Vec<XferId> = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    while reported.len() < XFERS - 1 {
        assert!(Instant::now() < deadline, "{} of {} transfers reported", reported.len(), XFERS - 1);
        target.progress().unwrap();
        agent.drain_completions(&mut reported).unwrap();
    }
    // Later drains report nothing again.
    for _ in 0..100 {
        target.progress().unwrap();
        agent.drain_completions(&mut reported).unwrap();
    }
    let mut expected: Vec<XferId> =
        xfers.iter().enumerate().filter(|&(t, _)| t != RELEASED).map(|(_, &x)| x).collect();
    reported.sort_by_key(|x| x.0);
    expected.sort_by_key(|x| x.0);
    assert_eq!(reported, expected, "each transfer reported once, the released one never");
    for &x in &expected {
        assert_eq!(agent.poll(x).unwrap(), XferState::Done);
        agent.release(x).unwrap();
    }
    // The released transfer holds the reader's memory until UCX is done with it.
    agent.deregister(registration).unwrap();
    while Arc::strong_count(&local) > 1 {
        assert!(Instant::now() < deadline, "the released READ did not end within {DEADLINE:?}");
        target.progress().unwrap();
        agent.progress().unwrap();
    }
    let got = local.to_vec();
    for (slot, chunk) in got.chunks(SMALL).enumerate() {
        let b = blocks - 1 - slot;
        if path == ReadPath::ActiveMessages && slot / PER_XFER == RELEASED {
            // Released before the target answered: its answers were refused, not written.
            assert!(chunk.iter().all(|&v| v == 0), "released slot {slot} was written");
        } else {
            assert!(chunk.iter().enumerate().all(|(i, &v)| v == pattern(b, i)), "block {b} in slot {slot}");
        }
    }
    if path == ReadPath::ActiveMessages {
        // Every answer to the released READ is refused: keep serving until all came.
        while agent.refused_read_messages() < PER_XFER as u64 {
            assert!(Instant::now() < deadline, "{} answers refused", agent.refused_read_messages());
            target.progress().unwrap();
            agent.progress().unwrap();
        }
        assert_eq!(agent.refused_read_messages(), PER_XFER as u64);
        assert!(local.to_vec()[RELEASED * PER_XFER * SMALL..][..PER_XFER * SMALL].iter().all(|&v| v == 0));
    }
}

/// A peer that never answers (over TCP without peer failure detection, a READ of its memory can
/// neither finish nor be cancelled): dropping the reader's agent returns, within its teardown
/// bound, without aborting. UCX 1.13 would abort in ucp_worker_destroy, so the agent leaks its
/// UCX state instead, and with it the reader's memory: the pending READ may still write into it.
#[test]
fn dropping_an_agent_with_a_pending_transfer_keeps_the_memory_ucx_may_write() {
    let tcp = UcxConfig::default().with_transports("tcp");
    let target = UcxAgent::with_config("never-served", &tcp).unwrap();
    let heap = Arc::new(HostMemory::new(4 * BLOCK).unwrap());
    target.register(heap.clone()).unwrap();
    let r = reader("dropper", &tcp, &target, heap.region().addr, 4);
    let x = r.agent.post(XferOp::Read, r.local_list, &[0, 1], r.remote_list, &[2, 3], None).unwrap();
    assert_eq!(r.agent.poll(x).unwrap(), XferState::Pending);
    let (agent, local) = (r.agent, r.local);
    let (tx, dropped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(agent);
        let _ = tx.send(());
    });
    dropped.recv_timeout(DEADLINE).expect("dropping the agent returned");
    assert_eq!(Arc::strong_count(&local), 2, "kept for the READ that may still write into it");
}

#[test]
fn ucx_memory_is_held_by_its_registration_and_outlives_its_agent() {
    let agent = UcxAgent::new("pool-owner").unwrap();
    let pool = agent.alloc_memory(3 * BLOCK + 5).unwrap();
    assert_eq!(pool.len(), 3 * BLOCK + 5);
    assert!(pool.to_vec().iter().all(|&b| b == 0));
    pool.fill(10, 5, 9).unwrap();
    assert!(pool.write(pool.len() - 1, &[1, 2]).is_err());
    let registration = agent.register(pool.clone()).unwrap();
    assert_eq!(Arc::strong_count(&pool), 2, "the registration holds the pool");
    agent.deregister(registration).unwrap();
    assert_eq!(Arc::strong_count(&pool), 1, "deregistering gives it back");
    agent.register(pool.clone()).unwrap();
    drop(agent); // deregisters; the pool's mapping (and its UCX context) stay with the pool
    assert_eq!(Arc::strong_count(&pool), 1);
    let mut out = [0u8; 6];
    pool.read(9, &mut out).unwrap();
    assert_eq!(out, [0, 9, 9, 9, 9, 9]);
}

#[test]
fn ucx_errors_carry_backend_and_status() {
    let e =
        UcxAgent::with_config("bad", &UcxConfig::default().with_option("RNDV_THRESH", "lots")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(e.backend(), Some("ucx"));
    assert!(e.code().is_some_and(|c| c < 0), "{e}");
    assert!(e.to_string().contains("RNDV_THRESH"), "{e}");

    let agent = UcxAgent::new("errors").unwrap();
    assert_eq!(agent.alloc_memory(0).unwrap_err().kind(), ErrorKind::InvalidArgument);
    let e = agent.load_remote(b"not metadata").unwrap_err();
    assert_eq!((e.kind(), e.backend()), (ErrorKind::InvalidPeerData, Some("ucx")));
    let own = agent.local_metadata().unwrap();
    assert_eq!(agent.load_remote(&own).unwrap_err().kind(), ErrorKind::InvalidPeerData);
    assert_eq!(agent.notify(&"nobody".into(), b"x").unwrap_err().kind(), ErrorKind::NotFound);
    let other = UcxAgent::new("other").unwrap();
    agent.load_remote(&other.local_metadata().unwrap()).unwrap();
    let big = vec![0u8; kvx_core::MAX_NOTIFICATION_LEN + 1];
    assert_eq!(agent.notify(other.name(), &big).unwrap_err().kind(), ErrorKind::InvalidArgument);
}

/// Agent metadata is kvx-core's envelope: a loopback agent's metadata is `Incompatible` here and
/// a UCX agent's is there; a byte after it is `InvalidPeerData`; neither loads anything.
#[test]
fn metadata_of_another_backend_is_incompatible_and_bytes_after_it_are_invalid() {
    let agent = UcxAgent::new("ucx-loader").unwrap();
    let peer = UcxAgent::new("ucx-peer").unwrap();
    let fabric = kvx_loopback::Fabric::new();
    let loopback = fabric.agent("loopback-peer").unwrap();
    let e = agent.load_remote(&loopback.local_metadata().unwrap()).unwrap_err();
    assert_eq!((e.kind(), e.backend()), (ErrorKind::Incompatible, Some("ucx")), "{e}");
    let e = loopback.load_remote(&peer.local_metadata().unwrap()).unwrap_err();
    assert_eq!((e.kind(), e.backend()), (ErrorKind::Incompatible, Some("loopback")), "{e}");
    let nixl = agent_metadata::seal("nixl", peer.name(), &()).unwrap();
    assert_eq!(agent.load_remote(&nixl).unwrap_err().kind(), ErrorKind::Incompatible);

    let md = peer.local_metadata().unwrap();
    let e = agent.load_remote(&[&md[..], &[0]].concat()).unwrap_err();
    assert_eq!((e.kind(), e.backend()), (ErrorKind::InvalidPeerData, Some("ucx")), "{e}");
    assert_eq!(agent.load_remote(&md).unwrap(), *peer.name(), "nothing was half-loaded");
    for bad in ["n".repeat(agent_metadata::MAX_AGENT_NAME + 1), "a\0".to_owned()] {
        assert_eq!(UcxAgent::new(bad).err().map(|e| e.kind()), Some(ErrorKind::InvalidArgument));
    }
}
