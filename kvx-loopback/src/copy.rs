//! The one place kvx-loopback touches memory behind Rust's back: copying bytes between registered
//! memory of two agents.
#![allow(unsafe_code)] // The loopback memcpy; each block says why it is sound.

use std::sync::Arc;

use kvx_core::{KvMemory, MemRegion};

/// Registered memory captured for one copy: the `Arc` keeps the allocation alive while bytes move,
/// even if its agent deregisters it concurrently.
#[derive(Debug, Clone)]
pub(crate) struct Pinned {
    pub(crate) region: MemRegion,
    pub(crate) memory: Arc<dyn KvMemory>,
}

/// Registrations sorted by address, for finding the one that holds a range.
#[derive(Debug, Default)]
pub(crate) struct PinnedSet(Vec<Pinned>);

impl PinnedSet {
    pub(crate) fn new(mut pinned: Vec<Pinned>) -> Self {
        pinned.sort_by_key(|p| p.region.addr);
        PinnedSet(pinned)
    }

    /// Whether `[addr, addr + len)` lies inside one of the pinned registrations.
    pub(crate) fn holds(&self, addr: u64, len: u64) -> bool {
        let range = MemRegion::dram(addr, len);
        let candidates = self.0.partition_point(|p| p.region.addr <= addr);
        // Usually the nearest registration below holds it; overlapping registrations (the same
        // memory registered twice) make us look further down.
        self.0[..candidates].iter().rev().any(|p| p.region.contains(&range) && p.memory.region() == p.region)
    }
}

/// Copies `len` bytes from `src` to `dst`, after checking that the source range lies in `src_set`
/// and the destination range in `dst_set`.
///
/// Returns false (and copies nothing) when a range is not held by its set.
pub(crate) fn copy_checked(src_set: &PinnedSet, src: u64, dst_set: &PinnedSet, dst: u64, len: u64) -> bool {
    if !src_set.holds(src, len) || !dst_set.holds(dst, len) {
        return false;
    }
    let (Ok(src), Ok(dst), Ok(len)) = (usize::try_from(src), usize::try_from(dst), usize::try_from(len))
    else {
        return false;
    };
    let src = std::ptr::with_exposed_provenance::<u8>(src);
    let dst = std::ptr::with_exposed_provenance_mut::<u8>(dst);
    // SAFETY: both ranges lie inside registrations whose `Arc<dyn KvMemory>` the sets hold (checked
    // just above), so by the `KvMemory` contract each range is allocated, valid for reads and
    // writes of its whole length by any thread, and stays so while the sets live (the caller holds
    // them across this call). No Rust reference into registered memory exists (owners access it
    // only by raw copies), so this aliases nothing. The ranges may overlap (the same memory
    // registered by two agents), hence `copy` (memmove) rather than `copy_nonoverlapping`.
    // Concurrent transfers into the same bytes leave unspecified bytes there, as DMA would; the
    // `KvMemory` contract makes that the caller's concern, not a memory-safety one.
    unsafe { std::ptr::copy(src, dst, len) };
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::HostMemory;

    #[test]
    fn copies_only_inside_pinned_ranges() {
        let a = Arc::new(HostMemory::new(64).unwrap());
        let b = Arc::new(HostMemory::new(64).unwrap());
        a.write(0, &[7; 64]).unwrap();
        let pin = |m: &Arc<HostMemory>| Pinned { region: m.region(), memory: m.clone() };
        let (sa, sb) = (PinnedSet::new(vec![pin(&a)]), PinnedSet::new(vec![pin(&b)]));
        let (ra, rb) = (a.region().addr, b.region().addr);
        assert!(copy_checked(&sa, ra + 8, &sb, rb + 16, 8));
        assert_eq!(&b.to_vec()[14..26], &[0, 0, 7, 7, 7, 7, 7, 7, 7, 7, 0, 0]);
        assert!(!copy_checked(&sa, ra + 60, &sb, rb, 8), "source overruns its registration");
        assert!(!copy_checked(&sa, ra, &sb, rb + 57, 8), "destination overruns its registration");
        assert!(!copy_checked(&sb, ra, &sa, rb, 8), "ranges of the wrong sets");
        assert!(!copy_checked(&sa, u64::MAX - 2, &sb, rb, 8), "wrapping range");
        // Overlapping copy inside one buffer (self-transfer) is a memmove.
        b.write(16, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        assert!(copy_checked(&sb, rb + 16, &sb, rb + 20, 8));
        assert_eq!(&b.to_vec()[16..28], &[1, 2, 3, 4, 1, 2, 3, 4, 5, 6, 7, 8]);
    }
}
