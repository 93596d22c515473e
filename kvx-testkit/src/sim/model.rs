//! The simulated model: the shape of its KV cache and the deterministic bytes it computes.
//!
//! The KV of a token is a pure function of the tokens up to it, the layer, K or V, and the
//! attention head, so an engine that received blocks can recompute what the sender must have
//! written and check every byte.

use kvx_core::{AttentionKind, Error, Result};

use super::pool::BlockHash;

/// The shape of one layer's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvShape {
    /// K and V with `kv_heads` heads of `head_dim` elements, split over the tensor-parallel ranks
    /// (or, on more ranks than heads, one head per rank, each held by `tp / kv_heads` ranks).
    Standard {
        /// KV heads of the whole model.
        kv_heads: u32,
        /// Elements per head.
        head_dim: u32,
    },
    /// One latent vector per token (multi-head latent attention), the same on every rank.
    Mla {
        /// Elements of the latent vector.
        latent_dim: u32,
    },
}

/// How a standard-attention cache orders the tokens and heads of a block (MLA has one head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeadLayout {
    /// `[2, num_blocks, block_size, kv_heads, head_dim]`: token-major
    /// ([`AttentionKind::Standard`]), so a slice of the heads is not contiguous within a block.
    #[default]
    Nhd,
    /// `[2, num_blocks, kv_heads, block_size, head_dim]`: head-major
    /// ([`AttentionKind::StandardHnd`]), so each head's part of a block is contiguous and a rank
    /// of another tensor-parallel size can READ a slice of the heads.
    Hnd,
}

/// The model as the KV cache sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// The per-layer KV shape.
    pub shape: KvShape,
    /// The order of tokens and heads in a block of standard attention.
    pub layout: HeadLayout,
    /// One entry per layer: `Some(w)` for chunked local attention over the last `w` blocks (a
    /// model with one KV-cache group, as vLLM runs a hybrid model with its hybrid allocator off).
    pub windows: Vec<Option<u32>>,
    /// The KV-cache groups of vLLM's hybrid allocator, one entry per group: `Some(w)` for a
    /// sliding window of `w` tokens, `None` for full attention (`[None]`: one full-attention
    /// group). Each layer's cache (a slot) holds that layer of every group overlaid: the groups
    /// share one block pool, and block `b` of a slot holds the layer of whichever group owns `b`.
    pub groups: Vec<Option<u32>>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Bytes per element.
    pub elem_size: u32,
}

impl ModelSpec {
    /// Standard attention (token-major, [`HeadLayout::Nhd`]) on `layers` global-attention layers,
    /// 2-byte elements.
    pub fn standard(layers: usize, kv_heads: u32, head_dim: u32, block_size: u32) -> Self {
        ModelSpec {
            shape: KvShape::Standard { kv_heads, head_dim },
            layout: HeadLayout::Nhd,
            windows: vec![None; layers],
            groups: vec![None],
            block_size,
            elem_size: 2,
        }
    }

    /// MLA on `layers` global-attention layers, 2-byte elements.
    pub fn mla(layers: usize, latent_dim: u32, block_size: u32) -> Self {
        ModelSpec {
            shape: KvShape::Mla { latent_dim },
            layout: HeadLayout::Nhd,
            windows: vec![None; layers],
            groups: vec![None],
            block_size,
            elem_size: 2,
        }
    }

    /// The same model with per-layer windows (`windows.len()` layers).
    pub fn with_windows(mut self, windows: Vec<Option<u32>>) -> Self {
        self.windows = windows;
        self
    }

    /// The same model with the KV-cache groups `groups` (see [`groups`](Self::groups)): each of
    /// its layers holds one layer of every group.
    pub fn with_groups(mut self, groups: Vec<Option<u32>>) -> Self {
        self.groups = groups;
        self
    }

    /// The first block position group `group` keeps once `tokens` tokens are computed: 0 for
    /// full attention; for a sliding window of `w` tokens the block of token `tokens + 1 - w`, the
    /// first the next token attends to (vLLM's `get_num_skipped_tokens`).
    pub fn window_start(&self, group: usize, tokens: usize) -> usize {
        match self.groups.get(group).copied().flatten() {
            None => 0,
            Some(w) => (tokens + 1).saturating_sub(w as usize) / self.block_size as usize,
        }
    }

    /// The same model with its standard-attention blocks in `layout` (MLA ignores it).
    pub fn with_layout(mut self, layout: HeadLayout) -> Self {
        self.layout = layout;
        self
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.windows.len()
    }

    /// KV heads of the whole model (1 for MLA's latent).
    pub fn kv_heads(&self) -> u32 {
        match self.shape {
            KvShape::Standard { kv_heads, .. } => kv_heads,
            KvShape::Mla { .. } => 1,
        }
    }

    /// The cache's attention kind: standard in either head layout, or MLA.
    pub fn kind(&self) -> AttentionKind {
        match (self.shape, self.layout) {
            (KvShape::Standard { .. }, HeadLayout::Nhd) => AttentionKind::Standard,
            (KvShape::Standard { .. }, HeadLayout::Hnd) => AttentionKind::StandardHnd,
            (KvShape::Mla { .. }, _) => AttentionKind::Mla,
        }
    }

    /// Checks that the model can run on `tp` ranks: the KV heads split evenly over the ranks, or
    /// the ranks evenly over the heads (replicated heads); a head-major block must not look
    /// token-major (a rank's heads equal to the block size).
    pub fn check(&self, tp: u32) -> Result<()> {
        let bad = |msg: String| Err(Error::invalid_argument(msg));
        if tp == 0 || self.block_size == 0 || self.elem_size == 0 || self.windows.is_empty() {
            return bad(format!("invalid model {self:?} on {tp} ranks"));
        }
        if self.windows.contains(&Some(0)) {
            return bad("a layer has a zero block window".to_owned());
        }
        if self.groups.is_empty() || self.groups.contains(&Some(0)) {
            return bad(format!("KV-cache groups {:?}: none, or a zero-token window", self.groups));
        }
        if self.groups != [None] && self.windows.iter().any(Option::is_some) {
            return bad("layers with their own windows take one full-attention KV-cache group".to_owned());
        }
        match self.shape {
            KvShape::Standard { kv_heads, head_dim }
                if kv_heads == 0 || head_dim == 0 || (kv_heads % tp != 0 && tp % kv_heads != 0) =>
            {
                bad(format!("{kv_heads} KV heads of {head_dim} elements do not split over {tp} ranks"))
            }
            KvShape::Standard { .. }
                if self.layout == HeadLayout::Hnd && self.rank_heads(tp).0 == self.block_size =>
            {
                bad(format!(
                    "{} heads per rank equal the block size: a head-major cache would be taken for a \
                     token-major one",
                    self.block_size
                ))
            }
            KvShape::Mla { latent_dim: 0 } => bad("zero latent dimension".to_owned()),
            _ => Ok(()),
        }
    }

    /// Heads one rank holds and elements per head.
    fn rank_heads(&self, tp: u32) -> (u32, u32) {
        match self.shape {
            KvShape::Standard { kv_heads, head_dim } => ((kv_heads / tp).max(1), head_dim),
            KvShape::Mla { latent_dim } => (1, latent_dim),
        }
    }

    /// The model's head that local head `h` of `rank` of `tp` holds: `rank * H / tp + h` when the
    /// `H` heads split over the ranks, `rank * H / tp` when they are replicated (more ranks than
    /// heads; vLLM's rule); MLA's latent is head 0 on every rank.
    pub fn global_head(&self, rank: u32, tp: u32, h: u32) -> u32 {
        match self.shape {
            KvShape::Standard { kv_heads, .. } => {
                let first = (u64::from(rank) * u64::from(kv_heads) / u64::from(tp.max(1))) as u32;
                if kv_heads >= tp { first + h } else { first }
            }
            KvShape::Mla { .. } => 0,
        }
    }

    /// Bytes of one token in one region on one rank.
    pub fn row_len(&self, tp: u32) -> usize {
        let (heads, dim) = self.rank_heads(tp);
        heads as usize * dim as usize * self.elem_size as usize
    }

    /// Bytes of one block in one region on one rank.
    pub fn block_len(&self, tp: u32) -> usize {
        self.row_len(tp) * self.block_size as usize
    }

    /// The tensor shape of one layer's cache of `num_blocks` blocks on one rank.
    pub fn layer_shape(&self, num_blocks: u32, tp: u32) -> Vec<u64> {
        let (n, bs) = (u64::from(num_blocks), u64::from(self.block_size));
        let (heads, dim) = self.rank_heads(tp);
        let (heads, dim) = (u64::from(heads), u64::from(dim));
        match (self.shape, self.layout) {
            (KvShape::Standard { .. }, HeadLayout::Nhd) => vec![2, n, bs, heads, dim],
            (KvShape::Standard { .. }, HeadLayout::Hnd) => vec![2, n, heads, bs, dim],
            (KvShape::Mla { .. }, _) => vec![n, bs, dim],
        }
    }

    /// A tag of everything that is not in the layout but that peers must agree on.
    pub fn compat_tag(&self) -> String {
        format!("kvx-sim/{:?}/elem{}/groups{:?}", self.shape, self.elem_size, self.groups)
    }

    /// The bytes that `rank` of `tp` holds in one block of `region` of `layer` of KV-cache group
    /// `group` for the tokens whose prefix hashes are `prefixes`, from slot `first_slot` of the
    /// block on: hands each contiguous piece to `put` with its offset in the block (one piece
    /// token-major, one per local head head-major).
    pub fn fill_block(
        &self,
        prefixes: &[u64],
        first_slot: usize,
        (layer, group): (usize, usize),
        region: u32,
        (rank, tp): (u32, u32),
        mut put: impl FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let (heads, dim) = self.rank_heads(tp);
        let head_bytes = dim as usize * self.elem_size as usize;
        let seed = |prefix: u64, h: u32| {
            let head = u64::from(self.global_head(rank, tp, h));
            mix(mix(mix(mix(prefix, layer as u64), group as u64), u64::from(region)), head)
        };
        let mut piece = Vec::with_capacity(prefixes.len() * heads as usize * head_bytes);
        match (self.shape, self.layout) {
            (KvShape::Standard { .. }, HeadLayout::Hnd) => {
                let head_span = self.block_size as usize * head_bytes;
                for h in 0..heads {
                    piece.clear();
                    for &prefix in prefixes {
                        fill(seed(prefix, h), head_bytes, &mut piece);
                    }
                    put(h as usize * head_span + first_slot * head_bytes, &piece)?;
                }
                Ok(())
            }
            _ => {
                for &prefix in prefixes {
                    for h in 0..heads {
                        fill(seed(prefix, h), head_bytes, &mut piece);
                    }
                }
                put(first_slot * self.row_len(tp), &piece)
            }
        }
    }
}

/// The vocabulary of the simulated model.
pub const VOCAB: u32 = 32_000;

/// A 64-bit mixer (splitmix64's finaliser over `a` combined with `b`).
pub(crate) fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn fill(seed: u64, len: usize, out: &mut Vec<u8>) {
    let mut state = seed;
    let mut left = len;
    while left > 0 {
        state = mix(state, 1);
        let n = left.min(8);
        out.extend_from_slice(&state.to_le_bytes()[..n]);
        left -= n;
    }
}

/// The prefix hash of a token given the prefix hash of the tokens before it (`None` at the start).
pub(crate) fn prefix_hash(before: Option<u64>, token: u32) -> u64 {
    mix(before.unwrap_or(0x6b76_782d_7369_6d00), u64::from(token))
}

/// The token the model samples after a prefix.
pub(crate) fn next_token(prefix: u64) -> u32 {
    (mix(prefix, 0x5a3e) % u64::from(VOCAB)) as u32
}

/// The hash under which KV-cache group `group` caches the block whose chained hash is `hash`
/// (each group caches its own blocks, as vLLM's hybrid allocator does).
pub(crate) fn group_hash(hash: BlockHash, group: usize) -> BlockHash {
    mix(hash, 0x6772_6f75_7000 ^ group as u64)
}

/// The chained hash of a full block: its tokens and the hash of the block before it.
pub(crate) fn block_hash(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    tokens
        .iter()
        .fold(mix(parent.unwrap_or(0x626c_6f63_6b00), tokens.len() as u64), |h, &t| mix(h, u64::from(t)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One full block of `region` of layer 0 that `rank` of `tp` holds, for prefixes `1..=bs`.
    fn block(m: &ModelSpec, region: u32, rank: u32, tp: u32) -> Vec<u8> {
        let prefixes: Vec<u64> = (1..=u64::from(m.block_size)).collect();
        let mut out = vec![0u8; m.block_len(tp)];
        m.fill_block(&prefixes, 0, (0, 0), region, (rank, tp), |at, bytes| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn rows_depend_on_prefix_layer_region_and_rank_head_slice() {
        let m = ModelSpec::standard(2, 4, 8, 16);
        let row_of = |p, (l, g), r, rank, tp| {
            let mut v = Vec::new();
            m.fill_block(&[p], 0, (l, g), r, (rank, tp), |_, bytes| {
                v.extend_from_slice(bytes);
                Ok(())
            })
            .unwrap();
            v
        };
        let row = |p, l, r, rank, tp| row_of(p, (l, 0), r, rank, tp);
        assert_ne!(row(1, 0, 0, 0, 1), row_of(1, (0, 1), 0, 0, 1), "another KV-cache group's layer");
        assert_eq!(row(1, 0, 0, 0, 1).len(), 4 * 8 * 2);
        assert_eq!(row(1, 0, 0, 0, 2).len(), 2 * 8 * 2);
        assert_eq!(row(1, 0, 0, 0, 1), row(1, 0, 0, 0, 1));
        assert_ne!(row(1, 0, 0, 0, 1), row(2, 0, 0, 0, 1));
        assert_ne!(row(1, 0, 0, 0, 1), row(1, 1, 0, 0, 1));
        assert_ne!(row(1, 0, 0, 0, 1), row(1, 0, 1, 0, 1));
        // With TP=2, rank 1 holds heads 2 and 3 of the TP=1 row.
        assert_eq!(row(1, 0, 0, 1, 2), row(1, 0, 0, 0, 1)[32..]);
        let mla = ModelSpec::mla(1, 64, 16);
        assert_eq!(block(&mla, 0, 0, 2), block(&mla, 0, 1, 2), "MLA's latent is replicated on every rank");
        assert_eq!(block(&mla, 0, 0, 2), block(&mla, 0, 0, 1), "and the same at every TP size");
    }

    #[test]
    fn a_head_major_block_keeps_each_head_contiguous() {
        let (nhd, bs) = (ModelSpec::standard(1, 4, 8, 16), 16);
        let hnd = nhd.clone().with_layout(HeadLayout::Hnd);
        assert_eq!(nhd.layer_shape(10, 2), [2, 10, 16, 2, 8]);
        assert_eq!(hnd.layer_shape(10, 2), [2, 10, 2, 16, 8]);
        assert_eq!(hnd.kind(), AttentionKind::StandardHnd);
        let head = 8 * 2;
        let (n, h) = (block(&nhd, 1, 0, 1), block(&hnd, 1, 0, 1));
        for t in 0..bs {
            for k in 0..4 {
                let at_n = (t * 4 + k) * head;
                let at_h = (k * bs + t) * head;
                assert_eq!(n[at_n..at_n + head], h[at_h..at_h + head], "token {t} head {k}");
            }
        }
        // Rank 1 of 2 holds heads 2 and 3: the second half of the TP=1 block, head-major.
        assert_eq!(block(&hnd, 0, 1, 2), block(&hnd, 0, 0, 1)[2 * bs * head..]);
        // Written in two parts from a slot on, the same block.
        let prefixes: Vec<u64> = (1..=16).collect();
        let mut parts = vec![0u8; hnd.block_len(2)];
        for (from, to) in [(0, 5), (5, 16)] {
            hnd.fill_block(&prefixes[from..to], from, (0, 0), 0, (1, 2), |at, bytes| {
                parts[at..at + bytes.len()].copy_from_slice(bytes);
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(parts, block(&hnd, 0, 1, 2));
    }

    #[test]
    fn replicated_heads_follow_vllm_and_split_heads_the_rank_slices() {
        let m = ModelSpec::standard(1, 2, 8, 16).with_layout(HeadLayout::Hnd);
        // 2 heads on 4 ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1.
        assert_eq!((0..4).map(|r| m.global_head(r, 4, 0)).collect::<Vec<_>>(), [0, 0, 1, 1]);
        assert_eq!(block(&m, 0, 0, 4), block(&m, 0, 1, 4));
        assert_eq!(block(&m, 0, 2, 4), block(&m, 0, 1, 2), "rank 2 of 4 holds what rank 1 of 2 holds");
        assert_eq!(m.layer_shape(3, 4), [2, 3, 1, 16, 8]);
        let split = ModelSpec::standard(1, 8, 8, 16);
        assert_eq!((0..4).map(|r| split.global_head(r, 4, 1)).collect::<Vec<_>>(), [1, 3, 5, 7]);
        assert_eq!(ModelSpec::mla(1, 8, 16).global_head(3, 4, 0), 0);
    }

    #[test]
    fn checks_reject_models_that_do_not_split() {
        assert!(ModelSpec::standard(1, 4, 8, 16).check(2).is_ok());
        assert!(ModelSpec::standard(1, 2, 8, 16).check(4).is_ok(), "replicated heads");
        assert!(ModelSpec::standard(1, 3, 8, 16).check(2).is_err());
        assert!(ModelSpec::standard(1, 2, 8, 16).check(3).is_err());
        assert!(ModelSpec::mla(1, 0, 16).check(1).is_err());
        assert!(ModelSpec::standard(1, 4, 8, 16).with_windows(vec![Some(0)]).check(1).is_err());
        let hybrid = ModelSpec::standard(2, 4, 8, 16).with_groups(vec![Some(32), None]);
        assert!(hybrid.check(2).is_ok());
        assert!(hybrid.clone().with_groups(vec![Some(0), None]).check(1).is_err());
        assert!(hybrid.clone().with_groups(Vec::new()).check(1).is_err());
        assert!(hybrid.with_windows(vec![None, Some(1)]).check(1).is_err(), "layer windows and groups");
        let ambiguous = ModelSpec::standard(1, 8, 8, 4).with_layout(HeadLayout::Hnd);
        assert!(ambiguous.check(2).is_err(), "4 heads per rank in 4-token blocks");
        assert!(ambiguous.check(1).is_ok());
    }

    #[test]
    fn a_sliding_window_keeps_the_blocks_the_next_token_attends_to() {
        // vLLM's tiny hybrid: 128-token blocks, a 256-token window.
        let m = ModelSpec::standard(2, 2, 64, 128).with_groups(vec![Some(256), None]);
        let starts: Vec<usize> =
            [0, 255, 256, 257, 383, 384, 600, 639, 640, 641, 767].map(|n| m.window_start(0, n)).into();
        assert_eq!(
            starts,
            [0, 0, 0, 0, 1, 1, 2, 3, 3, 3, 4],
            "vLLM 0.32 nulls 2, 3, 3 and 0 blocks at 600, 640, 641 and 257 tokens"
        );
        assert_eq!(m.window_start(1, 10_000), 0, "full attention keeps every block");
    }

    #[test]
    fn hashes_chain() {
        let a = block_hash(None, &[1, 2]);
        assert_ne!(block_hash(Some(a), &[3, 4]), block_hash(None, &[3, 4]));
        assert_ne!(prefix_hash(Some(1), 2), prefix_hash(Some(2), 2));
        assert!(next_token(7) < VOCAB);
    }
}
