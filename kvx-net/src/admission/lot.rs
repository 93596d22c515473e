//! The [`Lot`]: where a server parks the connections the admission policy dismissed for room
//! (see the [`admission`](super) module's docs).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// Where a server keeps the connections it dismissed for room, open and unserved, so that their
/// peers do not connect again at once (see the [`admission`](super) module's docs). Holds at most
/// its capacity: a newcomer when it is full releases the oldest.
#[derive(Clone)]
pub struct Lot {
    inner: Arc<Mutex<LotState>>,
}

struct LotState {
    max: usize,
    next: u64,
    held: BTreeMap<u64, oneshot::Sender<()>>,
}

impl fmt::Debug for Lot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lot").field("held", &self.len()).finish()
    }
}

impl Lot {
    /// A lot holding at most `max` connections (none when 0: each is released as it comes).
    pub fn new(max: usize) -> Self {
        Lot { inner: Arc::new(Mutex::new(LotState { max, next: 0, held: BTreeMap::new() })) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LotState> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Parks one connection, releasing the oldest when the lot is full.
    pub fn park(&self) -> Parked {
        let (tx, released) = oneshot::channel();
        let mut lot = self.lock();
        let id = lot.next;
        lot.next += 1;
        lot.held.insert(id, tx);
        while lot.held.len() > lot.max {
            if let Some((_, oldest)) = lot.held.pop_first() {
                let _ = oldest.send(());
            }
        }
        Parked { lot: self.clone(), id, released }
    }

    /// Holds `stream` parked (see the [`admission`](super) module's docs): what it sends is read
    /// and thrown away, and this returns when its peer closes it, it sends more than
    /// [`MAX_PARKED_BYTES`], `limit` passes, or the lot needs its place. The caller then closes it.
    pub async fn hold(&self, stream: &mut TcpStream, limit: Duration) {
        let mut parked = self.park();
        let deadline = tokio::time::sleep(limit);
        tokio::pin!(deadline);
        let mut sink = [0u8; 512];
        let mut left = MAX_PARKED_BYTES;
        loop {
            tokio::select! {
                read = stream.read(&mut sink) => match read {
                    Ok(n) if n > 0 && n < left => left -= n,
                    _ => return,
                },
                () = &mut deadline => return,
                () = parked.released() => return,
            }
        }
    }

    /// Releases every connection and parks no more (each later one is released at once): for a
    /// server that stops.
    pub fn close(&self) {
        let mut lot = self.lock();
        lot.max = 0;
        while let Some((_, held)) = lot.held.pop_first() {
            let _ = held.send(());
        }
    }

    /// Releases the `n` oldest connections (to free their file descriptors); returns how many
    /// there were.
    pub fn shed(&self, n: usize) -> usize {
        let mut lot = self.lock();
        let mut shed = 0;
        while shed < n {
            let Some((_, oldest)) = lot.held.pop_first() else { break };
            let _ = oldest.send(());
            shed += 1;
        }
        shed
    }

    /// The connections parked now.
    pub fn len(&self) -> usize {
        self.lock().held.len()
    }

    /// Whether none is parked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The most a parked connection may send (it is read and thrown away) before it is let go.
pub const MAX_PARKED_BYTES: usize = 64 << 10;

/// A second descriptor of a connection's socket, kept aside while an HTTP stack that owns the
/// stream serves it, so that the connection can be parked once that stack lets go of it (closing
/// its own descriptor then leaves the socket open).
#[derive(Debug)]
pub struct Spare(std::net::TcpStream);

impl Spare {
    /// `stream`, and its spare.
    pub fn of(stream: TcpStream) -> std::io::Result<(TcpStream, Spare)> {
        let std = stream.into_std()?;
        let spare = std.try_clone()?;
        Ok((TcpStream::from_std(std)?, Spare(spare)))
    }

    /// Parks the connection in `lot` for at most `limit` (see [`Lot::hold`]), then closes it with a
    /// reset. Call it once the stack's own stream is gone.
    pub async fn park(self, lot: &Lot, limit: Duration) {
        let Ok(mut stream) = TcpStream::from_std(self.0) else { return };
        lot.hold(&mut stream, limit).await;
        let _ = stream.set_zero_linger();
    }
}

/// One connection's place in a [`Lot`]; dropping it gives the place up.
#[derive(Debug)]
pub struct Parked {
    lot: Lot,
    id: u64,
    released: oneshot::Receiver<()>,
}

impl Parked {
    /// Returns when the lot releases the connection (its place is needed).
    pub async fn released(&mut self) {
        // A closed channel is a release too: the lot no longer holds the sender.
        let _ = (&mut self.released).await;
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        self.lot.lock().held.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_lot_releases_its_oldest_and_sheds_oldest_first() {
        let lot = Lot::new(2);
        let mut a = lot.park();
        let mut b = lot.park();
        let mut c = lot.park();
        let released = |p: &mut Parked| p.released.try_recv().is_ok();
        assert!(released(&mut a) && !released(&mut b) && !released(&mut c));
        assert_eq!(lot.len(), 2);
        assert_eq!(lot.shed(5), 2);
        assert!(released(&mut b) && released(&mut c) && lot.is_empty());
        let d = lot.park();
        drop(d);
        assert!(lot.is_empty());
        // A lot of none holds nothing.
        let mut e = Lot::new(0).park();
        assert!(released(&mut e));
    }
}
