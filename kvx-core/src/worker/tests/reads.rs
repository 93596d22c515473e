//! Registration, handshakes and the READs a decode worker posts.

use super::*;

#[test]
fn needs_read_and_notifications() {
    let mut a = MockTransferAgent::new();
    a.expect_capabilities().return_const(Capabilities { read: false, ..caps() });
    let e = ConnectorWorker::new(config(0), Arc::new(a)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
}

#[test]
fn registration_publishes_a_complete_payload_once() {
    let posts = Arc::new(Mutex::new(vec![]));
    let mut w = ConnectorWorker::new(config(1), Arc::new(agent(posts, |_| {}))).unwrap();
    let c = caches(&[None, None]);
    let bytes = w.register_kv_caches(&c).unwrap();
    let p: HandshakePayload = wire::decode(&bytes).unwrap();
    assert_eq!((p.engine_id.as_str(), p.rank, p.world_size), ("decode", 1, 2));
    assert_eq!(p.agent_metadata, b"my-agent-md");
    assert_eq!(p.num_blocks, NB);
    assert_eq!(p.block_len, u64::from(BS) * 2);
    assert_eq!(p.region_bases.len(), 4);
    assert_eq!(p.region_bases[0], c[0].memory.region().addr);
    assert_eq!(w.handshake_payload(), Some(bytes.as_slice()));
    assert_eq!(w.register_kv_caches(&c).unwrap_err().kind(), ErrorKind::State);
}

#[test]
fn requests_wait_for_the_handshake_then_read_the_last_blocks() {
    let posts = Arc::new(Mutex::new(vec![]));
    let mut w = worker_with(agent(posts.clone(), |_| {}), 1, &[None, None]);
    let now = Instant::now();
    // Partial prefix hit: 2 local blocks, 3 remote: read the last 2 remote blocks.
    w.start_load_kv(now, &meta(vec![recv("a", vec![1, 2], vec![9, 10, 11])]));
    assert!(posts.lock().unwrap().is_empty(), "nothing is posted before the handshake");
    // A second request for the same peer waits on the same handshake.
    w.start_load_kv(now, &meta(vec![recv("b", vec![3], vec![12])]));
    assert!(matches!(
        w.poll_command(),
        Some(WorkerCommand::FetchHandshake(PeerLocator { endpoint: Some(Endpoint { port: 5601, .. }), .. }))
    ));
    assert_eq!(w.poll_command(), None, "one handshake per peer");
    w.handle_handshake(now, &"prefill".into(), 1, Ok(peer_payload(1, &[None, None], |_| {})));
    let posts = posts.lock().unwrap();
    assert_eq!(posts.len(), 2);
    // Regions K0 V0 K1 V1; local num_blocks 8, remote 16.
    assert_eq!(posts[0].local, vec![1, 2, 9, 10, 17, 18, 25, 26]);
    assert_eq!(posts[0].remote, vec![10, 11, 26, 27, 42, 43, 58, 59]);
    assert_eq!(posts[0].remote_dlist, DlistId(200));
    assert_read_release(&posts[0].notify, &w, "a");
    assert_eq!(posts[1].local, vec![3, 11, 19, 27]);
    assert_eq!(w.stats().handshakes, 1);
    // Blocks 1, 2 <- 10, 11 are one run per region; block 3 one more.
    assert_eq!((w.stats().descriptors, w.stats().block_descriptors), (4 + 4, 8 + 4));
}

#[test]
fn windowed_layers_read_only_their_last_blocks() {
    let posts = Arc::new(Mutex::new(vec![]));
    let windows = [None, Some(1)];
    let mut w = worker_with(agent(posts.clone(), |_| {}), 0, &windows);
    w.start_load_kv(Instant::now(), &meta(vec![recv("a", vec![1, 2], vec![3, 4])]));
    w.poll_command();
    w.handle_handshake(Instant::now(), &"prefill".into(), 0, Ok(peer_payload(0, &windows, |_| {})));
    let posts = posts.lock().unwrap();
    assert_eq!(posts[0].local, vec![1, 2, 9, 10, 18, 26]);
    assert_eq!(posts[0].remote, vec![3, 4, 19, 20, 36, 52]);
    assert_eq!((w.stats().descriptors, w.stats().block_descriptors), (4, 6));
}

#[test]
fn the_groups_of_a_hybrid_model_read_their_blocks_at_the_same_positions_into_every_region() {
    // vLLM overlays the layers of its KV-cache groups on the same regions: a group's blocks are
    // read, in every region, from the offered blocks of that group at the same positions.
    let posts = Arc::new(Mutex::new(vec![]));
    let mut w = worker_with(agent(posts.clone(), |_| {}), 0, &[None, None]);
    let req = RecvRequest {
        // Sliding group: positions 2 and 3 (its window); full group: positions 1 to 3.
        local_block_ids: vec![GroupBlocks::new(2, vec![5, 6]), GroupBlocks::new(1, vec![1, 2, 3])],
        remote_block_ids: vec![GroupBlocks::new(1, vec![7, 8, 9]), GroupBlocks::whole(vec![10, 11, 12, 13])],
        ..recv("a", vec![], vec![])
    };
    start_and_handshake(&mut w, Instant::now(), vec![req]);
    let posts = posts.lock().unwrap();
    assert_eq!(posts.len(), 1, "one READ for both groups");
    // Pairs 5<-8, 6<-9, 1<-11, 2<-12, 3<-13 in region 0 (K0); region 1 adds 8 locally, 16 remotely.
    assert_eq!(posts[0].local[..5], [5, 6, 1, 2, 3]);
    assert_eq!(posts[0].remote[..5], [8, 9, 11, 12, 13]);
    assert_eq!(posts[0].local[5..10], [13, 14, 9, 10, 11]);
    assert_eq!(posts[0].remote[5..10], [24, 25, 27, 28, 29]);
}

#[test]
fn full_prefix_hit_notifies_without_reading() {
    let posts = Arc::new(Mutex::new(vec![]));
    let a = agent(posts.clone(), |a| {
        a.expect_notify()
            .withf(|to, m| to.as_str() == "peer" && m == release("a"))
            .times(1)
            .returning(|_, _| Ok(()));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    start_and_handshake(&mut w, Instant::now(), vec![recv("a", vec![], vec![3, 4])]);
    assert!(posts.lock().unwrap().is_empty());
    assert!(w.get_finished(Instant::now()).is_empty(), "the request is not waiting");
    assert_eq!(w.stats().notify_only, 1);
}

#[test]
fn the_prefill_engines_request_id_names_every_notification() {
    // vLLM gives the two engines' requests different ids: the READ's notification, a notify-only
    // message and the free-at-once after a failed READ all name the prefill engine's id.
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        for id in ["p-only", "p-bad"] {
            a.expect_notify()
                .withf(move |to, m| to.as_str() == "peer" && m == release(id))
                .times(1)
                .returning(|_, _| Ok(()));
        }
        a.expect_poll().with(eq(XferId(1))).returning(|_| Ok(XferState::Done));
        a.expect_poll().with(eq(XferId(2))).returning(|_| Ok(XferState::Failed(link_down())));
    });
    let with_remote = |id: &str, local: Vec<BlockId>, remote: Vec<BlockId>| RecvRequest {
        remote_request_id: Some(format!("p-{id}").into()),
        nonce: Some(nonce_of(&format!("p-{id}"))),
        ..recv(id, local, remote)
    };
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(
        &mut w,
        now,
        vec![
            with_remote("ok", vec![1], vec![1]),
            with_remote("bad", vec![2], vec![2]),
            with_remote("only", vec![], vec![3]),
        ],
    );
    let notes: Vec<_> = posts.lock().unwrap().iter().map(|p| p.notify.clone()).collect();
    assert_eq!(notes.len(), 2);
    assert_read_release(&notes[0], &w, "p-ok");
    assert_read_release(&notes[1], &w, "p-bad");
    inbox.lock().unwrap().push(answer(&posts, "p-ok", true));
    let mut f = w.get_finished(now);
    assert_eq!(f.recving, vec![RequestId::new("ok")], "reported under the decode engine's id");
    // The failed READ's engine is handshaken again; the same instance: the load fails.
    answer_handshakes(&mut w, now, 1);
    f.extend(w.get_finished(now));
    assert_eq!(f.failed_recving[0].request_id, "bad".into());
}
#[test]
fn a_read_that_fails_because_the_engine_restarted_is_posted_again_to_its_new_instance() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        a.expect_poll().with(eq(XferId(1))).returning(|_| Ok(XferState::Failed(link_down())));
        a.expect_poll().with(eq(XferId(2))).returning(|_| Ok(XferState::Done));
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    assert!(w.get_finished(now).is_empty(), "not failed yet: the engine may have restarted");
    answer_handshakes(&mut w, now, 2);
    assert_eq!(posts.lock().unwrap().len(), 2, "posted again to the new instance");
    inbox.lock().unwrap().push(answer(&posts, "a", true));
    assert_eq!(w.get_finished(now).recving, vec![RequestId::new("a")]);
    let s = w.stats();
    assert_eq!((s.handshakes, s.peer_restarts, s.peers_invalidated), (2, 1, 1));
    assert!(w.is_idle());
}

#[test]
fn completed_and_failed_transfers_are_reported_per_request() {
    let posts = Arc::new(Mutex::new(vec![]));
    let inbox = Inbox::default();
    let a = agent_with_inbox(posts.clone(), inbox.clone(), |a| {
        // The failed load tells the prefill engine to free its blocks at once.
        a.expect_notify()
            .withf(|to, m| to.as_str() == "peer" && m == release("bad"))
            .times(1)
            .returning(|_, _| Ok(()));
        a.expect_poll().with(eq(XferId(1))).returning(|_| Ok(XferState::Done));
        a.expect_poll().with(eq(XferId(2))).returning(|_| Ok(XferState::Failed(link_down())));
        // The third READ never completes: never reported, never polled.
        report_completions(a, posts.clone(), &[3]);
    });
    let mut w = worker_with(a, 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("ok", vec![1], vec![1]), recv("bad", vec![2], vec![2])]);
    w.start_load_kv(now, &meta(vec![recv("slow", vec![3], vec![3])]));
    let mut f = w.get_finished(now + Duration::from_millis(5));
    assert!(f.recving.is_empty(), "a READ done is not a load done: the prefill engine confirms");
    answer_handshakes(&mut w, now, 1);
    inbox.lock().unwrap().push(answer(&posts, "ok", true));
    let f2 = w.get_finished(now + Duration::from_millis(7));
    assert_eq!(f2.recving, vec![RequestId::new("ok")]);
    f.extend(f2);
    assert_eq!(f.failed_recving.len(), 1);
    assert_eq!(f.failed_recving[0].request_id, "bad".into());
    assert_eq!(f.failed_recving[0].error, link_down(), "the transfer's own error, kind and backend kept");
    assert_eq!(w.num_in_flight(), 1, "the worker goes on with the others");
    assert_eq!(
        w.stats().read_latencies.kept(),
        [Duration::from_millis(5)],
        "READ seen done at the 5 ms step"
    );
    assert_eq!(w.stats().transfer_latencies.kept(), [Duration::from_millis(7)], "confirmed at the 7 ms step");
    assert_eq!(w.stats().post_waits.kept(), [Duration::ZERO], "posted in the step that admitted it");
    assert_eq!(w.stats().confirm_waits.kept(), [Duration::from_millis(2)]);
    assert_eq!(w.stats().bytes_read, 4 * u64::from(BS) * 2);
    // The stages of the completed load, once.
    let ms = |n| now + Duration::from_millis(n);
    let ok =
        LoadTimes { request_id: "ok".into(), admitted: now, posted: now, read_done: ms(5), confirmed: ms(7) };
    assert_eq!(w.take_load_times(), vec![ok]);
    assert!(w.take_load_times().is_empty());
    // The confirmed READ, once, as NixlConnector records a transfer; the failed one is not.
    let read =
        TransferRecord { duration: Duration::from_millis(5), bytes: 4 * u64::from(BS) * 2, descriptors: 4 };
    assert_eq!(w.take_transfers(), vec![read]);
    assert!(w.take_transfers().is_empty());
}

#[test]
fn a_failed_handshake_fails_exactly_the_waiting_requests_and_is_retried() {
    let posts = Arc::new(Mutex::new(vec![]));
    let mut w = worker_with(agent(posts.clone(), |_| {}), 0, &[None, None]);
    let now = Instant::now();
    w.start_load_kv(now, &meta(vec![recv("a", vec![1], vec![1]), recv("b", vec![2], vec![2])]));
    w.poll_command();
    w.handle_handshake(now, &"prefill".into(), 0, Err(Error::new(ErrorKind::Io, "connection refused")));
    let f = w.get_finished(now);
    let failed: Vec<_> = f.failed_recving.iter().map(|f| f.request_id.as_str()).collect();
    assert_eq!(failed, ["a", "b"]);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Io);
    assert!(f.failed_recving[0].error.message().ends_with("connection refused"), "{:?}", f.failed_recving[0]);
    // The next request handshakes again and succeeds.
    start_and_handshake(&mut w, now, vec![recv("c", vec![3], vec![3])]);
    assert_eq!(posts.lock().unwrap().len(), 1);
    assert_eq!(w.stats().handshake_failures, 1);
}

#[test]
fn a_failed_handshake_says_so_once() {
    let mut w = worker_with(agent(Arc::default(), |_| {}), 0, &[None, None]);
    let now = Instant::now();
    for (n, cause) in [
        Error::new(ErrorKind::Handshake, "connecting to h:5600: refused"),
        Error::new(ErrorKind::Wire, "decode envelope: bad"),
    ]
    .into_iter()
    .enumerate()
    {
        w.start_load_kv(now, &meta(vec![recv(&format!("r{n}"), vec![1], vec![1])]));
        w.poll_command();
        w.handle_handshake(now, &"prefill".into(), 0, Err(cause));
        let error = w.get_finished(now).failed_recving.remove(0).error;
        assert_eq!(error.kind(), ErrorKind::Handshake, "{error}");
        let reason = error.to_string();
        assert!(reason.starts_with("handshake failed: with engine prefill rank 0: "), "{reason}");
        assert_eq!(reason.matches("handshake failed").count(), 1, "{reason}");
    }
}

#[test]
fn a_handshake_that_never_answers_times_out() {
    let mut w = worker_with(agent(Arc::default(), |_| {}), 0, &[None, None]);
    let now = Instant::now();
    w.start_load_kv(now, &meta(vec![recv("a", vec![1], vec![1])]));
    assert!(w.get_finished(now + Duration::from_secs(4)).is_empty());
    assert_eq!(w.next_deadline(), Some(now + Duration::from_secs(5)));
    let f = w.get_finished(now + Duration::from_secs(5));
    assert_eq!(f.failed_recving.len(), 1);
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::Timeout, "{:?}", f.failed_recving[0]);
    // A result arriving after the timeout is ignored.
    w.handle_handshake(now, &"prefill".into(), 0, Ok(peer_payload(0, &[None, None], |_| {})));
    assert!(w.is_idle());
}

#[test]
fn bad_peer_inputs_fail_the_request_and_transfer_nothing() {
    let cases: Vec<(&str, RecvRequest)> = vec![
        ("remote id past the remote pool", recv("r", vec![1], vec![16])),
        ("local id past the local pool", recv("r", vec![8], vec![1])),
        ("more local than remote blocks", recv("r", vec![1, 2], vec![1])),
        (
            "read window past the offer",
            RecvRequest { local_block_ids: at(1, vec![1]), ..recv("r", vec![1], vec![1]) },
        ),
        (
            "read window overflows",
            RecvRequest { local_block_ids: at(u32::MAX, vec![1]), ..recv("r", vec![1], vec![1]) },
        ),
        (
            "read before the offer",
            RecvRequest { remote_block_ids: at(1, vec![1]), ..recv("r", vec![1], vec![1]) },
        ),
        (
            "more groups to load than offered",
            RecvRequest {
                local_block_ids: vec![GroupBlocks::whole(vec![1]), GroupBlocks::whole(vec![2])],
                ..recv("r", vec![1], vec![1])
            },
        ),
        (
            "a block loaded twice across groups",
            RecvRequest {
                local_block_ids: vec![GroupBlocks::whole(vec![1]), GroupBlocks::whole(vec![1])],
                remote_block_ids: vec![GroupBlocks::whole(vec![1]), GroupBlocks::whole(vec![2])],
                ..recv("r", vec![1], vec![1])
            },
        ),
        ("no nonce: not a kvx offer", RecvRequest { nonce: None, ..recv("r", vec![1], vec![1]) }),
        ("notify-only without a nonce", RecvRequest { nonce: None, ..recv("r", vec![], vec![1]) }),
        (
            "a 10 MB request id",
            RecvRequest {
                remote_request_id: Some("x".repeat(10 << 20).into()),
                ..recv("r", vec![1], vec![1])
            },
        ),
        (
            "a 10 MB engine id",
            RecvRequest {
                remote: RemoteCoordinates::at("e".repeat(10 << 20), "h", 1),
                ..recv("r", vec![1], vec![1])
            },
        ),
        (
            "a 10 MB host",
            RecvRequest {
                remote: RemoteCoordinates::at("prefill", "h".repeat(10 << 20), 1),
                ..recv("r", vec![1], vec![1])
            },
        ),
        ("duplicate local block", recv("r", vec![1, 1], vec![1, 2])),
        (
            "our own engine id",
            RecvRequest { remote: RemoteCoordinates::at("decode", "h", 1), ..recv("r", vec![1], vec![1]) },
        ),
        (
            "port overflow",
            RecvRequest {
                remote: RemoteCoordinates::at("prefill", "h", u16::MAX),
                ..recv("r", vec![1], vec![1])
            },
        ),
    ];
    for (what, req) in cases {
        let posts = Arc::new(Mutex::new(vec![]));
        let mut w = worker_with(agent(posts.clone(), |_| {}), 1, &[None, None]);
        w.start_load_kv(Instant::now(), &meta(vec![req]));
        if w.poll_command().is_some() {
            w.handle_handshake(
                Instant::now(),
                &"prefill".into(),
                1,
                Ok(peer_payload(1, &[None, None], |_| {})),
            );
        }
        let f = w.get_finished(Instant::now());
        assert_eq!(f.failed_recving.len(), 1, "{what}");
        assert!(f.failed_recving[0].error.message().len() < 2048, "{what}: a short reason");
        assert!(posts.lock().unwrap().is_empty(), "{what}: nothing may be posted");
    }
}

#[test]
fn bad_handshake_payloads_are_refused() {
    let (layout, _) = KvCacheLayout::detect(&caches(&[None, None]), BS).unwrap();
    let cases: Vec<(&str, Vec<u8>, ErrorKind)> = vec![
        ("garbage", b"not a payload".to_vec(), ErrorKind::Handshake),
        ("other engine", peer_payload(0, &[None, None], |p| p.engine_id = "x".into()), ErrorKind::Handshake),
        ("other rank", peer_payload(1, &[None, None], |_| {}), ErrorKind::Handshake),
        (
            "a TP size the heads do not split over",
            peer_payload(0, &[None, None], |p| p.world_size = 3),
            ErrorKind::Incompatible,
        ),
        ("other model heads", peer_payload(0, &[None, None], |p| p.kv_heads = 4), ErrorKind::Incompatible),
        ("other layout", peer_payload(0, &[None, None], |p| p.compat_hash ^= 1), ErrorKind::Incompatible),
        (
            "other block length",
            peer_payload(0, &[None, None], |p| p.block_len = layout.block_len * 2),
            ErrorKind::Incompatible,
        ),
        (
            "missing regions",
            peer_payload(0, &[None, None], |p| p.region_bases.pop().map(drop).unwrap_or(())),
            ErrorKind::Handshake,
        ),
        ("empty pool", peer_payload(0, &[None, None], |p| p.num_blocks = 0), ErrorKind::Handshake),
        (
            "a pool past u32 descriptor ids",
            peer_payload(0, &[None, None], |p| p.num_blocks = u32::MAX / 2),
            ErrorKind::Handshake,
        ),
    ];
    for (what, payload, kind) in cases {
        let posts = Arc::new(Mutex::new(vec![]));
        let mut w = worker_with(agent(posts.clone(), |_| {}), 0, &[None, None]);
        w.start_load_kv(Instant::now(), &meta(vec![recv("r", vec![1], vec![1])]));
        w.poll_command();
        w.handle_handshake(Instant::now(), &"prefill".into(), 0, Ok(payload));
        let f = w.get_finished(Instant::now());
        assert_eq!(f.failed_recving.len(), 1, "{what}");
        assert_eq!(f.failed_recving[0].error.kind(), kind, "{what}: {}", f.failed_recving[0].error);
        assert!(posts.lock().unwrap().is_empty(), "{what}");
        assert_eq!(w.stats().handshake_failures, 1, "{what}");
    }
}

#[test]
fn a_restarted_peer_with_the_same_agent_name_is_reloaded() {
    let loads = Arc::new(Mutex::new(0));
    let l = loads.clone();
    let a = {
        let mut a = MockTransferAgent::new();
        a.expect_load_remote().returning(move |_| {
            let mut n = l.lock().unwrap();
            *n += 1;
            if *n == 1 {
                Err(Error::new(ErrorKind::State, "already loaded"))
            } else {
                Ok(AgentName::new("peer"))
            }
        });
        a.expect_forget_remote().with(eq(AgentName::new("peer"))).times(1).returning(|_| Ok(()));
        agent(Arc::default(), |m| *m = std::mem::replace(&mut a, MockTransferAgent::new()))
    };
    let mut w = worker_with(a, 0, &[None, None]);
    start_and_handshake(&mut w, Instant::now(), vec![recv("a", vec![1], vec![1])]);
    assert_eq!(*loads.lock().unwrap(), 2);
    assert_eq!(w.stats().handshakes, 1);
}
