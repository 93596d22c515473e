//! The prefill side through the agent: releases received, answers sent.

use super::*;

#[test]
fn a_flooding_sender_pushes_out_only_its_own_early_releases() {
    let (mut w, inbox, sent) = answering_prefill(config(0));
    let now = Instant::now();
    let cap = w.config().early_releases_per_sender as u64;
    // The decode worker's READ finished before the prefill worker saw the hold: its release,
    // asking for an answer, comes early; then another sender floods releases for holds that
    // never come.
    let from = |agent: &str, n: Notification| Notification { from: agent.into(), ..n };
    inbox.lock().unwrap().push(from("decode-agent", release_asking("real", 7)));
    for chunk in 0..100 {
        let flood = (0..1000).map(|i| from("mallory", notif(&release(&format!("ghost-{chunk}-{i}")))));
        inbox.lock().unwrap().extend(flood);
        assert!(w.get_finished(now).is_empty());
        assert!(w.holds.early_len().0 <= cap + 1, "{:?}", w.holds.early_len());
    }
    assert_eq!(w.holds.early_len(), (cap + 1, 2), "the flood at its cap, the real release kept");
    assert_eq!(w.stats().early_notifications_dropped, 100_000 - cap);
    // The hold comes: the real release frees it and is answered "held", so its load completes.
    w.start_load_kv(now, &ConnectorMetadata { reqs_to_send: held(&["real"]), ..Default::default() });
    assert_eq!(w.get_finished(now).sending, vec![RequestId::new("real")]);
    assert!(
        matches!(w.poll_command(), Some(WorkerCommand::FetchHandshake(l)) if l.engine_id.as_str() == "decode")
    );
    w.handle_handshake(now, &"decode".into(), 0, Ok(decode_payload(7)));
    assert_eq!(answers(&sent), [("real".to_owned(), true)]);
    assert_eq!(w.holds.early_len(), (cap, 1));
}

#[test]
fn holds_end_on_notification_or_expiry() {
    let (mut w, queue) = prefill_worker(config(0));
    queue.lock().unwrap().extend([
        notif(&release("early")),
        notif(&release("held")),
        notif(b"\xff\xfe"),
        notif(&release("held")),
    ]);
    let now = Instant::now();
    let send = |ids: &[&str]| ConnectorMetadata { reqs_to_send: held(ids), ..Default::default() };
    w.start_load_kv(now, &send(&["held", "forgotten"]));
    let f = w.get_finished(now);
    assert_eq!(f.sending, vec![RequestId::new("held")]);
    // The early notification completes its hold as soon as the hold arrives.
    w.start_load_kv(now, &send(&["early"]));
    assert_eq!(w.get_finished(now).sending, vec![RequestId::new("early")]);
    // A hold no reader claims is released when its lease runs out.
    assert!(w.get_finished(now + Duration::from_secs(29)).is_empty());
    assert_eq!(w.get_finished(now + Duration::from_secs(30)).sending, vec![RequestId::new("forgotten")]);
    let s = w.stats();
    assert_eq!((s.notifications, s.stray_notifications, s.expired_holds), (2, 2, 1));
    assert!(w.is_idle());
}

#[test]
fn a_release_is_answered_held_only_while_the_lease_lives() {
    let (mut w, inbox, sent) = answering_prefill(config(0));
    let now = Instant::now();
    w.start_load_kv(now, &ConnectorMetadata { reqs_to_send: held(&["live", "late"]), ..Default::default() });
    inbox.lock().unwrap().push(release_asking("live", 7));
    assert_eq!(w.get_finished(now).sending, vec![RequestId::new("live")]);
    // The answer goes to the decode engine's side channel: handshake first, then notify.
    assert_eq!(
        w.poll_command(),
        Some(WorkerCommand::FetchHandshake(PeerLocator {
            engine_id: "decode".into(),
            rank: 0,
            endpoint: Some(Endpoint::new("d", 5700)),
        }))
    );
    w.handle_handshake(now, &"decode".into(), 0, Ok(decode_payload(7)));
    assert_eq!(answers(&sent), [("live".to_owned(), true)]);
    // "late"'s lease runs out; its READ's release comes after: answered "not held" at once.
    let lease = w.config().lease_duration;
    assert_eq!(w.get_finished(now + lease).sending, vec![RequestId::new("late")]);
    // Replays of that release (anyone who saw the params can send them) are answered once.
    inbox.lock().unwrap().extend([
        release_asking("late", 7),
        release_asking("late", 7),
        release_asking("late", 9),
    ]);
    assert!(w.get_finished(now + lease).is_empty());
    assert_eq!(answers(&sent), [("live".to_owned(), true), ("late".to_owned(), false)]);
    // A release from a restarted decode engine (a new instance): handshaken again first.
    w.start_load_kv(now + lease, &ConnectorMetadata { reqs_to_send: held(&["next"]), ..Default::default() });
    inbox.lock().unwrap().push(release_asking("next", 8));
    w.get_finished(now + lease);
    assert!(matches!(w.poll_command(), Some(WorkerCommand::FetchHandshake(_))));
    w.handle_handshake(now + lease, &"decode".into(), 0, Ok(decode_payload(8)));
    assert_eq!(answers(&sent).last(), Some(&("next".to_owned(), true)));
    let s = w.stats();
    assert_eq!((s.hold_answers, s.expired_holds, s.peer_restarts), (3, 1, 1));
}

#[test]
fn a_release_that_comes_before_its_hold_is_answered_without_waiting_for_the_engine() {
    // vLLM hands a finished request's hold to the workers in a later step's metadata; a READ can
    // end before it. The answer must not wait for that step (it can last seconds).
    let (mut w, inbox, sent) = answering_prefill(config(0));
    let now = Instant::now();
    let mut nonces = crate::auth::NonceSource::from_seed([3; 32]);
    let hold = |id: &str, nonce| ConnectorMetadata {
        reqs_to_send: vec![HeldRequest { request_id: id.into(), nonce }],
        ..Default::default()
    };
    let (first, second, third) = (nonces.next_nonce(), nonces.next_nonce(), nonces.next_nonce());
    let me = Some(w.instance());
    // The decode worker's first release comes after its hold: answered once handshaken.
    w.start_load_kv(now, &hold("first", first));
    inbox.lock().unwrap().push(release_naming("first", first, 7, me));
    assert_eq!(w.get_finished(now).sending, vec![RequestId::new("first")]);
    assert!(matches!(w.poll_command(), Some(WorkerCommand::FetchHandshake(_))));
    w.handle_handshake(now, &"decode".into(), 0, Ok(decode_payload(7)));
    // The second READ's release comes before its hold: "held" at once, and the hold, when it
    // comes, is freed at once and answered no more.
    inbox.lock().unwrap().push(release_naming("second", second, 7, me));
    assert!(w.get_finished(now).is_empty());
    assert_eq!(answers(&sent), [("first".to_owned(), true), ("second".to_owned(), true)]);
    assert_eq!(w.stats().early_answers, 1);
    w.start_load_kv(now, &hold("second", second));
    assert_eq!(w.get_finished(now).sending, vec![RequestId::new("second")]);
    assert_eq!(answers(&sent).len(), 2);
    // A release naming another instance of this engine waits for its hold (none comes here).
    let other = Some(w.instance() ^ 1);
    inbox.lock().unwrap().push(release_naming("third", third, 7, other));
    assert!(w.get_finished(now).is_empty());
    assert_eq!((answers(&sent).len(), w.stats().early_answers), (2, 1));
    // A release of the first hold again, from a READ of its replayed offer, once the first hold
    // is forgotten: "not held" at once.
    let forgotten = now + 2 * w.config().lease_duration.max(w.config().early_release_ttl);
    assert!(w.get_finished(forgotten).is_empty());
    inbox.lock().unwrap().push(release_naming("first", first, 7, me));
    w.get_finished(forgotten);
    assert_eq!(answers(&sent).last(), Some(&("first".to_owned(), false)));
}

#[test]
fn heartbeats_with_the_right_nonce_extend_a_lease() {
    let (mut w, inbox, _) = answering_prefill(config(0));
    let now = Instant::now();
    let lease = w.config().lease_duration;
    w.start_load_kv(now, &ConnectorMetadata { reqs_to_send: held(&["a", "b"]), ..Default::default() });
    let renew =
        |holds: Vec<HeldRequest>| notif(&wire::encode(&RenewLeases { holds, pushes: Vec::new() }).unwrap());
    let forged = vec![HeldRequest { request_id: "b".into(), nonce: nonce_of("not b") }];
    let at = now + lease / 2;
    inbox.lock().unwrap().extend([renew(held(&["a"])), renew(forged)]);
    assert!(w.get_finished(at).is_empty());
    assert_eq!(
        w.get_finished(now + lease).sending,
        vec![RequestId::new("b")],
        "a wrong nonce renews nothing"
    );
    assert!(w.get_finished(at + lease - Duration::from_millis(1)).is_empty());
    assert_eq!(w.get_finished(at + lease).sending, vec![RequestId::new("a")]);
    assert_eq!(w.stats().leases_renewed, 1);
}
