//! xPyD on the loopback backend, in simulated time: several prefill and several decode engines
//! behind the cluster's router (least outstanding requests, ties round robin). Every request
//! ends, every loaded byte is checked, every pool is whole again, the router's counts of
//! outstanding requests are exact at every step, and the load spreads over every engine.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

mod common;

use common::*;
use kvx_core::{ErrorKind, FinishReason, RequestId};
use kvx_testkit::chaos::Faults;
use kvx_testkit::matrix::assert_failed;
use kvx_testkit::sim::{Cluster, EngineConfig, EngineStats, RequestState, SimEngine};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `p` prefill engines `prefill-{i}` and `d` decode engines `decode-{j}`, TP=2, seeded, in
/// simulated time.
fn xpyd(lb: &Loopback, p: usize, d: usize) -> Cluster {
    let m = model();
    let engine = |id: String, seed: u64| lb.engine(EngineConfig { seed: Some(seed), ..lb.config(&id, &m) });
    let prefills = (0..p).map(|i| engine(format!("prefill-{i}"), i as u64)).collect();
    let decodes = (0..d).map(|j| engine(format!("decode-{j}"), 100 + j as u64)).collect();
    let c = Cluster::xpyd(prefills, decodes).unwrap();
    c.with_sim_time(lb.time.clone().unwrap()).unwrap()
}

fn is_live(state: Option<&RequestState>) -> bool {
    matches!(state, Some(RequestState::Waiting | RequestState::WaitingForRemoteKv | RequestState::Running))
}

/// The router's counts against the engines' own view of `ids`: a request is outstanding at the
/// engine where it is still live.
fn assert_outstanding_exact(c: &Cluster, ids: &[RequestId]) {
    let live = |engines: &[SimEngine]| -> Vec<usize> {
        engines.iter().map(|e| ids.iter().filter(|id| is_live(e.state(id))).count()).collect()
    };
    assert_eq!(c.prefill_outstanding(), live(&c.prefills), "prefill outstanding");
    assert_eq!(c.decode_outstanding(), live(&c.decodes), "decode outstanding");
}

/// Where `id` ended: on the decode engine the router sent it to, or on its prefill engine when it
/// was aborted there before its params came back. It went to one engine of each kind at most.
fn final_state(c: &Cluster, id: &RequestId) -> RequestState {
    let on_prefill: Vec<_> = c.prefills.iter().filter_map(|e| e.state(id)).collect();
    let on_decode: Vec<_> = c.decodes.iter().filter_map(|e| e.state(id)).collect();
    match (&on_prefill[..], &on_decode[..]) {
        ([_], [state]) | ([state], []) => (*state).clone(),
        _ => panic!("{id} is on {} prefill and {} decode engines", on_prefill.len(), on_decode.len()),
    }
}

/// Random prompts over a few shared prefixes (prefix hits on both sides), submitted in bursts while
/// the cluster runs, some aborted at once (on their prefill engine), some a few steps later (on
/// their decode engine); every request ends, finished or aborted, every loaded block is checked,
/// nothing leaks, and every engine serves some. Returns every engine's counters.
fn workload(p: usize, d: usize, seed: u64) -> Vec<EngineStats> {
    let lb = Loopback::simulated();
    let mut c = xpyd(&lb, p, d);
    let mut rng = StdRng::seed_from_u64(seed);
    let bases: Vec<Vec<u32>> = (0..4).map(|i| prompt(seed * 10 + i, 3 * BS)).collect();
    let (mut ids, mut aborted) = (Vec::new(), Vec::new());
    for i in 0..160 {
        let rid = id(format!("r-{i}"));
        let mut p = if rng.gen_bool(0.5) {
            bases[rng.gen_range(0..bases.len())][..rng.gen_range(1..=3) * BS].to_vec()
        } else {
            Vec::new()
        };
        p.extend(prompt(rng.r#gen(), rng.gen_range(1..3 * BS)));
        c.submit(rid.clone(), p, rng.gen_range(1..=6)).unwrap();
        if rng.gen_bool(0.05) {
            c.abort(&rid);
        } else if rng.gen_bool(0.1) {
            aborted.push(rid.clone());
        }
        ids.push(rid);
        if i % 20 == 19 {
            for _ in 0..3 {
                c.step().unwrap();
                assert_outstanding_exact(&c, &ids);
            }
            for rid in aborted.drain(..) {
                c.abort(&rid);
            }
            assert_outstanding_exact(&c, &ids);
        }
    }
    c.run_until_idle_with(LIMIT, |c| assert_outstanding_exact(c, &ids)).unwrap();
    assert_clean(&c);
    assert_eq!(c.prefill_outstanding(), vec![0; p]);
    assert_eq!(c.decode_outstanding(), vec![0; d]);

    let (mut finished, mut aborted_on_prefill, mut aborted_on_decode) = (0, 0, 0);
    for rid in &ids {
        match final_state(&c, rid) {
            RequestState::Finished(FinishReason::LengthCapped) => finished += 1,
            RequestState::Finished(FinishReason::Aborted)
                if c.decodes.iter().any(|e| e.state(rid).is_some()) =>
            {
                aborted_on_decode += 1
            }
            RequestState::Finished(FinishReason::Aborted) => aborted_on_prefill += 1,
            other => panic!("{rid} ended {other:?}"),
        }
    }
    assert!(finished >= ids.len() * 3 / 4, "{finished} of {} finished", ids.len());
    assert!(
        aborted_on_prefill > 0 && aborted_on_decode > 0,
        "{aborted_on_prefill}, {aborted_on_decode} aborted"
    );
    let (mut loaded, mut verified, mut cached) = (0, 0, 0);
    for e in &c.decodes {
        let s = e.stats();
        (loaded, verified, cached) =
            (loaded + s.tokens_loaded, verified + s.blocks_verified, cached + s.tokens_cached);
    }
    // Every loaded block checked on both ranks, K and V, every layer.
    let m = model();
    let per_block = m.num_layers() as u64 * u64::from(m.kind().regions_per_layer()) * 2;
    assert_eq!(verified, loaded / BS as u64 * per_block);
    assert!(loaded > 0 && cached > 0, "loads and prefix hits: {loaded} loaded, {cached} cached");
    for e in c.engines() {
        assert!(e.stats().finished > 10, "{} served {} requests", e.engine_id(), e.stats().finished);
    }
    c.engines().map(|e| e.stats().clone()).collect()
}

/// 2P2D; the same seed replays the same run, engine by engine.
#[test]
fn two_prefill_two_decode() {
    assert_eq!(workload(2, 2, 1), workload(2, 2, 1));
}

#[test]
fn four_prefill_one_decode() {
    workload(4, 1, 2);
}

#[test]
fn one_prefill_four_decode() {
    workload(1, 4, 3);
}

/// Two requests aborted at prefill-0 leave it with none outstanding and prefill-1 with one: the
/// next request goes to prefill-0 even where round robin would pick prefill-1.
#[test]
fn requests_go_to_the_prefill_engine_with_the_fewest_outstanding_requests() {
    let lb = Loopback::simulated();
    let mut c = xpyd(&lb, 2, 1);
    let ids: Vec<_> = (0..4).map(|i| id(format!("p-{i}"))).collect();
    for rid in &ids[..3] {
        c.submit(rid.clone(), prompt(1, 2 * BS), 2).unwrap();
    }
    let on = |c: &Cluster, p: usize, rid: &RequestId| c.prefills[p].state(rid).is_some();
    assert!(on(&c, 0, &ids[0]) && on(&c, 1, &ids[1]) && on(&c, 0, &ids[2]), "round robin on ties");
    assert_eq!(c.prefill_outstanding(), [2, 1]);
    c.abort(&ids[0]);
    c.abort(&ids[2]);
    assert_eq!(c.prefill_outstanding(), [0, 1], "an abort ends the request at once");
    c.submit(ids[3].clone(), prompt(4, 2 * BS), 2).unwrap();
    assert!(on(&c, 0, &ids[3]), "prefill-0 has the fewest outstanding requests");
    assert_eq!(c.prefill_outstanding(), [1, 1]);
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_eq!((c.prefill_outstanding(), c.decode_outstanding()), (vec![0, 0], vec![0]));
    let finished = Some(&RequestState::Finished(FinishReason::LengthCapped));
    assert!(c.decodes[0].state(&ids[1]) == finished && c.decodes[0].state(&ids[3]) == finished);
    assert!(c.decodes[0].state(&ids[0]).is_none(), "an aborted prefill hands nothing on");
}

/// One long request keeps decode-0 busy: the next requests go to decode-1 even where round robin
/// would pick decode-0.
#[test]
fn params_go_to_the_decode_engine_with_the_fewest_outstanding_requests() {
    let lb = Loopback::simulated();
    let mut c = xpyd(&lb, 1, 2);
    let (long, first, second) = (id("long"), id("first"), id("second"));
    let on = |c: &Cluster, d: usize, rid: &RequestId| c.decodes[d].state(rid).is_some();
    c.submit(long.clone(), prompt(1, 2 * BS), 200).unwrap();
    step_until(&mut c, |c| on(c, 0, &long));
    assert_eq!(c.decode_outstanding(), [1, 0]);

    c.submit(first.clone(), prompt(2, 2 * BS), 2).unwrap();
    step_until(&mut c, |c| on(c, 1, &first));
    assert_eq!(c.decode_outstanding(), [1, 1]);
    step_until(&mut c, |c| !is_live(c.decodes[1].state(&first)));
    assert_eq!(c.decode_outstanding(), [1, 0]);

    // A tie would now go to decode-0 (round robin after decode-1); decode-0 has one outstanding.
    c.submit(second.clone(), prompt(3, 2 * BS), 2).unwrap();
    step_until(&mut c, |c| on(c, 1, &second));
    assert!(is_live(c.decodes[0].state(&long)), "the long request still runs");
    assert_eq!(c.decode_outstanding(), [1, 1]);
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    for (d, rid) in [(0, &long), (1, &first), (1, &second)] {
        assert_eq!(c.decodes[d].state(rid), Some(&RequestState::Finished(FinishReason::LengthCapped)));
    }
    assert_eq!(c.decode_outstanding(), [0, 0]);
}

/// Steps until `done` holds, within a bound of steps (simulated time).
fn step_until(c: &mut Cluster, mut done: impl FnMut(&Cluster) -> bool) {
    for _ in 0..1000 {
        if done(c) {
            return;
        }
        c.step().unwrap();
    }
    panic!("not done after 1000 steps: {c:?}");
}

/// Every READ of decode-1 fails: its requests fail with `Transfer` (the router does not retry
/// them elsewhere), decode-0's finish, and nothing leaks on any engine.
#[test]
fn a_decode_engine_whose_loads_fail_fails_its_requests_typed() {
    let lb = Loopback::simulated();
    let mut c = xpyd(&lb, 2, 2);
    for rank in 0..2 {
        lb.agent("decode-1", rank).set_faults(Faults::none().transfer_failures(1.0)).unwrap();
    }
    let ids: Vec<_> = (0..40).map(|i| id(format!("f-{i}"))).collect();
    for (i, rid) in ids.iter().enumerate() {
        c.submit(rid.clone(), prompt(i as u64, 2 * BS + i), 2).unwrap();
    }
    c.run_until_idle_with(LIMIT, |c| assert_outstanding_exact(c, &ids)).unwrap();
    assert_clean(&c);
    let (mut ok, mut failed) = (0, 0);
    for rid in &ids {
        if c.decodes[0].state(rid).is_some() {
            assert_eq!(c.decodes[0].state(rid), Some(&RequestState::Finished(FinishReason::LengthCapped)));
            ok += 1;
        } else {
            assert_failed(&c.decodes[1], rid, &[ErrorKind::Transfer]);
            failed += 1;
        }
    }
    assert!(ok > 0 && failed > 0, "{ok} finished, {failed} failed");
    assert_eq!(c.decodes[1].stats().blocks_verified, 0);
    assert_eq!(c.decode_outstanding(), [0, 0]);
}
