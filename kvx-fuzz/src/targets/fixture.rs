//! Real workers and agents for the targets to feed: a prefill engine rank on a loopback fabric
//! (kept per thread, as its payload must name a live agent), and a fresh decode rank per run.
//!
//! A decode load completes only once the prefill rank answers the release its READ carried
//! (`HoldStatus`), so every session runs both ranks: the prefill rank holds the session's offers,
//! receives the releases, and handshakes back with the decode engine (its payload, handed over
//! in process) to answer. The prefill rank's time is a per-thread clock that only moves forward,
//! a day apart between sessions, so nothing one session leaves in its buffers reaches the next.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::wire::{self, HandshakePayload};
use kvx_core::{
    AgentName, AuthKey, Capabilities, ConnectorMetadata, ConnectorWorker, DlistId, DlistOwner, EngineId,
    Error, ErrorKind, Finished, HeldRequest, HostMemory, KvMemory, LayerCache, Nonce, Notification,
    RecvRequest, RegistrationId, RemoteCoordinates, RequestId, TransferAgent, WorkerCommand, WorkerConfig,
    XferId, XferOp, XferState,
};
use kvx_loopback::{Fabric, LoopbackAgent};

/// Tokens per block.
pub(crate) const BS: u32 = 4;
/// Bytes of one block of one region (`BS` tokens, one head of 2 one-byte elements).
pub(crate) const BLOCK_LEN: usize = (BS * 2) as usize;
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

/// A nonce that several of the fixtures' offers share (a second load of one offer is refused).
pub(crate) const NONCE: Nonce = kvx_core::HexBytes([0x5a; 16]);

/// The nonce of the prefill engine's hold of request `id` (distinct per request, as a real
/// scheduler's are).
pub(crate) fn nonce_of(id: &str) -> Nonce {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut n = [0u8; 16];
    n[..8].copy_from_slice(&h.to_le_bytes());
    n[8..].copy_from_slice(&(!h).to_le_bytes());
    kvx_core::HexBytes(n)
}

/// Another nonce than `nonce` (a forged or stale one).
pub(crate) fn other_nonce(nonce: &Nonce) -> Nonce {
    kvx_core::HexBytes(nonce.0.map(|b| b ^ 0xa5))
}

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

/// Standard-attention caches `[2, blocks, BS, 1, 2]` of one byte per element (8-byte blocks), and
/// the first layer's memory: region 0 (its keys), block `b` at `b * BLOCK_LEN`, is what the
/// targets check the READs by.
pub(crate) fn caches(num_blocks: u32) -> (Vec<LayerCache>, Arc<HostMemory>) {
    let memories: Vec<Arc<HostMemory>> = WINDOWS
        .iter()
        .map(|_| Arc::new(must(HostMemory::new((2 * num_blocks * BS * 2) as usize), "allocating a cache")))
        .collect();
    let layers = WINDOWS
        .iter()
        .zip(&memories)
        .map(|(&window, memory)| LayerCache {
            memory: memory.clone() as Arc<dyn KvMemory>,
            shape: vec![2, u64::from(num_blocks), u64::from(BS), 1, 2],
            elem_size: 1,
            window,
        })
        .collect();
    (layers, memories[0].clone())
}

/// A worker configuration of rank 0 of 1.
pub(crate) fn config(engine: &str) -> WorkerConfig {
    WorkerConfig { compat_tag: MODEL.into(), ..WorkerConfig::new(engine.into(), 0, 1, BS) }
}

/// The decode engine's side channel: where the prefill ranks answer its releases.
pub(crate) fn decode_side_channel() -> RemoteCoordinates {
    RemoteCoordinates { engine_id: DECODE.into(), host: "10.0.0.2".into(), port: 5700 }
}

/// The prefill engine's coordinates, as its params name them.
pub(crate) fn prefill_coordinates() -> RemoteCoordinates {
    RemoteCoordinates { engine_id: PREFILL.into(), host: "10.0.0.1".into(), port: 5600 }
}

/// A decode worker configuration (rank 0 of 1): it answers on [`decode_side_channel`].
pub(crate) fn decode_config() -> WorkerConfig {
    WorkerConfig { side_channel: Some(decode_side_channel()), ..config(DECODE) }
}

/// The byte every byte of prefill block `b` of region 0 holds while the block is held.
pub(crate) fn pattern(block: u32) -> u8 {
    0x80 | (block & 0x3f) as u8
}

/// What a freed prefill block is overwritten with (its reuse by another request).
pub(crate) const SCRIBBLE: u8 = 0xdd;

/// Fills region 0 of a prefill rank's first layer with [`pattern`].
pub(crate) fn fill_pattern(keys: &HostMemory, blocks: u32) {
    for b in 0..blocks {
        must(keys.fill(b as usize * BLOCK_LEN, BLOCK_LEN, pattern(b)), "filling a prefill block");
    }
}

/// The bytes of block `b` of region 0.
pub(crate) fn block_bytes(keys: &HostMemory, b: u32) -> [u8; BLOCK_LEN] {
    let mut out = [0u8; BLOCK_LEN];
    must(keys.read(b as usize * BLOCK_LEN, &mut out), "reading a block");
    out
}

/// A [`TransferAgent`] that keeps a copy of every notification its worker drains, in order (when
/// asked to): what a rank received, for targets that model it.
#[derive(Debug)]
pub(crate) struct Recorder {
    inner: Arc<LoopbackAgent>,
    drained: Mutex<Vec<Notification>>,
}

impl Recorder {
    pub(crate) fn new(inner: Arc<LoopbackAgent>) -> Self {
        Recorder { inner, drained: Mutex::new(Vec::new()) }
    }

    /// The notifications drained since the last call.
    pub(crate) fn take(&self) -> Vec<Notification> {
        std::mem::take(&mut *self.drained.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl TransferAgent for Recorder {
    fn name(&self) -> &AgentName {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn register(&self, memory: Arc<dyn KvMemory>) -> kvx_core::Result<RegistrationId> {
        self.inner.register(memory)
    }
    fn deregister(&self, registration: RegistrationId) -> kvx_core::Result<()> {
        self.inner.deregister(registration)
    }
    fn local_metadata(&self) -> kvx_core::Result<Vec<u8>> {
        self.inner.local_metadata()
    }
    fn load_remote(&self, metadata: &[u8]) -> kvx_core::Result<AgentName> {
        self.inner.load_remote(metadata)
    }
    fn forget_remote(&self, agent: &AgentName) -> kvx_core::Result<()> {
        self.inner.forget_remote(agent)
    }
    fn prep_dlist(&self, owner: &DlistOwner, blocks: &kvx_core::BlockList) -> kvx_core::Result<DlistId> {
        self.inner.prep_dlist(owner, blocks)
    }
    fn release_dlist(&self, dlist: DlistId) -> kvx_core::Result<()> {
        self.inner.release_dlist(dlist)
    }
    fn post(
        &self,
        op: XferOp,
        local: DlistId,
        local_descs: &[u32],
        remote: DlistId,
        remote_descs: &[u32],
        notify: Option<&[u8]>,
    ) -> kvx_core::Result<XferId> {
        self.inner.post(op, local, local_descs, remote, remote_descs, notify)
    }
    fn poll(&self, xfer: XferId) -> kvx_core::Result<XferState> {
        self.inner.poll(xfer)
    }
    fn drain_completions(&self, out: &mut Vec<XferId>) -> kvx_core::Result<()> {
        self.inner.drain_completions(out)
    }
    fn release(&self, xfer: XferId) -> kvx_core::Result<()> {
        self.inner.release(xfer)
    }
    fn notify(&self, agent: &AgentName, msg: &[u8]) -> kvx_core::Result<()> {
        self.inner.notify(agent, msg)
    }
    fn drain_notifications(&self, out: &mut Vec<Notification>) -> kvx_core::Result<()> {
        let from = out.len();
        self.inner.drain_notifications(out)?;
        self.drained.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(&out[from..]);
        Ok(())
    }
    fn progress(&self) -> kvx_core::Result<()> {
        self.inner.progress()
    }
}

/// One step of a prefill rank: what it finished, with every handshake it asks for answered (the
/// decode engine's payload, handed over in process; any other engine is unreachable).
pub(crate) fn prefill_step(prefill: &mut ConnectorWorker, decode_payload: &[u8], now: Instant) -> Finished {
    let finished = prefill.get_finished(now);
    answer_fetches(prefill, decode_payload, now);
    finished
}

/// Answers a prefill rank's queued handshakes (see [`prefill_step`]).
pub(crate) fn answer_fetches(prefill: &mut ConnectorWorker, decode_payload: &[u8], now: Instant) {
    while let Some(WorkerCommand::FetchHandshake { engine_id, .. }) = prefill.poll_command() {
        let result = if engine_id.as_str() == DECODE {
            Ok(decode_payload.to_vec())
        } else {
            Err(unreachable_peer(&engine_id))
        };
        prefill.handle_handshake(now, &engine_id, result);
    }
}

/// The prefill engine's rank: its agent on a fabric, its registered worker and its payload.
pub(crate) struct Prefill {
    pub(crate) fabric: Fabric,
    pub(crate) agent: Arc<LoopbackAgent>,
    worker: RefCell<ConnectorWorker>,
    /// Region 0 of its first layer.
    keys: Arc<HostMemory>,
    /// What its side channel serves.
    pub(crate) payload: Vec<u8>,
    /// The metadata of an agent that has gone (a restarted peer's stale metadata).
    pub(crate) stale_metadata: Vec<u8>,
    /// Its regions' base addresses (from its payload).
    region_bases: Vec<u64>,
    /// Its time: only forward.
    clock: Cell<Instant>,
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
        let (layers, keys) = caches(PREFILL_BLOCKS);
        let payload = must(worker.register_kv_caches(&layers), "registering prefill caches");
        let stale_metadata = {
            let gone = must(fabric.agent("gone-agent"), "a short-lived agent");
            let memory = Arc::new(must(HostMemory::new(64), "memory"));
            must(gone.register(memory), "registering");
            must(gone.local_metadata(), "its metadata")
        };
        let clock = Cell::new(Instant::now());
        let region_bases =
            must(wire::decode::<HandshakePayload>(&payload), "decoding the payload").region_bases;
        let worker = RefCell::new(worker);
        Prefill { fabric, agent, worker, keys, payload, stale_metadata, region_bases, clock }
    }

    /// The payload, decoded.
    pub(crate) fn decoded_payload(&self) -> HandshakePayload {
        must(wire::decode(&self.payload), "decoding the prefill payload")
    }

    /// Starts a session: a day after the last one, with everything an earlier session left (a
    /// hold, a buffered release, a handshake; a panicking one leaves them) expired, and the
    /// blocks' patterns written again. Returns the session's start.
    fn begin(&self) -> Instant {
        // Holds expire here; buffered releases, ended holds and handshakes by the session's start.
        let flush = self.clock.get() + Duration::from_secs(24 * 3600);
        let mut worker = self.worker.borrow_mut();
        worker.get_finished(flush);
        while worker.poll_command().is_some() {}
        fill_pattern(&self.keys, PREFILL_BLOCKS);
        let now = flush + Duration::from_secs(24 * 3600);
        self.clock.set(now);
        now
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
/// deployment) or none: the worker and region 0 of its first layer.
pub(crate) fn decode_worker(prefill: &Prefill, key: Option<AuthKey>) -> (ConnectorWorker, Arc<HostMemory>) {
    let agent = Arc::new(must(prefill.fabric.agent("decode-agent"), "decode agent"));
    let config = WorkerConfig { auth_key: key, ..decode_config() };
    let mut worker = must(ConnectorWorker::new(config, agent), "decode worker");
    let (layers, keys) = caches(DECODE_BLOCKS);
    must(worker.register_kv_caches(&layers), "registering decode caches");
    (worker, keys)
}

/// A load of `local` blocks from the last of the prefill engine's offered `remote` blocks, with
/// its hold's nonce ([`nonce_of`] its id) and no MAC.
pub(crate) fn recv(id: &str, local: Vec<u32>, remote: Vec<u32>) -> RecvRequest {
    RecvRequest {
        request_id: id.into(),
        remote_request_id: None,
        remote_read_from: remote.len().saturating_sub(local.len()) as u32,
        local_block_ids: local,
        remote_block_ids: remote,
        remote: prefill_coordinates(),
        nonce: Some(nonce_of(id)),
        mac: None,
        remote_instance: None,
    }
}

/// How the prefill rank holds the offer a load names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lease {
    /// Held from the session's start, under the load's nonce.
    Held,
    /// Held, but its lease ran out (and the blocks were freed and reused) before the READ.
    Expired,
    /// Held under another nonce (the load's params are forged or stale).
    OtherNonce,
    /// Never held (the prefill engine restarted, or the params are made up).
    Missing,
}

/// The prefill rank's holds of one session, as the fixture started them, and what it freed.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    /// By the prefill engine's request id: the hold's nonce, its lease, its blocks, whether the
    /// prefill rank still holds it.
    held: HashMap<RequestId, (Nonce, Lease, Vec<u32>, bool)>,
    /// Every id the prefill rank reported freed, in order.
    pub(crate) freed: Vec<RequestId>,
}

impl Holds {
    /// Holds the offer of each load (the first load naming a prefill request decides its nonce and
    /// lease), with `leases[i]` for the `i`-th load (default [`Lease::Held`]), on `prefill` at
    /// `now`: an expired lease is started a lease ago, so the first step frees it.
    pub(crate) fn start(
        prefill: &mut ConnectorWorker,
        loads: &[&RecvRequest],
        leases: &[Lease],
        now: Instant,
    ) -> Self {
        let mut holds = Holds::default();
        let lease_duration = prefill.config().lease_duration;
        for (i, r) in loads.iter().enumerate() {
            let Some(nonce) = r.nonce else { continue };
            let id = r.prefill_request_id();
            if let Some((_, _, blocks, _)) = holds.held.get_mut(id) {
                blocks.extend(&r.remote_block_ids);
                continue;
            }
            let lease = leases.get(i).copied().unwrap_or(Lease::Held);
            let (at, nonce) = match lease {
                Lease::Held => (now, nonce),
                Lease::Expired => (now - lease_duration - Duration::from_secs(1), nonce),
                Lease::OtherNonce => (now, other_nonce(&nonce)),
                Lease::Missing => {
                    holds.held.insert(id.clone(), (nonce, lease, r.remote_block_ids.clone(), false));
                    continue;
                }
            };
            let meta = ConnectorMetadata {
                reqs_to_send: vec![HeldRequest { request_id: id.clone(), nonce }],
                ..Default::default()
            };
            prefill.start_load_kv(at, &meta);
            holds.held.insert(id.clone(), (nonce, lease, r.remote_block_ids.clone(), true));
        }
        holds
    }

    /// [`start`](Self::start), then the blocks of offers the prefill rank does not hold are
    /// reused (a made-up or outlived offer names blocks that hold other requests' KV).
    pub(crate) fn start_reused(
        prefill: &mut ConnectorWorker,
        loads: &[&RecvRequest],
        leases: &[Lease],
        now: Instant,
        keys: &HostMemory,
    ) -> Self {
        let holds = Holds::start(prefill, loads, leases, now);
        let unheld: Vec<u32> =
            holds.held.values().filter(|h| !h.3).flat_map(|h| h.2.iter().copied()).collect();
        holds.reuse(&unheld, keys);
        holds
    }

    /// The prefill rank reported `sending` freed: those holds end, and their blocks no other live
    /// hold keeps are reused at once (overwritten with [`SCRIBBLE`]).
    pub(crate) fn freed(&mut self, sending: Vec<RequestId>, keys: &HostMemory) {
        if sending.is_empty() {
            return;
        }
        let mut ended = Vec::new();
        for id in sending {
            if let Some((_, _, blocks, live)) = self.held.get_mut(&id) {
                if std::mem::replace(live, false) {
                    ended.extend(blocks.iter().copied());
                }
            }
            self.freed.push(id);
        }
        self.reuse(&ended, keys);
    }

    /// Overwrites the blocks of `blocks` that no live hold keeps.
    fn reuse(&self, blocks: &[u32], keys: &HostMemory) {
        let kept: HashSet<u32> =
            self.held.values().filter(|h| h.3).flat_map(|h| h.2.iter().copied()).collect();
        for &b in blocks.iter().filter(|b| **b < PREFILL_BLOCKS && !kept.contains(b)) {
            must(keys.fill(b as usize * BLOCK_LEN, BLOCK_LEN, SCRIBBLE), "reusing a freed block");
        }
    }

    /// Whether the prefill rank held `r`'s offer (its id and nonce) under a live lease from the
    /// session's start (whether the lease lasted through the READ, the bytes tell: see
    /// [`check_bytes`]).
    pub(crate) fn covers(&self, r: &RecvRequest) -> Result<(), String> {
        match self.held.get(r.prefill_request_id()) {
            // Held under another load's nonce is held all the same for a load with that nonce.
            Some((nonce, Lease::Held | Lease::OtherNonce, ..)) if Some(*nonce) == r.nonce => Ok(()),
            Some((nonce, lease, ..)) => {
                Err(format!("its hold is {lease:?} (nonce {nonce}, the load's {:?})", r.nonce))
            }
            None => Err("the prefill engine never held it".to_owned()),
        }
    }

    /// Checks that every hold was freed exactly once and nothing else was.
    pub(crate) fn check_freed(&self) {
        let mut seen = HashSet::new();
        for id in &self.freed {
            let held = self.held.get(id).is_some_and(|h| h.1 != Lease::Missing);
            assert!(held, "the prefill rank freed {id}, which it never held");
            assert!(seen.insert(id), "the prefill rank freed {id} twice: {:?}", self.freed);
        }
        for (id, h) in &self.held {
            if h.1 != Lease::Missing {
                assert!(seen.contains(id), "the prefill rank never freed its hold of {id}");
            }
        }
    }
}

/// Checks the bytes of loads reported done: each local block holds the prefill block it was read
/// from as it was while held (not a reused block, not left unwritten). Only loads whose local
/// blocks no other load of the session writes are checked.
pub(crate) fn check_bytes(loads: &[&RecvRequest], done: &[RequestId], keys: &HostMemory) {
    let mut writers: HashMap<u32, usize> = HashMap::new();
    for r in loads {
        for b in r.local_block_ids.iter().collect::<HashSet<_>>() {
            *writers.entry(*b).or_default() += 1;
        }
    }
    for id in done {
        let mut same = loads.iter().filter(|r| &r.request_id == id);
        let (Some(r), None) = (same.next(), same.next()) else { continue };
        if r.local_block_ids.iter().any(|b| writers.get(b) != Some(&1)) {
            continue;
        }
        let from = r.remote_read_from as usize;
        for (k, &local) in r.local_block_ids.iter().enumerate() {
            let Some(&remote) = r.remote_block_ids.get(from + k) else { continue };
            let got = block_bytes(keys, local);
            assert!(
                got == [pattern(remote); BLOCK_LEN],
                "load {id} reported done, but its local block {local} holds {got:02x?}, not prefill block \
                 {remote} as held ({:02x}): the READ copied freed (reused) blocks or nothing",
                pattern(remote)
            );
        }
    }
}

/// Runs a decode rank through a whole session against the thread's prefill rank, which holds
/// every load's offer as `leases` say (default: held): starts each step's metadata in turn,
/// answering the handshake fetches each step queues with `answer(engine)` (`None`: no answer, the
/// handshake times out), lets the two ranks exchange (READ, release, the prefill rank's
/// handshake back and its answer), then steps both far in the future (every lease, READ,
/// confirmation and handshake times out). Checks what a session must guarantee whatever the peer
/// or the metadata said: every load is reported exactly once (done or failed), nothing that was
/// not asked for is reported, a load is done only if the prefill engine held its offer throughout
/// and its blocks hold the prefill's bytes (when the handshake gave the prefill rank's real
/// regions), every hold on either rank is released exactly once, and both ranks end idle.
pub(crate) fn decode_session(
    prefill: &Prefill,
    key: Option<AuthKey>,
    steps: &[ConnectorMetadata],
    leases: &[Lease],
    mut answer: impl FnMut(&EngineId) -> Option<kvx_core::Result<Vec<u8>>>,
) -> Finished {
    let now = prefill.begin();
    let (mut worker, keys) = decode_worker(prefill, key);
    let decode_payload = worker.handshake_payload().unwrap_or_default().to_vec();
    let loads: Vec<&RecvRequest> = steps.iter().flat_map(|m| &m.reqs_to_recv).collect();
    let mut holds = Holds::start_reused(&mut prefill.worker.borrow_mut(), &loads, leases, now, &prefill.keys);
    let mut genuine = true;
    let mut finished = Finished::default();
    let exchange = |worker: &mut ConnectorWorker, finished: &mut Finished, holds: &mut Holds, at, rounds| {
        for _ in 0..rounds {
            finished.extend(worker.get_finished(at));
            let sent = prefill_step(&mut prefill.worker.borrow_mut(), &decode_payload, at);
            holds.freed(sent.sending, &prefill.keys);
        }
    };
    // Frees the holds whose lease already ran out.
    let sent = prefill_step(&mut prefill.worker.borrow_mut(), &decode_payload, now);
    holds.freed(sent.sending, &prefill.keys);
    for meta in steps {
        worker.start_load_kv(now, meta);
        while let Some(WorkerCommand::FetchHandshake { engine_id, .. }) = worker.poll_command() {
            if let Some(result) = answer(&engine_id) {
                if let Ok(bytes) = &result {
                    genuine &= wire::decode::<HandshakePayload>(bytes)
                        .is_ok_and(|p| p.region_bases == prefill.region_bases);
                }
                worker.handle_handshake(now, &engine_id, result);
            }
        }
        // The READs complete and carry their releases; the prefill rank answers; the decode rank
        // confirms.
        exchange(&mut worker, &mut finished, &mut holds, now, 2);
    }
    exchange(&mut worker, &mut finished, &mut holds, now, 1);
    let later = now + Duration::from_secs(7 * 24 * 3600);
    exchange(&mut worker, &mut finished, &mut holds, later, 1);
    // A late answer for an engine that is no longer handshaking is ignored.
    worker.handle_handshake(later, &PREFILL.into(), Ok(prefill.payload.clone()));
    // Buffered releases and ended holds expire.
    let end = later + Duration::from_secs(24 * 3600);
    exchange(&mut worker, &mut finished, &mut holds, end, 1);
    prefill.clock.set(end);

    let all = ConnectorMetadata {
        reqs_to_recv: loads.iter().map(|r| (*r).clone()).collect(),
        reqs_to_send: steps.iter().flat_map(|m| m.reqs_to_send.iter().cloned()).collect(),
        heartbeats: vec![],
    };
    check_session(&all, &finished);
    for id in &finished.recving {
        let covered =
            loads.iter().filter(|r| &r.request_id == id).map(|r| holds.covers(r)).collect::<Vec<_>>();
        assert!(
            covered.iter().any(Result::is_ok),
            "load {id} reported done although the prefill engine did not hold its offer: {covered:?}"
        );
    }
    if genuine {
        check_bytes(&loads, &finished.recving, &keys);
    }
    holds.check_freed();
    assert!(
        worker.is_idle(),
        "the decode worker is not idle at the end of the session: {:?}",
        worker.stats()
    );
    let prefill_worker = prefill.worker.borrow();
    assert!(
        prefill_worker.is_idle(),
        "the prefill worker is not idle at the end of the session: {:?}",
        prefill_worker.stats()
    );
    finished
}

/// Checks a decode rank's reports against the metadata it was given (see [`decode_session`]).
pub(crate) fn check_session(meta: &ConnectorMetadata, finished: &Finished) {
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
