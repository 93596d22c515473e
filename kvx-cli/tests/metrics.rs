//! The metrics behind `kvx prefill/decode --metrics-port`: sim engines on the loopback backend with
//! real TCP side channels, their metrics served on 127.0.0.1, scraped over TCP after the run and
//! checked against what the engines moved.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use kvx_core::{EngineId, RequestId, TransferAgent};
use kvx_loopback::Fabric;
use kvx_net::metrics::{CONTENT_TYPE, Metrics, serve};
use kvx_testkit::sim::{
    Cluster, EngineConfig, EngineMetrics, InProcessSideChannels, ModelSpec, SideChannel, SimBackend,
    SimEngine,
};

const LIMIT: Duration = Duration::from_secs(60);
const BS: usize = 16;
const REQUESTS: usize = 12;

/// `GET path` over a fresh connection: the status line and headers, and the body.
fn get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(LIMIT)).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: kvx\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

/// The sum of a metric's samples for `engine` (over its ranks), `None` if it has none.
fn total(text: &str, name: &str, engine: &str) -> Option<f64> {
    let label = format!("engine=\"{engine}\"");
    let values: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(&label))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

fn engine(id: &str, fabric: &Fabric) -> SimEngine {
    let fabric = fabric.clone();
    let backend = SimBackend::new(move |engine: &EngineId, rank| {
        Ok(Arc::new(fabric.agent(format!("{engine}-{rank}"))?) as Arc<dyn TransferAgent>)
    });
    let model = ModelSpec::standard(2, 4, 8, BS as u32);
    let config = EngineConfig {
        side_channel: SideChannel::Tcp { host: "127.0.0.1".into(), advertise_host: None, port: 0 },
        ..EngineConfig::new(id, 2, 512, model, &InProcessSideChannels::new())
    };
    SimEngine::new(config, &backend).unwrap()
}

#[test]
fn metrics_scraped_after_a_run_match_what_the_engines_moved() {
    let fabric = Fabric::new();
    let mut c = Cluster::new(vec![engine("prefill", &fabric)], engine("decode", &fabric)).unwrap();
    let metrics = Metrics::new();
    let mut prefill = EngineMetrics::new(&metrics, &c.prefills[0]);
    let mut decode = EngineMetrics::new(&metrics, &c.decodes[0]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let server = rt.block_on(serve("127.0.0.1", 0, metrics.registry())).unwrap();

    for i in 0..REQUESTS {
        // Distinct prompts of at least two full blocks: every request loads.
        let prompt = (0..2 * BS + i).map(|t| (t * 31 + i * 7919) as u32 % kvx_testkit::sim::VOCAB).collect();
        c.submit(RequestId::new(format!("m-{i}")), prompt, 2).unwrap();
    }
    c.run_until_idle_with(LIMIT, |c| {
        prefill.observe(&c.prefills[0]);
        decode.observe(&c.decodes[0]);
    })
    .unwrap();
    prefill.observe(&c.prefills[0]);
    decode.observe(&c.decodes[0]);
    assert_eq!((c.decodes[0].stats().finished, c.decodes[0].stats().failed), (REQUESTS as u64, 0));

    let (head, text) = get(server.local_addr(), "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains(&format!("content-type: {CONTENT_TYPE}")), "{head}");
    let m = |name: &str, engine: &str| total(&text, name, engine);
    // Every rank READ its share of every request once; nothing failed.
    let reads = (2 * REQUESTS) as f64;
    assert_eq!(m("kvx_reads_posted_total", "decode"), Some(reads), "{text}");
    assert_eq!(m("kvx_reads_done_total", "decode"), Some(reads));
    assert_eq!(m("kvx_read_duration_seconds_count", "decode"), Some(reads));
    assert_eq!(m("kvx_transfer_duration_seconds_count", "decode"), Some(reads), "every READ confirmed");
    assert_eq!(m("kvx_reads_failed_total", "decode"), Some(0.0), "no READ failed");
    assert_eq!(m("kvx_loads_failed_total", "decode"), Some(0.0));
    // The bytes the decode engine checked are the bytes the READs moved.
    let bytes = c.decodes[0].stats().bytes_verified as f64;
    assert!(bytes > 0.0);
    assert_eq!(m("kvx_read_bytes_total", "decode"), Some(bytes));
    let descriptors: u64 = c.decodes[0].worker_stats().iter().map(|w| w.descriptors).sum();
    assert_eq!(m("kvx_read_descriptors_total", "decode"), Some(descriptors as f64));
    // One handshake per decode rank with its prefill rank; both sides' peers are ready.
    assert_eq!(m("kvx_handshakes_total", "decode"), Some(2.0));
    assert_eq!(m("kvx_handshake_duration_seconds_count", "decode"), Some(2.0));
    assert_eq!(m("kvx_peers", "decode"), Some(2.0));
    // The prefill engine held every request's blocks until its reader released them.
    assert_eq!(m("kvx_holds_released_total", "prefill"), Some(reads));
    assert_eq!(m("kvx_holds_live", "prefill"), Some(0.0));
    assert_eq!(m("kvx_holds_expired_total", "prefill"), Some(0.0));
    assert_eq!(m("kvx_loads_in_flight", "decode"), Some(0.0));
    // The decode ranks fetched the prefill ranks' payloads over their side channels.
    assert_eq!(m("kvx_side_channel_accepted_total", "prefill"), Some(2.0));
    assert!(text.ends_with("# EOF\n"));

    let (head, _) = get(server.local_addr(), "/other");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    rt.block_on(server.shutdown(LIMIT)).unwrap();
}
