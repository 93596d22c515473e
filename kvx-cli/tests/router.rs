//! The `kvx router` process: its options, its address line, its two ports and its stop on
//! SIGTERM. Routing, failover and streaming are tested against stub servers in the router
//! module's own tests.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const KVX: &str = env!("CARGO_BIN_EXE_kvx");
const LIMIT: Duration = Duration::from_secs(60);

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

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
        let read: Vec<String> = BufReader::new(stdout).lines().take(lines).map_while(Result::ok).collect();
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
    let api = address("kvx router: serving on ", &lines[0]);
    let metrics = address("kvx router: metrics on ", &lines[1]);

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let client = reqwest::Client::builder().no_proxy().timeout(LIMIT).build().unwrap();
        let body = r#"{"model": "m", "prompt": "hello"}"#;
        let post = client.post(format!("{api}/v1/completions")).body(body).send().await.unwrap();
        // 502 when the router tried the closed port, 503 when its first health check was first.
        assert!([502, 503].contains(&post.status().as_u16()), "{}", post.status());
        assert!(post.text().await.unwrap().contains("prefill server"));
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
    assert!(text(&out.stderr).contains("stopping"), "{}", text(&out.stderr));
}
