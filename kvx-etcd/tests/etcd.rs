//! `EtcdExchange` against a real etcd server (Debian's `etcd-server`, started per test on free
//! 127.0.0.1 ports by `kvx_testkit::etcd::EtcdServer`). Without `etcd` the tests print why they
//! skip, unless `KVX_REQUIRE_ETCD=1`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, EventType, PutOptions};
use kvx_core::{
    AuthKey, EngineId, ErrorKind, MetadataExchange, PeerLocator, RequestId, TransferAgent, TransferParams,
};
use kvx_etcd::{EtcdConfig, EtcdExchange, EtcdUrl};
use kvx_loopback::Fabric;
use kvx_testkit::etcd::EtcdServer;
use kvx_testkit::matrix::{assert_clean, assert_failed};
use kvx_testkit::sim::{
    Cluster, EngineConfig, Exchanges, InProcessSideChannels, ModelSpec, RequestState, SideChannel,
    SimBackend, SimEngine,
};
use tokio::runtime::Runtime;

/// The bound of every wait here (a failure bound, not a measurement).
const T: Duration = Duration::from_secs(30);

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The test's etcd server and an exchange configuration for it; `None` when the test skips.
fn etcd(test: &str) -> Option<(EtcdServer, EtcdConfig)> {
    let server = EtcdServer::start_or_skip(test)?;
    let config = EtcdConfig::new(EtcdUrl::parse(&server.url()).unwrap());
    Some((server, config))
}

fn peer(engine: &str, rank: u32) -> PeerLocator {
    PeerLocator { engine_id: engine.into(), rank, endpoint: None }
}

async fn exchange(config: &EtcdConfig, engine: &str, rank: u32) -> EtcdExchange {
    EtcdExchange::connect(config.clone(), &engine.into(), rank).await.unwrap()
}

#[test]
fn a_published_payload_is_fetched_by_engine_id_and_rank() {
    let Some((_server, config)) = etcd("a_published_payload_is_fetched_by_engine_id_and_rank") else {
        return;
    };
    runtime().block_on(async {
        let prefill = [exchange(&config, "prefill", 0).await, exchange(&config, "prefill", 1).await];
        assert_eq!(prefill[1].key(), "/kvx/handshake/prefill/1");
        prefill[0].publish(b"rank-0".to_vec()).await.unwrap();
        prefill[1].publish(b"rank-1".to_vec()).await.unwrap();
        let decode = exchange(&config, "decode", 0).await;
        assert_eq!(decode.fetch(&peer("prefill", 0), T).await.unwrap(), b"rank-0");
        assert_eq!(decode.fetch(&peer("prefill", 1), T).await.unwrap(), b"rank-1");
        // An endpoint in the locator changes nothing: etcd finds the peer by id.
        let with_endpoint =
            PeerLocator { endpoint: Some(kvx_core::Endpoint::new("10.9.9.9", 1)), ..peer("prefill", 1) };
        assert_eq!(decode.fetch(&with_endpoint, T).await.unwrap(), b"rank-1");
        let e = decode.fetch(&peer("prefill", 2), T).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Handshake, "no rank 2: {e}");
        // Publishing again replaces the payload under the same lease.
        let lease = prefill[0].lease_id().unwrap();
        prefill[0].publish(b"rank-0, again".to_vec()).await.unwrap();
        assert_eq!(prefill[0].lease_id(), Some(lease));
        assert_eq!(decode.fetch(&peer("prefill", 0), T).await.unwrap(), b"rank-0, again");
        // Closing revokes the lease: the entry is gone at once.
        prefill[0].close().await.unwrap();
        let e = decode.fetch(&peer("prefill", 0), T).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Handshake, "{e}");
    });
}

#[test]
fn fetching_an_unknown_engine_fails_typed_and_bounded() {
    let Some((server, config)) = etcd("fetching_an_unknown_engine_fails_typed_and_bounded") else { return };
    runtime().block_on(async {
        let decode = exchange(&config, "decode", 0).await;
        let nobody = peer("nobody", 0);
        let fetch = decode.fetch(&nobody, Duration::from_secs(5));
        let e = tokio::time::timeout(T, fetch).await.expect("the fetch hung").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Handshake, "{e}");
        assert!(e.to_string().contains("engine \"nobody\" rank 0 is not registered"), "{e}");
    });
    // A cluster that is not there: connecting fails within its bound.
    let gone = EtcdConfig { timeout: Duration::from_secs(2), ..config };
    drop(server);
    runtime().block_on(async {
        let decode: EngineId = "decode".into();
        let connect = EtcdExchange::connect(gone, &decode, 0);
        let e = tokio::time::timeout(T, connect).await.expect("connecting hung").unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Io | ErrorKind::Timeout), "{e}");
    });
}

#[test]
fn a_restarted_engine_s_payload_replaces_the_old_one() {
    let Some((_server, config)) = etcd("a_restarted_engine_s_payload_replaces_the_old_one") else { return };
    runtime().block_on(async {
        let old = exchange(&config, "prefill", 0).await;
        old.publish(b"first start".to_vec()).await.unwrap();
        let decode = exchange(&config, "decode", 0).await;
        assert_eq!(decode.fetch(&peer("prefill", 0), T).await.unwrap(), b"first start");
        let new = exchange(&config, "prefill", 0).await;
        new.publish(b"second start".to_vec()).await.unwrap();
        assert_ne!(old.lease_id(), new.lease_id());
        assert_eq!(decode.fetch(&peer("prefill", 0), T).await.unwrap(), b"second start");
        // The old start's lease ending does not take the new start's entry with it.
        old.close().await.unwrap();
        assert_eq!(decode.fetch(&peer("prefill", 0), T).await.unwrap(), b"second start");
    });
}

#[test]
fn a_dead_engine_s_entry_disappears_after_its_lease_ttl() {
    let Some((_server, config)) = etcd("a_dead_engine_s_entry_disappears_after_its_lease_ttl") else {
        return;
    };
    // etcd's shortest lease is about 1.5 s.
    let config = EtcdConfig { lease_ttl: Duration::from_secs(2), ..config };
    let rt = runtime();
    // A live engine, published before the one that dies and with the same TTL: only its
    // keep-alives keep its entry once the other's has expired.
    let (live, decode, mut deletes) = rt.block_on(async {
        let live = exchange(&config, "live", 0).await;
        live.publish(b"alive".to_vec()).await.unwrap();
        let mut watcher = Client::connect(config.url.client_endpoints(), None).await.unwrap();
        let deletes = watcher.watch("/kvx/handshake/doomed/0", None).await.unwrap();
        (live, exchange(&config, "decode", 0).await, deletes)
    });
    // The engine that dies runs on a runtime of its own; dropping that runtime stops its
    // keep-alive and leaves nothing to revoke its lease: a crash.
    let crash_rt = runtime();
    let doomed = crash_rt.block_on(async {
        let doomed = exchange(&config, "doomed", 0).await;
        doomed.publish(b"soon gone".to_vec()).await.unwrap();
        doomed
    });
    rt.block_on(async {
        assert_eq!(decode.fetch(&peer("doomed", 0), T).await.unwrap(), b"soon gone");
    });
    drop(crash_rt);
    drop(doomed);
    rt.block_on(async {
        let deleted = async {
            while let Some(response) = deletes.message().await.unwrap() {
                if response.events().iter().any(|e| e.event_type() == EventType::Delete) {
                    return;
                }
            }
            panic!("the watch ended without a delete");
        };
        tokio::time::timeout(T, deleted).await.expect("the dead engine's entry was not deleted");
        let e = decode.fetch(&peer("doomed", 0), T).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Handshake, "{e}");
        assert_eq!(decode.fetch(&peer("live", 0), T).await.unwrap(), b"alive", "kept alive");
        drop(live);
    });
}

#[test]
fn a_lease_revoked_behind_the_exchange_s_back_is_replaced_at_the_next_publish() {
    let test = "a_lease_revoked_behind_the_exchange_s_back_is_replaced_at_the_next_publish";
    let Some((_server, config)) = etcd(test) else { return };
    runtime().block_on(async {
        let prefill = exchange(&config, "prefill", 0).await;
        prefill.publish(b"first".to_vec()).await.unwrap();
        let lease = prefill.lease_id().unwrap();
        let mut admin = Client::connect(config.url.client_endpoints(), None).await.unwrap();
        admin.lease_revoke(lease).await.unwrap();
        let decode = exchange(&config, "decode", 0).await;
        assert_eq!(decode.fetch(&peer("prefill", 0), T).await.unwrap_err().kind(), ErrorKind::Handshake);
        prefill.publish(b"again".to_vec()).await.unwrap();
        assert_ne!(prefill.lease_id(), Some(lease), "a new lease");
        assert_eq!(decode.fetch(&peer("prefill", 0), T).await.unwrap(), b"again");
    });
}

#[test]
fn payloads_over_the_limit_are_neither_published_nor_accepted() {
    let test = "payloads_over_the_limit_are_neither_published_nor_accepted";
    let Some((_server, config)) = etcd(test) else { return };
    let config = EtcdConfig { max_payload: 1000, ..config };
    runtime().block_on(async {
        let prefill = exchange(&config, "prefill", 0).await;
        let e = prefill.publish(vec![1; 1001]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        prefill.publish(vec![1; 1000]).await.unwrap();
        // Someone else wrote an oversized value under an engine's key.
        let mut client = Client::connect(config.url.client_endpoints(), None).await.unwrap();
        client.put("/kvx/handshake/huge/0", vec![0u8; 4096], Some(PutOptions::new())).await.unwrap();
        let decode = exchange(&config, "decode", 0).await;
        let e = decode.fetch(&peer("huge", 0), T).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "{e}");
        assert_eq!(decode.fetch(&peer("prefill", 0), T).await.unwrap().len(), 1000);
    });
}

#[test]
fn with_a_key_only_entries_sealed_under_it_for_their_own_key_are_accepted() {
    let test = "with_a_key_only_entries_sealed_under_it_for_their_own_key_are_accepted";
    let Some((_server, config)) = etcd(test) else { return };
    let keyed = |k: &str| EtcdConfig { auth_key: Some(AuthKey::new(k).unwrap()), ..config.clone() };
    let (ours, theirs) = (keyed("the-deployment-key"), keyed("another-deployment-key"));
    runtime().block_on(async {
        let prefill = exchange(&ours, "prefill", 0).await;
        prefill.publish(b"sealed".to_vec()).await.unwrap();
        let decode = exchange(&ours, "decode", 0).await;
        assert_eq!(decode.fetch(&peer("prefill", 0), T).await.unwrap(), b"sealed");
        // The entry as stored: the tag, then the payload.
        let mut client = Client::connect(ours.url.client_endpoints(), None).await.unwrap();
        let stored = client.get("/kvx/handshake/prefill/0", None).await.unwrap().kvs()[0].value().to_vec();
        assert_eq!(&stored[32..], b"sealed");
        // Copied under another engine's key, written without a key or with another key, or cut
        // short: refused before anyone uses it.
        client.put("/kvx/handshake/copy/0", stored.clone(), None).await.unwrap();
        client.put("/kvx/handshake/bare/0", b"sealed".to_vec(), None).await.unwrap();
        client.put("/kvx/handshake/short/0", stored[..31].to_vec(), None).await.unwrap();
        let stranger = exchange(&theirs, "stranger", 0).await;
        stranger.publish(b"sealed".to_vec()).await.unwrap();
        for engine in ["copy", "bare", "short", "stranger"] {
            let e = decode.fetch(&peer(engine, 0), T).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Unauthenticated, "{engine}: {e}");
        }
    });
}

/// Side channels that are etcd exchanges with `config`.
fn through_etcd(config: &EtcdConfig) -> SideChannel {
    let config = config.clone();
    SideChannel::ById(Exchanges::new(move |engine: &EngineId, rank, runtime| {
        let exchange = runtime.block_on(EtcdExchange::connect(config.clone(), engine, rank))?;
        Ok(Arc::new(exchange) as Arc<dyn MetadataExchange>)
    }))
}

/// A sim engine with TP=2 on `side_channel`, over `fabric` (loopback).
fn sim_engine(name: &str, side_channel: SideChannel, fabric: &Fabric, model: &ModelSpec) -> SimEngine {
    let config = EngineConfig {
        side_channel,
        ..EngineConfig::new(name, 2, 256, model.clone(), &InProcessSideChannels::new())
    };
    let fabric = fabric.clone();
    let backend = SimBackend::new(move |engine: &EngineId, rank| {
        Ok(Arc::new(fabric.agent(format!("{engine}-{rank}"))?) as Arc<dyn TransferAgent>)
    });
    SimEngine::new(config, &backend).unwrap()
}

#[test]
fn sim_engines_find_each_other_through_etcd_without_host_or_port() {
    let test = "sim_engines_find_each_other_through_etcd_without_host_or_port";
    let Some((_server, config)) = etcd(test) else { return };
    let (fabric, model) = (Fabric::new(), ModelSpec::standard(2, 4, 8, 16));
    let prefill = sim_engine("prefill", through_etcd(&config), &fabric, &model);
    let decode = sim_engine("decode", through_etcd(&config), &fabric, &model);
    let handed: Arc<Mutex<Vec<TransferParams>>> = Arc::default();
    let seen = Arc::clone(&handed);
    let mut c = Cluster::new(vec![prefill], decode).unwrap().with_client(move |request| {
        seen.lock().unwrap().push(request.3.clone());
        vec![request]
    });
    for i in 0..8u32 {
        let prompt: Vec<u32> = (0..16 * (i as usize + 1) + 3).map(|t| (t as u32 * 7 + i) % 1000).collect();
        c.submit(format!("etcd-{i}").into(), prompt, 2).unwrap();
    }
    c.run_until_idle(T).unwrap();
    assert_clean(&c);
    let handed = handed.lock().unwrap();
    assert_eq!(handed.len(), 8);
    for params in handed.iter() {
        assert_eq!((&params.remote_host, params.remote_port), (&None, None), "{params:?}");
        assert_eq!(params.remote_engine_id, Some("prefill".into()));
    }
    let stats = c.decodes[0].stats();
    assert_eq!(stats.tokens_loaded, 16 * (1..=8).sum::<u64>());
    assert!(stats.bytes_verified > 0 && stats.blocks_mismatched == 0, "{stats:?}");
    assert!(c.decodes[0].worker_stats().iter().all(|w| w.handshakes == 1 && w.failed_loads == 0));
}

/// A decode engine on TCP side channels cannot find a prefill engine by id: the request whose
/// params carry no host or port fails with `InvalidArgument`, and nothing is read.
#[test]
fn params_without_host_or_port_fail_typed_on_a_tcp_side_channel() {
    let Some((_server, config)) = etcd("params_without_host_or_port_fail_typed_on_a_tcp_side_channel") else {
        return;
    };
    let (fabric, model) = (Fabric::new(), ModelSpec::standard(2, 4, 8, 16));
    let prefill = sim_engine("prefill", through_etcd(&config), &fabric, &model);
    let tcp = SideChannel::Tcp { host: "127.0.0.1".into(), port: 0, advertise_host: None };
    let mut c = Cluster::new(vec![prefill], sim_engine("decode", tcp, &fabric, &model)).unwrap();
    let id = RequestId::new("by-id");
    c.submit(id.clone(), (0..3 * 16).collect(), 2).unwrap();
    let deadline = Instant::now() + T;
    while !matches!(c.decodes[0].state(&id), Some(RequestState::Failed(_))) {
        assert!(Instant::now() < deadline, "the request did not fail: {:?}", c.decodes[0].state(&id));
        c.step().unwrap();
    }
    let e = assert_failed(&c.decodes[0], &id, &[ErrorKind::InvalidArgument]);
    assert!(e.to_string().contains("TCP side channel"), "{e}");
    assert!(c.decodes[0].worker_stats().iter().all(|w| w.reads_posted == 0));
}
