//! [`EtcdServer`]: a real etcd server (Debian's `etcd-server`) for tests, on free 127.0.0.1 ports
//! with its data in a fresh temporary directory, killed and removed when dropped.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::child::wait_within;

/// The line etcd logs once it serves clients.
const READY: &str = "ready to serve client requests";

/// How long etcd may take to start.
const START_LIMIT: Duration = Duration::from_secs(60);

/// Starts tried when a free port was taken before etcd bound it.
const ATTEMPTS: usize = 3;

/// The environment variable that makes a missing `etcd` a failure instead of a skip.
pub const REQUIRE_ETCD: &str = "KVX_REQUIRE_ETCD";

/// A running single-member etcd cluster. Dropping it kills the server and removes its data.
#[derive(Debug)]
pub struct EtcdServer {
    child: Child,
    dir: PathBuf,
    client_port: u16,
}

/// Whether the environment requires etcd ([`REQUIRE_ETCD`]`=1`).
pub fn etcd_required() -> bool {
    std::env::var(REQUIRE_ETCD).is_ok_and(|v| v == "1")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port: {e}"))
}

fn fresh_dir() -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kvx-etcd-{}-{n}-{nanos}", std::process::id()));
    std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

impl EtcdServer {
    /// Starts etcd and waits (at most a minute) until it logs that it serves clients. Without an
    /// `etcd` binary on `PATH`: prints why the caller skips and returns `None`, or panics when
    /// [`REQUIRE_ETCD`]`=1`. Panics when etcd is there but does not start.
    pub fn start_or_skip(test: &str) -> Option<EtcdServer> {
        if let Err(e) = Command::new("etcd").arg("--version").stdout(Stdio::null()).status() {
            assert!(!etcd_required(), "{REQUIRE_ETCD}=1 but etcd cannot run: {e}");
            eprintln!("skipping {test}: no etcd server (`etcd`: {e}; Debian: apt-get install etcd-server)");
            return None;
        }
        let mut failures = Vec::new();
        for _ in 0..ATTEMPTS {
            match Self::try_start() {
                Ok(server) => return Some(server),
                Err(why) => failures.push(why),
            }
        }
        panic!("etcd did not start: {}", failures.join("; "))
    }

    fn try_start() -> Result<EtcdServer, String> {
        let (client_port, peer_port) = (free_port(), free_port());
        let dir = fresh_dir();
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let spawned = Command::new("etcd")
            .args(["--name", "kvx-test", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kvx-test={peer}"), "--initial-cluster-state", "new"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(format!("spawning etcd: {e}"));
            }
        };
        let stderr = child.stderr.take();
        // From here on, dropping the server kills etcd and removes its directory.
        let server = EtcdServer { child, dir, client_port };
        let (tx, rx) = mpsc::channel();
        if let Some(stderr) = stderr {
            // Reads etcd's log to its end (so etcd never blocks on a full pipe): says when it is
            // ready, or hands back the lines it logged before it stopped.
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                for line in BufReader::new(stderr).lines().map_while(std::result::Result::ok) {
                    if line.contains(READY) {
                        let _ = tx.send(Ok(()));
                        seen.clear();
                    } else if seen.len() < 40 {
                        seen.push(line);
                    }
                }
                let _ = tx.send(Err(seen.join("\n")));
            });
        }
        match rx.recv_timeout(START_LIMIT) {
            Ok(Ok(())) => Ok(server),
            Ok(Err(log)) => Err(format!("etcd exited before serving:\n{log}")),
            Err(_) => Err(format!("etcd did not serve clients within {START_LIMIT:?}")),
        }
    }

    /// The discovery URL of the server: `etcd://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = wait_within(&mut self.child, Duration::from_secs(30));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
