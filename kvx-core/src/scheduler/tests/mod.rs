//! The scheduler on its own: plain tests, no workers.
//!
//! - `loads`: the decode side: matched tokens, allocation, aborts.
//! - `offers`: the prefill side's offers and holds, keys, and lease renewals.
//! - `hybrid`: models with sliding-window groups.
//! - `push`: push mode on both sides.

use super::*;
use crate::ids::BlockId;

const BS: usize = 16;

fn sched() -> ConnectorScheduler {
    ConnectorScheduler::new(SchedulerConfig {
        engine_id: "prefill".into(),
        block_size: BS as u32,
        side_channel: Some(Endpoint::new("10.0.0.1", 5600)),
        auth_key: None,
        lease_duration: Duration::from_secs(30),
        instance: None,
        tp_size: 1,
        group_windows: Vec::new(),
    })
    .unwrap()
}

fn decode_params(blocks: Vec<BlockId>) -> TransferParams {
    TransferParams::for_decode(
        vec![GroupBlocks::whole(blocks)],
        RemoteCoordinates::at("prefill", "10.0.0.1", 5600),
    )
}

/// One group's blocks from position 0.
fn whole(ids: &[BlockId]) -> Vec<GroupBlocks> {
    vec![GroupBlocks::whole(ids.to_vec())]
}

/// One group's new blocks, from the position after `computed` tokens.
fn new_at(computed: usize, ids: &[BlockId]) -> Vec<GroupBlocks> {
    vec![GroupBlocks::new((computed / BS) as u32, ids.to_vec())]
}

fn id(s: &str) -> RequestId {
    RequestId::new(s)
}

mod hybrid;
mod loads;
mod offers;
mod push;
