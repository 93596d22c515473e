//! The worker against a mockall agent, at the `TransferAgent` boundary: what is registered,
//! posted, notified and given back, and what is reported. The decode and prefill sides' logic on
//! its own is tested in `loads::tests` and `holds::tests`.
//!
//! - `reads`: registration, handshakes and the READs posted.
//! - `confirmations`: offers, instances, confirmations and heartbeats of loads.
//! - `holds`: the prefill side's releases and answers through the agent.
//! - `close`: what a closing worker gives back.

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
        instance: None,
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
        prompt: None,
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

/// A release from decode worker `instance` that asks for an answer.
fn release_asking(id: &str, instance: u64) -> Notification {
    release_naming(id, nonce_of(id), instance, None)
}

/// A release of the hold `id` with `nonce` from decode worker `instance` that asks for an answer
/// and names the prefill instance `prefill`.
fn release_naming(id: &str, nonce: Nonce, instance: u64, prefill: Option<u64>) -> Notification {
    let reply_to = Some(ReplyTo {
        engine: decode_side_channel(),
        rank: 0,
        instance,
        token: crate::auth::HexBytes([9; 16]),
    });
    notif(
        &wire::encode(&HoldRelease {
            request_id: id.into(),
            nonce,
            reply_to,
            reader: 0,
            readers: 1,
            instance: prefill,
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

/// A load of an offer made by prefill instance `instance`.
fn recv_from(id: &str, local: Vec<BlockId>, remote: Vec<BlockId>, instance: u64) -> RecvRequest {
    RecvRequest {
        remote_instance: Some(crate::auth::HexBytes(instance.to_le_bytes())),
        ..recv(id, local, remote)
    }
}

mod close;
mod confirmations;
mod holds;
mod reads;
