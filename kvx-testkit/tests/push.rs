//! Push mode on the loopback backend, in simulated time: the router sends both legs of a request
//! at once, the decode engine registers the blocks it allocated with the prefill engine, and the
//! prefill engine WRITEs into them once it has computed the prompt. Every pair of TP sizes of
//! the heterogeneous suite, with split and replicated heads, MLA and hybrid windows: every byte
//! each decode rank receives is checked, nothing leaks in either pool, no READ is posted.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvx_core::{ErrorKind, FinishReason, TransferMode, TransferParams};
use kvx_testkit::chaos::Faults;
use kvx_testkit::matrix::{assert_failed, step_until};
use kvx_testkit::sim::{Cluster, EngineConfig, HeadLayout, LoadFailurePolicy, ModelSpec, RequestState};
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

/// A push cluster of TP 2 engines in simulated time, the decode engine under `policy`.
fn push_cluster(lb: &Loopback, policy: LoadFailurePolicy) -> Cluster {
    let m = model();
    let prefill = lb.engine(lb.config("prefill", &m));
    let decode = lb.engine(EngineConfig { load_failure: policy, ..lb.config("decode", &m) });
    lb.cluster_of(vec![prefill], decode).with_mode(TransferMode::Push)
}

/// Simulated time since the cluster started.
fn elapsed(lb: &Loopback) -> Duration {
    lb.time.as_ref().unwrap().clock().elapsed()
}

/// A WRITE that fails reaches its decode engine at once, as that request's failure: not after
/// the registration's wait or the lease. The requests before and after it are pushed whole.
#[test]
fn a_failed_write_fails_exactly_that_request_at_once() {
    let lb = Loopback::simulated();
    let mut c = push_cluster(&lb, LoadFailurePolicy::Fail);
    submit(&mut c, &id("before"), prompt(1, 3 * BS));
    c.run_until_idle(LIMIT).unwrap();
    lb.agent("prefill", 1).set_faults(Faults::none().fail_nth_transfer(1)).unwrap();
    let start = elapsed(&lb);
    submit(&mut c, &id("victim"), prompt(2, 3 * BS));
    c.run_until_idle(LIMIT).unwrap();
    let e = assert_failed(&c.decodes[0], &id("victim"), &[ErrorKind::Transfer]);
    assert!(e.message().contains("did not write") && e.message().contains("injected"), "{e}");
    let took = elapsed(&lb) - start;
    assert!(took < Duration::from_secs(1), "failed at once, not after a wait: {took:?}");
    submit(&mut c, &id("after"), prompt(3, 3 * BS));
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    for rid in ["before", "after"] {
        assert_state(&c.decodes[0], &id(rid), RequestState::Finished(FinishReason::LengthCapped), rid);
    }
    assert_no_hold_expired(&c.prefills[0], "a failed WRITE ends its hold");
    let pw = c.prefills[0].worker_stats();
    assert_eq!(pw.iter().map(|w| (w.writes_failed, w.push_refusals)).collect::<Vec<_>>(), [(0, 0), (1, 1)]);
}

/// Under the recompute policy the request whose WRITE failed computes its prompt locally.
#[test]
fn a_failed_write_recomputes_under_the_recompute_policy() {
    let lb = Loopback::simulated();
    let mut c = push_cluster(&lb, LoadFailurePolicy::Recompute);
    lb.agent("prefill", 0).set_faults(Faults::none().fail_nth_transfer(1)).unwrap();
    submit(&mut c, &id("victim"), prompt(2, 3 * BS));
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_state(
        &c.decodes[0],
        &id("victim"),
        RequestState::Finished(FinishReason::LengthCapped),
        "recomputed",
    );
    assert_eq!(c.decodes[0].stats().recomputed, 1);
}

/// A request aborted at its prefill engine keeps no blocks there: the registration is refused at
/// once and the decode leg fails (or recomputes), without waiting for anything.
#[test]
fn a_request_aborted_at_the_prefill_engine_fails_its_decode_leg_at_once() {
    for policy in [LoadFailurePolicy::Fail, LoadFailurePolicy::Recompute] {
        let lb = Loopback::simulated();
        let mut c = push_cluster(&lb, policy);
        let rid = id("aborted-at-prefill");
        submit(&mut c, &rid, prompt(4, 3 * BS));
        c.prefills[0].abort(&rid);
        c.run_until_idle(LIMIT).unwrap();
        assert_clean(&c);
        assert!(elapsed(&lb) < Duration::from_secs(1), "{policy:?}: {:?}", elapsed(&lb));
        match policy {
            LoadFailurePolicy::Fail => {
                let e = assert_failed(&c.decodes[0], &rid, &[ErrorKind::Transfer]);
                assert!(e.message().contains("kept no blocks"), "{e}");
            }
            LoadFailurePolicy::Recompute => assert_state(
                &c.decodes[0],
                &rid,
                RequestState::Finished(FinishReason::LengthCapped),
                "recomputed",
            ),
        }
    }
}

/// A request aborted at its decode engine while it waits for the WRITE keeps its blocks until
/// the WRITE landed: nothing is written into freed blocks, and both pools end whole.
#[test]
fn an_abort_at_the_decode_engine_keeps_its_blocks_until_the_write_lands() {
    let lb = Loopback::simulated();
    let mut c = push_cluster(&lb, LoadFailurePolicy::Fail);
    let rid = id("aborted-at-decode");
    submit(&mut c, &rid, prompt(5, 4 * BS));
    step_until(&mut c, "registered", |c| c.decodes[0].workers().all(|w| w.num_in_flight() == 1));
    c.decodes[0].abort(&rid);
    assert_eq!(c.decodes[0].pool().num_in_flight(), 4, "its blocks wait for the WRITE");
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_state(&c.decodes[0], &rid, RequestState::Finished(FinishReason::Aborted), "aborted");
    assert!(c.prefills[0].worker_stats().iter().all(|w| w.writes_posted == 1 && w.expired_holds == 0));
}

/// Engines under one deployment key push as without one: each registration carries a MAC the
/// prefill workers check.
#[test]
fn authenticated_engines_push() {
    let lb = Loopback::simulated();
    let m = model();
    let key = Some(kvx_core::AuthKey::new("a deployment's shared secret").unwrap());
    let prefill = lb.engine(EngineConfig { auth_key: key.clone(), ..lb.config("prefill", &m) });
    let decode = lb.engine(EngineConfig { auth_key: key, ..lb.config("decode", &m) });
    let mut c = lb.cluster_of(vec![prefill], decode).with_mode(TransferMode::Push);
    submit(&mut c, &id("signed"), prompt(6, 3 * BS));
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_state(&c.decodes[0], &id("signed"), RequestState::Finished(FinishReason::LengthCapped), "signed");
    assert!(
        c.prefills[0].worker_stats().iter().all(|w| w.writes_posted == 1 && w.rejected_notifications == 0)
    );
}

/// A decode engine told to push to a prefill engine that holds the request for a pull (two
/// routers that disagree) fails at once with an error that says so; the prefill engine's hold
/// ends by its lease.
#[test]
fn a_push_to_a_pull_hold_fails_at_once_and_says_why() {
    let lb = Loopback::default();
    let m = model();
    let short = Duration::from_millis(300);
    let mut prefill = lb.engine(EngineConfig { lease_duration: short, ..lb.config("prefill", &m) });
    let mut decode = lb.engine(lb.config("decode", &m));
    let rid = id("modes-differ");
    let tokens = prompt(7, 3 * BS);
    let pull = TransferParams { do_remote_decode: true, ..Default::default() };
    prefill.add_request(rid.clone(), &tokens, 1, Some(pull)).unwrap();
    let push = TransferParams::for_push(prefill.coordinates().clone(), rid.clone(), Some(2));
    decode.add_request(rid.clone(), &tokens, 2, Some(push)).unwrap();
    let deadline = Instant::now() + LIMIT;
    while !(prefill.is_idle() && decode.is_idle()) {
        assert!(Instant::now() < deadline, "not idle: {prefill:?} {decode:?}");
        prefill.step().unwrap();
        prefill.take_transfer_params();
        decode.step().unwrap();
        std::thread::yield_now();
    }
    let e = assert_failed(&decode, &rid, &[ErrorKind::Transfer]);
    assert!(e.message().contains("the modes differ"), "{e}");
    for engine in [&prefill, &decode] {
        assert!(engine.pool().is_whole() && engine.errors().is_empty(), "{engine:?}");
    }
}

/// A lost registration (the decode side's first notification) or a lost WRITE notification (the
/// prefill side's): the registration is sent again a tenth of the confirmation wait later and
/// answered again, so the request finishes after a second, not after the registration's wait.
#[test]
fn a_lost_registration_or_result_costs_a_resend_not_the_wait() {
    for (engine, what) in [("decode", "registration"), ("prefill", "WRITE notification")] {
        let lb = Loopback::simulated();
        let mut c = push_cluster(&lb, LoadFailurePolicy::Fail);
        lb.agent(engine, 0).set_faults(Faults::none().drop_nth_notification(1)).unwrap();
        submit(&mut c, &id("r"), prompt(8, 3 * BS));
        c.run_until_idle(LIMIT).unwrap();
        assert_clean(&c);
        assert_state(&c.decodes[0], &id("r"), RequestState::Finished(FinishReason::LengthCapped), what);
        let took = elapsed(&lb);
        assert!(took < Duration::from_secs(3), "{what} lost: took {took:?}");
        assert!(c.decodes[0].worker_stats()[0].push_resends >= 1, "{what}");
    }
}
