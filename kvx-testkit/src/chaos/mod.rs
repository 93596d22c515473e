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
mod net;
mod state;

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use kvx_core::{
    AgentName, BlockList, BlockPost, Capabilities, DlistId, DlistOwner, Error, ErrorKind, KvMemory,
    Notification, NotificationWaker, RegistrationId, Result, TransferAgent, XferId, XferOp, XferState,
};

use faults::{Delivery, TransferFate, message_key, stray_message};
use net::lock;
use state::{Outgoing, Shared, State, Xfer};

pub use faults::{FaultCounts, Faults};
pub use net::ChaosNet;

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
        let shared = Arc::new(Shared::default());
        net.join(&name, &shared);
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

    /// The key of `msg` from this agent to `to`: its [`message_key`], and how many times the
    /// same message went that way before (so that a copy sent again has a fate of its own).
    fn key_of(&self, to: &str, msg: &[u8]) -> Result<u64> {
        let key = message_key(self.name.as_str(), to, msg);
        let mut sent = lock(&self.net.inner.sent_keys, "sent notifications")?;
        let times = sent.entry(key).or_insert(0);
        *times += 1;
        Ok(if *times == 1 { key } else { faults::mix(key, *times) })
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
            (Some(peer), Some(msg)) => Some(self.key_of(peer.as_str(), msg)?),
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
        self.net.leave(&self.name, &self.shared);
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
        let key = self.key_of(agent.as_str(), msg)?;
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

    /// The inner agent's: a wake for a notification the chaos layer then holds back (late) or
    /// drops (lost) only makes the worker drain early.
    fn wake_on_notification(&self, wake: NotificationWaker) -> bool {
        self.inner.wake_on_notification(wake)
    }
}
