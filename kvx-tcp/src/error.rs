//! kvx-tcp's own failures, and how they become [`kvx_core::Error`]s.

use kvx_core::{Error, ErrorKind};

use crate::BACKEND;

/// Why a connection was dropped or a frame refused. Every one becomes an error of kind
/// [`ErrorKind::InvalidPeerData`] (the peer sent something kvx-tcp does not take),
/// [`ErrorKind::Io`] (the socket failed) or [`ErrorKind::Transfer`] (for the transfers that were
/// waiting on the connection).
#[derive(Debug, thiserror::Error)]
pub(crate) enum TcpError {
    /// A frame's header is not one this end takes: bad magic, unknown or misdirected kind, counts
    /// and lengths that disagree.
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// A frame's header claims more bytes than the limit, refused before anything was allocated.
    #[error("a frame of {len} bytes of {what} is over the limit of {max}")]
    Oversize { what: &'static str, len: u64, max: u64 },
    /// An answer that is not the one the connection waits for next (another transfer, nonce or
    /// range, or another length).
    #[error("an answer that answers nothing in flight: {0}")]
    Unexpected(String),
    /// The socket failed or the peer closed it.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A bounded wait ran out.
    #[error("{0} timed out")]
    Timeout(&'static str),
}

impl From<TcpError> for Error {
    fn from(e: TcpError) -> Error {
        let kind = match &e {
            TcpError::Malformed(_) | TcpError::Oversize { .. } | TcpError::Unexpected(_) => {
                ErrorKind::InvalidPeerData
            }
            TcpError::Io(_) => ErrorKind::Io,
            TcpError::Timeout(_) => ErrorKind::Timeout,
        };
        Error::new(kind, e.to_string()).with_backend(BACKEND).with_source(e)
    }
}

/// An error of `kind` from this backend.
pub(crate) fn err(kind: ErrorKind, msg: impl Into<String>) -> Error {
    Error::new(kind, msg).with_backend(BACKEND)
}
