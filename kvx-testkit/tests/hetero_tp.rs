//! Engines of different tensor-parallel sizes on the loopback backend, in simulated time: a
//! prefill engine of TP `P` and a decode engine of TP `D` for every pair of (1,2), (2,1), (2,4),
//! (4,2), (1,4) and (4,1), with standard attention (head-major, split heads), replicated heads
//! (more ranks than KV heads), MLA, and a hybrid model whose layers mix global attention and
//! windows, and TP sizes that do not divide each other (2 and 3, 6 heads). Each runs random
//! prompts with prefix hits on the decode side and aborts at both engines; every byte each decode
//! rank receives is checked against what that rank (of its own TP size) must hold, nothing leaks
//! in either pool and every request ends. A READ failing on one of several readers fails its
//! request and still frees the prefill blocks; prefill engines of two TP sizes feed one decode
//! engine. Pairings kvx cannot serve (a token-major cache that would need slicing, another head
//! size) fail every request at once with `Incompatible`, refused at the handshake.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

mod common;

use common::*;
use kvx_core::{ErrorKind, FinishReason};
use kvx_testkit::chaos::Faults;
use kvx_testkit::matrix::{assert_failed, step_until};
use kvx_testkit::sim::{EngineConfig, HeadLayout, ModelSpec, RequestState};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The (prefill, decode) TP pairs.
const PAIRS: [(u32, u32); 6] = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)];

/// Standard attention, head-major: 8 KV heads of 8 elements, split over up to 4 ranks.
fn split_heads() -> ModelSpec {
    ModelSpec::standard(2, 8, 8, BS as u32).with_layout(HeadLayout::Hnd)
}

/// 2 KV heads: on 4 ranks each head is held by two ranks.
fn replicated_heads() -> ModelSpec {
    ModelSpec::standard(2, 2, 8, BS as u32).with_layout(HeadLayout::Hnd)
}

/// Global-attention layers between windowed ones (1 and 2 blocks).
fn hybrid() -> ModelSpec {
    ModelSpec::standard(4, 4, 8, BS as u32).with_layout(HeadLayout::Hnd).with_windows(vec![
        None,
        Some(1),
        None,
        Some(2),
    ])
}

/// Blocks a decode engine of TP `d` checks when it loaded `tokens` tokens of `model` (no windows):
/// every block on every rank, layer and region.
fn verified(model: &ModelSpec, d: u32, tokens: u64) -> u64 {
    let regions = u64::from(model.kind().regions_per_layer());
    tokens / BS as u64 * model.num_layers() as u64 * regions * u64::from(d)
}

/// The workload on a prefill engine of TP `p` and a decode engine of TP `d`: two waves of random
/// prompts (half of them behind a shared 3-block prefix, so the second wave hits the decode
/// engine's prefix cache), a request aborted at the prefill engine before it ran, and one aborted
/// at the decode engine while it waits for its KV.
fn run_pair(model: &ModelSpec, (p, d): (u32, u32), seed: u64) {
    let what = format!("P={p} D={d} {:?} {:?} windows {:?}", model.shape, model.layout, model.windows);
    let lb = Loopback::simulated();
    let mut c = cluster(&lb, model, (p, d));
    let mut rng = StdRng::seed_from_u64(seed);
    let shared = prompt(seed, 3 * BS);
    let mut random_prompt = |i: usize| {
        let mut out = if i % 2 == 0 { shared.clone() } else { Vec::new() };
        out.extend(prompt(rng.r#gen(), rng.gen_range(1..=4 * BS)));
        out
    };
    let mut served = Vec::new();
    for wave in 0..2 {
        for i in 0..3 {
            let rid = id(format!("w{wave}-{i}"));
            submit(&mut c, &rid, random_prompt(i));
            served.push(rid);
        }
        if wave == 0 {
            c.run_until_idle(LIMIT).unwrap_or_else(|e| panic!("{what}: {e}"));
            for rid in &served {
                assert_state(&c.decodes[0], rid, RequestState::Finished(FinishReason::LengthCapped), &what);
            }
        }
    }
    abort_at_both_and_finish(&mut c, &served, seed, &what);
    let (prefill, decode) = (&c.prefills[0], &c.decodes[0]);
    let s = decode.stats();
    assert!(s.tokens_cached >= 3 * BS as u64, "{what}: the second wave hit the shared prefix: {s:?}");
    // Every loaded block was checked on every decode rank, in every layer within its window.
    let regions = u64::from(model.kind().regions_per_layer());
    let loaded = s.tokens_loaded / BS as u64;
    let global = model.windows.iter().filter(|w| w.is_none()).count() as u64;
    let per_block = regions * u64::from(d);
    assert!(loaded > 0, "{what}: {s:?}");
    if global == model.num_layers() as u64 {
        assert_eq!(s.blocks_verified, verified(model, d, s.tokens_loaded), "{what}: {s:?}");
    } else {
        let windowed = model.num_layers() as u64 - global;
        assert!(s.blocks_verified >= loaded * global * per_block + windowed * per_block, "{what}: {s:?}");
        assert!(s.blocks_verified < loaded * model.num_layers() as u64 * per_block, "{what}: {s:?}");
    }
    assert_no_hold_expired(prefill, &what);
    assert_eq!(prefill.worker_stats().len(), p as usize);
}

/// [`run_pair`] on every pair of [`PAIRS`], seeds from `seed` on.
fn on_every_pair(model: &ModelSpec, seed: u64) {
    for (i, pair) in PAIRS.into_iter().enumerate() {
        run_pair(model, pair, seed + i as u64);
    }
}

#[test]
fn split_heads_on_every_pair() {
    on_every_pair(&split_heads(), 100);
}

#[test]
fn replicated_heads_on_every_pair() {
    on_every_pair(&replicated_heads(), 200);
}

#[test]
fn mla_on_every_pair() {
    on_every_pair(&ModelSpec::mla(2, 32, BS as u32), 300);
}

#[test]
fn hybrid_windows_on_every_pair() {
    on_every_pair(&hybrid(), 400);
}

/// Equal TP sizes stay as they were in either layout (a token-major cache needs no slicing).
#[test]
fn equal_sizes_in_both_layouts() {
    run_pair(&split_heads().with_layout(HeadLayout::Nhd), (2, 2), 500);
    run_pair(&split_heads(), (4, 4), 501);
}

/// A pairing kvx cannot serve: every request fails with `Incompatible` from the handshake, long
/// before the handshake timeout (in simulated time), with no READ posted; nothing leaks.
fn refused(prefill: &ModelSpec, decode: &ModelSpec, (p, d): (u32, u32)) {
    let what = format!("P={p} D={d} {:?} {:?} to {:?}", prefill.shape, prefill.layout, decode.shape);
    let lb = Loopback::simulated();
    let prefill = lb.engine(EngineConfig { tp: p, ..lb.config("prefill", prefill) });
    let decode = lb.engine(EngineConfig { tp: d, ..lb.config("decode", decode) });
    let mut c = lb.cluster_of(vec![prefill], decode);
    let ids: Vec<_> = (0..3).map(|i| id(format!("refused-{i}"))).collect();
    for (i, rid) in ids.iter().enumerate() {
        submit(&mut c, rid, prompt(600 + i as u64, 2 * BS + i));
    }
    let clock = lb.time.as_ref().unwrap().clock().clone();
    step_until(&mut c, &format!("{what}: every request ends"), |c| {
        ids.iter().all(|rid| {
            matches!(c.decodes[0].state(rid), Some(RequestState::Finished(_) | RequestState::Failed(_)))
        })
    });
    let handshake_timeout = c.decodes[0].config().handshake_timeout;
    assert!(
        clock.elapsed() < handshake_timeout / 5,
        "{what}: failed after {:?}, not at once",
        clock.elapsed()
    );
    for rid in &ids {
        let e = assert_failed(&c.decodes[0], rid, &[ErrorKind::Incompatible]);
        assert!(!e.message().contains("timed out"), "{what}: {e}");
    }
    assert!(c.decodes[0].worker_stats().iter().all(|w| w.reads_posted == 0), "{what}");
    c.run_until_idle(LIMIT).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_clean(&c);
    assert_eq!(c.decodes[0].stats().blocks_verified, 0);
}

#[test]
fn a_token_major_cache_that_needs_slicing_is_refused() {
    let nhd = split_heads().with_layout(HeadLayout::Nhd);
    refused(&nhd, &nhd, (1, 2));
    refused(&nhd, &nhd, (4, 2));
}

#[test]
fn another_head_size_is_refused() {
    let other = ModelSpec::standard(2, 8, 16, BS as u32).with_layout(HeadLayout::Hnd);
    refused(&split_heads(), &other, (1, 2));
    refused(&split_heads(), &other, (2, 1));
}

/// TP sizes that do not divide each other: a decode rank's heads lie on two prefill ranks, or two
/// decode ranks share a prefill rank's heads unevenly.
#[test]
fn tp_sizes_that_do_not_divide_each_other() {
    let six = ModelSpec::standard(2, 6, 8, BS as u32).with_layout(HeadLayout::Hnd);
    run_pair(&six, (2, 3), 700);
    run_pair(&six, (3, 2), 701);
}

/// A READ that fails on one decode rank fails the request with `Transfer`, and the prefill ranks
/// it read from are still freed by the failed reader (no hold waits for its lease): with one
/// prefill rank read by two decode ranks, one decode rank reading two prefill ranks, and two of
/// each. The next request succeeds.
#[test]
fn a_failed_read_fails_the_request_and_still_frees_the_prefill_blocks() {
    for ((p, d), failing) in [((1, 2), 1), ((2, 1), 0), ((4, 2), 1)] {
        let what = format!("P={p} D={d}, decode rank {failing} fails its first READ");
        let lb = Loopback::simulated();
        let mut c = cluster(&lb, &split_heads(), (p, d));
        lb.agent("decode", failing).set_faults(Faults::none().fail_nth_transfer(1)).unwrap();
        let (victim, after) = (id("victim"), id("after"));
        submit(&mut c, &victim, prompt(800, 3 * BS + 2));
        c.run_until_idle(LIMIT).unwrap_or_else(|e| panic!("{what}: {e}"));
        let e = assert_failed(&c.decodes[0], &victim, &[ErrorKind::Transfer]);
        assert!(e.message().contains("injected"), "{what}: {e}");
        submit(&mut c, &after, prompt(801, 3 * BS + 2));
        c.run_until_idle(LIMIT).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_state(&c.decodes[0], &after, RequestState::Finished(FinishReason::LengthCapped), &what);
        assert_clean(&c);
        assert_eq!(
            c.decodes[0].stats().blocks_verified,
            verified(&split_heads(), d, 3 * BS as u64),
            "{what}"
        );
        assert_no_hold_expired(&c.prefills[0], &what);
    }
}

/// Prefill engines of TP 1 and TP 4 feed one decode engine of TP 2: its workers read from peers
/// of both sizes side by side.
#[test]
fn prefill_engines_of_different_tp_sizes_feed_one_decode_engine() {
    let (lb, m) = (Loopback::simulated(), split_heads());
    let prefills = vec![engine(&lb, "prefill-1", &m, 1), engine(&lb, "prefill-4", &m, 4)];
    let mut c = lb.cluster_of(prefills, engine(&lb, "decode", &m, 2));
    let ids: Vec<_> = (0..8).map(|i| id(format!("mixed-{i}"))).collect();
    for (i, rid) in ids.iter().enumerate() {
        submit(&mut c, rid, prompt(900 + i as u64, 2 * BS + i));
    }
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    for rid in &ids {
        assert_state(&c.decodes[0], rid, RequestState::Finished(FinishReason::LengthCapped), "mixed");
    }
    assert!(c.prefills.iter().all(|p| p.stats().finished == 4), "requests split evenly");
    assert_eq!(c.decodes[0].stats().blocks_verified, verified(&m, 2, 8 * 2 * BS as u64));
    for prefill in &c.prefills {
        assert_no_hold_expired(prefill, "mixed");
    }
}
