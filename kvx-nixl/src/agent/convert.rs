//! kvx's memory, operations and indices as NIXL's types.

use kvx_core::{ErrorKind, MemKind, MemRegion, Result, XferOp};
use nixl_sys as nixl;

use crate::error::error;

/// A registration's region as nixl-sys's descriptor trait.
#[derive(Debug)]
pub(super) struct RegionDescriptor {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) region: MemRegion,
}

impl RegionDescriptor {
    pub(super) fn new(region: MemRegion) -> Result<Self> {
        Ok(RegionDescriptor { addr: to_usize(region.addr)?, len: to_usize(region.len)?, region })
    }
}

impl nixl::MemoryRegion for RegionDescriptor {
    unsafe fn as_ptr(&self) -> *const u8 {
        // Only an address for NIXL's descriptor; never dereferenced by kvx.
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl nixl::NixlDescriptor for RegionDescriptor {
    fn mem_type(&self) -> nixl::MemType {
        mem_type(self.region.kind)
    }

    fn device_id(&self) -> u64 {
        u64::from(self.region.device)
    }
}

pub(super) fn mem_type(kind: MemKind) -> nixl::MemType {
    match kind {
        MemKind::Dram => nixl::MemType::Dram,
        MemKind::Vram => nixl::MemType::Vram,
    }
}

pub(super) fn nixl_op(op: XferOp) -> nixl::XferOp {
    match op {
        XferOp::Read => nixl::XferOp::Read,
        XferOp::Write => nixl::XferOp::Write,
    }
}

pub(super) fn to_usize(value: u64) -> Result<usize> {
    usize::try_from(value)
        .map_err(|_| error(ErrorKind::InvalidArgument, format!("{value} does not fit an address")))
}

/// A descriptor index as NIXL's `int`. Every list's length fits one (checked when it was
/// prepared), so every index in range does too.
pub(super) fn nixl_index(index: u32) -> Result<i32> {
    i32::try_from(index)
        .map_err(|_| error(ErrorKind::InvalidArgument, format!("descriptor {index} is past NIXL's indices")))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests fail loudly by unwrapping.
mod tests {
    use super::*;

    #[test]
    fn indices_past_nixls_int_are_refused() {
        assert_eq!(nixl_index(7).unwrap(), 7);
        let e = nixl_index(u32::MAX).unwrap_err();
        assert_eq!((e.kind(), e.backend()), (ErrorKind::InvalidArgument, Some("nixl")));
    }
}
