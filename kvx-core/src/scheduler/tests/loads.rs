//! The decode side: what a request loads, its allocation, and aborts.

use super::*;

#[test]
fn remote_prefill_counts_full_blocks_minus_computed() {
    let mut s = sched();
    let p = decode_params(vec![10, 11, 12]);
    let m = s.get_num_new_matched_tokens(&id("r"), 3 * BS + 5, Some(&p), 0).unwrap();
    assert_eq!(m, MatchedTokens { count: 3 * BS, load_async: true });
    let m = s.get_num_new_matched_tokens(&id("r"), 3 * BS + 5, Some(&p), BS).unwrap();
    assert_eq!(m, MatchedTokens { count: 2 * BS, load_async: true });
    // Capped by the blocks the remote offers, not only by the prompt.
    let m = s.get_num_new_matched_tokens(&id("r"), 10 * BS, Some(&p), 0).unwrap();
    assert_eq!(m.count, 3 * BS);
    assert!(s.build_connector_meta(Instant::now()).is_empty());
}

#[test]
fn params_without_host_or_port_load_from_the_engine_found_by_id() {
    let mut prefill =
        ConnectorScheduler::new(SchedulerConfig { side_channel: None, ..sched().config }).unwrap();
    let asked = TransferParams { do_remote_decode: true, ..Default::default() };
    let out =
        prefill.request_finished(&id("p"), Some(&asked), FinishReason::LengthCapped, 2 * BS, &whole(&[4, 5]));
    let mut p = out.params.unwrap();
    assert_eq!((&p.remote_host, p.remote_port), (&None, None));
    let mut s = sched();
    let m = s.get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&p), 0).unwrap();
    assert_eq!(m, MatchedTokens { count: 2 * BS, load_async: true });
    s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[7, 8]), 0, m.count).unwrap();
    let meta = s.build_connector_meta(Instant::now());
    assert_eq!(meta.reqs_to_recv[0].remote, RemoteCoordinates::by_id("prefill"));
}

#[test]
fn no_remote_prefill_or_no_params_loads_nothing() {
    let s = sched();
    assert_eq!(s.get_num_new_matched_tokens(&id("r"), 100, None, 0).unwrap(), MatchedTokens::default());
    let p = TransferParams { do_remote_decode: true, ..Default::default() };
    assert_eq!(s.get_num_new_matched_tokens(&id("r"), 100, Some(&p), 0).unwrap(), MatchedTokens::default());
}

#[test]
fn unaligned_computed_tokens_is_an_error_not_a_panic() {
    let s = sched();
    let p = decode_params(vec![1, 2]);
    let e = s.get_num_new_matched_tokens(&id("r"), 40, Some(&p), 3).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
}

#[test]
fn incomplete_coordinates_promise_no_load_and_transfer_nothing() {
    for strip in 0..3 {
        let mut s = sched();
        let mut p = decode_params(vec![1, 2]);
        match strip {
            0 => p.remote_host = None,
            1 => p.remote_engine_id = None,
            _ => p.remote_port = None,
        }
        let m = s.get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&p), 0).unwrap();
        assert_eq!(m, MatchedTokens::default(), "case {strip}");
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[7, 8]), 0, 2 * BS).unwrap();
        assert!(!p.do_remote_prefill, "at most one transfer");
        assert!(s.build_connector_meta(Instant::now()).reqs_to_recv.is_empty());
    }
}

#[test]
fn alloc_records_new_blocks_and_turns_remote_prefill_off() {
    let mut s = sched();
    let mut p = decode_params(vec![10, 11, 12]);
    s.get_num_new_matched_tokens(&id("r"), 3 * BS + 1, Some(&p), BS).unwrap();
    s.update_state_after_alloc(&id("r"), 3 * BS + 1, Some(&mut p), &new_at(BS, &[5, 6, 99]), BS, 2 * BS)
        .unwrap();
    assert!(!p.do_remote_prefill);
    // A second allocation for the same request triggers nothing.
    s.update_state_after_alloc(&id("r"), 3 * BS + 1, Some(&mut p), &new_at(0, &[5, 6]), 0, 2 * BS).unwrap();
    let meta = s.build_connector_meta(Instant::now());
    assert_eq!(meta.reqs_to_recv.len(), 1);
    let r = &meta.reqs_to_recv[0];
    assert_eq!(r.local_block_ids, new_at(BS, &[5, 6]), "the first block hit the local prefix cache");
    assert_eq!(r.remote_block_ids, whole(&[10, 11, 12]), "as offered");
    assert_eq!(r.remote.engine_id, "prefill".into());
    assert_eq!(s.num_recving(), 1);
    assert!(s.build_connector_meta(Instant::now()).is_empty(), "the record is cleared");
}

#[test]
fn full_prefix_hit_is_notify_only_and_survives_allocation() {
    let mut s = sched();
    let mut p = decode_params(vec![10, 11]);
    let m = s.get_num_new_matched_tokens(&id("r"), 2 * BS + 3, Some(&p), 2 * BS).unwrap();
    assert_eq!(m, MatchedTokens::default());
    // The engine allocates a block for its own computation of the tail: not a load target.
    s.update_state_after_alloc(&id("r"), 2 * BS + 3, Some(&mut p), &new_at(0, &[42]), 0, 0).unwrap();
    let meta = s.build_connector_meta(Instant::now());
    assert_eq!(meta.reqs_to_recv.len(), 1);
    assert!(meta.reqs_to_recv[0].is_notify_only());
    assert_eq!(s.num_recving(), 0, "a notify-only request does not wait");
}

#[test]
fn empty_remote_blocks_with_a_long_prompt_loads_nothing() {
    let mut s = sched();
    let mut p = decode_params(vec![]);
    let m = s.get_num_new_matched_tokens(&id("r"), 5 * BS, Some(&p), 0).unwrap();
    assert_eq!(m, MatchedTokens::default());
    s.update_state_after_alloc(&id("r"), 5 * BS, Some(&mut p), &new_at(0, &[1, 2, 3, 4, 5]), 0, 0).unwrap();
    assert!(s.build_connector_meta(Instant::now()).is_empty(), "nothing held remotely: nothing to free");
}

#[test]
fn alloc_with_too_few_blocks_is_an_error() {
    let mut s = sched();
    let mut p = decode_params(vec![1, 2]);
    let e =
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[7]), 0, 2 * BS).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
    let mut p = decode_params(vec![1]);
    assert!(
        s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[7, 8]), 0, 2 * BS).is_err()
    );
}

#[test]
fn abort_before_metadata_drops_the_read_but_still_notifies() {
    let mut s = sched();
    let mut p = decode_params(vec![10, 11]);
    s.get_num_new_matched_tokens(&id("r"), 2 * BS, Some(&p), 0).unwrap();
    s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[5, 6]), 0, 2 * BS).unwrap();
    let out = s.request_finished(&id("r"), Some(&p), FinishReason::Aborted, 0, &whole(&[5, 6]));
    assert!(!out.delay_free, "no READ will target the blocks: free them now");
    let meta = s.build_connector_meta(Instant::now());
    assert_eq!(meta.reqs_to_recv.len(), 1);
    assert!(meta.reqs_to_recv[0].is_notify_only());
    assert!(s.is_idle());
}

#[test]
fn abort_during_read_delays_freeing_until_the_load_ends() {
    let mut s = sched();
    let mut p = decode_params(vec![10]);
    s.get_num_new_matched_tokens(&id("r"), BS, Some(&p), 0).unwrap();
    s.update_state_after_alloc(&id("r"), BS, Some(&mut p), &new_at(0, &[5]), 0, BS).unwrap();
    s.build_connector_meta(Instant::now());
    let out = s.request_finished(&id("r"), Some(&p), FinishReason::Aborted, 0, &whole(&[5]));
    assert!(out.delay_free);
    s.update_finished(&Finished {
        failed_recving: vec![FailedRecv {
            request_id: id("r"),
            error: crate::Error::new(crate::ErrorKind::Transfer, "x"),
        }],
        ..Default::default()
    });
    assert!(s.is_idle());
}

#[test]
fn asking_for_matched_tokens_records_nothing() {
    // vLLM may ask again for a request it could not schedule: only the allocation records.
    let mut s = sched();
    for (blocks, computed) in [(vec![10, 11], 0), (vec![10, 11], 2 * BS)] {
        let p = decode_params(blocks);
        for _ in 0..3 {
            s.get_num_new_matched_tokens(&id("r"), 2 * BS + 3, Some(&p), computed).unwrap();
        }
    }
    assert!(s.build_connector_meta(Instant::now()).is_empty());
    assert!(s.is_idle());
    assert_eq!(s.num_recving(), 0);
}

#[test]
fn the_second_allocation_of_an_async_load_records_nothing() {
    // vLLM calls update_state_after_alloc again once the load completes, with no external
    // tokens: neither a second load nor a notify-only message may follow.
    let mut s = sched();
    let mut p = decode_params(vec![10, 11]);
    s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[5, 6]), 0, 2 * BS).unwrap();
    assert_eq!(s.build_connector_meta(Instant::now()).reqs_to_recv.len(), 1);
    s.update_state_after_alloc(&id("r"), 2 * BS, Some(&mut p), &new_at(0, &[7]), 0, 0).unwrap();
    assert!(s.build_connector_meta(Instant::now()).is_empty());
    // Notify-only, twice: one message.
    let mut p = decode_params(vec![10, 11]);
    s.update_state_after_alloc(&id("n"), 2 * BS + 3, Some(&mut p), &new_at(0, &[42]), 0, 0).unwrap();
    s.update_state_after_alloc(&id("n"), 2 * BS + 3, Some(&mut p), &new_at(0, &[42]), 0, 0).unwrap();
    let meta = s.build_connector_meta(Instant::now());
    assert_eq!(meta.reqs_to_recv.len(), 1);
    assert!(meta.reqs_to_recv[0].is_notify_only());
}

#[test]
fn the_alloc_check_counts_the_local_prefix() {
    let mut s = sched();
    // 3 blocks offered, 1 cached locally: at most 2 may load, from the second remote block.
    let mut p = decode_params(vec![10, 11, 12]);
    let e = s
        .update_state_after_alloc(&id("r"), 3 * BS, Some(&mut p), &new_at(BS, &[5, 6, 7]), BS, 3 * BS)
        .unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
    let meta = s.build_connector_meta(Instant::now());
    assert!(meta.reqs_to_recv[0].is_notify_only(), "the prefill engine is still told to free");
    let mut p = decode_params(vec![10, 11, 12]);
    s.update_state_after_alloc(&id("q"), 3 * BS, Some(&mut p), &new_at(2 * BS, &[5]), 2 * BS, BS).unwrap();
    let r = s.build_connector_meta(Instant::now()).reqs_to_recv.remove(0);
    assert_eq!(r.local_block_ids, new_at(2 * BS, &[5]), "read from the third remote block");
}
