use super::*;
use kvx_core::error::ErrorKind;
use kvx_core::mock::MockTransferAgent;
use kvx_core::transfer::Capabilities;
use kvx_core::worker::WorkerConfig;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn worker(instance: u64) -> ConnectorWorker {
    let mut agent = MockTransferAgent::new();
    agent.expect_capabilities().return_const(Capabilities {
        backend: "mock",
        dram: true,
        vram: false,
        read: true,
        write: true,
        notifications: true,
    });
    let mut config = WorkerConfig::new("engine-a".into(), 1, 2, 4);
    config.instance = Some(instance);
    ConnectorWorker::new(config, Arc::new(agent)).unwrap()
}

/// The value of the sample `name{labels}` in an OpenMetrics text.
fn value(text: &str, sample: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
}

const LABELS: &str = "{engine=\"engine-a\",rank=\"1\"}";

fn sample(name: &str) -> String {
    format!("{name}{LABELS}")
}

#[test]
fn counters_add_what_changed_and_stay_monotonic_across_takes_and_new_workers() {
    let metrics = Metrics::new();
    let mut handle = metrics.worker("engine-a", 1);
    let mut w = worker(7);
    handle.observe(&w);
    let text = metrics.encode();
    assert_eq!(value(&text, &sample("kvx_holds_live")), Some(0.0));
    assert_eq!(value(&text, &sample("kvx_reads_posted_total")), Some(0.0), "the series exist at once");
    assert_eq!(value(&text, &sample("kvx_read_duration_seconds_count")), Some(0.0));

    let s = w.stats_mut();
    s.reads_posted = 3;
    s.bytes_read = 4096;
    s.read_latencies.push(Duration::from_micros(150));
    s.read_latencies.push(Duration::from_secs(2));
    s.handshake_times.push(Duration::from_millis(3));
    s.post_waits.push(Duration::from_millis(4));
    s.confirm_waits.push(Duration::from_millis(5));
    handle.observe(&w);
    // Taking the samples (as kvx-vllm's stats do) changes no metric.
    w.take_latencies();
    handle.observe(&w);
    handle.observe(&w);
    let text = metrics.encode();
    assert_eq!(value(&text, &sample("kvx_reads_posted_total")), Some(3.0));
    assert_eq!(value(&text, &sample("kvx_reads_done_total")), Some(2.0));
    assert_eq!(value(&text, &sample("kvx_read_bytes_total")), Some(4096.0));
    assert_eq!(value(&text, &sample("kvx_read_duration_seconds_count")), Some(2.0));
    assert_eq!(value(&text, &sample("kvx_read_duration_seconds_sum")), Some(2.00015));
    let bucket = |le: &str| {
        value(
            &text,
            &format!("kvx_read_duration_seconds_bucket{{le=\"{le}\",engine=\"engine-a\",rank=\"1\"}}"),
        )
    };
    assert_eq!(
        (bucket("0.0001"), bucket("0.00025"), bucket("1.0"), bucket("2.5")),
        (Some(0.0), Some(1.0), Some(1.0), Some(2.0))
    );
    assert_eq!(bucket("+Inf"), Some(2.0));
    assert_eq!(value(&text, &sample("kvx_handshake_duration_seconds_count")), Some(1.0));
    assert_eq!(value(&text, &sample("kvx_post_wait_duration_seconds_sum")), Some(0.004));
    assert_eq!(value(&text, &sample("kvx_confirm_duration_seconds_sum")), Some(0.005));

    // A new worker under the same labels (another instance) counts from zero: its totals add.
    let mut w = worker(8);
    w.stats_mut().reads_posted = 1;
    w.stats_mut().read_latencies.push(Duration::from_millis(1));
    handle.observe(&w);
    let text = metrics.encode();
    assert_eq!(value(&text, &sample("kvx_reads_posted_total")), Some(4.0));
    assert_eq!(value(&text, &sample("kvx_read_duration_seconds_count")), Some(3.0));
    assert!(text.ends_with("# EOF\n"), "{text}");
}

/// Every counter and histogram of [`WorkerStats`] has its series, at zero from the start, under
/// the name its table gives, with its help text; and docs/METRICS.md lists each one.
#[test]
fn every_worker_counter_and_histogram_is_registered_and_documented() {
    let metrics = Metrics::new();
    metrics.worker("engine-a", 1).observe(&worker(7));
    let text = metrics.encode();
    let doc = include_str!("../../../docs/METRICS.md");
    let mut names: Vec<(String, String, &str)> = WorkerStats::COUNTERS
        .iter()
        .map(|c| {
            let family = match c.unit {
                CounterUnit::Events => format!("kvx_{}", c.metric),
                CounterUnit::Bytes => format!("kvx_{}_bytes", c.metric),
            };
            (family.clone(), format!("{family}_total"), c.help)
        })
        .collect();
    names.extend(WorkerStats::TIMINGS.iter().map(|t| {
        let family = format!("kvx_{}_seconds", t.metric);
        (family.clone(), format!("{family}_count"), t.help)
    }));
    for (family, series, help) in names {
        assert_eq!(value(&text, &sample(&series)), Some(0.0), "{series}");
        assert!(text.contains(&format!("# HELP {family} {help}")), "{family}: {text}");
        let documented = if series.ends_with("_count") { family } else { series };
        assert!(doc.contains(&format!("| `{documented}` |")), "docs/METRICS.md lacks {documented}");
    }
}

#[test]
fn side_channel_refusals_are_counted_by_reason_and_restart_from_zero() {
    let metrics = Metrics::with_role("prefill");
    let mut handle = metrics.side_channel("p", 0);
    let mut stats =
        ServerStats { accepted: 5, refused: 2, idle: 1, slow: 1, unauthenticated: 3, ..Default::default() };
    handle.observe(&stats);
    stats.refused = 3;
    handle.observe(&stats);
    // Another server (its counters below the last ones): counted from zero.
    handle.observe(&ServerStats { refused: 1, ..Default::default() });
    let text = metrics.encode();
    let refused = |reason: &str| {
        value(
            &text,
            &format!(
                "kvx_side_channel_refused_total{{role=\"prefill\",engine=\"p\",rank=\"0\",reason=\"{reason}\"}}"
            ),
        )
    };
    assert_eq!(
        (refused("limit"), refused("timeout"), refused("unauthenticated")),
        (Some(4.0), Some(2.0), Some(3.0))
    );
    assert_eq!(refused("malformed"), Some(0.0));
    assert_eq!(
        value(&text, "kvx_side_channel_accepted_total{role=\"prefill\",engine=\"p\",rank=\"0\"}"),
        Some(5.0)
    );
}

/// One HTTP/1.1 exchange over a fresh TCP connection: the response's head and body.
async fn http(addr: SocketAddr, request: &str) -> (String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

#[tokio::test]
async fn the_server_answers_metrics_404_405_and_stops() {
    let metrics = Metrics::new();
    let mut handle = metrics.worker("engine-a", 1);
    let mut w = worker(1);
    w.stats_mut().reads_posted = 9;
    handle.observe(&w);
    let server = serve("127.0.0.1", 0, metrics.registry()).await.unwrap();
    let addr = server.local_addr();
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: kvx\r\nConnection: close\r\n\r\n");

    let (head, body) = http(addr, &get("/metrics")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains(&format!("content-type: {CONTENT_TYPE}")), "{head}");
    assert_eq!(value(&body, &sample("kvx_reads_posted_total")), Some(9.0));
    assert!(body.ends_with("# EOF\n"));
    assert_eq!(server.wait_for_scrape(0, Duration::from_secs(10)).await.unwrap(), 1);

    let (head, _) = http(addr, &get("/")).await;
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    let (head, _) =
        http(addr, "POST /metrics HTTP/1.1\r\nHost: kvx\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await;
    assert!(head.starts_with("HTTP/1.1 405"), "{head}");
    assert_eq!(server.scrapes(), 1, "only GET /metrics counts");
    let e = server.wait_for_scrape(1, Duration::from_millis(1)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);

    server.shutdown(Duration::from_secs(10)).await.unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "no longer listening");
}

#[tokio::test]
async fn idle_and_half_sent_connections_cannot_keep_a_scraper_out() {
    let metrics = Metrics::new();
    let server = serve("127.0.0.1", 0, metrics.registry()).await.unwrap();
    let addr = server.local_addr();
    // Twice every budget in idle connections and in half-sent requests, from the scraper's own
    // address: each newcomer makes the oldest of them make way.
    let total = 2 * (server::BUDGETS.max_pending + server::BUDGETS.max_connections);
    let mut held = Vec::new();
    for i in 0..total {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        if i % 2 == 0 {
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kv").await.unwrap();
        }
        held.push(s);
    }
    // Established connections that scraped once and stay open.
    for _ in 0..server::BUDGETS.max_connections {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvx\r\n\r\n").await.unwrap();
        let mut head = [0u8; 12];
        s.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 200");
        held.push(s);
    }
    for _ in 0..3 {
        let (head, body) =
            http(addr, "GET /metrics HTTP/1.1\r\nHost: kvx\r\nConnection: close\r\n\r\n").await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(body.ends_with("# EOF\n"));
    }
    drop(held);
}
