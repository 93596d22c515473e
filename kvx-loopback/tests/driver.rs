//! `WorkerDriver` against kvx-core's mockall mocks of `MetadataExchange` and `ParallelGroup`, with
//! real loopback agents: what the driver publishes and fetches, how rank 0 aggregates, and
//! handshakes polled on the step thread under a manual clock.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::mock::{MockMetadataExchange, MockParallelGroup};
use kvx_core::{
    Clock, ConnectorMetadata, ConnectorWorker, Endpoint, ErrorKind, Finished, GroupBlocks, HeldRequest,
    HexBytes, HostMemory, LayerCache, ManualClock, MetadataExchange, PeerLocator, RankReport, RecvRequest,
    RemoteCoordinates, RequestId, SingleRank, WorkerConfig,
};
use kvx_loopback::Fabric;
use kvx_net::{Handshakes, WorkerDriver};

fn layer() -> Vec<LayerCache> {
    let memory = Arc::new(HostMemory::new(2 * 8 * 64).unwrap());
    vec![LayerCache { memory, shape: vec![2, 8, 4, 2, 8], elem_size: 1, window: None }]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
}

#[test]
fn driver_publishes_fetches_at_base_port_plus_rank_and_aggregates_on_rank0() {
    let endpoint = Some(Endpoint::new("10.0.0.1", 5601));
    rank1_loads_through_the_exchange(RemoteCoordinates::at("prefill", "10.0.0.1", 5600), endpoint);
}

#[test]
fn params_without_an_endpoint_fetch_by_engine_id_and_rank() {
    rank1_loads_through_the_exchange(RemoteCoordinates::by_id("prefill"), None);
}

/// Decode rank 1 loads a block from `remote`: its driver publishes, fetches rank 1 of "prefill" at
/// `endpoint` from its exchange, posts the READ and sends its reports to rank 0.
fn rank1_loads_through_the_exchange(remote: RemoteCoordinates, endpoint: Option<Endpoint>) {
    let rt = runtime();
    let fabric = Fabric::new();

    // The prefill rank 1 registers and its payload is what the decode rank 1 will fetch.
    let mut prefill = ConnectorWorker::new(
        WorkerConfig::new("prefill".into(), 1, 2, 4),
        Arc::new(fabric.agent("prefill-1").unwrap()),
    )
    .unwrap();
    let payload = prefill.register_kv_caches(&layer()).unwrap();

    let mut exchange = MockMetadataExchange::new();
    exchange.expect_publish().times(1).returning(|_| Ok(()));
    let fetched = payload.clone();
    exchange
        .expect_fetch()
        .withf(move |peer, timeout| {
            *peer == PeerLocator { engine_id: "prefill".into(), rank: 1, endpoint: endpoint.clone() }
                && *timeout == Duration::from_secs(5)
        })
        .times(1)
        .returning(move |_, _| Ok(fetched.clone()));

    // Rank 1 of the decode engine, whose group sends its reports to rank 0.
    let mut group = MockParallelGroup::new();
    group.expect_world_size().return_const(2u32);
    group.expect_gather_finished().returning(|_| Ok(None));

    let side_channel = RemoteCoordinates::at("decode", "10.0.0.2", 5700);
    let worker = ConnectorWorker::new(
        WorkerConfig { side_channel: Some(side_channel), ..WorkerConfig::new("decode".into(), 1, 2, 4) },
        Arc::new(fabric.agent("decode-1").unwrap()),
    )
    .unwrap();
    let mut driver = WorkerDriver::new(worker, Arc::new(exchange), Arc::new(group), rt.handle().clone());
    driver.register_kv_caches(&layer()).unwrap();

    driver.start_load_kv(&one_load(remote));
    // The fetch runs on the runtime; the result is fed at a later call.
    driver.wait_for_handshakes(Duration::from_secs(5));
    let deadline = Instant::now() + Duration::from_secs(5);
    while driver.worker().stats().reads_posted == 0 {
        assert!(Instant::now() < deadline, "the READ was not posted");
        // Rank 1 reports to rank 0: it returns nothing itself.
        assert!(driver.get_finished().unwrap().is_empty());
    }
    assert_eq!(driver.worker().stats().handshakes, 1);
}

#[test]
fn rank0_returns_ids_only_once_the_other_rank_reported_them() {
    let rt = runtime();
    let fabric = Fabric::new();
    let mut exchange = MockMetadataExchange::new();
    exchange.expect_publish().returning(|_| Ok(()));
    let mut group = MockParallelGroup::new();
    group.expect_world_size().return_const(2u32);
    let other = |ids: &[&str]| Finished {
        sending: ids.iter().map(|s| RequestId::new(*s)).collect(),
        ..Default::default()
    };
    // Rank 1 reports "a" in the first step, "b" in the second.
    let mut steps = vec![other(&["b"]), other(&["a"])];
    group.expect_gather_finished().times(2).returning(move |own| {
        let other = steps.pop().unwrap();
        Ok(Some(vec![RankReport { rank: 0, finished: own }, RankReport { rank: 1, finished: other }]))
    });
    let worker = ConnectorWorker::new(
        WorkerConfig { lease_duration: Duration::ZERO, ..WorkerConfig::new("prefill".into(), 0, 2, 4) },
        Arc::new(fabric.agent("prefill-0").unwrap()),
    )
    .unwrap();
    let mut driver = WorkerDriver::new(worker, Arc::new(exchange), Arc::new(group), rt.handle().clone());
    driver.register_kv_caches(&layer()).unwrap();
    // Holds for "a" and "b" expire at once on this rank (hold timeout zero).
    let held = |id: &str| HeldRequest { request_id: id.into(), nonce: HexBytes([2; 16]) };
    let meta = ConnectorMetadata { reqs_to_send: vec![held("a"), held("b")], ..Default::default() };
    driver.start_load_kv(&meta);
    let first = driver.get_finished().unwrap();
    assert_eq!(first.sending, vec![RequestId::new("a")], "b is not finished on rank 1 yet");
    assert!(!driver.is_idle());
    let second = driver.get_finished().unwrap();
    assert_eq!(second.sending, vec![RequestId::new("b")]);
    assert!(driver.is_idle());
}

/// A side channel that publishes and never answers a fetch.
#[derive(Debug)]
struct Silent;

#[async_trait::async_trait]
impl MetadataExchange for Silent {
    async fn publish(&self, _payload: Vec<u8>) -> kvx_core::Result<()> {
        Ok(())
    }

    async fn fetch(&self, _peer: &PeerLocator, _timeout: Duration) -> kvx_core::Result<Vec<u8>> {
        std::future::pending().await
    }
}

/// A decode rank on `clock` whose side channel never answers (`Silent`), its KV registered.
fn silent_decode_driver(rt: &tokio::runtime::Runtime, fabric: &Fabric, clock: &ManualClock) -> WorkerDriver {
    let side_channel = RemoteCoordinates::at("decode", "h", 5700);
    let worker = ConnectorWorker::new(
        WorkerConfig { side_channel: Some(side_channel), ..WorkerConfig::new("decode".into(), 0, 1, 4) },
        Arc::new(fabric.agent("decode-0").unwrap()),
    )
    .unwrap();
    let mut driver = WorkerDriver::new(worker, Arc::new(Silent), Arc::new(SingleRank), rt.handle().clone())
        .with_clock(Arc::new(clock.clone()));
    driver.register_kv_caches(&layer()).unwrap();
    driver
}

/// One load from a prefill engine at `remote` that has not been handshaken yet.
fn one_load(remote: RemoteCoordinates) -> ConnectorMetadata {
    let req = RecvRequest {
        prompt: None,
        request_id: "r".into(),
        remote_request_id: None,
        local_block_ids: vec![GroupBlocks::whole(vec![2])],
        remote_block_ids: vec![GroupBlocks::whole(vec![5])],
        remote,
        nonce: Some(HexBytes([1; 16])),
        mac: None,
        remote_instance: None,
        remote_tp_size: None,
    };
    ConnectorMetadata { reqs_to_recv: vec![req], ..Default::default() }
}

#[test]
fn step_thread_handshakes_follow_the_driver_s_clock_and_never_wait() {
    let (rt, fabric, clock) = (runtime(), Fabric::new(), ManualClock::new());
    let mut driver = silent_decode_driver(&rt, &fabric, &clock).with_handshakes(Handshakes::OnStepThread);
    driver.start_load_kv(&one_load(RemoteCoordinates::at("prefill", "h", 5600)));
    // The fetch never answers; the step thread is never held up by it.
    driver.wait_for_handshakes(Duration::from_secs(3600));
    for _ in 0..3 {
        assert!(driver.get_finished().unwrap().is_empty());
    }
    // The handshake times out when the clock says so, not the wall.
    clock.advance(driver.worker().config().handshake_timeout);
    let failed = driver.get_finished().unwrap().failed_recving;
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].error.kind(), ErrorKind::Timeout, "{}", failed[0].error);
    assert!(driver.is_idle());
}

/// An idle engine's wait for handshakes ends at the worker's next deadline, not at the caller's
/// timeout: a handshake that never answers is failed when it is due.
#[test]
fn waiting_for_handshakes_ends_at_the_next_deadline() {
    let (rt, fabric, clock) = (runtime(), Fabric::new(), ManualClock::new());
    let mut driver = silent_decode_driver(&rt, &fabric, &clock);
    assert_eq!(driver.next_deadline(), None, "nothing is due before a load");
    driver.start_load_kv(&one_load(RemoteCoordinates::at("prefill", "h", 5600)));
    let timeout = driver.worker().config().handshake_timeout;
    assert_eq!(driver.next_deadline(), Some(clock.now() + timeout));
    clock.advance(timeout);
    // Due now: the wait returns at once instead of after the hour asked for (bounded here by a
    // watchdog so that a regression fails instead of hanging).
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        driver.wait_for_handshakes(Duration::from_secs(3600));
        let _ = done_tx.send(driver);
    });
    let mut driver = done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("wait_for_handshakes waited past the worker's deadline");
    let failed = driver.get_finished().unwrap().failed_recving;
    assert_eq!(failed.len(), 1, "the handshake that never answered failed when due");
}
