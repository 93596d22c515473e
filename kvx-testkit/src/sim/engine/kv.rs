//! The simulated model's KV bytes (written by prefill, checked byte for byte by decode), its
//! block hashes and its seeds.

use std::ops::Range;

use kvx_core::{BlockId, Error, ErrorKind, GroupBlocks, Result};

use crate::sim::config::EngineConfig;
use crate::sim::model;
use crate::sim::pool::BlockHash;

use super::*;

#[derive(Debug, Default)]
pub(super) struct Verified {
    pub(super) blocks: u64,
    pub(super) bytes: u64,
    /// A description of each wrong block.
    pub(super) wrong: Vec<String>,
}

/// The block of `group` at position `i`, if it has one.
pub(super) fn block_at(group: &GroupBlocks, i: usize) -> Option<BlockId> {
    group.at(i as u64, i as u64 + 1).and_then(|ids| ids.first().copied())
}

/// The block positions of group `g` that `load` fills: all of the load's, but of a
/// sliding-window group only those from its first block on (it has none before its window).
pub(super) fn loaded_positions(r: &Request, load: Load, g: usize) -> Range<usize> {
    let first = r.groups.get(g).map_or(0, |group| group.first as usize);
    load.first.max(first)..load.first + load.count
}

/// Compares every block the load brought in, in every KV-cache group (of a sliding-window group
/// only those its window needs; of a layer with its own window only its last `window` loaded
/// blocks), with what the model computes.
pub(super) fn verify_load(ranks: &[Rank], config: &EngineConfig, r: &Request) -> Verified {
    let mut out = Verified::default();
    let Some(load) = r.load else { return out };
    let model = &config.model;
    let (bs, tp) = (model.block_size as usize, config.tp);
    let block_len = model.block_len(tp);
    let regions = model.kind().regions_per_layer();
    let region_len = config.num_blocks as usize * block_len;
    let mut expected = vec![0u8; block_len];
    let mut actual = vec![0u8; block_len];
    for (g, group) in r.groups.iter().enumerate() {
        let loaded = loaded_positions(r, load, g);
        for (rank, ranked) in ranks.iter().enumerate() {
            for (layer, buf) in ranked.layers.iter().enumerate() {
                let from = model.windows[layer]
                    .map_or(loaded.start, |w| loaded.start.max(loaded.end.saturating_sub(w as usize)));
                for i in from..loaded.end {
                    let Some(block) = block_at(group, i) else {
                        out.wrong.push(format!("group {g} has no block at loaded position {i}"));
                        continue;
                    };
                    for region in 0..regions {
                        let filled = model.fill_block(
                            &r.prefixes[i * bs..(i + 1) * bs],
                            0,
                            (layer, g),
                            region,
                            (rank as u32, tp),
                            |at, bytes| place(&mut expected, at, bytes),
                        );
                        let offset = region as usize * region_len + block as usize * block_len;
                        let read = buf.read(offset, &mut actual);
                        out.blocks += 1;
                        out.bytes += block_len as u64;
                        if filled.is_err() || read.is_err() || actual != expected {
                            out.wrong.push(format!(
                                "rank {rank} layer {layer} group {g} region {region} block {i} (id {block})"
                            ));
                        }
                    }
                }
            }
        }
    }
    out
}

/// Writes the KV of positions `from..to` of `r` into its blocks of every KV-cache group, on every
/// rank, layer and region; a sliding-window group's positions before its first block are not
/// kept (vLLM writes them to its null block, which nothing reads).
pub(super) fn write_kv(
    ranks: &[Rank],
    config: &EngineConfig,
    r: &Request,
    from: usize,
    to: usize,
) -> Result<()> {
    let model = &config.model;
    let (bs, tp) = (model.block_size as usize, config.tp);
    let block_len = model.block_len(tp);
    let region_len = config.num_blocks as usize * block_len;
    let mut pos = from;
    while pos < to {
        let (i, slot) = (pos / bs, pos % bs);
        let end = to.min((i + 1) * bs);
        for (g, group) in r.groups.iter().enumerate() {
            let block = match block_at(group, i) {
                Some(block) => block,
                None if i < group.first as usize => continue,
                None => return Err(Error::new(ErrorKind::State, "position beyond the request's blocks")),
            };
            for (rank, ranked) in ranks.iter().enumerate() {
                for (layer, buf) in ranked.layers.iter().enumerate() {
                    for region in 0..model.kind().regions_per_layer() {
                        let base = region as usize * region_len + block as usize * block_len;
                        model.fill_block(
                            &r.prefixes[pos..end],
                            slot,
                            (layer, g),
                            region,
                            (rank as u32, tp),
                            |at, bytes| buf.write(base + at, bytes),
                        )?;
                    }
                }
            }
        }
        pos = end;
    }
    Ok(())
}

/// Copies `bytes` into `block` at `at`.
fn place(block: &mut [u8], at: usize, bytes: &[u8]) -> Result<()> {
    block
        .get_mut(at..at + bytes.len())
        .ok_or_else(|| Error::new(ErrorKind::State, "a piece beyond its block"))?
        .copy_from_slice(bytes);
    Ok(())
}

/// The 32-byte nonce seed of a 64-bit one.
pub(super) fn seed_bytes(seed: u64) -> [u8; 32] {
    let mut bytes = [0u8; 32];
    for (i, chunk) in bytes.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&model::mix(seed, i as u64).to_le_bytes());
    }
    bytes
}

/// Chained hashes of the full blocks of `tokens`.
pub(super) fn full_block_hashes(tokens: &[u32], bs: usize) -> Vec<BlockHash> {
    let mut out: Vec<BlockHash> = Vec::with_capacity(tokens.len() / bs);
    for chunk in tokens.chunks_exact(bs) {
        out.push(model::block_hash(out.last().copied(), chunk));
    }
    out
}
