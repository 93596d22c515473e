use super::*;
use crate::params::TransferMode;

fn push_params(id: &str) -> TransferParams {
    TransferParams::for_push(RemoteCoordinates::at("prefill", "10.0.0.1", 5600), id.into(), Some(2))
}

#[test]
fn a_push_loads_the_prompts_full_blocks_into_a_registration() {
    let mut s = sched();
    let mut p = push_params("r");
    let m = s.get_num_new_matched_tokens(&id("r"), 3 * BS + 5, Some(&p), 0).unwrap();
    assert_eq!(m, MatchedTokens { count: 3 * BS, load_async: true }, "the prompt's full blocks");
    let partial = s.get_num_new_matched_tokens(&id("r"), 3 * BS + 5, Some(&p), BS).unwrap();
    assert_eq!(partial.count, 2 * BS, "a local prefix hit loads the rest");
    s.update_state_after_alloc(&id("r"), 3 * BS + 5, Some(&mut p), &whole(&[7, 8, 9]), 0, 3 * BS).unwrap();
    assert!(!p.do_remote_prefill, "one load per request");
    let meta = s.build_connector_meta(Instant::now());
    assert!(meta.reqs_to_recv.is_empty() && meta.heartbeats.is_empty(), "{meta:?}");
    let [reg] = meta.reqs_to_register.as_slice() else { panic!("{meta:?}") };
    assert_eq!((reg.local_block_ids.clone(), reg.remote_tp_size), (whole(&[7, 8, 9]), Some(2)));
    assert_eq!(reg.prefill_request_id(), &id("r"));
    assert!(reg.remote_block_ids.is_empty() && reg.nonce.is_none(), "nothing offered yet");
    assert_eq!(s.num_recving(), 1);
    // Aborted while its WRITE may come: the blocks stay until the workers report it.
    let out = s.request_finished(&id("r"), Some(&p), FinishReason::Aborted, 0, &[]);
    assert!(out.delay_free);
}

#[test]
fn a_full_local_hit_still_frees_the_prefill_engines_hold_and_a_short_prompt_registers_nothing() {
    let mut s = sched();
    let mut p = push_params("hit");
    s.update_state_after_alloc(&id("hit"), 2 * BS + 1, Some(&mut p), &whole(&[]), 2 * BS, 0).unwrap();
    let mut short = push_params("short");
    assert_eq!(s.get_num_new_matched_tokens(&id("short"), BS - 1, Some(&short), 0).unwrap().count, 0);
    s.update_state_after_alloc(&id("short"), BS - 1, Some(&mut short), &whole(&[]), 0, 0).unwrap();
    let meta = s.build_connector_meta(Instant::now());
    let ids: Vec<_> =
        meta.reqs_to_register.iter().map(|r| (r.request_id.clone(), r.is_notify_only())).collect();
    assert_eq!(ids, [(id("hit"), true)], "the short prompt's prefill engine holds no block");
    assert!(s.is_idle());
}

#[test]
fn a_push_waits_for_no_block_a_window_needs_that_the_prefill_engine_drops() {
    let mut s = sched();
    s.config.group_windows = vec![None, Some(40)];
    let p = push_params("w");
    // 50 tokens: the prefill engine keeps the sliding group from token 11 (block 0) on; the
    // decode engine's window after 3 blocks needs it from token 9 (block 0): pushed.
    assert_eq!(s.get_num_new_matched_tokens(&id("w"), 50, Some(&p), 0).unwrap().count, 3 * BS);
    // 63 tokens: the prefill engine keeps it from token 24 (block 1) on, but block 0 is needed.
    assert_eq!(s.get_num_new_matched_tokens(&id("w"), 63, Some(&p), 0).unwrap().count, 0);
}

#[test]
fn the_prefill_side_holds_a_push_with_its_blocks_or_refuses_it_empty() {
    let mut s = sched();
    let p = TransferParams::for_push_prefill();
    let kept =
        s.request_finished(&id("p"), Some(&p), FinishReason::LengthCapped, 2 * BS + 3, &whole(&[4, 5, 6]));
    assert!(kept.delay_free);
    assert_eq!(kept.params.as_ref().and_then(|p| p.transfer_mode), Some(TransferMode::Push));
    let aborted = s.request_finished(&id("a"), Some(&p), FinishReason::Aborted, 2 * BS, &whole(&[1, 2]));
    assert!(!aborted.delay_free && aborted.params.is_none());
    let short = s.request_finished(&id("s"), Some(&p), FinishReason::LengthCapped, BS - 1, &whole(&[3]));
    assert!(!short.delay_free);
    let meta = s.build_connector_meta(Instant::now());
    assert!(meta.reqs_to_send.is_empty(), "no pull hold: {meta:?}");
    let holds: Vec<_> = meta.reqs_to_push.iter().map(|h| (h.request_id.clone(), h.groups.clone())).collect();
    assert_eq!(
        holds,
        [(id("p"), whole(&[4, 5])), (id("a"), Vec::new()), (id("s"), Vec::new())],
        "the full blocks held; nothing for the aborted and the short request"
    );
    assert_eq!(s.num_sending(), 1);
}

#[test]
fn an_unknown_transfer_mode_is_refused_as_a_wire_error() {
    let e =
        TransferParams::from_json(r#"{"do_remote_prefill": true, "transfer_mode": "pigeon"}"#).unwrap_err();
    assert_eq!(e.kind(), crate::error::ErrorKind::Wire, "{e}");
    let p = TransferParams::from_json(r#"{"transfer_mode": "push"}"#).unwrap();
    assert_eq!(p.mode(), TransferMode::Push);
    assert_eq!(TransferParams::default().mode(), TransferMode::Pull);
}

#[test]
fn a_push_waiting_for_its_blocks_renews_its_prefill_hold() {
    let mut s = sched();
    let p = push_params("queued");
    s.on_new_request(&id("queued"), Some(&p));
    let now = Instant::now();
    assert!(s.build_connector_meta(now).heartbeats.is_empty(), "the first renewal waits a sixth of a lease");
    let beats = s.build_connector_meta(now + Duration::from_secs(5)).heartbeats;
    let [beat] = beats.as_slice() else { panic!("{beats:?}") };
    assert_eq!((beat.holds.len(), beat.pushes.clone()), (0, vec![id("queued")]));
    s.update_finished(&Finished { recving: vec![id("queued")], ..Finished::default() });
    assert!(s.is_idle());
}

#[test]
fn a_prefill_leg_with_a_shared_id_is_held_and_offered_under_it() {
    let mut s = sched();
    let mut p = TransferParams::for_push_prefill();
    p.remote_request_id = Some(id("cmpl-7-0"));
    let out = s.request_finished(
        &id("cmpl-7-0-1a2b3c4d"),
        Some(&p),
        FinishReason::LengthCapped,
        2 * BS,
        &whole(&[4, 5]),
    );
    assert!(out.delay_free);
    assert_eq!(
        out.params.and_then(|p| p.remote_request_id),
        Some(id("cmpl-7-0")),
        "a late decode leg registers under it"
    );
    let aborted = s.request_finished(
        &id("cmpl-8-0-1a2b3c4d"),
        Some(&TransferParams { remote_request_id: Some(id("cmpl-8-0")), ..p.clone() }),
        FinishReason::Aborted,
        0,
        &[],
    );
    assert!(!aborted.delay_free);
    let mut long = p.clone();
    long.remote_request_id = Some(id(&"x".repeat(crate::params::MAX_ID_LEN + 1)));
    s.request_finished(&id("own"), Some(&long), FinishReason::LengthCapped, BS, &whole(&[6]));
    let meta = s.build_connector_meta(Instant::now());
    let holds: Vec<_> =
        meta.reqs_to_push.iter().map(|h| (h.request_id.as_str(), h.registered_as.as_str())).collect();
    assert_eq!(
        holds,
        [("cmpl-7-0-1a2b3c4d", "cmpl-7-0"), ("cmpl-8-0-1a2b3c4d", "cmpl-8-0"), ("own", "own")],
        "an id over kvx's limits is not shared: the engine's own stands"
    );
    s.update_finished(&Finished { sending: vec![id("cmpl-7-0-1a2b3c4d"), id("own")], ..Default::default() });
    assert!(s.is_idle());
}

#[test]
fn the_engines_prompt_digest_goes_to_the_registration_and_to_the_hold() {
    let digest = Some(crate::HexBytes([9; 32]));
    let mut decode = sched();
    let mut p = TransferParams { kvx_prompt_digest: digest, ..push_params("r") };
    decode.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &whole(&[7, 8]), 0, 2 * BS).unwrap();
    let meta = decode.build_connector_meta(Instant::now());
    assert_eq!(meta.reqs_to_register[0].prompt, digest);
    let mut prefill = sched();
    let p = TransferParams { kvx_prompt_digest: digest, ..TransferParams::for_push_prefill() };
    let out =
        prefill.request_finished(&id("r"), Some(&p), FinishReason::LengthCapped, 2 * BS, &whole(&[4, 5]));
    assert_eq!(out.params.and_then(|p| p.kvx_prompt_digest), None, "the answer does not carry it");
    assert_eq!(prefill.build_connector_meta(Instant::now()).reqs_to_push[0].prompt, digest);
}
