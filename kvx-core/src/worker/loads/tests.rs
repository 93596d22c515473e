//! `Loads` on its own: events in, effects out. No agent, no peers, no runtime.

use std::time::Duration;

use super::*;
use crate::auth::HexBytes;
use crate::ids::GroupBlocks;
use crate::meta::HoldStatus;
use crate::worker::WorkerStats;

const SECOND: Duration = Duration::from_secs(1);

fn loads() -> Loads {
    let mut config = WorkerConfig::new("decode".into(), 0, 1, 4);
    config.transfer_timeout = 10 * SECOND;
    config.confirm_timeout = 5 * SECOND;
    Loads::new(&config)
}

fn nonce(id: &str) -> Nonce {
    let mut b = [0u8; 16];
    b[..id.len()].copy_from_slice(id.as_bytes());
    HexBytes(b)
}

fn request(id: &str) -> RecvRequest {
    RecvRequest {
        prompt: None,
        request_id: id.into(),
        remote_request_id: None,
        local_block_ids: vec![GroupBlocks::whole(vec![1, 2])],
        remote_block_ids: vec![GroupBlocks::whole(vec![5, 6])],
        remote: RemoteCoordinates::at("prefill", "h", 5600),
        nonce: Some(nonce(id)),
        mac: None,
        remote_instance: None,
        remote_tp_size: None,
    }
}

/// Reads every head from prefill ranks `ranks`, each read by this rank alone.
fn reading(ranks: &[u32]) -> Vec<Target> {
    let read = Some(Slice { remote_head: 0, local_head: 0, heads: 1 });
    ranks.iter().map(|&rank| Target { rank, read, readers: 1 }).collect()
}

fn key(id: &str, rank: u32) -> LoadKey {
    LoadKey::new(id.into(), rank)
}

fn peer(rank: u32) -> PeerKey {
    ("prefill".into(), rank)
}

fn agent() -> AgentName {
    AgentName::new("peer")
}

fn posted(xfer: u64, token: u8) -> Posted {
    Posted { xfer: XferId(xfer), peer: agent(), token: HexBytes([token; 16]), bytes: 64, descriptors: 2 }
}

fn status(id: &str, token: u8, held: bool) -> HoldStatus {
    HoldStatus { request_id: id.into(), nonce: nonce(id), held, token: HexBytes([token; 16]) }
}

fn free_hold(id: &str, rank: u32) -> LoadEffect {
    let release = free_at_once(&request(id), 0, 1).unwrap();
    LoadEffect::FreeHold { remote: request(id).remote, rank, release }
}

fn link_down() -> Error {
    Error::new(ErrorKind::Transfer, "link down")
}

/// Admits `id` reading from `ranks` and posts each READ (transfer `rank + 1`, token `rank`) to
/// instance 1.
fn admit_and_post(l: &mut Loads, now: Instant, id: &str, ranks: &[u32]) {
    let effects = l.admit(now, &request(id), &reading(ranks));
    assert_eq!(effects.len(), ranks.len());
    for &rank in ranks {
        let effects = l.issue(now, &key(id, rank), Some(1));
        assert!(matches!(&effects[..], [LoadEffect::Post(p)] if p.key == key(id, rank) && p.instance == 1));
        let token = u8::try_from(rank).unwrap();
        assert_eq!(l.posted(now, &key(id, rank), 1, Ok(posted(u64::from(rank) + 1, token))), []);
    }
}

#[test]
fn admit_waits_for_each_peer_read_and_frees_the_ranks_only_released() {
    let mut l = loads();
    let mut targets = reading(&[0]);
    targets.push(Target { rank: 1, read: None, readers: 2 });
    let effects = l.admit(Instant::now(), &request("a"), &targets);
    let release = free_at_once(&request("a"), 0, 2).unwrap();
    assert_eq!(
        effects,
        [
            LoadEffect::AwaitPeer { key: key("a", 0), remote: request("a").remote, free: Free::Now },
            LoadEffect::FreeHold { remote: request("a").remote, rank: 1, release },
        ]
    );
    assert_eq!(l.len(), 1);
    assert!(l.is_loading(&"a".into(), None));
    assert!(l.is_loading(&"other".into(), Some(nonce("a"))), "one load per offer");
}

#[test]
fn a_read_done_and_confirmed_is_loaded_with_its_times_and_transfer() {
    let (mut l, mut stats) = (loads(), WorkerStats::default());
    let t0 = Instant::now();
    admit_and_post(&mut l, t0, "a", &[0]);
    assert!(l.reads_from(&agent()));
    assert_eq!(l.next_deadline(), Some(t0 + 10 * SECOND));
    assert_eq!(l.take_completed(XferId(1)), Some(key("a", 0)));
    assert_eq!(l.take_completed(XferId(1)), None, "each transfer ends once");
    let effects = l.read_ended(t0 + SECOND, &key("a", 0), Ok(()), &mut stats);
    assert_eq!(effects, [LoadEffect::ReleaseTransfer(XferId(1))]);
    assert!(!l.reads_from(&agent()));
    assert_eq!(l.next_deadline(), Some(t0 + 6 * SECOND), "now the confirmation's");
    let effects = l.answer(t0 + 2 * SECOND, &agent(), &status("a", 0, true), &mut stats);
    assert_eq!(effects, [LoadEffect::Loaded("a".into())]);
    assert!(l.is_empty());
    assert_eq!(stats.bytes_read, 64);
    assert_eq!(l.take_transfers(), [TransferRecord { duration: SECOND, bytes: 64, descriptors: 2 }]);
    let times = l.take_times();
    assert_eq!(times.len(), 1);
    assert_eq!((times[0].read_done, times[0].confirmed), (t0 + SECOND, t0 + 2 * SECOND));
    assert_eq!(stats.confirm_waits.take(), [SECOND]);
}

#[test]
fn an_answer_before_the_read_is_seen_done_confirms_it_then() {
    let (mut l, mut stats) = (loads(), WorkerStats::default());
    let now = Instant::now();
    admit_and_post(&mut l, now, "a", &[0]);
    assert_eq!(l.answer(now, &agent(), &status("a", 0, true), &mut stats), []);
    l.take_completed(XferId(1));
    let effects = l.read_ended(now, &key("a", 0), Ok(()), &mut stats);
    assert_eq!(effects, [LoadEffect::ReleaseTransfer(XferId(1)), LoadEffect::Loaded("a".into())]);
}

#[test]
fn only_the_answer_to_the_reads_own_token_and_peer_confirms_it() {
    let (mut l, mut stats) = (loads(), WorkerStats::default());
    let now = Instant::now();
    admit_and_post(&mut l, now, "a", &[0]);
    assert_eq!(l.answer(now, &agent(), &status("a", 9, true), &mut stats), []);
    assert_eq!(l.answer(now, &AgentName::new("other"), &status("a", 0, true), &mut stats), []);
    assert_eq!(l.answer(now, &agent(), &status("b", 0, true), &mut stats), []);
    assert_eq!(stats.stray_notifications, 3);
    l.take_completed(XferId(1));
    assert_eq!(l.read_ended(now, &key("a", 0), Ok(()), &mut stats), [LoadEffect::ReleaseTransfer(XferId(1))]);
}

#[test]
fn a_hold_that_ended_before_the_release_fails_the_load_without_freeing_again() {
    let (mut l, mut stats) = (loads(), WorkerStats::default());
    let now = Instant::now();
    admit_and_post(&mut l, now, "a", &[0]);
    l.take_completed(XferId(1));
    l.read_ended(now, &key("a", 0), Ok(()), &mut stats);
    let effects = l.answer(now, &agent(), &status("a", 0, false), &mut stats);
    assert!(matches!(&effects[..], [LoadEffect::Failed { error, .. }] if error.kind() == ErrorKind::Expired));
    assert_eq!(stats.lease_failures, 1);
    assert!(l.take_transfers().is_empty());
}

#[test]
fn a_failed_read_is_posted_again_only_to_a_new_instance() {
    let (mut l, mut stats) = (loads(), WorkerStats::default());
    let now = Instant::now();
    for (id, instance) in [("a", 1), ("b", 2)] {
        admit_and_post(&mut l, now, id, &[0]);
        assert_eq!(l.take_completed(XferId(1)), Some(key(id, 0)));
        let remote = request(id).remote;
        let effects = l.read_ended(now, &key(id, 0), Err(link_down()), &mut stats);
        assert_eq!(
            effects,
            [
                LoadEffect::ReleaseTransfer(XferId(1)),
                LoadEffect::DropPeer { peer: peer(0), agent: Some(agent()) },
                LoadEffect::AwaitPeer { key: key(id, 0), remote, free: Free::No },
            ]
        );
        let effects = l.issue(now, &key(id, 0), Some(instance));
        if instance == 1 {
            // The same instance: the READ's failure stands.
            assert!(
                matches!(&effects[..], [f @ LoadEffect::FreeHold { .. }, LoadEffect::Failed { error, .. }]
                if *f == free_hold(id, 0) && error.kind() == ErrorKind::Transfer)
            );
        } else {
            assert!(matches!(&effects[..], [LoadEffect::Post(p)] if p.instance == 2));
        }
    }
    assert_eq!(stats.reads_failed, 2);
}

#[test]
fn the_first_failure_ends_the_waiting_and_confirming_siblings_and_waits_for_those_in_flight() {
    let (mut l, mut stats) = (loads(), WorkerStats::default());
    let now = Instant::now();
    l.admit(now, &request("a"), &reading(&[0, 1, 2, 3]));
    // Rank 1 reads, rank 2 is confirming, rank 3 waits for its handshake.
    for rank in [1, 2] {
        l.issue(now, &key("a", rank), Some(1));
        l.posted(now, &key("a", rank), 1, Ok(posted(u64::from(rank), 0)));
    }
    l.take_completed(XferId(2));
    l.read_ended(now, &key("a", 2), Ok(()), &mut stats);
    // Rank 0's post is refused for good.
    l.issue(now, &key("a", 0), Some(1));
    let refused = Error::invalid_peer_data("bad blocks");
    let effects = l.posted(now, &key("a", 0), 1, Err(refused));
    // Its own rank and the waiting one are told to free; the confirming one's release went with
    // its READ. Not reported yet: rank 1's READ is in flight.
    assert_eq!(effects, [free_hold("a", 0), free_hold("a", 3)]);
    assert_eq!(l.len(), 1);
    l.take_completed(XferId(1));
    let effects = l.read_ended(now, &key("a", 1), Ok(()), &mut stats);
    assert!(
        matches!(&effects[..], [LoadEffect::ReleaseTransfer(XferId(1)), LoadEffect::Failed { request_id, error }]
        if request_id.as_str() == "a" && error.kind() == ErrorKind::InvalidPeerData)
    );
    assert!(l.is_empty());
    assert!(!l.is_loading(&"b".into(), Some(nonce("a"))), "the offer is forgotten with its load");
}

#[test]
fn an_offer_of_another_instance_handshakes_again_once() {
    let mut l = loads();
    let now = Instant::now();
    let mut req = request("a");
    req.remote_instance = Some(HexBytes(7u64.to_le_bytes()));
    l.admit(now, &req, &reading(&[0]));
    let effects = l.issue(now, &key("a", 0), Some(1));
    assert_eq!(
        effects,
        [
            LoadEffect::DropPeer { peer: peer(0), agent: None },
            LoadEffect::AwaitPeer { key: key("a", 0), remote: req.remote.clone(), free: Free::No },
        ]
    );
    let effects = l.issue(now, &key("a", 0), Some(1));
    assert!(matches!(&effects[..], [LoadEffect::Failed { error, .. }] if error.kind() == ErrorKind::Expired));
    // At the offer's instance it would have been posted.
    l.admit(now, &RecvRequest { request_id: "b".into(), nonce: Some(nonce("b")), ..req }, &reading(&[0]));
    assert!(matches!(&l.issue(now, &key("b", 0), Some(7))[..], [LoadEffect::Post(_)]));
}

#[test]
fn a_peer_not_ready_any_more_is_waited_for_again() {
    let mut l = loads();
    let now = Instant::now();
    l.admit(now, &request("a"), &reading(&[0]));
    let effects = l.issue(now, &key("a", 0), None);
    assert_eq!(
        effects,
        [LoadEffect::AwaitPeer { key: key("a", 0), remote: request("a").remote, free: Free::No }]
    );
    assert_eq!(l.issue(now, &key("gone", 0), Some(1)), [], "an ended load is not posted");
}

#[test]
fn overdue_reads_and_confirmations_time_out_and_free_their_holds() {
    let (mut l, mut stats) = (loads(), WorkerStats::default());
    let t0 = Instant::now();
    admit_and_post(&mut l, t0, "a", &[0]);
    admit_and_post(&mut l, t0, "b", &[1]);
    l.take_completed(XferId(2));
    l.read_ended(t0 + SECOND, &key("b", 1), Ok(()), &mut stats);
    assert!(l.take_due(t0 + 5 * SECOND).is_empty());
    // The READ is due at 10 s; the confirmation at 6 s (and its READ's stale entry at 10 s).
    assert_eq!(l.take_due(t0 + 10 * SECOND), [key("a", 0), key("b", 1)]);
    let now = t0 + 10 * SECOND;
    let read = l.overdue(now, &key("a", 0)).unwrap();
    assert_eq!(read, Overdue { peer: peer(0), agent: agent(), transfer: Some(XferId(1)) });
    let confirm = l.overdue(now, &key("b", 1)).unwrap();
    assert_eq!(confirm.transfer, None);
    // A READ that cannot be cancelled yet is looked at again.
    l.recheck(now, key("a", 0));
    assert_eq!(l.take_due(now), [key("a", 0)]);
    for (id, rank) in [("a", 0), ("b", 1)] {
        let effects = l.time_out(now, &key(id, rank), &mut stats);
        assert!(matches!(&effects[..], [f @ LoadEffect::FreeHold { .. }, LoadEffect::Failed { error, .. }]
            if *f == free_hold(id, rank) && error.kind() == ErrorKind::Timeout));
    }
    assert_eq!((stats.reads_failed, stats.lease_failures), (1, 1));
    assert!(l.is_empty());
    assert_eq!(l.overdue(now, &key("a", 0)), None);
}

#[test]
fn a_restarted_engine_fails_the_confirmations_of_its_old_instance() {
    let (mut l, mut stats) = (loads(), WorkerStats::default());
    let now = Instant::now();
    admit_and_post(&mut l, now, "a", &[0]);
    admit_and_post(&mut l, now, "b", &[1]);
    for (xfer, id, rank) in [(1, "a", 0), (2, "b", 1)] {
        l.take_completed(XferId(xfer));
        l.read_ended(now, &key(id, rank), Ok(()), &mut stats);
    }
    assert_eq!(l.peer_restarted(now, &peer(0), 2, &mut stats), [], "not the instance read from");
    let effects = l.peer_restarted(now, &peer(0), 1, &mut stats);
    assert!(matches!(&effects[..], [LoadEffect::Failed { request_id, .. }] if request_id.as_str() == "a"));
    assert_eq!((stats.lease_failures, l.len()), (1, 1));
}

#[test]
fn a_failed_handshake_hands_the_release_back() {
    let mut l = loads();
    let now = Instant::now();
    l.admit(now, &request("a"), &reading(&[0]));
    let failed = l.handshake_failed(now, &key("a", 0), Error::new(ErrorKind::Incompatible, "layout"));
    assert_eq!(failed.release, free_at_once(&request("a"), 0, 1));
    assert!(matches!(&failed.effects[..], [LoadEffect::Failed { .. }]));
    assert_eq!(l.handshake_failed(now, &key("a", 0), link_down()), HandshakeFailed::default());
}

#[test]
fn close_ends_everything_and_frees_only_the_reads_not_completed() {
    let (mut l, mut stats) = (loads(), WorkerStats::default());
    let now = Instant::now();
    admit_and_post(&mut l, now, "b", &[0]);
    admit_and_post(&mut l, now, "a", &[1]);
    l.take_completed(XferId(2));
    l.read_ended(now, &key("a", 1), Ok(()), &mut stats);
    l.admit(now, &request("c"), &reading(&[0]));
    let closed = l.close(&mut stats);
    assert_eq!(closed.transfers, [XferId(1)]);
    let release = |id| free_at_once(&request(id), 0, 1).unwrap();
    assert_eq!(
        closed.releases,
        [
            PeerRelease { peer: peer(0), release: release("b") },
            PeerRelease { peer: peer(0), release: release("c") }
        ]
    );
    assert_eq!(closed.failed, [RequestId::from("a"), "b".into(), "c".into()]);
    assert_eq!(stats.reads_failed, 1);
    assert!(l.is_empty() && l.next_deadline().is_none() && !l.is_loading(&"x".into(), Some(nonce("a"))));
}
