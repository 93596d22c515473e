//! The one public error type of kvx.
//!
//! Backends keep their own status codes inside ([`Error::code`]) and say which backend they are
//! ([`Error::backend`]); callers branch on [`ErrorKind`] and [`Error::is_retryable`].

use std::fmt;

/// Result with kvx's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What kind of failure an [`Error`] is. New kinds may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument from the local caller is invalid (a bug in the caller).
    InvalidArgument,
    /// Data that came from a peer or the network is invalid: out-of-range block ids, unequal
    /// lengths, an unknown engine, a malformed message. Nothing was transferred.
    InvalidPeerData,
    /// The peer's KV layout or wire-format version is not compatible with ours.
    Incompatible,
    /// The transport library is not installed or could not be loaded.
    NotAvailable,
    /// The backend lacks a capability the call needs (see `Capabilities`).
    Unsupported,
    /// An agent, descriptor list, registration or transfer id that this agent does not know.
    NotFound,
    /// A bounded wait ran out.
    Timeout,
    /// A handshake with a peer failed (it refused, was unreachable, or sent garbage).
    Handshake,
    /// A transfer failed after it was posted.
    Transfer,
    /// A serialisation or deserialisation failure.
    Wire,
    /// An I/O error (sockets, files).
    Io,
    /// The transport library returned an error status.
    Backend,
    /// The call is not valid in the current state (e.g. registering twice).
    State,
    /// A peer or client failed authentication: a missing or wrong key, or a MAC that does not
    /// verify. Nothing was served or transferred.
    Unauthenticated,
    /// A lease ran out before the work it covered was done: the prefill engine's hold expired (or
    /// was already released) before the READ's notification reached it, so the bytes read may be
    /// another request's. The load fails; nothing it read is used.
    Expired,
}

impl ErrorKind {
    /// Whether retrying the same operation later can succeed.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::Timeout | ErrorKind::Handshake | ErrorKind::Io)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::InvalidPeerData => "invalid peer data",
            ErrorKind::Incompatible => "incompatible peer",
            ErrorKind::NotAvailable => "transport not available",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::NotFound => "not found",
            ErrorKind::Timeout => "timed out",
            ErrorKind::Handshake => "handshake failed",
            ErrorKind::Transfer => "transfer failed",
            ErrorKind::Wire => "wire format error",
            ErrorKind::Io => "i/o error",
            ErrorKind::Backend => "backend error",
            ErrorKind::State => "invalid state",
            ErrorKind::Unauthenticated => "not authenticated",
            ErrorKind::Expired => "lease expired",
        };
        f.write_str(s)
    }
}

/// kvx's error: a kind, a message, optionally the backend and its raw status code, and a source.
#[derive(Debug, thiserror::Error)]
#[error("{kind}{}: {message}{}", backend_tag(.backend), code_tag(.code))]
pub struct Error {
    kind: ErrorKind,
    message: String,
    backend: Option<&'static str>,
    code: Option<i64>,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

fn backend_tag(backend: &Option<&'static str>) -> String {
    backend.map(|b| format!(" [{b}]")).unwrap_or_default()
}

fn code_tag(code: &Option<i64>) -> String {
    code.map(|c| format!(" (status {c})")).unwrap_or_default()
}

/// The longest message an [`Error`] keeps, in bytes: whatever a peer sent, an error stays small.
pub const MAX_MESSAGE_LEN: usize = 1024;

/// The most characters of peer or client data that [`quote`] keeps.
pub const MAX_QUOTE_CHARS: usize = 64;

/// Quotes peer or client data for a message: escaped as Rust's `Debug` does, cut after
/// [`MAX_QUOTE_CHARS`] characters with the full length said.
pub fn quote(data: &str) -> String {
    let mut chars = data.chars();
    let head: String = chars.by_ref().take(MAX_QUOTE_CHARS).collect();
    if chars.next().is_none() { format!("{head:?}") } else { format!("{head:?}... ({} bytes)", data.len()) }
}

fn truncate(mut message: String) -> String {
    if message.len() > MAX_MESSAGE_LEN {
        let mut end = MAX_MESSAGE_LEN;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...");
    }
    message
}

impl Error {
    /// A new error of `kind` with a message (cut at [`MAX_MESSAGE_LEN`] bytes).
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: truncate(message.into()), backend: None, code: None, source: None }
    }

    /// The same error with `what` before its message: the kind, backend, code and source stay,
    /// so the kind is not repeated in the text (`handshake failed: with engine e: ...`).
    pub fn context(self, what: impl fmt::Display) -> Self {
        Error { message: truncate(format!("{what}: {}", self.message)), ..self }
    }

    /// Shorthand for [`ErrorKind::InvalidArgument`].
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    /// Shorthand for [`ErrorKind::InvalidPeerData`].
    pub fn invalid_peer_data(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidPeerData, message)
    }

    /// Shorthand for [`ErrorKind::NotFound`].
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    /// Names the backend that raised the error.
    pub fn with_backend(mut self, backend: &'static str) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Keeps the backend's raw status code.
    pub fn with_code(mut self, code: i64) -> Self {
        self.code = Some(code);
        self
    }

    /// Attaches the underlying cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// The same kind, message, backend and code without the source: one failure reported for
    /// several requests.
    pub fn detached(&self) -> Self {
        Error {
            kind: self.kind,
            message: self.message.clone(),
            backend: self.backend,
            code: self.code,
            source: None,
        }
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The human-readable message (without kind, backend or code).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The backend that raised the error, if any.
    pub fn backend(&self) -> Option<&'static str> {
        self.backend
    }

    /// The backend's raw status code, if any.
    pub fn code(&self) -> Option<i64> {
        self.code
    }

    /// Whether retrying the same operation later can succeed.
    pub fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        let kind = if e.kind() == std::io::ErrorKind::TimedOut { ErrorKind::Timeout } else { ErrorKind::Io };
        Error::new(kind, e.to_string()).with_source(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_carries_kind_backend_and_code() {
        let e = Error::new(ErrorKind::Backend, "no memory").with_backend("ucx").with_code(-4);
        assert_eq!(e.to_string(), "backend error [ucx]: no memory (status -4)");
        assert_eq!(e.code(), Some(-4));
        assert!(!e.is_retryable());
        assert!(Error::new(ErrorKind::Timeout, "x").is_retryable());
    }

    #[test]
    fn messages_and_quotes_are_bounded_and_context_is_not_doubled() {
        let long = "h".repeat(10 << 20);
        let e = Error::new(ErrorKind::Handshake, format!("connecting to {long}"));
        assert!(e.message().len() <= MAX_MESSAGE_LEN + 3, "{}", e.message().len());
        let q = quote(&long);
        assert!(q.len() < 100 && q.ends_with("(10485760 bytes)"), "{q}");
        assert_eq!(quote("a\"b"), "\"a\\\"b\"");
        let e = Error::new(ErrorKind::Handshake, "refused").context("with engine p");
        assert_eq!(e.to_string(), "handshake failed: with engine p: refused");
        assert_eq!(e.kind(), ErrorKind::Handshake);
        let cut = Error::new(ErrorKind::Io, "é".repeat(MAX_MESSAGE_LEN));
        assert!(cut.message().ends_with("..."), "cut on a char boundary");
    }
}
