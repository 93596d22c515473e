//! The cases of the fault matrix, each a plain function over a [`Matrix`].

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use kvx_core::{ErrorKind, FinishReason, TransferParams, WorkerStats};

use crate::sim::{
    ClientRequest, Cluster, EngineConfig, InProcessSideChannels, ModelSpec, RequestState, SideChannel,
};

use super::*;

/// A reader too late for its lease: the prefill engine's lease is zero, so every hold ends at the
/// step that records it, before any READ. Every load fails, [`ErrorKind::Expired`] (the prefill
/// worker answered "not held") or [`ErrorKind::Timeout`] (no answer: with a zero lease the worker
/// forgets ended holds at once, so a late release waits as an early one and is never answered); no
/// byte of it is used, nothing leaks, the prefill holds all expired. Then a prefill engine with a
/// normal lease serves the same decode engine.
pub fn late_reader(m: &Matrix) {
    let net = InProcessSideChannels::new();
    let late = m.engine(EngineConfig { lease_duration: Duration::ZERO, ..m.config("late-prefill", &net) });
    let decode = m.engine(m.config("late-decode", &net));
    let mut c = cluster(vec![late], decode);
    let ids = submit(&mut c, "late", 1, 4);
    run(&mut c);
    for rid in &ids {
        assert_failed(&c.decodes[0], rid, &[ErrorKind::Expired, ErrorKind::Timeout]);
    }
    let s = c.decodes[0].stats().clone();
    assert_eq!((s.finished, s.failed, s.blocks_verified, s.tokens_loaded), (0, 4, 0, 0), "{s:?}");
    m.assert_per_rank(&c.decodes[0], "lease_failures", |w| w.lease_failures, 4);
    m.assert_per_rank(&c.decodes[0], "failed_loads", |w| w.failed_loads, 4);
    m.assert_per_rank(&c.decodes[0], "bytes_read", |w| w.bytes_read, 0);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 4);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 0);
    m.assert_per_rank(&c.prefills[0], "leases_renewed", |w| w.leases_renewed, 0);
    assert_clean(&c);

    // The same decode engine, now fed by a prefill engine with the usual lease.
    let late = std::mem::replace(&mut c.prefills[0], m.engine(m.config("late-ok-prefill", &net)));
    let ids = submit(&mut c, "late-ok", 2, 4);
    run(&mut c);
    assert_finished(&c.decodes[0], &ids);
    assert_eq!(c.decodes[0].stats().blocks_verified, 4 * m.verified_per_load(PROMPT_BLOCKS));
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 4);
    m.assert_per_rank(&c.prefills[0], "hold_answers", |w| w.hold_answers, 4);
    m.assert_per_rank(&c.decodes[0], "lease_failures", |w| w.lease_failures, 4);
    assert_clean(&c);
    assert_engine_clean(&late);
}

/// The prefill engine restarts between requests: it is dropped (its agents and KV memory go) and
/// started again under the same engine id (on new in-process ports). The new engine's params name
/// its instance, so the decode workers handshake with it again before reading: no READ goes
/// through the stale connection, and every request after the restart succeeds, every byte
/// checked.
pub fn prefill_restart(m: &Matrix) {
    let c = restart_prefill(m, "restart", false, false);
    m.assert_per_rank(&c.decodes[0], "reads_posted", |w| w.reads_posted, 6);
}

/// [`prefill_restart`] with real TCP side channels, the new engine binding the ports the old one
/// had: the params of both starts name the same host and port, only their instance differs.
pub fn prefill_restart_same_ports(m: &Matrix) {
    let c = restart_prefill(m, "restart-ports", true, false);
    m.assert_per_rank(&c.decodes[0], "reads_posted", |w| w.reads_posted, 6);
}

/// [`prefill_restart`] with params that name no instance (a client that drops the keys it does
/// not know, or a prefill engine that sets none; without a key nothing refuses them): the decode
/// workers READ through the connection to the dropped engine's agent. That READ must fail (the
/// contract: the peer is dropped, handshaken again, and the READ posted once more to the new
/// instance), so every request after the restart still succeeds.
pub fn prefill_restart_unnamed_instance(m: &Matrix) {
    restart_prefill(m, "restart-unnamed", false, true);
}

/// Drops a client's `kvx_instance` from the params it hands on.
fn without_instance(mut request: ClientRequest) -> Vec<ClientRequest> {
    request.3.kvx_instance = None;
    vec![request]
}

/// Three requests, a prefill restart, three more that must all succeed; returns the cluster.
fn restart_prefill(m: &Matrix, case: &str, same_ports: bool, unnamed: bool) -> Cluster {
    let net = InProcessSideChannels::new();
    let config = |id: &str| {
        let c = m.config(&format!("{case}-{id}"), &net);
        if same_ports { EngineConfig { side_channel: tcp(0), ..c } } else { c }
    };
    let mut c = cluster(vec![m.engine(config("prefill"))], m.engine(config("decode")));
    if unnamed {
        c = c.with_client(without_instance);
    }
    let before = submit(&mut c, "before", 1, 3);
    run(&mut c);
    assert_finished(&c.decodes[0], &before);
    assert_clean(&c);

    let mut config = c.prefills[0].config().clone();
    if same_ports {
        config.side_channel = tcp(c.prefills[0].side_channel_port());
    }
    c.prefills.clear();
    c.prefills.push(m.engine(config));

    let after = submit(&mut c, "after", 2, 3);
    run(&mut c);
    assert_finished(&c.decodes[0], &after);
    assert_eq!(c.decodes[0].stats().blocks_verified, 6 * m.verified_per_load(PROMPT_BLOCKS));
    assert_eq!(c.decodes[0].stats().failed, 0);
    m.assert_per_rank(&c.decodes[0], "handshakes", |w| w.handshakes, 2);
    m.assert_per_rank(&c.decodes[0], "peer_restarts", |w| w.peer_restarts, 1);
    m.assert_per_rank(&c.decodes[0], "peers_invalidated", |w| w.peers_invalidated, 1);
    m.assert_per_rank(&c.decodes[0], "lease_failures", |w| w.lease_failures, 0);
    m.assert_per_rank(&c.decodes[0], "failed_loads", |w| w.failed_loads, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 3);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
    c
}

/// TCP side channels on 127.0.0.1, rank 0 on `port` (0: a free one).
fn tcp(port: u16) -> SideChannel {
    SideChannel::Tcp { host: "127.0.0.1".into(), port, advertise_host: None }
}

/// What every backend must keep when the prefill engine restarts, even one whose READs of the
/// dropped engine's agent are not seen to fail, and with params that name no instance (so that
/// those READs happen): no wrong byte is used. The requests sent to the restarted engine (whose
/// lease is 3 s here) either succeed or fail ([`ErrorKind::Timeout`], [`ErrorKind::Transfer`] or
/// [`ErrorKind::Expired`]); every hold of the new engine ends, released or expired; nothing leaks;
/// and once the decode workers have found the new instance, every request succeeds.
pub fn prefill_restart_is_safe(m: &Matrix) {
    let (c, _net) = m.cluster("safe-restart");
    let mut c = c.with_client(without_instance);
    let before = submit(&mut c, "before", 1, 3);
    run(&mut c);
    assert_finished(&c.decodes[0], &before);

    let config = EngineConfig { lease_duration: Duration::from_secs(3), ..c.prefills[0].config().clone() };
    c.prefills.clear();
    c.prefills.push(m.engine(config));
    let after = submit(&mut c, "after", 2, 3);
    run(&mut c);
    let mut loads = before.len() as u64;
    for rid in &after {
        if finished(&c.decodes[0], rid) {
            loads += 1;
        } else {
            assert_failed(&c.decodes[0], rid, &[ErrorKind::Timeout, ErrorKind::Transfer, ErrorKind::Expired]);
        }
    }
    assert_clean(&c);
    let ended = |w: &WorkerStats| w.notifications + w.expired_holds;
    m.assert_per_rank(&c.prefills[0], "holds released or expired", ended, 3);

    let more = submit(&mut c, "more", 3, 3);
    run(&mut c);
    assert_finished(&c.decodes[0], &more);
    loads += more.len() as u64;
    assert_eq!(c.decodes[0].stats().blocks_verified, loads * m.verified_per_load(PROMPT_BLOCKS));
    m.assert_per_rank(&c.decodes[0], "peer_restarts", |w| w.peer_restarts, 1);
    m.assert_per_rank(&c.prefills[0], "holds released or expired", ended, 6);
    assert_clean(&c);
}

/// The decode engine restarts between requests (dropped, started again under the same id). Its
/// releases carry its new instance, so the prefill workers handshake with it again before they
/// answer. Every request after the restart succeeds.
pub fn decode_restart(m: &Matrix) {
    let (mut c, _net) = m.cluster("decode-restart");
    let before = submit(&mut c, "before", 1, 3);
    run(&mut c);
    assert_finished(&c.decodes[0], &before);
    assert_clean(&c);

    let Cluster { prefills, decodes, .. } = c;
    let config = decodes[0].config().clone();
    drop(decodes);
    let mut c = cluster(prefills, m.engine(config));

    let after = submit(&mut c, "after", 2, 3);
    run(&mut c);
    assert_finished(&c.decodes[0], &after);
    assert_eq!(c.decodes[0].stats().blocks_verified, 3 * m.verified_per_load(PROMPT_BLOCKS));
    m.assert_per_rank(&c.decodes[0], "handshakes", |w| w.handshakes, 1);
    m.assert_per_rank(&c.decodes[0], "lease_failures", |w| w.lease_failures, 0);
    // The prefill workers answered 6 releases, reaching each decode instance by its own handshake.
    m.assert_per_rank(&c.prefills[0], "hold_answers", |w| w.hold_answers, 6);
    m.assert_per_rank(&c.prefills[0], "handshakes", |w| w.handshakes, 2);
    m.assert_per_rank(&c.prefills[0], "peer_restarts", |w| w.peer_restarts, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A client edits the params so that the READ window reaches past the prefill engine's pool (a
/// remote block id equal to its `num_blocks`; no key, so the edit is not refused up front). The
/// decode worker finds it out after the handshake, when it knows the pool's size: the request
/// fails, nothing is read, and the prefill engine is told at once to free (no hold expires). Once
/// while the handshake is under way, once with the peer ready.
pub fn out_of_range_read(m: &Matrix) {
    let (c, _net) = m.cluster("oob");
    let mut c = c.with_client(|mut request: ClientRequest| {
        if request.0.as_str().starts_with("oob") {
            if let Some(last) =
                request.3.remote_block_ids.as_mut().and_then(|g| g.last_mut()).and_then(|b| b.last_mut())
            {
                *last = NUM_BLOCKS;
            }
        }
        vec![request]
    });
    let first = submit(&mut c, "oob-first", 1, 1);
    run(&mut c);
    let (good, later) = (submit(&mut c, "good", 2, 1), submit(&mut c, "oob-later", 3, 1));
    run(&mut c);
    for rid in first.iter().chain(&later) {
        // Every check of peer data fails with this kind; the message says it was this one.
        let e = assert_failed(&c.decodes[0], rid, &[ErrorKind::InvalidPeerData]);
        let out_of_range = format!("remote block id {NUM_BLOCKS} out of range");
        assert!(e.message().contains(&out_of_range), "{rid}: {e}");
    }
    assert_finished(&c.decodes[0], &good);
    assert_eq!(c.decodes[0].stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    m.assert_per_rank(&c.decodes[0], "reads_posted", |w| w.reads_posted, 1);
    m.assert_per_rank(&c.decodes[0], "handshakes", |w| w.handshakes, 1);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 3);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// The decode engine runs another model (another block length): the handshake refuses the
/// prefill engine as incompatible, both waiting requests fail, nothing is read, and the decode
/// workers still tell the prefill engine to free (no hold expires).
pub fn layout_refusal(m: &Matrix) {
    let net = InProcessSideChannels::new();
    let prefill = m.engine(m.config("layout-prefill", &net));
    let other = ModelSpec::standard(2, 4, 16, BLOCK_SIZE as u32);
    let decode = m.engine(EngineConfig { model: other, ..m.config("layout-decode", &net) });
    let mut c = cluster(vec![prefill], decode);
    let ids = submit(&mut c, "layout", 1, 2);
    run(&mut c);
    for rid in &ids {
        assert_failed(&c.decodes[0], rid, &[ErrorKind::Incompatible]);
    }
    m.assert_per_rank(&c.decodes[0], "handshake_failures", |w| w.handshake_failures, 1);
    m.assert_per_rank(&c.decodes[0], "reads_posted", |w| w.reads_posted, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 2);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A decode-side request aborted while queued, before it has blocks: nothing is read, and the
/// prefill engine is told at once to free (a notify-only release; no hold expires).
pub fn abort_queued_on_decode(m: &Matrix) {
    let (c, _net) = m.cluster("abort-queued");
    let (hook, held) = holding_client("held");
    let mut c = c.with_client(hook);
    submit(&mut c, "held", 1, 1);
    let request = take_held(&mut c, &held, &id("held-0"));
    let rid = request.0.clone();
    add_to_decode(&mut c, request);
    c.decodes[0].abort(&rid);
    assert_eq!(c.decodes[0].state(&rid), Some(&RequestState::Finished(FinishReason::Aborted)));
    run(&mut c);
    m.assert_per_rank(&c.decodes[0], "reads_posted", |w| w.reads_posted, 0);
    m.assert_per_rank(&c.decodes[0], "notify_only", |w| w.notify_only, 1);
    assert_eq!(c.decodes[0].stats().blocks_verified, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A decode-side request aborted right after its allocation, on a fresh cluster: its load waits
/// for the handshake (or its READ has just been posted). Its blocks stay until the load is
/// reported; the READ's release frees the prefill hold (no expiry); the loaded bytes are not used.
pub fn abort_before_the_read(m: &Matrix) {
    abort_while_loading(m, "abort-early", false);
}

/// A decode-side request aborted while its READ is in flight (the peer is ready, so the READ is
/// posted in the step that allocates): as [`abort_before_the_read`].
pub fn abort_during_read(m: &Matrix) {
    abort_while_loading(m, "abort-read", true);
}

fn abort_while_loading(m: &Matrix, case: &str, warm: bool) {
    let (c, _net) = m.cluster(case);
    let (hook, held) = holding_client("held");
    let mut c = c.with_client(hook);
    let warmed = if warm { submit(&mut c, "warm", 1, 1) } else { Vec::new() };
    run(&mut c);
    assert_finished(&c.decodes[0], &warmed);
    submit(&mut c, "held", 2, 1);
    let request = take_held(&mut c, &held, &id("held-0"));
    let rid = request.0.clone();
    add_to_decode(&mut c, request);
    if let Err(e) = c.decodes[0].step() {
        panic!("decode step: {e}");
    }
    assert_eq!(c.decodes[0].state(&rid), Some(&RequestState::WaitingForRemoteKv));
    if warm {
        m.assert_per_rank(&c.decodes[0], "reads_posted", |w| w.reads_posted, 2);
    }
    let pool = c.decodes[0].pool();
    let used = pool.num_blocks() as usize - pool.num_free();
    c.decodes[0].abort(&rid);
    assert_eq!(c.decodes[0].state(&rid), Some(&RequestState::Finished(FinishReason::Aborted)));
    let pool = c.decodes[0].pool();
    assert_eq!(pool.num_blocks() as usize - pool.num_free(), used, "nothing freed while the load runs");
    assert_eq!(pool.num_in_flight(), PROMPT_BLOCKS, "the load's blocks stay in flight");
    run(&mut c);
    let loads = warmed.len() as u64;
    assert_eq!(
        c.decodes[0].stats().blocks_verified,
        loads * m.verified_per_load(PROMPT_BLOCKS),
        "an aborted load is not used"
    );
    m.assert_per_rank(&c.decodes[0], "reads_posted", |w| w.reads_posted, loads + 1);
    m.assert_per_rank(&c.decodes[0], "failed_loads", |w| w.failed_loads, 0);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, loads + 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A decode-side request aborted while it runs (its KV loaded and checked): its blocks are freed,
/// nothing else happens.
pub fn abort_running(m: &Matrix) {
    let (c, _net) = m.cluster("abort-running");
    let (hook, held) = holding_client("held");
    let mut c = c.with_client(hook);
    submit(&mut c, "held", 1, 1);
    let (rid, prompt, _, params) = take_held(&mut c, &held, &id("held-0"));
    add_to_decode(&mut c, (rid.clone(), prompt, 64, params));
    step_until(&mut c, "the request to run", |c| c.decodes[0].state(&rid) == Some(&RequestState::Running));
    c.decodes[0].abort(&rid);
    assert_eq!(c.decodes[0].state(&rid), Some(&RequestState::Finished(FinishReason::Aborted)));
    run(&mut c);
    assert_eq!(c.decodes[0].stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    assert!(c.decodes[0].output_tokens(&rid).is_some_and(|t| t.len() < 64), "aborted before its last token");
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// Prefill-side aborts: a request aborted while queued on the prefill engine offers nothing and
/// holds nothing; a request the client aborts at the prefill engine after its params went out is
/// not freed by that (its hold belongs to its reader), and the decode engine reads it whole.
pub fn abort_on_prefill(m: &Matrix) {
    let (c, _net) = m.cluster("abort-prefill");
    let (hook, held) = holding_client("held");
    let mut c = c.with_client(hook);
    let queued = id("queued");
    let params = TransferParams { do_remote_decode: true, ..Default::default() };
    c.prefills[0]
        .add_request(queued.clone(), &prompt(7, PROMPT_LEN), 1, Some(params))
        .unwrap_or_else(|e| panic!("adding {queued}: {e}"));
    c.prefills[0].abort(&queued);
    assert_eq!(c.prefills[0].state(&queued), Some(&RequestState::Finished(FinishReason::Aborted)));

    submit(&mut c, "held", 1, 1);
    let request = take_held(&mut c, &held, &id("held-0"));
    let rid = request.0.clone();
    assert!(finished(&c.prefills[0], &rid), "{:?}", c.prefills[0].state(&rid));
    c.prefills[0].abort(&rid);
    assert!(finished(&c.prefills[0], &rid), "an abort after the offer changes nothing");
    add_to_decode(&mut c, request);
    run(&mut c);
    assert_finished(&c.decodes[0], &[rid]);
    assert_eq!(c.decodes[0].stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    assert!(c.prefills[0].take_transfer_params().is_empty(), "the queued abort offered nothing");
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A client submits the same offer twice at once (a copy of the params under another request
/// id): one load per offer, so exactly one of the two is read; the other fails before reading or
/// releasing anything; nothing leaks and the hold is released once.
pub fn duplicate_offer(m: &Matrix) {
    let (c, _net) = m.cluster("dup");
    let mut c = c.with_client(|request: ClientRequest| {
        let copy = (id(format!("{}-copy", request.0)), request.1.clone(), request.2, request.3.clone());
        vec![request, copy]
    });
    submit(&mut c, "dup", 1, 1);
    run(&mut c);
    let (a, b) = (id("dup-0"), id("dup-0-copy"));
    let (read, refused) = if finished(&c.decodes[0], &a) { (a, b) } else { (b, a) };
    assert_finished(&c.decodes[0], std::slice::from_ref(&read));
    // Any misuse of the connector fails with this kind; the message says it was the duplicate.
    let e = assert_failed(&c.decodes[0], &refused, &[ErrorKind::InvalidArgument]);
    assert!(e.message().contains("already in flight"), "{refused}: {e}");
    assert_eq!(c.decodes[0].stats().blocks_verified, m.verified_per_load(PROMPT_BLOCKS));
    m.assert_per_rank(&c.decodes[0], "reads_posted", |w| w.reads_posted, 1);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "stray_notifications", |w| w.stray_notifications, 0);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}

/// A client submits an offer again, with another prompt, after its load completed: the READ happens
/// (the decode engine cannot know), but the prefill worker answers its release "not held", so the
/// load fails [`ErrorKind::Expired`] and its bytes are not used; nothing leaks. (With the same
/// prompt the decode engine's prefix cache would serve it: a notify-only release, no READ.)
pub fn replayed_offer(m: &Matrix) {
    let (c, _net) = m.cluster("replay");
    let kept: Held = Arc::default();
    let keep = Arc::clone(&kept);
    let mut c = c.with_client(move |request: ClientRequest| {
        keep.lock().unwrap_or_else(PoisonError::into_inner).push(request.clone());
        vec![request]
    });
    let first = submit(&mut c, "orig", 1, 1);
    run(&mut c);
    assert_finished(&c.decodes[0], &first);
    let (_, _, n, params) = kept.lock().unwrap_or_else(PoisonError::into_inner).remove(0);
    let replay = id("replay");
    add_to_decode(&mut c, (replay.clone(), prompt(2, PROMPT_LEN), n, params));
    run(&mut c);
    assert_failed(&c.decodes[0], &replay, &[ErrorKind::Expired]);
    assert_eq!(
        c.decodes[0].stats().blocks_verified,
        m.verified_per_load(PROMPT_BLOCKS),
        "the replay's bytes are not used"
    );
    m.assert_per_rank(&c.decodes[0], "reads_posted", |w| w.reads_posted, 2);
    m.assert_per_rank(&c.decodes[0], "lease_failures", |w| w.lease_failures, 1);
    m.assert_per_rank(&c.prefills[0], "releases matched", |w| w.notifications, 1);
    m.assert_per_rank(&c.prefills[0], "stray_notifications", |w| w.stray_notifications, 1);
    m.assert_per_rank(&c.prefills[0], "hold_answers", |w| w.hold_answers, 2);
    m.assert_per_rank(&c.prefills[0], "expired_holds", |w| w.expired_holds, 0);
    assert_clean(&c);
}
