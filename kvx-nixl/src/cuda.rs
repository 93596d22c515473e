//! GPU memory for NIXL: [`CudaMemory`], a cudarc device buffer that a [`NixlAgent`](crate::NixlAgent)
//! registers as VRAM.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError};
use kvx_core::{ByteAccess, Error, ErrorKind, KvMemory, MemKind, MemRegion, Result};

/// Zeroed device memory owned by kvx, as a KV pool on a GPU.
///
/// Reads and writes from the host go through [`CudaMemory::read`] and [`CudaMemory::write`]
/// (synchronous copies), never through references into device memory, so a transport may write
/// into the buffer while the owner holds an `Arc` to it.
pub struct CudaMemory {
    buffer: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    region: MemRegion,
}

fn cuda_error(what: &str, e: DriverError) -> Error {
    Error::new(ErrorKind::Backend, format!("{what}: {e:?}")).with_backend("cuda").with_code(e.0 as i64)
}

impl CudaMemory {
    /// Allocates `len` zeroed bytes on GPU `ordinal`.
    ///
    /// Returns [`ErrorKind::NotAvailable`] if the CUDA driver library cannot be loaded (cudarc
    /// would panic on first use).
    pub fn new(ordinal: usize, len: usize) -> Result<Self> {
        // SAFETY: only checks whether libcuda can be loaded; no CUDA call is made.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::new(ErrorKind::NotAvailable, "the CUDA driver library is not loadable")
                .with_backend("cuda"));
        }
        if len == 0 {
            return Err(Error::invalid_argument("CudaMemory of zero bytes"));
        }
        let context = CudaContext::new(ordinal).map_err(|e| cuda_error("creating a CUDA context", e))?;
        let stream = context.default_stream();
        let buffer = stream.alloc_zeros::<u8>(len).map_err(|e| cuda_error("allocating device memory", e))?;
        // Zeroing runs on the stream: finish it before the first synchronous copy or transfer.
        stream.synchronize().map_err(|e| cuda_error("synchronising the stream", e))?;
        let addr = {
            let (addr, _record) = buffer.device_ptr(&stream);
            addr
        };
        let region = MemRegion {
            addr,
            len: len as u64,
            kind: MemKind::Vram,
            device: u32::try_from(context.ordinal()).unwrap_or(u32::MAX),
        };
        Ok(CudaMemory { buffer, stream, region })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buffer.len()
    }

    /// Always false: a CudaMemory has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The cudarc buffer, for kernels and cudarc copies.
    pub fn buffer(&self) -> &CudaSlice<u8> {
        &self.buffer
    }

    fn device_addr(&self, offset: usize, len: usize) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(self.region.addr + offset as u64),
            _ => Err(Error::invalid_argument(format!(
                "range {offset}+{len} outside CudaMemory of {} bytes",
                self.len()
            ))),
        }
    }

    /// Copies `src` into the buffer at `offset` (synchronously).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let dst = self.device_addr(offset, src.len())?;
        self.stream.context().bind_to_thread().map_err(|e| cuda_error("binding the context", e))?;
        // SAFETY: `dst..dst+src.len()` lies inside our live allocation (checked above) and the
        // context that owns it is current on this thread.
        unsafe { cudarc::driver::result::memcpy_htod_sync(dst, src) }
            .map_err(|e| cuda_error("copying to the GPU", e))
    }

    /// Copies bytes at `offset` out of the buffer into `dst` (synchronously).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.device_addr(offset, dst.len())?;
        self.stream.context().bind_to_thread().map_err(|e| cuda_error("binding the context", e))?;
        // SAFETY: the source range lies inside our live allocation (checked above), `dst` is an
        // exclusive host slice, and the owning context is current on this thread.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, src) }
            .map_err(|e| cuda_error("copying from the GPU", e))
    }
}

// SAFETY: the region is our own device allocation, which lives, unmoved, as long as `buffer`
// (until drop); host access is only by synchronous driver copies, and the allocation is usable
// from any thread once its context is bound.
unsafe impl KvMemory for CudaMemory {
    fn region(&self) -> MemRegion {
        self.region
    }
}

impl ByteAccess for CudaMemory {
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        CudaMemory::write(self, offset, src)
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        CudaMemory::read(self, offset, dst)
    }
}

impl fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaMemory").field("region", &self.region).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without a GPU this is a typed error; with one, a real allocation round trip.
    #[test]
    fn allocates_or_reports_no_cuda() {
        match CudaMemory::new(0, 1 << 20) {
            Ok(memory) => {
                let data: Vec<u8> = (0..=255).collect();
                assert!(memory.write(4096, &data).is_ok());
                let mut back = vec![0; 256];
                assert!(memory.read(4096, &mut back).is_ok());
                assert_eq!(back, data);
                assert_eq!(memory.region().kind, MemKind::Vram);
                assert!(memory.write(1 << 20, &[1]).is_err());
            }
            Err(e) => assert!(matches!(e.kind(), ErrorKind::NotAvailable | ErrorKind::Backend), "{e}"),
        }
    }
}
