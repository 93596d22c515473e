//! The model and the requests a run uses, from the command line.

use clap::Args;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::str::FromStr;

use kvx_core::RequestId;
use kvx_testkit::sim::{ModelSpec, VOCAB};

/// The simulated model and each engine's KV pool.
#[derive(Debug, Clone, Args)]
pub(crate) struct ModelArgs {
    /// Layers.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV heads (split over the tensor-parallel ranks).
    #[arg(long, default_value_t = 8)]
    kv_heads: u32,
    /// Elements per head (2 bytes each).
    #[arg(long, default_value_t = 64)]
    head_dim: u32,
    /// Tensor-parallel ranks of each engine.
    #[arg(long, default_value_t = 2)]
    pub(crate) tp: u32,
    /// KV blocks in each engine's pool.
    #[arg(long, default_value_t = 1024)]
    pub(crate) blocks: u32,
}

impl ModelArgs {
    pub(crate) fn model(&self) -> ModelSpec {
        ModelSpec::standard(self.layers, self.kv_heads, self.head_dim, self.block_size)
    }

    pub(crate) fn describe(&self) -> String {
        format!(
            "TP={}, {} layers, {} KV heads x {}, {}-token blocks, {} blocks per pool",
            self.tp, self.layers, self.kv_heads, self.head_dim, self.block_size, self.blocks
        )
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
