//! `Registrations` on its own: admissions, sends, results and time in, effects out.

use super::*;
use crate::auth::HexBytes;
use crate::ids::GroupBlocks;
use crate::params::RemoteCoordinates;

const SECOND: Duration = Duration::from_secs(1);

fn registrations() -> Registrations {
    let mut config = WorkerConfig::new("decode".into(), 0, 1, 4);
    config.transfer_timeout = 10 * SECOND;
    config.confirm_timeout = 2 * SECOND;
    Registrations::new(&config)
}

fn req(id: &str) -> RecvRequest {
    RecvRequest {
        prompt: None,
        request_id: id.into(),
        remote_request_id: Some(format!("p-{id}").as_str().into()),
        local_block_ids: vec![GroupBlocks::whole(vec![1, 2])],
        remote_block_ids: Vec::new(),
        remote: RemoteCoordinates::at("prefill", "p", 5600),
        nonce: None,
        mac: None,
        remote_instance: None,
        remote_tp_size: Some(2),
    }
}

/// Two prefill ranks, each holding one of this rank's heads.
fn targets() -> Vec<Target> {
    (0..2)
        .map(|rank| Target {
            rank,
            read: Some(Slice { remote_head: 0, local_head: rank, heads: 1 }),
            readers: 1,
        })
        .collect()
}

fn tokens() -> impl FnMut() -> Nonce {
    let mut n = 0u8;
    move || {
        n += 1;
        HexBytes([n; 16])
    }
}

fn result(id: &str, token: u8, written: bool) -> PushResult {
    PushResult {
        request_id: format!("p-{id}").as_str().into(),
        token: HexBytes([token; 16]),
        written,
        reason: "why".into(),
    }
}

fn agent(rank: u32) -> AgentName {
    AgentName::new(format!("prefill-{rank}"))
}

/// Admitted and sent to both ranks.
fn registered(r: &mut Registrations, stats: &mut WorkerStats, now: Instant) {
    let effects = r.admit(&req("r"), &targets(), tokens());
    assert_eq!(effects.len(), 2);
    for rank in 0..2 {
        assert!(r.sent(now, &LoadKey::new("r".into(), rank), Ok((agent(rank), 7)), stats).is_empty());
    }
}

#[test]
fn a_load_is_done_when_every_rank_wrote_and_only_its_agent_can_say_so() {
    let (mut r, mut stats, now) = (registrations(), WorkerStats::default(), Instant::now());
    registered(&mut r, &mut stats, now);
    assert!(
        r.result(now, &agent(1), result("r", 1, true), &mut stats).is_empty(),
        "rank 0's token from rank 1"
    );
    assert!(r.result(now, &agent(0), result("x", 1, true), &mut stats).is_empty(), "another request");
    assert_eq!(stats.rejected_notifications, 2);
    assert!(r.result(now, &agent(0), result("r", 1, true), &mut stats).is_empty());
    assert_eq!(r.result(now, &agent(1), result("r", 2, true), &mut stats), [RegEffect::Loaded("r".into())]);
    assert!(r.is_empty() && stats.pushes_written == 2);
    assert!(r.result(now, &agent(0), result("r", 1, true), &mut stats).is_empty(), "a copy is stray");
}

#[test]
fn one_rank_not_written_cancels_the_other_and_the_load_fails_once_both_settle() {
    let (mut r, mut stats, now) = (registrations(), WorkerStats::default(), Instant::now());
    registered(&mut r, &mut stats, now);
    let effects = r.result(now, &agent(0), result("r", 1, false), &mut stats);
    assert_eq!(
        effects,
        [RegEffect::Cancel {
            peer: ("prefill".into(), 1),
            request_id: "p-r".into(),
            token: HexBytes([2; 16])
        }]
    );
    // Rank 1's WRITE had landed: the load still fails (rank 0 wrote nothing).
    let done = r.result(now, &agent(1), result("r", 2, true), &mut stats);
    assert!(matches!(&done[..], [RegEffect::Failed { request_id, error }]
        if request_id.as_str() == "r" && error.message().contains("prefill rank 0 did not write: why")));
}

#[test]
fn a_registration_nobody_writes_is_cancelled_and_given_up_on_if_the_cancel_is_not_answered() {
    let (mut r, mut stats, now) = (registrations(), WorkerStats::default(), Instant::now());
    registered(&mut r, &mut stats, now);
    assert!(r.result(now, &agent(1), result("r", 2, true), &mut stats).is_empty());
    // Unanswered, it is sent again every tenth of the confirmation's wait.
    assert_eq!(r.next_deadline(), Some(now + SECOND / 5));
    assert_eq!(r.expire(now + SECOND / 5, &mut stats), [RegEffect::Resend(LoadKey::new("r".into(), 0))]);
    assert!(r.to_resend(&LoadKey::new("r".into(), 0)).is_some());
    let cancels = r.expire(now + 10 * SECOND, &mut stats);
    assert!(matches!(&cancels[..], [RegEffect::Cancel { peer, .. }] if peer.1 == 0), "{cancels:?}");
    assert_eq!(stats.push_cancels, 1);
    let given_up = r.expire(now + 12 * SECOND, &mut stats);
    assert!(
        matches!(&given_up[..], [RegEffect::DropPeer { peer, .. }, RegEffect::Failed { error, .. }]
            if peer.1 == 0 && error.kind() == ErrorKind::Timeout),
        "{given_up:?}"
    );
    assert_eq!(stats.push_cancels_unanswered, 1);
}

#[test]
fn a_restarted_prefill_engine_fails_the_registrations_it_had_at_once() {
    let (mut r, mut stats, now) = (registrations(), WorkerStats::default(), Instant::now());
    registered(&mut r, &mut stats, now);
    assert!(r.peer_restarted(now, &("prefill".into(), 0), 6).is_empty(), "another instance");
    let effects = r.peer_restarted(now, &("prefill".into(), 0), 7);
    assert!(matches!(&effects[..], [RegEffect::Cancel { peer, .. }] if peer.1 == 1), "{effects:?}");
    let done = r.result(now, &agent(1), result("r", 2, false), &mut stats);
    assert!(matches!(&done[..], [RegEffect::Failed { error, .. }] if error.message().contains("restarted")));
}

#[test]
fn a_registration_that_could_not_be_sent_fails_the_load_after_the_others_settle() {
    let (mut r, mut stats, now) = (registrations(), WorkerStats::default(), Instant::now());
    r.admit(&req("r"), &targets(), tokens());
    r.sent(now, &LoadKey::new("r".into(), 0), Ok((agent(0), 7)), &mut stats);
    let failed =
        r.sent(now, &LoadKey::new("r".into(), 1), Err(Error::new(ErrorKind::Handshake, "no")), &mut stats);
    assert!(matches!(&failed[..], [RegEffect::Cancel { peer, .. }] if peer.1 == 0), "{failed:?}");
    let done = r.result(now, &agent(0), result("r", 1, false), &mut stats);
    assert!(matches!(&done[..], [RegEffect::Failed { error, .. }] if error.kind() == ErrorKind::Handshake));
    let (ids, cancels) = r.close();
    assert!(ids.is_empty() && cancels.is_empty());
}
