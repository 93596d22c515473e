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
    /// K and V with `kv_heads` heads of `head_dim` elements, split over the tensor-parallel ranks.
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

/// The model as the KV cache sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// The per-layer KV shape.
    pub shape: KvShape,
    /// One entry per layer: `Some(w)` for chunked local attention over the last `w` blocks.
    pub windows: Vec<Option<u32>>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Bytes per element.
    pub elem_size: u32,
}

impl ModelSpec {
    /// Standard attention on `layers` global-attention layers, 2-byte elements.
    pub fn standard(layers: usize, kv_heads: u32, head_dim: u32, block_size: u32) -> Self {
        ModelSpec {
            shape: KvShape::Standard { kv_heads, head_dim },
            windows: vec![None; layers],
            block_size,
            elem_size: 2,
        }
    }

    /// MLA on `layers` global-attention layers, 2-byte elements.
    pub fn mla(layers: usize, latent_dim: u32, block_size: u32) -> Self {
        ModelSpec {
            shape: KvShape::Mla { latent_dim },
            windows: vec![None; layers],
            block_size,
            elem_size: 2,
        }
    }

    /// The same model with per-layer windows (`windows.len()` layers).
    pub fn with_windows(mut self, windows: Vec<Option<u32>>) -> Self {
        self.windows = windows;
        self
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.windows.len()
    }

    /// Standard or MLA.
    pub fn kind(&self) -> AttentionKind {
        match self.shape {
            KvShape::Standard { .. } => AttentionKind::Standard,
            KvShape::Mla { .. } => AttentionKind::Mla,
        }
    }

    /// Checks that the model can run on `tp` ranks.
    pub fn check(&self, tp: u32) -> Result<()> {
        let bad = |msg: String| Err(Error::invalid_argument(msg));
        if tp == 0 || self.block_size == 0 || self.elem_size == 0 || self.windows.is_empty() {
            return bad(format!("invalid model {self:?} on {tp} ranks"));
        }
        if self.windows.contains(&Some(0)) {
            return bad("a layer has a zero block window".to_owned());
        }
        match self.shape {
            KvShape::Standard { kv_heads, head_dim }
                if kv_heads == 0 || head_dim == 0 || kv_heads % tp != 0 =>
            {
                bad(format!("{kv_heads} KV heads of {head_dim} elements do not split over {tp} ranks"))
            }
            KvShape::Mla { latent_dim: 0 } => bad("zero latent dimension".to_owned()),
            _ => Ok(()),
        }
    }

    /// Heads one rank holds and elements per head.
    fn rank_heads(&self, tp: u32) -> (u32, u32) {
        match self.shape {
            KvShape::Standard { kv_heads, head_dim } => (kv_heads / tp, head_dim),
            KvShape::Mla { latent_dim } => (1, latent_dim),
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
        match self.shape {
            KvShape::Standard { kv_heads, head_dim } => {
                vec![2, n, bs, u64::from(kv_heads / tp), u64::from(head_dim)]
            }
            KvShape::Mla { latent_dim } => vec![n, bs, u64::from(latent_dim)],
        }
    }

    /// A tag of everything that is not in the layout but that peers must agree on.
    pub fn compat_tag(&self) -> String {
        format!("kvx-sim/{:?}/elem{}", self.shape, self.elem_size)
    }

    /// Appends to `out` the rows (one per token) that `rank` of `tp` holds in `region` of
    /// `layer`, for the tokens whose prefix hashes are `prefixes`.
    pub fn rows(&self, prefixes: &[u64], layer: usize, region: u32, rank: u32, tp: u32, out: &mut Vec<u8>) {
        let (heads, dim) = self.rank_heads(tp);
        let head_bytes = dim as usize * self.elem_size as usize;
        for &prefix in prefixes {
            for h in 0..heads {
                let global_head = match self.shape {
                    KvShape::Standard { .. } => rank * heads + h,
                    KvShape::Mla { .. } => 0,
                };
                let seed = mix(mix(mix(prefix, layer as u64), u64::from(region)), u64::from(global_head));
                fill(seed, head_bytes, out);
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

/// The chained hash of a full block: its tokens and the hash of the block before it.
pub(crate) fn block_hash(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    tokens
        .iter()
        .fold(mix(parent.unwrap_or(0x626c_6f63_6b00), tokens.len() as u64), |h, &t| mix(h, u64::from(t)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_depend_on_prefix_layer_region_and_rank_head_slice() {
        let m = ModelSpec::standard(2, 4, 8, 16);
        let row = |p, l, r, rank, tp| {
            let mut v = Vec::new();
            m.rows(&[p], l, r, rank, tp, &mut v);
            v
        };
        assert_eq!(row(1, 0, 0, 0, 1).len(), 4 * 8 * 2);
        assert_eq!(row(1, 0, 0, 0, 2).len(), 2 * 8 * 2);
        assert_eq!(row(1, 0, 0, 0, 1), row(1, 0, 0, 0, 1));
        assert_ne!(row(1, 0, 0, 0, 1), row(2, 0, 0, 0, 1));
        assert_ne!(row(1, 0, 0, 0, 1), row(1, 1, 0, 0, 1));
        assert_ne!(row(1, 0, 0, 0, 1), row(1, 0, 1, 0, 1));
        // With TP=2, rank 1 holds heads 2 and 3 of the TP=1 row.
        assert_eq!(row(1, 0, 0, 1, 2), row(1, 0, 0, 0, 1)[32..]);
        let mla = ModelSpec::mla(1, 64, 16);
        let mut a = Vec::new();
        let mut b = Vec::new();
        mla.rows(&[5], 0, 0, 0, 2, &mut a);
        mla.rows(&[5], 0, 0, 1, 2, &mut b);
        assert_eq!(a, b, "MLA's latent is replicated on every rank");
    }

    #[test]
    fn checks_reject_models_that_do_not_split() {
        assert!(ModelSpec::standard(1, 4, 8, 16).check(2).is_ok());
        assert!(ModelSpec::standard(1, 3, 8, 16).check(2).is_err());
        assert!(ModelSpec::mla(1, 0, 16).check(1).is_err());
        assert!(ModelSpec::standard(1, 4, 8, 16).with_windows(vec![Some(0)]).check(1).is_err());
    }

    #[test]
    fn hashes_chain() {
        let a = block_hash(None, &[1, 2]);
        assert_ne!(block_hash(Some(a), &[3, 4]), block_hash(None, &[3, 4]));
        assert_ne!(prefix_hash(Some(1), 2), prefix_hash(Some(2), 2));
        assert!(next_token(7) < VOCAB);
    }
}
