//! `Holds` on its own: holds, releases, heartbeats and time in, effects out. No agent, no peers.

use super::*;
use crate::auth::HexBytes;

const SECOND: Duration = Duration::from_secs(1);

/// The prefill worker's instance.
const INSTANCE: u64 = 9;

/// Every decode worker is connected (see `Holds::release`).
fn connected(_: &ReplyTo) -> bool {
    true
}

fn holds() -> Holds {
    let mut config = WorkerConfig::new("prefill".into(), 0, 1, 4);
    config.lease_duration = 10 * SECOND;
    config.early_release_ttl = 5 * SECOND;
    Holds::new(&config, INSTANCE)
}

fn nonce(id: &str) -> Nonce {
    let mut b = [0u8; 16];
    b[..id.len()].copy_from_slice(id.as_bytes());
    HexBytes(b)
}

fn held(id: &str) -> HeldRequest {
    HeldRequest { request_id: id.into(), nonce: nonce(id) }
}

fn decode_engine() -> RemoteCoordinates {
    RemoteCoordinates::at("decode", "d", 5700)
}

fn reply_to(token: u8) -> ReplyTo {
    ReplyTo { engine: decode_engine(), rank: 1, instance: 3, token: HexBytes([token; 16]) }
}

/// The release of `id` by `reader` of `readers`, asking for an answer with `token` if given.
fn release(id: &str, reader: u32, readers: u32, token: Option<u8>) -> HoldRelease {
    let reply_to = token.map(reply_to);
    HoldRelease { request_id: id.into(), nonce: nonce(id), reply_to, reader, readers, instance: None }
}

fn answer(id: &str, token: u8, held: bool) -> HoldEffect {
    let status = HoldStatus { request_id: id.into(), nonce: nonce(id), held, token: HexBytes([token; 16]) };
    HoldEffect::Answer { engine: decode_engine(), rank: 1, instance: 3, status }
}

fn sender() -> AgentName {
    AgentName::new("decode-agent")
}

#[test]
fn the_last_readers_release_frees_the_hold_and_each_is_answered_held() {
    let (mut h, mut stats) = (holds(), WorkerStats::default());
    let now = Instant::now();
    assert_eq!(h.hold(now, &held("a"), &mut stats), []);
    assert_eq!(h.len(), 1);
    assert_eq!(
        h.release(now, &sender(), release("a", 0, 2, Some(1)), connected, &mut stats),
        [answer("a", 1, true)]
    );
    // The same reader again: answered again, changes nothing.
    assert_eq!(
        h.release(now, &sender(), release("a", 0, 2, Some(1)), connected, &mut stats),
        [answer("a", 1, true)]
    );
    assert_eq!(h.len(), 1);
    let effects = h.release(now, &sender(), release("a", 1, 2, Some(2)), connected, &mut stats);
    assert_eq!(effects, [HoldEffect::Freed("a".into()), answer("a", 2, true)]);
    assert!(h.is_empty());
    assert_eq!((stats.notifications, stats.stray_notifications), (2, 1));
}

#[test]
fn a_second_copy_of_a_release_that_ended_the_hold_is_answered_held_once() {
    // A doubled release, or one whose copies took two connections: the copy that comes after
    // the hold ended must not tell its reader that the blocks it read may have been reused.
    let (mut h, mut stats) = (holds(), WorkerStats::default());
    let now = Instant::now();
    h.hold(now, &held("a"), &mut stats);
    h.release(now, &sender(), release("a", 0, 2, Some(1)), connected, &mut stats);
    let effects = h.release(now, &sender(), release("a", 1, 2, Some(2)), connected, &mut stats);
    assert_eq!(effects, [HoldEffect::Freed("a".into()), answer("a", 2, true)]);
    assert_eq!(
        h.release(now, &sender(), release("a", 1, 2, Some(2)), connected, &mut stats),
        [answer("a", 2, true)]
    );
    assert_eq!(
        h.release(now, &sender(), release("a", 0, 2, Some(1)), connected, &mut stats),
        [],
        "answered once"
    );
    // A replayed offer's READ (the same reader, another token) is told "not held".
    h.hold(now, &held("b"), &mut stats);
    h.release(now, &sender(), release("b", 0, 1, Some(3)), connected, &mut stats);
    assert_eq!(
        h.release(now, &sender(), release("b", 0, 1, Some(4)), connected, &mut stats),
        [answer("b", 4, false)]
    );
}

#[test]
fn a_wrong_nonce_or_another_count_of_readers_frees_nothing() {
    let (mut h, mut stats) = (holds(), WorkerStats::default());
    let now = Instant::now();
    h.hold(now, &held("a"), &mut stats);
    let forged = HoldRelease { nonce: nonce("zz"), ..release("a", 0, 1, Some(1)) };
    assert_eq!(h.release(now, &sender(), forged, connected, &mut stats), []);
    h.release(now, &sender(), release("a", 0, 2, None), connected, &mut stats);
    assert_eq!(h.release(now, &sender(), release("a", 1, 3, Some(1)), connected, &mut stats), []);
    assert_eq!((h.len(), stats.rejected_notifications), (1, 2));
    let bad = release("a", 0, 0, None);
    assert_eq!(h.release(now, &sender(), bad, connected, &mut stats), [], "no readers: not a release");
}

#[test]
fn a_release_before_its_hold_is_kept_and_frees_it_when_it_comes() {
    let (mut h, mut stats) = (holds(), WorkerStats::default());
    let now = Instant::now();
    assert_eq!(h.release(now, &sender(), release("a", 0, 1, Some(4)), connected, &mut stats), []);
    assert_eq!((stats.early_notifications, h.early_len()), (1, (1, 1)));
    let effects = h.hold(now + SECOND, &held("a"), &mut stats);
    assert_eq!(effects, [HoldEffect::Freed("a".into()), answer("a", 4, true)]);
    assert!(h.is_empty());
    // Kept at most `early_release_ttl`.
    h.release(now, &sender(), release("b", 0, 1, None), connected, &mut stats);
    h.expire_buffers(now + 6 * SECOND, &mut stats);
    assert_eq!(h.hold(now + 6 * SECOND, &held("b"), &mut stats), []);
    assert_eq!(stats.stray_notifications, 1);
}

#[test]
fn a_lease_runs_out_unless_renewed_and_a_late_release_is_answered_not_held_once() {
    let (mut h, mut stats) = (holds(), WorkerStats::default());
    let t0 = Instant::now();
    h.hold(t0, &held("a"), &mut stats);
    h.hold(t0, &held("b"), &mut stats);
    assert_eq!(h.next_deadline(), Some(t0 + 10 * SECOND));
    let renew = |id: &str| RenewLeases { holds: vec![held(id)], pushes: Vec::new() };
    h.renew(t0 + 5 * SECOND, renew("a"), &mut stats);
    // A heartbeat with the wrong nonce extends nothing.
    h.renew(
        t0 + 5 * SECOND,
        RenewLeases { holds: vec![HeldRequest { nonce: nonce("x"), ..held("b") }], pushes: Vec::new() },
        &mut stats,
    );
    assert_eq!(stats.leases_renewed, 1);
    assert_eq!(h.expire(t0 + 10 * SECOND, &mut stats), [HoldEffect::Freed("b".into())]);
    assert_eq!(h.expire(t0 + 14 * SECOND, &mut stats), []);
    assert_eq!(h.expire(t0 + 15 * SECOND, &mut stats), [HoldEffect::Freed("a".into())]);
    assert_eq!(stats.expired_holds, 2);
    let late = || release("b", 0, 1, Some(7));
    assert_eq!(
        h.release(t0 + 16 * SECOND, &sender(), late(), connected, &mut stats),
        [answer("b", 7, false)]
    );
    assert_eq!(h.release(t0 + 16 * SECOND, &sender(), late(), connected, &mut stats), [], "answered once");
}

#[test]
fn answers_to_this_engine_or_an_impossible_rank_are_not_sent() {
    let (mut h, mut stats) = (holds(), WorkerStats::default());
    let now = Instant::now();
    for (i, (engine, rank)) in
        [(RemoteCoordinates::at("prefill", "p", 5600), 0), (decode_engine(), MAX_TP)].into_iter().enumerate()
    {
        let id = format!("r{i}");
        h.hold(now, &held(&id), &mut stats);
        let reply_to = Some(ReplyTo { engine, rank, ..reply_to(1) });
        let r = HoldRelease { reply_to, ..release(&id, 0, 1, None) };
        assert_eq!(
            h.release(now, &sender(), r, connected, &mut stats),
            [HoldEffect::Freed(id.as_str().into())]
        );
    }
    assert_eq!(stats.unsent_messages, 2);
}

#[test]
fn close_ends_every_hold_in_order_and_forgets_the_buffers() {
    let (mut h, mut stats) = (holds(), WorkerStats::default());
    let now = Instant::now();
    let config = WorkerConfig::new("prefill".into(), 0, 1, 4);
    h.hold(now, &held("b"), &mut stats);
    h.hold(now, &held("a"), &mut stats);
    h.release(now, &sender(), release("c", 0, 1, None), connected, &mut stats);
    assert_eq!(h.close(&config), [RequestId::from("a"), "b".into()]);
    assert!(h.is_empty());
    assert_eq!(h.early_len(), (0, 0));
}

#[test]
fn a_forged_or_replayed_release_frees_no_hold() {
    let (mut h, mut stats) = (holds(), WorkerStats::default());
    let now = Instant::now();
    let forged = |id: &str| HoldRelease { nonce: HexBytes([0xee; 16]), ..release(id, 0, 1, None) };
    h.hold(now, &held("victim"), &mut stats);
    // Another client names the victim's request id: without its nonce, nothing is freed.
    assert_eq!(h.release(now, &sender(), forged("victim"), connected, &mut stats), []);
    assert_eq!(stats.rejected_notifications, 1);
    // The victim's real reader frees it.
    let freed = h.release(now, &sender(), release("victim", 0, 1, None), connected, &mut stats);
    assert_eq!(freed, [HoldEffect::Freed("victim".into())]);
    // Replayed after the hold ended, it frees no later hold of that id.
    assert_eq!(h.release(now, &sender(), release("victim", 0, 1, None), connected, &mut stats), []);
    let again = HeldRequest { request_id: "victim".into(), nonce: nonce("second") };
    assert_eq!(h.hold(now, &again, &mut stats), [], "the replay does not free the new hold");
    // A forged release that comes before its hold does not free it either.
    h.release(now, &sender(), forged("later"), connected, &mut stats);
    assert_eq!(h.hold(now, &held("later"), &mut stats), []);
    assert_eq!((stats.notifications, h.len()), (1, 2));
}

#[test]
fn a_flood_of_releases_for_unknown_holds_costs_bounded_state() {
    let mut config = WorkerConfig::new("prefill".into(), 0, 1, 4);
    config.early_releases_per_sender = 64;
    let (mut h, mut stats) = (Holds::new(&config, INSTANCE), WorkerStats::default());
    let now = Instant::now();
    h.hold(now, &held("real"), &mut stats);
    for round in 0..20 {
        for i in 0..1000 {
            let ghost = release(&format!("ghost-{round}-{i}"), 0, 1, None);
            assert_eq!(h.release(now, &sender(), ghost, connected, &mut stats), []);
        }
        assert!(h.early_len().0 <= 64);
    }
    assert_eq!(stats.stray_notifications, 20_000 - 64);
    // The real release still finds its hold, and the rest expire.
    let freed = h.release(now, &sender(), release("real", 0, 1, None), connected, &mut stats);
    assert_eq!(freed, [HoldEffect::Freed("real".into())]);
    assert!(h.next_deadline().is_some());
    h.expire_buffers(now + config.early_release_ttl, &mut stats);
    assert_eq!((h.early_len(), stats.stray_notifications), ((0, 0), 20_000));
    assert_eq!(stats.early_notifications_dropped, 20_000 - 64, "expired releases were not dropped");
}

/// A nonce at `place` in the scheduler's order (see `nonce_place`), its other half from `id`.
fn placed(id: &str, place: u64) -> Nonce {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&place.to_le_bytes());
    b[8..8 + id.len()].copy_from_slice(id.as_bytes());
    HexBytes(b)
}

/// The release of the hold `id` at `place` by its only reader, asking with `token`, naming the
/// prefill instance `instance`.
fn placed_release(id: &str, place: u64, token: u8, instance: Option<u64>) -> HoldRelease {
    HoldRelease { nonce: placed(id, place), instance, ..release(id, 0, 1, Some(token)) }
}

fn placed_answer(id: &str, place: u64, token: u8, held: bool) -> HoldEffect {
    let status =
        HoldStatus { request_id: id.into(), nonce: placed(id, place), held, token: HexBytes([token; 16]) };
    HoldEffect::Answer { engine: decode_engine(), rank: 1, instance: 3, status }
}

fn placed_hold(id: &str, place: u64) -> HeldRequest {
    HeldRequest { request_id: id.into(), nonce: placed(id, place) }
}

#[test]
fn a_release_of_a_hold_not_handed_over_yet_is_answered_held_at_once_and_frees_it_when_it_comes() {
    let (mut h, mut stats) = (holds(), WorkerStats::default());
    let now = Instant::now();
    h.hold(now, &placed_hold("a", 1), &mut stats);
    let mine = Some(INSTANCE);
    let effects = h.release(now, &sender(), placed_release("b", 2, 5, mine), connected, &mut stats);
    assert_eq!(effects, [placed_answer("b", 2, 5, true)]);
    assert_eq!((stats.early_answers, stats.early_notifications, h.early_len()), (1, 1, (1, 1)));
    // The hold comes: freed by the release that waited, not answered again.
    assert_eq!(h.hold(now + SECOND, &placed_hold("b", 2), &mut stats), [HoldEffect::Freed("b".into())]);
    assert!(h.early_len() == (0, 0) && h.len() == 1);
    // A decode worker not connected yet waits for the hold (answering it would mean handshaking
    // with whatever engine a release names).
    let effects = h.release(now, &sender(), placed_release("c", 3, 6, mine), |_: &ReplyTo| false, &mut stats);
    assert_eq!(effects, []);
    let effects = h.hold(now + SECOND, &placed_hold("c", 3), &mut stats);
    assert_eq!(effects, [HoldEffect::Freed("c".into()), placed_answer("c", 3, 6, true)]);
    // A release naming another instance of this engine, or none, waits for its hold too: the
    // order of nonces is this instance's.
    for instance in [Some(INSTANCE + 1), None] {
        assert_eq!(h.release(now, &sender(), placed_release("d", 9, 7, instance), connected, &mut stats), []);
    }
    assert_eq!(stats.early_answers, 1);
}

#[test]
fn a_release_of_a_hold_handed_over_and_forgotten_is_answered_not_held_at_once() {
    let (mut h, mut stats) = (holds(), WorkerStats::default());
    let now = Instant::now();
    h.hold(now, &placed_hold("a", 1), &mut stats);
    h.hold(now, &placed_hold("b", 2), &mut stats);
    // "gone" was handed over before "b" and is neither live nor remembered: it will not come.
    let mine = Some(INSTANCE);
    let effects = h.release(now, &sender(), placed_release("gone", 1, 5, mine), connected, &mut stats);
    assert_eq!(effects, [placed_answer("gone", 1, 5, false)]);
    let effects =
        h.release(now, &sender(), placed_release("gone", 2, 6, mine), |_: &ReplyTo| false, &mut stats);
    assert_eq!(effects, [], "nobody connected to answer");
    assert_eq!((h.early_len(), stats.early_answers, stats.stray_notifications), ((0, 0), 1, 2));
    // A release with a forged nonce placed ahead gets its "held" (it read nothing it may use),
    // but frees nothing: the hold that comes has another nonce.
    let forged = HoldRelease { nonce: placed("forged", 3), ..placed_release("c", 3, 7, mine) };
    assert_eq!(h.release(now, &sender(), forged, connected, &mut stats).len(), 1);
    assert_eq!(h.hold(now, &placed_hold("c", 3), &mut stats), []);
    assert_eq!(h.len(), 3);
}
