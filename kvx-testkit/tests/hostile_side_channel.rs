//! Engines over real TCP side channels (and the loopback backend) under attack: after hostile
//! bytes hit every side-channel port of the prefill engine, the decode engine still handshakes
//! and READs every block; with an auth key, engines with the same key READ, and a decode engine
//! with another key or none fails its requests with an authentication error and READs nothing.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::time::Duration;

use kvx_core::{AuthKey, ErrorKind, FinishReason, RequestId, TransferAgent};
use kvx_loopback::Fabric;
use kvx_testkit::hostile::zmtp_73;
use kvx_testkit::sim::{
    Cluster, EngineConfig, InProcessSideChannels, ModelSpec, RequestState, SideChannel, SimBackend, SimEngine,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BS: usize = 16;
const LIMIT: Duration = Duration::from_secs(60);

fn engine(fabric: &Fabric, id: &str, auth_key: Option<AuthKey>) -> SimEngine {
    let fabric = fabric.clone();
    let backend = SimBackend::new(move |engine, rank| {
        Ok(std::sync::Arc::new(fabric.agent(format!("{engine}-{rank}"))?)
            as std::sync::Arc<dyn TransferAgent>)
    });
    let model = ModelSpec::standard(2, 4, 8, BS as u32);
    let config = EngineConfig {
        side_channel: SideChannel::Tcp { host: "127.0.0.1".into(), port: 0, advertise_host: None },
        auth_key,
        lease_duration: Duration::from_millis(300),
        ..EngineConfig::new(id, 2, 512, model, &InProcessSideChannels::new())
    };
    SimEngine::new(config, &backend).unwrap()
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(0..kvx_testkit::sim::VOCAB)).collect()
}

/// Submits `n` requests and runs the cluster until idle; returns their ids.
fn run(c: &mut Cluster, n: usize) -> Vec<RequestId> {
    let ids: Vec<_> = (0..n).map(|i| RequestId::new(format!("r-{i}"))).collect();
    for (i, id) in ids.iter().enumerate() {
        c.submit(id.clone(), prompt(i as u64, 2 * BS + i), 2).unwrap();
    }
    c.run_until_idle(LIMIT).unwrap();
    for e in c.prefills.iter().chain(&c.decodes) {
        assert!(e.errors().is_empty(), "{}: {:?}", e.engine_id(), e.errors());
        assert_eq!(e.stats().blocks_mismatched, 0);
        assert!(e.pool().is_whole(), "{} leaked blocks", e.engine_id());
    }
    ids
}

#[test]
fn attacked_side_channels_still_serve_handshakes_and_reads() {
    let fabric = Fabric::new();
    let prefill = engine(&fabric, "prefill", None);
    let base = prefill.side_channel_port();
    for port in [base, base + 1] {
        kvx_testkit::hostile::attack(port, &zmtp_73(), false, LIMIT).unwrap();
        kvx_testkit::hostile::attack(port, &[&u32::MAX.to_be_bytes()[..], b"x"].concat(), false, LIMIT)
            .unwrap();
        kvx_testkit::hostile::attack(port, &[&64u32.to_be_bytes()[..], &[0xAB; 64]].concat(), false, LIMIT)
            .unwrap();
        kvx_testkit::hostile::attack(port, &[&100u32.to_be_bytes()[..], &[1; 10]].concat(), true, LIMIT)
            .unwrap();
    }
    let mut c = Cluster::new(vec![prefill], engine(&fabric, "decode", None)).unwrap();
    let ids = run(&mut c, 8);
    for id in &ids {
        assert_eq!(c.decodes[0].state(id), Some(&RequestState::Finished(FinishReason::LengthCapped)), "{id}");
    }
    assert!(c.decodes[0].stats().blocks_verified > 0);
    assert!(c.decodes[0].worker_stats().iter().all(|w| w.handshakes == 1));
}

#[test]
fn keyed_engines_read_and_a_wrong_key_or_none_reads_nothing() {
    let key = |k: &str| Some(AuthKey::new(k).unwrap());
    let fabric = Fabric::new();
    let mut c = Cluster::new(
        vec![engine(&fabric, "prefill", key("deployment-key-0001"))],
        engine(&fabric, "decode", key("deployment-key-0001")),
    )
    .unwrap();
    let ids = run(&mut c, 4);
    assert!(ids.iter().all(|id| matches!(c.decodes[0].state(id), Some(RequestState::Finished(_)))));
    assert!(c.decodes[0].stats().blocks_verified > 0);

    for (n, wrong) in [key("deployment-key-0002"), None].into_iter().enumerate() {
        let wrong_is_a_key = wrong.is_some();
        let fabric = Fabric::new();
        let prefill = engine(&fabric, &format!("prefill-{n}"), key("deployment-key-0001"));
        let mut c = Cluster::new(vec![prefill], engine(&fabric, &format!("decode-{n}"), wrong)).unwrap();
        let ids = run(&mut c, 3);
        for id in &ids {
            match c.decodes[0].state(id) {
                Some(RequestState::Failed(e)) => {
                    assert_eq!(e.kind(), ErrorKind::Unauthenticated, "{id}: {e}")
                }
                other => panic!("{id}: {other:?}"),
            }
        }
        assert_eq!(c.decodes[0].stats().blocks_verified, 0, "nothing READ");
        // Another key: the signed params already fail, before any connection. No key: the
        // params are not checked, and the side channel refuses the handshake.
        for w in c.decodes[0].worker_stats() {
            assert_eq!((w.handshakes, w.reads_posted), (0, 0), "{w:?}");
            assert_eq!(w.handshake_failures == 0, wrong_is_a_key, "{w:?}");
        }
    }
}
