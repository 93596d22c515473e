//! Push mode on the loopback backend, in simulated time: the router sends both legs of a request
//! at once, the decode engine registers the blocks it allocated with the prefill engine, and the
//! prefill engine WRITEs into them once it has computed the prompt. Every pair of TP sizes of
//! the heterogeneous suite, with split and replicated heads, MLA and hybrid windows: every byte
//! each decode rank receives is checked, nothing leaks in either pool, no READ is posted.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

mod common;

use common::*;
use kvx_core::{FinishReason, TransferMode};
use kvx_testkit::sim::{HeadLayout, ModelSpec, RequestState};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The (prefill, decode) TP pairs.
const PAIRS: [(u32, u32); 7] = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)];

fn split_heads() -> ModelSpec {
    ModelSpec::standard(2, 8, 8, BS as u32).with_layout(HeadLayout::Hnd)
}

/// Random prompts, half behind a shared prefix (so the second wave hits the decode engine's
/// prefix cache and registers only the blocks after it), pushed from a prefill engine of TP `p`
/// to a decode engine of TP `d`.
fn run_pair(model: &ModelSpec, (p, d): (u32, u32), seed: u64) {
    let what = format!("push P={p} D={d} {:?} {:?} windows {:?}", model.shape, model.layout, model.windows);
    let lb = Loopback::simulated();
    let mut c = cluster(&lb, model, (p, d)).with_mode(TransferMode::Push);
    let mut rng = StdRng::seed_from_u64(seed);
    let shared = prompt(seed, 3 * BS);
    let mut served = Vec::new();
    for wave in 0..2 {
        for i in 0..3 {
            let mut tokens = if i % 2 == 0 { shared.clone() } else { Vec::new() };
            tokens.extend(prompt(rng.r#gen(), rng.gen_range(1..=4 * BS)));
            let rid = id(format!("w{wave}-{i}"));
            submit(&mut c, &rid, tokens);
            served.push(rid);
        }
        c.run_until_idle(LIMIT).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    assert_clean(&c);
    let (prefill, decode) = (&c.prefills[0], &c.decodes[0]);
    for rid in &served {
        assert_state(decode, rid, RequestState::Finished(FinishReason::LengthCapped), &what);
    }
    let s = decode.stats();
    assert_eq!((s.finished, s.failed, s.blocks_mismatched), (served.len() as u64, 0, 0), "{what}: {s:?}");
    assert!(s.tokens_loaded > 0 && s.blocks_verified > 0, "{what}: {s:?}");
    assert!(s.tokens_cached >= 3 * BS as u64, "{what}: the second wave hit the shared prefix: {s:?}");
    assert_no_hold_expired(prefill, &what);
    let (dw, pw) = (decode.worker_stats(), prefill.worker_stats());
    assert!(dw.iter().all(|w| w.reads_posted == 0 && w.push_registrations > 0), "{what}: {dw:?}");
    // A prefill rank whose heads every reader takes from a replica only frees its hold.
    assert!(pw.iter().map(|w| w.writes_posted).sum::<u64>() > 0, "{what}");
    assert!(pw.iter().all(|w| w.writes_failed == 0), "{what}: {pw:?}");
    assert_eq!(pw.iter().map(|w| w.push_refusals).sum::<u64>(), 0, "{what}");
}

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
    on_every_pair(&ModelSpec::standard(2, 2, 8, BS as u32).with_layout(HeadLayout::Hnd), 200);
}

#[test]
fn mla_on_every_pair() {
    on_every_pair(&ModelSpec::mla(2, 32, BS as u32), 300);
}

#[test]
fn hybrid_windows_on_every_pair() {
    let model = split_heads().with_windows(vec![None, Some(1)]);
    on_every_pair(&model, 400);
}
