//! Client bytes: vLLM's `kv_transfer_params` JSON driving the scheduler, and hold nonces.

use kvx_core::wire;
use kvx_core::{
    AuthKey, BlockId, ConnectorMetadata, ConnectorScheduler, ErrorKind, FinishReason, Finished, GroupBlocks,
    Nonce, Offer, RequestId, SchedulerConfig, TransferParams,
};

use crate::input::ByteSource;

/// `TransferParams::from_json`, then a request through a decode engine's and a prefill engine's
/// `ConnectorScheduler` with the parsed params (`on_new_request`, `get_num_new_matched_tokens`,
/// `update_state_after_alloc`, `build_connector_meta` now and a sixth of a lease later,
/// `request_finished`, `update_finished`).
///
/// The input is the JSON, optionally followed by a NUL byte (never valid in JSON) and bytes that
/// pick the scheduler's inputs: block size, prompt length, computed tokens, external tokens,
/// the allocated blocks and how the request finishes. Without them every pick is the natural
/// one (the whole prompt loads into freshly allocated blocks).
///
/// Checks: parse errors are `Wire`; what parses renders to JSON that parses to the same params;
/// the matched tokens are whole blocks the remote offers within the prompt; the metadata loads
/// only blocks that were offered and allocated (an allocation that does not fit only notifies),
/// and survives the wire; heartbeats renew only the params' own hold at the engine they name;
/// once the workers report, both schedulers are idle.
pub fn transfer_params(data: &[u8]) {
    let (json, picks) = match data.iter().position(|&b| b == 0) {
        Some(nul) => (&data[..nul], &data[nul + 1..]),
        None => (data, &[][..]),
    };
    let text = String::from_utf8_lossy(json);
    let params = match TransferParams::from_json(&text) {
        Ok(p) => p,
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Wire, "kv_transfer_params refused with {:?}: {e}", e.kind());
            return;
        }
    };
    let rendered = params.to_json();
    match TransferParams::from_json(&rendered) {
        Ok(again) => assert_eq!(again, params, "params changed on a round trip through {rendered}"),
        Err(e) => panic!("kvx's own rendering {rendered} does not parse: {e}"),
    }
    drive_schedulers(&params, &mut ByteSource::new(picks));
}

fn scheduler(
    engine: &str,
    block_size: u32,
    auth_key: Option<AuthKey>,
    group_windows: Vec<Option<u32>>,
) -> Option<ConnectorScheduler> {
    ConnectorScheduler::new(SchedulerConfig {
        engine_id: engine.into(),
        block_size,
        side_channel: Some(kvx_core::Endpoint::new("10.0.0.2", 5700)),
        auth_key,
        lease_duration: std::time::Duration::from_secs(30),
        instance: None,
        tp_size: 1,
        group_windows,
    })
    .ok()
}

fn drive_schedulers(params: &TransferParams, src: &mut ByteSource<'_>) {
    let block_size = [16, 1, 3, 256, u32::MAX, 0][src.below(6)];
    let offered_groups = params.remote_groups().unwrap_or_default();
    // One full-attention group, a sliding window of two blocks and a full group, or as many
    // full-attention groups as offered.
    let windows = match src.below(3) {
        0 => Vec::new(),
        1 => vec![Some(block_size.saturating_mul(2)), None],
        _ => vec![None; offered_groups.len().min(8)],
    };
    let Some(mut decode) = scheduler("decode", block_size, None, windows.clone()) else {
        assert_eq!(block_size, 0, "a scheduler with block size {block_size} refused");
        return;
    };
    let bs = block_size as usize;
    let offered = offered_groups.iter().map(GroupBlocks::end).max().unwrap_or(0) as usize;
    let prompt_len = match src.below(6) {
        0 => offered.saturating_mul(bs).saturating_add(3),
        1 => 0,
        2 => offered.saturating_mul(bs),
        3 => usize::MAX,
        4 => src.u32() as usize,
        _ => bs - 1,
    };
    let computed = match src.below(5) {
        0 => 0,
        1 => bs,
        2 => prompt_len / bs * bs,
        3 => usize::MAX,
        _ => src.u32() as usize,
    };
    let id = RequestId::new("cmpl-fuzz-0");
    // The request arrives: its lease is renewed from now on if its offer checks.
    decode.on_new_request(&id, Some(params));
    let matched = decode.get_num_new_matched_tokens(&id, prompt_len, Some(params), computed);
    if let Ok(m) = matched {
        assert!(m.count % bs == 0, "{} matched tokens are not whole blocks of {bs}", m.count);
        assert!(m.count <= prompt_len, "{} matched tokens for a {prompt_len}-token prompt", m.count);
        assert!(m.count / bs <= offered, "{} matched tokens but {offered} block positions offered", m.count);
        assert_eq!(m.load_async, m.count > 0);
    }
    let external = match src.below(4) {
        0 => matched.map(|m| m.count).unwrap_or_default(),
        1 => 0,
        2 => bs.saturating_mul(src.below(8)),
        _ => src.u32() as usize,
    };
    // Fresh blocks from the first uncomputed position for each group, random ones, or none.
    let groups = windows.len().max(1);
    let first = u32::try_from(computed / bs).unwrap_or(u32::MAX);
    let new_blocks: Vec<GroupBlocks> = match src.below(3) {
        0 => (0..groups as u32)
            .map(|g| {
                GroupBlocks::new(
                    first,
                    (0..(external / bs).min(4096) as u32).map(|b| 100 + g * 4096 + b).collect(),
                )
            })
            .collect(),
        1 => (0..src.below(4))
            .map(|_| GroupBlocks::new(src.edgy_u32(), (0..src.below(64)).map(|_| src.edgy_u32()).collect()))
            .collect(),
        _ => Vec::new(),
    };
    let allocated: Vec<BlockId> = new_blocks.iter().flat_map(|g| g.ids.iter().copied()).collect();
    let mut alloc_params = params.clone();
    let alloc = decode.update_state_after_alloc(
        &id,
        prompt_len,
        Some(&mut alloc_params),
        &new_blocks,
        computed,
        external,
    );
    if params.do_remote_prefill {
        assert!(!alloc_params.do_remote_prefill, "a request may trigger one load only");
    }
    // vLLM allocates again once an async load completes: nothing more is recorded.
    let again =
        decode.update_state_after_alloc(&id, prompt_len, Some(&mut alloc_params), &new_blocks, computed, 0);
    assert!(again.is_ok(), "the second allocation failed: {again:?}");
    let now = std::time::Instant::now();
    let meta = decode.build_connector_meta(now);
    assert!(meta.reqs_to_recv.len() <= 1 && meta.reqs_to_send.is_empty(), "{meta:?}");
    if let Some(r) = meta.reqs_to_recv.first() {
        // An allocation that does not fit loads nothing, but the prefill engine is still told to
        // free (notify only).
        assert!(
            alloc.is_ok() || r.is_notify_only(),
            "a load recorded although the allocation failed: {alloc:?}, {r:?}"
        );
        assert_eq!(r.remote_block_ids, offered_groups, "the offer as the params made it");
        if !r.is_notify_only() {
            let pairs = r.read_pairs();
            let Ok((local, remote)) = &pairs else { panic!("a load whose pairs do not check: {pairs:?}") };
            assert!(local.iter().all(|b| allocated.contains(b)), "loads into unallocated blocks: {r:?}");
            let offered_ids: Vec<BlockId> =
                offered_groups.iter().flat_map(|g| g.ids.iter().copied()).collect();
            assert!(remote.iter().all(|b| offered_ids.contains(b)), "reads unoffered: {r:?}");
        }
    }
    match wire::encode(&meta).and_then(|b| wire::decode::<ConnectorMetadata>(&b)) {
        Ok(back) => assert_eq!(back, meta),
        Err(e) => panic!("the scheduler's metadata does not cross the wire: {e}"),
    }
    // A sixth of a lease later, a request still waiting has its lease renewed: only its own
    // offer's hold, at the engine the params name.
    let beat = decode.build_connector_meta(now + std::time::Duration::from_secs(5));
    for h in &beat.heartbeats {
        assert_eq!(Some(&h.remote), params.coordinates().as_ref(), "a heartbeat to another engine: {h:?}");
        let offer = (params.remote_request_id.as_ref(), params.kvx_hold_nonce.as_ref());
        for held in &h.holds {
            assert_eq!((Some(&held.request_id), Some(&held.nonce)), offer, "renews another hold: {h:?}");
        }
    }
    let reason =
        [FinishReason::LengthCapped, FinishReason::Aborted, FinishReason::Stopped, FinishReason::Error]
            [src.below(4)];
    let finished_tokens = if src.below(2) == 0 { prompt_len } else { computed };
    let out = decode.request_finished(&id, Some(params), reason, finished_tokens, &new_blocks);
    if let Some(handed_out) = &out.params {
        match TransferParams::from_json(&handed_out.to_json()) {
            Ok(back) => assert_eq!(&back, handed_out),
            Err(e) => panic!("the params a scheduler hands out do not parse: {e}"),
        }
    }
    decode.build_connector_meta(std::time::Instant::now());
    // The workers report every load done and every hold released.
    let report = Finished { sending: vec![id.clone()], recving: vec![id.clone()], failed_recving: vec![] };
    decode.update_finished(&report);
    assert!(decode.is_idle(), "the decode scheduler is not idle once everything is reported");

    // The same params at a prefill engine (with a key or none), for a request that stops at its
    // length cap: the params it hands out carry a nonce, and with a key a MAC that verifies.
    let key = (src.below(2) == 1).then(|| AuthKey::new("kvx-fuzz deployment key")).and_then(Result::ok);
    let Some(mut prefill) = scheduler("prefill", block_size, key.clone(), windows) else { return };
    let out =
        prefill.request_finished(&id, Some(params), FinishReason::LengthCapped, prompt_len, &new_blocks);
    if let Some(offered) = out.params.as_ref().filter(|p| p.do_remote_prefill) {
        let remote = offered.coordinates();
        let nonce = offered.kvx_hold_nonce;
        assert!(remote.is_some() && nonce.is_some(), "an offer without coordinates or nonce: {offered:?}");
        if let (Some(key), Some(remote), Some(nonce)) = (&key, &remote, &nonce) {
            let instance = offered.kvx_instance.as_ref();
            let groups = offered.remote_groups();
            let Ok(groups) = &groups else {
                panic!("a prefill engine's own offer does not parse: {groups:?}")
            };
            let offer = Offer { remote, request_id: &id, groups, nonce, instance, tp_size: offered.tp_size };
            let verified = offer.verify(key, offered.kvx_offer_mac.as_ref());
            assert!(verified.is_ok(), "a prefill engine's own offer does not verify: {verified:?}");
        }
    }
    let meta = prefill.build_connector_meta(std::time::Instant::now());
    assert_eq!(meta.reqs_to_send.len(), usize::from(out.delay_free));
    prefill.update_finished(&report);
    assert!(prefill.is_idle(), "the prefill scheduler is not idle once the hold is released");
}

/// A hold's nonce as it comes back from a peer or client: `Nonce::parse`, and as a JSON string.
/// What parses prints back as the same nonce; errors are `InvalidPeerData`.
pub fn nonce(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match Nonce::parse(&text) {
        Ok(n) => {
            let printed = n.to_string();
            assert_eq!(printed, text.to_ascii_lowercase(), "a nonce printed differently");
            assert!(matches!(Nonce::parse(&printed), Ok(m) if m == n));
        }
        Err(e) => assert_eq!(e.kind(), ErrorKind::InvalidPeerData, "{e}"),
    }
    let _ = serde_json::from_str::<Nonce>(&text);
}
