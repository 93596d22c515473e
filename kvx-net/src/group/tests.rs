use super::*;
use kvx_core::RequestId;
use kvx_core::auth::AuthKey;
use kvx_core::worker::{AggregatorLimits, FinishedAggregator};

fn rep(s: &str) -> Finished {
    Finished { sending: vec![RequestId::new(s)], ..Default::default() }
}

/// `reports`, each as its rank's (rank 0's first, then 1, 2, ...).
fn ranked(reports: impl IntoIterator<Item = Finished>) -> Vec<RankReport> {
    (0..).zip(reports).map(|(rank, finished)| RankReport { rank, finished }).collect()
}

/// A client speaking the group's protocol by hand: a forger, or a rank's connection.
struct Raw(Runtime);

impl Raw {
    fn new() -> Self {
        Raw(tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap())
    }

    fn connect(&self, port: u16, config: &NetConfig) -> Connection {
        self.0.block_on(Connection::connect("127.0.0.1", port, config)).unwrap()
    }

    fn send(&self, conn: &mut Connection, msg: &GroupMessage) -> Result<()> {
        self.0.block_on(conn.request(wire::encode(msg).unwrap())).map(drop)
    }

    /// `msg` on a new connection of its own, as a forger that never joined sends it.
    fn forge(&self, port: u16, config: &NetConfig, msg: &GroupMessage) -> Result<()> {
        self.send(&mut self.connect(port, config), msg)
    }
}

fn report(rank: u32, epoch: u64, seq: u64, finished: Finished) -> GroupMessage {
    GroupMessage::Report { rank, epoch, seq, finished }
}

/// This process's resident memory, in bytes.
fn vm_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

const T: Duration = Duration::from_secs(5);

#[test]
fn tcp_group_gathers_reports_of_other_ranks() {
    let port = free_port();
    let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, T).unwrap();
    let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, T).unwrap();
    assert_eq!(r1.gather_finished(rep("b")).unwrap(), None);
    let got = r0.gather_finished(rep("a")).unwrap().unwrap();
    assert_eq!(got, ranked([rep("a"), rep("b")]));
    assert!(TcpGroup::join(2, 2, "127.0.0.1", port, Duration::from_secs(1)).is_err());
    assert_eq!(r0.port(), Some(port));
    assert_eq!(r1.stats(), None);
}

#[test]
fn unacknowledged_reports_are_sent_again_and_merged_never_lost() {
    let port = free_port();
    let short = Duration::from_millis(300);
    let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, short).unwrap();
    let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, short).unwrap();
    // Rank 0 goes away: rank 1's reports cannot be delivered.
    drop(r0);
    assert_eq!(r1.gather_finished(rep("a")).unwrap(), None);
    assert_eq!(r1.gather_finished(rep("b")).unwrap(), None);
    // A new rank 0 on the same port gets them all: "a" first, then "b".
    let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, T).unwrap();
    assert_eq!(r1.gather_finished(Finished::default()).unwrap(), None);
    assert_eq!(r1.gather_finished(rep("c")).unwrap(), None);
    let mut all = Vec::new();
    for _ in 0..2 {
        all.extend(r0.gather_finished(Finished::default()).unwrap().unwrap()[1].finished.sending.clone());
    }
    assert_eq!(all, vec![RequestId::new("a"), RequestId::new("b"), RequestId::new("c")]);
}

#[test]
fn a_restarted_rank_is_heard_and_a_mismatched_one_refused_at_once() {
    let port = free_port();
    let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, T).unwrap();
    let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, T).unwrap();
    assert_eq!(r1.gather_finished(rep("before")).unwrap(), None);
    drop(r1);
    // The new process numbers its reports from 1 again: not taken for duplicates.
    let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, T).unwrap();
    assert_eq!(r1.gather_finished(rep("after")).unwrap(), None);
    assert_eq!(r0.gather_finished(Finished::default()).unwrap().unwrap()[1].finished, rep("before"));
    assert_eq!(r0.gather_finished(Finished::default()).unwrap().unwrap()[1].finished, rep("after"));
    // `Incompatible`, not the `Timeout` of a join retried until `T`: refused at once.
    let e = TcpGroup::join(1, 3, "127.0.0.1", port, T).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Incompatible, "{e}");
}

#[test]
fn a_keyed_group_refuses_ranks_without_the_key() {
    let port = free_port();
    let keyed = |k: &str| NetConfig::with_key(Some(AuthKey::new(k).unwrap()));
    let r0 = TcpGroup::join_with(0, 2, "127.0.0.1", port, T, keyed("group-key-0123456")).unwrap();
    for config in [keyed("other-key-01234567"), NetConfig::default()] {
        let e = TcpGroup::join_with(1, 2, "127.0.0.1", port, T, config).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unauthenticated, "{e}");
    }
    let r1 = TcpGroup::join_with(1, 2, "127.0.0.1", port, T, keyed("group-key-0123456")).unwrap();
    // Forgers without the key, or with another, reach nothing: neither a join nor a report.
    let raw = Raw::new();
    for config in [keyed("other-key-01234567"), NetConfig::default()] {
        for msg in [GroupMessage::Join { rank: 1, world_size: 2, epoch: 1 }, report(1, 1, 1, rep("forged"))] {
            let e = raw.forge(port, &config, &msg).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Unauthenticated, "{e}");
        }
    }
    assert_eq!(r1.gather_finished(rep("x")).unwrap(), None);
    assert_eq!(r0.gather_finished(rep("y")).unwrap().unwrap(), ranked([rep("y"), rep("x")]));
    assert_eq!(r0.stats().unwrap().unauthenticated, 6);
    let s = r0.group_stats().unwrap();
    assert_eq!(s, GroupStats { joins: 1, reports: 1, ..Default::default() });
}

#[test]
fn reports_from_connections_that_did_not_join_as_their_rank_are_refused_and_counted() {
    let port = free_port();
    let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, T).unwrap();
    let raw = Raw::new();
    let open = NetConfig::default();
    // Before rank 1 joined: no connection is rank 1's.
    let e = raw.forge(port, &open, &report(1, 1, 1, rep("x"))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Handshake, "{e}");
    assert!(e.to_string().contains("has not joined on this connection"), "{e}");
    // After rank 1 joined on its own connection: forged reports on others, whatever their
    // epoch (a new one, as a restarted rank's would be) and sequence number.
    let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, T).unwrap();
    for epoch in [0, 1, u64::MAX] {
        assert!(raw.forge(port, &open, &report(1, epoch, 1_000, rep("x"))).is_err());
    }
    // Nor is a rank outside the group anyone's.
    assert!(raw.forge(port, &open, &report(7, 1, 1, rep("x"))).is_err());
    // Rank 0 finished "x" itself, rank 1 has not: no step reports it.
    let mut agg = FinishedAggregator::new(2);
    for step in 0..3 {
        let own = rep(&format!("own-{step}"));
        assert_eq!(r1.gather_finished(own.clone()).unwrap(), None);
        let got = r0.gather_finished(rep("x")).unwrap().unwrap();
        assert_eq!(got, ranked([rep("x"), own]));
        assert!(agg.aggregate(Instant::now(), got).is_empty());
    }
    let s = r0.group_stats().unwrap();
    assert_eq!((s.refused_not_member, s.reports, s.joins, s.rejoins), (5, 3, 1, 0), "{s:?}");
}

#[test]
fn a_rank_joining_again_moves_it_to_its_new_connection() {
    let port = free_port();
    let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, T).unwrap();
    let r1 = TcpGroup::join(1, 2, "127.0.0.1", port, T).unwrap();
    let raw = Raw::new();
    // Another connection joins as rank 1 (without a key, whoever joins as a rank is taken
    // for it): its reports are heard, rank 1's first connection is not.
    let mut c = raw.connect(port, &NetConfig::default());
    raw.send(&mut c, &GroupMessage::Join { rank: 1, world_size: 2, epoch: 7 }).unwrap();
    raw.send(&mut c, &report(1, 7, 1, rep("from-c"))).unwrap();
    // The rank's own connection with another epoch than it joined with is refused.
    let e = raw.send(&mut c, &report(1, 8, 2, rep("other-epoch"))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Handshake, "{e}");
    // Rank 1's report is refused on its old connection; its sender connects again, joins
    // first, and is heard.
    assert_eq!(r1.gather_finished(rep("real")).unwrap(), None);
    // c is no longer rank 1's.
    let mut c = raw.connect(port, &NetConfig::default());
    assert!(raw.send(&mut c, &report(1, 7, 2, rep("late"))).is_err());
    let mut heard = Vec::new();
    for _ in 0..2 {
        let got = r0.gather_finished(Finished::default()).unwrap().unwrap();
        heard.extend(got[1].finished.sending.iter().map(|i| i.as_str().to_owned()));
    }
    assert_eq!(heard, ["from-c", "real"]);
    let s = r0.group_stats().unwrap();
    let counts = (s.joins, s.rejoins, s.reports, s.refused_not_member, s.refused_epoch);
    assert_eq!(counts, (3, 2, 2, 2, 1), "{s:?}");
}

#[test]
fn re_sent_reports_are_taken_once_and_a_new_epoch_is_heard() {
    let port = free_port();
    let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, T).unwrap();
    let raw = Raw::new();
    let open = NetConfig::default();
    let join = |epoch| GroupMessage::Join { rank: 1, world_size: 2, epoch };
    let mut c = raw.connect(port, &open);
    raw.send(&mut c, &join(5)).unwrap();
    raw.send(&mut c, &report(1, 5, 1, rep("a"))).unwrap();
    // The acknowledgement was lost: the same report again, on a new connection joined first.
    let mut c = raw.connect(port, &open);
    raw.send(&mut c, &join(5)).unwrap();
    raw.send(&mut c, &report(1, 5, 1, rep("a"))).unwrap();
    raw.send(&mut c, &report(1, 5, 2, rep("b"))).unwrap();
    // The rank restarts: a new process, a new epoch, numbered from 1 again.
    let mut c = raw.connect(port, &open);
    raw.send(&mut c, &join(6)).unwrap();
    raw.send(&mut c, &report(1, 6, 1, rep("c"))).unwrap();
    let mut heard = Vec::new();
    for _ in 0..4 {
        let got = r0.gather_finished(Finished::default()).unwrap().unwrap();
        heard.extend(got[1].finished.sending.iter().map(|i| i.as_str().to_owned()));
    }
    assert_eq!(heard, ["a", "b", "c"]);
    let s = r0.group_stats().unwrap();
    assert_eq!((s.joins, s.rejoins, s.reports, s.duplicates), (3, 2, 3, 1), "{s:?}");
}

#[test]
fn a_million_forged_ids_cost_bounded_memory() {
    let port = free_port();
    let r0 = TcpGroup::join(0, 2, "127.0.0.1", port, T).unwrap();
    let raw = Raw::new();
    let open = NetConfig::default();
    const BATCH: usize = 100_000;
    let ids = |k: usize| Finished {
        sending: (k * BATCH..(k + 1) * BATCH).map(|i| RequestId::new(format!("forged-{i}"))).collect(),
        ..Default::default()
    };
    let rss_before = vm_rss();
    // Forgers that never joined: a million ids, all refused before the gather.
    for k in 0..10 {
        assert!(raw.forge(port, &open, &report(1, 1, k as u64 + 1, ids(k))).is_err());
    }
    // A connection that joined as rank 1 (without a key, taken for it): its million ids reach
    // rank 0's aggregation, which keeps at most its cap of them.
    let mut c = raw.connect(port, &open);
    raw.send(&mut c, &GroupMessage::Join { rank: 1, world_size: 2, epoch: 9 }).unwrap();
    let mut agg = FinishedAggregator::new(2);
    for k in 0..10 {
        raw.send(&mut c, &report(1, 9, k as u64 + 1, ids(k))).unwrap();
        let got = r0.gather_finished(Finished::default()).unwrap().unwrap();
        assert!(agg.aggregate(Instant::now(), got).is_empty());
        assert!(agg.num_partial() <= AggregatorLimits::DEFAULT_MAX_PARTIAL);
    }
    let grown = vm_rss().saturating_sub(rss_before);
    eprintln!("a million forged ids: resident memory grew by {} MiB", grown >> 20);
    // About 80 MiB here (the reports in flight); 470 MiB with no cap on the partial ids.
    assert!(grown < 256 << 20, "resident memory grew by {} MiB", grown >> 20);
    let s = agg.stats();
    let cap = AggregatorLimits::DEFAULT_MAX_PARTIAL;
    assert_eq!((s.partial, s.evicted), (cap, 10 * BATCH as u64 - cap as u64), "{s:?}");
    let g = r0.group_stats().unwrap();
    assert_eq!((g.refused_not_member, g.reports), (10, 10), "{g:?}");
}
