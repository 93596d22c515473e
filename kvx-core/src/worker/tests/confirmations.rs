//! Offers, instances, the prefill engine's confirmations, and heartbeats.

use super::*;

#[test]
fn with_a_key_only_signed_offers_are_read_and_nothing_else_touches_the_network() {
    let key = AuthKey::new("the deployment's secret").unwrap();
    let signed = |mut r: RecvRequest| {
        r.mac = Some(r.offer().unwrap().tag(&key));
        r
    };
    // An offer that names every field the MAC covers: what a prefill engine of 2 ranks, at its
    // instance 1, hands out.
    let offer = || {
        signed(RecvRequest {
            remote_instance: Some(crate::auth::HexBytes(1u64.to_le_bytes())),
            remote_tp_size: Some(2),
            ..recv("a", vec![1], vec![2, 3])
        })
    };
    // Every field of the offer that steers the connection or what is read, edited after signing.
    let edited = |edit: &dyn Fn(&mut RecvRequest)| {
        let mut r = offer();
        edit(&mut r);
        r
    };
    let cases = [
        ("unsigned", RecvRequest { mac: None, ..offer() }),
        ("signed by another key", {
            let mut r = offer();
            r.mac = Some(r.offer().unwrap().tag(&AuthKey::new("some other deployment").unwrap()));
            r
        }),
        ("another engine", edited(&|r| r.remote.engine_id = "prefill-2".into())),
        ("another host", edited(&|r| r.remote.endpoint = Some(Endpoint::new("evil", 5600)))),
        ("another port", edited(&|r| r.remote.endpoint = Some(Endpoint::new("h", 5601)))),
        ("found by id instead", edited(&|r| r.remote.endpoint = None)),
        ("another TP size", edited(&|r| r.remote_tp_size = Some(4))),
        ("no TP size", edited(&|r| r.remote_tp_size = None)),
        ("another request's id", edited(&|r| r.remote_request_id = Some("b".into()))),
        ("another request's blocks", edited(&|r| r.remote_block_ids = at(0, vec![5, 3]))),
        ("the blocks at other positions", edited(&|r| r.remote_block_ids = at(1, vec![2, 3]))),
        ("the blocks split into two groups", {
            edited(&|r| r.remote_block_ids = vec![GroupBlocks::whole(vec![2]), GroupBlocks::whole(vec![3])])
        }),
        ("another nonce", edited(&|r| r.nonce = Some(nonce_of("b")))),
        ("another instance", edited(&|r| r.remote_instance = Some(crate::auth::HexBytes([2; 8])))),
        ("no instance", edited(&|r| r.remote_instance = None)),
        ("notify-only, unsigned", recv("n", vec![], vec![1])),
    ];
    for (what, req) in cases {
        let posts = Arc::new(Mutex::new(vec![]));
        let config = WorkerConfig { auth_key: Some(key.clone()), ..config(0) };
        let mut w = ConnectorWorker::new(config, Arc::new(agent(posts.clone(), |_| {}))).unwrap();
        w.register_kv_caches(&caches(&[None, None])).unwrap();
        w.start_load_kv(Instant::now(), &meta(vec![req]));
        assert_eq!(w.poll_command(), None, "{what}: no handshake with the named host");
        let f = w.get_finished(Instant::now());
        assert_eq!(f.failed_recving.len(), 1, "{what}");
        assert_eq!(
            f.failed_recving[0].error.kind(),
            ErrorKind::Unauthenticated,
            "{what}: {}",
            f.failed_recving[0].error
        );
        assert_eq!((w.poll_command(), posts.lock().unwrap().len()), (None, 0), "{what}: nothing sent");
    }
    let posts = Arc::new(Mutex::new(vec![]));
    let config = WorkerConfig { auth_key: Some(key.clone()), ..config(0) };
    let mut w = ConnectorWorker::new(config, Arc::new(agent(posts.clone(), |_| {}))).unwrap();
    w.register_kv_caches(&caches(&[None, None])).unwrap();
    start_and_handshake(&mut w, Instant::now(), vec![offer()]);
    assert_eq!(posts.lock().unwrap().len(), 1, "a signed offer is read");
}

#[test]
fn loads_before_registration_fail() {
    let mut w = ConnectorWorker::new(config(0), Arc::new(agent(Arc::default(), |_| {}))).unwrap();
    w.start_load_kv(Instant::now(), &meta(vec![recv("a", vec![1], vec![1])]));
    assert_eq!(w.get_finished(Instant::now()).failed_recving.len(), 1);
}

#[test]
fn rank0_reports_an_id_once_every_rank_has_it() {
    let mut agg = FinishedAggregator::new(2);
    let r = |recving: &[&str], sending: &[&str], failed: &[&str]| Finished {
        recving: recving.iter().map(|s| RequestId::new(*s)).collect(),
        sending: sending.iter().map(|s| RequestId::new(*s)).collect(),
        failed_recving: failed
            .iter()
            .map(|s| FailedRecv { request_id: RequestId::new(*s), error: link_down() })
            .collect(),
    };
    let now = Instant::now();
    let ranked =
        |reports: [Finished; 2]| (0..).zip(reports).map(|(rank, finished)| RankReport { rank, finished });
    let out = agg.aggregate(now, ranked([r(&["a", "b"], &["s"], &[]), r(&["a"], &[], &["b"])]));
    assert_eq!(out.recving, vec![RequestId::new("a")]);
    assert_eq!(out.failed_recving, vec![FailedRecv { request_id: "b".into(), error: link_down() }]);
    assert!(out.sending.is_empty());
    assert_eq!(agg.num_partial(), 1);
    let out = agg.aggregate(now, ranked([r(&[], &[], &[]), r(&[], &["s"], &[])]));
    assert_eq!(out.sending, vec![RequestId::new("s")]);
    assert_eq!(agg.num_partial(), 0);
}

#[test]
fn the_same_request_twice_while_its_handshake_runs_loads_once() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().returning(|_| Ok(XferState::Done));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    w.start_load_kv(now, &meta(vec![recv("a", vec![1], vec![1])]));
    w.start_load_kv(now, &meta(vec![recv("a", vec![2], vec![2])]));
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving.len(), 1, "the second is refused");
    while let Some(WorkerCommand::FetchHandshake(PeerLocator { engine_id, .. })) = w.poll_command() {
        w.handle_handshake(now, &engine_id, 0, Ok(peer_payload(0, &[None, None], |_| {})));
    }
    assert_eq!(posts.lock().unwrap().len(), 1, "one READ");
    inbox.lock().unwrap().push(answer(&posts, "a", true));
    assert_eq!(w.get_finished(now).recving, vec![RequestId::new("a")]);
    assert!(w.is_idle(), "nothing left in flight unpolled");
}

#[test]
fn an_id_a_report_names_twice_counts_once_for_its_rank() {
    let mut agg = FinishedAggregator::new(2);
    let twice = |id: &str| Finished {
        sending: vec![RequestId::new(id), RequestId::new(id)],
        recving: vec![RequestId::new("r"), RequestId::new("r")],
        ..Default::default()
    };
    let now = Instant::now();
    let rank = |rank| RankReport { rank, finished: twice("s") };
    assert!(agg.aggregate(now, [rank(0)]).is_empty(), "one rank of two has reported");
    assert!(agg.aggregate(now, [rank(0)]).is_empty(), "the same rank again");
    let out = agg.aggregate(now, [rank(1)]);
    assert_eq!((out.sending, out.recving), (vec![RequestId::new("s")], vec![RequestId::new("r")]));
}

#[test]
fn a_load_without_an_answer_fails_and_its_engine_is_handshaken_again() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().returning(|_| Ok(XferState::Done));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    assert!(w.get_finished(now).is_empty());
    let timeout = w.config().confirm_timeout;
    assert_eq!(w.next_deadline(), Some(now + timeout));
    // An answer for another nonce, or "not held", never completes it.
    inbox.lock().unwrap().push(answer(&posts, "other", true));
    assert!(w.get_finished(now).is_empty());
    let f = w.get_finished(now + timeout);
    assert_eq!(f.failed_recving.len(), 1);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Timeout, "{:?}", f.failed_recving[0]);
    assert_eq!(w.stats().lease_failures, 1);
    // A "not held" answer fails a load with the lease's error.
    start_and_handshake(&mut w, now, vec![recv("b", vec![2], vec![2])]);
    inbox.lock().unwrap().push(answer(&posts, "b", false));
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Expired, "{:?}", f.failed_recving[0]);
    assert_eq!((w.stats().lease_failures, w.stats().bytes_read), (2, 0));
}

#[test]
fn heartbeats_go_to_the_matching_rank_in_small_messages() {
    let posts = Arc::new(Mutex::new(vec![]));
    let sent: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let s = sent.clone();
    let a = agent(posts, move |a| {
        let s = s.clone();
        a.expect_notify().returning(move |_, m| {
            s.lock().unwrap().push(m.to_vec());
            Ok(())
        });
    });
    let mut w = worker_with(a, 1, &[None, None]);
    let now = Instant::now();
    let ids: Vec<String> = (0..300).map(|i| format!("r{i}")).collect();
    let holds = held(&ids.iter().map(String::as_str).collect::<Vec<_>>());
    let beat = Heartbeat {
        remote: recv("x", vec![], vec![]).remote,
        remote_tp_size: None,
        holds,
        pushes: Vec::new(),
    };
    w.start_load_kv(now, &ConnectorMetadata { heartbeats: vec![beat], ..Default::default() });
    assert!(matches!(
        w.poll_command(),
        Some(WorkerCommand::FetchHandshake(PeerLocator { endpoint: Some(Endpoint { port: 5601, .. }), .. }))
    ));
    w.handle_handshake(now, &"prefill".into(), 1, Ok(peer_payload(1, &[None, None], |_| {})));
    let renewed: Vec<usize> =
        sent.lock().unwrap().iter().map(|m| wire::decode::<RenewLeases>(m).unwrap().holds.len()).collect();
    assert_eq!(renewed, [128, 128, 44]);
    assert_eq!(w.stats().renewals_sent, 300);
}

#[test]
fn an_offer_of_another_instance_is_never_read_through_the_old_connection() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().returning(|_| Ok(XferState::Done));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    // Connected to instance 1; a load of instance 1's offer is waiting for its answer.
    start_and_handshake(&mut w, now, vec![recv_from("old", vec![1], vec![1], 1)]);
    assert!(w.get_finished(now).is_empty());
    // An offer of instance 2 (the engine restarted): handshake again before reading.
    w.start_load_kv(now, &meta(vec![recv_from("new", vec![2], vec![2], 2)]));
    assert_eq!(posts.lock().unwrap().len(), 1, "not read through the connection to instance 1");
    answer_handshakes(&mut w, now, 2);
    assert_eq!(posts.lock().unwrap().len(), 2, "read from instance 2");
    // Instance 1 will never answer: its load fails at once, not at its confirmation timeout.
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving.len(), 1);
    assert_eq!(f.failed_recving[0].request_id, "old".into());
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Expired, "{:?}", f.failed_recving[0]);
    // An offer of an instance that is gone: one more handshake, then it fails unread.
    w.start_load_kv(now, &meta(vec![recv_from("gone", vec![3], vec![3], 1)]));
    answer_handshakes(&mut w, now, 2);
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving[0].request_id, "gone".into());
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Expired, "{:?}", f.failed_recving[0]);
    assert_eq!(posts.lock().unwrap().len(), 2);
    inbox.lock().unwrap().push(answer(&posts, "new", true));
    assert_eq!(w.get_finished(now).recving, vec![RequestId::new("new")]);
    assert_eq!(w.stats().peer_restarts, 1);
}

/// Loads waiting on one handshake are issued one by one; when one of them drops the peer again
/// (its offer names a newer instance), the others wait for the next handshake instead of failing.
#[test]
fn a_load_that_drops_its_peer_does_not_fail_the_others_waiting_on_the_handshake() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().returning(|_| Ok(XferState::Pending));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    let loads = vec![recv_from("newer", vec![1], vec![1], 2), recv("any", vec![2], vec![2])];
    w.start_load_kv(now, &meta(loads));
    // The first handshake finds instance 1 (the engine restarted since it made the offer).
    assert!(matches!(w.poll_command(), Some(WorkerCommand::FetchHandshake(_))));
    w.handle_handshake(now, &"prefill".into(), 0, Ok(peer_payload(0, &[None, None], |p| p.instance = 1)));
    let f = w.get_finished(now);
    assert!(
        f.failed_recving.is_empty(),
        "nothing fails while a handshake is pending: {:?}",
        f.failed_recving
    );
    assert!(posts.lock().unwrap().is_empty(), "nothing read through instance 1");
    answer_handshakes(&mut w, now, 2);
    assert!(w.get_finished(now).is_empty());
    assert_eq!(posts.lock().unwrap().len(), 2, "both read from instance 2");
    assert_eq!(w.num_in_flight(), 2);
}

#[test]
fn a_post_the_transport_refuses_is_retried_on_a_new_connection() {
    let mut a = MockTransferAgent::new();
    let mut refused = true;
    a.expect_post_blocks().times(1).returning(move |_, _, _, _, _| {
        assert!(std::mem::take(&mut refused));
        Err(Error::new(ErrorKind::Backend, "remote agent was disconnected"))
    });
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), move |m| {
        *m = std::mem::replace(&mut a, MockTransferAgent::new())
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    assert!(w.get_finished(now).is_empty(), "not failed: handshaking again");
    answer_handshakes(&mut w, now, 2);
    assert_eq!(posts.lock().unwrap().len(), 1, "posted to the new instance");
}

#[test]
fn only_the_answer_to_the_reads_own_release_confirms_it() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().returning(|_| Ok(XferState::Done));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    // Someone who knows the offer sent their own release (with a reply_to naming this engine)
    // while the READ ran: the prefill engine freed the hold and answered "held" to it. That answer
    // carries another token: it confirms nothing.
    let forged = HoldStatus {
        request_id: "a".into(),
        nonce: nonce_of("a"),
        held: true,
        token: crate::auth::HexBytes([7; 16]),
    };
    inbox.lock().unwrap().push(notif(&wire::encode(&forged).unwrap()));
    assert!(w.get_finished(now).is_empty());
    assert_eq!(w.stats().stray_notifications, 1);
    // The READ's own release finds the hold gone: "not held", and the load fails.
    inbox.lock().unwrap().push(answer(&posts, "a", false));
    let f = w.get_finished(now);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Expired, "{:?}", f);
}
