//! Agents, registrations, metadata and descriptor lists.

use kvx_core::{AgentName, BlockList, DlistOwner, ErrorKind, MemKind, RegistrationId, TransferAgent, XferOp};

use crate::conformance::fixture::{Fixture, Loaded, Registered};
use crate::conformance::harness::{Harness, Side, TestBuffer};
use crate::conformance::support::{SplitMix, expect_kind, ok, skip_because, whole};

/// The two agents are distinct, of the same backend, can move data and register host memory.
pub fn check_capabilities<H: Harness + ?Sized>(h: &H) {
    let (ci, ct) = (h.initiator().capabilities(), h.target().capabilities());
    assert_ne!(h.initiator().name(), h.target().name(), "the two agents need distinct names");
    assert_eq!(ci.backend, ct.backend, "both agents are of one backend");
    assert!(ci.read || ci.write, "{}: supports neither READ nor WRITE", ci.backend);
    assert!(ci.dram || ci.vram, "{}: can register no memory at all", ci.backend);
}

/// An operation or a notification the backend does not support is refused with `Unsupported`.
pub fn check_unsupported_operations<H: Harness + ?Sized>(h: &H) {
    let ini = h.initiator();
    let caps = ini.capabilities();
    if caps.read && caps.write && caps.notifications {
        skip_because(&format!("backend {} supports every operation", caps.backend));
        return;
    }
    let f = Fixture::new(h, 0x5eed_0010);
    for (op, supported) in [(XferOp::Read, caps.read), (XferOp::Write, caps.write)] {
        if !supported {
            expect_kind(f.post(op, &[(0, 0)], None), ErrorKind::Unsupported, &format!("{op:?}"));
        }
    }
    if !caps.notifications {
        let op = if caps.read { XferOp::Read } else { XferOp::Write };
        expect_kind(f.post(op, &[(0, 0)], Some(b"x")), ErrorKind::Unsupported, "post with a notification");
        expect_kind(ini.notify(&f.target_name, b"x"), ErrorKind::Unsupported, "notify");
    }
    f.settle_and_verify("after unsupported posts");
}

/// Registering and deregistering memory; descriptor lists only over registered memory, and
/// deregistering releases the lists over it.
pub fn check_registration<H: Harness + ?Sized>(h: &H) {
    let agent = h.initiator();
    let a = ok(h.alloc(Side::Initiator, 8192), "alloc");
    let b = ok(h.alloc(Side::Initiator, 8192), "alloc");
    let unregistered = (a.holders(), b.holders());
    let ra = ok(agent.register(a.memory()), "register a");
    let rb = ok(agent.register(b.memory()), "register b");
    assert_ne!(ra, rb, "two registrations got the same id");

    let list = whole(&a, 2);
    let dl = ok(agent.prep_dlist(&DlistOwner::Local, &list), "prep_dlist over registered memory");
    ok(agent.release_dlist(dl), "release_dlist");
    expect_kind(agent.release_dlist(dl), ErrorKind::NotFound, "releasing a descriptor list twice");

    let over_a = ok(agent.prep_dlist(&DlistOwner::Local, &list), "prep_dlist over registered memory");
    let over_b = ok(agent.prep_dlist(&DlistOwner::Local, &whole(&b, 4)), "prep_dlist over the other");
    ok(agent.deregister(ra), "deregister a");
    expect_kind(agent.release_dlist(over_a), ErrorKind::NotFound, "deregistering releases the lists over it");
    expect_kind(agent.deregister(ra), ErrorKind::NotFound, "deregistering twice");
    expect_kind(
        agent.prep_dlist(&DlistOwner::Local, &list),
        ErrorKind::InvalidArgument,
        "prep_dlist over deregistered memory",
    );

    // The same memory can be registered again, and the other registration was not disturbed.
    let ra2 = ok(agent.register(a.memory()), "registering again after deregistration");
    ok(agent.release_dlist(over_b), "a list over the other registration outlives a's deregistration");
    let dl = ok(agent.prep_dlist(&DlistOwner::Local, &list), "prep_dlist over memory registered again");
    ok(agent.release_dlist(dl), "release_dlist");
    ok(agent.deregister(ra2), "deregister a again");
    ok(agent.deregister(rb), "deregister b");
    expect_kind(
        agent.deregister(RegistrationId(u64::MAX)),
        ErrorKind::NotFound,
        "deregistering an unknown id",
    );
    assert_eq!((a.holders(), b.holders()), unregistered, "the agent released the memory it deregistered");
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
    expect_kind(ini.load_remote(&md), ErrorKind::State, "loading the same peer twice");

    ok(ini.forget_remote(&loaded.name), "forget_remote");
    expect_kind(ini.forget_remote(&loaded.name), ErrorKind::NotFound, "forgetting a peer twice");
    let name = ok(ini.load_remote(&md), "loading a forgotten peer again");
    assert_eq!(&name, tgt.name());
    expect_kind(
        ini.forget_remote(&AgentName::new("kvx-no-such-agent")),
        ErrorKind::NotFound,
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
        ErrorKind::InvalidPeerData,
        "remote list over memory the peer deregistered before its metadata was taken",
    );
    let dl = ok(ini.prep_dlist(&owner, &whole(&other, 2)), "remote list over the peer's other registration");
    ok(ini.release_dlist(dl), "release_dlist");
    drop(loaded);
    drop(other_reg);
}

/// Malformed metadata is `InvalidPeerData`, never a panic, and leaves nothing half-loaded behind.
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
        match ini.load_remote(bytes) {
            Ok(name) => {
                // Leave the agents clean before failing.
                let _ = ini.forget_remote(&name);
                panic!("load_remote accepted garbage metadata ({what}) as agent {name}");
            }
            Err(e) => assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "garbage metadata ({what}): {e}"),
        }
    }
    let loaded = Loaded::new(ini, &md);
    assert_eq!(&loaded.name, tgt.name(), "valid metadata after garbage");
    drop(loaded);
    drop(reg);
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
            ErrorKind::InvalidPeerData,
            &format!("remote list {what}"),
        );
    }
    for (what, list) in cases(&f.local) {
        expect_kind(
            ini.prep_dlist(&DlistOwner::Local, &list),
            ErrorKind::InvalidArgument,
            &format!("local list {what}"),
        );
    }
    let unknown = DlistOwner::Remote(AgentName::new("kvx-no-such-agent"));
    expect_kind(
        ini.prep_dlist(&unknown, &f.shape.list(&f.remote)),
        ErrorKind::NotFound,
        "list of an unknown remote",
    );
}
