//! Engines of different tensor-parallel sizes, against a mockall agent: which prefill ranks a
//! decode rank handshakes, the head-sliced descriptors it posts, the releases each prefill rank
//! gets, the prefill side's count of readers, and the pairings refused before any READ.

use super::*;
use crate::auth::Nonce;
use crate::ids::{AgentName, BlockId, GroupBlocks};
use crate::memory::HostMemory;
use crate::meta::{HeldRequest, RecvRequest, ReplyTo};
use crate::mock::MockTransferAgent;
use crate::params::Endpoint;
use crate::transfer::{BlockList, Capabilities, XferId, XferState};
use std::sync::Mutex;

/// Tokens per block (not a head count, so head-major caches are told from token-major ones).
const BS: u32 = 16;
/// Blocks per pool.
const NB: u32 = 8;
/// Elements per head (one byte each).
const HD: u32 = 2;
/// Bytes of one head of one block.
const HEAD_LEN: u64 = (BS * HD) as u64;

/// A READ as the mock saw it: the local and remote list, their descriptor indices, the release
/// it carries.
type Post = (DlistId, DlistId, Vec<u32>, Vec<u32>, HoldRelease);

/// What the mock agent saw.
#[derive(Debug, Default)]
struct Seen {
    /// Every list prepared: its owner and shape.
    lists: Vec<(DlistOwner, BlockList)>,
    /// Every READ.
    posts: Vec<Post>,
    /// Every notification sent alone: to whom, what.
    sent: Vec<(AgentName, Vec<u8>)>,
}

type Shared = Arc<Mutex<Seen>>;

fn caps() -> Capabilities {
    Capabilities { backend: "mock", dram: true, vram: false, read: true, write: true, notifications: true }
}

/// A mock agent loading peer `x`'s metadata `b"x"` as agent `x`, recording what it is asked, and
/// completing every READ at the next step. `inbox` is what it delivers.
fn agent(seen: Shared, inbox: Arc<Mutex<Vec<Notification>>>) -> MockTransferAgent {
    let mut a = MockTransferAgent::new();
    a.expect_capabilities().return_const(caps());
    a.expect_name().return_const(AgentName::new("me"));
    a.expect_register().returning(|_| Ok(RegistrationId(1)));
    a.expect_local_metadata().returning(|| Ok(b"me".to_vec()));
    let s = seen.clone();
    a.expect_prep_dlist().returning(move |owner, list| {
        let mut s = s.lock().unwrap();
        s.lists.push((owner.clone(), list.clone()));
        Ok(DlistId(s.lists.len() as u64))
    });
    a.expect_load_remote().returning(|md| Ok(AgentName::new(String::from_utf8_lossy(md).into_owned())));
    let s = seen.clone();
    a.expect_post_blocks().returning(move |_, local, remote, blocks, n| {
        let (mut l, mut r) = (Vec::new(), Vec::new());
        blocks.descriptor_indices(&mut l, &mut r)?;
        let release = wire::decode::<HoldRelease>(n.expect("a READ carries its release"))?;
        let mut s = s.lock().unwrap();
        s.posts.push((local, remote, l, r, release));
        Ok(XferId(s.posts.len() as u64))
    });
    let (s, mut reported) = (seen.clone(), 0);
    a.expect_drain_completions().returning(move |out| {
        let posted = s.lock().unwrap().posts.len() as u64;
        out.extend((reported + 1..=posted).map(XferId));
        reported = posted;
        Ok(())
    });
    a.expect_poll().returning(|_| Ok(XferState::Done));
    a.expect_release().returning(|_| Ok(()));
    let s = seen;
    a.expect_notify().returning(move |to, msg| {
        s.lock().unwrap().sent.push((to.clone(), msg.to_vec()));
        Ok(())
    });
    a.expect_drain_notifications().returning(move |out| {
        out.append(&mut inbox.lock().unwrap());
        Ok(())
    });
    a.expect_release_dlist().returning(|_| Ok(()));
    a.expect_forget_remote().returning(|_| Ok(()));
    a.expect_deregister().returning(|_| Ok(()));
    a
}

/// One layer's cache of `heads` heads a block: head-major (HND) or token-major (NHD).
fn caches(heads: u32, hnd: bool) -> Vec<LayerCache> {
    let (n, bs, h, d) = (u64::from(NB), u64::from(BS), u64::from(heads), u64::from(HD));
    let shape = if hnd { vec![2, n, h, bs, d] } else { vec![2, n, bs, h, d] };
    let len: u64 = shape.iter().product();
    vec![LayerCache {
        memory: Arc::new(HostMemory::new(len as usize).unwrap()),
        shape,
        elem_size: 1,
        window: None,
    }]
}

/// A decode worker, rank `rank` of `tp`, of a model of `heads` KV heads.
fn decode(
    rank: u32,
    tp: u32,
    heads: u32,
    hnd: bool,
    seen: &Shared,
    inbox: &Arc<Mutex<Vec<Notification>>>,
) -> ConnectorWorker {
    let config = WorkerConfig {
        kv_heads: Some(heads),
        side_channel: Some(RemoteCoordinates::at("decode", "d", 5700)),
        ..WorkerConfig::new("decode".into(), rank, tp, BS)
    };
    let mut w = ConnectorWorker::new(config, Arc::new(agent(seen.clone(), inbox.clone()))).unwrap();
    w.register_kv_caches(&caches((heads / tp).max(1), hnd)).unwrap();
    w
}

/// The payload of rank `rank` of a prefill engine of `tp` ranks and `heads` heads (agent
/// `prefill<rank>`).
fn prefill_payload(rank: u32, tp: u32, heads: u32, hnd: bool) -> Vec<u8> {
    let per_rank = (heads / tp).max(1);
    let (layout, _) = KvCacheLayout::detect(&caches(per_rank, hnd), BS).unwrap();
    let name = format!("prefill{rank}");
    wire::encode(&HandshakePayload {
        engine_id: "prefill".into(),
        rank,
        world_size: tp,
        kv_heads: heads,
        agent_name: name.as_str().into(),
        agent_metadata: name.into_bytes(),
        region_bases: vec![0x100_0000 * u64::from(rank + 1), 0x100_0000 * u64::from(rank + 1) + 0x8_0000],
        num_blocks: 2 * NB,
        block_len: layout.block_len,
        compat_hash: layout.compat_hash(""),
        instance: 1,
    })
    .unwrap()
}

fn nonce() -> Nonce {
    crate::auth::HexBytes([7; 16])
}

/// A load of local blocks `local` from remote blocks `remote` of a prefill engine of `tp` ranks.
fn recv(local: Vec<BlockId>, remote: Vec<BlockId>, tp: u32) -> RecvRequest {
    RecvRequest {
        prompt: None,
        request_id: "r".into(),
        remote_request_id: None,
        local_block_ids: vec![GroupBlocks::whole(local)],
        remote_block_ids: vec![GroupBlocks::whole(remote)],
        remote: RemoteCoordinates::at("prefill", "h", 5600),
        nonce: Some(nonce()),
        mac: None,
        remote_instance: None,
        remote_tp_size: Some(tp),
    }
}

fn meta(req: RecvRequest) -> ConnectorMetadata {
    ConnectorMetadata { reqs_to_recv: vec![req], ..Default::default() }
}

/// Answers every queued handshake with the prefill rank it names; returns the ranks fetched.
fn handshake(w: &mut ConnectorWorker, now: Instant, tp: u32, heads: u32, hnd: bool) -> Vec<u32> {
    let mut ranks = Vec::new();
    while let Some(WorkerCommand::FetchHandshake(PeerLocator { engine_id, rank, endpoint })) =
        w.poll_command()
    {
        assert_eq!(endpoint, Some(Endpoint::new("h", 5600 + rank as u16)), "rank {rank}'s own side channel");
        ranks.push(rank);
        w.handle_handshake(now, &engine_id, rank, Ok(prefill_payload(rank, tp, heads, hnd)));
    }
    ranks
}

/// The prefill rank's answer to the release the READ to `agent` carried.
fn held(seen: &Shared, agent: &str) -> Notification {
    let s = seen.lock().unwrap();
    let to_agent = |p: &&Post| s.lists[p.1.0 as usize - 1].0 == DlistOwner::Remote(agent.into());
    let release = &s.posts.iter().find(to_agent).expect("a READ from that agent").4;
    let token = release.reply_to.as_ref().expect("the READ's release asks").token;
    let status = HoldStatus { request_id: "r".into(), nonce: nonce(), held: true, token };
    Notification { from: agent.into(), msg: wire::encode(&status).unwrap() }
}

#[test]
fn a_wider_decode_engine_reads_its_heads_out_of_the_one_prefill_rank_that_holds_them() {
    // 4 heads; prefill TP 1 holds all four, decode TP 2 rank 1 holds heads 2 and 3.
    let (seen, inbox) = (Shared::default(), Arc::default());
    let mut w = decode(1, 2, 4, true, &seen, &inbox);
    let now = Instant::now();
    w.start_load_kv(now, &meta(recv(vec![3, 4], vec![5, 9], 1)));
    assert_eq!(handshake(&mut w, now, 1, 4, true), [0], "prefill rank 0 only");
    let s = seen.lock().unwrap();
    // The whole-block lists of registration and handshake, then the two per-head lists.
    let (owner, local) = &s.lists[2];
    assert_eq!((owner, local.num_blocks, local.block_len), (&DlistOwner::Local, NB * 2, HEAD_LEN));
    let (owner, remote) = &s.lists[3];
    assert_eq!(
        (owner, remote.num_blocks, remote.block_len),
        (&DlistOwner::Remote("prefill0".into()), 2 * NB * 4, HEAD_LEN)
    );
    assert_eq!(remote.bases, [0x100_0000, 0x100_0000 + 0x8_0000]);
    let (l, r, local_idx, remote_idx, release) = &s.posts[0];
    assert_eq!((l.0, r.0), (3, 4), "posted on the per-head lists");
    // Local blocks 3, 4: heads 0, 1 of each (units 6, 7, 8, 9), in K then V (16 units a region).
    assert_eq!(local_idx, &[6, 7, 8, 9, 22, 23, 24, 25]);
    // Remote blocks 5, 9: heads 2, 3 of each (units 22, 23, 38, 39; 64 units a region).
    assert_eq!(remote_idx, &[22, 23, 38, 39, 86, 87, 102, 103]);
    assert_eq!((release.reader, release.readers), (1, 2), "prefill rank 0 has two readers");
    assert_eq!(release.reply_to.as_ref().map(|r| r.rank), Some(1), "answer decode rank 1");
}

#[test]
fn a_narrower_decode_engine_gathers_from_every_prefill_rank_and_reports_once_all_confirmed() {
    // 4 heads; prefill TP 2 (2 heads a rank), decode TP 1 (all four).
    let (seen, inbox) = (Shared::default(), Arc::<Mutex<Vec<Notification>>>::default());
    let mut w = decode(0, 1, 4, true, &seen, &inbox);
    let now = Instant::now();
    w.start_load_kv(now, &meta(recv(vec![1], vec![2], 2)));
    assert_eq!(handshake(&mut w, now, 2, 4, true), [0, 1]);
    {
        let s = seen.lock().unwrap();
        assert_eq!(s.posts.len(), 2);
        // From rank 0 its whole block into local heads 0, 1; from rank 1 into heads 2, 3.
        assert_eq!((&s.posts[0].2, &s.posts[0].3), (&vec![4, 5, 36, 37], &vec![4, 5, 36, 37]));
        assert_eq!((&s.posts[1].2, &s.posts[1].3), (&vec![6, 7, 38, 39], &vec![4, 5, 36, 37]));
        assert!(s.posts.iter().all(|p| (p.4.reader, p.4.readers) == (0, 1)));
    }
    assert!(w.get_finished(now).is_empty(), "both READs done, neither confirmed");
    inbox.lock().unwrap().push(held(&seen, "prefill1"));
    assert!(w.get_finished(now).is_empty(), "one of two confirmed");
    assert_eq!(w.num_in_flight(), 1);
    inbox.lock().unwrap().push(held(&seen, "prefill0"));
    assert_eq!(w.get_finished(now).recving, [RequestId::new("r")]);
    assert!(w.is_idle());
    assert_eq!(w.stats().reads_posted, 2);
}

#[test]
fn a_failed_read_from_one_prefill_rank_fails_the_request_once_and_releases_the_other() {
    let (seen, inbox) = (Shared::default(), Arc::<Mutex<Vec<Notification>>>::default());
    let mut w = decode(0, 1, 4, true, &seen, &inbox);
    let now = Instant::now();
    w.start_load_kv(now, &meta(recv(vec![1], vec![2], 2)));
    // Rank 0 answers; rank 1's handshake fails.
    let Some(WorkerCommand::FetchHandshake(first)) = w.poll_command() else { panic!("a fetch") };
    let Some(WorkerCommand::FetchHandshake(second)) = w.poll_command() else { panic!("two fetches") };
    w.handle_handshake(now, &first.engine_id, first.rank, Ok(prefill_payload(first.rank, 2, 4, true)));
    w.get_finished(now);
    w.handle_handshake(now, &second.engine_id, second.rank, Err(Error::new(ErrorKind::Io, "refused")));
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving.len(), 1, "reported once: {f:?}");
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Io);
    assert_eq!(w.num_in_flight(), 0, "the confirming READ from rank 0 ended with the request");
    // Rank 0's release went with its READ; nobody answers a late status.
    inbox.lock().unwrap().push(held(&seen, "prefill0"));
    assert!(w.get_finished(now).is_empty());
}

#[test]
fn mla_reads_the_latent_from_one_rank_and_releases_the_replica_nobody_reads() {
    let (seen, inbox) = (Shared::default(), Arc::<Mutex<Vec<Notification>>>::default());
    let config = WorkerConfig {
        side_channel: Some(RemoteCoordinates::at("decode", "d", 5700)),
        ..WorkerConfig::new("decode".into(), 0, 1, BS)
    };
    let mut w = ConnectorWorker::new(config, Arc::new(agent(seen.clone(), inbox))).unwrap();
    let mla = |n: u32| LayerCache {
        memory: Arc::new(HostMemory::new((n * BS * 8) as usize).unwrap()),
        shape: vec![u64::from(n), u64::from(BS), 8],
        elem_size: 1,
        window: None,
    };
    w.register_kv_caches(&[mla(NB)]).unwrap();
    let now = Instant::now();
    w.start_load_kv(now, &meta(recv(vec![1], vec![2], 2)));
    let mut fetched = Vec::new();
    while let Some(WorkerCommand::FetchHandshake(p)) = w.poll_command() {
        let (layout, _) = KvCacheLayout::detect(&[mla(NB)], BS).unwrap();
        let name = format!("prefill{}", p.rank);
        let payload = HandshakePayload {
            engine_id: "prefill".into(),
            rank: p.rank,
            world_size: 2,
            kv_heads: 1,
            agent_name: name.as_str().into(),
            agent_metadata: name.into_bytes(),
            region_bases: vec![0x100_0000 * u64::from(p.rank + 1)],
            num_blocks: NB,
            block_len: layout.block_len,
            compat_hash: layout.compat_hash(""),
            instance: 1,
        };
        fetched.push(p.rank);
        w.handle_handshake(now, &p.engine_id, p.rank, Ok(wire::encode(&payload).unwrap()));
    }
    assert_eq!(fetched, [0, 1], "rank 0 for the READ, rank 1 for its release alone");
    let s = seen.lock().unwrap();
    assert_eq!(s.posts.len(), 1);
    assert_eq!((s.posts[0].0.0, s.posts[0].1.0), (1, 2), "whole blocks: no per-head lists");
    assert_eq!(s.lists[1].0, DlistOwner::Remote("prefill0".into()));
    let (to, msg) = &s.sent[0];
    let release: HoldRelease = wire::decode(msg).unwrap();
    assert_eq!((to.as_str(), release.reader, release.readers, release.reply_to), ("prefill1", 0, 1, None));
}

#[test]
fn impossible_pairings_fail_at_once_with_incompatible_and_read_nothing() {
    for (what, hnd, decode_tp, heads, prefill_tp) in [
        ("heads that do not split over the prefill ranks", true, 1, 4, 3),
        ("a token-major cache that would need slicing", false, 2, 4, 1),
    ] {
        let (seen, inbox) = (Shared::default(), Arc::default());
        let mut w = decode(0, decode_tp, heads, hnd, &seen, &inbox);
        let now = Instant::now();
        w.start_load_kv(now, &meta(recv(vec![1], vec![2], prefill_tp)));
        let f = w.get_finished(now);
        assert_eq!(f.failed_recving.len(), 1, "{what}");
        assert_eq!(
            f.failed_recving[0].error.kind(),
            ErrorKind::Incompatible,
            "{what}: {}",
            f.failed_recving[0].error
        );
        assert!(seen.lock().unwrap().posts.is_empty(), "{what}");
        assert_eq!(w.num_in_flight(), 0, "{what}");
    }
    // A token-major cache reads whole blocks where the ranks hold the same heads.
    let (seen, inbox) = (Shared::default(), Arc::default());
    let mut w = decode(0, 2, 2, false, &seen, &inbox);
    let now = Instant::now();
    w.start_load_kv(now, &meta(recv(vec![1], vec![2], 2)));
    handshake(&mut w, now, 2, 2, false);
    assert_eq!(seen.lock().unwrap().posts.len(), 1);
    // A peer whose size is not the params': refused before the READ.
    let (seen, inbox) = (Shared::default(), Arc::default());
    let mut w = decode(0, 2, 4, true, &seen, &inbox);
    w.start_load_kv(now, &meta(recv(vec![1], vec![2], 2)));
    while let Some(WorkerCommand::FetchHandshake(p)) = w.poll_command() {
        w.handle_handshake(now, &p.engine_id, p.rank, Ok(prefill_payload(p.rank, 4, 4, true)));
    }
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Incompatible, "{}", f.failed_recving[0].error);
    assert!(seen.lock().unwrap().posts.is_empty());
}

/// A prefill worker holding "r"; `inbox` delivers to it.
fn holder(inbox: &Arc<Mutex<Vec<Notification>>>, seen: &Shared) -> ConnectorWorker {
    let config = WorkerConfig::new("prefill".into(), 0, 1, BS);
    let mut w = ConnectorWorker::new(config, Arc::new(agent(seen.clone(), inbox.clone()))).unwrap();
    w.register_kv_caches(&caches(4, true)).unwrap();
    let held = HeldRequest { request_id: "r".into(), nonce: nonce() };
    w.start_load_kv(Instant::now(), &ConnectorMetadata { reqs_to_send: vec![held], ..Default::default() });
    w
}

fn release(reader: u32, readers: u32, asks: bool) -> Notification {
    let reply_to = asks.then(|| ReplyTo {
        engine: RemoteCoordinates::at("decode", "d", 5700),
        rank: reader,
        instance: 3,
        token: crate::auth::HexBytes([reader as u8; 16]),
    });
    let msg =
        HoldRelease { request_id: "r".into(), nonce: nonce(), reply_to, reader, readers, instance: None };
    Notification { from: format!("decode{reader}").into(), msg: wire::encode(&msg).unwrap() }
}

#[test]
fn a_hold_with_several_readers_ends_with_the_last_distinct_one() {
    let (seen, inbox) = (Shared::default(), Arc::<Mutex<Vec<Notification>>>::default());
    let mut w = holder(&inbox, &seen);
    let now = Instant::now();
    inbox.lock().unwrap().extend([release(1, 3, true), release(1, 3, false)]);
    assert!(w.get_finished(now).sending.is_empty(), "one distinct reader of three");
    // Reader 1 is answered "held" on its own side channel rank (5701).
    assert!(matches!(
        w.poll_command(),
        Some(WorkerCommand::FetchHandshake(PeerLocator {
            rank: 1,
            endpoint: Some(Endpoint { port: 5701, .. }),
            ..
        }))
    ));
    // A release announcing another count of readers is refused.
    inbox.lock().unwrap().push(release(0, 2, false));
    assert!(w.get_finished(now).sending.is_empty());
    assert_eq!(w.stats().rejected_notifications, 1);
    inbox.lock().unwrap().extend([release(0, 3, false), release(2, 3, false)]);
    assert_eq!(w.get_finished(now).sending, [RequestId::new("r")]);
    assert_eq!((w.stats().notifications, w.stats().stray_notifications), (3, 1));
}

#[test]
fn early_releases_of_several_readers_wait_for_their_hold() {
    let (seen, inbox) = (Shared::default(), Arc::<Mutex<Vec<Notification>>>::default());
    let config = WorkerConfig::new("prefill".into(), 0, 1, BS);
    let mut w = ConnectorWorker::new(config, Arc::new(agent(seen, inbox.clone()))).unwrap();
    w.register_kv_caches(&caches(4, true)).unwrap();
    let now = Instant::now();
    inbox.lock().unwrap().extend([release(0, 2, false), release(0, 2, false), release(1, 2, false)]);
    assert!(w.get_finished(now).is_empty());
    let held = HeldRequest { request_id: "r".into(), nonce: nonce() };
    w.start_load_kv(now, &ConnectorMetadata { reqs_to_send: vec![held], ..Default::default() });
    assert_eq!(w.get_finished(now).sending, [RequestId::new("r")], "both readers had released");
    let s = w.stats();
    assert_eq!((s.early_notifications, s.notifications, s.stray_notifications), (3, 2, 1));
}
