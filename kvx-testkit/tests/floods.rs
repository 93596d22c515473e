//! Floods of well-formed traffic against kvx's real servers on 127.0.0.1, judged by the
//! legitimate side: while 256, 1,000 and 10,000 attacker connections stay open, idle, stalled,
//! trickling, holding their slots with valid requests, or busy with them (keyed and unkeyed), every
//! legitimate fetch and group report succeeds, each within twice the slowest unloaded one plus
//! 1 s (floods of connections sending valid requests: up to 1,000 of them). Attackers that the
//! server drops connect again at once. Each case prints its figures
//! (`--nocapture`); `KVX_FLOOD_SIZES=256,1000` picks the flood sizes (all three by default).

#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

use kvx_core::{AuthKey, Endpoint, Finished, MetadataExchange, ParallelGroup, PeerLocator, RequestId, wire};
use kvx_net::session::SessionRequest;
use kvx_net::{MetadataRequest, NetConfig, ServeLimits, ServerStats, SideChannel, TcpGroup};
use kvx_testkit::flood::{ChildFlood, Latencies, Shape, raise_open_files, rss_kib, run_child_flood};

const PAYLOAD: &[u8] = &[0x5A; 4096];
/// Legitimate requests measured per case, unloaded and under the flood.
const LEGIT: usize = 20;
/// A bound that only proves "did not hang" (a flood's ramp-up, a fetch's own timeout).
const T: Duration = Duration::from_secs(60);
const KEY: &str = "flood-test-key-0123456789";

/// Where the legitimate peers connect from.
const LEGIT_SOURCE: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
/// Where the attackers connect from: another host, as far as the server can tell.
const ATTACK_SOURCE: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

fn sizes() -> Vec<usize> {
    match std::env::var("KVX_FLOOD_SIZES") {
        Ok(v) => v.split(',').map(|s| s.trim().parse().unwrap()).collect(),
        Err(_) => vec![256, 1000, 10_000],
    }
}

/// The floods each case runs: every size from another address, and the smallest from the
/// legitimate peers' own address too.
fn floods() -> Vec<(usize, IpAddr)> {
    let sizes = sizes();
    let own = sizes.iter().min().map(|&n| (n, LEGIT_SOURCE));
    own.into_iter().chain(sizes.into_iter().map(|n| (n, ATTACK_SOURCE))).collect()
}

/// The descriptors a flood of `n` needs here (the server's ends of its sockets, slack; the flood
/// runs in a child process of its own), raised to if the hard limit allows; `None` (with the
/// reason printed) where it does not.
fn room_for(n: usize) -> Option<usize> {
    let want = n as u64 + 4096;
    let have = raise_open_files(want);
    if have >= want {
        Some(n)
    } else {
        println!("SKIPPED: a flood of {n} needs {want} open files; the limit here is {have}");
        None
    }
}

fn runtime(threads: usize) -> Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build().unwrap()
}

fn config(keyed: bool) -> NetConfig {
    // The defaults, with a short handshake deadline so that the suite stays fast.
    let limits = ServeLimits { handshake_timeout: Duration::from_secs(2), ..Default::default() };
    let auth_key = keyed.then(|| AuthKey::new(KEY).unwrap());
    NetConfig { auth_key, limits }
}

fn framed(body: &[u8]) -> Vec<u8> {
    [&(body.len() as u32).to_be_bytes()[..], body].concat()
}

/// A whole, valid metadata request of a client without a key.
fn valid_request() -> Vec<u8> {
    let body = wire::encode(&MetadataRequest {}).unwrap();
    framed(&wire::encode(&SessionRequest::Request { body }).unwrap())
}

/// A keyless client's hello: the server answers with a challenge the client can never prove.
fn hello() -> Vec<u8> {
    framed(&wire::encode(&SessionRequest::Hello { challenge: vec![7; 16] }).unwrap())
}

/// The flood shapes for a server with or without a key.
fn shapes(keyed: bool) -> Vec<Shape> {
    let request = if keyed { hello() } else { valid_request() };
    let mut shapes = vec![
        Shape::Idle,
        // Half a request's header: never completes.
        Shape::Stalled(request[..2].to_vec()),
        Shape::Trickle { bytes: request.clone(), pace: Duration::from_millis(500) },
    ];
    if keyed {
        // The hello is answered; the proof never comes.
        shapes.push(Shape::Stalled(request));
    } else {
        shapes.push(Shape::Holding { bytes: request.clone(), pace: Duration::from_secs(50) });
        shapes.push(Shape::Busy(request));
    }
    shapes
}

struct Case {
    what: String,
    unloaded: Latencies,
    loaded: Latencies,
    rss_growth_kib: u64,
}

impl Case {
    fn check(&self) {
        let (ok, all) = self.loaded.succeeded();
        println!(
            "{}: unloaded {}; under the flood {}; memory +{} MiB",
            self.what,
            self.unloaded,
            self.loaded,
            self.rss_growth_kib >> 10
        );
        assert_eq!(ok, all, "{}: legitimate requests failed: {:?}", self.what, self.loaded.failures());
        assert!(
            self.loaded.max() <= self.unloaded.bound(),
            "{}: the slowest legitimate request took {:?}, over {:?}",
            self.what,
            self.loaded.max(),
            self.unloaded.bound()
        );
    }
}

/// `legit` timed `LEGIT` times unloaded, then under each flood of `shapes` x `sizes`.
fn run_cases(
    name: &str,
    target: SocketAddr,
    shapes: &[Shape],
    mut legit: impl FnMut() -> Result<(), String>,
    stats: impl Fn() -> String,
) {
    // One flood at a time: two at once (the test harness runs tests in parallel) would measure
    // each other on this machine's few cores.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let mut unloaded = Latencies::default();
    for _ in 0..LEGIT {
        unloaded.time(&mut legit);
    }
    for shape in shapes {
        for (n, source) in floods() {
            let Some(n) = room_for(n) else { continue };
            let before = rss_kib();
            let mut flood = ChildFlood::start("flood", target, source, shape, n).unwrap();
            flood
                .wait_connected(T)
                .unwrap_or_else(|e| panic!("{name}: the flood of {n} did not connect: {e}"));
            let mut loaded = Latencies::default();
            let start = Instant::now();
            for _ in 0..LEGIT {
                loaded.time(&mut legit);
            }
            let took = start.elapsed();
            let rss_growth_kib = rss_kib().saturating_sub(before);
            let f = flood.stop(T).unwrap();
            let from = if source == LEGIT_SOURCE { "its own address" } else { "another address" };
            let what = format!("{name}, {n} {} connections from {from}", shape.name());
            println!(
                "{what}: {LEGIT} legitimate in {took:.2?}; flood opened {} ({} dropped, {} answers); server {}",
                f.opened,
                f.dropped,
                f.answers,
                stats()
            );
            Case { what, unloaded: unloaded.clone(), loaded, rss_growth_kib }.check();
        }
    }
}

/// Where each flood runs: in a child process of this binary (see [`ChildFlood`]); passes at once
/// in a test run.
#[test]
fn flood() {
    run_child_flood();
}

fn describe(s: &ServerStats) -> String {
    format!(
        "accepted {}, evicted {}, unproven {}, refused {}, full {}, active {} ({} parked)",
        s.accepted, s.evicted, s.unproven, s.refused, s.full, s.active, s.parked
    )
}

fn side_channel_under_floods(keyed: bool) {
    let server_rt = runtime(1);
    let server = server_rt.block_on(async {
        let s = SideChannel::bind_with("127.0.0.1", 0, config(keyed)).await.unwrap();
        s.publish(PAYLOAD.to_vec()).await.unwrap();
        Arc::new(s)
    });
    let port = server.port();
    let client_rt = runtime(1);
    let client = client_rt.block_on(SideChannel::bind_with("127.0.0.1", 0, config(keyed))).unwrap();
    let peer =
        PeerLocator { engine_id: "p".into(), rank: 0, endpoint: Some(Endpoint::new("127.0.0.1", port)) };
    let fetch = || {
        let got =
            client_rt.block_on(client.fetch(&peer, Duration::from_secs(30))).map_err(|e| e.to_string())?;
        if got == PAYLOAD { Ok(()) } else { Err(format!("a payload of {} bytes", got.len())) }
    };
    let name = format!("side channel ({})", if keyed { "keyed" } else { "no key" });
    let target: SocketAddr = ([127, 0, 0, 1], port).into();
    run_cases(&name, target, &shapes(keyed), fetch, || describe(&server.stats()));
    // The server let every attacker go: nothing is held once the floods are gone.
    let s = server_rt.block_on(server.server().wait_for_stats(|s| s.active == 0, T)).unwrap();
    assert_eq!(server.server().connections().established + server.server().connections().pending, 0, "{s:?}");
}

#[test]
fn side_channel_without_a_key_serves_its_peers_through_floods() {
    side_channel_under_floods(false);
}

#[test]
fn side_channel_with_a_key_serves_key_holders_through_keyless_floods() {
    side_channel_under_floods(true);
}

fn group_under_floods(keyed: bool) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let r0 = TcpGroup::join_with(0, 2, "127.0.0.1", port, T, config(keyed)).unwrap();
    let r1 = TcpGroup::join_with(1, 2, "127.0.0.1", port, T, config(keyed)).unwrap();
    let mut step = 0u64;
    // One step of the group: rank 1 reports, rank 0 gathers that report.
    let mut report = || {
        step += 1;
        let id = RequestId::new(format!("step-{step}"));
        let started = Instant::now();
        r1.gather_finished(Finished { sending: vec![id.clone()], ..Default::default() })
            .map_err(|e| e.to_string())?;
        let deadline = started + Duration::from_secs(30);
        while Instant::now() < deadline {
            let gathered = r0.gather_finished(Finished::default()).map_err(|e| e.to_string())?.unwrap();
            if gathered.iter().any(|r| r.finished.sending.contains(&id)) {
                return Ok(());
            }
        }
        Err(format!("rank 0 did not gather step {step}"))
    };
    let name = format!("group ({})", if keyed { "keyed" } else { "no key" });
    let target: SocketAddr = ([127, 0, 0, 1], port).into();
    let shapes: Vec<Shape> = shapes(keyed).into_iter().filter(|s| !matches!(s, Shape::Busy(_))).collect();
    run_cases(&name, target, &shapes, &mut report, || describe(&r0.stats().unwrap()));
}

#[test]
fn group_ranks_report_through_floods_of_their_port() {
    group_under_floods(false);
}

#[test]
fn keyed_group_ranks_report_through_keyless_floods() {
    group_under_floods(true);
}

/// One scrape of `/metrics` at `addr` on a connection of its own: the answer's status line and
/// the end of its body.
fn scrape(addr: SocketAddr) -> Result<(), String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, T).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(T)).map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvx\r\nConnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).map_err(|e| e.to_string())?;
    if answer.starts_with("HTTP/1.1 200") && answer.ends_with("# EOF\n") {
        Ok(())
    } else {
        Err(format!("an answer of {} bytes: {:?}", answer.len(), answer.lines().next()))
    }
}

#[test]
fn metrics_are_scraped_through_floods_of_their_port() {
    let rt = runtime(1);
    let metrics = kvx_net::metrics::Metrics::new();
    let server = rt.block_on(kvx_net::metrics::serve("127.0.0.1", 0, metrics.registry())).unwrap();
    let target = server.local_addr();
    let get = b"GET /metrics HTTP/1.1\r\nHost: kvx\r\n\r\n".to_vec();
    let shapes = [
        Shape::Idle,
        Shape::Stalled(get[..20].to_vec()),
        Shape::Trickle { bytes: get.clone(), pace: Duration::from_millis(500) },
        Shape::Busy(get),
    ];
    run_cases("metrics", target, &shapes, || scrape(target), String::new);
}
