//! A hostile network against kvx's real servers and clients, on 127.0.0.1: frames that claim
//! terabytes, garbage, truncated frames, peers that never read or never speak, thousands of idle
//! connections, a process out of file descriptors, and peers without the key. After each attack a
//! valid peer still gets its handshake payload. Every wait is bounded; nothing sleeps to wait for
//! an event (the servers' counters are awaited).

#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream as StdStream;
use std::process::{Command, Stdio};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;

use kvx_core::auth::Purpose;
use kvx_core::{
    AuthKey, Endpoint, ErrorKind, Finished, MetadataExchange, ParallelGroup, PeerLocator, RequestId, wire,
};
use kvx_net::frame::{read_frame, write_frame};
use kvx_net::session::{Refusal, SessionReply, SessionRequest};
use kvx_net::{MetadataRequest, NetConfig, ServeLimits, ServerStats, SideChannel, TcpGroup};
use kvx_testkit::hostile::zmtp_73;

/// Sends `bytes` and waits (bounded) until the server closes the connection.
fn attack(port: u16, bytes: &[u8]) {
    kvx_testkit::hostile::attack(port, bytes, false, T).unwrap();
}

/// A generous bound that only proves "did not hang".
const T: Duration = Duration::from_secs(20);

/// Rank 0's worker at `127.0.0.1:port`.
fn at(port: u16) -> PeerLocator {
    PeerLocator { engine_id: "peer".into(), rank: 0, endpoint: Some(Endpoint::new("127.0.0.1", port)) }
}
const PAYLOAD: &[u8] = b"the handshake payload";
/// Set in a child process of this test binary to the role it plays.
const ROLE: &str = "KVX_HOSTILE_NET_ROLE";

fn rt() -> Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Requests a server must drop, with their names.
fn header_attacks() -> Vec<(&'static str, Vec<u8>)> {
    let over = u32::try_from(ServeLimits::DEFAULT_MAX_FRAME + 1).unwrap();
    vec![
        ("ZMTP greeting + 2^40 command", zmtp_73()),
        ("u32::MAX length", [&u32::MAX.to_be_bytes()[..], b"tail"].concat()),
        ("max_frame + 1 length", over.to_be_bytes().to_vec()),
        // Read as a 4-byte length, 2^40 in 8 bytes claims 256 bytes and sends 4: dropped as slow.
        ("2^40 as a 64-bit length", (1u64 << 40).to_be_bytes().to_vec()),
    ]
}

fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap();
    kb >> 10
}

/// The default limits, but a frame must complete within 300 ms of its first byte.
fn short_exchanges() -> NetConfig {
    let limits = ServeLimits { exchange_timeout: Duration::from_millis(300), ..Default::default() };
    NetConfig { auth_key: None, limits }
}

fn keyed(k: &str) -> NetConfig {
    NetConfig::with_key(Some(AuthKey::new(k).unwrap()))
}

async fn serving(config: NetConfig) -> SideChannel {
    let server = SideChannel::bind_with("127.0.0.1", 0, config).await.unwrap();
    server.publish(PAYLOAD.to_vec()).await.unwrap();
    server
}

/// A valid peer's fetch succeeds.
async fn assert_served(port: u16, config: NetConfig) {
    let client = SideChannel::bind_with("127.0.0.1", 0, config).await.unwrap();
    assert_eq!(client.fetch(&at(port), T).await.unwrap(), PAYLOAD);
}

async fn wait(server: &SideChannel, what: impl FnMut(&ServerStats) -> bool) -> ServerStats {
    server.server().wait_for_stats(what, T).await.unwrap()
}

#[test]
fn side_channel_drops_zmtp_and_oversize_headers_and_keeps_serving() {
    rt().block_on(async {
        let server = serving(short_exchanges()).await;
        for (n, (name, bytes)) in header_attacks().into_iter().enumerate() {
            attack(server.port(), &bytes);
            let s = wait(&server, |s| s.oversize + s.unproven == n as u64 + 1 && s.active == 0).await;
            assert_eq!(s.requests, n as u64, "{name}: nothing was answered");
            assert_served(server.port(), NetConfig::default()).await;
        }
        let s = wait(&server, |s| s.active == 0).await;
        // The stalled header is a connection that never proved itself (no complete request).
        assert_eq!((s.oversize, s.unproven, s.requests), (3, 1, 4), "{s:?}");
    });
}

#[test]
fn group_drops_zmtp_and_oversize_headers_and_keeps_gathering() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let r0 = TcpGroup::join_with(0, 2, "127.0.0.1", port, T, short_exchanges()).unwrap();
    let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, T).unwrap();
    let report = |s: &str| Finished { sending: vec![RequestId::new(s)], ..Default::default() };
    for (step, (_, bytes)) in header_attacks().into_iter().enumerate() {
        attack(port, &bytes);
        let name = format!("step-{step}");
        assert_eq!(r1.gather_finished(report(&name)).unwrap(), None);
        assert_eq!(r0.gather_finished(Finished::default()).unwrap().unwrap()[1].finished, report(&name));
    }
    let s = r0.stats().unwrap();
    assert_eq!((s.oversize, s.unproven), (3, 1), "{s:?}");
}

/// What a hostile server does after reading the client's first frame.
#[derive(Debug, Clone)]
enum Hostile {
    Sends(Vec<u8>),
    SendsAndCloses(Vec<u8>),
    Streams200MB,
    Silent,
}

/// A server that accepts one connection and misbehaves on it.
async fn hostile_server(how: Hostile) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let _ = read_frame(&mut s, 1 << 20, T, T).await;
        match how {
            Hostile::Sends(bytes) => {
                let _ = s.write_all(&bytes).await;
                let _ = s.read(&mut [0u8; 64]).await; // hold it until the client goes
            }
            Hostile::SendsAndCloses(bytes) => {
                let _ = s.write_all(&bytes).await;
            }
            Hostile::Streams200MB => {
                let _ = s.write_all(&200_000_000u32.to_be_bytes()).await;
                let chunk = vec![0x5Au8; 1 << 20];
                for _ in 0..200 {
                    if s.write_all(&chunk).await.is_err() {
                        break;
                    }
                }
            }
            Hostile::Silent => {
                let _ = s.read(&mut [0u8; 64]).await;
            }
        }
    });
    port
}

fn framed(body: &[u8]) -> Vec<u8> {
    [&(body.len() as u32).to_be_bytes()[..], body].concat()
}

#[test]
fn fetch_from_hostile_servers_fails_with_typed_errors_in_bounded_memory() {
    rt().block_on(async {
        let client = SideChannel::bind("127.0.0.1", 0).await.unwrap();
        let before = rss_mib();
        let not_a_reply = wire::encode(&SessionRequest::Request { body: vec![1, 2, 3] }).unwrap();
        let cases = [
            (Hostile::Sends(zmtp_73()), ErrorKind::Handshake),
            (Hostile::Sends([&u32::MAX.to_be_bytes()[..], b"xx"].concat()), ErrorKind::Handshake),
            (Hostile::Streams200MB, ErrorKind::Handshake),
            (Hostile::Sends(b"HTTP/1.1 200 OK\r\n\r\nhello".to_vec()), ErrorKind::Handshake),
            (Hostile::Sends(framed(&[0xAB; 100])), ErrorKind::Handshake),
            (Hostile::Sends(framed(&not_a_reply)), ErrorKind::Handshake),
            (Hostile::SendsAndCloses([&1000u32.to_be_bytes()[..], &[7; 10]].concat()), ErrorKind::Handshake),
            (Hostile::SendsAndCloses(Vec::new()), ErrorKind::Handshake),
            (Hostile::Silent, ErrorKind::Timeout),
        ];
        for (how, kind) in cases {
            let port = hostile_server(how.clone()).await;
            // Every fetch ends by its own 2 s timeout at the latest (then `Timeout`, the kind
            // the silent server gets): the others fail on what they received, before it.
            let e = client.fetch(&at(port), Duration::from_secs(2)).await.unwrap_err();
            assert_eq!(e.kind(), kind, "{how:?}: {e}");
        }
        let grown = rss_mib().saturating_sub(before);
        assert!(grown < 64, "memory grew by {grown} MiB");
    });
}

#[test]
fn garbage_truncated_and_stalled_requests_are_dropped_and_counted() {
    rt().block_on(async {
        let server = serving(short_exchanges()).await;
        let port = server.port();
        attack(port, &framed(&[0xAB; 64]));
        attack(port, &framed(b"\x92\xa4KVX1\x01")); // msgpack, but not an envelope
        wait(&server, |s| s.malformed == 2).await;
        // Truncated: a header that claims 100 bytes, 10 of them, then the end of the stream.
        let mut s = StdStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(&[&100u32.to_be_bytes()[..], &[1; 10]].concat()).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        wait(&server, |s| s.truncated == 1).await;
        // Stalled: half a header, then nothing (on a connection not proven yet: `unproven`).
        attack(port, &[0, 0]);
        let s = wait(&server, |s| s.unproven == 1 && s.active == 0).await;
        assert_eq!(s.requests, 0, "{s:?}");
        assert_served(port, NetConfig::default()).await;
    });
}

#[test]
fn a_client_that_pipelines_and_never_reads_is_dropped_while_others_are_served() {
    rt().block_on(async {
        let limits = ServeLimits { exchange_timeout: Duration::from_millis(500), ..Default::default() };
        let server =
            SideChannel::bind_with("127.0.0.1", 0, NetConfig { auth_key: None, limits }).await.unwrap();
        server.publish(vec![0x11; 4096]).await.unwrap();
        let request =
            wire::encode(&SessionRequest::Request { body: wire::encode(&MetadataRequest {}).unwrap() });
        let one = framed(&request.unwrap());
        let flood: Vec<u8> = one.iter().copied().cycle().take(one.len() * 200_000).collect();
        let before = rss_mib();
        let mut s = StdStream::connect(("127.0.0.1", server.port())).unwrap();
        s.set_write_timeout(Some(T)).unwrap();
        let writer = std::thread::spawn(move || {
            let _ = s.write_all(&flood); // stops when the server stops reading, or drops us
            s
        });
        let client = SideChannel::bind("127.0.0.1", 0).await.unwrap();
        let got = client.fetch(&at(server.port()), T).await.unwrap();
        assert_eq!(got.len(), 4096, "a valid peer is served during the flood");
        let s = wait(&server, |s| s.slow == 1).await;
        assert!(s.requests > 1, "{s:?}");
        let _held = writer.join().unwrap();
        let grown = rss_mib().saturating_sub(before);
        assert!(grown < 64, "memory grew by {grown} MiB (the flood is {} MiB)", (one.len() * 200_000) >> 20);
        assert_eq!(client.fetch(&at(server.port()), T).await.unwrap().len(), 4096);
    });
}

fn max_open_files() -> u64 {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    line.split_whitespace().nth(3).unwrap().parse().unwrap_or(u64::MAX)
}

/// Runs test `name` of this binary in a child process with `ulimit -n nofile` and `ROLE=role`.
fn child(name: &str, nofile: u64, role: &str) -> std::process::Child {
    Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -n {nofile} && exec \"$0\" --exact {name} --nocapture --test-threads=1"))
        .arg(std::env::current_exe().unwrap())
        .env(ROLE, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a child within [`T`] (killing it after).
fn wait_child(mut c: std::process::Child) -> std::process::ExitStatus {
    let pid = c.id();
    kvx_testkit::child::wait_within(&mut c, T)
        .unwrap_or_else(|| panic!("child {pid} did not exit within {T:?}"))
}

#[test]
fn three_thousand_idle_connections_are_evicted_or_timed_out() {
    const N: u64 = 3000;
    if std::env::var(ROLE).is_err() && max_open_files() < 2 * N + 500 {
        // Not enough descriptors here: run in a child with more.
        let c = child("three_thousand_idle_connections_are_evicted_or_timed_out", 2 * N + 1000, "idle");
        assert!(wait_child(c).success());
        return;
    }
    rt().block_on(async {
        let limits =
            ServeLimits { max_pending: 64, handshake_timeout: Duration::from_secs(1), ..Default::default() };
        let server = serving(NetConfig { auth_key: None, limits }).await;
        let before = rss_mib();
        let mut idle = Vec::new();
        for _ in 0..N {
            idle.push(tokio::net::TcpStream::connect(("127.0.0.1", server.port())).await.unwrap());
        }
        // Every one was accepted, none refused: each made way for a newer one (and was parked,
        // held open unserved) or timed out (at least the last 64).
        let s = wait(&server, |s| s.accepted == N && s.active == s.parked).await;
        assert_eq!((s.refused, s.evicted + s.unproven, s.parked), (0, N, s.evicted), "{s:?}");
        assert!(s.unproven >= 64 && s.evicted > 0, "{s:?}");
        assert!(rss_mib().saturating_sub(before) < 64, "bounded memory");
        assert_served(server.port(), NetConfig::default()).await;
        // Parked connections go as their peers close them.
        drop(idle);
        let s = wait(&server, |s| s.active == 0).await;
        assert_eq!(s.parked, 0, "{s:?}");
    });
}

/// The child side of [`accept_backs_off_when_file_descriptors_run_out`]: a side channel in a
/// process with few descriptors, driven by commands on stdin. Passes at once in a normal run.
#[test]
fn child_side_channel_server() {
    if std::env::var(ROLE).as_deref() != Ok("fd-server") {
        return;
    }
    let rt = rt();
    let server = rt.block_on(serving(NetConfig::default()));
    println!("PORT {}", server.port());
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().as_str() {
            "wait-accept-errors" => {
                let s = rt.block_on(server.server().wait_for_stats(|s| s.accept_errors > 0, T)).unwrap();
                println!("ERRORS {}", s.accept_errors);
            }
            "window" => {
                let errors = server.stats().accept_errors;
                rt.block_on(async { tokio::time::sleep(Duration::from_secs(1)).await }); // the window
                println!("WINDOW {}", server.stats().accept_errors - errors);
            }
            other => panic!("unknown command {other:?}"),
        }
    }
}

/// Kills a child process (by its id) when the test fails before waiting for it.
struct KillOnPanic(u32);

impl Drop for KillOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = Command::new("kill").arg(self.0.to_string()).status();
        }
    }
}

#[test]
fn accept_backs_off_when_file_descriptors_run_out() {
    let mut c = child("child_side_channel_server", 64, "fd-server");
    let _guard = KillOnPanic(c.id());
    let mut stdin = c.stdin.take().unwrap();
    let mut out = BufReader::new(c.stdout.take().unwrap()).lines();
    // The numbers after `prefix` on the next line that has it (the harness may print before it).
    let mut next = |prefix: &str| -> Vec<u64> {
        let line = out.find(|l| l.as_ref().is_ok_and(|l| l.contains(prefix))).unwrap().unwrap();
        let (_, numbers) = line.split_once(prefix).unwrap();
        numbers.split_whitespace().map(|w| w.parse().unwrap()).collect()
    };
    let port = u16::try_from(next("PORT ")[0]).unwrap();
    // More connections than the child has descriptors (64): what it cannot accept waits in the
    // listen backlog (128 at least).
    let held: Vec<StdStream> = (0..100).map(|_| StdStream::connect(("127.0.0.1", port)).unwrap()).collect();
    writeln!(stdin, "wait-accept-errors").unwrap();
    assert!(next("ERRORS ")[0] > 0);
    // The child has no descriptor to spare: its CPU time is read from here.
    let cpu_ticks = |pid: u32| -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        // utime + stime (fields 14 and 15 of proc_pid_stat(5)), in 1/100 s.
        fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
    };
    let before = cpu_ticks(c.id());
    writeln!(stdin, "window").unwrap();
    let errors = next("WINDOW ")[0];
    let cpu_ticks = cpu_ticks(c.id()) - before;
    eprintln!("out of descriptors: {errors} failed accepts and {cpu_ticks}/100 s of CPU in one second");
    // Backing off to 100 ms makes about 10 failed accepts a second; spinning makes millions.
    assert!(errors <= 60, "{errors} failed accepts in one second: the accept loop spins");
    assert!(cpu_ticks <= 50, "{cpu_ticks}/100 s of CPU in one second: the accept loop spins");
    drop(held);
    rt().block_on(assert_served(port, NetConfig::default()));
    drop(stdin);
    assert!(wait_child(c).success());
}

#[test]
fn auth_matching_keys_fetch_and_every_mismatch_is_unauthenticated() {
    rt().block_on(async {
        let keyed_server = serving(keyed("deployment-key-0001")).await;
        let open_server = serving(NetConfig::default()).await;
        assert_served(keyed_server.port(), keyed("deployment-key-0001")).await;
        let mismatches = [
            (keyed_server.port(), NetConfig::default()),
            (keyed_server.port(), keyed("deployment-key-0002")),
            (open_server.port(), keyed("deployment-key-0001")),
        ];
        for (port, config) in mismatches {
            let client = SideChannel::bind_with("127.0.0.1", 0, config).await.unwrap();
            let e = client.fetch(&at(port), T).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Unauthenticated, "{e}");
            assert!(!e.to_string().contains("handshake payload"), "no payload: {e}");
        }
        let s = wait(&keyed_server, |s| s.active == 0).await;
        assert_eq!((s.requests, s.unauthenticated), (1, 2), "{s:?}");
    });
}

async fn exchange(s: &mut tokio::net::TcpStream, msg: &SessionRequest) -> Option<SessionReply> {
    write_frame(s, &wire::encode(msg).unwrap(), T).await.unwrap();
    let frame = read_frame(s, 1 << 20, T, T).await.ok()?;
    Some(wire::decode(&frame).unwrap())
}

#[test]
fn a_replayed_proof_from_an_earlier_connection_is_refused() {
    let key = AuthKey::new("deployment-key-0001").unwrap();
    rt().block_on(async {
        let server = serving(NetConfig::with_key(Some(key.clone()))).await;
        let connect = || tokio::net::TcpStream::connect(("127.0.0.1", server.port()));
        let hello = SessionRequest::Hello { challenge: vec![9; 16] };
        let body = wire::encode(&MetadataRequest {}).unwrap();
        // A legitimate client's exchange, recorded.
        let mut a = connect().await.unwrap();
        let Some(SessionReply::Challenge { challenge: s1 }) = exchange(&mut a, &hello).await else {
            panic!()
        };
        let proof = key.tag(Purpose::HandshakeRequest, &[&[9; 16], &s1]).to_vec();
        let reply = exchange(&mut a, &SessionRequest::Proof { tag: proof.clone(), body: body.clone() }).await;
        assert!(matches!(reply, Some(SessionReply::Reply { ref body, tag: Some(_) }) if body == PAYLOAD));
        // The recording replayed on a new connection meets a new challenge and is refused.
        let mut b = connect().await.unwrap();
        let Some(SessionReply::Challenge { challenge: s2 }) = exchange(&mut b, &hello).await else {
            panic!()
        };
        assert_ne!(s1, s2, "a fresh challenge per connection");
        let reply = exchange(&mut b, &SessionRequest::Proof { tag: proof, body }).await;
        assert!(
            matches!(reply, Some(SessionReply::Refused { refusal: Refusal::Unauthenticated, .. })),
            "{reply:?}"
        );
        wait(&server, |s| s.unauthenticated == 1 && s.requests == 1).await;
    });
}

/// A server without the key that answers the challenge-response with `reply(client challenge)`.
async fn impostor(reply: impl FnOnce(Vec<u8>) -> SessionReply + Send + 'static) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let frame = read_frame(&mut s, 1 << 20, T, T).await.unwrap();
        let Ok(SessionRequest::Hello { challenge }) = wire::decode(&frame) else { return };
        let challenge_reply = SessionReply::Challenge { challenge: vec![5; 16] };
        write_frame(&mut s, &wire::encode(&challenge_reply).unwrap(), T).await.unwrap();
        let _ = read_frame(&mut s, 1 << 20, T, T).await;
        let _ = write_frame(&mut s, &wire::encode(&reply(challenge)).unwrap(), T).await;
        let _ = s.read(&mut [0u8; 16]).await;
    });
    port
}

#[test]
fn a_replayed_or_forged_server_reply_is_refused() {
    let key = AuthKey::new("deployment-key-0001").unwrap();
    rt().block_on(async {
        let client =
            SideChannel::bind_with("127.0.0.1", 0, NetConfig::with_key(Some(key.clone()))).await.unwrap();
        // A reply recorded from another session (another client challenge), replayed.
        let old = key.tag(Purpose::HandshakeReply, &[&[1; 16], &[5; 16], b"evil"]).to_vec();
        let replayed =
            impostor(move |_| SessionReply::Reply { body: b"evil".to_vec(), tag: Some(old) }).await;
        let untagged = impostor(|_| SessionReply::Reply { body: b"evil".to_vec(), tag: None }).await;
        let forged =
            impostor(|_| SessionReply::Reply { body: b"evil".to_vec(), tag: Some(vec![0; 32]) }).await;
        for port in [replayed, untagged, forged] {
            let e = client.fetch(&at(port), T).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Unauthenticated, "{e}");
        }
    });
}
