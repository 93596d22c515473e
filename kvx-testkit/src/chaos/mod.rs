//! Fault injection as a layer: [`Chaos`] wraps any [`TransferAgent`] and fails, delays, drops,
//! doubles and forges at the trait boundary, so that every backend (loopback, UCX, NIXL, TCP) meets
//! the same faults. Agents wrapped on one [`ChaosNet`] share its faults, its clock and its counts.
//!
//! What the layer does to each call:
//! - `post` / `post_blocks`: a transfer made to fail is not posted (no byte moves, no notification
//!   is sent) and is `Failed` at once, drained as ended at the next `drain_completions`; a late
//!   transfer's completion (and notification)
//!   waits for the net's clock or for progress passes; a notification that faults strike (lost,
//!   doubled, late, followed by a stray) is taken off the transfer and sent by the layer with
//!   `notify` once the transfer is done. Otherwise the transfer goes through untouched, its
//!   notification with it.
//! - `notify`: the notification is lost, sent twice, held back until its time, or followed by a
//!   stray one (garbage, a release nobody holds, or a forgery of it with another nonce).
//! - `load_remote`: refused when the agent, the net, or the peer (another agent of the net)
//!   refuses handshakes.
//! - `progress`, `drain_completions`, `drain_notifications`: each is a progress pass of the layer
//!   (late notifications whose time came are sent) before the wrapped agent's own call.
//!
//! Transfers get the layer's own ids; everything else passes through. Whether a fault strikes an
//! event is a function of the seed and of the event (see [`Faults`]), so the same run meets the
//! same faults on any backend.
//!
//! ```
//! use std::sync::Arc;
//! use kvx_core::TransferAgent;
//! use kvx_loopback::Fabric;
//! use kvx_testkit::chaos::{Chaos, ChaosNet, Faults};
//!
//! let (fabric, net) = (Fabric::new(), ChaosNet::new());
//! let decode = Chaos::new(Arc::new(fabric.agent("decode")?), &net);
//! decode.set_faults(Faults::none().fail_nth_transfer(1))?;
//! assert_eq!(decode.name().as_str(), "decode");
//! # Ok::<(), kvx_core::Error>(())
//! ```

mod faults;

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use kvx_core::clock::system_clock;
use kvx_core::{
    AgentName, BlockList, BlockPost, Capabilities, Clock, DlistId, DlistOwner, Error, ErrorKind, KvMemory,
    Notification, RegistrationId, Result, TransferAgent, XferId, XferOp, XferState,
};

use crate::sim::SimBackend;
use faults::{Delivery, FaultPlan, TransferFate, message_key, stray_message};

pub use faults::{FaultCounts, Faults};

/// Locks `mutex`; a lock poisoned by a panicking thread is a `State` error, not a panic.
fn lock<'a, T>(mutex: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>> {
    mutex.lock().map_err(|_| {
        Error::new(ErrorKind::State, format!("the chaos {what} lock is poisoned: a thread panicked"))
    })
}

/// The agents whose faults, clock and counts are shared: faults set on the net strike every
/// agent of it, and an agent that refuses handshakes is refused by every agent of it.
///
/// Cheap to clone; clones are the same net.
#[derive(Clone)]
pub struct ChaosNet {
    inner: Arc<NetInner>,
}

struct NetInner {
    /// The time of late transfers and notifications.
    clock: Arc<dyn Clock>,
    faults: Mutex<FaultPlan>,
    /// Faults injected so far, by the net's faults and its agents'.
    injected: Mutex<FaultCounts>,
    /// The live agents, by name.
    agents: Mutex<HashMap<AgentName, Weak<Shared>>>,
}

impl ChaosNet {
    /// A net on the system clock, without faults.
    pub fn new() -> Self {
        ChaosNet::with_clock(system_clock())
    }

    /// A net whose late transfers and notifications follow `clock`: a simulation's
    /// [`ManualClock`](kvx_core::ManualClock), say.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        ChaosNet {
            inner: Arc::new(NetInner {
                clock,
                faults: Mutex::new(FaultPlan::default()),
                injected: Mutex::new(FaultCounts::default()),
                agents: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Sets faults for every agent of this net, replacing earlier net faults and restarting their
    /// counts. [`Faults::none`] clears them.
    pub fn set_faults(&self, faults: Faults) -> Result<()> {
        lock(&self.inner.faults, "net faults")?.set(faults);
        Ok(())
    }

    /// Sets the faults of the live agent named `agent` (as [`Chaos::set_faults`]); a `NotFound`
    /// error when this net has none.
    pub fn set_agent_faults(&self, agent: &str, faults: Faults) -> Result<()> {
        let shared = self.live(agent)?.ok_or_else(|| {
            Error::new(ErrorKind::NotFound, format!("no live chaos agent {agent} on this net"))
        })?;
        lock(&shared.faults, "agent faults")?.set(faults);
        Ok(())
    }

    /// The faults injected so far (by the net's faults and by its agents').
    pub fn fault_counts(&self) -> Result<FaultCounts> {
        Ok(*lock(&self.inner.injected, "fault counts")?)
    }

    /// The earliest time at which an agent of this net has something to do: the clock's now when
    /// a transfer is in flight, a completion waits to be drained or a notification sent to an
    /// agent of the net has not been drained yet, else when the first late transfer or
    /// notification is due; `None` when nothing waits. A simulation on a manual clock may jump to
    /// it.
    pub fn next_event(&self) -> Result<Option<Instant>> {
        let agents: Vec<Arc<Shared>> =
            lock(&self.inner.agents, "agent table")?.values().filter_map(Weak::upgrade).collect();
        let now = self.inner.clock.now();
        let mut next = None;
        for agent in agents {
            let unread = (agent.unread.load(Ordering::Relaxed) > 0).then_some(now);
            let own = lock(&agent.state, "agent state")?.next_event(now);
            next = next.into_iter().chain(unread).chain(own).min();
        }
        Ok(next)
    }

    /// `backend` with every agent wrapped in a [`Chaos`] of this net (its memory unchanged).
    pub fn backend(&self, backend: SimBackend) -> SimBackend {
        let (net, agents) = (self.clone(), backend.clone());
        SimBackend::new(move |engine, rank| {
            Ok(Arc::new(Chaos::new(agents.agent(engine, rank)?, &net)) as Arc<dyn TransferAgent>)
        })
        .with_memory(move |engine, rank, len| backend.memory(engine, rank, len))
    }

    fn live(&self, agent: &str) -> Result<Option<Arc<Shared>>> {
        Ok(lock(&self.inner.agents, "agent table")?.get(&AgentName::new(agent)).and_then(Weak::upgrade))
    }

    fn refuses_handshakes(&self) -> Result<bool> {
        Ok(lock(&self.inner.faults, "net faults")?.refuses_handshakes())
    }
}

impl Default for ChaosNet {
    fn default() -> Self {
        ChaosNet::new()
    }
}

impl fmt::Debug for ChaosNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let agents = self.inner.agents.lock().map(|a| a.len()).unwrap_or(0);
        f.debug_struct("ChaosNet").field("agents", &agents).finish_non_exhaustive()
    }
}

/// The part of a [`Chaos`] agent that its net reaches.
struct Shared {
    faults: Mutex<FaultPlan>,
    state: Mutex<State>,
    /// Notifications agents of the net sent it, less those it drained: while above zero, some
    /// wait to be drained. (Apart from the state: senders add to it holding their own state.)
    unread: AtomicI64,
}

/// A transfer of the layer.
#[derive(Debug)]
struct Xfer {
    /// The wrapped agent's transfer; none for a transfer made to fail.
    inner: Option<XferId>,
    /// Why it fails, when a fault made it.
    fail: Option<String>,
    /// The pass after which it may complete, when it waits for passes.
    after_pass: Option<u64>,
    /// When it may complete, when it waits for the clock.
    not_before: Option<Instant>,
    /// Its transport is done with it.
    inner_ended: bool,
    /// It completed for the caller (and went to `ended`).
    visible: bool,
    /// The notification the layer sends once it is done, taken off the transfer by faults.
    notification: Option<Outgoing>,
    /// Where the notification that the transfer carries itself goes.
    carried_to: Option<AgentName>,
}

/// A notification faults struck, and what they decided.
#[derive(Debug)]
struct Outgoing {
    to: AgentName,
    msg: Vec<u8>,
    key: u64,
    delivery: Delivery,
}

#[derive(Debug, Default)]
struct State {
    /// Progress passes so far.
    passes: u64,
    next_id: u64,
    xfers: HashMap<u64, Xfer>,
    /// The layer's transfer of each transfer of the wrapped agent.
    by_inner: HashMap<XferId, u64>,
    /// Transfers whose transport is done but whose completion waits.
    waiting: BTreeSet<u64>,
    /// Transfers that completed and that `drain_completions` has not reported yet.
    ended: Vec<u64>,
    /// The peer of each remote list.
    remote_lists: HashMap<DlistId, AgentName>,
    /// Late notifications: when, their key (which orders those due together), to whom, what.
    late: Vec<(Instant, u64, AgentName, Vec<u8>)>,
}

impl State {
    fn ready(&self, x: &Xfer, now: Instant) -> bool {
        x.inner_ended && x.after_pass.is_none_or(|p| self.passes > p) && x.not_before.is_none_or(|t| t <= now)
    }

    fn next_event(&self, now: Instant) -> Option<Instant> {
        let transfers =
            self.xfers.values().filter(|x| !x.visible).map(|x| match (x.inner_ended, x.after_pass) {
                (true, None) => x.not_before.unwrap_or(now).max(now),
                _ => now,
            });
        let ended = (!self.ended.is_empty()).then_some(now);
        let late = self.late.iter().map(|(due, ..)| (*due).max(now));
        transfers.chain(ended).chain(late).min()
    }
}

/// A [`TransferAgent`] that injects [`Faults`] into the agent it wraps: see the
/// [module documentation](self).
pub struct Chaos<A: ?Sized = dyn TransferAgent> {
    name: AgentName,
    shared: Arc<Shared>,
    net: ChaosNet,
    inner: Arc<A>,
}

impl<A: TransferAgent + ?Sized> Chaos<A> {
    /// `inner`, without faults until some are set, on `net`. The net knows it by its name until
    /// it is dropped (a later agent of that name takes the name over).
    pub fn new(inner: Arc<A>, net: &ChaosNet) -> Self {
        let name = inner.name().clone();
        let shared = Arc::new(Shared {
            faults: Mutex::new(FaultPlan::default()),
            state: Mutex::default(),
            unread: AtomicI64::new(0),
        });
        // A poisoned table is still a valid map.
        let mut agents = net.inner.agents.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        agents.retain(|_, w| w.strong_count() > 0);
        agents.insert(name.clone(), Arc::downgrade(&shared));
        drop(agents);
        Chaos { name, shared, net: net.clone(), inner }
    }

    /// The wrapped agent.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// Sets faults for this agent, replacing earlier ones and restarting their counts.
    /// [`Faults::none`] clears them.
    pub fn set_faults(&self, faults: Faults) -> Result<()> {
        lock(&self.shared.faults, "agent faults")?.set(faults);
        Ok(())
    }

    fn err(&self, kind: ErrorKind, msg: impl Into<String>) -> Error {
        Error::new(kind, msg).with_backend(self.inner.capabilities().backend)
    }

    fn state(&self) -> Result<MutexGuard<'_, State>> {
        lock(&self.shared.state, "agent state")
    }

    fn now(&self) -> Instant {
        self.net.inner.clock.now()
    }

    /// What becomes of a transfer of key `key`, by this agent's faults and the net's; counted.
    fn transfer_fate(&self, key: Option<u64>) -> Result<TransferFate> {
        let mine = lock(&self.shared.faults, "agent faults")?.next_transfer(key);
        let net = lock(&self.net.inner.faults, "net faults")?.next_transfer(key);
        let fate = mine.combine(net);
        lock(&self.net.inner.injected, "fault counts")?.count_transfer(&fate);
        Ok(fate)
    }

    /// How a notification of key `key` is delivered, by this agent's faults and the net's;
    /// counted.
    fn delivery(&self, key: u64) -> Result<Delivery> {
        let mine = lock(&self.shared.faults, "agent faults")?.next_notification(key);
        let net = lock(&self.net.inner.faults, "net faults")?.next_notification(key);
        let delivery = mine.combine(net);
        lock(&self.net.inner.injected, "fault counts")?.count_delivery(&delivery);
        Ok(delivery)
    }

    /// Counts `n` notifications sent to `to`, when it is an agent of the net.
    fn sent(&self, to: &AgentName, n: i64) {
        if let Ok(Some(peer)) = self.net.live(to.as_str()) {
            peer.unread.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Sends `msg` to `to` now, counted.
    fn send_now(&self, to: &AgentName, msg: &[u8]) -> Result<()> {
        self.inner.notify(to, msg)?;
        self.sent(to, 1);
        Ok(())
    }

    /// Sends a notification as faults decided: its copies now or late, then its stray at once. The
    /// first error of what is sent now is returned (the rest is still sent).
    fn send(&self, st: &mut State, out: Outgoing) -> Result<()> {
        let Outgoing { to, msg, key, delivery } = out;
        if delivery.copies == 0 {
            tracing::debug!(from = %self.name, %to, "chaos: injected fault drops a notification");
        }
        let mut result = Ok(());
        if delivery.delay.is_zero() {
            for _ in 0..delivery.copies {
                result = result.and(self.send_now(&to, &msg));
            }
        } else {
            let due = self.now() + delivery.delay;
            for _ in 0..delivery.copies {
                st.late.push((due, key, to.clone(), msg.clone()));
            }
        }
        if let Some(seed) = delivery.stray {
            result = result.and(self.send_now(&to, &stray_message(seed, &msg)));
        }
        result
    }

    /// One progress pass of the layer: counts it and sends the late notifications whose time came.
    fn pass(&self) -> Result<MutexGuard<'_, State>> {
        let mut st = self.state()?;
        st.passes += 1;
        if !st.late.is_empty() {
            let now = self.now();
            let (mut due, later): (Vec<_>, Vec<_>) =
                std::mem::take(&mut st.late).into_iter().partition(|(t, ..)| *t <= now);
            st.late = later;
            due.sort_by_key(|(t, key, ..)| (*t, *key));
            for (_, _, to, msg) in due {
                // The peer may be gone: the notification is lost with it.
                if let Err(e) = self.send_now(&to, &msg) {
                    tracing::debug!(from = %self.name, %to, error = %e, "chaos: a late notification is lost");
                }
            }
        }
        Ok(st)
    }

    /// Transfer `id` completes for the caller: it goes to `ended`, and the notification faults
    /// took off it is sent when it is done.
    fn complete(&self, st: &mut State, id: u64) -> Result<()> {
        st.waiting.remove(&id);
        let Some(x) = st.xfers.get_mut(&id) else { return Ok(()) };
        x.visible = true;
        let (inner, notification, carried_to) = (x.inner, x.notification.take(), x.carried_to.take());
        st.ended.push(id);
        let Some(inner) = inner.filter(|_| notification.is_some() || carried_to.is_some()) else {
            return Ok(());
        };
        if self.inner.poll(inner)? == XferState::Done {
            if let Some(to) = carried_to {
                self.sent(&to, 1);
            }
            if let Some(out) = notification {
                if let Err(e) = self.send(st, out) {
                    tracing::debug!(from = %self.name, error = %e, "chaos: a transfer's notification is lost");
                }
            }
        }
        Ok(())
    }

    /// Posts a transfer to the peer of `remote` through `post` (given the notification to carry),
    /// as faults decide.
    fn post_with(
        &self,
        remote: DlistId,
        notify: Option<&[u8]>,
        post: impl FnOnce(Option<&[u8]>) -> Result<XferId>,
    ) -> Result<XferId> {
        let mut st = self.state()?;
        let peer = st.remote_lists.get(&remote).cloned();
        let key = match (&peer, notify) {
            (Some(peer), Some(msg)) => Some(message_key(self.name.as_str(), peer.as_str(), msg)),
            _ => None,
        };
        let fate = self.transfer_fate(key)?;
        let outgoing = match (peer.clone(), notify, key) {
            (Some(to), Some(msg), Some(key)) if fate.fail.is_none() => {
                Some(Outgoing { to, msg: msg.to_vec(), key, delivery: self.delivery(key)? })
            }
            _ => None,
        };
        let plain = |d: &Delivery| d.copies == 1 && d.delay.is_zero() && d.stray.is_none();
        let untouched = fate.fail.is_none()
            && fate.delay_passes == 0
            && fate.delay.is_zero()
            && outgoing.as_ref().is_none_or(|o| plain(&o.delivery));
        let TransferFate { fail, delay_passes, delay } = fate;
        let inner = match fail {
            Some(_) => None,
            None => Some(post(if untouched { notify } else { None })?),
        };
        let x = Xfer {
            inner,
            after_pass: (delay_passes > 0).then(|| st.passes + u64::from(delay_passes)),
            fail,
            not_before: (!delay.is_zero()).then(|| self.now() + delay),
            inner_ended: inner.is_none(),
            visible: false,
            notification: outgoing.filter(|_| !untouched),
            carried_to: peer.filter(|_| untouched && notify.is_some()),
        };
        st.next_id += 1;
        let id = st.next_id;
        if x.inner_ended {
            st.waiting.insert(id);
        }
        st.xfers.insert(id, x);
        if let Some(inner) = inner {
            st.by_inner.insert(inner, id);
        }
        Ok(XferId(id))
    }
}

impl<A: ?Sized> Drop for Chaos<A> {
    fn drop(&mut self) {
        let mut agents = self.net.inner.agents.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if agents.get(&self.name).is_some_and(|w| w.as_ptr() == Arc::as_ptr(&self.shared)) {
            agents.remove(&self.name);
        }
    }
}

impl<A: TransferAgent + ?Sized> fmt::Debug for Chaos<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chaos").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<A: TransferAgent + ?Sized> TransferAgent for Chaos<A> {
    fn name(&self) -> &AgentName {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn register(&self, memory: Arc<dyn KvMemory>) -> Result<RegistrationId> {
        self.inner.register(memory)
    }

    fn deregister(&self, registration: RegistrationId) -> Result<()> {
        self.inner.deregister(registration)
    }

    fn local_metadata(&self) -> Result<Vec<u8>> {
        self.inner.local_metadata()
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<AgentName> {
        let refused = |who: &AgentName| {
            self.err(ErrorKind::Handshake, format!("injected fault: {who} refuses handshakes"))
        };
        if lock(&self.shared.faults, "agent faults")?.refuses_handshakes() || self.net.refuses_handshakes()? {
            return Err(refused(&self.name));
        }
        let name = self.inner.load_remote(metadata)?;
        let peer = self.net.live(name.as_str())?;
        if let Some(peer) = peer {
            if lock(&peer.faults, "agent faults")?.refuses_handshakes() {
                self.inner.forget_remote(&name)?;
                return Err(refused(&name));
            }
        }
        Ok(name)
    }

    fn forget_remote(&self, agent: &AgentName) -> Result<()> {
        self.inner.forget_remote(agent)?;
        self.state()?.remote_lists.retain(|_, peer| peer != agent);
        Ok(())
    }

    fn prep_dlist(&self, owner: &DlistOwner, blocks: &BlockList) -> Result<DlistId> {
        let id = self.inner.prep_dlist(owner, blocks)?;
        if let DlistOwner::Remote(peer) = owner {
            self.state()?.remote_lists.insert(id, peer.clone());
        }
        Ok(id)
    }

    fn release_dlist(&self, dlist: DlistId) -> Result<()> {
        self.inner.release_dlist(dlist)?;
        self.state()?.remote_lists.remove(&dlist);
        Ok(())
    }

    fn post(
        &self,
        op: XferOp,
        local: DlistId,
        local_descs: &[u32],
        remote: DlistId,
        remote_descs: &[u32],
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        self.post_with(remote, notify, |notify| {
            self.inner.post(op, local, local_descs, remote, remote_descs, notify)
        })
    }

    fn post_blocks(
        &self,
        op: XferOp,
        local: DlistId,
        remote: DlistId,
        blocks: &BlockPost<'_>,
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        self.post_with(remote, notify, |notify| self.inner.post_blocks(op, local, remote, blocks, notify))
    }

    /// A transfer whose completion waits for faults is `Pending` until then.
    fn poll(&self, xfer: XferId) -> Result<XferState> {
        let mut st = self.state()?;
        let x = st
            .xfers
            .get(&xfer.0)
            .ok_or_else(|| self.err(ErrorKind::NotFound, format!("no transfer {xfer}")))?;
        let (inner, visible, inner_ended) = (x.inner, x.visible, x.inner_ended);
        if !visible {
            if let Some(inner) = inner.filter(|_| !inner_ended) {
                if self.inner.poll(inner)? == XferState::Pending {
                    return Ok(XferState::Pending);
                }
                if let Some(x) = st.xfers.get_mut(&xfer.0) {
                    x.inner_ended = true;
                }
                st.waiting.insert(xfer.0);
            }
            let now = self.now();
            if !st.xfers.get(&xfer.0).is_some_and(|x| st.ready(x, now)) {
                return Ok(XferState::Pending);
            }
            self.complete(&mut st, xfer.0)?;
        }
        match (st.xfers.get(&xfer.0).and_then(|x| x.fail.clone()), inner) {
            (None, Some(inner)) => self.inner.poll(inner),
            (reason, _) => {
                let reason = reason.unwrap_or_else(|| "injected fault: transfer fails".to_owned());
                Ok(XferState::Failed(self.err(ErrorKind::Transfer, reason)))
            }
        }
    }

    fn drain_completions(&self, out: &mut Vec<XferId>) -> Result<()> {
        let mut st = self.pass()?;
        let mut done = Vec::new();
        self.inner.drain_completions(&mut done)?;
        for inner in done {
            let Some(&id) = st.by_inner.get(&inner) else { continue };
            if let Some(x) = st.xfers.get_mut(&id).filter(|x| !x.visible) {
                x.inner_ended = true;
                st.waiting.insert(id);
            }
        }
        let now = self.now();
        let due: Vec<u64> = st
            .waiting
            .iter()
            .copied()
            .filter(|id| st.xfers.get(id).is_some_and(|x| st.ready(x, now)))
            .collect();
        for id in due {
            self.complete(&mut st, id)?;
        }
        let State { xfers, ended, .. } = &mut *st;
        out.extend(ended.drain(..).filter(|id| xfers.contains_key(id)).map(XferId));
        Ok(())
    }

    fn release(&self, xfer: XferId) -> Result<()> {
        let mut st = self.state()?;
        let x = st
            .xfers
            .remove(&xfer.0)
            .ok_or_else(|| self.err(ErrorKind::NotFound, format!("no transfer {xfer}")))?;
        st.waiting.remove(&xfer.0);
        let Some(inner) = x.inner else { return Ok(()) };
        st.by_inner.remove(&inner);
        drop(st);
        self.inner.release(inner)
    }

    fn notify(&self, agent: &AgentName, msg: &[u8]) -> Result<()> {
        let key = message_key(self.name.as_str(), agent.as_str(), msg);
        let delivery = self.delivery(key)?;
        if delivery == (Delivery { copies: 1, delay: std::time::Duration::ZERO, stray: None }) {
            return self.send_now(agent, msg);
        }
        let mut st = self.state()?;
        self.send(&mut st, Outgoing { to: agent.clone(), msg: msg.to_vec(), key, delivery })
    }

    fn drain_notifications(&self, out: &mut Vec<Notification>) -> Result<()> {
        drop(self.pass()?);
        let before = out.len();
        self.inner.drain_notifications(out)?;
        let drained = i64::try_from(out.len() - before).unwrap_or(i64::MAX);
        self.shared.unread.fetch_sub(drained, Ordering::Relaxed);
        Ok(())
    }

    fn progress(&self) -> Result<()> {
        drop(self.pass()?);
        self.inner.progress()
    }
}
