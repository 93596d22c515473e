//! Hybrid models with several KV-cache groups (vLLM's hybrid allocator): sliding-window groups
//! and a full-attention group overlaid in the same layer caches and sharing one block pool, on the
//! loopback backend in simulated time, for every (prefill, decode) TP pair of (1,1), (1,2), (2,1),
//! (2,4), (4,2), (1,4) and (4,1), head-major. Each runs random prompts whose lengths sit on and
//! around the block and window boundaries, prefix hits on the decode side (longer prompts of
//! earlier ones, so that the sliding groups hit too, and prompts sharing only a prefix, which the
//! hybrid rule shrinks) and aborts at both engines; every loaded byte of every group is checked,
//! the sliding groups load only their windows, and nothing leaks in either pool. A request whose
//! prefill engine already dropped a block its window needs, and one whose offer has other groups
//! than the decode engine, are computed locally; a failed load is computed into both groups. A
//! prefix hit needs the sliding group's window blocks too (vLLM's hybrid rule).

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use kvx_core::{FinishReason, GroupBlocks, RequestId};
use kvx_testkit::chaos::Faults;
use kvx_testkit::sim::{Cluster, EngineConfig, HeadLayout, LoadFailurePolicy, ModelSpec, RequestState};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Requests in each wave of [`run_groups`].
const WAVE: usize = 12;

/// Tokens the second wave's requests generate: more than a window.
const GENERATED: usize = 4 * BS;

/// The (prefill, decode) TP pairs.
const PAIRS: [(u32, u32); 7] = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)];

/// One sliding-window group of 3 blocks and one full-attention group, two layers each (vLLM's
/// grouping of `[sliding, full] x 2`), 4 KV heads of 8, head-major.
fn one_sliding_one_full() -> ModelSpec {
    ModelSpec::standard(2, 4, 8, BS as u32)
        .with_layout(HeadLayout::Hnd)
        .with_groups(vec![Some(3 * BS as u32), None])
}

/// Gemma 3's ratio: five sliding-window groups and one full-attention group, one layer each, all
/// overlaid in one layer cache; a window of 2.5 blocks (not a whole number of blocks).
fn five_sliding_one_full() -> ModelSpec {
    let window = Some(5 * BS as u32 / 2);
    ModelSpec::standard(1, 4, 8, BS as u32)
        .with_layout(HeadLayout::Hnd)
        .with_groups(vec![window, window, window, window, window, None])
}

/// Indices of `model`'s sliding-window groups and of its full-attention groups.
fn group_kinds(model: &ModelSpec) -> (Vec<usize>, Vec<usize>) {
    (0..model.groups.len()).partition(|&g| model.groups[g].is_some())
}

/// A prompt length on or around a block or window boundary, or any length up to 8 blocks.
fn edge_len(rng: &mut StdRng, window: usize) -> usize {
    let k = rng.gen_range(1..=6);
    let bases = [k * BS, window, window + k * BS];
    match rng.gen_range(0..4) {
        3 => rng.gen_range(1..=8 * BS),
        i => (bases[i] + rng.gen_range(0..=2)).saturating_sub(1).max(1),
    }
}

/// The workload on a prefill engine of TP `p` and a decode engine of TP `d`: a wave of prompts
/// of [`edge_len`] lengths (half behind a shared 6-block prefix), then a wave of longer prompts
/// of the first wave's (and of some that share only the prefix) that generate more than a
/// window, a request aborted at the prefill engine before it ran and one aborted at the decode
/// engine while its KV loads. Checks that everything ended, nothing leaked, the decode engine hit
/// its prefix cache, every loaded block of every group was verified, the sliding groups loaded
/// fewer blocks than the full ones, and both engines dropped blocks behind the windows.
fn run_groups(model: &ModelSpec, (p, d): (u32, u32), seed: u64) {
    let what = format!("P={p} D={d} groups {:?}", model.groups);
    let (sliding, full) = group_kinds(model);
    let window = sliding.iter().filter_map(|&g| model.groups[g]).min().unwrap() as usize;
    let lb = Loopback::simulated();
    let mut c = cluster(&lb, model, (p, d));
    let mut rng = StdRng::seed_from_u64(seed);
    let shared = prompt(seed, 6 * BS);
    let mut served = Vec::new();
    let mut first_wave = Vec::new();
    for i in 0..WAVE {
        let mut text = if i % 2 == 0 { shared.clone() } else { Vec::new() };
        // The last one long enough for the windows to leave blocks out of its load.
        let len = if i == WAVE - 1 { 8 * BS + 1 } else { edge_len(&mut rng, window) };
        text.extend(prompt(rng.r#gen(), len));
        let rid = id(format!("w0-{i}"));
        submit(&mut c, &rid, text.clone());
        served.push(rid);
        first_wave.push(text);
    }
    c.run_until_idle(LIMIT).unwrap_or_else(|e| panic!("{what}: {e}"));
    for (i, earlier) in first_wave.iter().enumerate() {
        let mut text = if i % 3 == 2 { shared.clone() } else { earlier.clone() };
        text.extend(prompt(rng.r#gen(), rng.gen_range(1..=3 * BS)));
        // Generating past the windows, so the decode engine drops blocks as it goes.
        let rid = id(format!("w1-{i}"));
        c.submit(rid.clone(), text, GENERATED).unwrap_or_else(|e| panic!("{what}: {rid}: {e}"));
        served.push(rid);
    }
    abort_at_both_and_finish(&mut c, &served, seed, &what);
    let (prefill, decode) = (&c.prefills[0], &c.decodes[0]);
    let s = decode.stats();
    assert!(s.tokens_cached > 0, "{what}: the second wave hit the decode engine's prefix cache: {s:?}");
    // Full groups load every position, sliding ones only those their windows need.
    let loaded = &s.group_blocks_loaded;
    let full_loaded = loaded[full[0]];
    assert_eq!(full_loaded, s.tokens_loaded / BS as u64, "{what}: {s:?}");
    assert!(full.iter().all(|&g| loaded[g] == full_loaded), "{what}: {s:?}");
    assert!(sliding.iter().all(|&g| loaded[g] > 0 && loaded[g] < full_loaded), "{what}: {s:?}");
    // Every loaded block of every group, on every decode rank, layer and region.
    let per_block = model.num_layers() as u64 * u64::from(model.kind().regions_per_layer()) * u64::from(d);
    assert_eq!(s.blocks_verified, loaded.iter().sum::<u64>() * per_block, "{what}: {s:?}");
    // The windows moved on both engines: blocks before them went back to the pools.
    assert!(s.blocks_dropped > 0 && prefill.stats().blocks_dropped > 0, "{what}: {s:?}");
    assert_no_hold_expired(prefill, &what);
}

/// [`run_groups`] on every pair of [`PAIRS`], seeds from `seed` on.
fn on_every_pair(model: &ModelSpec, seed: u64) {
    for (i, pair) in PAIRS.into_iter().enumerate() {
        run_groups(model, pair, seed + i as u64);
    }
}

#[test]
fn one_sliding_and_one_full_group_on_every_pair() {
    on_every_pair(&one_sliding_one_full(), 1000);
}

#[test]
fn five_sliding_groups_and_one_full_on_every_pair() {
    on_every_pair(&five_sliding_one_full(), 2000);
}

/// A cluster whose client keeps a copy of every offer the prefill engine makes, and hands the
/// decode engine what `edit` makes of it.
fn with_offers(
    c: Cluster,
    mut edit: impl FnMut(&mut kvx_core::TransferParams) + Send + 'static,
) -> (Cluster, Arc<Mutex<Vec<Vec<GroupBlocks>>>>) {
    let offers = Arc::new(Mutex::new(Vec::new()));
    let seen = offers.clone();
    let c = c.with_client(move |(rid, text, n, mut params)| {
        seen.lock().unwrap().push(params.remote_groups().unwrap());
        edit(&mut params);
        vec![(rid, text, n, params)]
    });
    (c, offers)
}

/// Runs `prompts` through `c` and checks that each was computed on the decode engine, none
/// loaded, and nothing leaked.
fn computed_locally(c: &mut Cluster, prompts: &[(RequestId, Vec<u32>)], what: &str) {
    for (rid, text) in prompts {
        submit(c, rid, text.clone());
    }
    c.run_until_idle(LIMIT).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_clean(c);
    let decode = &c.decodes[0];
    for (rid, _) in prompts {
        assert_state(decode, rid, RequestState::Finished(FinishReason::LengthCapped), what);
    }
    let s = decode.stats();
    assert_eq!((s.tokens_loaded, s.blocks_verified), (0, 0), "{what}: {s:?}");
    assert!(decode.worker_stats().iter().all(|w| w.reads_posted == 0), "{what}");
}

/// A prompt of 5 blocks less one token: the prefill engine, with 79 tokens computed, keeps its
/// 3-block window from block 2 on (token 32), but a decode engine that loads the 4 full blocks
/// computes token 64 next, whose window starts in block 1 (token 17). The offer lacks a block the
/// window needs, so the decode engine computes the prompt itself rather than load a window with a
/// hole. The same prompt one token shorter loads.
#[test]
fn a_window_block_the_prefill_engine_dropped_is_computed_locally() {
    let model = one_sliding_one_full();
    for (p, d) in [(1, 1), (2, 1), (1, 2)] {
        let what = format!("P={p} D={d}");
        let lb = Loopback::simulated();
        let (mut c, offers) = with_offers(cluster(&lb, &model, (p, d)), |_| {});
        let text = prompt(7, 5 * BS - 1);
        computed_locally(&mut c, &[(id("dropped"), text.clone())], &what);
        assert_no_hold_expired(&c.prefills[0], &what);
        let offer = offers.lock().unwrap().pop().unwrap();
        assert_eq!(
            offer,
            [GroupBlocks::new(2, offer[0].ids.clone()), GroupBlocks::new(0, offer[1].ids.clone())]
        );
        assert_eq!((offer[0].end(), offer[1].end()), (4, 4), "{what}: {offer:?}");

        let lb = Loopback::simulated();
        let mut c = cluster(&lb, &model, (p, d));
        submit(&mut c, &id("kept"), text[..5 * BS - 2].to_vec());
        c.run_until_idle(LIMIT).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_clean(&c);
        let s = c.decodes[0].stats();
        assert_eq!(
            s.group_blocks_loaded,
            [3, 4],
            "{what}: blocks 1 to 3 of the window, 0 to 3 in full: {s:?}"
        );
    }
}

/// An offer whose KV-cache groups are not the decode engine's (a group missing, or an extra one)
/// is not loaded: the decode engine computes the prompt, and the prefill engine is freed. Between
/// engines whose groups differ (a hybrid prefill engine, a decode engine of one full-attention
/// group) the same: the handshake refuses the other layout, and the release still reaches the
/// prefill engine through the refused peer's agent, so no hold waits for its lease.
#[test]
fn an_offer_with_other_groups_is_computed_locally() {
    let model = one_sliding_one_full();
    let prompts: Vec<_> =
        (0..3).map(|i| (id(format!("r{i}")), prompt(40 + i as u64, 2 * BS + 5 * i))).collect();
    for (drop_last, what) in [(true, "a group missing"), (false, "an extra group")] {
        let lb = Loopback::simulated();
        let (mut c, _) = with_offers(cluster(&lb, &model, (2, 2)), move |params| {
            let groups = params.remote_block_ids.as_mut().unwrap();
            if drop_last {
                groups.pop();
            } else {
                groups.push(groups[1].clone());
            }
            params.kvx_group_first.clear();
        });
        computed_locally(&mut c, &prompts, what);
        assert_no_hold_expired(&c.prefills[0], what);
    }
    let lb = Loopback::simulated();
    let one_group = ModelSpec::standard(2, 4, 8, BS as u32).with_layout(HeadLayout::Hnd);
    let mut c = lb.cluster_of(vec![engine(&lb, "prefill", &model, 1)], engine(&lb, "decode", &one_group, 1));
    computed_locally(&mut c, &prompts, "engines with other groups");
    assert_no_hold_expired(&c.prefills[0], "engines with other groups");
}

/// vLLM's hybrid prefix-hit rule on the decode engine (3-block window, 16-token blocks): after a
/// 10-block prompt `a` was loaded (the full group's blocks 0 to 9, the sliding group's 7 to 9
/// only), a prompt sharing its first 6 blocks hits nothing, since a hit of h blocks needs the
/// sliding group's blocks of the window before h too (blocks 3 to 5 for 6), which were never
/// loaded; a longer prompt of `a` hits all 10 blocks, the sliding group taking only blocks 7 to 9,
/// and loads its 11th.
#[test]
fn a_prefix_hit_needs_the_sliding_groups_window_too() {
    let model = one_sliding_one_full();
    let lb = Loopback::simulated();
    let mut c = cluster(&lb, &model, (1, 1));
    let a = prompt(11, 10 * BS);
    let shares_prefix = [&a[..6 * BS], &prompt(12, 2 * BS + 8)].concat();
    let extends = [&a[..], &prompt(13, BS + 4)].concat();
    let mut cached = Vec::new();
    for (name, text) in [("a", a.clone()), ("shares-prefix", shares_prefix), ("extends", extends)] {
        submit(&mut c, &id(name), text);
        c.run_until_idle(LIMIT).unwrap();
        cached.push(c.decodes[0].stats().tokens_cached);
    }
    assert_clean(&c);
    assert_eq!(cached, [0, 0, 10 * BS as u64], "{:?}", c.decodes[0].stats());
    // Sliding / full: `a` 3 / 10, the second (8 full blocks) 3 / 8, the third block 10 only.
    assert_eq!(c.decodes[0].stats().group_blocks_loaded, [3 + 3 + 1, 10 + 8 + 1]);
}

/// A load that fails, where the policy is to compute instead, is computed into the request's
/// blocks of both groups on the decode engine (the sliding group's only from the window the load
/// would have needed on, its first 4 of 7 blocks never allocated), and cached per group: a longer
/// prompt of it then hits 7 blocks in both groups and loads only the 8th.
#[test]
fn a_failed_load_is_computed_into_both_groups() {
    let model = one_sliding_one_full();
    let lb = Loopback::simulated();
    let config =
        EngineConfig { tp: 1, load_failure: LoadFailurePolicy::Recompute, ..lb.config("decode", &model) };
    let mut c = lb.cluster_of(vec![engine(&lb, "prefill", &model, 1)], lb.engine(config));
    lb.agent("decode", 0).set_faults(Faults::none().fail_nth_transfer(1)).unwrap();
    let a = prompt(21, 7 * BS + 3);
    submit(&mut c, &id("failed"), a.clone());
    c.run_until_idle(LIMIT).unwrap();
    submit(&mut c, &id("extends"), [&a[..], &prompt(22, BS)].concat());
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    let decode = &c.decodes[0];
    for rid in ["failed", "extends"] {
        assert_state(decode, &id(rid), RequestState::Finished(FinishReason::LengthCapped), rid);
    }
    let s = decode.stats();
    assert_eq!((s.recomputed, s.tokens_cached, s.tokens_loaded), (1, 7 * BS as u64, BS as u64), "{s:?}");
    assert_eq!(s.group_blocks_loaded, [1, 1], "{s:?}");
    assert_no_hold_expired(&c.prefills[0], "failed load");
}

/// An engine takes every group's prefix hits before it allocates any new block: the blocks of a
/// finished prompt `a` wait at the head of a 40-block pool's free queue (a second prompt used the
/// rest), so the sliding group's new blocks of a longer prompt of `a` would otherwise be taken
/// from the full group's hits (the full group's block 3 overwritten with the sliding group's block
/// 4), and the decode engine would receive that block wrong.
#[test]
fn every_groups_hits_are_taken_before_new_blocks_are_allocated() {
    let model = one_sliding_one_full();
    let lb = Loopback::simulated();
    let prefill = lb.engine(EngineConfig { tp: 1, num_blocks: 40, ..lb.config("prefill", &model) });
    let mut c = lb.cluster_of(vec![prefill], engine(&lb, "decode", &model, 1));
    let a = prompt(31, 4 * BS + 1);
    // Computed on the prefill engine alone: 10 blocks, then the other 30.
    for (name, text) in [("a", a.clone()), ("rest", prompt(32, 14 * BS))] {
        c.prefills[0].add_request(id(name), &text, 1, None).unwrap();
        c.run_until_idle(LIMIT).unwrap();
    }
    assert_eq!(c.prefills[0].stats().tokens_cached, 0);
    submit(&mut c, &id("b"), [&a[..4 * BS], &prompt(33, 2 * BS + 4)].concat());
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_eq!(c.prefills[0].stats().tokens_cached, 4 * BS as u64, "b hit a's 4 blocks in both groups");
    // The sliding group's 3-block window before block 6, the full group's blocks 0 to 5.
    assert_eq!(c.decodes[0].stats().group_blocks_loaded, [3, 6]);
}
