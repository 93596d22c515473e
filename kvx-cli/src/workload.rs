//! The model and the requests a run uses, from the command line.

use clap::{Args, ValueEnum};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::str::FromStr;

use kvx_core::{RequestId, TransferMode};
use kvx_testkit::sim::{HeadLayout, ModelSpec, VOCAB};

/// How each block of a layer's K or V orders its tokens and heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Layout {
    /// Token-major, `[2, blocks, block_size, heads, head_dim]`: a rank's heads are not contiguous
    /// in a block, so engines of different TP sizes move it only where each decode rank holds
    /// exactly the heads of one prefill rank (replicated heads).
    Nhd,
    /// Head-major, `[2, blocks, heads, block_size, head_dim]`: engines of different TP sizes READ
    /// their slice of the heads.
    Hnd,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Nhd => "NHD",
            Layout::Hnd => "HND",
        }
    }
}

/// The simulated model and each engine's KV pool.
#[derive(Debug, Clone, Args)]
pub(crate) struct ModelArgs {
    /// Layers.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV heads of the model: split over the tensor-parallel ranks, or, on more ranks than heads,
    /// one per rank (each head on TP / heads ranks).
    #[arg(long, default_value_t = 8)]
    kv_heads: u32,
    /// Elements per head (2 bytes each).
    #[arg(long, default_value_t = 64)]
    head_dim: u32,
    /// The KV cache's layout.
    #[arg(long, value_enum, default_value_t = Layout::Hnd)]
    layout: Layout,
    /// A hybrid model as vLLM's hybrid allocator runs it: every other layer (the 2nd, 4th, ...)
    /// attends to the last W tokens only (a sliding window). The layers form two KV-cache groups,
    /// a sliding-window one and a full-attention one, overlaid in the same caches and sharing one
    /// block pool; a load moves only the blocks the window needs of the sliding group.
    #[arg(long, value_name = "W", value_parser = clap::value_parser!(u32).range(1..))]
    window: Option<u32>,
    /// A hybrid model as vLLM runs it with its hybrid allocator off: one KV-cache group, every
    /// other layer keeping only its last W blocks (chunked local attention), and a load moves
    /// only those of it.
    #[arg(long, value_name = "W", conflicts_with = "window", value_parser = clap::value_parser!(u32).range(1..))]
    layer_window: Option<u32>,
    /// Tensor-parallel ranks of each engine.
    #[arg(long, default_value_t = 2)]
    pub(crate) tp: u32,
    /// KV blocks in each engine's pool.
    #[arg(long, default_value_t = 1024)]
    pub(crate) blocks: u32,
}

impl ModelArgs {
    pub(crate) fn model(&self) -> ModelSpec {
        let layout = match self.layout {
            Layout::Nhd => HeadLayout::Nhd,
            Layout::Hnd => HeadLayout::Hnd,
        };
        match self.window {
            // Each cache holds one layer of each group (vLLM pads the smaller group).
            Some(w) => {
                ModelSpec::standard(self.layers.div_ceil(2), self.kv_heads, self.head_dim, self.block_size)
                    .with_groups(vec![Some(w), None])
            }
            None => {
                let windows = (0..self.layers).map(|l| self.layer_window.filter(|_| l % 2 == 1)).collect();
                ModelSpec::standard(self.layers, self.kv_heads, self.head_dim, self.block_size)
                    .with_windows(windows)
            }
        }
        .with_layout(layout)
    }

    /// The model in words, with `tp` for the tensor-parallel sizes (`TP=2`, say).
    pub(crate) fn describe_with(&self, tp: &str) -> String {
        let window = match (self.window, self.layer_window) {
            (Some(w), _) => format!(
                ", every other layer a {w}-token sliding window (KV-cache groups: sliding, full; {} \
                 layers each)",
                self.layers.div_ceil(2)
            ),
            (None, Some(w)) => format!(", every other layer a {w}-block window"),
            (None, None) => String::new(),
        };
        format!(
            "{tp}, {} layers, {} KV heads x {} ({}){window}, {}-token blocks, {} blocks per pool",
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.layout.name(),
            self.block_size,
            self.blocks
        )
    }

    pub(crate) fn describe(&self) -> String {
        self.describe_with(&format!("TP={}", self.tp))
    }
}

/// An inclusive range of prompt lengths, written `MIN..MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LenRange {
    min: usize,
    max: usize,
}

impl FromStr for LenRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s.split_once("..").ok_or_else(|| format!("{s:?} is not MIN..MAX"))?;
        let parse = |x: &str| x.trim().parse::<usize>().map_err(|e| format!("{x:?}: {e}"));
        let (min, max) = (parse(a)?, parse(b)?);
        if min == 0 || min > max {
            return Err(format!("{s:?}: need 1 <= MIN <= MAX"));
        }
        Ok(LenRange { min, max })
    }
}

/// How the KV moves between the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub(crate) enum Mode {
    /// The prefill engine holds its blocks; the decode engine READs them once the router hands
    /// it the prefill engine's params.
    #[default]
    Pull,
    /// The router sends both legs at once; the decode engine registers the blocks it allocated
    /// and the prefill engine WRITEs into them when it finishes.
    Push,
}

impl Mode {
    pub(crate) fn transfer_mode(self) -> TransferMode {
        match self {
            Mode::Pull => TransferMode::Pull,
            Mode::Push => TransferMode::Push,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Pull => "pull",
            Mode::Push => "push",
        }
    }
}

/// The requests of a run.
#[derive(Debug, Clone, Args)]
pub(crate) struct WorkloadArgs {
    /// Requests to run.
    #[arg(long, default_value_t = 200)]
    pub(crate) requests: usize,
    /// Prompt lengths in tokens, MIN..MAX (inclusive, uniform).
    #[arg(long, default_value = "16..512")]
    prompt_len: LenRange,
    /// Tokens each request generates on the decode engine.
    #[arg(long, default_value_t = 4)]
    pub(crate) max_new_tokens: usize,
    /// Seed of the prompts.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub(crate) timeout: u64,
}

impl WorkloadArgs {
    /// The requests: ids and prompts, the same for the same seed.
    pub(crate) fn prompts(&self) -> Vec<(RequestId, Vec<u32>)> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        (0..self.requests)
            .map(|i| {
                let len = rng.gen_range(self.prompt_len.min..=self.prompt_len.max);
                (RequestId::new(format!("req-{i}")), (0..len).map(|_| rng.gen_range(0..VOCAB)).collect())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_length_ranges_parse_and_reject_nonsense() {
        assert_eq!("3..9".parse(), Ok(LenRange { min: 3, max: 9 }));
        assert_eq!(" 5 .. 5".parse(), Ok(LenRange { min: 5, max: 5 }));
        for bad in ["", "5", "0..4", "9..3", "a..b"] {
            assert!(bad.parse::<LenRange>().is_err(), "{bad}");
        }
    }
}
