//! KV memory allocated by UCX itself: the truly one-sided fast path over shared memory.

use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use kvx_core::{ByteAccess, ErrorKind, KvMemory, MemRegion, Result};
use kvx_ucx_sys as sys;

use crate::context::Context;
use crate::status::{check, error};

/// A `ucp_mem_map(UCP_MEM_MAP_ALLOCATE)` mapping: memory UCX allocated and registered in one go.
/// Unmapped (which frees the memory) when the last owner goes: the [`UcxMemory`] and any agent
/// registration of it.
pub(crate) struct PoolMapping {
    context: Arc<Context>,
    memh: NonNull<sys::ucp_mem>,
    addr: NonNull<u8>,
    len: usize,
}

// SAFETY: the memh belongs to a context created with `mt_workers_shared`, whose map/unmap and rkey
// calls are thread-safe; the memory itself is plain shared memory without thread affinity.
unsafe impl Send for PoolMapping {}
// SAFETY: as for Send; `&PoolMapping` only hands out the handle and address.
unsafe impl Sync for PoolMapping {}

impl PoolMapping {
    /// Allocates and registers `len` zeroed bytes in `context`.
    pub(crate) fn allocate(context: Arc<Context>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(error(ErrorKind::InvalidArgument, "UcxMemory of zero bytes"));
        }
        // SAFETY: all-zero is "no fields set" for this plain C struct.
        let mut params: sys::ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(
            sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        );
        params.address = ptr::null_mut();
        params.length = len;
        params.flags = sys::UCP_MEM_MAP_ALLOCATE;
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: the context is live; params ask UCX to allocate; out-pointer valid.
        check(unsafe { sys::ucp_mem_map(context.raw(), &params, &mut memh) }, "ucp_mem_map(ALLOCATE)")?;
        let memh =
            NonNull::new(memh).ok_or_else(|| error(ErrorKind::Backend, "ucp_mem_map returned no handle"))?;
        // Owns the mapping from here on, so an error below unmaps it.
        let mut mapping = PoolMapping { context, memh, addr: NonNull::dangling(), len: 0 };

        // SAFETY: all-zero is "no fields requested" for this plain C struct.
        let mut attr: sys::ucp_mem_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = u64::from(sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH);
        // SAFETY: the memh is live; attr is writable.
        check(unsafe { sys::ucp_mem_query(memh.as_ptr(), &mut attr) }, "ucp_mem_query")?;
        let addr = NonNull::new(attr.address.cast::<u8>())
            .ok_or_else(|| error(ErrorKind::Backend, "ucp_mem_map allocated no memory"))?;
        if attr.length < len {
            return Err(error(
                ErrorKind::Backend,
                format!("ucp_mem_map allocated {} < {len} bytes", attr.length),
            ));
        }
        mapping.addr = addr;
        mapping.len = len;
        // SAFETY: UCX allocated at least `len` bytes at `addr`, mapped read-write in this process.
        unsafe { ptr::write_bytes(addr.as_ptr(), 0, len) };
        Ok(mapping)
    }

    pub(crate) fn memh(&self) -> sys::ucp_mem_h {
        self.memh.as_ptr()
    }

    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.context
    }

    pub(crate) fn region(&self) -> MemRegion {
        MemRegion::dram(self.addr.as_ptr() as u64, self.len as u64)
    }
}

impl Drop for PoolMapping {
    fn drop(&mut self) {
        // SAFETY: the memh is live and unmapped once; the context outlives it (we hold an Arc).
        let status = unsafe { sys::ucp_mem_unmap(self.context.raw(), self.memh.as_ptr()) };
        if let Err(e) = check(status, "ucp_mem_unmap") {
            tracing::error!("freeing UcxMemory: {e}");
        }
    }
}

/// Host memory allocated and registered by UCX (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`), from
/// [`UcxAgent::alloc_memory`](crate::UcxAgent::alloc_memory).
///
/// On UCX 1.13 this is the only host memory that peers on the same machine read and write truly
/// one-sidedly (shared memory): the owner's agent need not progress for a READ to complete.
/// Registering it with the agent that allocated it reuses UCX's mapping. The memory is zeroed,
/// lives until the last `Arc` goes (the agent holds one while it is registered), and is read and
/// written by raw copies, like [`kvx_core::HostMemory`].
pub struct UcxMemory {
    mapping: Arc<PoolMapping>,
}

impl UcxMemory {
    pub(crate) fn new(mapping: Arc<PoolMapping>) -> Self {
        UcxMemory { mapping }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mapping.len
    }

    /// Always false: a UcxMemory has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Base address in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mapping.addr.as_ptr()
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(error(
                ErrorKind::InvalidArgument,
                format!("range {offset}+{len} outside UcxMemory of {} bytes", self.len()),
            )),
        }
    }

    /// Copies `src` into the memory at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        // SAFETY: the range is inside the live mapping (checked above); `src` is a Rust slice and
        // cannot alias this raw, never-referenced memory.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        // SAFETY: the range is inside the live mapping (checked above); `dst` is exclusive.
        unsafe { ptr::copy_nonoverlapping(self.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Fills `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check_range(offset, len)?;
        // SAFETY: the range is inside the live mapping (checked above).
        unsafe { ptr::write_bytes(self.as_ptr().add(offset), byte, len) };
        Ok(())
    }

    /// Copies the whole memory out.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len()];
        // Cannot fail: the range is the whole mapping.
        let _ = self.read(0, &mut out);
        out
    }
}

impl ByteAccess for UcxMemory {
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        UcxMemory::write(self, offset, src)
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        UcxMemory::read(self, offset, dst)
    }
}

// SAFETY: the region is UCX's mapping, which stays mapped and unmoved while `self.mapping` (an
// Arc we hold) lives; all access from Rust is by raw copies.
unsafe impl KvMemory for UcxMemory {
    fn region(&self) -> MemRegion {
        self.mapping.region()
    }
}

impl fmt::Debug for UcxMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UcxMemory").field("addr", &self.mapping.addr).field("len", &self.len()).finish()
    }
}
