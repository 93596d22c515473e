//! `Peers` on its own: handshakes queued, connected, failed and expired; connections retired and
//! reused. No agent, no payloads.

use super::*;
use crate::memory::MemKind;

const SECOND: Duration = Duration::from_secs(1);

fn peers() -> Peers {
    let mut config = WorkerConfig::new("decode".into(), 0, 1, 4);
    config.handshake_timeout = 5 * SECOND;
    Peers::new(&config)
}

fn prefill() -> RemoteCoordinates {
    RemoteCoordinates::at("prefill", "h", 5600)
}

fn key(rank: u32) -> PeerKey {
    ("prefill".into(), rank)
}

fn conn(agent: &str, instance: u64) -> Connected {
    let list = BlockList { kind: MemKind::Dram, device: 0, bases: vec![0], num_blocks: 4, block_len: 16 };
    Connected {
        agent: AgentName::new(agent),
        dlist: DlistId(1),
        head_dlist: None,
        list,
        split: HeadSplit::new(1, 1).unwrap(),
        instance,
    }
}

fn load(id: &str) -> Waiter {
    Waiter::Load(LoadKey::new(id.into(), 1))
}

#[test]
fn a_peer_is_fetched_once_and_what_waited_is_handed_back_in_order() {
    let mut p = peers();
    let t0 = Instant::now();
    assert_eq!(p.when_ready(t0, &prefill(), 1, load("a")).unwrap(), None);
    assert_eq!(p.when_ready(t0, &prefill(), 1, Waiter::Message(b"m".to_vec())).unwrap(), None);
    let locator =
        PeerLocator { engine_id: "prefill".into(), rank: 1, endpoint: Some(Endpoint::new("h", 5601)) };
    assert_eq!(p.poll_command(), Some(WorkerCommand::FetchHandshake(locator)));
    assert_eq!(p.poll_command(), None, "one fetch per peer");
    assert!(p.is_handshaking(&key(1)) && !p.all_ready());
    assert_eq!(p.next_deadline(), Some(t0 + 5 * SECOND));
    let done = p.connected(t0 + SECOND, &key(1), conn("peer", 1)).unwrap();
    assert_eq!(
        done,
        Connection {
            took: SECOND,
            waiting: vec![load("a"), Waiter::Message(b"m".to_vec())],
            restarted_from: None
        }
    );
    assert_eq!((p.num_ready(), p.ready(&key(1)).map(|c| c.instance)), (1, Some(1)));
    assert_eq!(p.when_ready(t0, &prefill(), 1, load("b")).unwrap(), Some(load("b")), "ready: act now");
    assert_eq!(p.next_deadline(), None);
}

#[test]
fn a_side_channel_port_past_the_last_one_is_refused() {
    let mut p = peers();
    let remote = RemoteCoordinates::at("prefill", "h", u16::MAX);
    let e = p.when_ready(Instant::now(), &remote, 1, load("a")).unwrap_err();
    assert_eq!(e.kind(), crate::error::ErrorKind::InvalidPeerData);
    assert_eq!(p.poll_command(), None);
}

#[test]
fn a_new_instance_of_a_peer_is_a_restart() {
    let mut p = peers();
    let now = Instant::now();
    for (instance, restarted_from) in [(1, None), (1, None), (2, Some(1))] {
        p.when_ready(now, &prefill(), 0, load("a")).unwrap();
        let done = p.connected(now, &key(0), conn("peer", instance)).unwrap();
        assert_eq!(done.restarted_from, restarted_from);
        assert_eq!(p.retire(&key(0)), Some(AgentName::new("peer")));
        p.take_unused(|_| false);
    }
    assert_eq!(p.connected(now, &key(0), conn("peer", 3)), None, "no handshake was running");
}

#[test]
fn failed_and_expired_handshakes_hand_back_their_waiters() {
    let mut p = peers();
    let t0 = Instant::now();
    p.when_ready(t0, &prefill(), 0, load("a")).unwrap();
    p.when_ready(t0 + SECOND, &prefill(), 1, load("b")).unwrap();
    assert_eq!(p.expired(t0 + 5 * SECOND), [key(0)]);
    assert_eq!(p.failed(&key(0)), Some(vec![load("a")]));
    assert_eq!(p.failed(&key(0)), None);
    p.defer(&key(1), b"payload".to_vec());
    assert_eq!(p.take_deferred(), [Deferred { peer: key(1), payload: b"payload".to_vec() }]);
    assert!(p.take_deferred().is_empty(), "taken once");
}

#[test]
fn retired_connections_stay_while_read_from_and_come_back_for_the_same_instance() {
    let mut p = peers();
    let now = Instant::now();
    for (rank, agent) in [(0, "a"), (1, "b")] {
        p.when_ready(now, &prefill(), rank, load("x")).unwrap();
        p.connected(now, &key(rank), conn(agent, 1));
        assert_eq!(p.retire(&key(rank)), Some(AgentName::new(agent)));
    }
    assert_eq!(p.retire(&key(0)), None, "already dropped");
    let unused = p.take_unused(|agent| agent.as_str() == "a");
    assert_eq!(unused.iter().map(|c| c.agent.as_str()).collect::<Vec<_>>(), ["b"]);
    assert!(p.reuse_retired(&AgentName::new("a"), 2).is_none(), "another instance");
    assert!(p.reuse_retired(&AgentName::new("a"), 1).is_some());
    assert!(p.take_retired(&AgentName::new("a")).is_none());
}

#[test]
fn close_takes_every_connection_and_counts_the_messages_never_sent() {
    let mut p = peers();
    let now = Instant::now();
    p.when_ready(now, &prefill(), 0, load("x")).unwrap();
    p.connected(now, &key(0), conn("a", 1));
    p.when_ready(now, &prefill(), 1, load("x")).unwrap();
    p.connected(now, &key(1), conn("b", 1));
    p.retire(&key(1));
    p.when_ready(now, &prefill(), 2, Waiter::Message(vec![1])).unwrap();
    p.when_ready(now, &prefill(), 2, load("y")).unwrap();
    let closed = p.close();
    let mut agents: Vec<_> = closed.connections.iter().map(|c| c.agent.as_str().to_owned()).collect();
    agents.sort();
    assert_eq!((agents, closed.unsent), (vec!["a".to_owned(), "b".to_owned()], 1));
    assert_eq!((p.num_ready(), p.poll_command(), p.next_deadline()), (0, None, None));
}
