//! Closing a worker: every READ in flight is cancelled or released, every load fails, every hold
//! ends, and the agent gets back every descriptor list, peer and registration the worker made, so
//! that it keeps none of the KV memory alive on the worker's behalf. A closed worker refuses new
//! work with `State`.

use tracing::debug;

use super::ConnectorWorker;
use crate::error::{Error, ErrorKind, Result};
use crate::ids::AgentName;
use crate::meta::ConnectorMetadata;
use crate::transfer::{DlistId, RegistrationId, TransferAgent, XferId};

/// What a closed worker has not yet given back to its agent (the agent refused it): retried by
/// the next [`ConnectorWorker::close`].
#[derive(Debug, Default)]
pub(super) struct Leftovers {
    transfers: Vec<XferId>,
    dlists: Vec<DlistId>,
    peers: Vec<AgentName>,
    registrations: Vec<RegistrationId>,
}

impl Leftovers {
    /// Hands everything back, in the order the agent needs: transfers, then the lists (a list
    /// before its peer is forgotten or its memory deregistered), then peers, then registrations.
    /// Keeps what the agent refused; returns the first refusal.
    fn give_back(&mut self, agent: &dyn TransferAgent) -> Result<()> {
        let mut first = None;
        settle(&mut self.transfers, &mut first, |x| agent.release(*x));
        settle(&mut self.dlists, &mut first, |d| agent.release_dlist(*d));
        settle(&mut self.peers, &mut first, |p| agent.forget_remote(p));
        settle(&mut self.registrations, &mut first, |r| agent.deregister(*r));
        match first {
            None => Ok(()),
            Some(e) => Err(e.context(format!(
                "closing the worker: the agent still holds {} transfers, {} lists, {} peers and {} \
                 registrations of it (close again once they settle; dropping the agent ends them)",
                self.transfers.len(),
                self.dlists.len(),
                self.peers.len(),
                self.registrations.len()
            ))),
        }
    }
}

/// Gives each item back through `give`, keeping those the agent refused. An item the agent no
/// longer knows (`NotFound`) is gone already: a list goes with its peer or its memory.
fn settle<T: std::fmt::Debug>(
    items: &mut Vec<T>,
    first: &mut Option<Error>,
    give: impl Fn(&T) -> Result<()>,
) {
    items.retain(|item| match give(item) {
        Ok(()) => false,
        Err(e) if e.kind() == ErrorKind::NotFound => false,
        Err(e) => {
            debug!(?item, error = %e, "the agent refused to give back what the worker made");
            first.get_or_insert(e);
            true
        }
    });
}

impl ConnectorWorker {
    /// Closes the worker, before its KV memory is freed: cancels (or, where the backend cannot,
    /// releases) every READ in flight, tells the prefill engines it can reach to free the holds
    /// of those loads, fails every load (`State`) and ends every hold (both reported by the next
    /// [`get_finished`](Self::get_finished)); then releases every descriptor list, forgets every
    /// peer and deregisters every registration it made. Nothing waits: a backend that keeps a
    /// transfer's memory until the transfer settles frees it then.
    ///
    /// Afterwards the worker refuses work: [`register_kv_caches`](Self::register_kv_caches)
    /// fails with `State`, loads fail with `State`, holds end at once, and nothing calls the
    /// agent. Closing again retries only what the agent refused the first time.
    ///
    /// # Errors
    /// The first refusal of the agent (say, `State` from a backend that refuses to deregister
    /// memory under a running transfer), after everything else was given back.
    pub fn close(&mut self) -> Result<()> {
        let mut left = match self.closed.take() {
            Some(left) => left,
            None => self.end_everything(),
        };
        let result = left.give_back(self.agent.as_ref());
        self.closed = Some(left);
        result
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.closed.is_some()
    }

    pub(super) fn check_open(&self) -> Result<()> {
        match self.closed {
            Some(_) => Err(closed()),
            None => Ok(()),
        }
    }

    /// A closed worker's answer to a step's metadata: holds end, loads fail.
    pub(super) fn refuse(&mut self, meta: &ConnectorMetadata) {
        self.finished.sending.extend(meta.reqs_to_send.iter().map(|h| h.request_id.clone()));
        self.finished.sending.extend(meta.reqs_to_push.iter().map(|h| h.request_id.clone()));
        let loads = meta.reqs_to_recv.iter().chain(&meta.reqs_to_register);
        for req in loads.filter(|r| !r.is_notify_only()) {
            self.fail(&req.request_id, closed());
        }
    }

    /// Ends the loads, holds and connections; returns what the agent must give back.
    fn end_everything(&mut self) -> Leftovers {
        let mut left = Leftovers { transfers: self.close_loads(), ..Leftovers::default() };
        let ended = self.holds.close(&self.config);
        self.finished.sending.extend(ended);
        let (failed, cancels) = self.registrations.close();
        self.apply_registrations(std::time::Instant::now(), cancels);
        for id in failed {
            self.fail(&id, closed());
        }
        let (ended, writes) = self.pushes.close(&self.config);
        self.finished.sending.extend(ended);
        left.transfers.extend(writes);
        let peers = self.peers.close();
        self.stats.unsent_messages += peers.unsent;
        for conn in peers.connections {
            left.dlists.push(conn.dlist);
            left.dlists.extend(conn.head_dlist);
            left.peers.push(conn.agent);
        }
        if let Some(registered) = self.registered.take() {
            left.dlists.push(registered.local_dlist);
            left.dlists.extend(registered.head_dlist);
            left.registrations = registered.registrations;
        }
        left
    }
}

/// The error of work asked of a closed worker.
pub(super) fn closed() -> Error {
    Error::new(ErrorKind::State, "the worker is closed")
}
