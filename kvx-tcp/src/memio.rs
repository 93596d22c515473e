//! The one place kvx-tcp touches registered memory: vectored socket reads straight into it and
//! vectored socket writes straight from it, with no buffer between the kernel and the memory.
#![allow(unsafe_code)] // Slices over registered memory for the kernel; each block says why it is sound.

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::Arc;

use kvx_core::{KvMemory, MemKind};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// Ranges of registered host memory, with the registrations that hold them: the `Arc`s keep the
/// memory alive (and in place, by the [`KvMemory`] contract) for as long as this lives, whatever
/// its agent deregisters meanwhile.
#[derive(Debug)]
pub(crate) struct Pinned {
    ranges: Vec<(usize, usize)>,
    /// Held, never read: what keeps the ranges alive.
    _memory: Vec<Arc<dyn KvMemory>>,
}

impl Pinned {
    /// `ranges` (address, length), each of which must lie inside the host memory of one of
    /// `memory`; `None` when one does not (or wraps).
    pub(crate) fn new(ranges: &[(u64, u64)], memory: Vec<Arc<dyn KvMemory>>) -> Option<Pinned> {
        let held = |&(addr, len): &(u64, u64)| {
            let end = addr.checked_add(len)?;
            memory
                .iter()
                .map(|m| m.region())
                .find(|r| r.kind == MemKind::Dram && r.addr <= addr && r.end().is_some_and(|e| end <= e))?;
            Some((usize::try_from(addr).ok()?, usize::try_from(len).ok()?))
        };
        let ranges = ranges.iter().map(held).collect::<Option<Vec<_>>>()?;
        Some(Pinned { ranges, _memory: memory })
    }

    /// Writes `head` then every range, in order, with vectored writes.
    pub(crate) async fn send(&self, head: &[u8], out: &mut OwnedWriteHalf) -> io::Result<()> {
        let mut slices = Vec::with_capacity(1 + self.ranges.len());
        slices.push(IoSlice::new(head));
        for &(addr, len) in &self.ranges {
            // SAFETY: the range lies inside a registration whose `Arc<dyn KvMemory>` `self` holds
            // (checked in `new`), so by the `KvMemory` contract it is allocated and readable for
            // its whole length until `self` is dropped, which outlives `slices`. The slice is only
            // handed to the kernel (writev); Rust code never reads it. Concurrent writes by a
            // transport or the owner leave unspecified bytes in what is sent, as DMA would (the
            // contract makes that the caller's concern).
            let bytes =
                unsafe { std::slice::from_raw_parts(std::ptr::with_exposed_provenance::<u8>(addr), len) };
            slices.push(IoSlice::new(bytes));
        }
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            let n = out.write_vectored(rest).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut rest, n);
        }
        Ok(())
    }

    /// Fills every range, in order, from `input` with vectored reads.
    pub(crate) async fn receive(&self, input: &OwnedReadHalf) -> io::Result<()> {
        let mut slices = Vec::with_capacity(self.ranges.len());
        for &(addr, len) in &self.ranges {
            // SAFETY: as in `send`, and the memory is writable by the contract. The slice is only
            // handed to the kernel (readv) and dropped before this returns; Rust code never reads
            // or writes through it. Two transfers into the same bytes (which the caller must not
            // post) would leave unspecified bytes there, as DMA would.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(std::ptr::with_exposed_provenance_mut::<u8>(addr), len)
            };
            slices.push(IoSliceMut::new(bytes));
        }
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            input.readable().await?;
            match input.try_read_vectored(rest) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => IoSliceMut::advance_slices(&mut rest, n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::HostMemory;

    #[test]
    fn only_ranges_inside_host_memory_are_pinned() {
        let m = Arc::new(HostMemory::new(64).unwrap());
        let base = m.region().addr;
        let pin = |ranges: &[(u64, u64)]| Pinned::new(ranges, vec![m.clone() as Arc<dyn KvMemory>]);
        assert!(pin(&[(base, 64), (base + 8, 8)]).is_some());
        assert!(pin(&[(base + 60, 8)]).is_none(), "past the end");
        assert!(pin(&[(base - 1, 8)]).is_none(), "before the start");
        assert!(pin(&[(u64::MAX - 2, 8)]).is_none(), "wrapping");
        assert!(Pinned::new(&[(base, 8)], Vec::new()).is_none(), "no memory");
    }

    #[tokio::test]
    async fn bytes_go_from_memory_to_memory_through_a_socket() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = tokio::net::TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (b, _) = listener.accept().await.unwrap();
        let (src, dst) = (Arc::new(HostMemory::new(4096).unwrap()), Arc::new(HostMemory::new(4096).unwrap()));
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        src.write(0, &data).unwrap();
        let (s, d) = (src.region().addr, dst.region().addr);
        let from = Pinned::new(&[(s + 100, 1000), (s, 50)], vec![src.clone() as Arc<dyn KvMemory>]).unwrap();
        let into = Pinned::new(&[(d + 2000, 1050)], vec![dst.clone() as Arc<dyn KvMemory>]).unwrap();
        let (_, mut w) = a.into_split();
        let (r, _) = b.into_split();
        let (sent, received) = tokio::join!(from.send(b"", &mut w), into.receive(&r));
        sent.unwrap();
        received.unwrap();
        let got = dst.to_vec();
        assert_eq!(&got[2000..3000], &data[100..1100]);
        assert_eq!(&got[3000..3050], &data[..50]);
        assert!(got[..2000].iter().chain(&got[3050..]).all(|&b| b == 0));
    }
}
