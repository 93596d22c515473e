//! [`FinishedAggregator`]: rank 0 reports an id once every rank of the group reported it.

use std::collections::{HashMap, HashSet};

use crate::error::Error;
use crate::ids::RequestId;
use crate::meta::{FailedRecv, Finished};

/// Rank 0's view of the whole tensor-parallel group: an id is reported once every rank reported
/// it. A load that failed on any rank is reported failed (once all ranks are done with it).
#[derive(Debug)]
pub struct FinishedAggregator {
    world_size: u32,
    sending: HashMap<RequestId, u32>,
    recving: HashMap<RequestId, (u32, Option<Error>)>,
}

impl FinishedAggregator {
    /// An aggregator for `world_size` ranks.
    pub fn new(world_size: u32) -> Self {
        FinishedAggregator { world_size: world_size.max(1), sending: HashMap::new(), recving: HashMap::new() }
    }

    /// Adds the reports of some ranks and returns the ids that every rank has now reported. An id
    /// a report names twice counts once for that rank.
    pub fn aggregate(&mut self, reports: impl IntoIterator<Item = Finished>) -> Finished {
        let mut out = Finished::default();
        for report in reports {
            let mut seen = HashSet::new();
            for id in report.sending {
                if !seen.insert(id.clone()) {
                    continue;
                }
                let n = self.sending.entry(id.clone()).or_insert(0);
                *n = n.saturating_add(1);
                if *n >= self.world_size {
                    self.sending.remove(&id);
                    out.sending.push(id);
                }
            }
            let recvs = report.recving.into_iter().map(|id| (id, None));
            let fails = report.failed_recving.into_iter().map(|f| (f.request_id, Some(f.error)));
            seen.clear();
            for (id, failure) in recvs.chain(fails) {
                if !seen.insert(id.clone()) {
                    continue;
                }
                let entry = self.recving.entry(id.clone()).or_insert((0, None));
                entry.0 = entry.0.saturating_add(1);
                if entry.1.is_none() {
                    entry.1 = failure;
                }
                if entry.0 >= self.world_size {
                    match self.recving.remove(&id).and_then(|(_, f)| f) {
                        Some(error) => out.failed_recving.push(FailedRecv { request_id: id, error }),
                        None => out.recving.push(id),
                    }
                }
            }
        }
        out
    }

    /// Ids some but not all ranks have reported.
    pub fn num_partial(&self) -> usize {
        self.sending.len() + self.recving.len()
    }
}
