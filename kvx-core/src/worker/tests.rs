//! Every worker path against a mockall agent: what is posted, what is refused, what is reported.

use super::*;
use crate::auth::Nonce;
use crate::ids::{AgentName, BlockId, GroupBlocks};
use crate::memory::HostMemory;
use crate::meta::{FailedRecv, Heartbeat, HeldRequest, RankReport, RecvRequest, ReplyTo};
use crate::mock::MockTransferAgent;
use crate::params::Endpoint;
use crate::transfer::Capabilities;
use crate::transfer::{XferId, XferOp, XferState};
use mockall::predicate::*;
use std::sync::Mutex;

const BS: u32 = 4;
const NB: u32 = 8;

fn caps() -> Capabilities {
    Capabilities { backend: "mock", dram: true, vram: false, read: true, write: true, notifications: true }
}

/// One post as the mock saw it.
#[derive(Debug, Clone, PartialEq)]
struct Posted {
    local: Vec<u32>,
    remote: Vec<u32>,
    remote_dlist: DlistId,
    notify: Option<Vec<u8>>,
}

/// Notifications a test delivers to a mock agent.
type Inbox = Arc<Mutex<Vec<Notification>>>;

/// A mock agent that accepts registration, loads any metadata as "peer", and records posts.
fn agent(posts: Arc<Mutex<Vec<Posted>>>, configure: impl FnMut(&mut MockTransferAgent)) -> MockTransferAgent {
    agent_with_inbox(posts, Inbox::default(), configure)
}

/// The same, delivering what the test pushes on `inbox`.
fn agent_with_inbox(
    posts: Arc<Mutex<Vec<Posted>>>,
    inbox: Inbox,
    mut configure: impl FnMut(&mut MockTransferAgent),
) -> MockTransferAgent {
    let mut a = MockTransferAgent::new();
    configure(&mut a);
    report_completions(&mut a, posts.clone(), &[]);
    a.expect_capabilities().return_const(caps());
    a.expect_name().return_const(AgentName::new("me"));
    a.expect_register().returning(|_| Ok(RegistrationId(1)));
    a.expect_local_metadata().returning(|| Ok(b"my-agent-md".to_vec()));
    a.expect_prep_dlist().returning(|owner, _| {
        Ok(match owner {
            DlistOwner::Local => DlistId(100),
            DlistOwner::Remote(_) => DlistId(200),
        })
    });
    a.expect_load_remote().returning(|_| Ok(AgentName::new("peer")));
    a.expect_post_blocks().returning(move |op, _local, remote, blocks, n| {
        assert_eq!(op, XferOp::Read);
        // Recorded as the descriptor indices the default `post_blocks` would post.
        let (mut l, mut r) = (Vec::new(), Vec::new());
        blocks.descriptor_indices(&mut l, &mut r)?;
        let mut posts = posts.lock().unwrap();
        posts.push(Posted { local: l, remote: r, remote_dlist: remote, notify: n.map(<[u8]>::to_vec) });
        Ok(XferId(posts.len() as u64))
    });
    a.expect_release().returning(|_| Ok(()));
    a.expect_release_dlist().returning(|_| Ok(()));
    a.expect_forget_remote().returning(|_| Ok(()));
    a.expect_notify().returning(|_, _| Ok(()));
    a.expect_drain_notifications().returning(move |out| {
        out.append(&mut inbox.lock().unwrap());
        Ok(())
    });
    a
}

/// Has the mock report each transfer posted so far (ids 1, 2, ... in post order) once, at the next
/// `drain_completions`, except those in `pending`, which never complete.
fn report_completions(a: &mut MockTransferAgent, posts: Arc<Mutex<Vec<Posted>>>, pending: &'static [u64]) {
    let mut reported = 0;
    a.expect_drain_completions().returning(move |out| {
        let posted = posts.lock().unwrap().len() as u64;
        out.extend((reported + 1..=posted).filter(|id| !pending.contains(id)).map(XferId));
        reported = posted;
        Ok(())
    });
}

fn caches(windows: &[Option<u32>]) -> Vec<LayerCache> {
    windows
        .iter()
        .map(|&window| LayerCache {
            memory: Arc::new(HostMemory::new((2 * NB * BS * 2) as usize).unwrap()),
            shape: vec![2, u64::from(NB), u64::from(BS), 1, 2],
            elem_size: 1,
            window,
        })
        .collect()
}

/// The decode engine's own side channel, where the prefill engine answers.
fn decode_side_channel() -> RemoteCoordinates {
    RemoteCoordinates::at("decode", "d", 5700)
}

fn config(rank: u32) -> WorkerConfig {
    WorkerConfig {
        side_channel: Some(decode_side_channel()),
        ..WorkerConfig::new("decode".into(), rank, 2, BS)
    }
}

fn worker_with(agent: MockTransferAgent, rank: u32, windows: &[Option<u32>]) -> ConnectorWorker {
    let mut w = ConnectorWorker::new(config(rank), Arc::new(agent)).unwrap();
    w.register_kv_caches(&caches(windows)).unwrap();
    w
}

/// The payload a compatible prefill rank would publish.
fn peer_payload(rank: u32, windows: &[Option<u32>], edit: impl FnOnce(&mut HandshakePayload)) -> Vec<u8> {
    let (layout, _) = KvCacheLayout::detect(&caches(windows), BS).unwrap();
    let mut p = HandshakePayload {
        engine_id: "prefill".into(),
        rank,
        world_size: 2,
        kv_heads: layout.heads * 2,
        agent_name: "peer".into(),
        agent_metadata: b"peer-md".to_vec(),
        region_bases: (0..layout.num_regions()).map(|r| 0x10_0000 * u64::from(r + 1)).collect(),
        num_blocks: 16,
        block_len: layout.block_len,
        compat_hash: layout.compat_hash(""),
        instance: 1,
    };
    edit(&mut p);
    wire::encode(&p).unwrap()
}

/// The nonce the prefill engine gave request `id` in these tests.
fn nonce_of(id: &str) -> Nonce {
    let mut b = [0u8; 16];
    for (i, c) in id.bytes().enumerate() {
        b[i % 16] ^= c.wrapping_add(i as u8);
    }
    crate::auth::HexBytes(b)
}

/// The notification that frees the prefill engine's hold of `id`, wanting no answer (a failed
/// or notify-only load).
/// The failure a mocked transport reports for a READ.
fn link_down() -> Error {
    Error::new(ErrorKind::Transfer, "link down").with_backend("mock").with_code(-3)
}

fn release(id: &str) -> Vec<u8> {
    wire::encode(&HoldRelease {
        request_id: id.into(),
        nonce: nonce_of(id),
        reply_to: None,
        reader: 0,
        readers: 1,
    })
    .unwrap()
}

/// Checks that `posted` is the release a READ of `id` by `w` carries: asking for an answer.
fn assert_read_release(posted: &Option<Vec<u8>>, w: &ConnectorWorker, id: &str) {
    let r: HoldRelease = wire::decode(posted.as_ref().expect("a notification")).unwrap();
    assert_eq!((r.request_id.as_str(), r.nonce), (id, nonce_of(id)));
    let reply_to = r.reply_to.expect("the release asks for an answer");
    assert_eq!((reply_to.engine, reply_to.instance), (decode_side_channel(), w.instance()));
}

/// The prefill engine's answer for the hold of `id`, to the last READ posted for it (its token).
fn answer(posts: &Mutex<Vec<Posted>>, id: &str, held: bool) -> Notification {
    let token = posts
        .lock()
        .unwrap()
        .iter()
        .rev()
        .filter_map(|p| wire::decode::<HoldRelease>(p.notify.as_ref()?).ok())
        .find(|r| r.request_id.as_str() == id)
        .and_then(|r| r.reply_to)
        .map_or(crate::auth::HexBytes([0; 16]), |r| r.token);
    notif(&wire::encode(&HoldStatus { request_id: id.into(), nonce: nonce_of(id), held, token }).unwrap())
}

/// One group's blocks `ids` from position `first`.
fn at(first: u32, ids: Vec<BlockId>) -> Vec<GroupBlocks> {
    vec![GroupBlocks::new(first, ids)]
}

/// A load of `local` blocks from the last `local.len()` of the `remote` blocks offered.
fn recv(id: &str, local: Vec<BlockId>, remote: Vec<BlockId>) -> RecvRequest {
    RecvRequest {
        request_id: id.into(),
        remote_request_id: None,
        local_block_ids: vec![GroupBlocks::new(remote.len().saturating_sub(local.len()) as u32, local)],
        remote_block_ids: vec![GroupBlocks::whole(remote)],
        remote: RemoteCoordinates::at("prefill", "h", 5600),
        nonce: Some(nonce_of(id)),
        mac: None,
        remote_instance: None,
        remote_tp_size: None,
    }
}

fn meta(reqs: Vec<RecvRequest>) -> ConnectorMetadata {
    ConnectorMetadata { reqs_to_recv: reqs, ..Default::default() }
}

/// Starts `reqs` and completes the handshake with a compatible peer.
fn start_and_handshake(w: &mut ConnectorWorker, now: Instant, reqs: Vec<RecvRequest>) {
    w.start_load_kv(now, &meta(reqs));
    let cmd = w.poll_command().expect("a handshake is requested");
    let rank = w.config().rank;
    assert_eq!(
        cmd,
        WorkerCommand::FetchHandshake(PeerLocator {
            engine_id: "prefill".into(),
            rank,
            endpoint: Some(Endpoint::new("h", 5600 + rank as u16)),
        })
    );
    w.handle_handshake(now, &"prefill".into(), rank, Ok(peer_payload(rank, &[None, None], |_| {})));
}

#[test]
fn needs_read_and_notifications() {
    let mut a = MockTransferAgent::new();
    a.expect_capabilities().return_const(Capabilities { read: false, ..caps() });
    let e = ConnectorWorker::new(config(0), Arc::new(a)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
}

#[test]
fn registration_publishes_a_complete_payload_once() {
    let posts = Arc::new(Mutex::new(vec![]));
    let mut w = ConnectorWorker::new(config(1), Arc::new(agent(posts, |_| {}))).unwrap();
    let c = caches(&[None, None]);
    let bytes = w.register_kv_caches(&c).unwrap();
    let p: HandshakePayload = wire::decode(&bytes).unwrap();
    assert_eq!((p.engine_id.as_str(), p.rank, p.world_size), ("decode", 1, 2));
    assert_eq!(p.agent_metadata, b"my-agent-md");
    assert_eq!(p.num_blocks, NB);
    assert_eq!(p.block_len, u64::from(BS) * 2);
    assert_eq!(p.region_bases.len(), 4);
    assert_eq!(p.region_bases[0], c[0].memory.region().addr);
    assert_eq!(w.handshake_payload(), Some(bytes.as_slice()));
    assert_eq!(w.register_kv_caches(&c).unwrap_err().kind(), ErrorKind::State);
}

#[test]
fn requests_wait_for_the_handshake_then_read_the_last_blocks() {
    let posts = Arc::new(Mutex::new(vec![]));
    let mut w = worker_with(agent(posts.clone(), |_| {}), 1, &[None, None]);
    let now = Instant::now();
    // Partial prefix hit: 2 local blocks, 3 remote: read the last 2 remote blocks.
    w.start_load_kv(now, &meta(vec![recv("a", vec![1, 2], vec![9, 10, 11])]));
    assert!(posts.lock().unwrap().is_empty(), "nothing is posted before the handshake");
    // A second request for the same peer waits on the same handshake.
    w.start_load_kv(now, &meta(vec![recv("b", vec![3], vec![12])]));
    assert!(matches!(
        w.poll_command(),
        Some(WorkerCommand::FetchHandshake(PeerLocator { endpoint: Some(Endpoint { port: 5601, .. }), .. }))
    ));
    assert_eq!(w.poll_command(), None, "one handshake per peer");
    w.handle_handshake(now, &"prefill".into(), 1, Ok(peer_payload(1, &[None, None], |_| {})));
    let posts = posts.lock().unwrap();
    assert_eq!(posts.len(), 2);
    // Regions K0 V0 K1 V1; local num_blocks 8, remote 16.
    assert_eq!(posts[0].local, vec![1, 2, 9, 10, 17, 18, 25, 26]);
    assert_eq!(posts[0].remote, vec![10, 11, 26, 27, 42, 43, 58, 59]);
    assert_eq!(posts[0].remote_dlist, DlistId(200));
    assert_read_release(&posts[0].notify, &w, "a");
    assert_eq!(posts[1].local, vec![3, 11, 19, 27]);
    assert_eq!(w.stats().handshakes, 1);
    // Blocks 1, 2 <- 10, 11 are one run per region; block 3 one more.
    assert_eq!((w.stats().descriptors, w.stats().block_descriptors), (4 + 4, 8 + 4));
}

#[test]
fn windowed_layers_read_only_their_last_blocks() {
    let posts = Arc::new(Mutex::new(vec![]));
    let windows = [None, Some(1)];
    let mut w = worker_with(agent(posts.clone(), |_| {}), 0, &windows);
    w.start_load_kv(Instant::now(), &meta(vec![recv("a", vec![1, 2], vec![3, 4])]));
    w.poll_command();
    w.handle_handshake(Instant::now(), &"prefill".into(), 0, Ok(peer_payload(0, &windows, |_| {})));
    let posts = posts.lock().unwrap();
    assert_eq!(posts[0].local, vec![1, 2, 9, 10, 18, 26]);
    assert_eq!(posts[0].remote, vec![3, 4, 19, 20, 36, 52]);
    assert_eq!((w.stats().descriptors, w.stats().block_descriptors), (4, 6));
}

#[test]
fn the_groups_of_a_hybrid_model_read_their_blocks_at_the_same_positions_into_every_region() {
    // vLLM overlays the layers of its KV-cache groups on the same regions: a group's blocks are
    // read, in every region, from the offered blocks of that group at the same positions.
    let posts = Arc::new(Mutex::new(vec![]));
    let mut w = worker_with(agent(posts.clone(), |_| {}), 0, &[None, None]);
    let req = RecvRequest {
        // Sliding group: positions 2 and 3 (its window); full group: positions 1 to 3.
        local_block_ids: vec![GroupBlocks::new(2, vec![5, 6]), GroupBlocks::new(1, vec![1, 2, 3])],
        remote_block_ids: vec![GroupBlocks::new(1, vec![7, 8, 9]), GroupBlocks::whole(vec![10, 11, 12, 13])],
        ..recv("a", vec![], vec![])
    };
    start_and_handshake(&mut w, Instant::now(), vec![req]);
    let posts = posts.lock().unwrap();
    assert_eq!(posts.len(), 1, "one READ for both groups");
    // Pairs 5<-8, 6<-9, 1<-11, 2<-12, 3<-13 in region 0 (K0); region 1 adds 8 locally, 16 remotely.
    assert_eq!(posts[0].local[..5], [5, 6, 1, 2, 3]);
    assert_eq!(posts[0].remote[..5], [8, 9, 11, 12, 13]);
    assert_eq!(posts[0].local[5..10], [13, 14, 9, 10, 11]);
    assert_eq!(posts[0].remote[5..10], [24, 25, 27, 28, 29]);
}

#[test]
fn full_prefix_hit_notifies_without_reading() {
    let posts = Arc::new(Mutex::new(vec![]));
    let a = agent(posts.clone(), |a| {
        a.expect_notify()
            .withf(|to, m| to.as_str() == "peer" && m == release("a"))
            .times(1)
            .returning(|_, _| Ok(()));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    start_and_handshake(&mut w, Instant::now(), vec![recv("a", vec![], vec![3, 4])]);
    assert!(posts.lock().unwrap().is_empty());
    assert!(w.get_finished(Instant::now()).is_empty(), "the request is not waiting");
    assert_eq!(w.stats().notify_only, 1);
}

#[test]
fn the_prefill_engines_request_id_names_every_notification() {
    // vLLM gives the two engines' requests different ids: the READ's notification, a notify-only
    // message and the free-at-once after a failed READ all name the prefill engine's id.
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        for id in ["p-only", "p-bad"] {
            a.expect_notify()
                .withf(move |to, m| to.as_str() == "peer" && m == release(id))
                .times(1)
                .returning(|_, _| Ok(()));
        }
        a.expect_poll().with(eq(XferId(1))).returning(|_| Ok(XferState::Done));
        a.expect_poll().with(eq(XferId(2))).returning(|_| Ok(XferState::Failed(link_down())));
    });
    let with_remote = |id: &str, local: Vec<BlockId>, remote: Vec<BlockId>| RecvRequest {
        remote_request_id: Some(format!("p-{id}").into()),
        nonce: Some(nonce_of(&format!("p-{id}"))),
        ..recv(id, local, remote)
    };
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(
        &mut w,
        now,
        vec![
            with_remote("ok", vec![1], vec![1]),
            with_remote("bad", vec![2], vec![2]),
            with_remote("only", vec![], vec![3]),
        ],
    );
    let notes: Vec<_> = posts.lock().unwrap().iter().map(|p| p.notify.clone()).collect();
    assert_eq!(notes.len(), 2);
    assert_read_release(&notes[0], &w, "p-ok");
    assert_read_release(&notes[1], &w, "p-bad");
    inbox.lock().unwrap().push(answer(&posts, "p-ok", true));
    let mut f = w.get_finished(now);
    assert_eq!(f.recving, vec![RequestId::new("ok")], "reported under the decode engine's id");
    // The failed READ's engine is handshaken again; the same instance: the load fails.
    answer_handshakes(&mut w, now, 1);
    f.extend(w.get_finished(now));
    assert_eq!(f.failed_recving[0].request_id, "bad".into());
}

/// Answers every queued handshake with a compatible peer of `instance`.
fn answer_handshakes(w: &mut ConnectorWorker, now: Instant, instance: u64) {
    let rank = w.config().rank;
    while let Some(WorkerCommand::FetchHandshake(PeerLocator { engine_id, .. })) = w.poll_command() {
        w.handle_handshake(
            now,
            &engine_id,
            rank,
            Ok(peer_payload(rank, &[None, None], |p| p.instance = instance)),
        );
    }
}

#[test]
fn a_read_that_fails_because_the_engine_restarted_is_posted_again_to_its_new_instance() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().with(eq(XferId(1))).returning(|_| Ok(XferState::Failed(link_down())));
        a.expect_poll().with(eq(XferId(2))).returning(|_| Ok(XferState::Done));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    assert!(w.get_finished(now).is_empty(), "not failed yet: the engine may have restarted");
    answer_handshakes(&mut w, now, 2);
    assert_eq!(posts.lock().unwrap().len(), 2, "posted again to the new instance");
    inbox.lock().unwrap().push(answer(&posts, "a", true));
    assert_eq!(w.get_finished(now).recving, vec![RequestId::new("a")]);
    let s = w.stats();
    assert_eq!((s.handshakes, s.peer_restarts, s.peers_invalidated), (2, 1, 1));
    assert!(w.is_idle());
}

#[test]
fn completed_and_failed_transfers_are_reported_per_request() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        // The failed load tells the prefill engine to free its blocks at once.
        a.expect_notify()
            .withf(|to, m| to.as_str() == "peer" && m == release("bad"))
            .times(1)
            .returning(|_, _| Ok(()));
        a.expect_poll().with(eq(XferId(1))).returning(|_| Ok(XferState::Done));
        a.expect_poll().with(eq(XferId(2))).returning(|_| Ok(XferState::Failed(link_down())));
        // The third READ never completes: never reported, never polled.
        report_completions(a, posts.clone(), &[3]);
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("ok", vec![1], vec![1]), recv("bad", vec![2], vec![2])]);
    w.start_load_kv(now, &meta(vec![recv("slow", vec![3], vec![3])]));
    let mut f = w.get_finished(now + Duration::from_millis(5));
    assert!(f.recving.is_empty(), "a READ done is not a load done: the prefill engine confirms");
    answer_handshakes(&mut w, now, 1);
    inbox.lock().unwrap().push(answer(&posts, "ok", true));
    let f2 = w.get_finished(now + Duration::from_millis(7));
    assert_eq!(f2.recving, vec![RequestId::new("ok")]);
    f.extend(f2);
    assert_eq!(f.failed_recving.len(), 1);
    assert_eq!(f.failed_recving[0].request_id, "bad".into());
    assert_eq!(f.failed_recving[0].error, link_down(), "the transfer's own error, kind and backend kept");
    assert_eq!(w.num_in_flight(), 1, "the worker goes on with the others");
    assert_eq!(
        w.stats().read_latencies.kept(),
        [Duration::from_millis(5)],
        "READ seen done at the 5 ms step"
    );
    assert_eq!(w.stats().transfer_latencies.kept(), [Duration::from_millis(7)], "confirmed at the 7 ms step");
    assert_eq!(w.stats().post_waits.kept(), [Duration::ZERO], "posted in the step that admitted it");
    assert_eq!(w.stats().confirm_waits.kept(), [Duration::from_millis(2)]);
    assert_eq!(w.stats().bytes_read, 4 * u64::from(BS) * 2);
    // The stages of the completed load, once.
    let ms = |n| now + Duration::from_millis(n);
    let ok =
        LoadTimes { request_id: "ok".into(), admitted: now, posted: now, read_done: ms(5), confirmed: ms(7) };
    assert_eq!(w.take_load_times(), vec![ok]);
    assert!(w.take_load_times().is_empty());
    // The confirmed READ, once, as NixlConnector records a transfer; the failed one is not.
    let read =
        TransferRecord { duration: Duration::from_millis(5), bytes: 4 * u64::from(BS) * 2, descriptors: 4 };
    assert_eq!(w.take_transfers(), vec![read]);
    assert!(w.take_transfers().is_empty());
}

#[test]
fn a_failed_handshake_fails_exactly_the_waiting_requests_and_is_retried() {
    let posts = Arc::new(Mutex::new(vec![]));
    let mut w = worker_with(agent(posts.clone(), |_| {}), 0, &[None, None]);
    let now = Instant::now();
    w.start_load_kv(now, &meta(vec![recv("a", vec![1], vec![1]), recv("b", vec![2], vec![2])]));
    w.poll_command();
    w.handle_handshake(now, &"prefill".into(), 0, Err(Error::new(ErrorKind::Io, "connection refused")));
    let f = w.get_finished(now);
    let failed: Vec<_> = f.failed_recving.iter().map(|f| f.request_id.as_str()).collect();
    assert_eq!(failed, ["a", "b"]);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Io);
    assert!(f.failed_recving[0].error.message().ends_with("connection refused"), "{:?}", f.failed_recving[0]);
    // The next request handshakes again and succeeds.
    start_and_handshake(&mut w, now, vec![recv("c", vec![3], vec![3])]);
    assert_eq!(posts.lock().unwrap().len(), 1);
    assert_eq!(w.stats().handshake_failures, 1);
}

#[test]
fn a_failed_handshake_says_so_once() {
    let mut w = worker_with(agent(Arc::default(), |_| {}), 0, &[None, None]);
    let now = Instant::now();
    for (n, cause) in [
        Error::new(ErrorKind::Handshake, "connecting to h:5600: refused"),
        Error::new(ErrorKind::Wire, "decode envelope: bad"),
    ]
    .into_iter()
    .enumerate()
    {
        w.start_load_kv(now, &meta(vec![recv(&format!("r{n}"), vec![1], vec![1])]));
        w.poll_command();
        w.handle_handshake(now, &"prefill".into(), 0, Err(cause));
        let error = w.get_finished(now).failed_recving.remove(0).error;
        assert_eq!(error.kind(), ErrorKind::Handshake, "{error}");
        let reason = error.to_string();
        assert!(reason.starts_with("handshake failed: with engine prefill rank 0: "), "{reason}");
        assert_eq!(reason.matches("handshake failed").count(), 1, "{reason}");
    }
}

#[test]
fn a_handshake_that_never_answers_times_out() {
    let mut w = worker_with(agent(Arc::default(), |_| {}), 0, &[None, None]);
    let now = Instant::now();
    w.start_load_kv(now, &meta(vec![recv("a", vec![1], vec![1])]));
    assert!(w.get_finished(now + Duration::from_secs(4)).is_empty());
    assert_eq!(w.next_deadline(), Some(now + Duration::from_secs(5)));
    let f = w.get_finished(now + Duration::from_secs(5));
    assert_eq!(f.failed_recving.len(), 1);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Timeout, "{:?}", f.failed_recving[0]);
    // A result arriving after the timeout is ignored.
    w.handle_handshake(now, &"prefill".into(), 0, Ok(peer_payload(0, &[None, None], |_| {})));
    assert!(w.is_idle());
}

#[test]
fn bad_peer_inputs_fail_the_request_and_transfer_nothing() {
    let cases: Vec<(&str, RecvRequest)> = vec![
        ("remote id past the remote pool", recv("r", vec![1], vec![16])),
        ("local id past the local pool", recv("r", vec![8], vec![1])),
        ("more local than remote blocks", recv("r", vec![1, 2], vec![1])),
        (
            "read window past the offer",
            RecvRequest { local_block_ids: at(1, vec![1]), ..recv("r", vec![1], vec![1]) },
        ),
        (
            "read window overflows",
            RecvRequest { local_block_ids: at(u32::MAX, vec![1]), ..recv("r", vec![1], vec![1]) },
        ),
        (
            "read before the offer",
            RecvRequest { remote_block_ids: at(1, vec![1]), ..recv("r", vec![1], vec![1]) },
        ),
        (
            "more groups to load than offered",
            RecvRequest {
                local_block_ids: vec![GroupBlocks::whole(vec![1]), GroupBlocks::whole(vec![2])],
                ..recv("r", vec![1], vec![1])
            },
        ),
        (
            "a block loaded twice across groups",
            RecvRequest {
                local_block_ids: vec![GroupBlocks::whole(vec![1]), GroupBlocks::whole(vec![1])],
                remote_block_ids: vec![GroupBlocks::whole(vec![1]), GroupBlocks::whole(vec![2])],
                ..recv("r", vec![1], vec![1])
            },
        ),
        ("no nonce: not a kvx offer", RecvRequest { nonce: None, ..recv("r", vec![1], vec![1]) }),
        ("notify-only without a nonce", RecvRequest { nonce: None, ..recv("r", vec![], vec![1]) }),
        (
            "a 10 MB request id",
            RecvRequest {
                remote_request_id: Some("x".repeat(10 << 20).into()),
                ..recv("r", vec![1], vec![1])
            },
        ),
        (
            "a 10 MB engine id",
            RecvRequest {
                remote: RemoteCoordinates::at("e".repeat(10 << 20), "h", 1),
                ..recv("r", vec![1], vec![1])
            },
        ),
        (
            "a 10 MB host",
            RecvRequest {
                remote: RemoteCoordinates::at("prefill", "h".repeat(10 << 20), 1),
                ..recv("r", vec![1], vec![1])
            },
        ),
        ("duplicate local block", recv("r", vec![1, 1], vec![1, 2])),
        (
            "our own engine id",
            RecvRequest { remote: RemoteCoordinates::at("decode", "h", 1), ..recv("r", vec![1], vec![1]) },
        ),
        (
            "port overflow",
            RecvRequest {
                remote: RemoteCoordinates::at("prefill", "h", u16::MAX),
                ..recv("r", vec![1], vec![1])
            },
        ),
    ];
    for (what, req) in cases {
        let posts = Arc::new(Mutex::new(vec![]));
        let mut w = worker_with(agent(posts.clone(), |_| {}), 1, &[None, None]);
        w.start_load_kv(Instant::now(), &meta(vec![req]));
        if w.poll_command().is_some() {
            w.handle_handshake(
                Instant::now(),
                &"prefill".into(),
                1,
                Ok(peer_payload(1, &[None, None], |_| {})),
            );
        }
        let f = w.get_finished(Instant::now());
        assert_eq!(f.failed_recving.len(), 1, "{what}");
        assert!(f.failed_recving[0].error.message().len() < 2048, "{what}: a short reason");
        assert!(posts.lock().unwrap().is_empty(), "{what}: nothing may be posted");
    }
}

#[test]
fn bad_handshake_payloads_are_refused() {
    let (layout, _) = KvCacheLayout::detect(&caches(&[None, None]), BS).unwrap();
    let cases: Vec<(&str, Vec<u8>, ErrorKind)> = vec![
        ("garbage", b"not a payload".to_vec(), ErrorKind::Handshake),
        ("other engine", peer_payload(0, &[None, None], |p| p.engine_id = "x".into()), ErrorKind::Handshake),
        ("other rank", peer_payload(1, &[None, None], |_| {}), ErrorKind::Handshake),
        (
            "a TP size the heads do not split over",
            peer_payload(0, &[None, None], |p| p.world_size = 3),
            ErrorKind::Incompatible,
        ),
        ("other model heads", peer_payload(0, &[None, None], |p| p.kv_heads = 4), ErrorKind::Incompatible),
        ("other layout", peer_payload(0, &[None, None], |p| p.compat_hash ^= 1), ErrorKind::Incompatible),
        (
            "other block length",
            peer_payload(0, &[None, None], |p| p.block_len = layout.block_len * 2),
            ErrorKind::Incompatible,
        ),
        (
            "missing regions",
            peer_payload(0, &[None, None], |p| p.region_bases.pop().map(drop).unwrap_or(())),
            ErrorKind::Handshake,
        ),
        ("empty pool", peer_payload(0, &[None, None], |p| p.num_blocks = 0), ErrorKind::Handshake),
        (
            "a pool past u32 descriptor ids",
            peer_payload(0, &[None, None], |p| p.num_blocks = u32::MAX / 2),
            ErrorKind::Handshake,
        ),
    ];
    for (what, payload, kind) in cases {
        let posts = Arc::new(Mutex::new(vec![]));
        let mut w = worker_with(agent(posts.clone(), |_| {}), 0, &[None, None]);
        w.start_load_kv(Instant::now(), &meta(vec![recv("r", vec![1], vec![1])]));
        w.poll_command();
        w.handle_handshake(Instant::now(), &"prefill".into(), 0, Ok(payload));
        let f = w.get_finished(Instant::now());
        assert_eq!(f.failed_recving.len(), 1, "{what}");
        assert_eq!(f.failed_recving[0].error.kind(), kind, "{what}: {}", f.failed_recving[0].error);
        assert!(posts.lock().unwrap().is_empty(), "{what}");
        assert_eq!(w.stats().handshake_failures, 1, "{what}");
    }
}

#[test]
fn a_restarted_peer_with_the_same_agent_name_is_reloaded() {
    let loads = Arc::new(Mutex::new(0));
    let l = loads.clone();
    let a = {
        let mut a = MockTransferAgent::new();
        a.expect_load_remote().returning(move |_| {
            let mut n = l.lock().unwrap();
            *n += 1;
            if *n == 1 {
                Err(Error::new(ErrorKind::State, "already loaded"))
            } else {
                Ok(AgentName::new("peer"))
            }
        });
        a.expect_forget_remote().with(eq(AgentName::new("peer"))).times(1).returning(|_| Ok(()));
        agent(Arc::default(), |m| *m = std::mem::replace(&mut a, MockTransferAgent::new()))
    };
    let mut w = worker_with(a, 0, &[None, None]);
    start_and_handshake(&mut w, Instant::now(), vec![recv("a", vec![1], vec![1])]);
    assert_eq!(*loads.lock().unwrap(), 2);
    assert_eq!(w.stats().handshakes, 1);
}

fn notif(msg: &[u8]) -> Notification {
    Notification { from: "peer".into(), msg: msg.to_vec() }
}

fn held(ids: &[&str]) -> Vec<HeldRequest> {
    ids.iter().map(|s| HeldRequest { request_id: RequestId::new(*s), nonce: nonce_of(s) }).collect()
}

/// A prefill worker whose agent delivers what is pushed on the returned queue.
fn prefill_worker(config: WorkerConfig) -> (ConnectorWorker, Arc<Mutex<Vec<Notification>>>) {
    let queue: Arc<Mutex<Vec<Notification>>> = Arc::default();
    let q = queue.clone();
    let mut a = MockTransferAgent::new();
    a.expect_drain_notifications().returning(move |out| {
        out.append(&mut q.lock().unwrap());
        Ok(())
    });
    let a = agent(Arc::default(), |m| *m = std::mem::replace(&mut a, MockTransferAgent::new()));
    let mut w = ConnectorWorker::new(config, Arc::new(a)).unwrap();
    w.register_kv_caches(&caches(&[None, None])).unwrap();
    (w, queue)
}

#[test]
fn a_forged_or_replayed_release_frees_no_hold() {
    let (mut w, queue) = prefill_worker(config(0));
    let now = Instant::now();
    let send = |ids: &[&str]| ConnectorMetadata { reqs_to_send: held(ids), ..Default::default() };
    let forged = |id: &str| {
        let nonce = crate::auth::HexBytes([0xee; 16]);
        notif(
            &wire::encode(&HoldRelease {
                request_id: id.into(),
                nonce,
                reply_to: None,
                reader: 0,
                readers: 1,
            })
            .unwrap(),
        )
    };
    w.start_load_kv(now, &send(&["victim"]));
    // Another client names the victim's request id: without its nonce, nothing is freed.
    queue.lock().unwrap().push(forged("victim"));
    assert!(w.get_finished(now).sending.is_empty());
    assert_eq!(w.stats().rejected_notifications, 1);
    // The victim's real reader frees it.
    queue.lock().unwrap().push(notif(&release("victim")));
    assert_eq!(w.get_finished(now).sending, vec![RequestId::new("victim")]);
    // Replayed after the hold ended, it waits (bounded) and frees no later hold of that id.
    queue.lock().unwrap().push(notif(&release("victim")));
    assert!(w.get_finished(now).is_empty());
    let again = ConnectorMetadata {
        reqs_to_send: vec![HeldRequest { request_id: "victim".into(), nonce: nonce_of("second hold") }],
        ..Default::default()
    };
    w.start_load_kv(now, &again);
    assert!(w.get_finished(now).sending.is_empty(), "the replay does not free the new hold");
    // A forged release that comes before its hold does not free it either.
    queue.lock().unwrap().push(forged("later"));
    w.get_finished(now);
    w.start_load_kv(now, &send(&["later"]));
    assert!(w.get_finished(now).sending.is_empty());
    assert_eq!(w.stats().notifications, 1);
}

#[test]
fn a_flood_of_releases_for_unknown_holds_costs_bounded_state() {
    let config = WorkerConfig { early_releases_per_sender: 64, ..config(0) };
    let (mut w, queue) = prefill_worker(config);
    let now = Instant::now();
    w.start_load_kv(now, &ConnectorMetadata { reqs_to_send: held(&["real"]), ..Default::default() });
    for round in 0..20 {
        let flood: Vec<_> = (0..1000).map(|i| notif(&release(&format!("ghost-{round}-{i}")))).collect();
        queue.lock().unwrap().extend(flood);
        assert!(w.get_finished(now).is_empty());
        assert!(w.holds.early_len().0 <= 64);
    }
    assert_eq!(w.stats().stray_notifications, 20_000 - 64);
    // The real release still finds its hold, and the rest expire.
    queue.lock().unwrap().push(notif(&release("real")));
    assert_eq!(w.get_finished(now).sending, vec![RequestId::new("real")]);
    assert!(w.next_deadline().is_some());
    w.get_finished(now + w.config().early_release_ttl);
    assert_eq!((w.holds.early_len(), w.stats().stray_notifications), ((0, 0), 20_000));
    assert_eq!(w.stats().early_notifications_dropped, 20_000 - 64, "expired releases were not dropped");
}

#[test]
fn a_flooding_sender_pushes_out_only_its_own_early_releases() {
    let (mut w, inbox, sent) = answering_prefill(config(0));
    let now = Instant::now();
    let cap = w.config().early_releases_per_sender as u64;
    // The decode worker's READ finished before the prefill worker saw the hold: its release,
    // asking for an answer, comes early; then another sender floods releases for holds that
    // never come.
    let from = |agent: &str, n: Notification| Notification { from: agent.into(), ..n };
    inbox.lock().unwrap().push(from("decode-agent", release_asking("real", 7)));
    for chunk in 0..100 {
        let flood = (0..1000).map(|i| from("mallory", notif(&release(&format!("ghost-{chunk}-{i}")))));
        inbox.lock().unwrap().extend(flood);
        assert!(w.get_finished(now).is_empty());
        assert!(w.holds.early_len().0 <= cap + 1, "{:?}", w.holds.early_len());
    }
    assert_eq!(w.holds.early_len(), (cap + 1, 2), "the flood at its cap, the real release kept");
    assert_eq!(w.stats().early_notifications_dropped, 100_000 - cap);
    // The hold comes: the real release frees it and is answered "held", so its load completes.
    w.start_load_kv(now, &ConnectorMetadata { reqs_to_send: held(&["real"]), ..Default::default() });
    assert_eq!(w.get_finished(now).sending, vec![RequestId::new("real")]);
    assert!(
        matches!(w.poll_command(), Some(WorkerCommand::FetchHandshake(l)) if l.engine_id.as_str() == "decode")
    );
    w.handle_handshake(now, &"decode".into(), 0, Ok(decode_payload(7)));
    assert_eq!(answers(&sent), [("real".to_owned(), true)]);
    assert_eq!(w.holds.early_len(), (cap, 1));
}

#[test]
fn with_a_key_only_signed_offers_are_read_and_nothing_else_touches_the_network() {
    let key = AuthKey::new("the deployment's secret").unwrap();
    let signed = |mut r: RecvRequest| {
        r.mac = Some(r.offer().unwrap().tag(&key));
        r
    };
    // An offer that names every field the MAC covers: what a prefill engine of 2 ranks, at its
    // instance 1, hands out.
    let offer = || {
        signed(RecvRequest {
            remote_instance: Some(crate::auth::HexBytes(1u64.to_le_bytes())),
            remote_tp_size: Some(2),
            ..recv("a", vec![1], vec![2, 3])
        })
    };
    // Every field of the offer that steers the connection or what is read, edited after signing.
    let edited = |edit: &dyn Fn(&mut RecvRequest)| {
        let mut r = offer();
        edit(&mut r);
        r
    };
    let cases = [
        ("unsigned", RecvRequest { mac: None, ..offer() }),
        ("signed by another key", {
            let mut r = offer();
            r.mac = Some(r.offer().unwrap().tag(&AuthKey::new("some other deployment").unwrap()));
            r
        }),
        ("another engine", edited(&|r| r.remote.engine_id = "prefill-2".into())),
        ("another host", edited(&|r| r.remote.endpoint = Some(Endpoint::new("evil", 5600)))),
        ("another port", edited(&|r| r.remote.endpoint = Some(Endpoint::new("h", 5601)))),
        ("found by id instead", edited(&|r| r.remote.endpoint = None)),
        ("another TP size", edited(&|r| r.remote_tp_size = Some(4))),
        ("no TP size", edited(&|r| r.remote_tp_size = None)),
        ("another request's id", edited(&|r| r.remote_request_id = Some("b".into()))),
        ("another request's blocks", edited(&|r| r.remote_block_ids = at(0, vec![5, 3]))),
        ("the blocks at other positions", edited(&|r| r.remote_block_ids = at(1, vec![2, 3]))),
        ("the blocks split into two groups", {
            edited(&|r| r.remote_block_ids = vec![GroupBlocks::whole(vec![2]), GroupBlocks::whole(vec![3])])
        }),
        ("another nonce", edited(&|r| r.nonce = Some(nonce_of("b")))),
        ("another instance", edited(&|r| r.remote_instance = Some(crate::auth::HexBytes([2; 8])))),
        ("no instance", edited(&|r| r.remote_instance = None)),
        ("notify-only, unsigned", recv("n", vec![], vec![1])),
    ];
    for (what, req) in cases {
        let posts = Arc::new(Mutex::new(vec![]));
        let config = WorkerConfig { auth_key: Some(key.clone()), ..config(0) };
        let mut w = ConnectorWorker::new(config, Arc::new(agent(posts.clone(), |_| {}))).unwrap();
        w.register_kv_caches(&caches(&[None, None])).unwrap();
        w.start_load_kv(Instant::now(), &meta(vec![req]));
        assert_eq!(w.poll_command(), None, "{what}: no handshake with the named host");
        let f = w.get_finished(Instant::now());
        assert_eq!(f.failed_recving.len(), 1, "{what}");
        assert_eq!(
            f.failed_recving[0].error.kind(),
            ErrorKind::Unauthenticated,
            "{what}: {}",
            f.failed_recving[0].error
        );
        assert_eq!((w.poll_command(), posts.lock().unwrap().len()), (None, 0), "{what}: nothing sent");
    }
    let posts = Arc::new(Mutex::new(vec![]));
    let config = WorkerConfig { auth_key: Some(key.clone()), ..config(0) };
    let mut w = ConnectorWorker::new(config, Arc::new(agent(posts.clone(), |_| {}))).unwrap();
    w.register_kv_caches(&caches(&[None, None])).unwrap();
    start_and_handshake(&mut w, Instant::now(), vec![offer()]);
    assert_eq!(posts.lock().unwrap().len(), 1, "a signed offer is read");
}

#[test]
fn holds_end_on_notification_or_expiry() {
    let (mut w, queue) = prefill_worker(config(0));
    queue.lock().unwrap().extend([
        notif(&release("early")),
        notif(&release("held")),
        notif(b"\xff\xfe"),
        notif(&release("held")),
    ]);
    let now = Instant::now();
    let send = |ids: &[&str]| ConnectorMetadata { reqs_to_send: held(ids), ..Default::default() };
    w.start_load_kv(now, &send(&["held", "forgotten"]));
    let f = w.get_finished(now);
    assert_eq!(f.sending, vec![RequestId::new("held")]);
    // The early notification completes its hold as soon as the hold arrives.
    w.start_load_kv(now, &send(&["early"]));
    assert_eq!(w.get_finished(now).sending, vec![RequestId::new("early")]);
    // A hold no reader claims is released when its lease runs out.
    assert!(w.get_finished(now + Duration::from_secs(29)).is_empty());
    assert_eq!(w.get_finished(now + Duration::from_secs(30)).sending, vec![RequestId::new("forgotten")]);
    let s = w.stats();
    assert_eq!((s.notifications, s.stray_notifications, s.expired_holds), (2, 2, 1));
    assert!(w.is_idle());
}

#[test]
fn loads_before_registration_fail() {
    let mut w = ConnectorWorker::new(config(0), Arc::new(agent(Arc::default(), |_| {}))).unwrap();
    w.start_load_kv(Instant::now(), &meta(vec![recv("a", vec![1], vec![1])]));
    assert_eq!(w.get_finished(Instant::now()).failed_recving.len(), 1);
}

#[test]
fn rank0_reports_an_id_once_every_rank_has_it() {
    let mut agg = FinishedAggregator::new(2);
    let r = |recving: &[&str], sending: &[&str], failed: &[&str]| Finished {
        recving: recving.iter().map(|s| RequestId::new(*s)).collect(),
        sending: sending.iter().map(|s| RequestId::new(*s)).collect(),
        failed_recving: failed
            .iter()
            .map(|s| FailedRecv { request_id: RequestId::new(*s), error: link_down() })
            .collect(),
    };
    let now = Instant::now();
    let ranked =
        |reports: [Finished; 2]| (0..).zip(reports).map(|(rank, finished)| RankReport { rank, finished });
    let out = agg.aggregate(now, ranked([r(&["a", "b"], &["s"], &[]), r(&["a"], &[], &["b"])]));
    assert_eq!(out.recving, vec![RequestId::new("a")]);
    assert_eq!(out.failed_recving, vec![FailedRecv { request_id: "b".into(), error: link_down() }]);
    assert!(out.sending.is_empty());
    assert_eq!(agg.num_partial(), 1);
    let out = agg.aggregate(now, ranked([r(&[], &[], &[]), r(&[], &["s"], &[])]));
    assert_eq!(out.sending, vec![RequestId::new("s")]);
    assert_eq!(agg.num_partial(), 0);
}

#[test]
fn the_same_request_twice_while_its_handshake_runs_loads_once() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().returning(|_| Ok(XferState::Done));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    w.start_load_kv(now, &meta(vec![recv("a", vec![1], vec![1])]));
    w.start_load_kv(now, &meta(vec![recv("a", vec![2], vec![2])]));
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving.len(), 1, "the second is refused");
    while let Some(WorkerCommand::FetchHandshake(PeerLocator { engine_id, .. })) = w.poll_command() {
        w.handle_handshake(now, &engine_id, 0, Ok(peer_payload(0, &[None, None], |_| {})));
    }
    assert_eq!(posts.lock().unwrap().len(), 1, "one READ");
    inbox.lock().unwrap().push(answer(&posts, "a", true));
    assert_eq!(w.get_finished(now).recving, vec![RequestId::new("a")]);
    assert!(w.is_idle(), "nothing left in flight unpolled");
}

#[test]
fn an_id_a_report_names_twice_counts_once_for_its_rank() {
    let mut agg = FinishedAggregator::new(2);
    let twice = |id: &str| Finished {
        sending: vec![RequestId::new(id), RequestId::new(id)],
        recving: vec![RequestId::new("r"), RequestId::new("r")],
        ..Default::default()
    };
    let now = Instant::now();
    let rank = |rank| RankReport { rank, finished: twice("s") };
    assert!(agg.aggregate(now, [rank(0)]).is_empty(), "one rank of two has reported");
    assert!(agg.aggregate(now, [rank(0)]).is_empty(), "the same rank again");
    let out = agg.aggregate(now, [rank(1)]);
    assert_eq!((out.sending, out.recving), (vec![RequestId::new("s")], vec![RequestId::new("r")]));
}

/// A release from decode worker `instance` that asks for an answer.
fn release_asking(id: &str, instance: u64) -> Notification {
    let reply_to = Some(ReplyTo {
        engine: decode_side_channel(),
        rank: 0,
        instance,
        token: crate::auth::HexBytes([9; 16]),
    });
    notif(
        &wire::encode(&HoldRelease {
            request_id: id.into(),
            nonce: nonce_of(id),
            reply_to,
            reader: 0,
            readers: 1,
        })
        .unwrap(),
    )
}

/// The answers a prefill worker sent: what `notify` carried to the decode agent.
fn answers(sent: &Arc<Mutex<Vec<Vec<u8>>>>) -> Vec<(String, bool)> {
    sent.lock()
        .unwrap()
        .iter()
        .filter_map(|m| wire::decode::<HoldStatus>(m).ok())
        .map(|s| (s.request_id.as_str().to_owned(), s.held))
        .collect()
}

/// A prefill worker whose notifications (answers) are recorded.
fn answering_prefill(config: WorkerConfig) -> (ConnectorWorker, Inbox, Arc<Mutex<Vec<Vec<u8>>>>) {
    let sent: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let inbox = Inbox::default();
    let s = sent.clone();
    let a = agent_with_inbox(Arc::default(), inbox.clone(), move |a| {
        let s = s.clone();
        a.expect_notify().returning(move |_, m| {
            s.lock().unwrap().push(m.to_vec());
            Ok(())
        });
    });
    let mut w =
        ConnectorWorker::new(WorkerConfig { engine_id: "prefill".into(), ..config }, Arc::new(a)).unwrap();
    w.register_kv_caches(&caches(&[None, None])).unwrap();
    (w, inbox, sent)
}

/// The payload of the decode worker the prefill worker answers.
fn decode_payload(instance: u64) -> Vec<u8> {
    peer_payload(0, &[None, None], |p| {
        p.engine_id = "decode".into();
        p.instance = instance;
    })
}

#[test]
fn a_release_is_answered_held_only_while_the_lease_lives() {
    let (mut w, inbox, sent) = answering_prefill(config(0));
    let now = Instant::now();
    w.start_load_kv(now, &ConnectorMetadata { reqs_to_send: held(&["live", "late"]), ..Default::default() });
    inbox.lock().unwrap().push(release_asking("live", 7));
    assert_eq!(w.get_finished(now).sending, vec![RequestId::new("live")]);
    // The answer goes to the decode engine's side channel: handshake first, then notify.
    assert_eq!(
        w.poll_command(),
        Some(WorkerCommand::FetchHandshake(PeerLocator {
            engine_id: "decode".into(),
            rank: 0,
            endpoint: Some(Endpoint::new("d", 5700)),
        }))
    );
    w.handle_handshake(now, &"decode".into(), 0, Ok(decode_payload(7)));
    assert_eq!(answers(&sent), [("live".to_owned(), true)]);
    // "late"'s lease runs out; its READ's release comes after: answered "not held" at once.
    let lease = w.config().lease_duration;
    assert_eq!(w.get_finished(now + lease).sending, vec![RequestId::new("late")]);
    // Replays of that release (anyone who saw the params can send them) are answered once.
    inbox.lock().unwrap().extend([
        release_asking("late", 7),
        release_asking("late", 7),
        release_asking("late", 9),
    ]);
    assert!(w.get_finished(now + lease).is_empty());
    assert_eq!(answers(&sent), [("live".to_owned(), true), ("late".to_owned(), false)]);
    // A release from a restarted decode engine (a new instance): handshaken again first.
    w.start_load_kv(now + lease, &ConnectorMetadata { reqs_to_send: held(&["next"]), ..Default::default() });
    inbox.lock().unwrap().push(release_asking("next", 8));
    w.get_finished(now + lease);
    assert!(matches!(w.poll_command(), Some(WorkerCommand::FetchHandshake(_))));
    w.handle_handshake(now + lease, &"decode".into(), 0, Ok(decode_payload(8)));
    assert_eq!(answers(&sent).last(), Some(&("next".to_owned(), true)));
    let s = w.stats();
    assert_eq!((s.hold_answers, s.expired_holds, s.peer_restarts), (3, 1, 1));
}

#[test]
fn heartbeats_with_the_right_nonce_extend_a_lease() {
    let (mut w, inbox, _) = answering_prefill(config(0));
    let now = Instant::now();
    let lease = w.config().lease_duration;
    w.start_load_kv(now, &ConnectorMetadata { reqs_to_send: held(&["a", "b"]), ..Default::default() });
    let renew = |holds: Vec<HeldRequest>| notif(&wire::encode(&RenewLeases { holds }).unwrap());
    let forged = vec![HeldRequest { request_id: "b".into(), nonce: nonce_of("not b") }];
    let at = now + lease / 2;
    inbox.lock().unwrap().extend([renew(held(&["a"])), renew(forged)]);
    assert!(w.get_finished(at).is_empty());
    assert_eq!(
        w.get_finished(now + lease).sending,
        vec![RequestId::new("b")],
        "a wrong nonce renews nothing"
    );
    assert!(w.get_finished(at + lease - Duration::from_millis(1)).is_empty());
    assert_eq!(w.get_finished(at + lease).sending, vec![RequestId::new("a")]);
    assert_eq!(w.stats().leases_renewed, 1);
}

#[test]
fn a_load_without_an_answer_fails_and_its_engine_is_handshaken_again() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().returning(|_| Ok(XferState::Done));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    assert!(w.get_finished(now).is_empty());
    let timeout = w.config().confirm_timeout;
    assert_eq!(w.next_deadline(), Some(now + timeout));
    // An answer for another nonce, or "not held", never completes it.
    inbox.lock().unwrap().push(answer(&posts, "other", true));
    assert!(w.get_finished(now).is_empty());
    let f = w.get_finished(now + timeout);
    assert_eq!(f.failed_recving.len(), 1);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Timeout, "{:?}", f.failed_recving[0]);
    assert_eq!(w.stats().lease_failures, 1);
    // A "not held" answer fails a load with the lease's error.
    start_and_handshake(&mut w, now, vec![recv("b", vec![2], vec![2])]);
    inbox.lock().unwrap().push(answer(&posts, "b", false));
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Expired, "{:?}", f.failed_recving[0]);
    assert_eq!((w.stats().lease_failures, w.stats().bytes_read), (2, 0));
}

#[test]
fn heartbeats_go_to_the_matching_rank_in_small_messages() {
    let posts = Arc::new(Mutex::new(vec![]));
    let sent: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let s = sent.clone();
    let a = agent(posts, move |a| {
        let s = s.clone();
        a.expect_notify().returning(move |_, m| {
            s.lock().unwrap().push(m.to_vec());
            Ok(())
        });
    });
    let mut w = worker_with(a, 1, &[None, None]);
    let now = Instant::now();
    let ids: Vec<String> = (0..300).map(|i| format!("r{i}")).collect();
    let holds = held(&ids.iter().map(String::as_str).collect::<Vec<_>>());
    let beat = Heartbeat { remote: recv("x", vec![], vec![]).remote, remote_tp_size: None, holds };
    w.start_load_kv(now, &ConnectorMetadata { heartbeats: vec![beat], ..Default::default() });
    assert!(matches!(
        w.poll_command(),
        Some(WorkerCommand::FetchHandshake(PeerLocator { endpoint: Some(Endpoint { port: 5601, .. }), .. }))
    ));
    w.handle_handshake(now, &"prefill".into(), 1, Ok(peer_payload(1, &[None, None], |_| {})));
    let renewed: Vec<usize> =
        sent.lock().unwrap().iter().map(|m| wire::decode::<RenewLeases>(m).unwrap().holds.len()).collect();
    assert_eq!(renewed, [128, 128, 44]);
    assert_eq!(w.stats().renewals_sent, 300);
}

/// A load of an offer made by prefill instance `instance`.
fn recv_from(id: &str, local: Vec<BlockId>, remote: Vec<BlockId>, instance: u64) -> RecvRequest {
    RecvRequest {
        remote_instance: Some(crate::auth::HexBytes(instance.to_le_bytes())),
        ..recv(id, local, remote)
    }
}

#[test]
fn an_offer_of_another_instance_is_never_read_through_the_old_connection() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().returning(|_| Ok(XferState::Done));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    // Connected to instance 1; a load of instance 1's offer is waiting for its answer.
    start_and_handshake(&mut w, now, vec![recv_from("old", vec![1], vec![1], 1)]);
    assert!(w.get_finished(now).is_empty());
    // An offer of instance 2 (the engine restarted): handshake again before reading.
    w.start_load_kv(now, &meta(vec![recv_from("new", vec![2], vec![2], 2)]));
    assert_eq!(posts.lock().unwrap().len(), 1, "not read through the connection to instance 1");
    answer_handshakes(&mut w, now, 2);
    assert_eq!(posts.lock().unwrap().len(), 2, "read from instance 2");
    // Instance 1 will never answer: its load fails at once, not at its confirmation timeout.
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving.len(), 1);
    assert_eq!(f.failed_recving[0].request_id, "old".into());
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Expired, "{:?}", f.failed_recving[0]);
    // An offer of an instance that is gone: one more handshake, then it fails unread.
    w.start_load_kv(now, &meta(vec![recv_from("gone", vec![3], vec![3], 1)]));
    answer_handshakes(&mut w, now, 2);
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving[0].request_id, "gone".into());
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Expired, "{:?}", f.failed_recving[0]);
    assert_eq!(posts.lock().unwrap().len(), 2);
    inbox.lock().unwrap().push(answer(&posts, "new", true));
    assert_eq!(w.get_finished(now).recving, vec![RequestId::new("new")]);
    assert_eq!(w.stats().peer_restarts, 1);
}

/// Loads waiting on one handshake are issued one by one; when one of them drops the peer again
/// (its offer names a newer instance), the others wait for the next handshake instead of failing.
#[test]
fn a_load_that_drops_its_peer_does_not_fail_the_others_waiting_on_the_handshake() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().returning(|_| Ok(XferState::Pending));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    let loads = vec![recv_from("newer", vec![1], vec![1], 2), recv("any", vec![2], vec![2])];
    w.start_load_kv(now, &meta(loads));
    // The first handshake finds instance 1 (the engine restarted since it made the offer).
    assert!(matches!(w.poll_command(), Some(WorkerCommand::FetchHandshake(_))));
    w.handle_handshake(now, &"prefill".into(), 0, Ok(peer_payload(0, &[None, None], |p| p.instance = 1)));
    let f = w.get_finished(now);
    assert!(
        f.failed_recving.is_empty(),
        "nothing fails while a handshake is pending: {:?}",
        f.failed_recving
    );
    assert!(posts.lock().unwrap().is_empty(), "nothing read through instance 1");
    answer_handshakes(&mut w, now, 2);
    assert!(w.get_finished(now).is_empty());
    assert_eq!(posts.lock().unwrap().len(), 2, "both read from instance 2");
    assert_eq!(w.num_in_flight(), 2);
}

#[test]
fn a_post_the_transport_refuses_is_retried_on_a_new_connection() {
    let mut a = MockTransferAgent::new();
    let mut refused = true;
    a.expect_post_blocks().times(1).returning(move |_, _, _, _, _| {
        assert!(std::mem::take(&mut refused));
        Err(Error::new(ErrorKind::Backend, "remote agent was disconnected"))
    });
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), move |m| {
        *m = std::mem::replace(&mut a, MockTransferAgent::new())
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    assert!(w.get_finished(now).is_empty(), "not failed: handshaking again");
    answer_handshakes(&mut w, now, 2);
    assert_eq!(posts.lock().unwrap().len(), 1, "posted to the new instance");
}

#[test]
fn only_the_answer_to_the_reads_own_release_confirms_it() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().returning(|_| Ok(XferState::Done));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    // Someone who knows the offer sent their own release (with a reply_to naming this engine)
    // while the READ ran: the prefill engine freed the hold and answered "held" to it. That answer
    // carries another token: it confirms nothing.
    let forged = HoldStatus {
        request_id: "a".into(),
        nonce: nonce_of("a"),
        held: true,
        token: crate::auth::HexBytes([7; 16]),
    };
    inbox.lock().unwrap().push(notif(&wire::encode(&forged).unwrap()));
    assert!(w.get_finished(now).is_empty());
    assert_eq!(w.stats().stray_notifications, 1);
    // The READ's own release finds the hold gone: "not held", and the load fails.
    inbox.lock().unwrap().push(answer(&posts, "a", false));
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Expired, "{:?}", f);
}

/// What a closing worker gave back to its agent, in the order it did.
type Calls = Arc<Mutex<Vec<String>>>;

fn record(calls: &Calls, what: String) -> Result<()> {
    calls.lock().unwrap().push(what);
    Ok(())
}

/// A mock agent whose registrations get ids 1, 2, ...; records every call that gives something
/// back (and every drain), and refuses to deregister registration `refuse` while `refusing`.
fn closing_agent(
    posts: Arc<Mutex<Vec<Posted>>>,
    calls: Calls,
    refusing: Arc<Mutex<Option<u64>>>,
) -> MockTransferAgent {
    agent(posts, move |a| {
        let next = Arc::new(Mutex::new(0u64));
        a.expect_register().returning(move |_| {
            let mut n = next.lock().unwrap();
            *n += 1;
            Ok(RegistrationId(*n))
        });
        // No transfer completes.
        a.expect_drain_completions().returning(|_| Ok(()));
        let c = calls.clone();
        let refused = refusing.clone();
        a.expect_deregister().returning(move |r| {
            if *refused.lock().unwrap() == Some(r.0) {
                return Err(Error::new(ErrorKind::State, "a transfer still uses it"));
            }
            record(&c, format!("deregister {}", r.0))
        });
        let c = calls.clone();
        a.expect_release_dlist().returning(move |d| record(&c, format!("release_dlist {}", d.0)));
        let c = calls.clone();
        a.expect_forget_remote().returning(move |p| record(&c, format!("forget_remote {p}")));
        let c = calls.clone();
        a.expect_release().returning(move |x| record(&c, format!("release {}", x.0)));
        let c = calls.clone();
        a.expect_notify().returning(move |p, m| {
            let r: HoldRelease = wire::decode(m).unwrap();
            record(&c, format!("notify {p} {} {}", r.request_id, r.reply_to.is_some()))
        });
        let c = calls.clone();
        a.expect_drain_notifications().returning(move |_| record(&c, "drain".into()));
    })
}

#[test]
fn close_gives_back_every_registration_list_and_peer_and_refuses_work() {
    let posts = Arc::new(Mutex::new(vec![]));
    let calls = Calls::default();
    let mut w = worker_with(closing_agent(posts.clone(), calls.clone(), Arc::default()), 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    w.start_load_kv(now, &ConnectorMetadata { reqs_to_send: held(&["h"]), ..Default::default() });
    assert!(w.get_finished(now).is_empty(), "the READ runs and the hold lives");
    assert_eq!(posts.lock().unwrap().len(), 1);
    calls.lock().unwrap().clear();

    w.close().unwrap();
    assert!(w.is_closed());
    // The READ is cancelled and the prefill engine told to free at once (no answer wanted); the
    // peer's list before the peer, the local list before the memory under it.
    assert_eq!(
        *calls.lock().unwrap(),
        [
            "notify peer a false",
            "release 1",
            "release_dlist 200",
            "release_dlist 100",
            "forget_remote peer",
            "deregister 1",
            "deregister 2",
        ]
    );
    let f = w.get_finished(now);
    assert_eq!(f.sending, vec![RequestId::new("h")], "the hold ended");
    assert_eq!(f.failed_recving.len(), 1);
    assert_eq!(f.failed_recving[0].request_id, "a".into());
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::State, "{}", f.failed_recving[0].error);
    assert_eq!((w.num_in_flight(), w.handshake_payload(), w.layout()), (0, None, None));
    assert!(w.is_idle() && w.next_deadline().is_none());

    // Closed: nothing more reaches the agent, and work is refused with `State`.
    calls.lock().unwrap().clear();
    assert_eq!(w.register_kv_caches(&caches(&[None, None])).unwrap_err().kind(), ErrorKind::State);
    w.start_load_kv(
        now,
        &ConnectorMetadata {
            reqs_to_recv: vec![recv("b", vec![2], vec![2])],
            reqs_to_send: held(&["h2"]),
            ..Default::default()
        },
    );
    assert_eq!(w.poll_command(), None, "no handshake for a closed worker");
    let f = w.get_finished(now + Duration::from_secs(3600));
    assert_eq!(f.sending, vec![RequestId::new("h2")]);
    assert_eq!(f.failed_recving[0].request_id, "b".into());
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::State, "{}", f.failed_recving[0].error);
    w.handle_handshake(now, &"prefill".into(), 0, Ok(peer_payload(0, &[None, None], |_| {})));
    w.close().unwrap();
    assert!(calls.lock().unwrap().is_empty(), "closed: the agent was called: {:?}", calls.lock().unwrap());
}

#[test]
fn close_again_gives_back_what_the_agent_refused() {
    let calls = Calls::default();
    let refusing = Arc::new(Mutex::new(Some(2)));
    let mut w = worker_with(closing_agent(Arc::default(), calls.clone(), refusing.clone()), 0, &[None, None]);
    let now = Instant::now();
    // A connection dropped while its READ runs is kept (retired) until the READ ends: closing
    // forgets it too.
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    w.invalidate(&("prefill".into(), 0));
    calls.lock().unwrap().clear();

    let e = w.close().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::State, "{e}");
    assert!(e.to_string().contains("1 registrations"), "{e}");
    assert_eq!(
        *calls.lock().unwrap(),
        ["release 1", "release_dlist 200", "release_dlist 100", "forget_remote peer", "deregister 1"]
    );
    calls.lock().unwrap().clear();

    // Once the agent lets it go, closing again gives back only what it refused.
    *refusing.lock().unwrap() = None;
    w.close().unwrap();
    assert_eq!(*calls.lock().unwrap(), ["deregister 2"]);
}
