//! Block posts ([`TransferAgent::post_blocks`]): checked once for every backend and planned as
//! coalesced runs.
//!
//! A [`BlockPost`] names each block pair once; region `r` of the local list pairs with region `r`
//! of the remote list. Pairs `i` and `i + 1` whose blocks follow each other on both sides (local
//! `b, b + 1`, remote `c, c + 1`) lie back to back in every region, so a *run* of such pairs is one
//! range per region: the plan stores the runs once (O(blocks)) and, per covered region, where its
//! runs start (O(regions)). Where a region takes exactly one run covering the whole region on both
//! sides, and the next region does too and follows it in memory on both sides (inside one
//! registration of the backend), the two become one range. With kvx's layouts that happens only
//! when a transfer moves every block of the pool: each region is one layer's K or V (or packed
//! KV) for the whole pool, and K and V of a layer are adjacent.
//!
//! A backend iterates the plan's [`Range`]s: (region, local address, remote address, length),
//! computed by one multiplication and addition each, without division.
//!
//! [`TransferAgent::post_blocks`]: crate::TransferAgent::post_blocks

use crate::error::{Error, Result};
use crate::ids::AgentName;
use crate::transfer::{BlockPost, Capabilities, DlistId, RegionBlocks, XferOp};

use super::{DlistView, check_block_len, check_lists};

/// The arguments of one [`post_blocks`](crate::TransferAgent::post_blocks), as the backend
/// received them.
#[derive(Debug, Clone, Copy)]
pub struct BlockPostRequest<'a> {
    /// READ or WRITE.
    pub op: XferOp,
    /// The local list.
    pub local: DlistId,
    /// The remote list.
    pub remote: DlistId,
    /// The block pairs and the regions that take them.
    pub blocks: BlockPost<'a>,
    /// The notification to send once the data is in place.
    pub notify: Option<&'a [u8]>,
}

/// A run of block pairs contiguous on both sides: pairs `first..first + blocks` of the post are
/// local blocks `local..local + blocks` and remote blocks `remote..remote + blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    first: usize,
    local: u32,
    remote: u32,
    blocks: u32,
}

/// The runs of one region, or of several adjacent regions merged into one range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    /// The (first) region.
    region: usize,
    local_base: u64,
    remote_base: u64,
    /// The region's first run, and how many of its blocks the region skips (a window).
    first_run: usize,
    skip: u32,
    /// Regions merged into this span (1 unless each takes one whole-region run).
    regions: u32,
}

/// One contiguous range of a planned block post: `len` bytes at `local` <-> `len` bytes at
/// `remote`, in region `region` of both lists (a range merged across regions starts there, and
/// the backend said the regions it covers share that region's registration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// The region (an index into [`BlockList::bases`](crate::BlockList::bases) of both lists).
    pub region: usize,
    /// The local address.
    pub local: u64,
    /// The remote address.
    pub remote: u64,
    /// Bytes, a multiple of the block length.
    pub len: u64,
}

/// The ranges of a checked block post, stored in O(runs + regions): what a backend keeps for the
/// transfer. Owns its data (no borrow of the lists).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRuns {
    block_len: u64,
    runs: Vec<Run>,
    spans: Vec<Span>,
    ranges: usize,
    descriptors: u64,
}

impl BlockRuns {
    /// Bytes per block.
    pub fn block_len(&self) -> u64 {
        self.block_len
    }

    /// Number of ranges (descriptors after coalescing); never zero for a checked post.
    pub fn len(&self) -> usize {
        self.ranges
    }

    /// Whether there is no range (never, for a checked post).
    pub fn is_empty(&self) -> bool {
        self.ranges == 0
    }

    /// Block descriptors before coalescing (block pairs × the regions that take them).
    pub fn descriptors(&self) -> u64 {
        self.descriptors
    }

    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.descriptors * self.block_len
    }

    /// The region of each span of ranges, in order (a region whose ranges merge with the next
    /// regions' is named once): the regions whose registrations the transfer uses.
    pub fn regions(&self) -> impl Iterator<Item = usize> + '_ {
        self.spans.iter().map(|s| s.region)
    }

    /// Every range, region by region, in the post's pair order within each region.
    pub fn iter(&self) -> Ranges<'_> {
        Ranges { runs: self, span: 0, run: self.spans.first().map_or(0, |s| s.first_run) }
    }
}

impl<'r> IntoIterator for &'r BlockRuns {
    type Item = Range;
    type IntoIter = Ranges<'r>;

    fn into_iter(self) -> Ranges<'r> {
        self.iter()
    }
}

/// The iterator of [`BlockRuns::iter`].
#[derive(Debug, Clone)]
pub struct Ranges<'r> {
    runs: &'r BlockRuns,
    span: usize,
    /// The next run of the current span.
    run: usize,
}

impl Iterator for Ranges<'_> {
    type Item = Range;

    fn next(&mut self) -> Option<Range> {
        let BlockRuns { block_len, runs, spans, .. } = self.runs;
        loop {
            let span = spans.get(self.span)?;
            let Some(run) = runs.get(self.run) else {
                self.span += 1;
                self.run = spans.get(self.span).map_or(0, |s| s.first_run);
                continue;
            };
            // The check made every range lie inside its region, which does not wrap: no overflow.
            let range = if span.regions > 1 {
                // Whole regions back to back: one range (the span's only run).
                self.run = runs.len();
                Range {
                    region: span.region,
                    local: span.local_base,
                    remote: span.remote_base,
                    len: u64::from(span.regions) * u64::from(run.blocks) * block_len,
                }
            } else {
                let skip = if self.run == span.first_run { span.skip } else { 0 };
                self.run += 1;
                Range {
                    region: span.region,
                    local: span.local_base + u64::from(run.local + skip) * block_len,
                    remote: span.remote_base + u64::from(run.remote + skip) * block_len,
                    len: u64::from(run.blocks - skip) * block_len,
                }
            };
            return Some(range);
        }
    }
}

/// A block post whose arguments passed every check of [`BlockPostRequest::check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockPlan<'a> {
    op: XferOp,
    peer: &'a AgentName,
    notify: Option<&'a [u8]>,
    runs: BlockRuns,
}

impl<'a> BlockPlan<'a> {
    /// READ or WRITE.
    pub fn op(&self) -> XferOp {
        self.op
    }

    /// The peer that owns the remote list.
    pub fn peer(&self) -> &'a AgentName {
        self.peer
    }

    /// The notification to send once the data is in place.
    pub fn notify(&self) -> Option<&'a [u8]> {
        self.notify
    }

    /// The ranges to move.
    pub fn runs(&self) -> &BlockRuns {
        &self.runs
    }

    /// The ranges to move, to keep with the transfer.
    pub fn into_runs(self) -> BlockRuns {
        self.runs
    }
}

impl<'a> BlockPostRequest<'a> {
    /// Checks the post against `caps` and the lists `lists` finds (`None`: no such list of this
    /// agent), in the order and with the kinds that
    /// [`TransferAgent::post_blocks`](crate::TransferAgent::post_blocks) documents, and plans it
    /// as coalesced runs. Errors name `caps.backend`.
    ///
    /// `joinable(list, r)` says whether one range of `list` may run from region `r` into region
    /// `r + 1` (both lie in one registration of the backend); the plan asks it only where both
    /// regions are whole and back to back. A backend that cannot move such a range says `false`.
    ///
    /// O(blocks + regions × log runs) time (a windowed region looks its first run up), O(runs +
    /// regions) memory.
    pub fn check(
        &self,
        caps: &Capabilities,
        lists: impl Fn(DlistId) -> Option<DlistView<'a>>,
        joinable: impl Fn(DlistId, usize) -> bool,
    ) -> Result<BlockPlan<'a>> {
        let invalid = |message: String| Error::invalid_argument(message).with_backend(caps.backend);
        let (local, remote, peer) = check_lists(caps, self.op, self.notify, self.local, self.remote, lists)?;
        let BlockPost { local_blocks, local_num_blocks, remote_blocks, remote_num_blocks, regions } =
            self.blocks;
        let pairs = local_blocks.len();
        if pairs != remote_blocks.len() {
            return Err(invalid(format!("{pairs} local and {} remote blocks", remote_blocks.len())));
        }
        let covered = regions.count();
        if (0..covered).all(|r| regions.first_pair(r, pairs) >= pairs) {
            return Err(invalid("a post of no descriptors".to_owned()));
        }
        let block_len = check_block_len(caps, local.blocks, remote.blocks)?;
        for (id, list, assumed) in
            [(self.local, local.blocks, local_num_blocks), (self.remote, remote.blocks, remote_num_blocks)]
        {
            if list.num_blocks != assumed {
                return Err(invalid(format!(
                    "{id} has {} blocks per region, the post assumes {assumed}",
                    list.num_blocks
                )));
            }
            if list.bases.len() < covered {
                return Err(invalid(format!(
                    "the post covers {covered} regions, {id} has {}",
                    list.bases.len()
                )));
            }
            if let Some(r) = list.regions().take(covered).position(|region| region.is_none()) {
                return Err(invalid(format!("region {r} of {id} wraps the address space")));
            }
        }
        for (id, blocks, num_blocks) in
            [(self.local, local_blocks, local_num_blocks), (self.remote, remote_blocks, remote_num_blocks)]
        {
            if let Some(b) = blocks.iter().find(|&&b| b >= num_blocks) {
                return Err(invalid(format!(
                    "block {b} out of range of {id} ({num_blocks} blocks per region)"
                )));
            }
        }
        let runs: Vec<Run> = RunIter::new(local_blocks, remote_blocks).collect();
        let region_len = u64::from(local_num_blocks) * block_len;
        let whole = |run: &Run| {
            run.local == 0
                && run.remote == 0
                && run.blocks == local_num_blocks
                && run.blocks == remote_num_blocks
        };
        let mut spans: Vec<Span> = Vec::with_capacity(covered);
        let (mut ranges, mut descriptors) = (0, 0);
        let mut last: Option<(usize, usize)> = None;
        for r in 0..covered {
            let first = regions.first_pair(r, pairs);
            if first >= pairs {
                continue;
            }
            let first_run = match last {
                Some((pair, run)) if pair == first => run,
                // runs[0] starts at pair 0 <= first.
                _ => runs.partition_point(|run| run.first <= first).saturating_sub(1),
            };
            last = Some((first, first_run));
            let run = &runs[first_run];
            // `first` lies in the run; a run has at most u32::MAX blocks.
            let skip = (first - run.first) as u32;
            descriptors += (pairs - first) as u64;
            let (local_base, remote_base) = (local.blocks.bases[r], remote.blocks.bases[r]);
            let alone = first_run + 1 == runs.len() && skip == 0 && whole(run);
            let merges = alone
                && spans.last().is_some_and(|prev| {
                    prev.region + prev.regions as usize == r
                        && prev.first_run == first_run
                        && prev.skip == 0
                        && local.blocks.bases[r - 1].checked_add(region_len) == Some(local_base)
                        && remote.blocks.bases[r - 1].checked_add(region_len) == Some(remote_base)
                        && joinable(self.local, r - 1)
                        && joinable(self.remote, r - 1)
                });
            match spans.last_mut() {
                Some(prev) if merges => prev.regions += 1,
                _ => {
                    ranges += runs.len() - first_run;
                    spans.push(Span { region: r, local_base, remote_base, first_run, skip, regions: 1 });
                }
            }
        }
        let runs = BlockRuns { block_len, runs, spans, ranges, descriptors };
        Ok(BlockPlan { op: self.op, peer, notify: self.notify, runs })
    }
}

impl BlockPost<'_> {
    /// The descriptors this post becomes where no range merges across regions: per covered
    /// region, one per run of its block pairs contiguous on both sides. Ids are not checked;
    /// unequal slices count their common prefix. O(blocks) without windows, O(blocks + regions ×
    /// log runs) with.
    pub fn coalesced_len(&self) -> u64 {
        let pairs = self.local_blocks.len().min(self.remote_blocks.len());
        let runs = RunIter::new(self.local_blocks, self.remote_blocks);
        match self.regions {
            RegionBlocks::All(n) => u64::from(n) * runs.count() as u64,
            RegionBlocks::Windows(_) => {
                let starts: Vec<usize> = runs.map(|run| run.first).collect();
                (0..self.regions.count())
                    .map(|r| self.regions.first_pair(r, pairs))
                    .filter(|&first| first < pairs)
                    .map(|first| (starts.len() + 1 - starts.partition_point(|&s| s <= first)) as u64)
                    .sum()
            }
        }
    }
}

/// The runs of a list of block pairs, in order (over their common prefix).
struct RunIter<'a> {
    local: &'a [u32],
    remote: &'a [u32],
    next: usize,
}

impl<'a> RunIter<'a> {
    fn new(local: &'a [u32], remote: &'a [u32]) -> Self {
        RunIter { local, remote, next: 0 }
    }
}

impl Iterator for RunIter<'_> {
    type Item = Run;

    fn next(&mut self) -> Option<Run> {
        let first = self.next;
        let (&local, &remote) = (self.local.get(first)?, self.remote.get(first)?);
        let mut run = Run { first, local, remote, blocks: 1 };
        let following = self.local[first + 1..].iter().zip(&self.remote[first + 1..]);
        for (&l, &r) in following {
            let (Some(next_l), Some(next_r)) =
                (run.local.checked_add(run.blocks), run.remote.checked_add(run.blocks))
            else {
                break;
            };
            if l != next_l || r != next_r {
                break;
            }
            run.blocks += 1;
        }
        self.next = first + run.blocks as usize;
        Some(run)
    }
}

#[cfg(test)]
mod tests;
