//! What a request loads: the tokens it matches remotely and the blocks allocated for them.

use super::*;

/// The first block position a load ending before position `end` needs of a group with `window`
/// (tokens), from `from` on: every one for full attention; for a sliding window, only those the
/// window of the first token computed after the load reaches (vLLM keeps the blocks from token
/// `n - window + 1` on once `n` tokens are computed).
fn needed_from(window: Option<u32>, from: u64, end: u64, block_size: u64) -> u64 {
    match window {
        None => from,
        Some(w) => from
            .max(end.saturating_mul(block_size).saturating_add(1).saturating_sub(u64::from(w)) / block_size),
    }
}

impl ConnectorScheduler {
    /// How many of the prompt's tokens, beyond the `num_computed_tokens` the local prefix cache
    /// holds, load from the remote engine.
    ///
    /// Only requests with `do_remote_prefill` and complete remote coordinates load anything. The
    /// remote engine sends full blocks only: the count is the prompt rounded down to a block,
    /// capped by the blocks every group offers, minus the computed tokens. It is 0 when a
    /// sliding-window group no longer holds a block the window needs (the prefill engine dropped
    /// it), or when the offer's groups are not this engine's. Free of side effects (vLLM may
    /// ask again for a request it could not schedule): what to load, or only to notify, is recorded
    /// by [`update_state_after_alloc`](Self::update_state_after_alloc).
    pub fn get_num_new_matched_tokens(
        &self,
        request_id: &RequestId,
        prompt_len: usize,
        params: Option<&TransferParams>,
        num_computed_tokens: usize,
    ) -> Result<MatchedTokens> {
        let Some(params) = params.filter(|p| p.do_remote_prefill) else {
            return Ok(MatchedTokens::default());
        };
        let bs = self.block_size();
        if num_computed_tokens % bs != 0 {
            return Err(Error::invalid_argument(format!(
                "request {request_id}: {num_computed_tokens} computed tokens is not a multiple of block size {bs}"
            )));
        }
        let Some((_, groups)) = self.offered(request_id, params) else {
            return Ok(MatchedTokens::default());
        };
        let first = (num_computed_tokens / bs) as u64;
        let end = match params.mode() {
            TransferMode::Push => self.push_end(request_id, prompt_len, first),
            TransferMode::Pull => self.load_end(request_id, &groups, prompt_len, first),
        };
        let Some(end) = end else {
            return Ok(MatchedTokens::default());
        };
        let count = (end.saturating_sub(first) as usize).saturating_mul(bs);
        Ok(MatchedTokens { count, load_async: count > 0 })
    }

    /// The coordinates and groups of an offer, or `None` (with a warning) when they are
    /// incomplete or do not check.
    pub(super) fn offered(
        &self,
        request_id: &RequestId,
        params: &TransferParams,
    ) -> Option<(RemoteCoordinates, Vec<GroupBlocks>)> {
        let Some(remote) = params.coordinates() else {
            warn!(%request_id, "do_remote_prefill without complete remote coordinates: computing locally");
            return None;
        };
        match params.remote_groups() {
            Ok(groups) => Some((remote, groups)),
            Err(e) => {
                warn!(%request_id, error = %e, "kv_transfer_params ignored: computing locally");
                None
            }
        }
    }

    /// The block position where a load from `first` ends: the prompt's full blocks, capped by
    /// every group's offer. `None` when nothing past `first` can load: the offer's groups are not
    /// this engine's, a full-attention group misses a block from `first` on, or a sliding-window
    /// group misses one its window needs.
    fn load_end(
        &self,
        request_id: &RequestId,
        groups: &[GroupBlocks],
        prompt_len: usize,
        first: u64,
    ) -> Option<u64> {
        let windows = self.config.windows();
        if groups.len() != windows.len() {
            if groups.iter().any(|g| !g.ids.is_empty()) {
                warn!(%request_id, offered = groups.len(), here = windows.len(), "the offer's KV-cache groups are not this engine's: computing locally");
            }
            return None;
        }
        let bs = self.block_size() as u64;
        let end = groups.iter().map(GroupBlocks::end).fold((prompt_len as u64) / bs, u64::min);
        self.covered(request_id, groups.iter().map(|g| u64::from(g.first)), first, end)
    }

    /// Where a push from `first` ends: the prompt's full blocks, which the prefill engine
    /// computes whole. Of a sliding-window group it keeps the blocks from where the window of its
    /// last prompt token starts on (vLLM drops those before); `None` when that is past a block
    /// this engine's window needs, or nothing past `first` can load.
    fn push_end(&self, request_id: &RequestId, prompt_len: usize, first: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        let held_from =
            |w: &Option<u32>| w.map_or(0, |w| (prompt_len as u64 + 1).saturating_sub(u64::from(w)) / bs);
        let firsts = self.config.windows().iter().map(held_from);
        self.covered(request_id, firsts, first, prompt_len as u64 / bs)
    }

    /// `end`, when it is past `first` and each group's first remote position (`firsts`) is at
    /// or before the first one this engine needs of it.
    fn covered(
        &self,
        request_id: &RequestId,
        firsts: impl Iterator<Item = u64>,
        first: u64,
        end: u64,
    ) -> Option<u64> {
        let bs = self.block_size() as u64;
        let mut firsts = firsts;
        let covered = self
            .config
            .windows()
            .iter()
            .all(|&w| firsts.next().unwrap_or(0) <= needed_from(w, first, end, bs));
        if end <= first {
            return None;
        }
        if !covered {
            debug!(%request_id, "the prefill engine no longer holds every block a window needs: computing locally");
            return None;
        }
        Some(end)
    }

    /// Records the blocks allocated for a request's remote tokens. `new_blocks` are, per KV-cache
    /// group, the blocks newly allocated for it (not prefix-cached) at their block positions; the
    /// positions from the one after the `num_computed_tokens` the local prefix cache holds up to
    /// `num_computed_tokens + num_external_tokens` receive the remote blocks at the same
    /// positions (of a sliding-window group, only those its window needs).
    ///
    /// A request triggers at most one load: `do_remote_prefill` is turned off here, so a second
    /// call for the same request (vLLM makes one when an async load completes) does nothing. With
    /// `num_external_tokens == 0` while the remote holds blocks (a full local prefix hit), the
    /// request is recorded as notify-only, so that the prefill engine is still told to free.
    pub fn update_state_after_alloc(
        &mut self,
        request_id: &RequestId,
        prompt_len: usize,
        params: Option<&mut TransferParams>,
        new_blocks: &[GroupBlocks],
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> Result<()> {
        let Some(params) = params.filter(|p| p.do_remote_prefill) else {
            return Ok(());
        };
        params.do_remote_prefill = false;
        let Some((remote, groups)) = self.offered(request_id, params) else {
            self.awaiting.remove(request_id);
            return Ok(());
        };
        let push = params.mode() == TransferMode::Push;
        if num_external_tokens == 0 {
            self.awaiting.remove(request_id);
            // A push's prefill engine holds blocks when the prompt has a full one.
            if (push && prompt_len >= self.block_size()) || params.has_remote_blocks() {
                debug!(%request_id, "nothing to load: notify the prefill engine only");
                self.pending_recv.insert(request_id.clone(), PendingRecv::new(remote, params, groups));
            }
            return Ok(());
        }
        let local = match self.local_blocks(
            (!push).then_some(groups.as_slice()),
            new_blocks,
            prompt_len,
            num_computed_tokens,
            num_external_tokens,
        ) {
            Ok(local) => local,
            Err(misfit) => {
                // The prefill engine is still told to free: the load never happens.
                self.pending_recv.insert(request_id.clone(), PendingRecv::new(remote, params, groups));
                self.awaiting.remove(request_id);
                return Err(Error::invalid_argument(format!("request {request_id}: {misfit}")));
            }
        };
        if !self.awaiting.contains_key(request_id) {
            if let Some(entry) = self.lease_of(params) {
                self.awaiting.insert(request_id.clone(), entry);
            }
        }
        let pending = PendingRecv { local_block_ids: local, ..PendingRecv::new(remote, params, groups) };
        self.pending_recv.insert(request_id.clone(), pending);
        Ok(())
    }

    /// The local blocks a load fills, per group, or what does not fit: positions past the
    /// computed tokens up to the external ones, of a sliding-window group only those its window
    /// needs, each allocated locally and offered remotely (`offered`; `None` for a push, whose
    /// prefill engine offered nothing yet).
    fn local_blocks(
        &self,
        offered: Option<&[GroupBlocks]>,
        new_blocks: &[GroupBlocks],
        prompt_len: usize,
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> std::result::Result<Vec<GroupBlocks>, String> {
        let bs = self.block_size();
        if num_external_tokens % bs != 0 || num_computed_tokens % bs != 0 {
            return Err("computed and external tokens must be whole blocks".to_owned());
        }
        let windows = self.config.windows();
        let offered_groups = offered.map_or(windows.len(), <[GroupBlocks]>::len);
        if offered_groups != windows.len() || new_blocks.len() != windows.len() {
            return Err(format!(
                "{offered_groups} KV-cache groups offered and {} allocated, but this engine has {}",
                new_blocks.len(),
                windows.len()
            ));
        }
        let (first, needed) = ((num_computed_tokens / bs) as u64, (num_external_tokens / bs) as u64);
        let end = first.saturating_add(needed);
        if end > (prompt_len / bs) as u64 {
            return Err(format!(
                "{num_computed_tokens} computed and {num_external_tokens} external tokens exceed the \
                 {prompt_len}-token prompt's full blocks"
            ));
        }
        let mut local = Vec::with_capacity(windows.len());
        for (g, (allocated, &window)) in new_blocks.iter().zip(windows).enumerate() {
            let from = needed_from(window, first, end, bs as u64);
            let Some(ids) = allocated.at(from, end) else {
                return Err(format!(
                    "group {g}: block positions {from}..{end} to load but {}..{} allocated",
                    allocated.first,
                    allocated.end()
                ));
            };
            if let Some(offered) = offered.and_then(|o| o.get(g)).filter(|o| o.at(from, end).is_none()) {
                return Err(format!(
                    "group {g}: block positions {from}..{end} to load but the remote offers {}..{}",
                    offered.first,
                    offered.end()
                ));
            }
            // `from <= end <= prompt_len / bs`, so `from` fits a block position.
            local.push(GroupBlocks::new(from as u32, ids.to_vec()));
        }
        Ok(local)
    }
}
