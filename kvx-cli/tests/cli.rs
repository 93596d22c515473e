//! The `kvx` binary: the demo, and prefill and decode as two processes.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

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

/// Runs `kvx demo` on `backend` with 40 requests and checks that all finished, every byte
/// matched and nothing leaked.
fn demo_checks_every_byte_and_leaks_nothing_on(backend: &str) {
    let child = Command::new(KVX)
        .args(["demo", "--backend", backend, "--requests", "40", "--prompt-len", "1..100", "--seed", "7"])
        .args(SIZES)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait(child);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains(&format!("{backend} backend")), "{stdout}");
    assert!(stdout.contains("40 (40 finished, 0 failed)"), "{stdout}");
    assert!(stdout.contains("blocks mismatched      0"), "{stdout}");
    assert!(stdout.contains("blocks leaked          0"), "{stdout}");
}

#[test]
fn demo_checks_every_byte_and_leaks_nothing() {
    demo_checks_every_byte_and_leaks_nothing_on("loopback");
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

            /// `kvx prefill` and `kvx decode` as two processes: the decode process READs every
            /// block out of the prefill process's memory and checks every byte; both exit 0 and
            /// leak nothing.
            #[test]
            fn prefill_and_decode_processes() {
                super::prefill_and_decode_processes_with(BACKEND, &[]);
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

/// `kvx prefill` and `kvx decode` over UCX's TCP transport only (both processes read `UCX_TLS`
/// when their agents start): the transport a deployment without shared memory or RDMA gets.
#[cfg(feature = "ucx")]
#[test]
fn prefill_and_decode_processes_over_tcp() {
    prefill_and_decode_processes_with("ucx", &[("UCX_TLS", "tcp")]);
}

/// A `kvx prefill` process and the ports it listens on.
#[cfg(any(feature = "ucx", feature = "nixl"))]
struct Prefill {
    child: Child,
    /// The request API, as printed (`tcp://host:port`).
    api: String,
    /// Every port it listens on: the request API's and each rank's side channel.
    ports: Vec<u16>,
}

#[cfg(any(feature = "ucx", feature = "nixl"))]
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
#[cfg(any(feature = "ucx", feature = "nixl"))]
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
    assert!(api.starts_with("tcp://"), "{first}");
    (child, api, first)
}

#[cfg(any(feature = "ucx", feature = "nixl"))]
fn run_decode(backend: &str, api: &str, requests: usize, env: &[(&str, &str)]) -> Output {
    let requests = requests.to_string();
    let decode = Command::new(KVX)
        .env_remove("KVX_AUTH_KEY")
        .env_remove("KVX_DISCOVERY")
        .envs(env.iter().copied())
        .args(["decode", "--backend", backend, "--prefill", api, "--requests", &requests])
        .args(["--prompt-len", "1..120"])
        .args(SIZES)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait(decode)
}

/// Both processes succeeded: every request finished, bytes verified, nothing leaked.
#[cfg(any(feature = "ucx", feature = "nixl"))]
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

#[cfg(any(feature = "ucx", feature = "nixl"))]
fn prefill_and_decode_processes_with(backend: &str, env: &[(&str, &str)]) {
    let prefill = start_prefill(backend, &[], env);
    let decode = run_decode(backend, &prefill.api, 30, env);
    check_pair(decode, prefill.child, 30);
}

/// Every listening port of a `kvx prefill` process (the request API and each rank's side
/// channel) gets the 73-byte ZMTP frame and a length header claiming u32::MAX bytes; the process
/// stays up and a following `kvx decode` succeeds.
#[cfg(any(feature = "ucx", feature = "nixl"))]
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

/// A prefill/decode pair with the same key (flag on one side, `KVX_AUTH_KEY` on the other)
/// succeeds; a decode with a wrong key first fails cleanly with an authentication error and the
/// prefill process goes on.
#[cfg(any(feature = "ucx", feature = "nixl"))]
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

/// `kvx bench` on `backend`: a small run that checks the first transfer's bytes and reports the
/// ratio to memcpy.
fn bench_runs_on(backend: &str) {
    let args = ["bench", "--backend", backend, "--blocks", "64", "--pool-blocks", "128", "--rounds", "2"];
    let out =
        wait(Command::new(KVX).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap());
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains(&format!("{backend} READ")) && stdout.contains("ratio to memcpy"), "{stdout}");
}

#[test]
fn bench_measures_against_memcpy() {
    bench_runs_on("loopback");
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
