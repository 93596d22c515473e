//! Closing a worker: what it gives back to its agent, and what it refuses afterwards.

use super::*;

/// What a closing worker gave back to its agent, in the order it did.
type Calls = Arc<Mutex<Vec<String>>>;

fn record(calls: &Calls, what: String) -> Result<()> {
    calls.lock().unwrap().push(what);
    Ok(())
}

/// A mock agent whose registrations get ids 1, 2, ...; records every call that gives something
/// back (and every drain), and refuses to deregister registration `refuse` while `refusing`.
fn closing_agent(
    posts: Arc<Mutex<Vec<Posted>>>,
    calls: Calls,
    refusing: Arc<Mutex<Option<u64>>>,
) -> MockTransferAgent {
    agent(posts, move |a| {
        let next = Arc::new(Mutex::new(0u64));
        a.expect_register().returning(move |_| {
            let mut n = next.lock().unwrap();
            *n += 1;
            Ok(RegistrationId(*n))
        });
        // No transfer completes.
        a.expect_drain_completions().returning(|_| Ok(()));
        let c = calls.clone();
        let refused = refusing.clone();
        a.expect_deregister().returning(move |r| {
            if *refused.lock().unwrap() == Some(r.0) {
                return Err(Error::new(ErrorKind::State, "a transfer still uses it"));
            }
            record(&c, format!("deregister {}", r.0))
        });
        let c = calls.clone();
        a.expect_release_dlist().returning(move |d| record(&c, format!("release_dlist {}", d.0)));
        let c = calls.clone();
        a.expect_forget_remote().returning(move |p| record(&c, format!("forget_remote {p}")));
        let c = calls.clone();
        a.expect_release().returning(move |x| record(&c, format!("release {}", x.0)));
        let c = calls.clone();
        a.expect_notify().returning(move |p, m| {
            let r: HoldRelease = wire::decode(m).unwrap();
            record(&c, format!("notify {p} {} {}", r.request_id, r.reply_to.is_some()))
        });
        let c = calls.clone();
        a.expect_drain_notifications().returning(move |_| record(&c, "drain".into()));
    })
}

#[test]
fn close_gives_back_every_registration_list_and_peer_and_refuses_work() {
    let posts = Arc::new(Mutex::new(vec![]));
    let calls = Calls::default();
    let mut w = worker_with(closing_agent(posts.clone(), calls.clone(), Arc::default()), 0, &[None, None]);
    let now = Instant::now();
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    w.start_load_kv(now, &ConnectorMetadata { reqs_to_send: held(&["h"]), ..Default::default() });
    assert!(w.get_finished(now).is_empty(), "the READ runs and the hold lives");
    assert_eq!(posts.lock().unwrap().len(), 1);
    calls.lock().unwrap().clear();

    w.close().unwrap();
    assert!(w.is_closed());
    // The READ is cancelled and the prefill engine told to free at once (no answer wanted); the
    // peer's list before the peer, the local list before the memory under it.
    assert_eq!(
        *calls.lock().unwrap(),
        [
            "notify peer a false",
            "release 1",
            "release_dlist 200",
            "release_dlist 100",
            "forget_remote peer",
            "deregister 1",
            "deregister 2",
        ]
    );
    let f = w.get_finished(now);
    assert_eq!(f.sending, vec![RequestId::new("h")], "the hold ended");
    assert_eq!(f.failed_recving.len(), 1);
    assert_eq!(f.failed_recving[0].request_id, "a".into());
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::State, "{}", f.failed_recving[0].error);
    assert_eq!((w.num_in_flight(), w.handshake_payload(), w.layout()), (0, None, None));
    assert!(w.is_idle() && w.next_deadline().is_none());

    // Closed: nothing more reaches the agent, and work is refused with `State`.
    calls.lock().unwrap().clear();
    assert_eq!(w.register_kv_caches(&caches(&[None, None])).unwrap_err().kind(), ErrorKind::State);
    w.start_load_kv(
        now,
        &ConnectorMetadata {
            reqs_to_recv: vec![recv("b", vec![2], vec![2])],
            reqs_to_send: held(&["h2"]),
            ..Default::default()
        },
    );
    assert_eq!(w.poll_command(), None, "no handshake for a closed worker");
    let f = w.get_finished(now + Duration::from_secs(3600));
    assert_eq!(f.sending, vec![RequestId::new("h2")]);
    assert_eq!(f.failed_recving[0].request_id, "b".into());
    assert_eq!(f.failed_recving[0].error.kind(), ErrorKind::State, "{}", f.failed_recving[0].error);
    w.handle_handshake(now, &"prefill".into(), 0, Ok(peer_payload(0, &[None, None], |_| {})));
    w.close().unwrap();
    assert!(calls.lock().unwrap().is_empty(), "closed: the agent was called: {:?}", calls.lock().unwrap());
}

#[test]
fn close_again_gives_back_what_the_agent_refused() {
    let calls = Calls::default();
    let refusing = Arc::new(Mutex::new(Some(2)));
    let mut w = worker_with(closing_agent(Arc::default(), calls.clone(), refusing.clone()), 0, &[None, None]);
    let now = Instant::now();
    // A connection dropped while its READ runs is kept (retired) until the READ ends: closing
    // forgets it too.
    start_and_handshake(&mut w, now, vec![recv("a", vec![1], vec![1])]);
    w.invalidate(&("prefill".into(), 0));
    calls.lock().unwrap().clear();

    let e = w.close().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::State, "{e}");
    assert!(e.to_string().contains("1 registrations"), "{e}");
    assert_eq!(
        *calls.lock().unwrap(),
        ["release 1", "release_dlist 200", "release_dlist 100", "forget_remote peer", "deregister 1"]
    );
    calls.lock().unwrap().clear();

    // Once the agent lets it go, closing again gives back only what it refused.
    *refusing.lock().unwrap() = None;
    w.close().unwrap();
    assert_eq!(*calls.lock().unwrap(), ["deregister 2"]);
}
