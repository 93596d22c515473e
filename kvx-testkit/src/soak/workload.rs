//! The soak's requests: each drawn from its own stream of the seed, so it can be drawn again.

use std::time::Duration;

use kvx_core::RequestId;

use super::SoakConfig;
use crate::sim::{SimRng, VOCAB};

/// Shared prompt prefixes (system prompts) draw from streams `PREFIXES + i`.
const PREFIXES: u64 = u64::MAX - 100;
const NUM_PREFIXES: u64 = 8;

/// One request, drawn from its own stream of the seed (so it can be drawn again).
pub(super) struct Plan {
    pub(super) id: RequestId,
    pub(super) prompt: Vec<u32>,
    pub(super) max_new_tokens: usize,
    pub(super) prefill: usize,
    pub(super) decode: usize,
    pub(super) client_delay: Duration,
    pub(super) abort_after: Option<Duration>,
    pub(super) lost_handoff: bool,
}

/// The id of request `n`.
pub(super) fn request_id(n: u64) -> RequestId {
    RequestId::new(format!("req-{n}"))
}

/// Request `n` of a soak: its prompt (now and then with a shared system prompt, or a recent
/// request's prompt again), the tokens it generates, its engines, its client's delay between
/// them, and whether its client aborts it or loses its params.
pub(super) fn plan(c: &SoakConfig, n: u64) -> Plan {
    let mut rng = SimRng::stream(c.seed, n);
    let mut prompt = Vec::new();
    if rng.chance(0.03) && n > 0 {
        // The same prompt as a recent request: a full prefix hit on a decode engine that
        // still caches it (only a notification goes to the prefill engine).
        prompt = plan(c, n - 1 - rng.below(n.min(50))).prompt;
    } else if rng.chance(0.3) {
        let mut shared = SimRng::stream(c.seed, PREFIXES + rng.below(NUM_PREFIXES));
        let len = shared.range(16, 128);
        prompt.extend((0..len).map(|_| shared.below(u64::from(VOCAB)) as u32));
    }
    let (lo, hi) = (*c.prompt_len.start() as u64, *c.prompt_len.end() as u64);
    let tail = rng.range(lo, hi).saturating_sub(prompt.len() as u64).max(1);
    if prompt.len() < hi as usize {
        prompt.extend((0..tail).map(|_| rng.below(u64::from(VOCAB)) as u32));
    }
    let f = &c.faults;
    Plan {
        id: request_id(n),
        prompt,
        max_new_tokens: rng.range(*c.max_new_tokens.start() as u64, *c.max_new_tokens.end() as u64) as usize,
        prefill: rng.below(c.prefills as u64) as usize,
        decode: rng.below(c.decodes as u64) as usize,
        client_delay: rng.duration(Duration::ZERO, c.max_client_delay),
        abort_after: rng.chance(f.abort).then(|| rng.duration(Duration::ZERO, f.max_abort_delay)),
        lost_handoff: rng.chance(f.lost_handoff),
    }
}
