//! `ConnectorWorker::close` over real loopback agents: once closed, neither the worker nor its
//! agent (both still alive) keeps the KV memory; a READ still in flight is cancelled or settles.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::sync::Arc;
use std::time::Instant;

use kvx_core::{
    BlockList, ConnectorMetadata, ConnectorWorker, DlistOwner, ErrorKind, GroupBlocks, HeldRequest, HexBytes,
    HostMemory, KvMemory, LayerCache, MemKind, PeerLocator, RecvRequest, RemoteCoordinates, RequestId,
    TransferAgent, WorkerCommand, WorkerConfig,
};
use kvx_loopback::Fabric;

/// Bytes of one block: block_size 4 × 2 heads × 8 elements of 1 byte.
const BLOCK: usize = 64;
const BLOCKS: usize = 8;
/// More than any exchange below needs: the agents progress only when the workers call them.
const STEPS: usize = 100;

fn coordinates(engine: &str) -> RemoteCoordinates {
    RemoteCoordinates::at(engine, "in-process", 5600)
}

/// A worker of `engine` (rank 0 of 1) on its own loopback agent, with one layer of `memory`
/// registered; returns its handshake payload too.
fn worker(fabric: &Fabric, engine: &str, memory: &Arc<HostMemory>) -> (ConnectorWorker, Vec<u8>) {
    let config =
        WorkerConfig { side_channel: Some(coordinates(engine)), ..WorkerConfig::new(engine.into(), 0, 1, 4) };
    let mut w = ConnectorWorker::new(config, Arc::new(fabric.agent(format!("{engine}-0")).unwrap())).unwrap();
    let layer = LayerCache {
        memory: memory.clone(),
        shape: vec![2, BLOCKS as u64, 4, 2, 8],
        elem_size: 1,
        window: None,
    };
    let payload = w.register_kv_caches(&[layer]).unwrap();
    (w, payload)
}

fn memory() -> Arc<HostMemory> {
    Arc::new(HostMemory::new(2 * BLOCKS * BLOCK).unwrap())
}

/// Answers `w`'s handshake fetches with `payload`.
fn handshake(w: &mut ConnectorWorker, now: Instant, payload: &[u8]) {
    while let Some(WorkerCommand::FetchHandshake(PeerLocator { engine_id, rank, .. })) = w.poll_command() {
        w.handle_handshake(now, &engine_id, rank, Ok(payload.to_vec()));
    }
}

/// A load of prefill block 5 into decode block 2, under the hold's nonce.
fn load() -> ConnectorMetadata {
    let req = RecvRequest {
        prompt: None,
        request_id: "r".into(),
        remote_request_id: None,
        local_block_ids: vec![GroupBlocks::whole(vec![2])],
        remote_block_ids: vec![GroupBlocks::whole(vec![5])],
        remote: coordinates("prefill"),
        nonce: Some(HexBytes([3; 16])),
        mac: None,
        remote_instance: None,
        remote_tp_size: None,
    };
    ConnectorMetadata { reqs_to_recv: vec![req], ..Default::default() }
}

fn hold() -> ConnectorMetadata {
    let held = HeldRequest { request_id: "r".into(), nonce: HexBytes([3; 16]) };
    ConnectorMetadata { reqs_to_send: vec![held], ..Default::default() }
}

/// A prefill worker holding request "r" and a decode worker whose READ of it is posted (never
/// progressed yet), on loopback agents of one fabric.
struct Posted {
    prefill: ConnectorWorker,
    decode: ConnectorWorker,
    prefill_memory: Arc<HostMemory>,
    decode_memory: Arc<HostMemory>,
    decode_payload: Vec<u8>,
}

fn posted(fabric: &Fabric, now: Instant) -> Posted {
    let (prefill_memory, decode_memory) = (memory(), memory());
    let (mut prefill, prefill_payload) = worker(fabric, "prefill", &prefill_memory);
    let (mut decode, decode_payload) = worker(fabric, "decode", &decode_memory);
    prefill.start_load_kv(now, &hold());
    decode.start_load_kv(now, &load());
    handshake(&mut decode, now, &prefill_payload);
    assert_eq!((decode.stats().reads_posted, decode.num_in_flight()), (1, 1), "posted");
    Posted { prefill, decode, prefill_memory, decode_memory, decode_payload }
}

#[test]
fn closed_workers_keep_no_memory_after_a_transfer() {
    let fabric = Fabric::new();
    let now = Instant::now();
    let Posted { mut prefill, mut decode, prefill_memory, decode_memory, decode_payload } =
        posted(&fabric, now);
    prefill_memory.fill(0, 2 * BLOCKS * BLOCK, 0x5a).unwrap();
    // The READ completes, the prefill worker frees its hold and (after its own handshake with
    // the decode engine) answers "held", which completes the load.
    let mut done = (Vec::new(), Vec::new());
    for _ in 0..STEPS {
        done.0.extend(prefill.get_finished(now).sending);
        handshake(&mut prefill, now, &decode_payload);
        let f = decode.get_finished(now);
        assert!(f.failed_recving.is_empty(), "{f:?}");
        done.1.extend(f.recving);
        if !done.1.is_empty() {
            break;
        }
    }
    assert_eq!(done, (vec![RequestId::new("r")], vec![RequestId::new("r")]));
    let mut block = vec![0u8; BLOCK];
    decode_memory.read(2 * BLOCK, &mut block).unwrap();
    assert!(block.iter().all(|&b| b == 0x5a), "the block was read");
    assert_eq!((Arc::strong_count(&prefill_memory), Arc::strong_count(&decode_memory)), (2, 2));

    // A peer that loads the decode agent's metadata finds that memory in it until the close.
    let observer = fabric.agent("observer").unwrap();
    let region = decode_memory.region();
    let list = BlockList {
        kind: MemKind::Dram,
        device: 0,
        bases: vec![region.addr],
        num_blocks: 1,
        block_len: region.len,
    };
    let agent = decode.agent().clone();
    let describe = || {
        let peer = observer.load_remote(&agent.local_metadata().unwrap()).unwrap();
        let listed = observer.prep_dlist(&DlistOwner::Remote(peer.clone()), &list);
        observer.forget_remote(&peer).unwrap();
        listed
    };
    describe().unwrap();

    prefill.close().unwrap();
    decode.close().unwrap();
    // The workers and their agents live on; only the test holds the memory.
    assert_eq!(Arc::strong_count(&prefill_memory), 1, "the prefill agent keeps its memory");
    assert_eq!(Arc::strong_count(&decode_memory), 1, "the decode agent keeps its memory");
    assert_eq!(describe().unwrap_err().kind(), ErrorKind::InvalidPeerData);
    assert!(decode.is_closed() && prefill.is_closed());
}

#[test]
fn a_read_in_flight_at_close_is_cancelled_and_its_memory_let_go() {
    let fabric = Fabric::new();
    let now = Instant::now();
    let Posted { mut prefill, mut decode, decode_memory, .. } = posted(&fabric, now);
    decode.close().unwrap();
    // A backend that cannot cancel lets the memory go once the READ settles: one pass settles it.
    decode.agent().progress().unwrap();
    assert_eq!(Arc::strong_count(&decode_memory), 1);
    let f = decode.get_finished(now);
    assert_eq!(f.failed_recving.len(), 1, "{f:?}");
    // The prefill worker was told to free its hold at once, without waiting for its lease.
    let mut freed = Vec::new();
    for _ in 0..STEPS {
        freed.extend(prefill.get_finished(now).sending);
        if !freed.is_empty() {
            break;
        }
    }
    assert_eq!(freed, [RequestId::new("r")]);
    assert_eq!(prefill.stats().expired_holds, 0);
    // Closed: a new registration is refused.
    let layer =
        LayerCache { memory: memory(), shape: vec![2, BLOCKS as u64, 4, 2, 8], elem_size: 1, window: None };
    assert_eq!(decode.register_kv_caches(&[layer]).unwrap_err().kind(), ErrorKind::State);
}
