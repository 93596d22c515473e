#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use super::*;
use kvx_core::{BlockList, DlistOwner, ErrorKind, HostMemory, KvMemory, MemKind};
use kvx_loopback::Fabric;

/// Python's constructor takes the four essential arguments and any other option by keyword:
/// those left out (None) are `WorkerOptions::new`'s defaults, those given are kept.
#[test]
fn options_left_out_in_python_take_the_rust_defaults() {
    let defaults = WorkerOptions::new("e", 16, "10.0.0.1", 5700);
    let none = WorkerOptions::py_new(
        "e".into(),
        16,
        "10.0.0.1".into(),
        5700,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    );
    assert_eq!(format!("{none:?}"), format!("{defaults:?}"));
    let given = WorkerOptions::py_new(
        "e".into(),
        16,
        "10.0.0.1".into(),
        5700,
        Some(1),
        Some(2),
        Some(8),
        Some(9),
        Some("tag".into()),
        Some(5.0),
        Some(6.0),
        Some(3),
        Some("k".repeat(16)),
        Some(0),
        Some("tcp".into()),
    );
    let expected = WorkerOptions {
        rank: 1,
        world_size: 2,
        kv_heads: Some(8),
        instance: Some(9),
        compat_tag: "tag".into(),
        handshake_timeout_s: 5.0,
        lease_duration_s: 6.0,
        runtime_threads: 3,
        auth_key: Some("k".repeat(16)),
        metrics_port: Some(0),
        discovery: Some("tcp".into()),
        ..defaults
    };
    assert_eq!(format!("{given:?}"), format!("{expected:?}"));
}

/// Closing gives the agent back every registration of the tensors, while the worker (the
/// Python object) still lives: a list over them is refused, and only the test still holds
/// the agent.
#[test]
fn close_deregisters_the_tensors_while_the_worker_lives() {
    let agent = Arc::new(Fabric::new().agent("vllm-worker").unwrap());
    let options =
        WorkerOptions { handshake_timeout_s: 5.0, ..WorkerOptions::new("engine", 4, "127.0.0.1", 0) };
    let mut worker = Worker::create(&options, agent.clone()).unwrap();
    assert!(worker.take_load_times().unwrap().is_empty(), "nothing loaded yet");
    assert!(worker.take_transfers().unwrap().is_empty(), "nothing read yet");
    // Two layers of 8 blocks, packed: (blocks, heads, block_size, 2 * head_dim), 1-byte elements.
    let shape = vec![8, 2, 4, 8];
    let tensors: Vec<HostMemory> = (0..2).map(|_| HostMemory::new(8 * 2 * 4 * 8).unwrap()).collect();
    let layers = tensors.iter().map(|t| (t.region().addr, t.region().len, shape.clone(), 1)).collect();
    assert_eq!(worker.register_kv_caches(layers).unwrap(), "Packed");
    let over = |t: &HostMemory| BlockList {
        kind: MemKind::Dram,
        device: 0,
        bases: vec![t.region().addr],
        num_blocks: 8,
        block_len: 64,
    };
    for t in &tensors {
        agent.prep_dlist(&DlistOwner::Local, &over(t)).unwrap();
    }

    worker.shut_down();
    for t in &tensors {
        let e = agent.prep_dlist(&DlistOwner::Local, &over(t)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "still registered: {e}");
    }
    assert_eq!(Arc::strong_count(&agent), 1, "the worker let its agent go");
    assert!(worker.instance().is_err() && worker.progress().is_err(), "closed");
    assert_eq!(worker.backend(), "loopback");
    worker.shut_down();
}

/// `metrics_port` makes the worker serve its metrics: GET /metrics answers the worker's
/// families (labelled with its engine and rank) in the OpenMetrics text format, and a step
/// brings them up to date.
#[test]
fn metrics_port_serves_the_worker_metrics() {
    use std::io::{Read, Write};
    let agent = Arc::new(Fabric::new().agent("vllm-metrics").unwrap());
    let mut options = WorkerOptions {
        handshake_timeout_s: 5.0,
        metrics_port: Some(0),
        ..WorkerOptions::new("engine-m", 4, "127.0.0.1", 0)
    };
    assert_eq!(options.metrics_port, Some(0));
    let worker = Worker::create(&options, agent.clone()).unwrap();
    worker.with_state(|s| s.collect().map_err(py_err)).unwrap();
    let addr = worker.metrics_address().unwrap();
    let mut stream = std::net::TcpStream::connect(&addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvx\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains(kvx_net::metrics::CONTENT_TYPE), "{response}");
    assert!(response.contains("kvx_peers{engine=\"engine-m\",rank=\"0\"} 0"), "{response}");
    assert!(response.contains("kvx_holds_live{engine=\"engine-m\",rank=\"0\"} 0"), "{response}");
    assert!(response.ends_with("# EOF\n"), "{response}");

    // Without the option, no endpoint.
    options.metrics_port = None;
    let plain = Worker::create(&options, agent).unwrap();
    assert_eq!(plain.metrics_address(), None);
}

/// With `discovery` an etcd URL, the worker publishes its payload in etcd under its engine
/// and rank (binding no side channel), where a decode worker finds it by id.
#[test]
fn with_etcd_discovery_the_payload_is_published_in_etcd() {
    let test = "with_etcd_discovery_the_payload_is_published_in_etcd";
    let Some(etcd) = kvx_testkit::etcd::EtcdServer::start_or_skip(test) else { return };
    let agent = Arc::new(Fabric::new().agent("vllm-etcd-worker").unwrap());
    // A host this machine cannot bind (TEST-NET-1): with etcd the worker binds no side channel.
    let (host, discovery) = ("192.0.2.1", Some(etcd.url()));
    let options =
        WorkerOptions { handshake_timeout_s: 5.0, discovery, ..WorkerOptions::new("prefill-7", 4, host, 1) };
    let mut worker = Worker::create(&options, agent).unwrap();
    let tensor = HostMemory::new(8 * 2 * 4 * 8).unwrap();
    let layers = vec![(tensor.region().addr, tensor.region().len, vec![8, 2, 4, 8], 1)];
    worker.register_kv_caches(layers).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let payload = rt.block_on(async {
        let config = EtcdConfig::new(kvx_etcd::EtcdUrl::parse(&etcd.url()).unwrap());
        let decode = EtcdExchange::connect(config, &"decode".into(), 0).await.unwrap();
        let peer = kvx_core::PeerLocator { engine_id: "prefill-7".into(), rank: 0, endpoint: None };
        decode.fetch(&peer, Duration::from_secs(30)).await.unwrap()
    });
    let payload = wire::decode::<wire::HandshakePayload>(&payload).unwrap();
    assert_eq!(payload.instance, worker.instance().unwrap());
    worker.shut_down();
}

#[test]
fn the_pump_signal_wakes_once_per_notification_and_stops_when_told() {
    let signal = PumpSignal::default();
    assert_eq!(signal.wait(Duration::from_millis(1)), (false, false), "nothing came: the period ran out");
    signal.set(|flags| flags.0 = true);
    assert_eq!(signal.wait(Duration::from_secs(60)), (true, false));
    assert_eq!(signal.wait(Duration::from_millis(1)), (false, false), "a wake is taken once");
    signal.set(|flags| flags.1 = true);
    assert_eq!(signal.wait(Duration::from_secs(60)), (false, true));
}

/// While the engine calls in (never quiet here), a notification is still taken at once: the
/// agent wakes the pump, which steps the worker. Without the wake it would wait for the engine.
#[test]
fn a_notification_wakes_the_pump_while_the_engine_is_busy() {
    let fabric = Fabric::new();
    let agent = Arc::new(fabric.agent("vllm-woken").unwrap());
    let peer = fabric.agent("vllm-peer").unwrap();
    let options = WorkerOptions::new("woken", 16, "127.0.0.1", 0);
    let worker = Worker::create(&options, agent.clone()).unwrap();
    let busy = Instant::now() + Duration::from_secs(3600);
    worker
        .with_state(|s| {
            s.last_call = busy;
            Ok(())
        })
        .unwrap();
    let to = peer.load_remote(&agent.local_metadata().unwrap()).unwrap();
    peer.notify(&to, b"not a kvx message").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while worker.with_state(|s| Ok(s.driver.worker().stats().stray_notifications)).unwrap() == 0 {
        assert!(Instant::now() < deadline, "the notification was not taken within 30 s");
        std::thread::yield_now();
    }
}
