//! Control-plane costs, with criterion: the scheduler hooks of one request (100 / 1000 / 10000
//! blocks), the same request's hooks while 100 / 1000 / 10000 other requests are in flight (a
//! per-request cost that should not grow with them), and a decode worker's `get_finished` step
//! while 0 / 100 / 1000 / 10000 READs are in flight.
//!
//! The agent is `kvx_core::testing::NoopAgent`, which moves no bytes and never completes a READ:
//! these are kvx-core's own costs. (Posting READs and first contact with a peer have their own benches.)
//!
//! `cargo bench -p kvx-core --bench control_plane`
#![allow(clippy::unwrap_used, clippy::expect_used)] // Benchmark driver: panics are failures.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvx_core::testing::NoopAgent;
use kvx_core::{
    BlockId, ConnectorMetadata, ConnectorScheduler, ConnectorWorker, Endpoint, FinishReason, Finished,
    GroupBlocks, HostMemory, LayerCache, RemoteCoordinates, RequestId, SchedulerConfig, TransferParams,
    WorkerCommand, WorkerConfig,
};

/// Tokens per block.
const BS: u32 = 16;
/// Blocks of each worker's KV cache (room for the largest request).
const CACHE_BLOCKS: u32 = 10_000;
/// Blocks of each request that stays in flight while the measured one runs.
const IN_FLIGHT_BLOCKS: usize = 16;

/// The prefill engine's and the decode engine's schedulers.
struct Schedulers {
    prefill: ConnectorScheduler,
    decode: ConnectorScheduler,
}

impl Schedulers {
    fn new(instance: Option<u64>) -> Self {
        let mut prefill =
            SchedulerConfig::new("prefill".into(), BS, Some(Endpoint::new("127.0.0.1", 17_500)));
        prefill.instance = instance;
        let decode = SchedulerConfig::new("decode".into(), BS, Some(Endpoint::new("127.0.0.1", 17_600)));
        Schedulers {
            prefill: ConnectorScheduler::new(prefill).unwrap(),
            decode: ConnectorScheduler::new(decode).unwrap(),
        }
    }

    /// The prefill side finishes `id` (`blocks` full blocks) and holds it: the params the client
    /// carries to the decode engine, and the prefill workers' metadata.
    fn prefill_finishes(
        &mut self,
        id: &RequestId,
        blocks: usize,
        now: Instant,
    ) -> (TransferParams, ConnectorMetadata) {
        let held = TransferParams { do_remote_decode: true, ..Default::default() };
        let ids: Vec<BlockId> = (0..blocks as BlockId).collect();
        let tokens = blocks * BS as usize;
        let out = self.prefill.request_finished(
            id,
            Some(&held),
            FinishReason::LengthCapped,
            tokens,
            &[GroupBlocks::whole(ids)],
        );
        (out.params.unwrap(), self.prefill.build_connector_meta(now))
    }

    /// The decode side's hooks for a request with `params`, up to the metadata its workers get.
    fn decode_starts(&mut self, id: &RequestId, params: &TransferParams, now: Instant) -> ConnectorMetadata {
        let mut params = params.clone();
        let offered = params.remote_block_ids.as_ref().map_or(0, |g| g[0].len());
        let tokens = offered * BS as usize;
        self.decode.on_new_request(id, Some(&params));
        let matched = self.decode.get_num_new_matched_tokens(id, tokens + 1, Some(&params), 0).unwrap();
        let local = [GroupBlocks::whole((0..offered as BlockId).collect())];
        self.decode
            .update_state_after_alloc(id, tokens + 1, Some(&mut params), &local, 0, matched.count)
            .unwrap();
        self.decode.build_connector_meta(now)
    }

    /// One request's whole life in both schedulers: held on the prefill side, loaded on the decode
    /// side, both reported finished.
    fn request(&mut self, id: &RequestId, blocks: usize, now: Instant) {
        let (params, prefill_meta) = self.prefill_finishes(id, blocks, now);
        let decode_meta = self.decode_starts(id, &params, now);
        self.decode.update_finished(&Finished { recving: vec![id.clone()], ..Default::default() });
        let local: Vec<BlockId> = (0..blocks as BlockId).collect();
        let tokens = blocks * BS as usize;
        let local = [GroupBlocks::whole(local)];
        black_box(self.decode.request_finished(id, None, FinishReason::Stopped, tokens + 1, &local));
        self.prefill.update_finished(&Finished { sending: vec![id.clone()], ..Default::default() });
        black_box((prefill_meta, decode_meta));
    }

    /// `n` requests left in flight: held by the prefill side, loading on the decode side.
    fn in_flight(&mut self, n: usize, now: Instant) -> Vec<ConnectorMetadata> {
        (0..n)
            .map(|i| {
                let id = RequestId::from(format!("in-flight-{i}"));
                let (params, _) = self.prefill_finishes(&id, IN_FLIGHT_BLOCKS, now);
                self.decode_starts(&id, &params, now)
            })
            .collect()
    }
}

fn scheduler_request(c: &mut Criterion) {
    let mut group = c.benchmark_group("scheduler_request_blocks");
    let now = Instant::now();
    for blocks in [100, 1000, 10_000] {
        let mut s = Schedulers::new(None);
        let id = RequestId::from("req");
        group.bench_function(BenchmarkId::from_parameter(blocks), |b| b.iter(|| s.request(&id, blocks, now)));
        assert!(s.prefill.is_idle() && s.decode.is_idle());
    }
    group.finish();
}

fn scheduler_concurrent(c: &mut Criterion) {
    let mut group = c.benchmark_group("scheduler_request_100_blocks_concurrent");
    let now = Instant::now();
    for concurrent in [100, 1000, 10_000] {
        let mut s = Schedulers::new(None);
        s.in_flight(concurrent, now);
        let id = RequestId::from("req");
        group
            .bench_function(BenchmarkId::from_parameter(concurrent), |b| b.iter(|| s.request(&id, 100, now)));
        assert_eq!((s.prefill.num_sending(), s.decode.num_recving()), (concurrent, concurrent));
    }
    group.finish();
}

/// A worker of `engine` over a stub agent, its one layer's cache registered.
fn worker(engine: &str, port: u16) -> ConnectorWorker {
    let config = WorkerConfig {
        side_channel: Some(RemoteCoordinates::at(engine, "127.0.0.1", port)),
        ..WorkerConfig::new(engine.into(), 0, 1, BS)
    };
    let mut w = ConnectorWorker::new(config, Arc::new(NoopAgent::new(engine))).unwrap();
    let memory = Arc::new(HostMemory::new((2 * CACHE_BLOCKS * BS * 2) as usize).unwrap());
    let cache = LayerCache {
        memory,
        shape: vec![2, u64::from(CACHE_BLOCKS), u64::from(BS), 1, 2],
        elem_size: 1,
        window: None,
    };
    w.register_kv_caches(&[cache]).unwrap();
    w
}

fn worker_get_finished(c: &mut Criterion) {
    let mut group = c.benchmark_group("worker_get_finished_reads_in_flight");
    let now = Instant::now();
    for in_flight in [0, 100, 1000, 10_000] {
        let prefill = worker("prefill", 17_500);
        let mut decode = worker("decode", 17_600);
        let mut s = Schedulers::new(Some(prefill.instance()));
        // A first request makes the decode worker ask for the prefill worker's handshake.
        for meta in s.in_flight(in_flight.max(1), now) {
            decode.start_load_kv(now, &meta);
        }
        while let Some(WorkerCommand::FetchHandshake(_)) = decode.poll_command() {
            let payload = prefill.handshake_payload().unwrap().to_vec();
            decode.handle_handshake(now, &"prefill".into(), 0, Ok(payload));
        }
        assert_eq!(decode.num_in_flight(), in_flight.max(1));
        if in_flight == 0 {
            decode.close().unwrap();
            decode = worker("decode", 17_600);
        }
        group.bench_function(BenchmarkId::from_parameter(in_flight), |b| {
            b.iter(|| black_box(decode.get_finished(now)))
        });
        assert_eq!(decode.num_in_flight(), in_flight);
    }
    group.finish();
}

criterion_group!(benches, scheduler_request, scheduler_concurrent, worker_get_finished);
criterion_main!(benches);
