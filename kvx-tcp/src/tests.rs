//! The checks of the wire, against a forged peer: a target that answers as a test says (a wrong
//! nonce, a wrong length, a second answer, an oversize frame, an answer to a released READ), a
//! client that sends an oversize request, and a real target refusing a range outside its live
//! registrations. Each failure is typed, and the agent goes on.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test setup: a failed unwrap is a failed test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use kvx_core::wire::agent_metadata;
use kvx_core::{
    AgentName, BlockList, DlistId, DlistOwner, ErrorKind, HostMemory, KvMemory, MemKind, TransferAgent,
    XferId, XferOp, XferState,
};
use kvx_net::session::accept_opening;
use kvx_net::{Connection, NetConfig};

use crate::frame::{HEADER_LEN, Header, Kind, Limits, decode_ranges};
use crate::link::Opening;
use crate::metadata::{AgentMetadata, RemoteRegion};
use crate::{BACKEND, TcpAgent, TcpConfig, TcpStats};

const BLOCK: u64 = 4096;
const BLOCKS: u32 = 4;
/// Where the forged target claims its memory is.
const REMOTE_BASE: u64 = 0x10_0000;
const DEADLINE: Duration = Duration::from_secs(10);

fn list(base: u64) -> BlockList {
    BlockList { kind: MemKind::Dram, device: 0, bases: vec![base], num_blocks: BLOCKS, block_len: BLOCK }
}

/// Waits, bounded, until `done` holds.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {DEADLINE:?}");
        std::thread::yield_now();
    }
}

fn settle(agent: &TcpAgent, x: XferId) -> XferState {
    let mut state = XferState::Pending;
    wait_until("a transfer settling", || {
        state = agent.poll(x).unwrap();
        state != XferState::Pending
    });
    state
}

fn failed_kind(state: XferState) -> ErrorKind {
    match state {
        XferState::Failed(e) => {
            assert_eq!(e.backend(), Some(BACKEND), "{e}");
            e.kind()
        }
        other => panic!("expected a failed transfer, got {other:?}"),
    }
}

/// An initiator with one connection per peer, its memory and lists over a peer's.
struct Initiator {
    agent: TcpAgent,
    memory: Arc<HostMemory>,
    local: DlistId,
    remote: DlistId,
}

impl Initiator {
    fn new(peer_metadata: &[u8], remote_base: u64) -> Self {
        let agent = TcpAgent::with_config("decode", &TcpConfig::default().with_connections(1)).unwrap();
        let memory = Arc::new(HostMemory::new((BLOCK * u64::from(BLOCKS)) as usize).unwrap());
        agent.register(memory.clone()).unwrap();
        let peer = agent.load_remote(peer_metadata).unwrap();
        let local = agent.prep_dlist(&DlistOwner::Local, &list(memory.region().addr)).unwrap();
        let remote = agent.prep_dlist(&DlistOwner::Remote(peer), &list(remote_base)).unwrap();
        Initiator { agent, memory, local, remote }
    }

    fn read(&self, blocks: &[u32]) -> XferId {
        self.agent.post(XferOp::Read, self.local, blocks, self.remote, blocks, None).unwrap()
    }

    fn untouched(&self) -> bool {
        self.memory.to_vec().iter().all(|&b| b == 0)
    }
}

/// A target that speaks the wire as the test says, on its own runtime.
struct ForgedTarget {
    rt: tokio::runtime::Runtime,
    listener: TcpListener,
}

/// One connection of the forged target, its session opened.
struct Forged {
    stream: TcpStream,
}

impl ForgedTarget {
    fn new() -> Self {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        ForgedTarget { rt, listener }
    }

    fn metadata(&self) -> Vec<u8> {
        let md = AgentMetadata {
            instance: 1,
            host: "127.0.0.1".into(),
            port: self.listener.local_addr().unwrap().port(),
            regions: vec![RemoteRegion { id: 1, addr: REMOTE_BASE, len: BLOCK * u64::from(BLOCKS) }],
        };
        agent_metadata::seal(BACKEND, &AgentName::new("forged"), &md).unwrap()
    }

    fn accept(&self) -> Forged {
        self.rt.block_on(async {
            let (mut stream, _) =
                tokio::time::timeout(DEADLINE, self.listener.accept()).await.unwrap().unwrap();
            accept_opening(&mut stream, None, 1 << 20, DEADLINE, |_| Ok((Vec::new(), ()))).await.unwrap();
            Forged { stream }
        })
    }

    /// Reads the next request: its header and ranges.
    fn request(&self, conn: &mut Forged) -> (Header, Vec<(u64, u64)>) {
        self.rt.block_on(async {
            let mut bytes = [0u8; HEADER_LEN];
            conn.stream.read_exact(&mut bytes).await.unwrap();
            let header = Header::decode(&bytes, Limits { max_data: 1 << 20 }).unwrap();
            let mut meta = vec![0u8; header.meta_len as usize];
            conn.stream.read_exact(&mut meta).await.unwrap();
            (header, decode_ranges(&header, &meta).unwrap())
        })
    }

    fn send(&self, conn: &mut Forged, header: Header, data: &[u8]) {
        self.rt.block_on(async {
            conn.stream.write_all(&header.encode()).await.unwrap();
            conn.stream.write_all(data).await.unwrap();
        })
    }

    /// Whether the agent closed the connection (reads to its end).
    fn closed(&self, conn: &mut Forged) -> bool {
        self.rt.block_on(async {
            let mut sink = [0u8; 256];
            loop {
                match tokio::time::timeout(DEADLINE, conn.stream.read(&mut sink)).await {
                    Ok(Ok(0) | Err(_)) => return true,
                    Ok(Ok(_)) => {}
                    Err(_) => return false,
                }
            }
        })
    }
}

/// The answer to `request` carrying `len` bytes of data.
fn answer(request: &Header, len: u64) -> Header {
    Header {
        data_len: len,
        ..Header::new(Kind::ReadData, request.xfer, request.nonce, request.first, request.count)
    }
}

fn asked(ranges: &[(u64, u64)]) -> u64 {
    ranges.iter().map(|r| r.1).sum()
}

/// A forged answer (another nonce, another READ, another chunk) drops the connection: the READ
/// fails with `Transfer` and nothing is written; the next READ opens a new connection and works.
#[test]
fn a_forged_answer_is_refused_and_the_agent_goes_on() {
    let target = ForgedTarget::new();
    let ini = Initiator::new(&target.metadata(), REMOTE_BASE);
    let forgeries: [fn(Header) -> Header; 3] = [
        |h| Header { nonce: h.nonce ^ 1, ..h },
        |h| Header { xfer: h.xfer + 1, ..h },
        |h| Header { first: h.first + 1, ..h },
    ];
    for (i, forge) in forgeries.into_iter().enumerate() {
        let x = ini.read(&[0, 1]);
        let mut conn = target.accept();
        let (req, ranges) = target.request(&mut conn);
        assert_eq!(ranges, [(REMOTE_BASE, 2 * BLOCK)], "blocks 0 and 1 travel as one range");
        let len = asked(&ranges);
        target.send(&mut conn, forge(answer(&req, len)), &vec![7u8; len as usize]);
        assert_eq!(failed_kind(settle(&ini.agent, x)), ErrorKind::Transfer);
        assert!(target.closed(&mut conn), "the connection of a forged answer is dropped");
        assert!(ini.untouched(), "a forged answer wrote into the slots");
        let stats = ini.agent.stats();
        assert_eq!((stats.answers_refused, stats.connections_dropped), (i as u64 + 1, i as u64 + 1));
    }
    // The agent goes on: a new connection, a READ answered as asked.
    let x = ini.read(&[2]);
    let mut conn = target.accept();
    let (req, ranges) = target.request(&mut conn);
    target.send(&mut conn, answer(&req, asked(&ranges)), &vec![9u8; BLOCK as usize]);
    assert_eq!(settle(&ini.agent, x), XferState::Done);
    assert_eq!(&ini.memory.to_vec()[2 * BLOCK as usize..3 * BLOCK as usize], &[9u8; BLOCK as usize][..]);
}

/// An answer of another length than asked (shorter, longer) drops the connection and fails the
/// READ; so does a second answer to a chunk already taken.
#[test]
fn an_answer_of_the_wrong_length_or_a_second_answer_is_refused() {
    let target = ForgedTarget::new();
    let ini = Initiator::new(&target.metadata(), REMOTE_BASE);
    for delta in [-1i64, 1] {
        let x = ini.read(&[3]);
        let mut conn = target.accept();
        let (req, ranges) = target.request(&mut conn);
        let len = (asked(&ranges) as i64 + delta) as u64;
        target.send(&mut conn, answer(&req, len), &vec![7u8; len as usize]);
        assert_eq!(failed_kind(settle(&ini.agent, x)), ErrorKind::Transfer);
        assert!(target.closed(&mut conn));
        assert!(ini.untouched());
    }
    let x = ini.read(&[0]);
    let mut conn = target.accept();
    let (req, ranges) = target.request(&mut conn);
    target.send(&mut conn, answer(&req, asked(&ranges)), &vec![5u8; BLOCK as usize]);
    assert_eq!(settle(&ini.agent, x), XferState::Done);
    target.send(&mut conn, answer(&req, asked(&ranges)), &vec![6u8; BLOCK as usize]);
    assert!(target.closed(&mut conn), "a second answer to a chunk drops the connection");
    assert_eq!(
        &ini.memory.to_vec()[..BLOCK as usize],
        &[5u8; BLOCK as usize][..],
        "the chunk was written twice"
    );
    assert_eq!(ini.agent.stats().answers_refused, 3);
}

/// A header claiming more data than the initiator asks in a chunk is refused from the header,
/// before anything is read or allocated.
#[test]
fn an_oversize_answer_is_refused_from_its_header() {
    let target = ForgedTarget::new();
    let ini = Initiator::new(&target.metadata(), REMOTE_BASE);
    let mut conn = target.accept();
    let x = ini.read(&[0]);
    let (req, _) = target.request(&mut conn);
    target.send(&mut conn, answer(&req, u64::MAX), &[]);
    let XferState::Failed(e) = settle(&ini.agent, x) else { panic!("an oversize answer completed a READ") };
    assert_eq!(e.kind(), ErrorKind::Transfer);
    assert!(e.message().contains("over the limit"), "{e}");
    assert!(target.closed(&mut conn));
    assert_eq!(ini.agent.stats().connections_dropped, 1);
}

/// A READ released while its answer is on its way takes nothing more: the answer is read and
/// thrown away, the slots keep their bytes, and the connection stays.
#[test]
fn a_released_read_takes_nothing_more() {
    let target = ForgedTarget::new();
    let ini = Initiator::new(&target.metadata(), REMOTE_BASE);
    let mut conn = target.accept();
    let x = ini.read(&[1]);
    let (req, ranges) = target.request(&mut conn);
    ini.agent.release(x).unwrap();
    target.send(&mut conn, answer(&req, asked(&ranges)), &vec![7u8; BLOCK as usize]);
    wait_until("the answer thrown away", || ini.agent.stats().answers_discarded == 1);
    assert!(ini.untouched(), "a released READ's answer was written");
    let y = ini.read(&[2]);
    let (req, ranges) = target.request(&mut conn);
    target.send(&mut conn, answer(&req, asked(&ranges)), &vec![8u8; BLOCK as usize]);
    assert_eq!(settle(&ini.agent, y), XferState::Done, "the same connection serves the next READ");
    let mut completed = Vec::new();
    ini.agent.drain_completions(&mut completed).unwrap();
    assert_eq!(completed, [y], "a released READ is never reported");
    assert_eq!(ini.agent.stats().connections_dropped, 0);
}

fn real_target() -> (TcpAgent, Arc<HostMemory>, kvx_core::RegistrationId) {
    let agent = TcpAgent::with_config("prefill", &TcpConfig::default()).unwrap();
    let memory = Arc::new(HostMemory::new((BLOCK * u64::from(BLOCKS)) as usize).unwrap());
    memory.write(0, &vec![3u8; memory.region().len as usize]).unwrap();
    let registration = agent.register(memory.clone()).unwrap();
    (agent, memory, registration)
}

/// A range outside the target's live registrations (here: deregistered after the initiator
/// loaded its metadata) is refused: the READ and the WRITE fail with `Transfer`, nothing moves,
/// and both agents go on.
#[test]
fn a_range_outside_the_targets_registrations_is_refused() {
    let (target, memory, registration) = real_target();
    let ini = Initiator::new(&target.local_metadata().unwrap(), memory.region().addr);
    let x = ini.read(&[0, 2]);
    assert_eq!(settle(&ini.agent, x), XferState::Done);
    target.deregister(registration).unwrap();
    let x = ini.read(&[1]);
    assert_eq!(failed_kind(settle(&ini.agent, x)), ErrorKind::Transfer);
    let w = ini.agent.post(XferOp::Write, ini.local, &[1], ini.remote, &[1], None).unwrap();
    assert_eq!(failed_kind(settle(&ini.agent, w)), ErrorKind::Transfer);
    assert_eq!(target.stats().requests_refused, 2);
    assert!(memory.to_vec().iter().all(|&b| b == 3), "a refused WRITE wrote");
    // Registered again: served again, on the same connections.
    target.register(memory.clone()).unwrap();
    let x = ini.read(&[1]);
    assert_eq!(settle(&ini.agent, x), XferState::Done);
    assert_eq!(ini.agent.stats().connections_dropped + target.stats().connections_dropped, 0);
}

/// Requests a target does not take (an oversize one, one of a kind it does not take) drop their
/// connection, counted, before anything is allocated; the target serves others meanwhile and after.
#[test]
fn a_malformed_request_drops_its_connection_and_the_target_goes_on() {
    let (target, memory, _) = real_target();
    let ini = Initiator::new(&target.local_metadata().unwrap(), memory.region().addr);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let port = target.local_addr().port();
    let opening = Opening { agent: "rogue".into(), target: "prefill".into(), instance: instance_of(&target) };
    let requests = [
        Header { data_len: u64::MAX, ..Header::new(Kind::WriteRequest, 1, 2, 0, 1) },
        Header { meta_len: u32::MAX, ..Header::new(Kind::Notify, 0, 0, 0, 0) },
        Header::new(Kind::ReadData, 1, 2, 0, 1),
    ];
    for (i, request) in requests.into_iter().enumerate() {
        let closed = rt.block_on(async {
            let mut conn = Connection::connect("127.0.0.1", port, &NetConfig::default()).await.unwrap();
            conn.request(rmp_serde::to_vec_named(&opening).unwrap()).await.unwrap();
            let mut stream = conn.into_stream();
            stream.write_all(&request.encode()).await.unwrap();
            let mut sink = [0u8; 16];
            matches!(tokio::time::timeout(DEADLINE, stream.read(&mut sink)).await, Ok(Ok(0) | Err(_)))
        });
        assert!(closed, "{request:?}: the connection stays open");
        wait_until("the drop counted", || target.stats().connections_dropped == i as u64 + 1);
        let x = ini.read(&[i as u32]);
        assert_eq!(settle(&ini.agent, x), XferState::Done, "the target serves others");
    }
    let TcpStats { requests_refused, .. } = target.stats();
    assert_eq!(requests_refused, 0);
}

/// A connection that means another agent or instance (stale metadata) is refused at its opening.
#[test]
fn an_opening_for_another_instance_is_refused() {
    let (target, ..) = real_target();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let port = target.local_addr().port();
    let stale =
        Opening { agent: "decode".into(), target: "prefill".into(), instance: instance_of(&target) ^ 1 };
    let e = rt.block_on(async {
        let mut conn = Connection::connect("127.0.0.1", port, &NetConfig::default()).await.unwrap();
        conn.request(rmp_serde::to_vec_named(&stale).unwrap()).await.unwrap_err()
    });
    assert_eq!(e.kind(), ErrorKind::Handshake, "{e}");
}

fn instance_of(agent: &TcpAgent) -> u64 {
    AgentMetadata::open(&agent.local_metadata().unwrap()).unwrap().1.instance
}

/// With a key, a peer without it is refused before anything is served, and one with it works.
#[test]
fn a_keyed_agent_refuses_a_peer_without_the_key() {
    let key = kvx_core::AuthKey::new(b"kvx-tcp test key, 32 bytes long").unwrap();
    let config = TcpConfig::default().with_auth_key(Some(key));
    let target = TcpAgent::with_config("prefill", &config).unwrap();
    let memory = Arc::new(HostMemory::new((BLOCK * u64::from(BLOCKS)) as usize).unwrap());
    target.register(memory.clone()).unwrap();
    let keyless = Initiator::new(&target.local_metadata().unwrap(), memory.region().addr);
    let x = keyless.read(&[0]);
    assert_eq!(failed_kind(settle(&keyless.agent, x)), ErrorKind::Transfer);
    assert!(keyless.untouched());
    assert_eq!(keyless.agent.stats().connections_opened, 0, "a session opened without the key");
}

/// A notification handed over right before its sender is dropped still arrives: dropping the
/// agent waits for what its connections were handed.
#[test]
fn a_notification_sent_before_the_sender_drops_arrives() {
    let (target, memory, _) = real_target();
    let ini = Initiator::new(&target.local_metadata().unwrap(), memory.region().addr);
    ini.agent.notify(&AgentName::new("prefill"), b"last words").unwrap();
    drop(ini);
    let mut got = Vec::new();
    wait_until("the notification", || {
        target.drain_notifications(&mut got).unwrap();
        !got.is_empty()
    });
    assert_eq!((got[0].from.as_str(), &got[0].msg[..]), ("decode", &b"last words"[..]));
}

/// `wait` sleeps until the transfer ends and returns its state (a lookup once it is final, and
/// `Pending` when the time runs out first); an unknown transfer is `NotFound`.
#[test]
fn wait_returns_once_the_transfer_ends_or_the_time_runs_out() {
    let (target, memory, _) = real_target();
    let ini = Initiator::new(&target.local_metadata().unwrap(), memory.region().addr);
    let x = ini.read(&[0, 1, 2, 3]);
    assert_eq!(ini.agent.wait(x, DEADLINE).unwrap(), XferState::Done);
    assert_eq!(ini.agent.wait(x, Duration::ZERO).unwrap(), XferState::Done);
    assert!(ini.memory.to_vec().iter().all(|&b| b == 3));
    ini.agent.release(x).unwrap();
    assert_eq!(ini.agent.wait(x, DEADLINE).unwrap_err().kind(), ErrorKind::NotFound);
    // A forged target that never answers: the wait ends with the time, the READ still pending.
    let forged = ForgedTarget::new();
    let silent = Initiator::new(&forged.metadata(), REMOTE_BASE);
    let _conn = forged.accept();
    let y = silent.read(&[0]);
    let start = Instant::now();
    assert_eq!(silent.agent.wait(y, Duration::from_millis(50)).unwrap(), XferState::Pending);
    assert!(start.elapsed() >= Duration::from_millis(50));
}

/// An established connection on which no request starts within `idle_timeout` is closed by the
/// listener (counted, not as a drop); the initiator lets a connection idle half as long go and
/// opens a new one first, so the next READ never meets the close.
#[test]
fn idle_connections_are_closed_and_opened_again_when_next_needed() {
    let mut config = TcpConfig::default();
    config.net.limits.idle_timeout = Duration::from_secs(1);
    let target = TcpAgent::with_config("prefill", &config).unwrap();
    let memory = Arc::new(HostMemory::new((BLOCK * u64::from(BLOCKS)) as usize).unwrap());
    memory.write(0, &vec![5u8; memory.region().len as usize]).unwrap();
    target.register(memory.clone()).unwrap();
    let agent = TcpAgent::with_config("decode", &config.clone().with_connections(1)).unwrap();
    let local_memory = Arc::new(HostMemory::new((BLOCK * u64::from(BLOCKS)) as usize).unwrap());
    agent.register(local_memory.clone()).unwrap();
    let peer = agent.load_remote(&target.local_metadata().unwrap()).unwrap();
    let local = agent.prep_dlist(&DlistOwner::Local, &list(local_memory.region().addr)).unwrap();
    let remote = agent.prep_dlist(&DlistOwner::Remote(peer), &list(memory.region().addr)).unwrap();
    let read = |b: u32| agent.post(XferOp::Read, local, &[b], remote, &[b], None).unwrap();
    assert_eq!(agent.wait(read(0), DEADLINE).unwrap(), XferState::Done);
    wait_until("the idle connection closed", || target.stats().connections_idle == 1);
    assert_eq!(agent.wait(read(1), DEADLINE).unwrap(), XferState::Done, "a new connection serves it");
    assert_eq!(agent.stats().connections_opened, 2);
    // Used again at once, well before half the idle time: the same connection.
    assert_eq!(agent.wait(read(2), DEADLINE).unwrap(), XferState::Done);
    assert_eq!(agent.stats().connections_opened, 2);
    assert_eq!(agent.stats().connections_dropped + target.stats().connections_dropped, 0);
    assert!(local_memory.to_vec()[..3 * BLOCK as usize].iter().all(|&b| b == 5));
}
