//! What one step of a decode worker costs its agent: with 20 000 READs in flight, a step drains
//! the agent's completions once and polls only the READs that completed, so its cost is linear in
//! what completed, not in what is in flight (polling every transfer each step, each poll a
//! progress pass over all of them, made a step of 20 000 quadratic).

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::sync::Arc;
use std::time::Instant;

use kvx_core::testing::Recording;
use kvx_core::{
    ConnectorMetadata, ConnectorWorker, GroupBlocks, HexBytes, HostMemory, LayerCache, PeerLocator,
    RecvRequest, RemoteCoordinates, TransferAgent, WorkerCommand, WorkerConfig,
};
use kvx_loopback::Fabric;
use kvx_testkit::chaos::{Chaos, ChaosNet, Faults};

const LOADS: usize = 20_000;
const BLOCKS: u64 = 8;

fn coordinates(engine: &str) -> RemoteCoordinates {
    RemoteCoordinates::at(engine, "in-process", 5600)
}

/// A worker of `engine` (rank 0 of 1) over `agent`, with one layer registered; and its payload.
fn worker(engine: &str, agent: Arc<dyn TransferAgent>) -> (ConnectorWorker, Vec<u8>) {
    let config =
        WorkerConfig { side_channel: Some(coordinates(engine)), ..WorkerConfig::new(engine.into(), 0, 1, 4) };
    let mut w = ConnectorWorker::new(config, agent).unwrap();
    let memory = Arc::new(HostMemory::new(2 * BLOCKS as usize * 64).unwrap());
    let layer = LayerCache { memory, shape: vec![2, BLOCKS, 4, 2, 8], elem_size: 1, window: None };
    let payload = w.register_kv_caches(&[layer]).unwrap();
    (w, payload)
}

/// Load `i`: one prefill block into one decode block, under its own nonce.
fn load(i: usize) -> RecvRequest {
    let mut nonce = [0u8; 16];
    nonce[..8].copy_from_slice(&(i as u64).to_le_bytes());
    RecvRequest {
        prompt: None,
        request_id: format!("r{i}").into(),
        remote_request_id: None,
        local_block_ids: vec![GroupBlocks::whole(vec![(i as u64 % BLOCKS) as u32])],
        remote_block_ids: vec![GroupBlocks::whole(vec![((i as u64 + 1) % BLOCKS) as u32])],
        remote: coordinates("prefill"),
        nonce: Some(HexBytes(nonce)),
        mac: None,
        remote_instance: None,
        remote_tp_size: None,
    }
}

#[test]
fn a_step_costs_what_completed() {
    let fabric = Fabric::new();
    let (_prefill, prefill_payload) = worker("prefill", Arc::new(fabric.agent("prefill-0").unwrap()));
    let inner = Chaos::new(Arc::new(fabric.agent("decode-0").unwrap()), &ChaosNet::new());
    // Every READ stays pending through 4 passes: two steps of the worker (each drains the
    // notifications and the completions once).
    inner.set_faults(Faults::none().delay_completion(4)).unwrap();
    // The agent counts the calls that poll a transfer or drive progress.
    let agent = Arc::new(Recording::new(Arc::new(inner)));
    let (mut decode, _) = worker("decode", agent.clone());
    let now = Instant::now();
    let reqs_to_recv = (0..LOADS).map(load).collect();
    decode.start_load_kv(now, &ConnectorMetadata { reqs_to_recv, ..Default::default() });
    while let Some(WorkerCommand::FetchHandshake(PeerLocator { engine_id, rank, .. })) = decode.poll_command()
    {
        decode.handle_handshake(now, &engine_id, rank, Ok(prefill_payload.clone()));
    }
    assert_eq!((decode.stats().reads_posted, decode.num_in_flight()), (LOADS as u64, LOADS));

    let step = |decode: &mut ConnectorWorker| {
        let before = agent.calls();
        let f = decode.get_finished(now);
        assert!(f.failed_recving.is_empty(), "{:?}", f.failed_recving.first());
        let after = agent.calls();
        (after.polls - before.polls, after.passes - before.passes)
    };
    // (polls, passes) of each step: nothing is polled while nothing completed, all 20 000 READs
    // once in the step they complete, none after; every step two passes, whatever is in flight.
    assert_eq!(step(&mut decode), (0, 2), "first step: all READs pending");
    assert_eq!(step(&mut decode), (0, 2), "second step: all READs pending");
    assert_eq!(step(&mut decode), (LOADS as u64, 2), "third step: all READs complete");
    assert_eq!(step(&mut decode), (0, 2), "fourth step: waiting for confirmations only");
    assert_eq!(decode.num_in_flight(), LOADS, "the loads wait for the prefill engine's confirmation");
}
