//! The step's internals: scheduling, the model run, finishing, failing and completing loads.

use kvx_core::{BlockId, Error, ErrorKind, FinishReason, Finished, GroupBlocks, RequestId, Result};

use crate::sim::config::{LoadFailurePolicy, RequestState};
use crate::sim::model::{self, ModelSpec};
use crate::sim::pool::{BlockHash, BlockPool, PoolError};

use super::*;

impl SimEngine {
    pub(super) fn error(&mut self, msg: String) {
        tracing::error!(engine = %self.config.engine_id, "{msg}");
        self.errors.push(msg);
    }

    pub(super) fn pool_result(&mut self, what: &str, id: &RequestId, r: Result<(), PoolError>) {
        if let Err(e) = r {
            self.error(format!("{what} of request {id}: {e}"));
        }
    }

    /// Admits waiting requests in arrival order while their blocks fit.
    pub(super) fn schedule_waiting(&mut self) {
        let (bs, groups) = (self.config.model.block_size as usize, self.config.model.groups.len());
        while let Some(id) = self.waiting.front().cloned() {
            let Some(r) = self.requests.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let hashes = full_block_hashes(&r.tokens[..r.prompt_len], bs);
            // At least one prompt token is always computed, so the last one yields logits.
            let hit = self.prefix_hit(&hashes[..hashes.len().min((r.prompt_len - 1) / bs)]);
            // Every group's blocks from position 0: more than sliding-window groups keep.
            let total = (r.prompt_len + r.max_new_tokens).div_ceil(bs) * groups;
            if self.pool.num_free() < total {
                break;
            }
            self.waiting.pop_front();
            if let Err(e) = self.admit(&id, hit, hashes) {
                self.error(format!("admitting request {id}: {e}"));
                self.fail(&id, e);
            }
        }
    }

    /// The longest prefix hit of the full blocks whose chained hashes are `hashes` (vLLM's hybrid
    /// rule): `h` blocks such that every full-attention group has positions `0..h` cached and
    /// every sliding-window group the positions before `h` its window needs; with each group's
    /// cached blocks of those positions.
    fn prefix_hit(&self, hashes: &[BlockHash]) -> (usize, Vec<GroupBlocks>) {
        let model = &self.config.model;
        let bs = model.block_size as usize;
        let hits = |h: usize| -> Option<Vec<GroupBlocks>> {
            (0..model.groups.len())
                .map(|g| {
                    let from = model.window_start(g, h * bs);
                    let cached = |i: usize| self.pool.cached_block(model::group_hash(hashes[i], g));
                    let ids = (from..h).map(cached).collect::<Option<Vec<_>>>()?;
                    Some(GroupBlocks::new(from as u32, ids))
                })
                .collect()
        };
        // No hit (h = 0) always fits.
        (0..=hashes.len())
            .rev()
            .find_map(|h| Some((h, hits(h)?)))
            .unwrap_or_else(|| (0, vec![GroupBlocks::default(); model.groups.len()]))
    }

    /// Takes a waiting request's prefix hit (`h` blocks, each group's cached blocks) and allocates
    /// the rest of its blocks; a sliding-window group gets none before the window of the tokens
    /// known once the load is in (vLLM's null blocks), hit or not.
    pub(super) fn admit(
        &mut self,
        id: &RequestId,
        (h, hit): (usize, Vec<GroupBlocks>),
        hashes: Vec<BlockHash>,
    ) -> Result<()> {
        let model = &self.config.model;
        let bs = model.block_size as usize;
        let Some(r) = self.requests.get_mut(id) else { return Ok(()) };
        let computed = h * bs;
        let matched =
            self.scheduler.get_num_new_matched_tokens(id, r.prompt_len, r.params.as_ref(), computed)?;
        let known = computed + matched.count;
        let total = (r.prompt_len + r.max_new_tokens).div_ceil(bs);
        let pool_err = |e: PoolError| Error::new(ErrorKind::State, e.to_string());
        r.block_hashes = hashes[..h].to_vec();
        r.num_computed = computed;
        r.groups = Vec::with_capacity(hit.len());
        let mut new_blocks = Vec::with_capacity(hit.len());
        for (g, hit) in hit.into_iter().enumerate() {
            let from = model.window_start(g, known);
            let kept = hit
                .at(from.min(h) as u64, h as u64)
                .ok_or_else(|| Error::new(ErrorKind::State, format!("group {g}: a hit without its window")))?
                .to_vec();
            self.pool.touch(&kept).map_err(pool_err)?;
            r.groups.push(GroupBlocks::new(from as u32, kept));
        }
        // Every group's hits are taken before any block is allocated: an allocation may evict a
        // free cached block, which another group's hit may be.
        for group in &mut r.groups {
            let start = (group.first as usize).max(h);
            let new = self.pool.allocate(total - start).map_err(pool_err)?;
            group.ids.extend_from_slice(&new);
            new_blocks.push(GroupBlocks::new(start as u32, new));
        }
        self.stats.tokens_cached += computed as u64;
        self.scheduler.update_state_after_alloc(
            id,
            r.prompt_len,
            r.params.as_mut(),
            &new_blocks,
            computed,
            matched.count,
        )?;
        if matched.load_async && matched.count > 0 {
            r.load = Some(Load { first: h, count: matched.count / bs });
            r.state = RequestState::WaitingForRemoteKv;
        } else {
            r.state = RequestState::Running;
            self.running.push(id.clone());
        }
        Ok(())
    }

    /// One forward pass: each running request computes its prompt (the part not cached or
    /// loaded) or its latest token, and samples the next token.
    pub(super) fn run_model(&mut self) {
        let mut done = Vec::new();
        for id in &self.running {
            let Some(r) = self.requests.get_mut(id) else { continue };
            let end = if r.num_computed < r.prompt_len { r.prompt_len } else { r.num_computed + 1 };
            if let Err(e) = write_kv(&self.ranks, &self.config, r, r.num_computed, end) {
                self.errors.push(format!("request {id}: writing KV: {e}"));
            }
            r.num_computed = end;
            let token = model::next_token(r.prefixes[end - 1]);
            r.push_token(token);
            if let Err(e) = cache_full_blocks(&mut self.pool, &self.config.model, r, end) {
                self.errors.push(format!("request {id}: {e}"));
            }
            match drop_outside_windows(&mut self.pool, &self.config.model, r) {
                Ok(dropped) => self.stats.blocks_dropped += dropped,
                Err(e) => self.errors.push(format!("request {id}: dropping blocks outside a window: {e}")),
            }
            if r.tokens.len() - r.prompt_len >= r.max_new_tokens {
                done.push(id.clone());
            }
        }
        for id in done {
            self.finish(&id, FinishReason::LengthCapped);
        }
    }

    /// Ends a request: tells the scheduler, hands back its params, frees or keeps its blocks.
    pub(super) fn finish(&mut self, id: &RequestId, reason: FinishReason) {
        let Some(r) = self.requests.get_mut(id) else { return };
        self.running.retain(|x| x != id);
        r.state = match reason {
            FinishReason::Error => r.state.clone(),
            other => RequestState::Finished(other),
        };
        if reason == FinishReason::Error {
            self.stats.failed += 1;
        } else {
            self.stats.finished += 1;
        }
        self.ended.push(id.clone());
        let outcome =
            self.scheduler.request_finished(id, r.params.as_ref(), reason, r.num_computed, &r.groups);
        let blocks: Vec<BlockId> = std::mem::take(&mut r.groups).into_iter().flat_map(|g| g.ids).collect();
        let mut in_flight = std::mem::take(&mut r.in_flight);
        if let Some(params) = outcome.params {
            if outcome.delay_free {
                // Held for the reader: exactly the blocks the params offer.
                in_flight = params.remote_block_ids.iter().flatten().flatten().copied().collect();
                let held = self.pool.begin_transfer(&in_flight);
                self.pool_result("holding the blocks", id, held);
            }
            self.outputs.push((id.clone(), params));
        }
        if outcome.delay_free {
            self.delayed.insert(id.clone(), Delayed { blocks, in_flight });
        } else {
            let freed = self.pool.free(&blocks);
            self.pool_result("freeing the blocks", id, freed);
        }
    }

    pub(super) fn fail(&mut self, id: &RequestId, error: Error) {
        if let Some(r) = self.requests.get_mut(id) {
            r.state = RequestState::Failed(error);
        }
        self.finish(id, FinishReason::Error);
    }

    /// Releases blocks of requests whose transfers ended; starts or fails loaded requests.
    pub(super) fn handle_finished(&mut self, mut finished: Finished) {
        // In id order: the workers' reports come in hash-map order, and the order blocks go back
        // to the pool decides which blocks later requests get (a run must replay exactly).
        finished.sending.sort();
        finished.recving.sort();
        finished.failed_recving.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        for id in finished.sending {
            self.release_delayed(&id, "a finished send");
        }
        let failed = finished.failed_recving.into_iter().map(|f| (f.request_id, Some(f.error)));
        for (id, failure) in finished.recving.into_iter().map(|id| (id, None)).chain(failed) {
            if self.delayed.contains_key(&id) {
                // Aborted while its READ was in flight: only now may its blocks go.
                self.release_delayed(&id, "a finished load");
                continue;
            }
            let Some(r) = self.requests.get_mut(&id) else {
                self.error(format!("load of unknown request {id} finished"));
                continue;
            };
            if r.state != RequestState::WaitingForRemoteKv {
                let state = r.state.clone();
                self.error(format!("load of request {id} finished in state {state:?}"));
                continue;
            }
            let in_flight = std::mem::take(&mut r.in_flight);
            let ended = self.pool.end_transfer(&in_flight);
            self.pool_result("ending the load", &id, ended);
            match failure {
                Some(error) if self.config.load_failure == LoadFailurePolicy::Recompute => {
                    self.recompute(&id, error)
                }
                Some(error) => self.fail(&id, error),
                None => self.complete_load(&id),
            }
        }
    }

    /// A load failed: the request computes its prompt itself, from what its prefix cache held,
    /// into the blocks the load was to fill.
    pub(super) fn recompute(&mut self, id: &RequestId, error: Error) {
        let Some(r) = self.requests.get_mut(id) else { return };
        r.load = None;
        r.load_failure = Some(error);
        r.state = RequestState::Running;
        self.stats.recomputed += 1;
        self.running.push(id.clone());
    }

    pub(super) fn release_delayed(&mut self, id: &RequestId, what: &str) {
        let Some(d) = self.delayed.remove(id) else {
            self.error(format!("{what} names request {id}, which holds no blocks"));
            return;
        };
        let ended = self.pool.end_transfer(&d.in_flight);
        self.pool_result("ending the transfer", id, ended);
        let freed = self.pool.free(&d.blocks);
        self.pool_result("freeing the blocks", id, freed);
    }

    /// A load completed: checks every received byte, caches the blocks and lets the request run.
    pub(super) fn complete_load(&mut self, id: &RequestId) {
        let bs = self.config.model.block_size as usize;
        let Some(r) = self.requests.get(id) else { return };
        let checked = verify_load(&self.ranks, &self.config, r);
        self.stats.blocks_verified += checked.blocks;
        self.stats.bytes_verified += checked.bytes;
        let mismatches = checked.wrong;
        if !mismatches.is_empty() {
            self.stats.blocks_mismatched += mismatches.len() as u64;
            let first = mismatches[0].clone();
            self.error(format!(
                "request {id}: {} received blocks are wrong, first: {first}",
                mismatches.len()
            ));
            self.fail(id, Error::new(ErrorKind::Transfer, format!("received KV is wrong: {first}")));
            return;
        }
        let Some(r) = self.requests.get_mut(id) else { return };
        let Some(load) = r.load else { return };
        self.stats.tokens_loaded += (load.count * bs) as u64;
        for (g, n) in self.stats.group_blocks_loaded.iter_mut().enumerate() {
            *n += loaded_positions(r, load, g).len() as u64;
        }
        let loaded_end = load.first + load.count;
        if let Err(e) = cache_full_blocks(&mut self.pool, &self.config.model, r, loaded_end * bs) {
            self.errors.push(format!("request {id}: loaded: {e}"));
        }
        // As vLLM does: with the whole prompt in place, the last prompt token is computed again
        // to produce the first output token.
        r.num_computed = (loaded_end * bs).min(r.prompt_len - 1);
        r.state = RequestState::Running;
        self.running.push(id.clone());
    }
}

/// Caches each KV-cache group's block of every full block below `tokens` not cached yet (a
/// sliding-window group has none before its window).
fn cache_full_blocks(
    pool: &mut BlockPool,
    model: &ModelSpec,
    r: &mut Request,
    tokens: usize,
) -> Result<(), String> {
    let bs = model.block_size as usize;
    while (r.block_hashes.len() + 1) * bs <= tokens {
        let i = r.block_hashes.len();
        let h = model::block_hash(r.block_hashes.last().copied(), &r.tokens[i * bs..(i + 1) * bs]);
        r.block_hashes.push(h);
        for (g, group) in r.groups.iter().enumerate() {
            if let Some(block) = block_at(group, i) {
                pool.cache(block, model::group_hash(h, g))
                    .map_err(|e| format!("caching block {i} of group {g}: {e}"))?;
            }
        }
    }
    Ok(())
}

/// Gives back each sliding-window group's blocks that the window of the next token no longer
/// reaches (vLLM's `remove_skipped_blocks`); how many.
fn drop_outside_windows(pool: &mut BlockPool, model: &ModelSpec, r: &mut Request) -> Result<u64, PoolError> {
    let mut dropped = 0;
    for (g, group) in r.groups.iter_mut().enumerate() {
        let n =
            model.window_start(g, r.num_computed).saturating_sub(group.first as usize).min(group.ids.len());
        pool.free(&group.ids[..n])?;
        group.ids.drain(..n);
        group.first += n as u32;
        dropped += n as u64;
    }
    Ok(dropped)
}
