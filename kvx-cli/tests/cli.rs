//! The `kvx` binary: the demo, and prefill and decode as two processes.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

mod common;

use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const KVX: &str = env!("CARGO_BIN_EXE_kvx");
const LIMIT: Duration = Duration::from_secs(120);
/// Small sizes: the debug build checks every byte.
const SIZES: [&str; 8] = ["--layers", "2", "--kv-heads", "4", "--head-dim", "32", "--blocks", "256"];

/// Waits for a child within [`LIMIT`] (killing it after), on a thread, without polling.
fn wait(child: Child) -> Output {
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(LIMIT) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").arg(pid.to_string()).status();
            panic!("kvx (pid {pid}) did not finish within {LIMIT:?}");
        }
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `kvx demo` with `args` and the small [`SIZES`] (within [`LIMIT`]).
fn run_demo(args: &[&str]) -> Output {
    wait(
        Command::new(KVX)
            .arg("demo")
            .args(args)
            .args(SIZES)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

/// Runs `kvx demo` on `backend` with 40 requests and `extra` options, checks that all finished,
/// every byte matched and nothing leaked, and returns its output.
fn demo_on(backend: &str, extra: &[&str]) -> String {
    let out = run_demo(
        &[&["--backend", backend, "--requests", "40", "--prompt-len", "1..100", "--seed", "7"], extra]
            .concat(),
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains(&format!("{backend} backend")), "{stdout}");
    assert!(stdout.contains("40 (40 finished, 0 failed)"), "{stdout}");
    assert!(stdout.contains("blocks mismatched      0"), "{stdout}");
    assert!(stdout.contains("blocks leaked          0"), "{stdout}");
    stdout
}

/// `kvx demo` on `backend`: one prefill and one decode engine, every byte checked, nothing leaked.
fn demo_checks_every_byte_and_leaks_nothing_on(backend: &str) {
    let stdout = demo_on(backend, &[]);
    assert!(!stdout.contains("requests per engine"), "one engine of each kind: no such row\n{stdout}");
}

#[test]
fn demo_checks_every_byte_and_leaks_nothing() {
    demo_checks_every_byte_and_leaks_nothing_on("loopback");
}

/// `kvx demo` on `backend` with `p` prefill and `d` decode engines: every request finishes, every
/// byte matched, nothing leaked, and the summary says how many requests each engine served. All
/// 40 are submitted before the first step, so the prefill engines share them exactly (ties go
/// round robin); every decode engine serves some.
fn demo_runs_several_prefill_and_decode_engines_on(backend: &str, p: u32, d: u32) {
    let (ps, ds) = (p.to_string(), d.to_string());
    let stdout = demo_on(backend, &["--prefill-engines", &ps, "--decode-engines", &ds]);
    assert!(stdout.contains(&format!("engines: {p} prefill, {d} decode")), "{stdout}");
    let row = stdout.lines().find_map(|l| l.trim().strip_prefix("requests per engine")).unwrap();
    let served: Vec<(String, u64)> = row
        .split(", ")
        .map(|e| e.trim().split_once(' ').unwrap())
        .map(|(id, n)| (id.to_owned(), n.parse().unwrap()))
        .collect();
    let named = |role: &'static str, n: u32| {
        (0..n).map(move |i| if n == 1 { role.to_owned() } else { format!("{role}-{i}") })
    };
    let ids: Vec<String> = named("prefill", p).chain(named("decode", d)).collect();
    assert_eq!(served.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>(), ids, "{row}");
    let (on_prefill, on_decode) = served.split_at(p as usize);
    assert!(on_prefill.iter().all(|&(_, n)| n == u64::from(40 / p)), "{row}");
    assert!(on_decode.iter().all(|&(_, n)| n > 0), "{row}");
    assert_eq!(on_decode.iter().map(|(_, n)| n).sum::<u64>(), 40, "{row}");
}

#[test]
fn demo_runs_several_prefill_and_decode_engines() {
    demo_runs_several_prefill_and_decode_engines_on("loopback", 2, 2);
    demo_runs_several_prefill_and_decode_engines_on("loopback", 4, 1);
}

/// `--prefill-engines` and `--decode-engines` take 1 to 16.
#[test]
fn demo_refuses_engine_counts_out_of_range() {
    for flag in ["--prefill-engines", "--decode-engines"] {
        for n in ["0", "17"] {
            let out = wait(
                Command::new(KVX)
                    .args(["demo", flag, n])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap(),
            );
            assert_eq!(out.status.code(), Some(2), "{flag} {n}");
            assert!(text(&out.stderr).contains(flag), "{}", text(&out.stderr));
        }
    }
}

/// `kvx demo` with prefill and decode engines of TP sizes `p` and `d` (head-major caches, the
/// default) and `extra` options: each decode rank READs its own slice of the heads from the
/// prefill ranks that hold it, every byte checked, nothing leaked.
fn demo_moves_kv_between_tp_sizes_on(backend: &str, (p, d): (u32, u32), extra: &[&str]) -> String {
    let (ps, ds) = (p.to_string(), d.to_string());
    let stdout = demo_on(backend, &[&["--prefill-tp", &ps, "--decode-tp", &ds], extra].concat());
    assert!(stdout.contains(&format!("TP={p} prefill, TP={d} decode")), "{stdout}");
    stdout
}

#[test]
fn demo_moves_kv_between_tp_sizes() {
    for pair in [(1, 2), (2, 1), (4, 2)] {
        demo_moves_kv_between_tp_sizes_on("loopback", pair, &[]);
    }
    // A hybrid model: every other layer a 40-token sliding window, in a KV-cache group of its own
    // (the sliding group loads fewer blocks than the full one)...
    let stdout = demo_moves_kv_between_tp_sizes_on("loopback", (2, 4), &["--window", "40"]);
    let loaded = stdout.lines().find_map(|l| l.trim().strip_prefix("blocks loaded by group")).unwrap();
    let counts: Vec<u64> =
        loaded.split(", ").map(|g| g.trim().split(' ').next().unwrap().parse().unwrap()).collect();
    assert!(counts.len() == 2 && 0 < counts[0] && counts[0] < counts[1], "{stdout}");
    // ...or with one group, every other layer keeping its last 2 blocks.
    demo_moves_kv_between_tp_sizes_on("loopback", (4, 2), &["--layer-window", "2"]);
}

/// `kvx demo --mode push` on `backend`: the router sends both legs at once, the prefill engines
/// WRITE every block into the decode engines', every byte checked, nothing leaked; between TP
/// sizes and with several engines of each kind.
fn demo_pushes_on(backend: &str) {
    let stdout = demo_on(backend, &["--mode", "push"]);
    assert!(stdout.contains("push mode"), "{stdout}");
    let stdout = demo_moves_kv_between_tp_sizes_on(backend, (2, 4), &["--mode", "push", "--window", "40"]);
    assert!(stdout.contains("push mode"), "{stdout}");
    demo_on(backend, &["--mode", "push", "--prefill-engines", "2", "--decode-engines", "3"]);
}

#[test]
fn demo_pushes() {
    demo_pushes_on("loopback");
    demo_pushes_on("tcp");
}

/// A token-major cache cannot be sliced between TP sizes: every request fails with the
/// handshake's refusal, and the demo says why and exits 1.
#[test]
fn demo_with_a_token_major_cache_refuses_different_tp_sizes() {
    let out = run_demo(&["--requests", "3", "--prefill-tp", "1", "--decode-tp", "2", "--layout", "nhd"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("3 (0 finished, 3 failed)"), "{stdout}");
    assert!(stderr.contains("failed: incompatible"), "{stderr}");
}

/// `--tp` gives both engines' TP size, so it cannot come with `--prefill-tp` or `--decode-tp`;
/// sizes and windows of 0 are refused, as are both kinds of window at once.
#[test]
fn demo_refuses_conflicting_or_zero_tp_sizes() {
    let cases: [&[&str]; 7] = [
        &["--tp", "2", "--prefill-tp", "1"],
        &["--tp", "2", "--decode-tp", "1"],
        &["--prefill-tp", "0"],
        &["--decode-tp", "0"],
        &["--window", "0"],
        &["--layer-window", "0"],
        &["--window", "32", "--layer-window", "2"],
    ];
    for args in cases {
        let out = wait(
            Command::new(KVX)
                .arg("demo")
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains(args[args.len() - 2]), "{args:?}: {stderr}");
    }
}

#[test]
fn backends_that_cannot_run_a_role_say_so() {
    let mut cases = vec![&["prefill", "--backend", "loopback", "--api-port", "0"][..]];
    if !cfg!(feature = "ucx") {
        cases.push(&["demo", "--backend", "ucx"]);
    }
    if !cfg!(feature = "nixl") {
        cases.push(&["demo", "--backend", "nixl"]);
    }
    for args in cases {
        let out =
            wait(Command::new(KVX).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap());
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(text(&out.stderr).contains("backend"), "{}", text(&out.stderr));
    }
}

/// Both roles refuse to bind every interface without an address to advertise, before they start
/// anything (the decode engine's kvx-tcp agent and side channel are reached back at it).
#[test]
fn roles_on_every_interface_need_an_advertised_host() {
    for role in ["prefill", "decode"] {
        let args = [role, "--backend", "tcp", "--host", "0.0.0.0", "--timeout", "5"];
        let out =
            wait(Command::new(KVX).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap());
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{role}: {stderr}");
        assert!(
            stderr.contains("--host 0.0.0.0 binds every interface") && stderr.contains("--advertise-host")
        );
    }
}

/// The tests of a native backend this `kvx` was built with, in a module named after it; a `kvx`
/// built with both features runs both modules' tests, each backend chosen by `--backend`.
#[cfg(any(feature = "ucx", feature = "nixl"))]
macro_rules! native_backend_tests {
    ($backend:ident) => {
        mod $backend {
            const BACKEND: &str = stringify!($backend);

            /// `kvx demo`: two engines in one process, every byte checked.
            #[test]
            fn demo() {
                super::demo_checks_every_byte_and_leaks_nothing_on(BACKEND);
            }

            /// `kvx demo --mode push`: the prefill engines WRITE every block.
            #[test]
            fn demo_push() {
                super::demo_pushes_on(BACKEND);
            }

            /// `kvx demo` with two prefill and two decode engines.
            #[test]
            fn demo_2p2d() {
                super::demo_runs_several_prefill_and_decode_engines_on(BACKEND, 2, 2);
            }

            /// `kvx prefill` and `kvx decode` as two processes: the decode process READs every
            /// block out of the prefill process's memory and checks every byte; both exit 0 and
            /// leak nothing.
            #[test]
            fn prefill_and_decode_processes() {
                super::prefill_and_decode_processes_with(BACKEND, &[]);
            }

            /// `kvx prefill --tp 1` and `kvx decode --tp 2`: each decode rank READs its half of
            /// the heads from the one prefill rank.
            #[test]
            fn prefill_tp1_decode_tp2() {
                super::prefill_and_decode_of_tp_sizes(BACKEND, (1, 2), &[], &[]);
            }

            /// `kvx prefill --tp 2` and `kvx decode --tp 1` of a hybrid model: the decode rank
            /// READs from both prefill ranks, the sliding-window group only its window.
            #[test]
            fn prefill_tp2_decode_tp1() {
                super::prefill_and_decode_of_tp_sizes(BACKEND, (2, 1), &["--window", "32"], &[]);
            }

            /// `kvx prefill --tp 2` and `kvx decode --tp 4` of a hybrid model: each decode rank
            /// READs a quarter of the heads, a slice of a prefill rank's half.
            #[test]
            fn prefill_tp2_decode_tp4() {
                super::prefill_and_decode_of_tp_sizes(BACKEND, (2, 4), &["--window", "32"], &[]);
            }

            /// `kvx prefill --tp 4` and `kvx decode --tp 2`: each decode rank gathers its heads
            /// from two prefill ranks.
            #[test]
            fn prefill_tp4_decode_tp2() {
                super::prefill_and_decode_of_tp_sizes(BACKEND, (4, 2), &[], &[]);
            }

            /// `kvx prefill --tp 1` and `kvx decode --tp 4` (4 KV heads): each decode rank READs
            /// one head out of the one prefill rank's blocks.
            #[test]
            fn prefill_tp1_decode_tp4() {
                super::prefill_and_decode_of_tp_sizes(BACKEND, (1, 4), &[], &[]);
            }

            /// `kvx prefill --tp 4` and `kvx decode --tp 1` of a hybrid model (4 KV heads): the
            /// one decode rank READs one head from each prefill rank, in both groups.
            #[test]
            fn prefill_tp4_decode_tp1() {
                super::prefill_and_decode_of_tp_sizes(BACKEND, (4, 1), &["--window", "32"], &[]);
            }

            #[test]
            fn prefill_survives_hostile_bytes_on_every_port() {
                super::prefill_survives_hostile_bytes_on_every_port(BACKEND);
            }

            #[test]
            fn prefill_and_decode_with_an_auth_key() {
                super::prefill_and_decode_with_an_auth_key(BACKEND);
            }

            #[test]
            fn prefill_serves_decode_through_floods_of_every_port() {
                super::prefill_serves_decode_through_floods_of_every_port(BACKEND);
            }

            #[test]
            fn bench() {
                super::bench_runs_on(BACKEND);
            }

            #[cfg(feature = "etcd")]
            #[test]
            fn prefill_and_decode_through_etcd() {
                super::prefill_and_decode_through_etcd(BACKEND);
            }
        }
    };
}

#[cfg(feature = "ucx")]
native_backend_tests!(ucx);
#[cfg(feature = "nixl")]
native_backend_tests!(nixl);

/// Heterogeneous TP over UCX's TCP transport only: the decode ranks READ by active messages, the
/// per-head slices of (1, 2) and the gathered heads of a hybrid model's (2, 1), every byte checked.
#[cfg(feature = "ucx")]
#[test]
fn prefill_and_decode_of_other_tp_sizes_over_tcp() {
    prefill_and_decode_of_tp_sizes("ucx", (1, 2), &[], &[("UCX_TLS", "tcp")]);
    prefill_and_decode_of_tp_sizes("ucx", (2, 1), &["--window", "32"], &[("UCX_TLS", "tcp")]);
}

/// `kvx prefill` and `kvx decode` over UCX's TCP transport only (both processes read `UCX_TLS`
/// when their agents start): the transport a deployment without shared memory or RDMA gets.
#[cfg(feature = "ucx")]
#[test]
fn prefill_and_decode_processes_over_tcp() {
    prefill_and_decode_processes_with("ucx", &[("UCX_TLS", "tcp")]);
}

/// A `kvx prefill` process and the ports it listens on.
struct Prefill {
    child: Child,
    /// The request API, as printed (`tcp://host:port`).
    api: String,
    /// Every port it listens on: the request API's and each rank's side channel.
    ports: Vec<u16>,
}

fn start_prefill(backend: &str, args: &[&str], env: &[(&str, &str)]) -> Prefill {
    let (child, api, first) = launch_prefill(backend, args, env);
    let mut ports = vec![api.rsplit(':').next().unwrap().parse().unwrap()];
    let range = first.split("side channels on ports ").nth(1).unwrap().split(';').next().unwrap();
    let (lo, hi) = range.split_once('-').unwrap();
    ports.extend(lo.parse::<u16>().unwrap()..=hi.parse().unwrap());
    assert_eq!(ports.len(), 3, "the API and two ranks: {first}");
    Prefill { child, api, ports }
}

/// Starts `kvx prefill`: the process, its request API (`tcp://host:port`) and its first line.
fn launch_prefill(backend: &str, args: &[&str], env: &[(&str, &str)]) -> (Child, String, String) {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(KVX)
        .env_remove("KVX_AUTH_KEY")
        .env_remove("KVX_DISCOVERY")
        .envs(env.iter().copied())
        .args(["prefill", "--backend", backend, "--api-port", "0"])
        .args(args)
        .args(SIZES)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The first line names the side-channel ports and, last, the request API's endpoint.
    let mut first = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut first).unwrap();
    let api = first.trim().rsplit(' ').next().unwrap().to_owned();
    if !api.starts_with("tcp://") {
        // It printed no address: say why (its stderr) rather than only that.
        let out = wait(child);
        panic!("kvx prefill printed {first:?}, then exited {:?}: {}", out.status, text(&out.stderr));
    }
    (child, api, first)
}

fn run_decode(backend: &str, api: &str, requests: usize, env: &[(&str, &str)]) -> Output {
    wait(spawn_decode(backend, api, requests, env, &[]))
}

fn spawn_decode(backend: &str, api: &str, requests: usize, env: &[(&str, &str)], args: &[&str]) -> Child {
    let requests = requests.to_string();
    Command::new(KVX)
        .env_remove("KVX_AUTH_KEY")
        .env_remove("KVX_DISCOVERY")
        .envs(env.iter().copied())
        .args(["decode", "--backend", backend, "--prefill", api, "--requests", &requests])
        .args(["--prompt-len", "1..120"])
        .args(args)
        .args(SIZES)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Both processes succeeded: every request finished, bytes verified, nothing leaked.
fn check_pair(decode: Output, prefill: Child, requests: usize) {
    let prefill = wait(prefill);
    let (d, p) = (text(&decode.stdout), text(&prefill.stdout));
    assert!(decode.status.success(), "decode:\n{d}\n{}", text(&decode.stderr));
    assert!(prefill.status.success(), "prefill:\n{p}\n{}", text(&prefill.stderr));
    assert!(d.contains(&format!("{requests} ({requests} finished, 0 failed)")), "{d}");
    assert!(d.contains("blocks mismatched      0") && d.contains("blocks leaked          0"), "{d}");
    let verified: u64 = d
        .lines()
        .find_map(|l| l.trim().strip_prefix("blocks verified"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    assert!(verified > 0, "{d}");
    assert!(
        p.contains(&format!("served {requests} requests")) && p.contains("blocks leaked          0"),
        "{p}"
    );
}

fn prefill_and_decode_processes_with(backend: &str, env: &[(&str, &str)]) {
    let prefill = start_prefill(backend, &[], env);
    let decode = run_decode(backend, &prefill.api, 30, env);
    check_pair(decode, prefill.child, 30);
}

/// `kvx prefill --tp P` and `kvx decode --tp D` (with `extra` options on both): every request
/// finishes, every byte each decode rank READs is checked, nothing leaks on either side. Without
/// the backend's library: a loud SKIP, or a failure with `KVX_REQUIRE_UCX=1` (`KVX_REQUIRE_NIXL=1`).
fn prefill_and_decode_of_tp_sizes(backend: &str, (p, d): (u32, u32), extra: &[&str], env: &[(&str, &str)]) {
    #[cfg(any(feature = "ucx", feature = "nixl"))]
    if backend != "tcp"
        && !common::backend_available(&format!("{backend}::prefill_tp{p}_decode_tp{d}"), backend)
    {
        return;
    }
    let (ps, ds) = (p.to_string(), d.to_string());
    let (prefill, api, first) = launch_prefill(backend, &[&["--tp", &ps], extra].concat(), env);
    assert!(first.contains(&format!("TP={p},")), "{first}");
    let decode = wait(spawn_decode(backend, &api, 20, env, &[&["--tp", &ds], extra].concat()));
    assert!(text(&decode.stdout).contains(&format!("TP={d},")), "{}", text(&decode.stdout));
    check_pair(decode, prefill, 20);
}

/// Every listening port of a `kvx prefill` process (the request API and each rank's side
/// channel) gets the 73-byte ZMTP frame and a length header claiming u32::MAX bytes; the process
/// stays up and a following `kvx decode` succeeds.
fn prefill_survives_hostile_bytes_on_every_port(backend: &str) {
    let prefill = start_prefill(backend, &[], &[]);
    for &port in &prefill.ports {
        kvx_testkit::hostile::attack(port, &kvx_testkit::hostile::zmtp_73(), false, LIMIT).unwrap();
        kvx_testkit::hostile::attack(port, &[&u32::MAX.to_be_bytes()[..], b"tail"].concat(), false, LIMIT)
            .unwrap();
    }
    let decode = run_decode(backend, &prefill.api, 10, &[]);
    check_pair(decode, prefill.child, 10);
}

/// A real `kvx prefill` with thousands of idle, stalled and trickling connections on every port
/// (its request API and each rank's side channel), from another address and from the decode
/// process's own: a `kvx decode` still finishes every request, the run within twice the time of an
/// unflooded one plus 1 s per request. A `Done` from an address that is not `--api-client` is refused and the
/// process goes on.
#[cfg(any(feature = "ucx", feature = "nixl"))]
fn prefill_serves_decode_through_floods_of_every_port(backend: &str) {
    use kvx_testkit::flood::{Flood, Shape, raise_open_files};
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    use std::time::Instant;
    const REQUESTS: usize = 10;
    let attacker = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let own = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let floods: [(IpAddr, Shape, usize); 3] = [
        (attacker, Shape::Idle, 1000),
        (attacker, Shape::Trickle { bytes: vec![0, 0, 1, 0], pace: Duration::from_millis(500) }, 500),
        (own, Shape::Stalled(vec![0, 0]), 256),
    ];
    // One flooded pair at a time (the ucx and nixl tests would otherwise flood each other's CPU).
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let per_port: usize = floods.iter().map(|f| f.2).sum();
    let want = (3 * per_port + 2048) as u64;
    if raise_open_files(want) < want {
        println!("SKIPPED: the floods need {want} open files, more than this machine allows");
        return;
    }
    let prefill = start_prefill(backend, &[], &[]);
    let started = Instant::now();
    let decode = run_decode(backend, &prefill.api, REQUESTS, &[]);
    let unloaded = started.elapsed();
    check_pair(decode, prefill.child, REQUESTS);

    let prefill = start_prefill(backend, &[], &[]);
    // An anonymous Done from another address (127.0.0.3) is refused; the prefill process stays up.
    let done = serde_json::to_vec(&"Done").unwrap();
    let frame = kvx_core::wire::encode(&kvx_net::session::SessionRequest::Request { body: done }).unwrap();
    let api_port = prefill.ports[0];
    {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let reply = rt.block_on(async {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3)), 0)).unwrap();
            let mut stream = s.connect(SocketAddr::from(([127, 0, 0, 1], api_port))).await.unwrap();
            kvx_net::frame::write_frame(&mut stream, &frame, LIMIT).await.unwrap();
            kvx_net::frame::read_frame(&mut stream, 1 << 20, LIMIT, LIMIT).await.unwrap()
        });
        let reply: kvx_net::session::SessionReply = kvx_core::wire::decode(&reply).unwrap();
        assert!(
            matches!(&reply, kvx_net::session::SessionReply::Refused { reason, .. } if reason.contains("--api-client")),
            "{reply:?}"
        );
    }
    let mut running = Vec::new();
    for &port in &prefill.ports {
        let target = SocketAddr::from(([127, 0, 0, 1], port));
        for (source, shape, n) in &floods {
            running.push(Flood::start(target, *source, shape.clone(), *n).unwrap());
        }
    }
    for flood in &running {
        assert!(flood.wait_connected(LIMIT), "{flood:?}");
    }
    let started = Instant::now();
    let decode = run_decode(backend, &prefill.api, REQUESTS, &[]);
    let loaded = started.elapsed();
    let stats: Vec<_> = running.iter().map(Flood::stats).collect();
    drop(running);
    let prefill_out = wait(prefill.child);
    println!(
        "{backend}: unflooded pair {unloaded:.2?}, decode under the floods {loaded:.2?}; floods {stats:?}"
    );
    let (d, p) = (text(&decode.stdout), text(&prefill_out.stdout));
    assert!(decode.status.success(), "decode:\n{d}\n{}", text(&decode.stderr));
    assert!(prefill_out.status.success(), "prefill:\n{p}\n{}", text(&prefill_out.stderr));
    assert!(d.contains(&format!("{REQUESTS} ({REQUESTS} finished, 0 failed)")), "{d}");
    assert!(p.contains("refused 1 Done from addresses other than --api-client"), "{p}");
    // Each request within twice its unflooded time plus 1 s: the run within twice the unflooded
    // run plus 1 s per request.
    let bound = 2 * unloaded + Duration::from_secs(REQUESTS as u64);
    assert!(loaded <= bound, "{loaded:?} against {unloaded:?} unflooded (bound {bound:?})");
}

/// A prefill/decode pair with the same key (flag on one side, `KVX_AUTH_KEY` on the other)
/// succeeds; a decode with a wrong key first fails cleanly with an authentication error and the
/// prefill process goes on.
fn prefill_and_decode_with_an_auth_key(backend: &str) {
    let prefill = start_prefill(backend, &["--auth-key", "the-deployment-key-1"], &[]);
    let wrong = run_decode(backend, &prefill.api, 3, &[("KVX_AUTH_KEY", "not-the-deployment-key")]);
    let stderr = text(&wrong.stderr);
    assert_eq!(wrong.status.code(), Some(2), "{}\n{stderr}", text(&wrong.stdout));
    assert!(stderr.contains("not authenticated"), "{stderr}");
    let unkeyed = run_decode(backend, &prefill.api, 3, &[]);
    assert_eq!(unkeyed.status.code(), Some(2));
    assert!(text(&unkeyed.stderr).contains("not authenticated"), "{}", text(&unkeyed.stderr));
    let decode = run_decode(backend, &prefill.api, 10, &[("KVX_AUTH_KEY", "the-deployment-key-1")]);
    check_pair(decode, prefill.child, 10);
}

/// `kvx prefill --discovery etcd://..` and `kvx decode` (`KVX_DISCOVERY`) find each other through
/// a real etcd server by engine id, with no side-channel host or port in the params and their
/// entries sealed under the deployment's key: every request finishes, bytes are verified and
/// nothing leaks. Without `etcd` it prints why it skips.
#[cfg(all(feature = "etcd", any(feature = "ucx", feature = "nixl")))]
fn prefill_and_decode_through_etcd(backend: &str) {
    let Some(etcd) = kvx_testkit::etcd::EtcdServer::start_or_skip("prefill_and_decode_through_etcd") else {
        return;
    };
    let url = etcd.url();
    let key = "the-deployment-key-2";
    let (prefill, api, first) = launch_prefill(backend, &["--discovery", &url, "--auth-key", key], &[]);
    assert!(first.contains(&format!("handshakes through {url}")), "{first}");
    let decode = run_decode(backend, &api, 20, &[("KVX_DISCOVERY", &url), ("KVX_AUTH_KEY", key)]);
    check_pair(decode, prefill, 20);
}

/// Runs `kvx bench` with `args` (and, with `files`, `--csv` and `--plot` into a fresh directory);
/// returns its output and the CSV and SVG it wrote.
fn bench(args: &[&str], files: bool) -> (Output, String, String) {
    let dir = std::env::temp_dir().join(format!("kvx-bench-test-{}-{}", std::process::id(), args.join("_")));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (csv, svg) = (dir.join("bench.csv"), dir.join("bench.svg"));
    let mut command = Command::new(KVX);
    command.arg("bench").args(args);
    if files {
        command.arg("--csv").arg(&csv).arg("--plot").arg(&svg);
    }
    let out = wait(command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap());
    let read = |path| std::fs::read_to_string(path).unwrap_or_default();
    let written = (read(&csv), read(&svg));
    let _ = std::fs::remove_dir_all(&dir);
    (out, written.0, written.1)
}

/// A small `kvx bench` with `args` over two block sizes, with a CSV and a plot: it succeeds, the
/// CSV has exactly the documented header and one well-formed row per backend, transport and size
/// (`rows`, in that order), every row's bytes were verified, and the SVG draws each of them.
fn bench_writes_verified_rows(args: &[&str], rows: &[(&str, &str)]) {
    let small = ["--sizes", "16K,64K", "--blocks", "16", "--pool-blocks", "40", "--rounds", "2"];
    let (out, csv, svg) = bench(&[args, &small[..]].concat(), true);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some(
            "backend,transport,block_bytes,blocks,gbps,baseline,baseline_gbps,ratio,p50_us,p99_us,cpu_s_per_gb"
        )
    );
    let expected: Vec<(&str, &str, &str)> = rows
        .iter()
        .flat_map(|&(backend, transport)| ["16384", "65536"].map(|size| (backend, transport, size)))
        .collect();
    let csv_rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(csv_rows.len(), expected.len(), "{csv}");
    for (fields, &(backend, transport, size)) in csv_rows.iter().zip(&expected) {
        assert_eq!(fields.len(), 11, "{fields:?}");
        assert_eq!(fields[..4], [backend, transport, size, "16"], "{fields:?}");
        let batch = args.iter().position(|a| *a == "--stream-batch").and_then(|i| args.get(i + 1));
        let baseline = match (transport, batch) {
            ("tcp", Some(batch)) => format!("tcp-stream/{batch}"),
            ("tcp", None) => "tcp-stream".to_owned(),
            _ => "memcpy".to_owned(),
        };
        assert_eq!(fields[5], baseline, "{fields:?}");
        for at in [4, 6, 7, 8, 9] {
            let value: f64 = fields[at].parse().unwrap();
            assert!(value > 0.0 && value.is_finite(), "{fields:?}");
        }
        // Two processes' CPU over the timed READs: never negative, though a short one may round
        // to 0.00 s/GB.
        let cpu: f64 = fields[10].parse().unwrap();
        assert!(cpu >= 0.0 && cpu.is_finite(), "{fields:?}");
    }
    let table: Vec<&str> = stdout
        .lines()
        .filter(|l| rows.iter().any(|(b, t)| l.starts_with(&format!("{b:<9} {t:<5}"))))
        .collect();
    assert_eq!(table.len(), expected.len(), "{stdout}");
    assert!(table.iter().all(|row| row.ends_with("yes (2 rounds)")), "{stdout}");
    assert!(stderr.contains(&format!("[{n}/{n}]", n = expected.len())), "progress on stderr: {stderr}");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
    for (backend, transport) in rows {
        assert!(svg.contains(&format!("kvx {backend} {transport}")), "{svg}");
    }
}

/// `kvx bench` on a native `backend` over both transports: every READ from another process.
#[cfg(any(feature = "ucx", feature = "nixl"))]
fn bench_runs_on(backend: &str) {
    bench_writes_verified_rows(
        &["--backend", backend, "--transport", "shm,tcp"],
        &[(backend, "shm"), (backend, "tcp")],
    );
}

/// `--stream-batch`: the TCP stream moves 3 blocks per `writev` / `readv` (16 blocks: the last
/// batch is short), its rows name it, and its bytes are checked like the READs'.
#[cfg(feature = "ucx")]
#[test]
fn bench_with_a_batched_tcp_stream_names_it_and_checks_its_bytes() {
    if !common::backend_available("bench_with_a_batched_tcp_stream", "ucx") {
        return;
    }
    bench_writes_verified_rows(
        &["--backend", "ucx", "--transport", "tcp", "--stream-batch", "3"],
        &[("ucx", "tcp")],
    );
}

#[test]
fn bench_writes_a_verified_csv_and_plot() {
    bench_writes_verified_rows(&[], &[("loopback", "shm")]);
}

/// `--all`: every backend this kvx was built with; the loopback backend has no tcp rows, the tcp
/// backend no shm rows.
#[test]
fn bench_all_runs_every_built_backend() {
    let mut rows = vec![("loopback", "shm")];
    for (backend, built) in [("ucx", cfg!(feature = "ucx")), ("nixl", cfg!(feature = "nixl"))] {
        if built {
            rows.extend([(backend, "shm"), (backend, "tcp")]);
        }
    }
    rows.push(("tcp", "tcp"));
    bench_writes_verified_rows(&["--all", "--transport", "shm,tcp"], &rows);
}

/// The tcp backend (pure Rust, in every build): the demo, the two roles as processes (also of
/// other TP sizes and with a key), and its bench over TCP.
mod tcp {
    const BACKEND: &str = "tcp";

    #[test]
    fn demo() {
        super::demo_checks_every_byte_and_leaks_nothing_on(BACKEND);
    }

    #[test]
    fn demo_2p2d() {
        super::demo_runs_several_prefill_and_decode_engines_on(BACKEND, 2, 2);
    }

    #[test]
    fn prefill_and_decode_processes() {
        super::prefill_and_decode_processes_with(BACKEND, &[]);
    }

    #[test]
    fn prefill_tp1_decode_tp2() {
        super::prefill_and_decode_of_tp_sizes(BACKEND, (1, 2), &[], &[]);
    }

    #[test]
    fn prefill_tp2_decode_tp1() {
        super::prefill_and_decode_of_tp_sizes(BACKEND, (2, 1), &["--window", "32"], &[]);
    }

    #[test]
    fn prefill_and_decode_with_an_auth_key() {
        super::prefill_and_decode_with_an_auth_key(BACKEND);
    }

    #[test]
    fn prefill_survives_hostile_bytes_on_every_port() {
        super::prefill_survives_hostile_bytes_on_every_port(BACKEND);
    }

    #[test]
    fn bench() {
        super::bench_writes_verified_rows(&["--backend", BACKEND, "--transport", "tcp"], &[(BACKEND, "tcp")]);
    }
}

/// Arguments that cannot make a benchmark fail at once, with exit status 2, naming the problem,
/// and write nothing.
#[test]
fn bench_refuses_invalid_arguments() {
    let cases: [(&[&str], &str); 7] = [
        (&["--sizes", "12X"], "--sizes"),
        (&["--sizes", "12"], "multiples of 8"),
        (&["--blocks", "0"], "reads"),
        (&["--blocks", "10", "--pool-blocks", "5"], "--pool-blocks"),
        (&["--rounds", "0"], "--rounds"),
        (&["--transport", "tcp"], "no tcp"),
        (&["--all", "--backend", "loopback"], "--all"),
    ];
    for (args, says) in cases {
        let (out, csv, svg) = bench(args, true);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(csv.is_empty() && svg.is_empty(), "{args:?}");
    }
    let (out, ..) = bench(&["--plot", "bench.png"], false);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("SVG only"), "{}", text(&out.stderr));
}

/// `kvx soak` twice with one seed: the same report, word for word, and a success.
#[test]
fn soak_replays_a_seed_and_succeeds() {
    let run = || {
        let child = Command::new(KVX)
            .args(["soak", "--requests", "300", "--seed", "5"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait(child)
    };
    let (first, second) = (run(), run());
    let stdout = text(&first.stdout);
    assert!(first.status.success(), "{stdout}\n{}", text(&first.stderr));
    assert!(stdout.contains("unresolved             0 (must be 0)"), "{stdout}");
    assert!(stdout.contains("kvx soak --requests 300 --seed 5"), "{stdout}");
    assert!(text(&first.stderr).contains("wall time"), "the wall time goes to stderr");
    assert_eq!(stdout, text(&second.stdout), "the same seed, the same report");
}

/// `kvx soak --backend tcp`: the soak over a real transport (the chaos layer over TCP agents) ends
/// clean, and its replay line names the backend.
#[test]
fn soak_runs_over_tcp() {
    let child = Command::new(KVX)
        .args(["soak", "--requests", "200", "--seed", "3", "--backend", "tcp"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait(child);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("unresolved             0 (must be 0)"), "{stdout}");
    assert!(
        stdout.contains("kvx soak --requests 200 --seed 3 --prefills 2 --decodes 2 --backend tcp"),
        "{stdout}"
    );
    assert!(text(&out.stderr).contains("tcp backend"), "{}", text(&out.stderr));
}

/// `kvx router` as a process: its options, its address lines, its two ports and its stop on
/// SIGTERM. Routing, failover and streaming are tested against stub servers in the router
/// module's own tests.
mod router {
    use std::io::{BufRead, BufReader};
    use std::process::{Child, Command, Stdio};
    use std::sync::mpsc;

    use super::{KVX, LIMIT, text, wait};

    /// A URL where nothing listens.
    fn closed_url() -> String {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        format!("http://127.0.0.1:{port}")
    }

    #[test]
    fn bad_server_urls_are_refused() {
        for url in ["https://127.0.0.1:8100", "127.0.0.1:8100", "http://127.0.0.1:8100/?x=1"] {
            let child = Command::new(KVX)
                .args(["router", "--port", "0", "--prefill", url, "--decode", "http://127.0.0.1:8200"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let out = wait(child);
            assert_eq!(out.status.code(), Some(2), "{url}");
            assert!(text(&out.stderr).contains("router: server"), "{}", text(&out.stderr));
        }
    }

    /// The first `lines` lines of `child`'s stdout, within [`LIMIT`].
    fn first_lines(child: &mut Child, lines: usize) -> Vec<String> {
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let read: Vec<String> =
                BufReader::new(stdout).lines().take(lines).map_while(Result::ok).collect();
            let _ = tx.send(read);
        });
        rx.recv_timeout(LIMIT).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("kvx router printed no address within {LIMIT:?}")
        })
    }

    #[test]
    fn the_router_serves_its_api_and_metrics_ports_and_stops_on_sigterm() {
        let (prefill, decode) = (closed_url(), closed_url());
        let mut child = Command::new(KVX)
            .args(["router", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"])
            .args(["--prefill", &prefill, "--decode", &decode, "--retries", "0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = first_lines(&mut child, 2);
        let address = |prefix: &str, line: &str| {
            let rest = line.strip_prefix(prefix).unwrap_or_else(|| panic!("{line:?}"));
            rest.split_whitespace().next().unwrap().to_owned()
        };
        assert!(lines[0].ends_with("(0/1 prefill and 0/1 decode servers healthy)"), "{lines:?}");
        let api = address("kvx router: serving on ", &lines[0]);
        let metrics = address("kvx router: metrics on ", &lines[1]);

        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let client = reqwest::Client::builder().no_proxy().timeout(LIMIT).build().unwrap();
            let body = r#"{"model": "m", "prompt": "hello"}"#;
            let post = client.post(format!("{api}/v1/completions")).body(body).send().await.unwrap();
            // The health check before serving found no server: 503 at once.
            assert_eq!(post.status(), 503);
            assert!(post.text().await.unwrap().contains("no prefill server is healthy"));
            let scrape = client.get(metrics).send().await.unwrap().text().await.unwrap();
            let series = format!(r#"kvx_router_upstream_healthy{{role="prefill",upstream="{prefill}"}} 0"#);
            assert!(scrape.contains(&series), "{scrape}");
            let scrape = client.get(format!("{api}/metrics")).send().await.unwrap().text().await.unwrap();
            assert!(scrape.contains(&series), "{scrape}");
        });

        let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
        assert!(killed.success());
        let out = wait(child);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let stderr = text(&out.stderr);
        assert!(stderr.contains("stopping"), "{stderr}");
        assert!(stderr.contains(&format!("prefill server {prefill} out of rotation")), "{stderr}");
    }
}

/// Reads `child`'s stdout (on a thread, within [`LIMIT`]) until it says its final metrics are
/// served, scrapes them over HTTP, then reads the rest of its stdout and waits for it: the metrics
/// text, the whole stdout and whether it succeeded.
#[cfg(feature = "ucx")]
fn scrape_final_metrics(mut child: Child) -> (String, String, bool) {
    use std::io::{BufRead, BufReader, Read, Write};
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut stdout = String::new();
        let url = loop {
            let mut line = String::new();
            if out.read_line(&mut line).unwrap() == 0 {
                panic!("kvx (pid {pid}) ended without serving its final metrics:\n{stdout}");
            }
            stdout.push_str(&line);
            if let Some(rest) = line.split("final metrics on http://").nth(1) {
                break rest.split_whitespace().next().unwrap().to_owned();
            }
        };
        let (addr, path) = url.split_once('/').unwrap();
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        write!(stream, "GET /{path} HTTP/1.1\r\nHost: kvx\r\nConnection: close\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        out.read_to_string(&mut stdout).unwrap();
        let ok = child.wait().unwrap().success();
        let _ = tx.send((response, stdout, ok));
    });
    match rx.recv_timeout(LIMIT) {
        Ok((response, stdout, ok)) => {
            let (head, body) = response.split_once("\r\n\r\n").unwrap();
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            (body.to_owned(), stdout, ok)
        }
        Err(_) => {
            let _ = Command::new("kill").arg(pid.to_string()).status();
            panic!("kvx (pid {pid}) did not serve its final metrics within {LIMIT:?}");
        }
    }
}

/// The sum over ranks of a metric's samples, `None` if it has none.
#[cfg(feature = "ucx")]
fn metric(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// `kvx prefill` and `kvx decode` with `--metrics-port 0 --metrics-linger`: after the run, each
/// serves its final metrics until scraped; the scrapes match the run.
#[cfg(feature = "ucx")]
#[test]
fn prefill_and_decode_serve_their_metrics() {
    let serve = ["--metrics-port", "0", "--metrics-linger", "60"];
    let prefill = start_prefill("ucx", &serve, &[]);
    let decode = spawn_decode("ucx", &prefill.api, 10, &[], &serve);
    let (d, stdout, ok) = scrape_final_metrics(decode);
    assert!(ok && stdout.contains("10 (10 finished, 0 failed)"), "{stdout}");
    let (p, prefill_stdout, ok) = scrape_final_metrics(prefill.child);
    assert!(ok, "{prefill_stdout}");

    // Every READ posted is done (two ranks, one READ each per request with a full block).
    let reads = metric(&d, "kvx_reads_posted_total").unwrap();
    assert!(reads > 0.0 && reads <= 20.0 && reads % 2.0 == 0.0, "{d}");
    assert_eq!(metric(&d, "kvx_reads_done_total"), Some(reads));
    assert_eq!(metric(&d, "kvx_transfer_duration_seconds_count"), Some(reads));
    assert_eq!(metric(&d, "kvx_reads_failed_total"), Some(0.0));
    assert_eq!(metric(&d, "kvx_loads_failed_total"), Some(0.0));
    let bytes = metric(&d, "kvx_read_bytes_total").unwrap();
    assert!(stdout.contains(&format!("bytes moved            {:.1} MB", bytes / 1e6)), "{bytes}\n{stdout}");
    assert!(metric(&d, "kvx_handshake_duration_seconds_count") >= Some(2.0));
    assert!(d.contains("role=\"decode\""), "{d}");
    // Every READ's release reached the prefill engine (a request with nothing to read releases its
    // hold too).
    assert!(metric(&p, "kvx_holds_released_total") >= Some(reads), "{p}");
    assert_eq!(metric(&p, "kvx_holds_live"), Some(0.0));
    assert_eq!(metric(&p, "kvx_holds_expired_total"), Some(0.0));
}
