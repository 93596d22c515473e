//! Real workers and agents for the targets to feed: a prefill engine rank on a loopback fabric
//! (kept per thread, as its payload must name a live agent), and a fresh decode rank per run.

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::wire::{self, HandshakePayload};
use kvx_core::{
    AuthKey, ConnectorMetadata, ConnectorWorker, EngineId, Error, ErrorKind, Finished, HostMemory,
    LayerCache, Nonce, Notification, RecvRequest, RemoteCoordinates, RequestId, TransferAgent, WorkerCommand,
    WorkerConfig,
};
use kvx_loopback::{Fabric, LoopbackAgent};

/// Tokens per block.
pub(crate) const BS: u32 = 4;
/// Blocks of the decode rank's pool.
pub(crate) const DECODE_BLOCKS: u32 = 16;
/// Blocks of the prefill rank's pool (pools may differ between engines).
pub(crate) const PREFILL_BLOCKS: u32 = 32;
/// Two layers, the second with a 2-block window: descriptor ids take both paths.
const WINDOWS: [Option<u32>; 2] = [None, Some(2)];
/// The model tag both engines hash into their compatibility hash.
const MODEL: &str = "fuzz-model";
/// The engines.
pub(crate) const PREFILL: &str = "prefill";
pub(crate) const DECODE: &str = "decode";

/// The nonce of every hold the fixtures' prefill engine offers.
pub(crate) const NONCE: Nonce = kvx_core::HexBytes([0x5a; 16]);

/// The shared key of the targets' authenticated deployments.
pub(crate) fn auth_key() -> AuthKey {
    must(AuthKey::new("kvx-fuzz deployment key"), "an auth key")
}

/// A fixture step that cannot fail unless kvx itself is broken: a failure is a finding.
pub(crate) fn must<T>(r: kvx_core::Result<T>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("fixture: {what}: {e}"),
    }
}

/// Standard-attention caches `[2, blocks, BS, 1, 2]` of one byte per element (8-byte blocks).
pub(crate) fn caches(num_blocks: u32) -> Vec<LayerCache> {
    WINDOWS
        .iter()
        .map(|&window| LayerCache {
            memory: Arc::new(must(HostMemory::new((2 * num_blocks * BS * 2) as usize), "allocating a cache")),
            shape: vec![2, u64::from(num_blocks), u64::from(BS), 1, 2],
            elem_size: 1,
            window,
        })
        .collect()
}

/// A worker configuration of rank 0 of 1.
pub(crate) fn config(engine: &str) -> WorkerConfig {
    WorkerConfig { compat_tag: MODEL.into(), ..WorkerConfig::new(engine.into(), 0, 1, BS) }
}

/// The prefill engine's rank: its agent on a fabric, its registered worker and its payload.
pub(crate) struct Prefill {
    pub(crate) fabric: Fabric,
    pub(crate) agent: Arc<LoopbackAgent>,
    /// Keeps the caches registered.
    _worker: ConnectorWorker,
    /// What its side channel serves.
    pub(crate) payload: Vec<u8>,
    /// The metadata of an agent that has gone (a restarted peer's stale metadata).
    pub(crate) stale_metadata: Vec<u8>,
}

impl fmt::Debug for Prefill {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prefill").field("agent", &self.agent).finish_non_exhaustive()
    }
}

impl Prefill {
    fn new() -> Self {
        let fabric = Fabric::new();
        let agent = Arc::new(must(fabric.agent("prefill-agent"), "prefill agent"));
        let mut worker = must(ConnectorWorker::new(config(PREFILL), agent.clone()), "prefill worker");
        let payload = must(worker.register_kv_caches(&caches(PREFILL_BLOCKS)), "registering prefill caches");
        let stale_metadata = {
            let gone = must(fabric.agent("gone-agent"), "a short-lived agent");
            let memory = Arc::new(must(HostMemory::new(64), "memory"));
            must(gone.register(memory), "registering");
            must(gone.local_metadata(), "its metadata")
        };
        Prefill { fabric, agent, _worker: worker, payload, stale_metadata }
    }

    /// The payload, decoded.
    pub(crate) fn decoded_payload(&self) -> HandshakePayload {
        must(wire::decode(&self.payload), "decoding the prefill payload")
    }

    /// Answers every release that asks, as a prefill worker whose holds all live does: "held",
    /// to the decode agent (loaded on first use).
    pub(crate) fn answer_releases(&self, decode: &ConnectorWorker) {
        let mut received: Vec<Notification> = Vec::new();
        must(self.agent.drain_notifications(&mut received), "draining prefill notifications");
        for n in received {
            let Ok(release) = wire::decode::<kvx_core::HoldRelease>(&n.msg) else { continue };
            if release.reply_to.is_none() {
                continue;
            }
            // Each session's decode agent has the same name: the last one is the one loaded.
            let _ = self.agent.forget_remote(decode.agent().name());
            if let Ok(md) = decode.agent().local_metadata() {
                let _ = self.agent.load_remote(&md);
            }
            let status =
                kvx_core::HoldStatus { request_id: release.request_id, nonce: release.nonce, held: true };
            let _ = self.agent.notify(&n.from, &must(wire::encode(&status), "encoding an answer"));
        }
    }

    /// Empties the prefill agent's notification queue (READs of earlier runs notify it).
    pub(crate) fn drain(&self) {
        let mut sink: Vec<Notification> = Vec::new();
        must(self.agent.drain_notifications(&mut sink), "draining prefill notifications");
    }
}

thread_local! {
    static PREFILL_RANK: RefCell<Option<Rc<Prefill>>> = const { RefCell::new(None) };
}

/// This thread's prefill rank, made on first use.
pub(crate) fn prefill() -> Rc<Prefill> {
    PREFILL_RANK.with(|p| p.borrow_mut().get_or_insert_with(|| Rc::new(Prefill::new())).clone())
}

/// A fresh, registered decode rank on the prefill rank's fabric, with `key` (an authenticated
/// deployment) or none.
pub(crate) fn decode_worker(prefill: &Prefill, key: Option<AuthKey>) -> ConnectorWorker {
    let agent = Arc::new(must(prefill.fabric.agent("decode-agent"), "decode agent"));
    let side_channel = RemoteCoordinates { engine_id: DECODE.into(), host: "10.0.0.2".into(), port: 5700 };
    let config = WorkerConfig { auth_key: key, side_channel: Some(side_channel), ..config(DECODE) };
    let mut worker = must(ConnectorWorker::new(config, agent), "decode worker");
    must(worker.register_kv_caches(&caches(DECODE_BLOCKS)), "registering decode caches");
    worker
}

/// A load of `local` blocks from the last of the prefill engine's offered `remote` blocks, with
/// the hold's nonce and no MAC.
pub(crate) fn recv(id: &str, local: Vec<u32>, remote: Vec<u32>) -> RecvRequest {
    RecvRequest {
        request_id: id.into(),
        remote_request_id: None,
        remote_read_from: remote.len().saturating_sub(local.len()) as u32,
        local_block_ids: local,
        remote_block_ids: remote,
        remote: RemoteCoordinates { engine_id: PREFILL.into(), host: "10.0.0.1".into(), port: 5600 },
        nonce: Some(NONCE),
        mac: None,
    }
}

/// Runs a decode rank through a whole session: starts each step's metadata in turn, answering
/// the handshake fetches each step queues with `answer(engine)` (`None`: no answer, the
/// handshake times out), steps, then steps far in the future (every hold and handshake times
/// out). Checks what a session must guarantee whatever the peer or the metadata said: every load
/// is reported exactly once (done or failed), nothing that was not asked for is reported, every
/// hold is released, and the worker ends idle.
pub(crate) fn decode_session(
    prefill: &Prefill,
    key: Option<AuthKey>,
    steps: &[ConnectorMetadata],
    mut answer: impl FnMut(&EngineId) -> Option<kvx_core::Result<Vec<u8>>>,
) -> Finished {
    let mut worker = decode_worker(prefill, key);
    let now = Instant::now();
    let mut finished = Finished::default();
    for meta in steps {
        worker.start_load_kv(now, meta);
        while let Some(WorkerCommand::FetchHandshake { engine_id, .. }) = worker.poll_command() {
            if let Some(result) = answer(&engine_id) {
                worker.handle_handshake(now, &engine_id, result);
            }
        }
        finished.extend(worker.get_finished(now));
        prefill.answer_releases(&worker);
    }
    for _ in 0..2 {
        finished.extend(worker.get_finished(now));
        prefill.answer_releases(&worker);
    }
    let later = now + Duration::from_secs(7 * 24 * 3600);
    finished.extend(worker.get_finished(later));
    // A late answer for an engine that is no longer handshaking is ignored.
    worker.handle_handshake(later, &PREFILL.into(), Ok(prefill.payload.clone()));
    finished.extend(worker.get_finished(later));
    prefill.drain();
    let all = ConnectorMetadata {
        reqs_to_recv: steps.iter().flat_map(|m| m.reqs_to_recv.iter().cloned()).collect(),
        reqs_to_send: steps.iter().flat_map(|m| m.reqs_to_send.iter().cloned()).collect(),
        heartbeats: vec![],
    };
    check_session(&all, &finished);
    assert!(
        worker.is_idle(),
        "the decode worker is not idle at the end of the session: {:?}",
        worker.stats()
    );
    finished
}

fn check_session(meta: &ConnectorMetadata, finished: &Finished) {
    let loads: HashSet<&RequestId> =
        meta.reqs_to_recv.iter().filter(|r| !r.is_notify_only()).map(|r| &r.request_id).collect();
    let any_recv: HashSet<&RequestId> = meta.reqs_to_recv.iter().map(|r| &r.request_id).collect();
    let unique_loads = meta.reqs_to_recv.len() == any_recv.len();
    let mut seen = HashSet::new();
    for id in finished.recving.iter().chain(finished.failed_recving.iter().map(|f| &f.request_id)) {
        assert!(any_recv.contains(id), "request {id} reported but never asked for");
        if unique_loads {
            assert!(seen.insert(id), "request {id} reported twice: {finished:?}");
        }
    }
    for id in &finished.recving {
        assert!(loads.contains(id), "notify-only request {id} reported as loaded");
    }
    if unique_loads {
        for id in loads {
            assert!(seen.contains(id), "load {id} never reported: {finished:?}");
        }
    }
    let held: HashSet<&RequestId> = meta.reqs_to_send.iter().map(|h| &h.request_id).collect();
    for id in &finished.sending {
        assert!(held.contains(id), "request {id} reported sent but never held");
    }
    for id in held {
        assert!(finished.sending.contains(id), "hold {id} never released");
    }
}

/// An error as a failed side-channel fetch reports it.
pub(crate) fn unreachable_peer(engine: &EngineId) -> Error {
    Error::new(ErrorKind::Handshake, format!("engine {engine} is unreachable"))
}
