//! End-to-end disaggregated serving on the loopback backend: prefill and decode [`SimEngine`]s
//! with TP=2, every transferred byte checked, and at the end every block pool whole again and
//! every scheduler and worker idle.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvx_core::{ErrorKind, FinishReason, RequestId};
use kvx_testkit::chaos::Faults;
use kvx_testkit::matrix::assert_failed;
use kvx_testkit::sim::{Cluster, EngineConfig, ModelSpec, RequestState, SideChannel, SimEngine};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Blocks checked for a load of `loaded` blocks, per rank and region, over windowed layers.
fn expected_verified(model: &ModelSpec, tp: u64, loaded: u64) -> u64 {
    let regions = u64::from(model.kind().regions_per_layer());
    let per_layer = model.windows.iter().map(|w| w.map_or(loaded, |w| loaded.min(u64::from(w))));
    per_layer.sum::<u64>() * regions * tp
}

fn assert_finished(e: &SimEngine, ids: &[RequestId]) {
    for id in ids {
        assert_eq!(e.state(id), Some(&RequestState::Finished(FinishReason::LengthCapped)), "{id}");
    }
}

#[test]
fn prompts_shorter_than_a_block_transfer_nothing() {
    let lb = Loopback::default();
    let mut c = lb.cluster(&model());
    let ids: Vec<_> = [1, 5, 15].iter().map(|&n| id(format!("short-{n}"))).collect();
    for (i, n) in [1, 5, 15].into_iter().enumerate() {
        c.submit(ids[i].clone(), prompt(n as u64, n), 3).unwrap();
    }
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_finished(&c.decodes[0], &ids);
    assert_eq!(c.decodes[0].stats().tokens_loaded, 0);
    assert_eq!(c.decodes[0].stats().blocks_verified, 0);
    assert!(c.decodes[0].worker_stats().iter().all(|w| w.reads_posted == 0));
    assert_eq!(c.decodes[0].output_tokens(&ids[0]).unwrap().len(), 3);
}

#[test]
fn prompts_of_exact_block_multiples_load_every_block() {
    let lb = Loopback::default();
    let m = model();
    let mut c = lb.cluster(&m);
    let lens = [BS, 2 * BS, 4 * BS];
    let ids: Vec<_> = lens.iter().map(|n| id(format!("exact-{n}"))).collect();
    for (i, &n) in lens.iter().enumerate() {
        c.submit(ids[i].clone(), prompt(100 + i as u64, n), 2).unwrap();
    }
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_finished(&c.decodes[0], &ids);
    let blocks = (lens.iter().sum::<usize>() / BS) as u64;
    assert_eq!(c.decodes[0].stats().tokens_loaded, blocks * BS as u64);
    assert_eq!(c.decodes[0].stats().blocks_verified, expected_verified(&m, 2, 1) * blocks);
    for w in c.decodes[0].worker_stats() {
        assert_eq!((w.reads_posted, w.handshakes, w.failed_loads), (3, 1, 0));
    }
}

#[test]
fn partial_and_full_prefix_hits_on_the_decode_side() {
    let lb = Loopback::default();
    let m = model();
    let mut c = lb.cluster(&m);
    let base = prompt(7, 4 * BS);
    c.submit(id("a"), base.clone(), 2).unwrap();
    c.run_until_idle(LIMIT).unwrap();
    assert_eq!(c.decodes[0].stats().tokens_loaded, 4 * BS as u64);

    // Partial hit: 2 blocks cached, the next 2 full blocks loaded, the tail computed.
    let mut partial = base[..2 * BS].to_vec();
    partial.extend(prompt(8, 2 * BS + 5));
    c.submit(id("b"), partial, 2).unwrap();
    c.run_until_idle(LIMIT).unwrap();
    assert_eq!(c.decodes[0].stats().tokens_cached, 2 * BS as u64);
    assert_eq!(c.decodes[0].stats().tokens_loaded, (4 + 2) * BS as u64);

    // Full hit: every full block cached; only the prefill engine is told to free.
    let mut full = base.clone();
    full.extend([1, 2]);
    c.submit(id("c"), full, 2).unwrap();
    c.run_until_idle(LIMIT).unwrap();
    assert_eq!(c.decodes[0].stats().tokens_cached, (2 + 4) * BS as u64);
    assert_eq!(c.decodes[0].stats().tokens_loaded, 6 * BS as u64, "nothing loaded");
    assert!(c.decodes[0].worker_stats().iter().all(|w| w.notify_only == 1));

    // The same exact-multiple prompt again: the last block is loaded, so one token is computed.
    c.submit(id("d"), base, 2).unwrap();
    c.run_until_idle(LIMIT).unwrap();
    assert_eq!(c.decodes[0].stats().tokens_loaded, 7 * BS as u64);
    assert_clean(&c);
    assert_finished(&c.decodes[0], &[id("a"), id("b"), id("c"), id("d")]);
    assert_eq!(c.decodes[0].stats().blocks_verified, expected_verified(&m, 2, 1) * 7);
}

#[test]
fn mla_layout() {
    let lb = Loopback::default();
    let m = ModelSpec::mla(3, 64, BS as u32);
    let mut c = lb.cluster(&m);
    for (i, n) in [3, BS, 3 * BS + 7].into_iter().enumerate() {
        c.submit(id(format!("mla-{i}")), prompt(i as u64, n), 2).unwrap();
    }
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_eq!(c.decodes[0].stats().blocks_verified, expected_verified(&m, 2, 1) * 4);
    assert_eq!(c.decodes[0].stats().blocks_verified, 3 * 2 * 4, "one region per layer");
}

#[test]
fn chunked_local_attention_layers_transfer_only_their_window() {
    let lb = Loopback::default();
    let m = ModelSpec::standard(3, 4, 8, BS as u32).with_windows(vec![None, Some(1), Some(2)]);
    let mut c = lb.cluster(&m);
    c.submit(id("w"), prompt(3, 5 * BS + 1), 2).unwrap();
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    // Layer 0 reads 5 blocks, layer 1 one, layer 2 two: (5 + 1 + 2) blocks x K,V x 2 ranks.
    assert_eq!(c.decodes[0].stats().blocks_verified, expected_verified(&m, 2, 5));
    assert_eq!(c.decodes[0].stats().blocks_verified, 8 * 2 * 2);
    for w in c.decodes[0].worker_stats() {
        assert_eq!(w.block_descriptors, 8 * 2, "only the window's descriptors are read");
        // The prompt's blocks were allocated together on both sides: one run per region.
        assert_eq!(w.descriptors, 3 * 2, "coalesced: one descriptor per region");
    }
}

#[test]
fn five_hundred_concurrent_requests_of_random_lengths() {
    let lb = Loopback::default();
    let m = model();
    let config = |name| EngineConfig { num_blocks: 4096, ..lb.config(name, &m) };
    let mut c = Cluster::new(vec![lb.engine(config("prefill"))], lb.engine(config("decode"))).unwrap();
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let shared: Vec<Vec<u32>> = (0..4).map(|i| prompt(1000 + i, 3 * BS)).collect();
    let mut ids = Vec::new();
    for i in 0..500 {
        let len = rng.gen_range(1..=12 * BS);
        let mut p = if rng.gen_bool(0.3) { shared[rng.gen_range(0..4)].clone() } else { Vec::new() };
        p.extend(prompt(rng.r#gen(), len));
        let rid = id(format!("r{i}"));
        c.submit(rid.clone(), p, rng.gen_range(1..=4)).unwrap();
        ids.push(rid);
        // Requests arrive while others run, so later ones hit blocks that earlier ones loaded.
        if i % 25 == 24 {
            c.step().unwrap();
        }
    }
    c.run_until_idle(Duration::from_secs(120)).unwrap();
    assert_clean(&c);
    assert_finished(&c.decodes[0], &ids);
    let s = c.decodes[0].stats();
    assert_eq!((s.finished, s.failed), (500, 0));
    assert!(s.blocks_verified > 1000, "{s:?}");
    assert!(s.tokens_cached > 0, "shared prefixes hit the decode engine's cache: {s:?}");
}

#[test]
fn two_prefill_engines_feed_one_decode_engine() {
    let lb = Loopback::default();
    let m = model();
    let prefills = vec![lb.engine(lb.config("prefill-a", &m)), lb.engine(lb.config("prefill-b", &m))];
    let mut c = Cluster::new(prefills, lb.engine(lb.config("decode", &m))).unwrap();
    let ids: Vec<_> = (0..20).map(|i| id(format!("two-{i}"))).collect();
    for (i, rid) in ids.iter().enumerate() {
        c.submit(rid.clone(), prompt(i as u64, 2 * BS + i), 2).unwrap();
    }
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_finished(&c.decodes[0], &ids);
    assert!(c.prefills.iter().all(|p| p.stats().finished == 10));
    for w in c.decodes[0].worker_stats() {
        assert_eq!((w.handshakes, w.reads_posted), (2, 20), "one handshake per prefill engine");
    }
}

#[test]
fn a_failed_transfer_fails_exactly_that_request() {
    let lb = Loopback::default();
    let m = model();
    // The default hold (120 s): the failed load must free the prefill blocks by itself.
    let prefill = lb.engine(lb.config("prefill", &m));
    let mut c = Cluster::new(vec![prefill], lb.engine(lb.config("decode", &m))).unwrap();
    c.submit(id("before"), prompt(1, 3 * BS), 2).unwrap();
    c.run_until_idle(LIMIT).unwrap();

    lb.agent("decode", 1).set_faults(Faults::none().fail_nth_transfer(1)).unwrap();
    c.submit(id("victim"), prompt(2, 3 * BS), 2).unwrap();
    c.run_until_idle(LIMIT).unwrap();
    let e = assert_failed(&c.decodes[0], &id("victim"), &[ErrorKind::Transfer]);
    // Every failed READ is a `Transfer` failure; the message says it is the injected one.
    assert_eq!(e.backend(), Some("loopback"), "{e}");
    assert!(e.message().contains("injected"), "{e}");

    c.submit(id("after"), prompt(3, 3 * BS), 2).unwrap();
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_finished(&c.decodes[0], &[id("before"), id("after")]);
    assert_eq!((c.decodes[0].stats().finished, c.decodes[0].stats().failed), (2, 1));
    // Rank 1's READ failed, and its worker told the prefill engine to free at once: no hold had
    // to expire.
    assert!(c.prefills[0].worker_stats().iter().all(|w| w.expired_holds == 0));
}

#[test]
fn a_refused_handshake_fails_the_waiting_requests() {
    // In simulated time: the holds nobody reads expire by their lease without waiting for it.
    let lb = Loopback::simulated();
    let m = model();
    let prefill =
        lb.engine(EngineConfig { lease_duration: Duration::from_millis(200), ..lb.config("prefill", &m) });
    let mut c = lb.cluster_of(vec![prefill], lb.engine(lb.config("decode", &m)));
    for rank in 0..2 {
        lb.agent("prefill", rank).set_faults(Faults::none().refuse_handshakes()).unwrap();
    }
    let ids: Vec<_> = (0..3).map(|i| id(format!("refused-{i}"))).collect();
    for (i, rid) in ids.iter().enumerate() {
        c.submit(rid.clone(), prompt(i as u64, 2 * BS), 2).unwrap();
    }
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    for rid in &ids {
        assert_failed(&c.decodes[0], rid, &[ErrorKind::Handshake]);
    }
    assert_eq!(c.decodes[0].stats().failed, 3);
    assert!(c.decodes[0].worker_stats().iter().all(|w| w.handshake_failures >= 1 && w.handshakes == 0));
    assert!(c.prefills[0].worker_stats().iter().all(|w| w.expired_holds == 3));
    let elapsed = lb.time.as_ref().unwrap().clock().elapsed();
    assert!(elapsed >= Duration::from_millis(200), "the leases ran out in simulated time: {elapsed:?}");
}

#[test]
fn simulated_time_needs_every_engine_on_its_clock() {
    let (system, simulated) = (Loopback::default(), Loopback::simulated());
    let m = model();
    let prefill = simulated.engine(simulated.config("prefill", &m));
    let decode = system.engine(system.config("decode", &m));
    let e = Cluster::new(vec![prefill], decode).unwrap().with_sim_time(simulated.time.unwrap()).unwrap_err();
    assert_eq!(e.kind(), kvx_core::ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("engine decode"), "{e}");
}

#[test]
fn an_abort_during_a_read_keeps_the_blocks_until_the_read_ends() {
    let lb = Loopback::default();
    let m = model();
    let mut c = lb.cluster(&m);
    for rank in 0..2 {
        lb.agent("decode", rank).set_faults(Faults::none().delay_completion(20)).unwrap();
    }
    let rid = id("aborted");
    c.submit(rid.clone(), prompt(9, 4 * BS), 4).unwrap();
    let deadline = Instant::now() + LIMIT;
    while c.decodes[0].pool().num_in_flight() == 0 {
        assert!(Instant::now() < deadline, "the READ never started");
        c.step().unwrap();
    }
    assert_eq!(c.decodes[0].state(&rid), Some(&RequestState::WaitingForRemoteKv));
    let total = c.decodes[0].pool().num_blocks() as usize;
    let used = total - c.decodes[0].pool().num_free();
    c.decodes[0].abort(&rid);
    assert_eq!(c.decodes[0].state(&rid), Some(&RequestState::Finished(FinishReason::Aborted)));
    assert_eq!(total - c.decodes[0].pool().num_free(), used, "nothing freed while the READ runs");
    assert_eq!(c.decodes[0].pool().num_in_flight(), 4);
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_eq!(c.decodes[0].stats().blocks_verified, 0, "an aborted load is not used");
}

#[test]
fn tcp_side_channels() {
    let lb = Loopback::default();
    let m = model();
    let config = |name| EngineConfig {
        side_channel: SideChannel::Tcp { host: "127.0.0.1".into(), port: 0, advertise_host: None },
        ..lb.config(name, &m)
    };
    let mut c = Cluster::new(vec![lb.engine(config("prefill"))], lb.engine(config("decode"))).unwrap();
    let ids: Vec<_> = (0..10).map(|i| id(format!("tcp-{i}"))).collect();
    for (i, rid) in ids.iter().enumerate() {
        c.submit(rid.clone(), prompt(i as u64, BS + 3 * i), 2).unwrap();
    }
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_finished(&c.decodes[0], &ids);
    assert!(c.decodes[0].worker_stats().iter().all(|w| w.handshakes == 1));
}
