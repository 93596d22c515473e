//! Hostile clients between the engines, end to end on loopback: a client that forges, replays or
//! edits the params a prefill engine handed out. Without a key, no other request is freed or
//! corrupted (one load per offer); with a key, every edited offer is refused before anything is
//! read.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::*;
use kvx_core::{AuthKey, ErrorKind, FinishReason, RequestId, TransferParams};
use kvx_testkit::matrix::assert_failed;
use kvx_testkit::sim::{ClientRequest, Cluster, EngineConfig, RequestState, SimEngine};

/// The victim's prompt: 4 full blocks.
fn victim_prompt() -> Vec<u32> {
    prompt(1, 4 * BS)
}

fn attacker_prompt() -> Vec<u32> {
    prompt(2, 3 * BS)
}

fn engines(lb: &Loopback, prefill_key: Option<&str>, decode_key: Option<&str>) -> (SimEngine, SimEngine) {
    let m = model();
    let config = |name: &str, k: Option<&str>| EngineConfig {
        auth_key: k.map(|k| AuthKey::new(k).unwrap()),
        lease_duration: Duration::from_millis(300),
        ..lb.config(name, &m)
    };
    (lb.engine(config("prefill", prefill_key)), lb.engine(config("decode", decode_key)))
}

/// The hostile client: holds the victim's request back until it has the attacker's params, then
/// submits, before both real requests (so that their releases reach the prefill engine while the
/// victim's hold is still there):
/// - `forged-id`: the attacker's params naming the victim's request id,
/// - `replay`: the attacker's params again, as they are,
/// - `other-blocks`: the attacker's params naming the victim's blocks (with the victim's prompt).
fn hostile_client() -> impl FnMut(ClientRequest) -> Vec<ClientRequest> + Send + 'static {
    let mut victim: Option<ClientRequest> = None;
    move |request: ClientRequest| {
        if request.0.as_str() == "victim" {
            victim = Some(request);
            return Vec::new();
        }
        let Some(v) = victim.take() else { return vec![request] };
        let params = &request.3;
        let edited = |edit: &dyn Fn(&mut TransferParams)| {
            let mut p = params.clone();
            edit(&mut p);
            p
        };
        let forged_id = edited(&|p| p.remote_request_id = v.3.remote_request_id.clone());
        let other_blocks = edited(&|p| p.remote_block_ids = v.3.remote_block_ids.clone());
        vec![
            (RequestId::new("forged-id"), attacker_prompt(), 2, forged_id),
            (RequestId::new("replay"), attacker_prompt(), 2, params.clone()),
            (RequestId::new("other-blocks"), victim_prompt(), 2, other_blocks),
            request,
            v,
        ]
    }
}

fn run(prefill_key: Option<&str>, decode_key: Option<&str>) -> Cluster {
    let lb = Loopback::simulated();
    let (prefill, decode) = engines(&lb, prefill_key, decode_key);
    let mut c = lb.cluster_of(vec![prefill], decode).with_client(hostile_client());
    c.submit(RequestId::new("victim"), victim_prompt(), 2).unwrap();
    c.submit(RequestId::new("attacker"), attacker_prompt(), 2).unwrap();
    c.run_until_idle(LIMIT).unwrap();
    c
}

fn state(c: &Cluster, id: &str) -> RequestState {
    c.decodes[0].state(&RequestId::new(id)).cloned().unwrap()
}

/// `rid` failed because a load of the same request or offer was in flight: the kind is that of
/// any misuse of the connector, so the message says which one.
#[track_caller]
fn assert_refused_as_duplicate(c: &Cluster, rid: &str) {
    let e = assert_failed(&c.decodes[0], &id(rid), &[ErrorKind::InvalidArgument]);
    assert!(e.message().contains("already in flight"), "{rid}: {e}");
}

fn assert_pools_whole(c: &Cluster) {
    for e in c.prefills.iter().chain(&c.decodes) {
        assert!(e.is_idle(), "{} is not idle", e.engine_id());
        assert!(e.pool().is_whole(), "{} leaked {} blocks", e.engine_id(), c.blocks_in_use());
    }
}

#[test]
fn without_a_key_forged_and_replayed_params_free_or_corrupt_no_other_request() {
    let c = run(None, None);
    // The victim's KV arrived whole and verified: no forged release freed its hold early.
    assert_eq!(state(&c, "victim"), RequestState::Finished(FinishReason::LengthCapped));
    assert_eq!(state(&c, "attacker"), RequestState::Finished(FinishReason::LengthCapped));
    // Every edited copy carries the attacker's nonce: one load per offer, so while the
    // attacker's own load runs, each copy is refused before anything is read or released.
    for copy in ["forged-id", "replay", "other-blocks"] {
        assert_refused_as_duplicate(&c, copy);
    }
    assert!(
        c.decodes[0].worker_stats().iter().all(|w| w.reads_posted == 2),
        "{:?}",
        c.decodes[0].worker_stats()
    );
    // Every engine idle, every block back in its pool; the victim's blocks were never reused
    // while it read them (its bytes verified).
    assert_pools_whole(&c);
    let decode_errors: Vec<_> =
        c.decodes[0].errors().iter().filter(|e| e.contains("victim") || e.contains("attacker")).collect();
    assert!(decode_errors.is_empty(), "{decode_errors:?}");
    assert!(c.prefills[0].errors().is_empty(), "{:?}", c.prefills[0].errors());
}

#[test]
fn with_a_key_every_edited_offer_is_refused_before_it_is_read() {
    let key = "one deployment's shared secret";
    let c = run(Some(key), Some(key));
    assert_eq!(state(&c, "victim"), RequestState::Finished(FinishReason::LengthCapped));
    assert_eq!(state(&c, "attacker"), RequestState::Finished(FinishReason::LengthCapped));
    for forged in ["forged-id", "other-blocks"] {
        assert_failed(&c.decodes[0], &id(forged), &[ErrorKind::Unauthenticated]);
    }
    // Only the two real requests were read, on each rank: the unedited replay is the attacker's
    // offer, whose load is running.
    assert_refused_as_duplicate(&c, "replay");
    assert!(
        c.decodes[0].worker_stats().iter().all(|w| w.reads_posted == 2),
        "{:?}",
        c.decodes[0].worker_stats()
    );
    assert_pools_whole(&c);
    assert!(c.prefills[0].errors().is_empty(), "{:?}", c.prefills[0].errors());
}

#[test]
fn a_decode_engine_with_another_key_reads_nothing_and_nothing_leaks() {
    let c = run(Some("the prefill deployment's key"), Some("a different deployment key"));
    for rid in ["victim", "attacker", "forged-id", "replay", "other-blocks"] {
        assert_failed(&c.decodes[0], &id(rid), &[ErrorKind::Unauthenticated]);
    }
    assert!(c.decodes[0].worker_stats().iter().all(|w| w.reads_posted == 0 && w.handshakes == 0));
    // The prefill engine's holds expire (nobody may read them) and its pool is whole again.
    assert!(c.prefills[0].worker_stats().iter().all(|w| w.expired_holds == 2));
    assert_pools_whole(&c);
}

#[test]
fn a_keyed_deployment_serves_every_request_and_verifies_every_byte() {
    let lb = Loopback::default();
    let key = Some("one deployment's shared secret");
    let (prefill, decode) = engines(&lb, key, key);
    let mut c = Cluster::new(vec![prefill], decode).unwrap();
    let ids: Vec<_> = (0..20).map(|i| RequestId::new(format!("k{i}"))).collect();
    for (i, rid) in ids.iter().enumerate() {
        c.submit(rid.clone(), prompt(i as u64, 2 * BS + i), 2).unwrap();
    }
    c.run_until_idle(LIMIT).unwrap();
    assert_clean(&c);
    assert_eq!((c.decodes[0].stats().finished, c.decodes[0].stats().failed), (20, 0));
    assert!(c.decodes[0].stats().blocks_verified > 0);
}
