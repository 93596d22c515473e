//! The conformance suite: plain `check_*` functions that any pair of
//! [`TransferAgent`]s must pass.
//!
//! Each check takes a [`Harness`]: two agents (the *initiator* posts transfers, the *target*'s
//! memory is read and written), a way to allocate memory they can register, and a way to drive
//! both agents' progress. Checks panic with a message on failure, like `assert!`. They leave the
//! agents as they found them (registrations, loaded remotes and descriptor lists are undone, also
//! when a check panics), so one pair runs the whole suite in sequence.
//!
//! Every wait is a bounded loop that calls [`Harness::progress`] (both agents) until
//! [`Harness::deadline`] passes: no sleeps. Capability differences are read from
//! [`TransferAgent::capabilities`]: a check whose capability is missing says so on stderr and
//! returns.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{
    AgentName, BlockList, Capabilities, DlistId, DlistOwner, Error, ErrorKind, HostMemory, KvMemory, MemKind,
    MemRegion, Notification, RegistrationId, Result, TransferAgent, XferId, XferOp, XferState,
};

/// Which agent of a [`Harness`] memory is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The agent that posts transfers.
    Initiator,
    /// The agent whose memory is read and written.
    Target,
}

pub use kvx_core::ByteAccess;

/// Memory for the suite: what an agent registers, together with host access to its bytes.
#[derive(Debug, Clone)]
pub struct TestBuffer {
    memory: Arc<dyn KvMemory>,
    access: Arc<dyn ByteAccess>,
}

impl TestBuffer {
    /// Wraps memory that can be both registered and accessed from the host.
    pub fn new<M: KvMemory + ByteAccess + 'static>(memory: Arc<M>) -> Self {
        TestBuffer { memory: memory.clone(), access: memory }
    }

    /// `len` zeroed bytes of [`HostMemory`].
    pub fn host(len: usize) -> Result<Self> {
        Ok(Self::new(Arc::new(HostMemory::new(len)?)))
    }

    /// The memory, to pass to [`TransferAgent::register`].
    pub fn memory(&self) -> Arc<dyn KvMemory> {
        self.memory.clone()
    }

    /// The memory's region.
    pub fn region(&self) -> MemRegion {
        self.memory.region()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        usize::try_from(self.region().len).unwrap_or(usize::MAX)
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.access.write(offset, src)
    }

    /// Copies the bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.access.read(offset, dst)
    }

    /// Copies the whole buffer out.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        self.read(0, &mut v)?;
        Ok(v)
    }
}

/// What the suite needs from a backend: two agents, memory they can register, and progress.
///
/// [`Pair`] is the harness for backends that register plain [`HostMemory`] and whose
/// [`TransferAgent::progress`] is all the driving they need.
pub trait Harness {
    /// The agents' type: a concrete agent, or `dyn TransferAgent`.
    type Agent: TransferAgent + ?Sized;

    /// The agent that posts transfers (the decode side of kvx).
    fn initiator(&self) -> &Self::Agent;

    /// The agent whose memory is read and written (the prefill side of kvx).
    fn target(&self) -> &Self::Agent;

    /// Allocates `len` bytes (`len > 0`) that `side`'s agent can register. Default: [`HostMemory`].
    fn alloc(&self, side: Side, len: usize) -> Result<TestBuffer> {
        let _ = side;
        TestBuffer::host(len)
    }

    /// Drives both agents once, without blocking. The suite calls it in every wait loop, so a
    /// backend whose target must be serviced while the initiator polls (UCX and NIXL with two
    /// agents in one process) gets that here. Default: `progress()` on the target, then on the
    /// initiator.
    fn progress(&self) -> Result<()> {
        self.target().progress()?;
        self.initiator().progress()
    }

    /// How long any single wait of the suite may take before the check fails. Default: 10 s.
    fn deadline(&self) -> Duration {
        Duration::from_secs(10)
    }
}

/// The plain harness: two agents, [`HostMemory`], and `progress()` on both.
#[derive(Debug)]
pub struct Pair<A: ?Sized> {
    initiator: Arc<A>,
    target: Arc<A>,
}

impl<A: ?Sized> Pair<A> {
    /// A harness over two distinct agents.
    pub fn new(initiator: Arc<A>, target: Arc<A>) -> Self {
        Pair { initiator, target }
    }
}

impl<A: TransferAgent + ?Sized> Harness for Pair<A> {
    type Agent = A;

    fn initiator(&self) -> &A {
        &self.initiator
    }

    fn target(&self) -> &A {
        &self.target
    }
}

/// Runs every check of the suite, in order.
pub fn check_all<H: Harness + ?Sized>(h: &H) {
    check_capabilities(h);
    check_registration(h);
    check_metadata_round_trip(h);
    check_garbage_metadata(h);
    check_read_scattered(h);
    check_write_scattered(h);
    check_notification_with_read(h);
    check_notification_with_write(h);
    check_standalone_notify(h);
    check_many_in_flight(h);
    check_unknown_transfer(h);
    check_unknown_dlist(h);
    check_out_of_range_rejected(h);
    check_unequal_lengths_rejected(h);
    check_wrong_dlist_owner_rejected(h);
    check_dlist_outside_registration(h);
    check_forget_remote(h);
}

/// The two agents are distinct, of the same backend, can move data and register host memory.
pub fn check_capabilities<H: Harness + ?Sized>(h: &H) {
    let (ci, ct) = (h.initiator().capabilities(), h.target().capabilities());
    assert_ne!(h.initiator().name(), h.target().name(), "the two agents need distinct names");
    assert_eq!(ci.backend, ct.backend, "both agents are of one backend");
    assert!(ci.read || ci.write, "{}: supports neither READ nor WRITE", ci.backend);
    assert!(ci.dram || ci.vram, "{}: can register no memory at all", ci.backend);
}

/// Registering and deregistering memory; descriptor lists only over registered memory.
pub fn check_registration<H: Harness + ?Sized>(h: &H) {
    let agent = h.initiator();
    let a = ok(h.alloc(Side::Initiator, 8192), "alloc");
    let b = ok(h.alloc(Side::Initiator, 8192), "alloc");
    let ra = ok(agent.register(a.memory()), "register a");
    let rb = ok(agent.register(b.memory()), "register b");
    assert_ne!(ra, rb, "two registrations got the same id");

    let list = whole(&a, 2);
    let dl = ok(agent.prep_dlist(&DlistOwner::Local, &list), "prep_dlist over registered memory");
    ok(agent.release_dlist(dl), "release_dlist");
    expect_kind(agent.release_dlist(dl), &[ErrorKind::NotFound], "releasing a descriptor list twice");

    ok(agent.deregister(ra), "deregister a");
    expect_kind(agent.deregister(ra), &[ErrorKind::NotFound], "deregistering twice");
    expect_kind(
        agent.prep_dlist(&DlistOwner::Local, &list),
        &[ErrorKind::InvalidArgument],
        "prep_dlist over deregistered memory",
    );

    // The same memory can be registered again, and the other registration was not disturbed.
    let ra2 = ok(agent.register(a.memory()), "registering again after deregistration");
    let dl =
        ok(agent.prep_dlist(&DlistOwner::Local, &whole(&b, 4)), "prep_dlist over the other registration");
    ok(agent.release_dlist(dl), "release_dlist");
    ok(agent.deregister(ra2), "deregister a again");
    ok(agent.deregister(rb), "deregister b");
    expect_kind(
        agent.deregister(RegistrationId(u64::MAX)),
        &[ErrorKind::NotFound],
        "deregistering an unknown id",
    );
}

/// `load_remote` returns the peer's name; loading twice is a `State` error; forget then load again.
pub fn check_metadata_round_trip<H: Harness + ?Sized>(h: &H) {
    let (ini, tgt) = (h.initiator(), h.target());
    let buf = ok(h.alloc(Side::Target, 8192), "alloc");
    let reg = Registered::new(tgt, &buf);
    let md = ok(tgt.local_metadata(), "local_metadata");
    assert!(!md.is_empty(), "metadata is empty");

    let loaded = Loaded::new(ini, &md);
    assert_eq!(&loaded.name, tgt.name(), "load_remote returned another name than the peer's");
    expect_kind(ini.load_remote(&md), &[ErrorKind::State], "loading the same peer twice");

    ok(ini.forget_remote(&loaded.name), "forget_remote");
    expect_kind(ini.forget_remote(&loaded.name), &[ErrorKind::NotFound], "forgetting a peer twice");
    let name = ok(ini.load_remote(&md), "loading a forgotten peer again");
    assert_eq!(&name, tgt.name());
    expect_kind(
        ini.forget_remote(&AgentName::new("kvx-no-such-agent")),
        &[ErrorKind::NotFound],
        "forget unknown",
    );
    drop(loaded);

    // Metadata describes the registrations of the moment: after the peer deregisters one, newly
    // loaded metadata no longer lets a list cover it.
    let other = ok(h.alloc(Side::Target, 8192), "alloc");
    let other_reg = Registered::new(tgt, &other);
    drop(reg);
    let loaded = Loaded::new(ini, &ok(tgt.local_metadata(), "local_metadata"));
    let owner = DlistOwner::Remote(loaded.name.clone());
    expect_kind(
        ini.prep_dlist(&owner, &whole(&buf, 2)),
        &[ErrorKind::InvalidPeerData],
        "remote list over memory the peer deregistered before its metadata was taken",
    );
    let dl = ok(ini.prep_dlist(&owner, &whole(&other, 2)), "remote list over the peer's other registration");
    ok(ini.release_dlist(dl), "release_dlist");
    drop(loaded);
    drop(other_reg);
}

/// Malformed metadata is an error, never a panic, and leaves nothing half-loaded behind.
pub fn check_garbage_metadata<H: Harness + ?Sized>(h: &H) {
    let (ini, tgt) = (h.initiator(), h.target());
    let buf = ok(h.alloc(Side::Target, 8192), "alloc");
    let reg = Registered::new(tgt, &buf);
    let md = ok(tgt.local_metadata(), "local_metadata");

    let mut noise = vec![0u8; 4096];
    SplitMix(0x6a5b).fill(&mut noise);
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("one zero byte", vec![0]),
        ("text", b"this is not kvx agent metadata".to_vec()),
        ("4 KiB of noise", noise),
    ];
    if md.len() > 1 {
        cases.push(("truncated to half", md[..md.len() / 2].to_vec()));
        cases.push(("truncated by one byte", md[..md.len() - 1].to_vec()));
    }
    for (what, bytes) in &cases {
        if let Ok(name) = ini.load_remote(bytes) {
            // Leave the agents clean before failing.
            let _ = ini.forget_remote(&name);
            panic!("load_remote accepted garbage metadata ({what}) as agent {name}");
        }
    }
    let loaded = Loaded::new(ini, &md);
    assert_eq!(&loaded.name, tgt.name(), "valid metadata after garbage");
    drop(loaded);
    drop(reg);
}

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

/// `notify` without data reaches the target; notifying an unknown agent fails.
pub fn check_standalone_notify<H: Harness + ?Sized>(h: &H) {
    if skip_without(h, "notifications", |c| c.notifications) {
        return;
    }
    let f = Fixture::new(h, 0x5eed_0005);
    let msgs = [b"kvx-standalone-1".to_vec(), b"kvx-standalone-2".to_vec()];
    for m in &msgs {
        ok(h.initiator().notify(&f.target_name, m), "notify");
    }
    wait_notifications(h, &msgs, |_| {});
    expect_err(
        h.initiator().notify(&AgentName::new("kvx-no-such-agent"), b"x"),
        "notify to an unknown agent",
    );
    assert_no_more_notifications(h, "after standalone notifications");
    f.verify("after notifications (no data may move)");
}

/// 32 transfers posted before any is polled all complete, with every byte and every notification.
pub fn check_many_in_flight<H: Harness + ?Sized>(h: &H) {
    let caps = h.initiator().capabilities();
    let op = if caps.read { XferOp::Read } else { XferOp::Write };
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
        expect_kind(h.initiator().poll(x), &[ErrorKind::NotFound], "polling a released transfer");
    }
}

/// Polling or releasing a transfer this agent does not know is `NotFound`.
pub fn check_unknown_transfer<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    expect_kind(ini.poll(XferId(u64::MAX)), &[ErrorKind::NotFound], "polling an unknown transfer");
    expect_kind(ini.release(XferId(u64::MAX)), &[ErrorKind::NotFound], "releasing an unknown transfer");
    let op = any_op(ini.capabilities());
    let f = Fixture::new(h, 0x5eed_0007);
    let x = ok(f.post(op, &[(0, 0)], None), "post");
    wait_done(h, x, "one-block transfer");
    ok(ini.release(x), "release");
    expect_kind(ini.poll(x), &[ErrorKind::NotFound], "polling a released transfer");
    expect_kind(ini.release(x), &[ErrorKind::NotFound], "releasing a transfer twice");
}

/// Descriptor lists this agent does not know are `NotFound`, in `release_dlist` and in `post`.
pub fn check_unknown_dlist<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    expect_kind(ini.release_dlist(DlistId(u64::MAX)), &[ErrorKind::NotFound], "releasing an unknown list");
    let op = any_op(ini.capabilities());
    let f = Fixture::new(h, 0x5eed_0008);
    let local = f.local_dlist.unwrap_or(DlistId(u64::MAX));
    let remote = f.remote_dlist.unwrap_or(DlistId(u64::MAX));
    expect_kind(
        ini.post(op, DlistId(u64::MAX), &[0], remote, &[0], None),
        &[ErrorKind::NotFound],
        "post with an unknown local list",
    );
    expect_kind(
        ini.post(op, local, &[0], DlistId(u64::MAX), &[0], None),
        &[ErrorKind::NotFound],
        "post with an unknown remote list",
    );
    f.settle_and_verify("after posts with unknown lists");
}

/// Out-of-range descriptor indices are rejected at `post`; nothing is transferred, no notification
/// is sent, and the agent keeps working.
pub fn check_out_of_range_rejected<H: Harness + ?Sized>(h: &H) {
    let caps = h.initiator().capabilities();
    let mut f = Fixture::new(h, 0x5eed_0009);
    let n = f.shape.len();
    let notify = caps.notifications.then_some(&b"kvx-must-not-arrive"[..]);
    let bad: [(&str, Vec<u32>, Vec<u32>); 5] = [
        ("local index = len", vec![0, n], vec![0, 1]),
        ("remote index = len", vec![0, 1], vec![0, n]),
        ("local index u32::MAX", vec![u32::MAX], vec![0]),
        ("remote index u32::MAX", vec![0], vec![u32::MAX]),
        ("valid pairs then one bad", vec![0, 1, 2, 3], vec![4, 5, 6, n + 7]),
    ];
    for op in ops(caps) {
        for (what, l, r) in &bad {
            expect_kind(
                f.post_indices(op, l, r, notify),
                &[ErrorKind::InvalidArgument, ErrorKind::InvalidPeerData],
                &format!("{op:?} with {what}"),
            );
        }
    }
    f.settle_and_verify("after rejected out-of-range posts (destination touched?)");
    assert_no_more_notifications(h, "after rejected posts");
    // The agent still works.
    let op = any_op(caps);
    let pairs = f.random_pairs(4);
    let x = ok(f.post(op, &pairs, None), "post after rejected posts");
    wait_done(h, x, "transfer after rejected posts");
    f.apply(op, &pairs);
    f.verify("after a valid transfer following rejected posts");
    ok(h.initiator().release(x), "release");
}

/// Index slices of unequal lengths are rejected at `post`, and nothing is transferred.
pub fn check_unequal_lengths_rejected<H: Harness + ?Sized>(h: &H) {
    let caps = h.initiator().capabilities();
    let f = Fixture::new(h, 0x5eed_000a);
    let notify = caps.notifications.then_some(&b"kvx-must-not-arrive"[..]);
    for op in ops(caps) {
        for (l, r) in [(&[0u32, 1][..], &[0u32][..]), (&[0], &[0, 1]), (&[], &[3])] {
            expect_kind(
                f.post_indices(op, l, r, notify),
                &[ErrorKind::InvalidArgument, ErrorKind::InvalidPeerData],
                &format!("{op:?} with {} local and {} remote indices", l.len(), r.len()),
            );
        }
    }
    f.settle_and_verify("after rejected posts of unequal lengths (destination touched?)");
    assert_no_more_notifications(h, "after rejected posts");
}

/// A remote list passed as the local one (and the other way round) is rejected.
pub fn check_wrong_dlist_owner_rejected<H: Harness + ?Sized>(h: &H) {
    let caps = h.initiator().capabilities();
    let f = Fixture::new(h, 0x5eed_000b);
    let (Some(local), Some(remote)) = (f.local_dlist, f.remote_dlist) else {
        panic!("fixture without descriptor lists");
    };
    for op in ops(caps) {
        expect_err(h.initiator().post(op, remote, &[0], local, &[0], None), "post with the lists swapped");
        expect_err(
            h.initiator().post(op, local, &[0], local, &[1], None),
            "post with a local list as remote",
        );
        expect_err(
            h.initiator().post(op, remote, &[0], remote, &[1], None),
            "post with a remote list as local",
        );
    }
    f.settle_and_verify("after posts with wrong lists");
}

/// Descriptor lists outside the owner's registrations are rejected: `InvalidArgument` for local
/// memory, `InvalidPeerData` for a remote's; a list for an unloaded remote is `NotFound`.
pub fn check_dlist_outside_registration<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let f = Fixture::new(h, 0x5eed_000c);
    let remote_owner = DlistOwner::Remote(f.target_name.clone());
    let cases = |bufs: &[TestBuffer]| -> Vec<(&'static str, BlockList)> {
        let base = f.shape.list(bufs);
        let region = bufs[0].region();
        let half = base.block_len / 2;
        vec![
            ("one block too many", BlockList { num_blocks: base.num_blocks + 1, ..base.clone() }),
            // Straddling blocks: even if another registration happens to be adjacent, a block
            // must lie inside one registration.
            (
                "straddling the registration's start",
                BlockList { bases: vec![region.addr.wrapping_sub(half)], num_blocks: 1, ..base.clone() },
            ),
            (
                "straddling the registration's end",
                BlockList {
                    bases: vec![(region.addr + region.len).wrapping_sub(half)],
                    num_blocks: 1,
                    ..base.clone()
                },
            ),
            (
                "wrapping the address space",
                BlockList { bases: vec![u64::MAX - 16], num_blocks: 2, block_len: 64, ..base.clone() },
            ),
            ("GPU memory at a host address", BlockList { kind: MemKind::Vram, ..base.clone() }),
        ]
    };
    for (what, list) in cases(&f.remote) {
        expect_kind(
            ini.prep_dlist(&remote_owner, &list),
            &[ErrorKind::InvalidPeerData],
            &format!("remote list {what}"),
        );
    }
    for (what, list) in cases(&f.local) {
        expect_kind(
            ini.prep_dlist(&DlistOwner::Local, &list),
            &[ErrorKind::InvalidArgument],
            &format!("local list {what}"),
        );
    }
    let unknown = DlistOwner::Remote(AgentName::new("kvx-no-such-agent"));
    expect_kind(
        ini.prep_dlist(&unknown, &f.shape.list(&f.remote)),
        &[ErrorKind::NotFound],
        "list of an unknown remote",
    );
}

/// After `forget_remote`, posts to the peer fail and move nothing; loading it again works.
pub fn check_forget_remote<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let caps = ini.capabilities();
    let op = any_op(caps);
    let mut f = Fixture::new(h, 0x5eed_000d);
    let pairs = f.random_pairs(4);
    let x = ok(f.post(op, &pairs, None), "post");
    wait_done(h, x, "transfer before forget_remote");
    ok(ini.release(x), "release");
    f.apply(op, &pairs);

    ok(ini.forget_remote(&f.target_name), "forget_remote");
    f.loaded = false;
    let stale = f.remote_dlist.take();
    let pairs = f.random_pairs(4);
    if let Some(stale) = stale {
        let (l, r): (Vec<u32>, Vec<u32>) = pairs.iter().copied().unzip();
        let local = f.local_dlist.unwrap_or(DlistId(u64::MAX));
        expect_err(ini.post(op, local, &l, stale, &r, None), "post to a forgotten remote");
        expect_kind(
            ini.release_dlist(stale),
            &[ErrorKind::NotFound],
            "forget_remote releases the remote's lists",
        );
    }
    let owner = DlistOwner::Remote(f.target_name.clone());
    expect_kind(
        ini.prep_dlist(&owner, &f.shape.list(&f.remote)),
        &[ErrorKind::NotFound],
        "list of a forgotten remote",
    );
    if caps.notifications {
        expect_err(ini.notify(&f.target_name, b"kvx-must-not-arrive"), "notify a forgotten remote");
    }
    f.settle_and_verify("after posts to a forgotten remote");

    let md = ok(h.target().local_metadata(), "local_metadata");
    let name = ok(ini.load_remote(&md), "loading a forgotten remote again");
    assert_eq!(&name, h.target().name());
    f.loaded = true;
    f.remote_dlist = Some(ok(ini.prep_dlist(&owner, &f.shape.list(&f.remote)), "prep_dlist after reloading"));
    let x = ok(f.post(op, &pairs, None), "post after reloading");
    wait_done(h, x, "transfer after reloading");
    ok(ini.release(x), "release");
    f.apply(op, &pairs);
    f.verify("after a transfer to a reloaded remote");
}

// ----------------------------------------------------------------------------------------------
// Fixture: two regions of blocks on each side, registered, loaded, with one list per side.

/// Bytes before and after the blocks of each region buffer: lists need not start at a
/// registration's start, and a transfer that overruns a block shows up here.
const PAD: usize = 128;

#[derive(Debug, Clone, Copy)]
struct Shape {
    regions: usize,
    num_blocks: u32,
    block_len: u64,
}

impl Shape {
    const DEFAULT: Shape = Shape { regions: 2, num_blocks: 64, block_len: 4096 };

    fn len(&self) -> u32 {
        // The default shape's 128 descriptors fit; the conversion cannot saturate.
        u32::try_from(self.regions).unwrap_or(u32::MAX).saturating_mul(self.num_blocks)
    }

    fn buffer_len(&self) -> usize {
        PAD * 2 + self.num_blocks as usize * self.block_len as usize
    }

    fn list(&self, bufs: &[TestBuffer]) -> BlockList {
        let first = bufs.first().map(|b| b.region()).unwrap_or(MemRegion::dram(0, 0));
        BlockList {
            kind: first.kind,
            device: first.device,
            bases: bufs.iter().map(|b| b.region().addr + PAD as u64).collect(),
            num_blocks: self.num_blocks,
            block_len: self.block_len,
        }
    }

    /// (buffer, byte offset) of descriptor `index`.
    fn locate(&self, index: u32) -> (usize, usize) {
        let region = (index / self.num_blocks) as usize;
        let block = (index % self.num_blocks) as usize;
        (region, PAD + block * self.block_len as usize)
    }
}

/// Registrations, a loaded remote and lists, undone on drop (also when a check panics).
struct Fixture<'h, H: Harness + ?Sized> {
    h: &'h H,
    shape: Shape,
    local: Vec<TestBuffer>,
    remote: Vec<TestBuffer>,
    local_regs: Vec<RegistrationId>,
    remote_regs: Vec<RegistrationId>,
    /// What the suite expects each buffer to hold.
    local_image: Vec<Vec<u8>>,
    remote_image: Vec<Vec<u8>>,
    target_name: AgentName,
    loaded: bool,
    local_dlist: Option<DlistId>,
    remote_dlist: Option<DlistId>,
    rng: SplitMix,
}

impl<'h, H: Harness + ?Sized> Fixture<'h, H> {
    fn new(h: &'h H, seed: u64) -> Self {
        let shape = Shape::DEFAULT;
        let (ini, tgt) = (h.initiator(), h.target());
        // Leftovers of an earlier failed check must not be taken for this check's notifications.
        let mut stale = Vec::new();
        let _ = tgt.drain_notifications(&mut stale);
        let _ = ini.drain_notifications(&mut stale);

        let mut f = Fixture {
            h,
            shape,
            local: Vec::new(),
            remote: Vec::new(),
            local_regs: Vec::new(),
            remote_regs: Vec::new(),
            local_image: Vec::new(),
            remote_image: Vec::new(),
            target_name: tgt.name().clone(),
            loaded: false,
            local_dlist: None,
            remote_dlist: None,
            rng: SplitMix(seed),
        };
        for side in [Side::Initiator, Side::Target] {
            for _ in 0..shape.regions {
                let buf = ok(h.alloc(side, shape.buffer_len()), "alloc");
                let mut image = vec![0u8; buf.len()];
                f.rng.fill(&mut image);
                ok(buf.write(0, &image), "filling test memory");
                let agent = if side == Side::Initiator { ini } else { tgt };
                let reg = ok(agent.register(buf.memory()), "register");
                match side {
                    Side::Initiator => {
                        f.local.push(buf);
                        f.local_regs.push(reg);
                        f.local_image.push(image);
                    }
                    Side::Target => {
                        f.remote.push(buf);
                        f.remote_regs.push(reg);
                        f.remote_image.push(image);
                    }
                }
            }
        }
        let md = ok(tgt.local_metadata(), "local_metadata");
        let name = ok(ini.load_remote(&md), "load_remote");
        f.loaded = true;
        assert_eq!(&name, tgt.name(), "load_remote returned another name than the peer's");
        f.local_dlist =
            Some(ok(ini.prep_dlist(&DlistOwner::Local, &shape.list(&f.local)), "prep local list"));
        let owner = DlistOwner::Remote(name);
        f.remote_dlist = Some(ok(ini.prep_dlist(&owner, &shape.list(&f.remote)), "prep remote list"));
        f
    }

    /// `n` (local, remote) descriptor pairs, each side's indices distinct and randomly scattered.
    fn random_pairs(&mut self, n: usize) -> Vec<(u32, u32)> {
        let l = self.rng.distinct(self.shape.len(), n);
        let r = self.rng.distinct(self.shape.len(), n);
        l.into_iter().zip(r).collect()
    }

    fn post(&self, op: XferOp, pairs: &[(u32, u32)], notify: Option<&[u8]>) -> Result<XferId> {
        let (l, r): (Vec<u32>, Vec<u32>) = pairs.iter().copied().unzip();
        self.post_indices(op, &l, &r, notify)
    }

    fn post_indices(&self, op: XferOp, l: &[u32], r: &[u32], notify: Option<&[u8]>) -> Result<XferId> {
        let (Some(local), Some(remote)) = (self.local_dlist, self.remote_dlist) else {
            return Err(Error::new(ErrorKind::State, "fixture has no descriptor lists"));
        };
        self.h.initiator().post(op, local, l, remote, r, notify)
    }

    /// Updates the expected images as the transfer of `pairs` does to the memory.
    fn apply(&mut self, op: XferOp, pairs: &[(u32, u32)]) {
        let len = self.shape.block_len as usize;
        for &(l, r) in pairs {
            let (lb, lo) = self.shape.locate(l);
            let (rb, ro) = self.shape.locate(r);
            match op {
                XferOp::Read => {
                    let block = self.remote_image[rb][ro..ro + len].to_vec();
                    self.local_image[lb][lo..lo + len].copy_from_slice(&block);
                }
                XferOp::Write => {
                    let block = self.local_image[lb][lo..lo + len].to_vec();
                    self.remote_image[rb][ro..ro + len].copy_from_slice(&block);
                }
            }
        }
    }

    /// Checks every byte of every buffer of both sides against the expected images.
    fn verify(&self, when: &str) {
        for (side, bufs, images) in
            [("initiator", &self.local, &self.local_image), ("target", &self.remote, &self.remote_image)]
        {
            for (i, (buf, image)) in bufs.iter().zip(images).enumerate() {
                let actual = ok(buf.to_vec(), "reading test memory");
                if let Some(at) = actual.iter().zip(image).position(|(a, e)| a != e) {
                    let block = at.checked_sub(PAD).map(|o| o / self.shape.block_len as usize);
                    panic!(
                        "{when}: {side} region {i} differs at byte {at} (block {block:?}): {} != expected {}",
                        actual[at], image[at]
                    );
                }
            }
        }
    }

    /// Drives progress a few rounds (so that anything wrongly posted would land), then verifies.
    fn settle_and_verify(&self, when: &str) {
        for _ in 0..20 {
            ok(self.h.progress(), "progress");
        }
        self.verify(when);
    }
}

impl<H: Harness + ?Sized> Drop for Fixture<'_, H> {
    fn drop(&mut self) {
        let (ini, tgt) = (self.h.initiator(), self.h.target());
        for dl in [self.local_dlist.take(), self.remote_dlist.take()].into_iter().flatten() {
            let _ = ini.release_dlist(dl);
        }
        if self.loaded {
            let _ = ini.forget_remote(&self.target_name);
        }
        for r in self.local_regs.drain(..) {
            let _ = ini.deregister(r);
        }
        for r in self.remote_regs.drain(..) {
            let _ = tgt.deregister(r);
        }
    }
}

/// One registration, deregistered on drop.
struct Registered<'a, A: TransferAgent + ?Sized> {
    agent: &'a A,
    id: RegistrationId,
}

impl<'a, A: TransferAgent + ?Sized> Registered<'a, A> {
    fn new(agent: &'a A, buf: &TestBuffer) -> Self {
        Registered { agent, id: ok(agent.register(buf.memory()), "register") }
    }
}

impl<A: TransferAgent + ?Sized> Drop for Registered<'_, A> {
    fn drop(&mut self) {
        let _ = self.agent.deregister(self.id);
    }
}

/// One loaded remote, forgotten on drop (whatever its state by then).
struct Loaded<'a, A: TransferAgent + ?Sized> {
    agent: &'a A,
    name: AgentName,
}

impl<'a, A: TransferAgent + ?Sized> Loaded<'a, A> {
    fn new(agent: &'a A, md: &[u8]) -> Self {
        Loaded { agent, name: ok(agent.load_remote(md), "load_remote") }
    }
}

impl<A: TransferAgent + ?Sized> Drop for Loaded<'_, A> {
    fn drop(&mut self) {
        let _ = self.agent.forget_remote(&self.name);
    }
}

// ----------------------------------------------------------------------------------------------
// Waiting, expectations, randomness.

/// Polls `x` on the initiator, driving both agents, until it is `Done`; panics on `Failed` or
/// when the deadline passes.
fn wait_done<H: Harness + ?Sized>(h: &H, x: XferId, what: &str) {
    let deadline = Instant::now() + h.deadline();
    loop {
        ok(h.progress(), "progress");
        match ok(h.initiator().poll(x), "poll") {
            XferState::Done => return,
            XferState::Failed(reason) => panic!("{what}: transfer {x} failed: {reason}"),
            XferState::Pending => {}
        }
        assert!(Instant::now() < deadline, "{what}: transfer {x} still pending after {:?}", h.deadline());
    }
}

/// Drains the target until every message of `want` has arrived (in any order), calling
/// `on_arrival` as each arrives; each must come from the initiator, and nothing else may arrive.
fn wait_notifications<H: Harness + ?Sized>(h: &H, want: &[Vec<u8>], mut on_arrival: impl FnMut(&[u8])) {
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
fn assert_no_more_notifications<H: Harness + ?Sized>(h: &H, when: &str) {
    let mut got = Vec::new();
    for _ in 0..20 {
        ok(h.progress(), "progress");
        ok(h.target().drain_notifications(&mut got), "drain_notifications");
        ok(h.initiator().drain_notifications(&mut got), "drain_notifications");
    }
    assert!(got.is_empty(), "{when}: unexpected notifications {got:?}");
}

fn skip_without<H: Harness + ?Sized>(h: &H, what: &str, has: impl Fn(&Capabilities) -> bool) -> bool {
    let caps = h.initiator().capabilities();
    let skip = !has(&caps);
    if skip {
        eprintln!("kvx-testkit: SKIPPED a check: backend {} does not support {what}", caps.backend);
    }
    skip
}

fn ops(caps: Capabilities) -> impl Iterator<Item = XferOp> {
    [(XferOp::Read, caps.read), (XferOp::Write, caps.write)]
        .into_iter()
        .filter(|&(_, on)| on)
        .map(|(op, _)| op)
}

fn any_op(caps: Capabilities) -> XferOp {
    if caps.read { XferOp::Read } else { XferOp::Write }
}

/// A list of `num_blocks` equal blocks covering the start of `buf`.
fn whole(buf: &TestBuffer, num_blocks: u32) -> BlockList {
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
fn ok<T>(r: Result<T>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{what}: unexpected error: {e}"),
    }
}

#[track_caller]
fn expect_err<T: fmt::Debug>(r: Result<T>, what: &str) -> Error {
    match r {
        Ok(v) => panic!("{what}: expected an error, got Ok({v:?})"),
        Err(e) => e,
    }
}

#[track_caller]
fn expect_kind<T: fmt::Debug>(r: Result<T>, kinds: &[ErrorKind], what: &str) -> Error {
    let e = expect_err(r, what);
    assert!(
        kinds.contains(&e.kind()),
        "{what}: expected an error of kind {kinds:?}, got {:?}: {e}",
        e.kind()
    );
    e
}

/// SplitMix64: a small seeded generator, so every run moves the same blocks.
#[derive(Debug, Clone)]
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// `k` distinct values below `n`, in random order (a partial Fisher-Yates shuffle).
    fn distinct(&mut self, n: u32, k: usize) -> Vec<u32> {
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
