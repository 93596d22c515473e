//! The KV-cache layout, detected from the caches an engine registers.

use serde::{Deserialize, Serialize};
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::ids::BlockId;
use crate::memory::{KvMemory, MemKind, MemRegion};
use crate::transfer::{BlockList, RegionBlocks};
use crate::wire::WIRE_VERSION;

/// How one layer's cache is shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AttentionKind {
    /// `[2, num_blocks, block_size, kv_heads, head_dim]`: K and V as two regions per layer, the
    /// heads of each token side by side ("NHD"). A block cannot be split by head: engines whose
    /// ranks hold different heads cannot exchange it.
    Standard,
    /// `[2, num_blocks, kv_heads, block_size, head_dim]`: K and V as two regions per layer, each
    /// head's tokens together ("HND"), so one head of one block is contiguous.
    StandardHnd,
    /// `[num_blocks, block_size, latent_dim]`: one region per layer.
    Mla,
    /// `[num_blocks, kv_heads, block_size, 2 * head_dim]`: K and V packed into each block (per
    /// head, the block's K rows then its V rows), so one block of one layer is one contiguous
    /// page and each layer is one region. vLLM's CPU attention backend (layout "LBHNC").
    Packed,
}

impl AttentionKind {
    /// Regions per layer.
    pub fn regions_per_layer(self) -> u32 {
        match self {
            AttentionKind::Standard | AttentionKind::StandardHnd => 2,
            AttentionKind::Mla | AttentionKind::Packed => 1,
        }
    }

    /// Whether one head of one block is contiguous, so that a READ can take some heads of a
    /// block (every kind but NHD; MLA's one latent is one "head").
    pub fn head_sliceable(self) -> bool {
        self != AttentionKind::Standard
    }
}

/// One layer's cache as the engine allocated it: its memory (contiguous, row-major) and shape.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// The layer's memory; it stays registered (and alive) as long as the worker lives.
    pub memory: Arc<dyn KvMemory>,
    /// The tensor shape: 5 dimensions (standard attention), 4 (packed K and V) or 3 (MLA).
    pub shape: Vec<u64>,
    /// Bytes per element.
    pub elem_size: u64,
    /// For chunked local attention: the number of most recent blocks this layer attends to.
    pub window: Option<u32>,
}

/// The layout of one engine rank's KV cache. Two ranks can exchange blocks when their
/// [`compat_hash`](KvCacheLayout::compat_hash)es are equal (the pool sizes may differ).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheLayout {
    /// Standard or MLA.
    pub kind: AttentionKind,
    /// Number of layers.
    pub num_layers: u32,
    /// Blocks in each region.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Bytes of one block of one region.
    pub block_len: u64,
    /// KV heads in one block of this rank (MLA: 1, the latent).
    pub heads: u32,
    /// Per layer, the block window for chunked local attention (`None`: global attention).
    pub windows: Vec<Option<u32>>,
    /// Memory kind of the cache.
    pub mem_kind: MemKind,
    /// Device of the cache.
    pub device: u32,
}

impl KvCacheLayout {
    /// Detects the layout from the caches of all layers and returns it with the base address of
    /// every region, ordered `[K0, V0, K1, V1, ..]` (standard) or `[L0, L1, ..]` (MLA, packed).
    pub fn detect(caches: &[LayerCache], block_size: u32) -> Result<(KvCacheLayout, Vec<u64>)> {
        let first = caches.first().ok_or_else(|| Error::invalid_argument("no KV caches to register"))?;
        // The kind, the block count, the dimensions of one block, and which of them is the
        // block's token dimension.
        // A 5-dimensional cache is head-major (HND) when its third dimension is the block's tokens
        // and its second is not; otherwise token-major (NHD). When both equal the block size NHD
        // is assumed: taken for NHD, an HND cache is only refused where heads must be sliced, and
        // whole blocks copy the same either way.
        let bs = u64::from(block_size);
        let (kind, num_blocks, block_dims, token_dim) = match first.shape.as_slice() {
            [2, n, rest @ ..] if rest.len() == 3 && rest[1] == bs && rest[0] != bs => {
                (AttentionKind::StandardHnd, *n, rest, 1)
            }
            [2, n, rest @ ..] if rest.len() == 3 => (AttentionKind::Standard, *n, rest, 0),
            [n, rest @ ..] if rest.len() == 3 => (AttentionKind::Packed, *n, rest, 1),
            [n, rest @ ..] if rest.len() == 2 => (AttentionKind::Mla, *n, rest, 0),
            other => {
                return Err(Error::invalid_argument(format!(
                    "unsupported KV cache shape {other:?}: expected [2, blocks, block_size, heads, head_dim], \
                     [blocks, heads, block_size, 2 * head_dim] or [blocks, block_size, latent]"
                )));
            }
        };
        if block_dims[token_dim] != u64::from(block_size) {
            return Err(Error::invalid_argument(format!(
                "cache block dimension {} differs from block_size {block_size}",
                block_dims[token_dim]
            )));
        }
        let num_blocks = u32::try_from(num_blocks)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| Error::invalid_argument(format!("unsupported number of blocks {num_blocks}")))?;
        let heads = match kind {
            AttentionKind::Standard => block_dims[1],
            AttentionKind::StandardHnd | AttentionKind::Packed => block_dims[0],
            AttentionKind::Mla => 1,
        };
        let heads = u32::try_from(heads)
            .ok()
            .filter(|&h| h > 0)
            .ok_or_else(|| Error::invalid_argument(format!("unsupported number of KV heads {heads}")))?;
        let block_len = block_dims
            .iter()
            .try_fold(first.elem_size, |acc, &d| acc.checked_mul(d))
            .filter(|&l| l > 0)
            .ok_or_else(|| Error::invalid_argument("block length is zero or overflows"))?;
        let region_len = block_len
            .checked_mul(u64::from(num_blocks))
            .ok_or_else(|| Error::invalid_argument("region length overflows"))?;
        let first_region = first.memory.region();
        let mut bases = Vec::with_capacity(caches.len() * kind.regions_per_layer() as usize);
        for (i, cache) in caches.iter().enumerate() {
            if cache.shape != first.shape || cache.elem_size != first.elem_size {
                return Err(Error::invalid_argument(format!(
                    "layer {i} has shape {:?} x {} bytes, layer 0 has {:?} x {}",
                    cache.shape, cache.elem_size, first.shape, first.elem_size
                )));
            }
            let mem = cache.memory.region();
            if mem.kind != first_region.kind || mem.device != first_region.device {
                return Err(Error::invalid_argument(format!("layer {i} lives in other memory than layer 0")));
            }
            for r in 0..u64::from(kind.regions_per_layer()) {
                let base = mem.addr.saturating_add(r * region_len);
                if !mem.contains(&MemRegion { addr: base, len: region_len, ..mem }) {
                    return Err(Error::invalid_argument(format!(
                        "layer {i} memory of {} bytes is smaller than its shape",
                        mem.len
                    )));
                }
                bases.push(base);
            }
            if cache.window == Some(0) {
                return Err(Error::invalid_argument(format!("layer {i} has a zero block window")));
            }
        }
        let layout = KvCacheLayout {
            kind,
            num_layers: caches.len() as u32,
            num_blocks,
            block_size,
            block_len,
            heads,
            windows: caches.iter().map(|c| c.window).collect(),
            mem_kind: first_region.kind,
            device: first_region.device,
        };
        Ok((layout, bases))
    }

    /// Bytes of one head of one block of one region.
    pub fn head_len(&self) -> u64 {
        self.block_len / u64::from(self.heads)
    }

    /// Number of regions (`num_layers * regions_per_layer`).
    pub fn num_regions(&self) -> u32 {
        self.num_layers * self.kind.regions_per_layer()
    }

    /// The descriptor list over `bases` (this layout's regions, in order).
    pub fn block_list(&self, bases: Vec<u64>) -> BlockList {
        BlockList {
            kind: self.mem_kind,
            device: self.device,
            bases,
            num_blocks: self.num_blocks,
            block_len: self.block_len,
        }
    }

    /// A hash of everything two peers must agree on to exchange blocks: kind, layers, block size,
    /// the length of one head of a block, windows, the wire version, and `tag` (the engine's
    /// model and dtype). Neither the pool size nor the heads per rank (the tensor-parallel size)
    /// are part of it. FNV-1a: stable across processes, builds and versions.
    pub fn compat_hash(&self, tag: &str) -> u64 {
        let mut h = Fnv1a::new();
        h.write(&WIRE_VERSION.to_le_bytes());
        // The kind's tag (standard and MLA keep their region counts, their tags before the others).
        h.write(&[match self.kind {
            AttentionKind::Standard => 2,
            AttentionKind::Mla => 1,
            AttentionKind::Packed => 3,
            AttentionKind::StandardHnd => 4,
        }]);
        h.write(&self.num_layers.to_le_bytes());
        h.write(&self.block_size.to_le_bytes());
        h.write(&self.head_len().to_le_bytes());
        for w in &self.windows {
            // Widened: a window of u32::MAX blocks (from a peer's payload, say) must not overflow.
            h.write(&w.map_or(0, |w| u64::from(w) + 1).to_le_bytes());
        }
        h.write(tag.as_bytes());
        h.finish()
    }

    /// The block window of each region, in region order (`None`: global attention), or `None`
    /// when no layer has a window: what [`RegionBlocks::Windows`] takes.
    pub fn region_windows(&self) -> Option<Vec<Option<u32>>> {
        if self.windows.iter().all(Option::is_none) {
            return None;
        }
        let per_layer = self.kind.regions_per_layer() as usize;
        let layers = (0..self.num_layers as usize).map(|l| self.windows.get(l).copied().flatten());
        Some(layers.flat_map(|w| std::iter::repeat_n(w, per_layer)).collect())
    }

    /// The regions a READ of this layout covers: every region takes every block, or, with
    /// windows (`region_windows`), windowed layers only their last `window` blocks.
    pub fn region_blocks<'a>(&self, region_windows: Option<&'a [Option<u32>]>) -> RegionBlocks<'a> {
        match region_windows {
            Some(windows) => RegionBlocks::Windows(windows),
            None => RegionBlocks::All(self.num_regions()),
        }
    }

    /// Checks that `ids` are valid blocks of a list with `num_blocks` blocks.
    pub fn check_block_ids(ids: &[BlockId], num_blocks: u32, whose: &str) -> Result<()> {
        match ids.iter().find(|&&b| b >= num_blocks) {
            Some(b) => Err(Error::new(
                ErrorKind::InvalidPeerData,
                format!("{whose} block id {b} out of range (num_blocks {num_blocks})"),
            )),
            None => Ok(()),
        }
    }
}

struct Fnv1a(u64);

impl Fnv1a {
    fn new() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostMemory;

    fn cache(shape: &[u64], elem: u64, window: Option<u32>) -> LayerCache {
        let len: u64 = shape.iter().product::<u64>() * elem;
        LayerCache {
            memory: Arc::new(HostMemory::new(len as usize).unwrap()),
            shape: shape.to_vec(),
            elem_size: elem,
            window,
        }
    }

    #[test]
    fn detects_standard_attention_with_k_and_v_regions() {
        let caches = vec![cache(&[2, 10, 16, 4, 8], 2, None), cache(&[2, 10, 16, 4, 8], 2, None)];
        let (l, bases) = KvCacheLayout::detect(&caches, 16).unwrap();
        assert_eq!(l.kind, AttentionKind::Standard);
        assert_eq!(l.num_blocks, 10);
        assert_eq!(l.block_len, 16 * 4 * 8 * 2);
        assert_eq!(l.num_regions(), 4);
        let k0 = caches[0].memory.region().addr;
        assert_eq!(bases[..2], [k0, k0 + 10 * l.block_len]);
        assert_eq!(bases[2], caches[1].memory.region().addr);
    }

    #[test]
    fn detects_mla_with_one_region_per_layer() {
        let caches = vec![cache(&[7, 16, 576], 2, None); 3];
        let (l, bases) = KvCacheLayout::detect(&caches, 16).unwrap();
        assert_eq!(l.kind, AttentionKind::Mla);
        assert_eq!(l.block_len, 16 * 576 * 2);
        assert_eq!(bases.len(), 3);
    }

    #[test]
    fn detects_packed_kv_with_one_contiguous_page_per_layer_block() {
        // vLLM CPU: [blocks, kv_heads, block_size, 2 * head_dim], layers back to back in one buffer.
        let caches = vec![cache(&[10, 2, 128, 128], 2, None); 4];
        let (l, bases) = KvCacheLayout::detect(&caches, 128).unwrap();
        assert_eq!(l.kind, AttentionKind::Packed);
        assert_eq!(l.num_blocks, 10);
        assert_eq!(l.block_len, 2 * 128 * 128 * 2, "K and V of every head in one page");
        assert_eq!(l.num_regions(), 4);
        assert_eq!(bases, caches.iter().map(|c| c.memory.region().addr).collect::<Vec<_>>());
        assert_eq!(l.region_windows(), None);
        assert_eq!(l.region_blocks(None), RegionBlocks::All(4));
        // The token dimension is the third one: a 4-D cache whose second dimension is the block
        // size is refused when the third is not.
        assert!(KvCacheLayout::detect(&[cache(&[10, 128, 2, 128], 2, None)], 128).is_err());
        // Not compatible with a standard layout of the same page size.
        let std = KvCacheLayout::detect(&vec![cache(&[2, 10, 128, 2, 64], 2, None); 2], 128).unwrap().0;
        let packed2 = KvCacheLayout::detect(&caches[..2], 128).unwrap().0;
        assert_ne!(std.compat_hash("m"), packed2.compat_hash("m"));
        // Nor with MLA of the same page size and layer count.
        let mla = KvCacheLayout::detect(&vec![cache(&[10, 128, 256], 2, None); 4], 128).unwrap().0;
        assert_eq!(mla.block_len, l.block_len);
        assert_ne!(mla.compat_hash("m"), l.compat_hash("m"));
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(KvCacheLayout::detect(&[], 16).is_err());
        assert!(KvCacheLayout::detect(&[cache(&[3, 16], 2, None)], 16).is_err());
        assert!(KvCacheLayout::detect(&[cache(&[2, 4, 8, 1, 1], 2, None)], 16).is_err());
        let mixed = vec![cache(&[2, 4, 16, 1, 1], 2, None), cache(&[2, 5, 16, 1, 1], 2, None)];
        assert!(KvCacheLayout::detect(&mixed, 16).is_err());
        let short = LayerCache { shape: vec![2, 8, 16, 1, 1], ..cache(&[2, 4, 16, 1, 1], 2, None) };
        assert!(KvCacheLayout::detect(&[short], 16).is_err());
        assert!(KvCacheLayout::detect(&[cache(&[4, 16, 1], 2, Some(0))], 16).is_err());
    }

    #[test]
    fn windowed_layers_give_every_region_its_window() {
        let caches = vec![cache(&[2, 10, 4, 1, 1], 1, None), cache(&[2, 10, 4, 1, 1], 1, Some(1))];
        let (l, _) = KvCacheLayout::detect(&caches, 4).unwrap();
        // Layer 0 (K0, V0) reads every block; layer 1 (K1, V1) only the last one.
        let windows = l.region_windows().unwrap();
        assert_eq!(windows, [None, None, Some(1), Some(1)]);
        let mut ids = (Vec::new(), Vec::new());
        let post = crate::BlockPost {
            local_blocks: &[3, 5],
            local_num_blocks: 10,
            remote_blocks: &[3, 5],
            remote_num_blocks: 10,
            regions: l.region_blocks(Some(&windows)),
        };
        post.descriptor_indices(&mut ids.0, &mut ids.1).unwrap();
        assert_eq!(ids.0, vec![3, 5, 13, 15, 25, 35]);
        let mla =
            KvCacheLayout::detect(&[cache(&[7, 4, 8], 1, Some(2)), cache(&[7, 4, 8], 1, None)], 4).unwrap().0;
        assert_eq!(mla.region_windows().unwrap(), [Some(2), None]);
    }

    #[test]
    fn compat_hash_ignores_pool_size_but_not_shape_or_tag() {
        let a = KvCacheLayout::detect(&[cache(&[2, 10, 4, 2, 2], 2, None)], 4).unwrap().0;
        let b = KvCacheLayout::detect(&[cache(&[2, 99, 4, 2, 2], 2, None)], 4).unwrap().0;
        let c = KvCacheLayout::detect(&[cache(&[2, 10, 4, 2, 4], 2, None)], 4).unwrap().0;
        assert_eq!(a.compat_hash("m"), b.compat_hash("m"));
        assert_ne!(a.compat_hash("m"), c.compat_hash("m"));
        assert_ne!(a.compat_hash("m"), a.compat_hash("other-model"));
        let widest = KvCacheLayout { windows: vec![Some(u32::MAX)], ..a.clone() };
        assert_ne!(widest.compat_hash("m"), a.compat_hash("m"), "no overflow, and not global attention");
    }
}
