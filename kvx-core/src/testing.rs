//! Test doubles of [`TransferAgent`] (feature `testing`): [`NoopAgent`], which accepts everything
//! and does nothing, and [`Recording`], which counts what its caller asks of an agent and keeps
//! what it drained. They live here, not in kvx-testkit, so that kvx-core's own benches can use
//! them (kvx-testkit depends on kvx-core; kvx-core cannot depend back on it).

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::{
    AgentName, BlockList, BlockPost, Capabilities, DlistId, DlistOwner, Error, KvMemory, Notification,
    NotificationWaker, RegistrationId, Result, TransferAgent, XferId, XferOp, XferState,
};

/// A [`TransferAgent`] that accepts everything, moves nothing and completes nothing: every
/// transfer stays `Pending`. What a caller measures over it is its own cost. Its metadata is its
/// name, so a peer that loads it learns that name.
#[derive(Debug)]
pub struct NoopAgent {
    name: AgentName,
    next: AtomicU64,
}

impl NoopAgent {
    /// An agent named `name`.
    pub fn new(name: impl Into<AgentName>) -> Self {
        NoopAgent { name: name.into(), next: AtomicU64::new(0) }
    }

    /// The next id, of one space for registrations, lists and transfers.
    fn next(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }
}

impl TransferAgent for NoopAgent {
    fn name(&self) -> &AgentName {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            backend: "noop",
            dram: true,
            vram: false,
            read: true,
            write: true,
            notifications: true,
        }
    }

    fn register(&self, _: Arc<dyn KvMemory>) -> Result<RegistrationId> {
        Ok(RegistrationId(self.next()))
    }

    fn deregister(&self, _: RegistrationId) -> Result<()> {
        Ok(())
    }

    fn local_metadata(&self) -> Result<Vec<u8>> {
        Ok(self.name.to_string().into_bytes())
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<AgentName> {
        let name = std::str::from_utf8(metadata)
            .map_err(|_| Error::invalid_argument("noop metadata is an agent name in UTF-8"))?;
        Ok(AgentName::new(name))
    }

    fn forget_remote(&self, _: &AgentName) -> Result<()> {
        Ok(())
    }

    fn prep_dlist(&self, _: &DlistOwner, _: &BlockList) -> Result<DlistId> {
        Ok(DlistId(self.next()))
    }

    fn release_dlist(&self, _: DlistId) -> Result<()> {
        Ok(())
    }

    /// Takes the descriptors' lengths, nothing more.
    fn post(
        &self,
        _: XferOp,
        _: DlistId,
        local_descs: &[u32],
        _: DlistId,
        remote_descs: &[u32],
        _: Option<&[u8]>,
    ) -> Result<XferId> {
        black_box(local_descs.len() + remote_descs.len());
        Ok(XferId(self.next()))
    }

    /// Takes the blocks' count, nothing more (no descriptor is numbered).
    fn post_blocks(
        &self,
        _: XferOp,
        _: DlistId,
        _: DlistId,
        blocks: &BlockPost<'_>,
        _: Option<&[u8]>,
    ) -> Result<XferId> {
        black_box(blocks.local_blocks.len());
        Ok(XferId(self.next()))
    }

    fn poll(&self, _: XferId) -> Result<XferState> {
        Ok(XferState::Pending)
    }

    fn drain_completions(&self, _: &mut Vec<XferId>) -> Result<()> {
        Ok(())
    }

    fn release(&self, _: XferId) -> Result<()> {
        Ok(())
    }

    fn notify(&self, _: &AgentName, _: &[u8]) -> Result<()> {
        Ok(())
    }

    fn drain_notifications(&self, _: &mut Vec<Notification>) -> Result<()> {
        Ok(())
    }
}

/// What a caller asked of a [`Recording`] agent so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calls {
    /// `post` and `post_blocks` calls.
    pub posts: u64,
    /// `poll` calls.
    pub polls: u64,
    /// Calls that drive progress: `progress`, `drain_completions`, `drain_notifications`.
    pub passes: u64,
}

/// A [`TransferAgent`] that passes every call to the agent it wraps, counting posts, polls and
/// progress ([`Calls`]) and keeping a copy of every notification drained through it.
#[derive(Debug)]
pub struct Recording<A: ?Sized = dyn TransferAgent> {
    posts: AtomicU64,
    polls: AtomicU64,
    passes: AtomicU64,
    drained: Mutex<Vec<Notification>>,
    inner: Arc<A>,
}

impl<A: TransferAgent + ?Sized> Recording<A> {
    /// Records the calls to `inner`.
    pub fn new(inner: Arc<A>) -> Self {
        Recording {
            posts: AtomicU64::new(0),
            polls: AtomicU64::new(0),
            passes: AtomicU64::new(0),
            drained: Mutex::new(Vec::new()),
            inner,
        }
    }

    /// The wrapped agent.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// The calls so far.
    pub fn calls(&self) -> Calls {
        Calls {
            posts: self.posts.load(Ordering::Relaxed),
            polls: self.polls.load(Ordering::Relaxed),
            passes: self.passes.load(Ordering::Relaxed),
        }
    }

    /// The notifications drained since the last call, in the order they were drained.
    pub fn take_notifications(&self) -> Vec<Notification> {
        std::mem::take(&mut *self.drained.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

impl<A: TransferAgent + ?Sized> TransferAgent for Recording<A> {
    fn name(&self) -> &AgentName {
        self.inner.name()
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
        self.inner.load_remote(metadata)
    }

    fn forget_remote(&self, agent: &AgentName) -> Result<()> {
        self.inner.forget_remote(agent)
    }

    fn prep_dlist(&self, owner: &DlistOwner, blocks: &BlockList) -> Result<DlistId> {
        self.inner.prep_dlist(owner, blocks)
    }

    fn release_dlist(&self, dlist: DlistId) -> Result<()> {
        self.inner.release_dlist(dlist)
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
        Self::count(&self.posts);
        self.inner.post(op, local, local_descs, remote, remote_descs, notify)
    }

    fn post_blocks(
        &self,
        op: XferOp,
        local: DlistId,
        remote: DlistId,
        blocks: &BlockPost<'_>,
        notify: Option<&[u8]>,
    ) -> Result<XferId> {
        Self::count(&self.posts);
        self.inner.post_blocks(op, local, remote, blocks, notify)
    }

    fn poll(&self, xfer: XferId) -> Result<XferState> {
        Self::count(&self.polls);
        self.inner.poll(xfer)
    }

    fn drain_completions(&self, out: &mut Vec<XferId>) -> Result<()> {
        Self::count(&self.passes);
        self.inner.drain_completions(out)
    }

    fn release(&self, xfer: XferId) -> Result<()> {
        self.inner.release(xfer)
    }

    fn notify(&self, agent: &AgentName, msg: &[u8]) -> Result<()> {
        self.inner.notify(agent, msg)
    }

    fn drain_notifications(&self, out: &mut Vec<Notification>) -> Result<()> {
        Self::count(&self.passes);
        let from = out.len();
        self.inner.drain_notifications(out)?;
        self.drained.lock().unwrap_or_else(PoisonError::into_inner).extend_from_slice(&out[from..]);
        Ok(())
    }

    fn progress(&self) -> Result<()> {
        Self::count(&self.passes);
        self.inner.progress()
    }

    fn wake_on_notification(&self, wake: NotificationWaker) -> bool {
        self.inner.wake_on_notification(wake)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_noop_agent_accepts_everything_and_completes_nothing() {
        let agent = NoopAgent::new("a");
        let peer = agent.load_remote(&NoopAgent::new("b").local_metadata().unwrap()).unwrap();
        assert_eq!(peer.as_str(), "b");
        assert!(agent.load_remote(&[0xff]).is_err(), "metadata is a name");
        let list =
            BlockList { kind: crate::MemKind::Dram, device: 0, bases: vec![0], num_blocks: 1, block_len: 1 };
        let (l, r) = (
            agent.prep_dlist(&DlistOwner::Local, &list).unwrap(),
            agent.prep_dlist(&DlistOwner::Remote(peer), &list).unwrap(),
        );
        assert_ne!(l, r);
        let x = agent.post(XferOp::Read, l, &[0], r, &[0], None).unwrap();
        assert_eq!(agent.poll(x).unwrap(), XferState::Pending);
        let mut done = Vec::new();
        agent.drain_completions(&mut done).unwrap();
        assert!(done.is_empty());
    }

    #[test]
    fn a_recording_counts_calls_and_keeps_what_was_drained() {
        let mut inner = crate::mock::MockTransferAgent::new();
        inner.expect_poll().returning(|_| Ok(XferState::Done));
        inner.expect_progress().returning(|| Ok(()));
        inner.expect_drain_notifications().returning(|out| {
            out.push(Notification { from: "p".into(), msg: b"m".to_vec() });
            Ok(())
        });
        let r = Recording::new(Arc::new(inner));
        assert_eq!(r.poll(XferId(1)).unwrap(), XferState::Done);
        r.progress().unwrap();
        let mut out = vec![Notification { from: "x".into(), msg: Vec::new() }];
        r.drain_notifications(&mut out).unwrap();
        assert_eq!(r.calls(), Calls { posts: 0, polls: 1, passes: 2 });
        assert_eq!(r.take_notifications(), out[1..]);
        assert!(r.take_notifications().is_empty());
    }
}
