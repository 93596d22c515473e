//! [`BlockPool`]: the engine's paged KV blocks, with a prefix cache and checks that nothing leaks
//! and nothing still needed by a transfer is freed.

use std::collections::{BTreeMap, HashMap};

use kvx_core::BlockId;

/// The hash of a full block of tokens, chained with the hash of the block before it, so equal
/// hashes mean equal prefixes.
pub type BlockHash = u64;

/// A misuse of the pool. Each one is a bug in the engine or the connector, reported instead of
/// corrupting the pool: the call that returns it changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Fewer free blocks than asked for.
    #[error("{wanted} blocks wanted, {free} free")]
    OutOfBlocks {
        /// Blocks asked for.
        wanted: usize,
        /// Blocks free.
        free: usize,
    },
    /// A block id past the pool.
    #[error("block {0} is not in the pool")]
    NoSuchBlock(BlockId),
    /// Freeing (or holding) a block nobody references.
    #[error("block {0} is already free")]
    AlreadyFree(BlockId),
    /// The last reference of a block went away while a transfer still needs it.
    #[error("block {0} would be freed while a transfer still needs it")]
    FreedWhileInFlight(BlockId),
    /// Ending a transfer mark that was never set.
    #[error("block {0} has no transfer in flight")]
    NotInFlight(BlockId),
}

#[derive(Debug, Clone, Default)]
struct Block {
    /// References by requests.
    refs: u32,
    /// Transfers that need the block (a READ into it, or a remote reader it is held for).
    in_flight: u32,
    hash: Option<BlockHash>,
    /// Position in the free queue, while free.
    free_at: Option<u64>,
}

/// A paged block pool with a prefix cache, in the manner of vLLM's `BlockPool`.
///
/// - Blocks are reference-counted; a block whose count drops to 0 joins the free queue's tail but
///   keeps its cached hash, so a later prefix hit can take it back. Allocation takes the queue's
///   head (the least recently freed block) and evicts its hash.
/// - Blocks a transfer needs are marked [`in flight`](Self::begin_transfer); dropping the last
///   reference of such a block is [`PoolError::FreedWhileInFlight`], so it is never reallocated.
/// - [`is_whole`](Self::is_whole) says every block is free again: nothing leaked.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Free blocks by the order they were freed (least recent first).
    free: BTreeMap<u64, BlockId>,
    next_stamp: u64,
    cached: HashMap<BlockHash, BlockId>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks.
    pub fn new(num_blocks: u32) -> Self {
        let mut pool = BlockPool {
            blocks: vec![Block::default(); num_blocks as usize],
            free: BTreeMap::new(),
            next_stamp: 0,
            cached: HashMap::new(),
        };
        for id in 0..num_blocks {
            pool.push_free(id);
        }
        pool
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks that can be allocated now.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks marked in flight.
    pub fn num_in_flight(&self) -> usize {
        self.blocks.iter().filter(|b| b.in_flight > 0).count()
    }

    /// Whether every block is free, unreferenced and not in flight.
    pub fn is_whole(&self) -> bool {
        self.free.len() == self.blocks.len() && self.blocks.iter().all(|b| b.refs == 0 && b.in_flight == 0)
    }

    /// References held on `block` (0 when free).
    pub fn refs(&self, block: BlockId) -> u32 {
        self.blocks.get(block as usize).map_or(0, |b| b.refs)
    }

    fn push_free(&mut self, id: BlockId) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.blocks[id as usize].free_at = Some(stamp);
        self.free.insert(stamp, id);
    }

    fn block(&self, id: BlockId) -> Result<&Block, PoolError> {
        self.blocks.get(id as usize).ok_or(PoolError::NoSuchBlock(id))
    }

    /// The cached blocks holding the longest prefix of `hashes` (the chained hashes of a prompt's
    /// full blocks). Takes no reference: [`touch`](Self::touch) them to keep them.
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|&h| self.cached_block(h)).collect()
    }

    /// The cached block holding the full block whose chained hash is `hash`, if any. Takes no
    /// reference.
    pub fn cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Takes a reference on each of `blocks` (prefix-cache hits), taking free ones off the free
    /// queue.
    pub fn touch(&mut self, blocks: &[BlockId]) -> Result<(), PoolError> {
        for &id in blocks {
            self.block(id)?;
        }
        for &id in blocks {
            let b = &mut self.blocks[id as usize];
            if let Some(stamp) = b.free_at.take() {
                self.free.remove(&stamp);
            }
            b.refs += 1;
        }
        Ok(())
    }

    /// Allocates `n` blocks, least recently freed first, evicting their cached hashes.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, PoolError> {
        if n > self.free.len() {
            return Err(PoolError::OutOfBlocks { wanted: n, free: self.free.len() });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let Some((_, id)) = self.free.pop_first() else { break };
            let b = &mut self.blocks[id as usize];
            b.free_at = None;
            b.refs = 1;
            if let Some(h) = b.hash.take() {
                self.cached.remove(&h);
            }
            out.push(id);
        }
        Ok(out)
    }

    /// Records that `block` holds the full block of tokens whose chained hash is `hash`, so later
    /// prompts with that prefix hit it. A hash already cached in another block is left there.
    pub fn cache(&mut self, block: BlockId, hash: BlockHash) -> Result<(), PoolError> {
        if self.block(block)?.refs == 0 {
            return Err(PoolError::AlreadyFree(block));
        }
        if self.blocks[block as usize].hash.is_none() && !self.cached.contains_key(&hash) {
            self.blocks[block as usize].hash = Some(hash);
            self.cached.insert(hash, block);
        }
        Ok(())
    }

    /// Drops one reference of each of `blocks`. Blocks are freed in reverse order, so a request's
    /// tail blocks are evicted before its head (which other prompts are likelier to share).
    pub fn free(&mut self, blocks: &[BlockId]) -> Result<(), PoolError> {
        let mut drops: HashMap<BlockId, u32> = HashMap::new();
        for &id in blocks {
            *drops.entry(id).or_insert(0) += 1;
        }
        for (&id, &n) in &drops {
            let b = self.block(id)?;
            if b.refs < n {
                return Err(PoolError::AlreadyFree(id));
            }
            if b.refs == n && b.in_flight > 0 {
                return Err(PoolError::FreedWhileInFlight(id));
            }
        }
        for &id in blocks.iter().rev() {
            let b = &mut self.blocks[id as usize];
            b.refs -= 1;
            if b.refs == 0 {
                self.push_free(id);
            }
        }
        Ok(())
    }

    /// Marks `blocks` as needed by a transfer (each must be referenced).
    pub fn begin_transfer(&mut self, blocks: &[BlockId]) -> Result<(), PoolError> {
        for &id in blocks {
            if self.block(id)?.refs == 0 {
                return Err(PoolError::AlreadyFree(id));
            }
        }
        for &id in blocks {
            self.blocks[id as usize].in_flight += 1;
        }
        Ok(())
    }

    /// Ends a [`begin_transfer`](Self::begin_transfer) mark.
    pub fn end_transfer(&mut self, blocks: &[BlockId]) -> Result<(), PoolError> {
        let mut ends: HashMap<BlockId, u32> = HashMap::new();
        for &id in blocks {
            *ends.entry(id).or_insert(0) += 1;
        }
        for (&id, &n) in &ends {
            if self.block(id)?.in_flight < n {
                return Err(PoolError::NotInFlight(id));
            }
        }
        for &id in blocks {
            self.blocks[id as usize].in_flight -= 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_least_recently_freed_and_evicts_its_hash() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(2).unwrap();
        assert_eq!(a, vec![0, 1]);
        p.cache(0, 100).unwrap();
        p.cache(1, 101).unwrap();
        p.free(&a).unwrap();
        assert_eq!(p.lookup(&[100, 101, 102]), vec![0, 1]);
        // Blocks 2 and 3 were freed earliest, then 1 (tail first), then 0.
        assert_eq!(p.allocate(3).unwrap(), vec![2, 3, 1]);
        assert_eq!(p.lookup(&[100, 101]), vec![0], "block 1 was reused: its hash is gone");
        assert!(!p.is_whole());
        p.free(&[2, 3, 1]).unwrap();
        assert!(p.is_whole());
    }

    #[test]
    fn prefix_hits_take_free_blocks_back_and_share_references() {
        let mut p = BlockPool::new(3);
        let a = p.allocate(1).unwrap();
        p.cache(a[0], 7).unwrap();
        p.touch(&a).unwrap();
        assert_eq!(p.refs(a[0]), 2);
        p.free(&a).unwrap();
        p.free(&a).unwrap();
        assert_eq!(p.num_free(), 3);
        p.touch(&p.lookup(&[7])).unwrap();
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.allocate(3), Err(PoolError::OutOfBlocks { wanted: 3, free: 2 }));
        p.free(&a).unwrap();
        assert_eq!(p.free(&a), Err(PoolError::AlreadyFree(a[0])));
        assert!(p.is_whole());
    }

    #[test]
    fn a_block_in_flight_is_never_freed_and_errors_change_nothing() {
        let mut p = BlockPool::new(2);
        let a = p.allocate(2).unwrap();
        p.begin_transfer(&a[1..]).unwrap();
        assert_eq!(p.free(&a), Err(PoolError::FreedWhileInFlight(1)));
        assert_eq!(p.refs(0), 1, "the failed free dropped nothing");
        assert_eq!(p.num_in_flight(), 1);
        assert!(!p.is_whole());
        p.end_transfer(&a[1..]).unwrap();
        assert_eq!(p.end_transfer(&a[1..]), Err(PoolError::NotInFlight(1)));
        p.free(&a).unwrap();
        assert!(p.is_whole());
        assert_eq!(p.begin_transfer(&[0]), Err(PoolError::AlreadyFree(0)));
        assert_eq!(p.free(&[9]), Err(PoolError::NoSuchBlock(9)));
    }
}
