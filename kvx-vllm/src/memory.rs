//! A vLLM KV-cache tensor as memory a transfer agent may register.

use kvx_core::{KvMemory, MemRegion};

/// One layer's KV-cache tensor (host memory), by address and length.
///
/// The tensor belongs to vLLM; the Python connector holds a reference to every tensor it hands
/// over for as long as the worker (and so every registration) lives, and closes the worker
/// before dropping them.
#[derive(Debug, Clone, Copy)]
pub struct TensorMemory {
    region: MemRegion,
}

impl TensorMemory {
    /// The tensor whose storage starts at `addr` and spans `len` bytes.
    ///
    /// # Safety
    /// `addr..addr + len` must be allocated host memory that stays allocated, unmoved and
    /// writable by any thread for as long as the returned value (or any clone) is alive.
    pub unsafe fn new(addr: u64, len: u64) -> Self {
        TensorMemory { region: MemRegion::dram(addr, len) }
    }
}

// SAFETY: `TensorMemory::new`'s contract is exactly `KvMemory`'s: the region stays allocated,
// valid and unmoved while the value lives (the Python connector keeps the tensors alive until
// the worker is closed), and the region never changes.
unsafe impl KvMemory for TensorMemory {
    fn region(&self) -> MemRegion {
        self.region
    }
}
