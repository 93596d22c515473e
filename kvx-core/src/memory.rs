//! Memory that transports read and write: regions, the [`KvMemory`] contract, and [`HostMemory`].
//!
//! This is the one module of kvx-core with `unsafe` code: a transport copies bytes in and out of
//! registered memory behind Rust's back, so the memory must stay alive and in place for as long as
//! it is registered. [`KvMemory`] is that promise; an agent keeps an `Arc<dyn KvMemory>` for each
//! registration, so the memory cannot be freed before it is deregistered.
#![allow(unsafe_code)] // Declares the KvMemory contract and implements it for an owned allocation.

use serde::{Deserialize, Serialize};
use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// Where memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemKind {
    /// Host memory.
    Dram,
    /// GPU memory.
    Vram,
}

/// A contiguous range of memory: plain data, no ownership. Used to describe registrations and the
/// blocks of a descriptor list. Decoding refuses keys it does not have (it travels in NIXL's
/// agent metadata).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemRegion {
    /// Start address in the owning process.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Host or GPU memory.
    pub kind: MemKind,
    /// Device id (GPU ordinal for VRAM; 0 for DRAM).
    pub device: u32,
}

impl MemRegion {
    /// A host-memory region.
    pub fn dram(addr: u64, len: u64) -> Self {
        MemRegion { addr, len, kind: MemKind::Dram, device: 0 }
    }

    /// One past the last byte, or `None` if the region wraps the address space.
    pub fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }

    /// Whether `inner` lies entirely inside `self` (same kind and device).
    pub fn contains(&self, inner: &MemRegion) -> bool {
        match (self.end(), inner.end()) {
            (Some(end), Some(inner_end)) => {
                self.kind == inner.kind
                    && self.device == inner.device
                    && inner.addr >= self.addr
                    && inner_end <= end
            }
            _ => false,
        }
    }
}

/// Memory that a [`TransferAgent`](crate::TransferAgent) may register.
///
/// # Safety
/// An implementor guarantees that, for as long as the value is alive, [`KvMemory::region`] returns
/// the same region and that region is allocated, valid for reads and writes of its whole length by
/// any thread and by transports (DMA, other processes through the transport), and not freed or
/// moved. Transports write into it concurrently with the owner; the owner accesses it only through
/// raw copies (never holding a `&mut [u8]` across a transfer).
pub unsafe trait KvMemory: Send + Sync + fmt::Debug {
    /// The memory's address range and kind.
    fn region(&self) -> MemRegion;
}

/// Access to a memory's bytes from the host by raw copies (never by references that could alias a
/// transport's writes): how tests fill and check KV memory, whatever allocated it.
pub trait ByteAccess: Send + Sync + fmt::Debug {
    /// Copies `src` into the memory at `offset`.
    fn write(&self, offset: usize, src: &[u8]) -> Result<()>;
    /// Copies the bytes at `offset` into `dst`.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
}

/// Zeroed, page-aligned host memory owned by kvx: the KV pool of tests, the demo and benchmarks.
///
/// From 2 MiB on, the buffer is aligned to a huge page and, on Linux, asks for
/// transparent huge pages (`madvise(MADV_HUGEPAGE)`, as numpy does for its large arrays): a
/// transport that copies between processes (UCX's and NIXL's cma, `process_vm_readv`) pins every
/// page it copies, and 4 KiB pages cost it up to half its rate on these machines (see
/// docs/PERFORMANCE.md, "Huge pages"). Where the kernel's `transparent_hugepage` setting is
/// `never` the hint does nothing.
///
/// Reads and writes go through [`HostMemory::read`] and [`HostMemory::write`] (raw copies), so a
/// transport may write into the buffer while the owner holds an `Arc` to it.
pub struct HostMemory {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: HostMemory is a plain heap allocation; it has no thread affinity. All accesses are raw
// copies through `read`/`write`, which are bounds-checked and never create references that outlive
// the call.
unsafe impl Send for HostMemory {}
// SAFETY: as for Send: shared access only performs raw copies, as transports do.
unsafe impl Sync for HostMemory {}

const PAGE: usize = 4096;
/// The size of a transparent huge page on x86-64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;

impl HostMemory {
    /// Allocates `len` zeroed bytes, aligned to a page (to a huge page from 2 MiB on). `len` must
    /// be at least 1.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid_argument("HostMemory of zero bytes"));
        }
        let align = if len >= HUGE_PAGE { HUGE_PAGE } else { PAGE };
        let layout = Layout::from_size_align(len, align)
            .map_err(|e| Error::invalid_argument(format!("HostMemory of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size (checked above).
        let raw = unsafe { alloc::alloc(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::new(crate::ErrorKind::Backend, format!("out of memory allocating {len} bytes"))
        })?;
        // The hint goes before the first touch: zeroing faults the pages in, huge where granted.
        if align == HUGE_PAGE {
            advise_huge_pages(ptr, len);
        }
        // SAFETY: `ptr` is a live allocation of `len` bytes.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(HostMemory { ptr, layout })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Always false: a HostMemory has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::invalid_argument(format!(
                "range {offset}+{len} outside HostMemory of {} bytes",
                self.len()
            ))),
        }
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: the destination range is inside our live allocation (checked above) and cannot
        // overlap `src`, which is a Rust slice and therefore not part of this buffer's raw range
        // handed out as a reference anywhere.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out of the buffer into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: the source range is inside our live allocation (checked above); `dst` is a
        // distinct exclusive slice.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// The whole buffer as a slice, for its sole owner: `&mut self` proves that no transport
    /// holds it (a registration holds an `Arc`), so nothing writes it behind the slice's back.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is live, initialized (zeroed at creation) and `len` long; the
        // exclusive borrow of `self` rules out every other access while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }

    /// Fills `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check(offset, len)?;
        // SAFETY: the range is inside our live allocation (checked above).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), byte, len) };
        Ok(())
    }

    /// Copies the whole buffer out (for tests and verification).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        // Cannot fail: the range is the whole buffer.
        let _ = self.read(0, &mut v);
        v
    }
}

/// Asks the kernel to back `len` bytes at `ptr` (aligned to [`HUGE_PAGE`]) with transparent huge
/// pages. A hint: where the kernel refuses it, the memory works the same on small pages.
#[cfg(target_os = "linux")]
fn advise_huge_pages(ptr: NonNull<u8>, len: usize) {
    // SAFETY: the range is our own live allocation; MADV_HUGEPAGE changes only how the kernel
    // backs it, not its contents.
    let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
    if rc != 0 {
        tracing::debug!(len, error = %std::io::Error::last_os_error(), "HostMemory: no transparent huge pages");
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_ptr: NonNull<u8>, _len: usize) {}

// SAFETY: the region is our own allocation, which lives, unmoved, until `drop`; all access is by
// raw copies.
unsafe impl KvMemory for HostMemory {
    fn region(&self) -> MemRegion {
        MemRegion::dram(self.ptr.as_ptr() as u64, self.len() as u64)
    }
}

impl ByteAccess for HostMemory {
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        HostMemory::write(self, offset, src)
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        HostMemory::read(self, offset, dst)
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc` with exactly this layout and is freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMemory").field("addr", &self.ptr).field("len", &self.len()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_is_zeroed_aligned_and_bounds_checked() {
        let m = HostMemory::new(10_000).unwrap();
        assert_eq!(m.region().addr % PAGE as u64, 0);
        assert!(m.to_vec().iter().all(|&b| b == 0));
        m.write(9_998, &[1, 2]).unwrap();
        let mut out = [0u8; 2];
        m.read(9_998, &mut out).unwrap();
        assert_eq!(out, [1, 2]);
        assert!(m.write(9_999, &[1, 2]).is_err());
        assert!(m.read(usize::MAX, &mut out).is_err());
        assert!(HostMemory::new(0).is_err());
        let mut owned = HostMemory::new(100).unwrap();
        owned.as_mut_slice()[99] = 7;
        assert_eq!(owned.as_mut_slice().len(), 100);
        let mut last = [0u8];
        owned.read(99, &mut last).unwrap();
        assert_eq!(last, [7]);
    }

    #[test]
    fn large_host_memory_is_zeroed_and_aligned_to_a_huge_page() {
        // Allocated and freed first, so that the next allocation may reuse dirty memory.
        let dirty = HostMemory::new(3 * HUGE_PAGE + 5).unwrap();
        dirty.fill(0, dirty.len(), 0xa5).unwrap();
        drop(dirty);
        let m = HostMemory::new(3 * HUGE_PAGE + 5).unwrap();
        assert_eq!(m.region().addr % HUGE_PAGE as u64, 0);
        assert_eq!(m.len(), 3 * HUGE_PAGE + 5);
        assert!(m.to_vec().iter().all(|&b| b == 0));
    }

    #[test]
    fn region_containment_checks_kind_device_and_overflow() {
        let outer = MemRegion::dram(100, 100);
        assert!(outer.contains(&MemRegion::dram(100, 100)));
        assert!(outer.contains(&MemRegion::dram(150, 50)));
        assert!(!outer.contains(&MemRegion::dram(150, 51)));
        assert!(!outer.contains(&MemRegion::dram(99, 2)));
        assert!(!outer.contains(&MemRegion { kind: MemKind::Vram, ..MemRegion::dram(100, 1) }));
        assert!(!outer.contains(&MemRegion::dram(u64::MAX, 2)));
    }
}
