//! What [`Chaos`](super::Chaos) injects: transfers that fail or lag, notifications that vanish,
//! double, lag or come with strays, handshakes that fail. Faults either name the n-th event, or
//! strike each event with a seeded chance.

use std::time::Duration;

use kvx_core::{HeldRequest, HexBytes, HoldRelease, HoldStatus, RenewLeases, ReplyTo, wire};

/// Faults to inject, set on a whole [`ChaosNet`](super::ChaosNet) or on one
/// [`Chaos`](super::Chaos) agent.
///
/// Counts start when the faults are set. Faults set on an agent count that agent's posts and
/// notifications; faults set on the net count those of all its agents. When both are set, a
/// fault of either applies (delays add up).
///
/// ```
/// use kvx_testkit::chaos::Faults;
/// // The second transfer posted from now on fails, and every transfer completes only on the
/// // third progress pass after it was posted.
/// let faults = Faults::none().fail_nth_transfer(2).delay_completion(2);
/// # let _ = faults;
/// ```
///
/// # Seeded chances
/// The methods that take a chance (`0.0..=1.0`) strike each event independently. Whether an
/// event is struck is a function of the [`seed`](Self::seed) and the event itself (the sending
/// agent, the receiving agent and the notification's bytes), not of the order events happen in:
/// the same run with the same seed meets the same faults. Delays are in the net's time
/// ([`ChaosNet::with_clock`](super::ChaosNet::with_clock)), uniform up to their maximum.
///
/// ```
/// use std::time::Duration;
/// use kvx_testkit::chaos::Faults;
/// let faults = Faults::none()
///     .seed(7)
///     .transfer_failures(0.01)
///     .transfer_delays(0.05, Duration::from_secs(2))
///     .notification_drops(0.01)
///     .notification_delays(0.02, Duration::from_millis(300))
///     .stray_notifications(0.01);
/// # let _ = faults;
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    fail_transfer: Option<u64>,
    delay_passes: u32,
    drop_notification: Option<u64>,
    duplicate_notification: Option<u64>,
    refuse_handshakes: bool,
    chances: Chances,
}

/// Seeded per-event chances, in parts per million.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Chances {
    seed: u64,
    fail_transfer: u32,
    delay_transfer: u32,
    max_transfer_delay: Duration,
    drop_notification: u32,
    duplicate_notification: u32,
    delay_notification: u32,
    max_notification_delay: Duration,
    stray_notification: u32,
}

const MILLION: u64 = 1_000_000;

fn per_million(chance: f64) -> u32 {
    (chance.clamp(0.0, 1.0) * MILLION as f64).round() as u32
}

impl Faults {
    /// No faults.
    pub fn none() -> Self {
        Faults::default()
    }

    /// The `n`-th transfer posted (counting from 1) fails: it is posted without its notification,
    /// and once the transport is done with it its state becomes `Failed` (its bytes are not to be
    /// trusted) and no notification is sent.
    pub fn fail_nth_transfer(mut self, n: u64) -> Self {
        self.fail_transfer = Some(n);
        self
    }

    /// Every transfer stays `Pending` through `passes` progress passes and completes on the next
    /// (or later, when its transport takes longer). A pass is one call of `progress`,
    /// `drain_completions` or `drain_notifications`.
    pub fn delay_completion(mut self, passes: u32) -> Self {
        self.delay_passes = passes;
        self
    }

    /// The `n`-th notification sent (counting from 1; with a transfer or alone) is lost. The
    /// transfer itself completes.
    pub fn drop_nth_notification(mut self, n: u64) -> Self {
        self.drop_notification = Some(n);
        self
    }

    /// The `n`-th notification sent (counting from 1) is delivered twice.
    pub fn duplicate_nth_notification(mut self, n: u64) -> Self {
        self.duplicate_notification = Some(n);
        self
    }

    /// Handshakes fail with `ErrorKind::Handshake`: on an agent, its `load_remote` and every peer's
    /// `load_remote` of its metadata (for peers of the same net); on the net, every `load_remote`.
    pub fn refuse_handshakes(mut self) -> Self {
        self.refuse_handshakes = true;
        self
    }

    /// The seed of the chances below (0 unless set).
    pub fn seed(mut self, seed: u64) -> Self {
        self.chances.seed = seed;
        self
    }

    /// Each transfer fails with this chance, as [`fail_nth_transfer`](Self::fail_nth_transfer)'s.
    pub fn transfer_failures(mut self, chance: f64) -> Self {
        self.chances.fail_transfer = per_million(chance);
        self
    }

    /// Each transfer completes, with this chance, only once the net's clock has passed its post
    /// time plus a delay of up to `max` (its bytes move when the transport moves them; its
    /// completion and its notification wait).
    pub fn transfer_delays(mut self, chance: f64, max: Duration) -> Self {
        self.chances.delay_transfer = per_million(chance);
        self.chances.max_transfer_delay = max;
        self
    }

    /// Each notification is lost with this chance.
    pub fn notification_drops(mut self, chance: f64) -> Self {
        self.chances.drop_notification = per_million(chance);
        self
    }

    /// Each notification is delivered twice with this chance.
    pub fn notification_duplicates(mut self, chance: f64) -> Self {
        self.chances.duplicate_notification = per_million(chance);
        self
    }

    /// Each notification is sent, with this chance, only once the net's clock has passed its send
    /// time (its transfer's completion, for a transfer's) plus a delay of up to `max`, at the
    /// sender's first progress pass after that.
    pub fn notification_delays(mut self, chance: f64, max: Duration) -> Self {
        self.chances.delay_notification = per_million(chance);
        self.chances.max_notification_delay = max;
        self
    }

    /// With this chance a notification comes with a stray one from the same sender, right after
    /// it: garbage bytes, a release ([`HoldRelease`]) for a request nobody holds, or the same
    /// release with another nonce (a forgery).
    pub fn stray_notifications(mut self, chance: f64) -> Self {
        self.chances.stray_notification = per_million(chance);
        self
    }
}

/// How many faults of each kind a net injected (its own faults and its agents').
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Transfers made to fail.
    pub transfers_failed: u64,
    /// Transfers whose completion was delayed (by passes or by time).
    pub transfers_delayed: u64,
    /// Notifications lost.
    pub notifications_dropped: u64,
    /// Notifications delivered twice.
    pub notifications_duplicated: u64,
    /// Notifications delivered late.
    pub notifications_delayed: u64,
    /// Stray notifications delivered.
    pub stray_notifications: u64,
}

impl FaultCounts {
    pub(super) fn count_transfer(&mut self, fate: &TransferFate) {
        self.transfers_failed += u64::from(fate.fail.is_some());
        self.transfers_delayed += u64::from(fate.delay_passes > 0 || !fate.delay.is_zero());
    }

    pub(super) fn count_delivery(&mut self, d: &Delivery) {
        self.notifications_dropped += u64::from(d.copies == 0);
        self.notifications_duplicated += u64::from(d.copies > 1);
        self.notifications_delayed += u64::from(d.copies > 0 && !d.delay.is_zero());
        self.stray_notifications += u64::from(d.stray.is_some());
    }
}

/// What happens to one notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Delivery {
    /// 0 (lost), 1 or 2.
    pub(super) copies: u8,
    pub(super) delay: Duration,
    /// The seed of a stray notification sent after it.
    pub(super) stray: Option<u64>,
}

/// Faults plus the counters they refer to.
#[derive(Debug, Default)]
pub(super) struct FaultPlan {
    faults: Faults,
    transfers: u64,
    notifications: u64,
}

/// What the plans decided for one posted transfer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct TransferFate {
    /// Why the transfer fails, when it does.
    pub(super) fail: Option<String>,
    pub(super) delay_passes: u32,
    pub(super) delay: Duration,
}

/// A 64-bit mixer (splitmix64's finaliser over `a` combined with `b`).
pub(super) fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of an event: a hash of its parts (names, bytes), independent of when it happens.
pub(super) fn event_key(parts: &[&[u8]]) -> u64 {
    parts.iter().fold(0x6b76_785f_6661_756c, |h, part| {
        part.iter().fold(mix(h, part.len() as u64), |h, &b| mix(h, u64::from(b)))
    })
}

/// The key of a notification from `from` to `to`: its bytes, except that the random parts a
/// decode worker draws for itself (its instance id and each READ's token, in a release's
/// `reply_to` and echoed in the answer) count as zero, so that the same run meets the same
/// faults.
pub(super) fn message_key(from: &str, to: &str, msg: &[u8]) -> u64 {
    let canonical = if let Ok(release @ HoldRelease { reply_to: Some(_), .. }) = wire::decode(msg) {
        let reply_to = release.reply_to.map(|r| ReplyTo { instance: 0, token: HexBytes([0; 16]), ..r });
        wire::encode(&HoldRelease { reply_to, ..release }).ok()
    } else if let Ok(status) = wire::decode::<HoldStatus>(msg) {
        wire::encode(&HoldStatus { token: HexBytes([0; 16]), ..status }).ok()
    } else {
        None
    };
    event_key(&[from.as_bytes(), to.as_bytes(), canonical.as_deref().unwrap_or(msg)])
}

/// The draws of one event: a stream of numbers from the seed and the event's key.
struct Draws(u64);

impl Draws {
    fn new(seed: u64, key: u64) -> Self {
        Draws(mix(seed, key))
    }

    fn next(&mut self) -> u64 {
        self.0 = mix(self.0, 0x5eed);
        self.0
    }

    fn hits(&mut self, per_million: u32) -> bool {
        // Always draws, so later draws of the event do not depend on earlier outcomes.
        self.next() % MILLION < u64::from(per_million)
    }

    /// Uniform in `1 ns..=max` (zero when `max` is).
    fn up_to(&mut self, max: Duration) -> Duration {
        let max = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        let n = self.next();
        if max == 0 { Duration::ZERO } else { Duration::from_nanos(1 + n % max) }
    }
}

impl FaultPlan {
    pub(super) fn set(&mut self, faults: Faults) {
        *self = FaultPlan { faults, transfers: 0, notifications: 0 };
    }

    pub(super) fn refuses_handshakes(&self) -> bool {
        self.faults.refuse_handshakes
    }

    /// Counts one posted transfer and says what becomes of it. `key` identifies the transfer
    /// (see [`event_key`]); without one, its ordinal among this plan's transfers does.
    pub(super) fn next_transfer(&mut self, key: Option<u64>) -> TransferFate {
        self.transfers = self.transfers.saturating_add(1);
        let c = &self.faults.chances;
        let mut draws = Draws::new(c.seed, key.unwrap_or(self.transfers));
        let (fails, delayed) = (draws.hits(c.fail_transfer), draws.hits(c.delay_transfer));
        let delay = draws.up_to(c.max_transfer_delay);
        let fail = if self.faults.fail_transfer == Some(self.transfers) {
            Some(format!("injected fault: transfer #{} fails", self.transfers))
        } else {
            fails.then(|| "injected fault: transfer fails (seeded chance)".to_owned())
        };
        TransferFate {
            fail,
            delay_passes: self.faults.delay_passes,
            delay: if delayed { delay } else { Duration::ZERO },
        }
    }

    /// Counts one sent notification and says how it is delivered. `key` identifies it (see
    /// [`event_key`]).
    pub(super) fn next_notification(&mut self, key: u64) -> Delivery {
        self.notifications = self.notifications.saturating_add(1);
        let c = &self.faults.chances;
        let mut draws = Draws::new(c.seed, key);
        let dropped = draws.hits(c.drop_notification);
        let doubled = draws.hits(c.duplicate_notification);
        let delayed = draws.hits(c.delay_notification);
        let delay = draws.up_to(c.max_notification_delay);
        let stray = draws.hits(c.stray_notification);
        let stray_seed = draws.next();
        let copies = if dropped || self.faults.drop_notification == Some(self.notifications) {
            0
        } else if doubled || self.faults.duplicate_notification == Some(self.notifications) {
            2
        } else {
            1
        };
        Delivery {
            copies,
            delay: if delayed { delay } else { Duration::ZERO },
            stray: stray.then_some(stray_seed),
        }
    }
}

impl TransferFate {
    pub(super) fn combine(self, other: TransferFate) -> TransferFate {
        TransferFate {
            fail: self.fail.or(other.fail),
            delay_passes: self.delay_passes.saturating_add(other.delay_passes),
            delay: self.delay.saturating_add(other.delay),
        }
    }
}

impl Delivery {
    pub(super) fn combine(self, other: Delivery) -> Delivery {
        Delivery {
            copies: if self.copies == 0 || other.copies == 0 { 0 } else { self.copies.max(other.copies) },
            delay: self.delay.saturating_add(other.delay),
            stray: self.stray.or(other.stray),
        }
    }
}

/// The stray notification of `seed` that follows `msg`: garbage, a release for a request nobody
/// holds, or `msg` forged with other nonces (a release, a hold's status claiming the opposite, or
/// a lease renewal; garbage when `msg` is none of them).
pub(super) fn stray_message(seed: u64, msg: &[u8]) -> Vec<u8> {
    let mut draws = Draws(seed);
    let mut nonce = || {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&draws.next().to_le_bytes());
        bytes[8..].copy_from_slice(&draws.next().to_le_bytes());
        HexBytes(bytes)
    };
    let stray = match seed % 3 {
        1 => Some(wire::encode(&HoldRelease {
            request_id: format!("kvx-chaos-stray-{seed:016x}").into(),
            nonce: nonce(),
            reply_to: None,
            reader: 0,
            readers: 1,
            instance: None,
        })),
        2 => {
            if let Ok(real) = wire::decode::<HoldRelease>(msg) {
                Some(wire::encode(&HoldRelease { nonce: nonce(), ..real }))
            } else if let Ok(real) = wire::decode::<HoldStatus>(msg) {
                Some(wire::encode(&HoldStatus { nonce: nonce(), held: !real.held, ..real }))
            } else if let Ok(real) = wire::decode::<RenewLeases>(msg) {
                let holds = real.holds.into_iter().map(|h| HeldRequest { nonce: nonce(), ..h }).collect();
                Some(wire::encode(&RenewLeases { holds, pushes: Vec::new() }))
            } else {
                None
            }
        }
        _ => None,
    };
    match stray {
        Some(Ok(bytes)) => bytes,
        _ => {
            let mut draws = Draws(seed ^ 0x6761_7262);
            let len = 1 + draws.next() % 64;
            (0..len).map(|_| draws.next() as u8).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_count_from_one_after_being_set() {
        let mut plan = FaultPlan::default();
        plan.set(Faults::none().fail_nth_transfer(2).drop_nth_notification(1).duplicate_nth_notification(2));
        assert_eq!(plan.next_transfer(None).fail, None);
        assert_eq!(plan.next_transfer(None).fail.as_deref(), Some("injected fault: transfer #2 fails"));
        assert_eq!(plan.next_transfer(None).fail, None);
        assert_eq!(plan.next_notification(1).copies, 0);
        assert_eq!(plan.next_notification(2).copies, 2);
        assert_eq!(plan.next_notification(3).copies, 1);
        plan.set(Faults::none().fail_nth_transfer(1));
        assert!(plan.next_transfer(None).fail.is_some());
    }

    #[test]
    fn combined_fates_take_the_worst() {
        let a = TransferFate { fail: None, delay_passes: 2, delay: Duration::from_millis(1) };
        let b = TransferFate { fail: Some("x".into()), delay_passes: 1, delay: Duration::from_millis(2) };
        let c = a.combine(b);
        assert_eq!((c.fail.as_deref(), c.delay_passes, c.delay), (Some("x"), 3, Duration::from_millis(3)));
        let once = Delivery { copies: 1, delay: Duration::ZERO, stray: None };
        let twice = Delivery { copies: 2, stray: Some(4), ..once };
        assert_eq!(twice.combine(Delivery { copies: 0, ..once }).copies, 0);
        assert_eq!(once.combine(twice), twice);
    }

    #[test]
    fn seeded_fates_depend_on_the_seed_and_the_event_not_on_the_order() {
        let faults = Faults::none()
            .seed(11)
            .transfer_failures(0.1)
            .transfer_delays(0.2, Duration::from_secs(1))
            .notification_drops(0.1)
            .notification_duplicates(0.1)
            .notification_delays(0.1, Duration::from_millis(50))
            .stray_notifications(0.1);
        let fates = |faults: &Faults, keys: &[u64]| {
            let mut plan = FaultPlan::default();
            plan.set(faults.clone());
            let mut out: Vec<_> =
                keys.iter().map(|&k| (k, plan.next_transfer(Some(k)), plan.next_notification(k))).collect();
            out.sort_by_key(|(k, ..)| *k);
            out
        };
        let keys: Vec<u64> = (0..10_000).map(|i| event_key(&[b"agent", &u64::to_le_bytes(i)])).collect();
        let reversed: Vec<u64> = keys.iter().rev().copied().collect();
        let forward = fates(&faults, &keys);
        assert_eq!(forward, fates(&faults, &reversed));
        let mut counts = FaultCounts::default();
        for (_, t, n) in &forward {
            counts.count_transfer(t);
            counts.count_delivery(n);
            assert!(t.delay <= Duration::from_secs(1) && n.delay <= Duration::from_millis(50));
        }
        // About 10% (20% for transfer delays) of 10 000 events each, and never all or none.
        for (n, expected) in [
            (counts.transfers_failed, 1000),
            (counts.transfers_delayed, 2000),
            (counts.notifications_dropped, 1000),
            (counts.stray_notifications, 1000),
        ] {
            assert!(n.abs_diff(expected) < expected / 5, "{n} of about {expected}: {counts:?}");
        }
        assert!(counts.notifications_duplicated > 0 && counts.notifications_delayed > 0);
        assert_ne!(forward, fates(&faults.clone().seed(12), &keys), "another seed, other faults");
    }

    #[test]
    fn keys_leave_out_the_worker_s_random_instance_and_tokens() {
        let release = |instance, token, nonce| {
            let engine = kvx_core::RemoteCoordinates::at("d", "h", 1);
            let reply_to = Some(ReplyTo { engine, rank: 0, instance, token: HexBytes([token; 16]) });
            wire::encode(&HoldRelease {
                request_id: "r".into(),
                nonce: HexBytes([nonce; 16]),
                reply_to,
                reader: 0,
                readers: 1,
                instance: None,
            })
            .unwrap()
        };
        let status = |token, held| {
            let nonce = HexBytes([7; 16]);
            wire::encode(&HoldStatus { request_id: "r".into(), nonce, held, token: HexBytes([token; 16]) })
                .unwrap()
        };
        let key = |msg: &[u8]| message_key("a", "b", msg);
        assert_eq!(key(&release(1, 3, 7)), key(&release(2, 4, 7)));
        assert_ne!(key(&release(1, 3, 7)), key(&release(1, 3, 8)));
        assert_eq!(key(&status(3, true)), key(&status(4, true)));
        assert_ne!(key(&status(3, true)), key(&status(3, false)));
        assert_ne!(message_key("a", "b", b"x"), message_key("a", "c", b"x"));
    }

    #[test]
    fn strays_are_garbage_unknown_releases_or_forged_nonces() {
        let real = HoldRelease {
            request_id: "req-1".into(),
            nonce: HexBytes([9; 16]),
            reply_to: None,
            reader: 0,
            readers: 1,
            instance: None,
        };
        let msg = wire::encode(&real).unwrap();
        let mut kinds = [0; 3];
        for seed in 0..300 {
            let stray = stray_message(seed, &msg);
            match wire::decode::<HoldRelease>(&stray) {
                Err(_) => kinds[0] += 1,
                Ok(r) if r.request_id == real.request_id => {
                    assert_ne!(r.nonce, real.nonce);
                    kinds[2] += 1;
                }
                Ok(r) => {
                    assert!(r.request_id.as_str().starts_with("kvx-chaos-stray-"));
                    kinds[1] += 1;
                }
            }
            assert_eq!(stray, stray_message(seed, &msg), "a function of the seed");
        }
        assert_eq!(kinds, [100, 100, 100]);
        let token = HexBytes([1; 16]);
        let status = HoldStatus { request_id: "req-1".into(), nonce: HexBytes([9; 16]), held: false, token };
        let forged = wire::decode::<HoldStatus>(&stray_message(2, &wire::encode(&status).unwrap())).unwrap();
        assert!(forged.held && forged.nonce != status.nonce, "a forged status claims the opposite");
        let renew = RenewLeases {
            holds: vec![HeldRequest { request_id: "req-1".into(), nonce: HexBytes([9; 16]) }],
            pushes: Vec::new(),
        };
        let forged = wire::decode::<RenewLeases>(&stray_message(5, &wire::encode(&renew).unwrap())).unwrap();
        assert_ne!(forged.holds[0].nonce, renew.holds[0].nonce);
        assert!(wire::decode::<HoldRelease>(&stray_message(2, b"not a message")).is_err());
    }
}
