//! Hybrid models: a sliding-window group beside a full-attention one.

use super::*;

/// A scheduler for a model with a sliding-window group of two blocks and a full-attention group.
fn hybrid() -> ConnectorScheduler {
    ConnectorScheduler::new(SchedulerConfig {
        group_windows: vec![Some(2 * BS as u32), None],
        ..sched().config
    })
    .unwrap()
}

/// What a hybrid prefill engine offers after computing `tokens`, holding the blocks `sliding`
/// (from position `first`) and `full`.
fn hybrid_offer(tokens: usize, first: u32, sliding: &[BlockId], full: &[BlockId]) -> TransferParams {
    let held = TransferParams { do_remote_decode: true, ..Default::default() };
    let blocks = [GroupBlocks::new(first, sliding.to_vec()), GroupBlocks::whole(full.to_vec())];
    hybrid()
        .request_finished(&id("p"), Some(&held), FinishReason::LengthCapped, tokens, &blocks)
        .params
        .unwrap()
}

#[test]
fn a_hybrid_model_offers_each_group_and_loads_only_the_window_of_a_sliding_group() {
    // 4 full blocks and a partial one; the sliding group dropped positions 0 and 1.
    let mut p = hybrid_offer(4 * BS + 3, 2, &[20, 21, 22], &[1, 2, 3, 4, 5]);
    let v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
    assert_eq!(v["remote_block_ids"], serde_json::json!([[20, 21], [1, 2, 3, 4]]), "full blocks only");
    assert_eq!(v["kvx_group_first"], serde_json::json!([2, 0]));
    let mut s = hybrid();
    let m = s.get_num_new_matched_tokens(&id("r"), 4 * BS + 3, Some(&p), 0).unwrap();
    assert_eq!(m, MatchedTokens { count: 4 * BS, load_async: true });
    // The engine allocated the sliding group from position 2 (its window), the full one whole.
    let new = [GroupBlocks::new(2, vec![50, 51, 52]), GroupBlocks::whole(vec![60, 61, 62, 63, 64])];
    s.update_state_after_alloc(&id("r"), 4 * BS + 3, Some(&mut p), &new, 0, m.count).unwrap();
    let r = s.build_connector_meta(Instant::now()).reqs_to_recv.remove(0);
    assert_eq!(
        r.local_block_ids,
        [GroupBlocks::new(2, vec![50, 51]), GroupBlocks::whole(vec![60, 61, 62, 63])]
    );
    let (local, remote) = r.read_pairs().unwrap();
    assert_eq!((&local[..], &remote[..]), (&[50, 51, 60, 61, 62, 63][..], &[20, 21, 1, 2, 3, 4][..]));
    // With a local prefix hit of 3 blocks, one block of each group loads.
    let mut p = hybrid_offer(4 * BS + 3, 2, &[20, 21], &[1, 2, 3, 4]);
    let m = s.get_num_new_matched_tokens(&id("q"), 4 * BS + 3, Some(&p), 3 * BS).unwrap();
    assert_eq!(m.count, BS);
    let new = [GroupBlocks::new(3, vec![53, 54]), GroupBlocks::new(3, vec![65, 66])];
    s.update_state_after_alloc(&id("q"), 4 * BS + 3, Some(&mut p), &new, 3 * BS, m.count).unwrap();
    let r = s.build_connector_meta(Instant::now()).reqs_to_recv.remove(0);
    assert_eq!(r.read_pairs().unwrap().1.as_ref(), [21, 4]);
}

#[test]
fn a_window_block_the_prefill_engine_dropped_is_computed_locally_not_loaded() {
    // 79 tokens computed: the window of the next token starts at token 48 (position 3), so
    // the prefill engine dropped position 2; a decode engine loading 4 blocks recomputes
    // token 64 first, whose window reaches back to position 2.
    let p = hybrid_offer(5 * BS - 1, 3, &[23], &[1, 2, 3, 4]);
    let s = hybrid();
    assert_eq!(
        s.get_num_new_matched_tokens(&id("r"), 5 * BS - 1, Some(&p), 0).unwrap(),
        MatchedTokens::default()
    );
    // One token more and it fits again: 80 tokens keep positions 3 and 4; 5 blocks load.
    let p = hybrid_offer(5 * BS, 3, &[23, 24], &[1, 2, 3, 4, 5]);
    assert_eq!(s.get_num_new_matched_tokens(&id("r"), 5 * BS, Some(&p), 0).unwrap().count, 5 * BS);
}

#[test]
fn groups_that_are_not_this_engines_load_nothing_and_a_misfit_allocation_still_frees() {
    // A one-group offer to a hybrid engine, and a hybrid offer to a one-group engine.
    let one = decode_params(vec![1, 2]);
    assert_eq!(hybrid().get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&one), 0).unwrap().count, 0);
    let two = hybrid_offer(2 * BS, 0, &[7, 8], &[1, 2]);
    assert_eq!(sched().get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&two), 0).unwrap().count, 0);
    // An allocation that misses a block the window needs, or a group: refused, and the prefill
    // engine is told to free.
    for new in [
        vec![GroupBlocks::new(1, vec![50]), GroupBlocks::whole(vec![60, 61])],
        vec![GroupBlocks::whole(vec![60, 61])],
    ] {
        let mut s = hybrid();
        let mut p = two.clone();
        let e = s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new, 0, 2 * BS).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument, "{new:?}");
        assert!(s.build_connector_meta(Instant::now()).reqs_to_recv[0].is_notify_only());
    }
}
