//! The router under floods, with legitimate traffic going on against stub servers: large uploads
//! that stall, hundreds of half-sent requests and idle connections, connections that hold slots
//! with slow or repeated requests. Each test checks the legitimate side (every `/health` and
//! completion answered 200, within twice its unloaded latency plus a second) and what the router
//! dropped, and prints its measurements (`--nocapture` shows them).

use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;

/// The legitimate client: a new connection per request, as a client behind a flood would make.
fn legit_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().pool_max_idle_per_host(0).build().unwrap()
}

/// The latencies of one `/health` and one completion, each answered 200 in full.
#[derive(Debug, Clone, Copy, Default)]
struct Round {
    health: Duration,
    completion: Duration,
}

async fn legit_round(url: &str) -> Round {
    let client = legit_client();
    let start = Instant::now();
    let health = within("/health", client.get(format!("{url}/health")).send()).await.unwrap();
    assert_eq!(health.status(), 200);
    within("/health's body", health.bytes()).await.unwrap();
    let health = start.elapsed();
    let start = Instant::now();
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 4});
    let request = client
        .post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string());
    let response = within("a completion", request.send()).await.unwrap();
    assert_eq!(response.status(), 200);
    let answer: Value = serde_json::from_slice(&within("its body", response.bytes()).await.unwrap()).unwrap();
    assert_eq!(answer["choices"][0]["text"], "decoded by d0");
    Round { health, completion: start.elapsed() }
}

/// The median of five rounds on the quiet router, after one to warm up.
async fn unloaded(url: &str) -> Round {
    legit_round(url).await;
    let mut rounds = Vec::new();
    for _ in 0..5 {
        rounds.push(legit_round(url).await);
    }
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    Round {
        health: median(rounds.iter().map(|r| r.health).collect()),
        completion: median(rounds.iter().map(|r| r.completion).collect()),
    }
}

/// Legitimate rounds until `done` (at least `min` of them): each must stay within twice its
/// unloaded latency plus a second. Returns the slowest of each.
async fn legit_while(url: &str, unloaded: Round, min: usize, done: &AtomicBool) -> Round {
    let bound = |d: Duration| d * 2 + Duration::from_secs(1);
    let mut worst = Round::default();
    let mut rounds = 0;
    let start = Instant::now();
    while rounds < min || !done.load(Ordering::SeqCst) {
        assert!(start.elapsed() < LIMIT, "the flood did not end within {LIMIT:?}");
        let round = legit_round(url).await;
        assert!(round.health <= bound(unloaded.health), "/health took {:?} under the flood", round.health);
        assert!(
            round.completion <= bound(unloaded.completion),
            "a completion took {:?} under the flood",
            round.completion
        );
        worst.health = worst.health.max(round.health);
        worst.completion = worst.completion.max(round.completion);
        rounds += 1;
    }
    println!(
        "  legit ({rounds} rounds, new connection each): /health {:?} unloaded, {:?} worst loaded; \
         completion {:?} unloaded, {:?} worst loaded",
        unloaded.health, worst.health, unloaded.completion, worst.completion
    );
    worst
}

/// A field of /proc/self/status, in KiB.
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Waits until the router closes `stream` (end of stream or an error), reading what it sends.
async fn closed(stream: &mut TcpStream) {
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

fn addr(url: &str) -> String {
    url.trim_start_matches("http://").to_owned()
}

/// A connection to `addr` from 127.0.0.2: a source of its own, as a flood from another host is.
async fn connect_from_elsewhere(addr: &str) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind("127.0.0.2:0".parse().unwrap())?;
    socket.connect(addr.parse().unwrap()).await
}

/// The dropped-connection counter for `reason`.
async fn dropped(url: &str, reason: &str) -> f64 {
    metric(&metrics(url).await, &format!("kvx_router_connections_dropped_total{{reason=\"{reason}\"}}"))
}

async fn stubs() -> (Arc<Stub>, Arc<Stub>) {
    (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await)
}

/// The child-process variable of [`in_child`].
const CHILD: &str = "KVX_ROUTER_FLOOD_CHILD";

/// Runs test `name` of this binary alone in a child process (so that no other test's memory
/// counts in its RSS), prints its output, and checks that it passed. In the child, runs `body`.
fn in_child<F: Future<Output = ()>>(name: &str, body: impl FnOnce() -> F) {
    if std::env::var_os(CHILD).is_some() {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        return runtime.block_on(body());
    }
    let exe = std::env::current_exe().unwrap();
    let output = Command::new(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    print!("{}", String::from_utf8_lossy(&output.stdout));
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{name} failed in its child process");
}

/// The flood's own runtime (one thread), as if it ran on other hosts: its tasks do not queue in
/// front of the router's on the test's runtime.
struct Crowd(Option<tokio::runtime::Runtime>);

impl Crowd {
    fn new() -> Self {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        Crowd(Some(runtime))
    }

    fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.0.as_ref().unwrap().spawn(task)
    }
}

impl Drop for Crowd {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

static ZEROS: [u8; 1 << 20] = [0; 1 << 20];

#[test]
fn stalled_large_uploads_stay_within_the_body_budget() {
    in_child("tests::floods::stalled_large_uploads_stay_within_the_body_budget", stalled_uploads);
}

async fn stalled_uploads() {
    const CLIENTS: usize = 32;
    const CLAIMED: usize = 48 << 20;
    const SENT: usize = 2 << 20;
    let limits =
        Limits { body_timeout: Duration::from_secs(2), max_buffered_bytes: 16 << 20, ..Limits::default() };
    let (p, d) = stubs().await;
    let (_router, url) = router_with(&[&p.url], &[&d.url], limits, 64 << 20).await;
    let quiet = unloaded(&url).await;
    let before = status_kib("VmRSS:");

    let done = Arc::new(AtomicBool::new(false));
    let crowd = Crowd::new();
    let flood: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let addr = addr(&url);
            crowd.spawn(async move {
                let start = Instant::now();
                let mut stream = TcpStream::connect(addr).await.unwrap();
                let head = format!(
                    "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                     content-length: {CLAIMED}\r\n\r\n"
                );
                let sent = async {
                    stream.write_all(head.as_bytes()).await?;
                    for _ in 0..SENT / ZEROS.len() {
                        stream.write_all(&ZEROS).await?;
                    }
                    std::io::Result::Ok(())
                };
                let _ = sent.await;
                // Stalled: nothing more is sent.
                closed(&mut stream).await;
                start.elapsed()
            })
        })
        .collect();
    let watch = {
        let done = done.clone();
        tokio::spawn(async move {
            let mut lifetimes = Vec::new();
            for client in flood {
                lifetimes.push(within("a stalled upload's close", client).await.unwrap());
            }
            done.store(true, Ordering::SeqCst);
            lifetimes
        })
    };
    legit_while(&url, quiet, 5, &done).await;
    let lifetimes = within("the flood", watch).await.unwrap();
    let peak = status_kib("VmHWM:");
    let after = status_kib("VmRSS:");
    let longest = lifetimes.iter().max().unwrap();
    println!(
        "flood 1: {CLIENTS} clients claiming {} MiB each, sending {} MiB and stalling; body budget {} MiB, \
         body timeout {:?}",
        CLAIMED >> 20,
        SENT >> 20,
        limits.max_buffered_bytes >> 20,
        limits.body_timeout
    );
    println!(
        "  RSS {:.1} MiB before, {:.1} MiB peak, {:.1} MiB after; every stalled upload closed, the last {:?} \
         after its connect",
        mib(before),
        mib(peak),
        mib(after),
        longest
    );
    assert!(peak - before < 64 << 10, "RSS grew by {:.1} MiB", mib(peak - before));
    assert!(*longest < limits.body_timeout + Duration::from_secs(2), "a stalled upload lived {longest:?}");
    let (budget, timeout) = (dropped(&url, "body_budget").await, dropped(&url, "body_timeout").await);
    println!("  dropped: {budget} over the body budget (503), {timeout} at the body timeout (408)");
    assert!(budget >= 1.0 && timeout >= 1.0, "budget {budget}, timeout {timeout}");
    assert_eq!(budget + timeout, CLIENTS as f64);
    let text = metrics(&url).await;
    assert_eq!(metric(&text, "kvx_router_buffered_body_bytes"), 0.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_requests_and_idle_connections_do_not_keep_health_out() {
    const HALF_SENT: usize = 1200;
    const IDLE: usize = 200;
    let limits = Limits {
        max_connections: 64,
        max_per_source: 64,
        max_pending: 64,
        header_timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(2),
        ..Limits::default()
    };
    let (p, d) = stubs().await;
    let (_router, url) = router_with(&[&p.url], &[&d.url], limits, 1 << 20).await;
    let quiet = unloaded(&url).await;

    let done = Arc::new(AtomicBool::new(false));
    let crowd = Crowd::new();
    // At most 1000 flood connections are open at once: fewer than the listen backlog (1024), which
    // the router's accept loop may lag behind on these two cores. Past it the kernel drops SYNs
    // (a SYN flood, the kernel's to handle), and the legitimate client's connect waits 1 s.
    let opening = Arc::new(Semaphore::new(1000));
    let half_sent = (0..HALF_SENT).map(|_| {
        let (addr, opening) = (addr(&url), opening.clone());
        crowd.spawn(async move {
            let permit = opening.acquire_owned().await.unwrap();
            let start = Instant::now();
            let mut stream = connect_from_elsewhere(&addr).await.unwrap();
            let _ = stream.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-le").await;
            closed(&mut stream).await;
            drop(permit);
            start.elapsed()
        })
    });
    let idle = (0..IDLE).map(|_| {
        let (addr, opening) = (addr(&url), opening.clone());
        crowd.spawn(async move {
            let permit = opening.acquire_owned().await.unwrap();
            let start = Instant::now();
            let mut stream = connect_from_elsewhere(&addr).await.unwrap();
            let _ = stream.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await;
            // The answer, then nothing: the connection idles until it is evicted or times out.
            closed(&mut stream).await;
            drop(permit);
            start.elapsed()
        })
    });
    let flood: Vec<_> = half_sent.chain(idle).collect();
    let watch = {
        let done = done.clone();
        tokio::spawn(async move {
            let mut lifetimes = Vec::new();
            for client in flood {
                lifetimes.push(within("a flood connection's close", client).await.unwrap());
            }
            done.store(true, Ordering::SeqCst);
            lifetimes
        })
    };
    legit_while(&url, quiet, 10, &done).await;
    let lifetimes = within("the flood", watch).await.unwrap();
    let longest = lifetimes.iter().max().unwrap();
    // Each flood connection was dropped by the router for one of these reasons. A client can see
    // its close a moment before the router counts it (hyper closes the socket on its timer before
    // it returns), so the counters are awaited, not read once.
    // Refused at its accept (every pending place taken, as on a loaded machine) is a drop too.
    let counts = || async {
        (
            dropped(&url, "evicted").await,
            dropped(&url, "header_timeout").await,
            dropped(&url, "idle_timeout").await,
            dropped(&url, "full").await,
            dropped(&url, "refused").await,
            dropped(&url, "error").await,
        )
    };
    let counted = async {
        loop {
            let c = counts().await;
            if c.0 + c.1 + c.2 + c.3 + c.4 + c.5 >= (HALF_SENT + IDLE) as f64 {
                break c;
            }
            tokio::task::yield_now().await;
        }
    };
    let Ok((evicted, header, idle, full, refused, error)) = tokio::time::timeout(LIMIT, counted).await else {
        panic!(
            "not every flood connection's drop was counted within {LIMIT:?}: (evicted, header timeout, \
             idle timeout, full, refused, error) {:?} of {}",
            counts().await,
            HALF_SENT + IDLE
        );
    };
    println!(
        "flood 2: {HALF_SENT} half-sent requests and {IDLE} idle connections (pending budget {}, \
         established {}); the last closed {longest:?} after its connect; dropped: {evicted} evicted, \
         {header} at the header timeout, {idle} at the idle timeout, {full} with no room, {refused} \
         refused at the accept, {error} failed",
        limits.max_pending, limits.max_connections
    );
    assert!(*longest < limits.idle_timeout + Duration::from_secs(3), "a flood connection lived {longest:?}");
    assert!(evicted >= 1.0, "{evicted} evicted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_holding_slots_with_slow_or_repeated_requests_make_way() {
    const DRIPPING: usize = 24;
    const REPEATING: usize = 24;
    let limits = Limits {
        max_connections: 32,
        max_per_source: 32,
        max_pending: 64,
        header_timeout: Duration::from_secs(1),
        body_timeout: Duration::from_secs(2),
        // Also how long an evicted connection stays parked: the flood's clients, which wait for
        // an answer that a parked connection never gets, then see it closed and stop.
        idle_timeout: Duration::from_secs(2),
        ..Limits::default()
    };
    let (p, d) = stubs().await;
    let (_router, url) = router_with(&[&p.url], &[&d.url], limits, 1 << 20).await;
    let quiet = unloaded(&url).await;

    let stop = Arc::new(AtomicBool::new(false));
    let crowd = Crowd::new();
    let requests = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(Semaphore::new(0));
    // Valid requests whose bodies come a byte every 20 ms: each connection sits in its request.
    let dripping = (0..DRIPPING).map(|_| {
        let (addr, stop) = (addr(&url), stop.clone());
        crowd.spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let Ok(mut stream) = connect_from_elsewhere(&addr).await else { continue };
                let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n";
                let mut ok = stream.write_all(head.as_bytes()).await.is_ok();
                while ok && !stop.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    ok = stream.write_all(b" ").await.is_ok();
                }
            }
        })
    });
    // Requests one after another on one connection, each answered: the slot is used, briefly.
    let repeating = (0..REPEATING).map(|_| {
        let (addr, stop, requests, answered) = (addr(&url), stop.clone(), requests.clone(), answered.clone());
        crowd.spawn(async move {
            let mut buf = [0u8; 4096];
            while !stop.load(Ordering::SeqCst) {
                let Ok(mut stream) = connect_from_elsewhere(&addr).await else { continue };
                while !stop.load(Ordering::SeqCst) {
                    if stream.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await.is_err() {
                        break;
                    }
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            requests.fetch_add(1, Ordering::SeqCst);
                            answered.add_permits(1);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        })
    });
    let flood: Vec<_> = dripping.chain(repeating).collect();
    // Let the flood take every slot before the legitimate client comes.
    let first = answered.acquire_many(4 * REPEATING as u32);
    within("the flood's first requests", first).await.unwrap().forget();
    let rounds = AtomicBool::new(true);
    legit_while(&url, quiet, 20, &rounds).await;
    stop.store(true, Ordering::SeqCst);
    for client in flood {
        within("a flood client's end", client).await.unwrap();
    }
    let (evicted, timeout, full) =
        (dropped(&url, "evicted").await, dropped(&url, "body_timeout").await, dropped(&url, "full").await);
    println!(
        "flood 3: {DRIPPING} connections dripping request bodies and {REPEATING} repeating requests \
         ({} answered) for {} slots; dropped: {evicted} evicted, {timeout} at the body timeout, \
         {full} refused as full",
        requests.load(Ordering::SeqCst),
        limits.max_connections
    );
    assert!(evicted >= 1.0, "{evicted} evicted");
}

/// Where [`ten_thousand_idle_or_half_sent_connections_do_not_keep_health_out`]'s floods run: in a
/// child process of this binary (see [`ChildFlood`]); passes at once in a test run.
#[test]
fn flood() {
    kvx_testkit::flood::run_child_flood();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_idle_or_half_sent_connections_do_not_keep_health_out() {
    use kvx_testkit::flood::{ChildFlood, Shape, raise_open_files};
    const N: usize = 10_000;
    // The router's ends of the flood's sockets, and slack (the flood has descriptors of its own).
    let want = N as u64 + 4096;
    let have = raise_open_files(want);
    if have < want {
        println!("SKIPPED: a flood of {N} needs {want} open files; the limit here is {have}");
        return;
    }
    let (p, d) = stubs().await;
    // The defaults: 128 pending, 1,024 established, 16,384 parked.
    let (_router, url) = router_with(&[&p.url], &[&d.url], Limits::default(), 1 << 20).await;
    let quiet = unloaded(&url).await;
    let target: std::net::SocketAddr = addr(&url).parse().unwrap();
    let half_sent = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-le".to_vec();
    for shape in [Shape::Idle, Shape::Stalled(half_sent)] {
        let source = [127, 0, 0, 2].into();
        let mut flood = ChildFlood::start("tests::floods::flood", target, source, &shape, N).unwrap();
        tokio::task::block_in_place(|| flood.wait_connected(LIMIT)).unwrap();
        let before = status_kib("VmRSS:");
        legit_while(&url, quiet, 20, &AtomicBool::new(true)).await;
        let grown = status_kib("VmRSS:").saturating_sub(before);
        let f = tokio::task::block_in_place(|| flood.stop(LIMIT)).unwrap();
        let evicted = dropped(&url, "evicted").await;
        println!(
            "flood 4: {N} {} connections from another address: opened {} ({} dropped); router evicted {evicted} \
             in all, RSS +{:.1} MiB",
            shape.name(),
            f.opened,
            f.dropped,
            mib(grown)
        );
        // Parked, not closed: the flood did not have to connect again and again.
        assert!(f.opened < 2 * N as u64, "{f:?}");
    }
}
