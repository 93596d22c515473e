//! `Pushes` on its own: holds, registrations, cancels, WRITE outcomes and time in, effects out.

use super::*;
use crate::error::{Error, ErrorKind};
use crate::params::RemoteCoordinates;

const SECOND: Duration = Duration::from_secs(1);
const INSTANCE: u64 = 9;

fn pushes(key: Option<&str>) -> Pushes {
    let mut config = WorkerConfig::new("prefill".into(), 0, 1, 4);
    config.lease_duration = 10 * SECOND;
    config.early_release_ttl = 5 * SECOND;
    config.early_releases_per_sender = 8;
    config.auth_key = key.map(|k| AuthKey::new(k).unwrap());
    Pushes::new(&config, INSTANCE)
}

fn hold(id: &str, ids: &[u32]) -> PushHold {
    PushHold::new(id.into(), vec![GroupBlocks::whole(ids.to_vec())])
}

fn registration(id: &str, token: u8, blocks: &[u32]) -> PushRegistration {
    PushRegistration {
        prompt: None,
        request_id: id.into(),
        reply_to: ReplyTo {
            engine: RemoteCoordinates::at("decode", "d", 5700),
            rank: 0,
            instance: 3,
            token: HexBytes([token; 16]),
        },
        groups: vec![GroupBlocks::whole(blocks.to_vec())],
        heads: Some(Slice { remote_head: 0, local_head: 0, heads: 1 }),
        reader: 0,
        readers: 1,
        instance: Some(INSTANCE),
        valid_ms: 60_000,
        mac: None,
    }
}

fn from(name: &str) -> AgentName {
    AgentName::new(name)
}

fn refusals(effects: &[PushEffect]) -> Vec<String> {
    effects
        .iter()
        .filter_map(|e| match e {
            PushEffect::Answer { reason, written: false, .. } => Some(reason.clone()),
            _ => None,
        })
        .collect()
}

fn key(id: &str) -> PushKey {
    PushKey { request_id: id.into(), reader: 0 }
}

#[test]
fn a_registration_before_its_hold_is_written_when_the_hold_comes_and_the_hold_ends_with_it() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    let early = p.register(now, &from("d"), registration("r", 1, &[7, 8]), |_| true, false, &mut stats);
    assert!(early.is_empty() && stats.early_notifications == 1);
    let effects = p.hold(now, &hold("r", &[1, 2, 3]), &mut stats);
    assert_eq!(effects, [PushEffect::Write(key("r"))]);
    let job = p.job(&key("r")).unwrap();
    assert_eq!((job.local.clone(), job.remote.clone()), (vec![1, 2], vec![7, 8]), "index by index");
    assert!(p.posted(now, &key("r"), Ok((XferId(5), from("d"), 64)), &mut stats).is_empty());
    assert!(p.writes_to(&from("d")));
    assert_eq!(p.take_write(XferId(5)), Some(key("r")));
    let done = p.write_ended(now, &key("r"), Ok(()), &mut stats);
    assert_eq!(done, [PushEffect::Freed("r".into())]);
    assert_eq!((stats.writes_posted, stats.bytes_written, p.len()), (1, 64, 0));
    // The registration again after the hold ended (its decode worker did not hear the WRITE's
    // notification): "written" again, since the WRITE ended well; a bounded number of times.
    let again: Vec<_> = (0..20)
        .flat_map(|_| p.register(now, &from("d"), registration("r", 1, &[7, 8]), |_| true, false, &mut stats))
        .collect();
    assert_eq!(again.len() as u32, MAX_ANSWERS_AGAIN);
    assert!(matches!(&again[0], PushEffect::Answer { written: true, .. }), "{again:?}");
    assert_eq!(stats.push_answers_again, u64::from(MAX_ANSWERS_AGAIN));
}

#[test]
fn a_forged_registration_is_refused_under_a_key_and_a_signed_one_is_taken() {
    let (mut p, mut stats, now) =
        (pushes(Some("the deployment key")), WorkerStats::default(), Instant::now());
    p.hold(now, &hold("r", &[1]), &mut stats);
    let unsigned = registration("r", 1, &[7]);
    let mut forged = registration("r", 2, &[7]);
    forged.mac = Some(forged.tag(&AuthKey::new("another deployment key").unwrap()));
    let mut tampered = registration("r", 3, &[7]);
    tampered.mac = Some(tampered.tag(&AuthKey::new("the deployment key").unwrap()));
    tampered.groups = vec![GroupBlocks::whole(vec![0])];
    for reg in [unsigned, forged, tampered] {
        assert!(p.register(now, &from("m"), reg, |_| true, false, &mut stats).is_empty());
    }
    assert_eq!(stats.rejected_notifications, 3);
    let mut signed = registration("r", 4, &[7]);
    signed.mac = Some(signed.tag(&AuthKey::new("the deployment key").unwrap()));
    assert_eq!(
        p.register(now, &from("d"), signed, |_| true, false, &mut stats),
        [PushEffect::Write(key("r"))]
    );
}

#[test]
fn a_flood_of_registrations_keeps_the_real_one() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    p.register(now, &from("d"), registration("real", 1, &[7]), |_| true, false, &mut stats);
    for i in 0..10_000 {
        p.register(
            now,
            &from("m"),
            registration(&format!("ghost-{i}"), 2, &[7]),
            |_| true,
            false,
            &mut stats,
        );
    }
    assert_eq!(stats.early_notifications_dropped, 10_000 - 8, "the flooder's own budget of 8");
    assert_eq!(p.hold(now, &hold("real", &[1]), &mut stats), [PushEffect::Write(key("real"))]);
}

#[test]
fn blocks_the_hold_lacks_and_a_second_reader_count_are_refused() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    p.hold(now, &hold("r", &[1, 2]), &mut stats);
    let too_many = p.register(now, &from("d"), registration("r", 1, &[7, 8, 9]), |_| true, false, &mut stats);
    assert_eq!(refusals(&too_many).len(), 1, "{too_many:?}");
    assert!(refusals(&too_many)[0].contains("positions 0..3 registered"), "{too_many:?}");
    assert_eq!(too_many.last(), Some(&PushEffect::Freed("r".into())), "its only reader is done");
    p.hold(now, &hold("two", &[1]), &mut stats);
    let mut first = registration("two", 1, &[7]);
    first.readers = 2;
    assert_eq!(
        p.register(now, &from("d"), first, |_| true, false, &mut stats),
        [PushEffect::Write(key("two"))]
    );
    let mut odd = registration("two", 2, &[7]);
    (odd.reader, odd.readers) = (1, 3);
    let refused = p.register(now, &from("d"), odd, |_| true, false, &mut stats);
    assert!(refusals(&refused)[0].contains("3 readers registered"), "{refused:?}");
    // The same reader again: the first registration stands.
    assert!(
        p.register(now, &from("d"), registration("two", 1, &[7]), |_| true, false, &mut stats).is_empty()
    );
}

#[test]
fn a_cancel_before_the_write_is_answered_and_one_for_a_kept_registration_stops_it() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    // Registered, the hold came, the decode worker is not ready yet: cancelled before the WRITE.
    p.hold(now, &hold("r", &[1]), &mut stats);
    p.register(now, &from("d"), registration("r", 1, &[7]), |_| true, false, &mut stats);
    let reg = registration("r", 1, &[7]);
    let cancelled =
        p.cancel(now, PushCancel { request_id: "r".into(), reply_to: reg.reply_to }, false, &mut stats);
    assert_eq!(refusals(&cancelled), ["cancelled before it was written"]);
    assert_eq!(cancelled.last(), Some(&PushEffect::Freed("r".into())));
    assert!(p.job(&key("r")).is_none());
    // Kept before its hold, then cancelled: the hold that comes does not write it.
    let kept = registration("k", 2, &[7]);
    p.register(now, &from("d"), kept.clone(), |_| true, false, &mut stats);
    let answer =
        p.cancel(now, PushCancel { request_id: "k".into(), reply_to: kept.reply_to }, true, &mut stats);
    assert_eq!(refusals(&answer).len(), 1, "a connected decode worker hears it will not be written");
    assert!(p.hold(now, &hold("k", &[1]), &mut stats).is_empty(), "nothing written");
}

#[test]
fn a_cancel_of_a_write_in_flight_waits_for_the_write() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    p.hold(now, &hold("r", &[1]), &mut stats);
    let reg = registration("r", 1, &[7]);
    p.register(now, &from("d"), reg.clone(), |_| true, false, &mut stats);
    p.posted(now, &key("r"), Ok((XferId(1), from("d"), 8)), &mut stats);
    let cancel = PushCancel { request_id: "r".into(), reply_to: reg.reply_to };
    assert!(p.cancel(now, cancel, true, &mut stats).is_empty(), "its WRITE's notification answers");
    let failed = p.write_ended(now, &key("r"), Err(Error::new(ErrorKind::Transfer, "lost")), &mut stats);
    assert_eq!(refusals(&failed).len(), 1);
    assert_eq!(failed.last(), Some(&PushEffect::Freed("r".into())));
}

#[test]
fn the_lease_cancels_writes_in_flight_and_frees_only_after_they_end() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    p.hold(now, &hold("r", &[1]), &mut stats);
    p.register(now, &from("d"), registration("r", 1, &[7]), |_| true, false, &mut stats);
    p.posted(now, &key("r"), Ok((XferId(1), from("d"), 8)), &mut stats);
    assert!(p.expire(now + 9 * SECOND, &mut stats).is_empty());
    assert_eq!(p.expire(now + 10 * SECOND, &mut stats), [PushEffect::Cancel(XferId(1))]);
    assert_eq!(p.len(), 1, "held while the WRITE may still read its blocks");
    let ended = p.write_ended(now, &key("r"), Err(Error::new(ErrorKind::Transfer, "cancelled")), &mut stats);
    assert_eq!(ended.last(), Some(&PushEffect::Freed("r".into())));
    // A hold nobody registered for ends with its lease; a registration after it is refused,
    // at most a bounded number of times.
    p.hold(now, &hold("idle", &[1]), &mut stats);
    assert_eq!(p.expire(now + 10 * SECOND, &mut stats), [PushEffect::Freed("idle".into())]);
    let answered: usize = (0..100u8)
        .map(|t| {
            let reg = registration("idle", t, &[7]);
            refusals(&p.register(now, &from("d"), reg, |_| false, false, &mut stats)).len()
        })
        .sum();
    assert_eq!(answered, MAX_EARLY_READERS);
}

#[test]
fn an_empty_hold_and_a_pull_hold_refuse_registrations_at_once() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    p.register(now, &from("d"), registration("aborted", 1, &[7]), |_| true, false, &mut stats);
    let refused = p.hold(now, &PushHold::new("aborted".into(), Vec::new()), &mut stats);
    assert!(refusals(&refused)[0].contains("kept no blocks"), "{refused:?}");
    p.register(now, &from("d"), registration("pulled", 2, &[7]), |_| true, false, &mut stats);
    let refused = p.pull_held(now, &"pulled".into(), &mut stats);
    assert!(refusals(&refused)[0].contains("the modes differ"), "{refused:?}");
    // Registered after the pull hold came, from a decode worker not connected yet: refused too.
    let after = p.register(now, &from("d"), registration("other", 3, &[7]), |_| false, true, &mut stats);
    assert!(refusals(&after)[0].contains("the modes differ"), "{after:?}");
}

#[test]
fn no_write_outlives_its_registrations_time() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    // Kept before its hold with 2 s left; the hold comes after 3 s: refused, not written.
    let mut short = registration("late", 1, &[7]);
    short.valid_ms = 2_000;
    p.register(now, &from("d"), short, |_| true, false, &mut stats);
    let refused = p.hold(now + 3 * SECOND, &hold("late", &[1]), &mut stats);
    assert_eq!(refusals(&refused), [TIME_RAN_OUT]);
    // Taken in time, posted, still in flight when its time runs out: cancelled then, and the
    // hold is freed once the WRITE ends.
    p.hold(now, &hold("r", &[1]), &mut stats);
    let mut reg = registration("r", 2, &[7]);
    reg.valid_ms = 5_000;
    p.register(now, &from("d"), reg, |_| true, false, &mut stats);
    p.posted(now, &key("r"), Ok((XferId(3), from("d"), 8)), &mut stats);
    assert!(p.expire(now + 4 * SECOND, &mut stats).is_empty());
    assert_eq!(p.expire(now + 5 * SECOND, &mut stats), [PushEffect::Cancel(XferId(3))]);
    let ended = p.write_ended(now, &key("r"), Err(Error::new(ErrorKind::Transfer, "cancelled")), &mut stats);
    assert_eq!(ended.last(), Some(&PushEffect::Freed("r".into())));
    // A registration claiming more than ten leases gets ten.
    let mut long = registration("long", 3, &[7]);
    long.valid_ms = u64::MAX;
    p.register(now, &from("d"), long, |_| true, false, &mut stats);
    assert_eq!(refusals(&p.hold(now + 101 * SECOND, &hold("long", &[1]), &mut stats)), [TIME_RAN_OUT]);
}

#[test]
fn heartbeats_keep_a_push_hold_for_at_most_ten_leases() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    p.hold(now, &hold("r", &[1]), &mut stats);
    let mut t = now;
    for _ in 0..20 {
        t += 5 * SECOND;
        p.renew(t, &["r".into(), "unknown".into()], &mut stats);
        if let [PushEffect::Freed(id)] = p.expire(t, &mut stats).as_slice() {
            assert_eq!(id.as_str(), "r");
            break;
        }
    }
    assert_eq!((p.len(), t.duration_since(now)), (0, 100 * SECOND), "freed at ten leases, renewed or not");
    assert!(stats.leases_renewed > 0);
}

#[test]
fn a_hold_is_registered_for_under_its_shared_id_and_freed_under_its_own() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    // vLLM names each engine's request with a random suffix: the router's id is what both legs share.
    let shared = |own: &str, ids: &[u32]| PushHold { registered_as: "cmpl-7-0".into(), ..hold(own, ids) };
    p.register(now, &from("d"), registration("cmpl-7-0", 1, &[7]), |_| true, false, &mut stats);
    assert_eq!(
        p.hold(now, &shared("cmpl-7-0-1a2b3c4d", &[1]), &mut stats),
        [PushEffect::Write(key("cmpl-7-0"))]
    );
    // A second request under the same shared id (a router reused it) is freed unpushed at once:
    // the first keeps the id and its registration.
    assert_eq!(
        p.hold(now, &shared("cmpl-7-0-99999999", &[2]), &mut stats),
        [PushEffect::Freed("cmpl-7-0-99999999".into())]
    );
    assert!(p.hold(now, &shared("cmpl-7-0-88888888", &[]), &mut stats).is_empty(), "nothing held");
    assert!(p.posted(now, &key("cmpl-7-0"), Ok((XferId(1), from("d"), 8)), &mut stats).is_empty());
    assert_eq!(p.take_write(XferId(1)), Some(key("cmpl-7-0")));
    let done = p.write_ended(now, &key("cmpl-7-0"), Ok(()), &mut stats);
    assert_eq!(done, [PushEffect::Freed("cmpl-7-0-1a2b3c4d".into())], "reported under the engine's own id");
}

#[test]
fn a_registration_of_another_prompt_is_refused_and_one_of_the_same_is_written() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    let digest = |b: u8| Some(HexBytes([b; 32]));
    // Two requests a router sent under one id: the decode leg of the other prompt registers first.
    p.hold(now, &PushHold { prompt: digest(1), ..hold("r", &[1]) }, &mut stats);
    let other = PushRegistration { prompt: digest(2), ..registration("r", 1, &[7]) };
    let refused = p.register(now, &from("d"), other, |_| true, false, &mut stats);
    assert_eq!(refusals(&refused), [OTHER_PROMPT]);
    let unknown = PushRegistration { prompt: None, ..registration("r", 2, &[7]) };
    let refused = p.register(now, &from("d"), unknown, |_| true, false, &mut stats);
    assert_eq!(refusals(&refused), [OTHER_PROMPT], "a hold that knows its prompt writes only that prompt");
    let same = PushRegistration { prompt: digest(1), ..registration("r", 3, &[7]) };
    assert_eq!(p.register(now, &from("d"), same, |_| true, false, &mut stats), [PushEffect::Write(key("r"))]);
    // Once the reader was taken, another prompt's registration is still answered at once.
    let late = PushRegistration { prompt: digest(2), ..registration("r", 4, &[7]) };
    let refused = p.register(now, &from("d"), late, |_| true, false, &mut stats);
    assert_eq!(refusals(&refused), [OTHER_PROMPT]);
}

#[test]
fn two_registrations_under_one_id_before_the_hold_are_both_kept_and_each_answered() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    let digest = |b: u8| Some(HexBytes([b; 32]));
    // Two decode requests of one decode rank, under the same id, before any hold: neither
    // stands for the other (a resend would carry the same token).
    let a = PushRegistration { prompt: digest(1), ..registration("r", 1, &[7]) };
    let b = PushRegistration { prompt: digest(2), ..registration("r", 2, &[8]) };
    for reg in [a.clone(), b, a] {
        assert!(p.register(now, &from("d"), reg, |_| true, false, &mut stats).is_empty());
    }
    assert_eq!(stats.stray_notifications, 1, "only the resend of a replaced its first copy");
    let effects = p.hold(now, &PushHold { prompt: digest(1), ..hold("r", &[1]) }, &mut stats);
    assert_eq!(refusals(&effects), [OTHER_PROMPT], "b answered at once");
    assert!(effects.contains(&PushEffect::Write(key("r"))), "a written: {effects:?}");
}

#[test]
fn a_hold_that_comes_after_its_registration_gave_up_is_freed_at_once() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    p.register(now, &from("d"), registration("late", 1, &[7]), |_| true, false, &mut stats);
    // The prefill engine did not get to the request within early_release_ttl (5 s here): the
    // decode leg is told, and fails or recomputes.
    let answered = p.expire_buffers(now + 6 * SECOND, |_| true, &mut stats);
    assert_eq!(refusals(&answered), ["no hold of the request came to the prefill engine in time"]);
    // Its hold, when it comes, has nobody to write to: its blocks go back at once, not at the
    // lease's end; a resend of the registration is refused.
    let held = p.hold(now + 7 * SECOND, &hold("late", &[1, 2]), &mut stats);
    assert_eq!(held, [PushEffect::Freed("late".into())]);
    assert!(p.is_empty());
    let again =
        p.register(now + 8 * SECOND, &from("d"), registration("late", 1, &[7]), |_| true, false, &mut stats);
    assert!(matches!(again.as_slice(), [PushEffect::Answer { written: false, .. }]), "{again:?}");
}

#[test]
fn a_registration_from_a_decode_worker_not_connected_expires_unanswered_and_its_hold_is_kept() {
    let (mut p, mut stats, now) = (pushes(None), WorkerStats::default(), Instant::now());
    p.register(now, &from("d"), registration("r", 1, &[7]), |_| true, false, &mut stats);
    // No handshake with whatever address an expired registration names: nothing is answered,
    // so its decode worker may still register, and the hold that comes waits for it.
    assert!(p.expire_buffers(now + 6 * SECOND, |_| false, &mut stats).is_empty());
    assert!(p.hold(now + 7 * SECOND, &hold("r", &[1]), &mut stats).is_empty());
    assert_eq!(p.len(), 1);
    let again =
        p.register(now + 8 * SECOND, &from("d"), registration("r", 1, &[7]), |_| true, false, &mut stats);
    assert_eq!(again, [PushEffect::Write(key("r"))]);
}
