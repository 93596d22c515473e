//! The prefill side's offers and holds, keyed deployments, and lease renewals.

use super::*;

#[test]
fn prefill_keeps_only_full_computed_blocks() {
    let mut s = sched();
    let p = TransferParams { do_remote_decode: true, ..Default::default() };
    // 2 full blocks and a partial one: the partial block is not offered.
    let out =
        s.request_finished(&id("a"), Some(&p), FinishReason::LengthCapped, 2 * BS + 5, &whole(&[3, 4, 5]));
    assert!(out.delay_free);
    let params = out.params.unwrap();
    let nonce_a = params.kvx_hold_nonce.unwrap();
    assert_eq!(
        params,
        TransferParams {
            remote_request_id: Some(id("a")),
            kvx_hold_nonce: Some(nonce_a),
            tp_size: Some(1),
            ..decode_params(vec![3, 4])
        }
    );
    assert_eq!(params.kvx_offer_mac, None, "no key, no MAC");
    // Exactly 2 full blocks, a third allocated for the next token: only 2 offered.
    let out = s.request_finished(&id("b"), Some(&p), FinishReason::LengthCapped, 2 * BS, &whole(&[6, 7, 8]));
    let params_b = out.params.unwrap();
    assert_eq!(params_b.remote_block_ids, Some(vec![vec![6, 7]]));
    let nonce_b = params_b.kvx_hold_nonce.unwrap();
    assert_ne!(nonce_a, nonce_b, "every hold has its own nonce");
    // Zero computed tokens is not "all full".
    let out = s.request_finished(&id("c"), Some(&p), FinishReason::LengthCapped, 0, &whole(&[9]));
    assert!(!out.delay_free);
    assert_eq!(out.params.unwrap().remote_block_ids, Some(vec![vec![]]));
    // Shorter than a block: free now.
    let out = s.request_finished(&id("d"), Some(&p), FinishReason::LengthCapped, 5, &whole(&[9]));
    assert!(!out.delay_free);
    let meta = s.build_connector_meta(Instant::now());
    assert_eq!(
        meta.reqs_to_send,
        vec![
            HeldRequest { request_id: id("a"), nonce: nonce_a },
            HeldRequest { request_id: id("b"), nonce: nonce_b }
        ]
    );
    assert_eq!(s.num_sending(), 2);
    s.update_finished(&Finished { sending: vec![id("a"), id("b")], ..Default::default() });
    assert!(s.is_idle());
}

#[test]
fn remote_decode_requests_that_stopped_or_hit_their_cap_are_held_and_no_others() {
    let mut s = sched();
    let p = TransferParams { do_remote_decode: true, ..Default::default() };
    for reason in [FinishReason::LengthCapped, FinishReason::Stopped] {
        assert!(
            s.request_finished(&id("a"), Some(&p), reason, 64, &whole(&[1, 2, 3, 4])).delay_free,
            "{reason:?}"
        );
    }
    s.update_finished(&Finished { sending: vec![id("a")], ..Default::default() });
    for reason in [FinishReason::Aborted, FinishReason::Error] {
        assert_eq!(
            s.request_finished(&id("a"), Some(&p), reason, 64, &whole(&[1, 2, 3, 4])),
            FinishOutcome::default()
        );
    }
    assert_eq!(
        s.request_finished(&id("a"), None, FinishReason::LengthCapped, 64, &whole(&[1, 2, 3, 4])),
        FinishOutcome::default()
    );
    assert!(s.is_idle());
}

#[test]
fn the_prefill_engines_request_id_travels_to_the_decode_workers() {
    // Prefill: request_finished names its own request in the params it returns.
    let mut prefill = sched();
    let held = TransferParams { do_remote_decode: true, ..Default::default() };
    let out = prefill.request_finished(
        &id("cmpl-p"),
        Some(&held),
        FinishReason::LengthCapped,
        2 * BS,
        &whole(&[3, 4]),
    );
    // The params cross to the decode engine as JSON (through the proxy), per-group block ids.
    let json = out.params.unwrap().to_json();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["remote_request_id"], "cmpl-p");
    assert_eq!(v["remote_block_ids"], serde_json::json!([[3, 4]]));
    let mut p = TransferParams::from_json(&json).unwrap();
    // Decode: a load and a notify-only request both carry the prefill engine's id.
    let mut decode = sched();
    decode
        .update_state_after_alloc(&id("cmpl-d"), 2 * BS, Some(&mut p.clone()), &new_at(0, &[5, 6]), 0, 2 * BS)
        .unwrap();
    decode.update_state_after_alloc(&id("cmpl-d2"), 2 * BS, Some(&mut p), &new_at(0, &[]), 0, 0).unwrap();
    let mut reqs = decode.build_connector_meta(Instant::now()).reqs_to_recv;
    reqs.sort_by(|a, b| a.request_id.as_str().cmp(b.request_id.as_str()));
    assert_eq!(reqs.len(), 2);
    for r in &reqs {
        assert_eq!(r.remote_request_id, Some(id("cmpl-p")));
        assert_eq!(r.prefill_request_id(), &id("cmpl-p"));
    }
    assert!(!reqs[0].is_notify_only() && reqs[1].is_notify_only());
    // Without it (an older peer), the notification names the decode engine's own id.
    let mut old = decode_params(vec![1]);
    decode.update_state_after_alloc(&id("same"), BS, Some(&mut old), &new_at(0, &[9]), 0, BS).unwrap();
    let meta = decode.build_connector_meta(Instant::now());
    assert_eq!(meta.reqs_to_recv[0].prefill_request_id(), &id("same"));
    // And it survives the wire encoding to the workers.
    let back: ConnectorMetadata = crate::wire::decode(&crate::wire::encode(&meta).unwrap()).unwrap();
    assert_eq!(back, meta);
}

#[test]
fn zero_block_size_is_rejected() {
    let cfg = SchedulerConfig { block_size: 0, ..sched().config().clone() };
    assert!(ConnectorScheduler::new(cfg).is_err());
}

#[test]
fn a_keyed_prefill_engine_signs_its_offer_and_the_decode_side_carries_it() {
    let key = AuthKey::new("deployment secret 0123").unwrap();
    let mut prefill =
        ConnectorScheduler::new(SchedulerConfig { auth_key: Some(key.clone()), ..sched().config }).unwrap();
    let held = TransferParams { do_remote_decode: true, ..Default::default() };
    let out = prefill.request_finished(
        &id("p1"),
        Some(&held),
        FinishReason::LengthCapped,
        3 * BS,
        &whole(&[7, 8, 9]),
    );
    let mut params = TransferParams::from_json(&out.params.unwrap().to_json()).unwrap();
    let mut decode = sched();
    decode
        .update_state_after_alloc(&id("d1"), 2 * BS + 1, Some(&mut params), &new_at(0, &[1, 2]), 0, 2 * BS)
        .unwrap();
    let r = decode.build_connector_meta(Instant::now()).reqs_to_recv.remove(0);
    assert_eq!(r.remote_block_ids, whole(&[7, 8, 9]));
    r.offer().unwrap().verify(&key, r.mac.as_ref()).unwrap();
    let mut forged = r.clone();
    forged.remote_block_ids[0].ids[2] = 3;
    assert!(forged.offer().unwrap().verify(&key, forged.mac.as_ref()).is_err());
    let other_tp = RecvRequest { remote_tp_size: Some(2), ..r };
    assert!(other_tp.offer().unwrap().verify(&key, other_tp.mac.as_ref()).is_err(), "tp_size is covered");
}

#[test]
fn seeded_nonces_are_reproducible() {
    let nonces = |seed| {
        let mut s = ConnectorScheduler::with_nonces(sched().config, NonceSource::from_seed(seed)).unwrap();
        let held = TransferParams { do_remote_decode: true, ..Default::default() };
        s.request_finished(&id("a"), Some(&held), FinishReason::LengthCapped, BS, &whole(&[1]))
            .params
            .unwrap()
            .kvx_hold_nonce
    };
    assert_eq!(nonces([1; 32]), nonces([1; 32]));
    assert_ne!(nonces([1; 32]), nonces([2; 32]));
}

fn offered(prefill: &mut ConnectorScheduler, id_: &str) -> TransferParams {
    let held = TransferParams { do_remote_decode: true, ..Default::default() };
    let out =
        prefill.request_finished(&id(id_), Some(&held), FinishReason::LengthCapped, 2 * BS, &whole(&[3, 4]));
    out.params.unwrap()
}

#[test]
fn waiting_requests_have_their_leases_renewed_every_sixth_of_a_lease() {
    let mut prefill = sched();
    let (mut a, b) = (offered(&mut prefill, "pa"), offered(&mut prefill, "pb"));
    let mut s = sched();
    let t0 = Instant::now();
    s.on_new_request(&id("a"), Some(&a));
    s.on_new_request(&id("b"), Some(&b));
    s.on_new_request(&id("plain"), None);
    assert!(s.build_connector_meta(t0).heartbeats.is_empty(), "a new hold needs no renewal yet");
    let sixth = Duration::from_secs(5);
    assert_eq!(s.next_deadline(), Some(t0 + sixth));
    let beats = s.build_connector_meta(t0 + sixth).heartbeats;
    assert_eq!(beats.len(), 1, "one per prefill engine");
    let ids: Vec<&str> = beats[0].holds.iter().map(|h| h.request_id.as_str()).collect();
    assert_eq!(ids, ["pa", "pb"], "named as the prefill engine knows them, with their nonces");
    assert_eq!(beats[0].holds[0].nonce, a.kvx_hold_nonce.unwrap());
    assert!(s.build_connector_meta(t0 + sixth + sixth / 2).heartbeats.is_empty());
    // "a" is loading: still renewed until its load is reported; "b" finishes while queued.
    s.update_state_after_alloc(&id("a"), 2 * BS, Some(&mut a), &new_at(0, &[1, 2]), 0, 2 * BS).unwrap();
    s.request_finished(&id("b"), Some(&b), FinishReason::Aborted, 0, &whole(&[]));
    let meta = s.build_connector_meta(t0 + 2 * sixth);
    assert_eq!(meta.heartbeats[0].holds.len(), 1);
    assert_eq!(meta.reqs_to_recv.len(), 2, "a's load, and b's release though it never ran");
    assert!(meta.reqs_to_recv.iter().any(|r| r.request_id == id("b") && r.is_notify_only()));
    s.update_finished(&Finished { recving: vec![id("a")], ..Default::default() });
    assert!(s.build_connector_meta(t0 + 3 * sixth).heartbeats.is_empty());
    assert!(s.is_idle());
}

#[test]
fn a_keyed_decode_engine_renews_only_offers_that_verify() {
    let key = AuthKey::new("deployment secret 0123").unwrap();
    let keyed =
        |c: SchedulerConfig| ConnectorScheduler::new(SchedulerConfig { auth_key: Some(key.clone()), ..c });
    let mut prefill = keyed(sched().config).unwrap();
    let good = offered(&mut prefill, "p1");
    let mut forged = good.clone();
    forged.remote_host = Some("evil".into());
    // Another TP size would renew other prefill ranks (other ports).
    let other_tp = TransferParams { tp_size: Some(4), ..good.clone() };
    let mut s = keyed(sched().config).unwrap();
    s.on_new_request(&id("good"), Some(&good));
    s.on_new_request(&id("forged"), Some(&forged));
    s.on_new_request(&id("other-tp"), Some(&other_tp));
    let t0 = Instant::now();
    s.build_connector_meta(t0);
    let beats = s.build_connector_meta(t0 + Duration::from_secs(5)).heartbeats;
    assert_eq!(beats.len(), 1);
    assert_eq!(beats[0].remote, RemoteCoordinates::at("prefill", "10.0.0.1", 5600));
    assert_eq!((beats[0].remote_tp_size, beats[0].holds.len()), (Some(1), 1));
}
