//! The one public error type of kvx.
//!
//! Backends keep their own status codes inside ([`Error::code`]) and say which backend they are
//! ([`Error::backend`]); callers branch on [`ErrorKind`] and [`Error::is_retryable`].

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Result with kvx's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What kind of failure an [`Error`] is. New kinds may be added.
///
/// On the wire (an [`Error`] inside a rank's report) a kind travels by its name: a new kind is a
/// change of the wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
///
/// Errors compare equal when kind, message, backend and code are equal (the source is not
/// compared). Cloning shares the source. Serialized (in a rank's report of failed loads), an error
/// keeps kind, message, backend and code, not the source; deserialized, its message and backend
/// name are cut to [`MAX_MESSAGE_LEN`] and [`MAX_BACKEND_LEN`] bytes, whatever the peer sent.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(from = "WireError", into = "WireError")]
pub struct Error {
    kind: ErrorKind,
    message: String,
    backend: Option<Cow<'static, str>>,
    code: Option<i64>,
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        if let Some(backend) = &self.backend {
            write!(f, " [{backend}]")?;
        }
        write!(f, ": {}", self.message)?;
        if let Some(code) = self.code {
            write!(f, " (status {code})")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|s| s as &(dyn std::error::Error + 'static))
    }
}

impl PartialEq for Error {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind
            && self.message == other.message
            && self.backend == other.backend
            && self.code == other.code
    }
}

impl Eq for Error {}

/// An [`Error`] as it crosses the wire.
#[derive(Serialize, Deserialize)]
struct WireError {
    kind: ErrorKind,
    message: String,
    backend: Option<String>,
    code: Option<i64>,
}

impl From<Error> for WireError {
    fn from(e: Error) -> Self {
        WireError { kind: e.kind, message: e.message, backend: e.backend.map(Cow::into_owned), code: e.code }
    }
}

impl From<WireError> for Error {
    fn from(w: WireError) -> Self {
        Error {
            kind: w.kind,
            message: truncate(w.message, MAX_MESSAGE_LEN),
            backend: w.backend.map(|b| Cow::Owned(truncate(b, MAX_BACKEND_LEN))),
            code: w.code,
            source: None,
        }
    }
}

/// The longest message an [`Error`] keeps, in bytes: whatever a peer sent, an error stays small.
pub const MAX_MESSAGE_LEN: usize = 1024;

/// The longest backend name an [`Error`] read from the wire keeps, in bytes.
pub const MAX_BACKEND_LEN: usize = 32;

/// The most characters of peer or client data that [`quote`] keeps.
pub const MAX_QUOTE_CHARS: usize = 64;

/// Quotes peer or client data for a message: escaped as Rust's `Debug` does, cut after
/// [`MAX_QUOTE_CHARS`] characters with the full length said.
pub fn quote(data: &str) -> String {
    let mut chars = data.chars();
    let head: String = chars.by_ref().take(MAX_QUOTE_CHARS).collect();
    if chars.next().is_none() { format!("{head:?}") } else { format!("{head:?}... ({} bytes)", data.len()) }
}

/// `message` cut to at most `max` bytes (on a character boundary), with `...` added when cut.
fn truncate(mut message: String, max: usize) -> String {
    if message.len() > max {
        let mut end = max;
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
        Error {
            kind,
            message: truncate(message.into(), MAX_MESSAGE_LEN),
            backend: None,
            code: None,
            source: None,
        }
    }

    /// The same error with `what` before its message: the kind, backend, code and source stay,
    /// so the kind is not repeated in the text (`handshake failed: with engine e: ...`).
    pub fn context(self, what: impl fmt::Display) -> Self {
        Error { message: truncate(format!("{what}: {}", self.message), MAX_MESSAGE_LEN), ..self }
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
        self.backend = Some(Cow::Borrowed(backend));
        self
    }

    /// Keeps the backend's raw status code.
    pub fn with_code(mut self, code: i64) -> Self {
        self.code = Some(code);
        self
    }

    /// Attaches the underlying cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
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
    pub fn backend(&self) -> Option<&str> {
        self.backend.as_deref()
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

    #[test]
    fn errors_compare_by_kind_message_backend_and_code_and_clone_with_their_source() {
        let io = std::io::Error::other("disk");
        let e = Error::new(ErrorKind::Transfer, "lost").with_backend("ucx").with_code(-25).with_source(io);
        let copy = e.clone();
        assert_eq!(copy, e);
        assert!(std::error::Error::source(&copy).is_some(), "a clone shares the source");
        assert_eq!(Error::new(ErrorKind::Transfer, "lost").with_backend("ucx").with_code(-25), e);
        assert_ne!(Error::new(ErrorKind::Transfer, "lost").with_backend("ucx"), e, "the code differs");
        assert_ne!(Error::new(ErrorKind::Backend, "lost").with_backend("ucx").with_code(-25), e);
    }

    #[test]
    fn the_wire_form_keeps_kind_message_backend_and_code_and_is_bounded() {
        let e = Error::new(ErrorKind::Transfer, "peer gone").with_backend("nixl").with_code(-3);
        let bytes = rmp_serde::to_vec_named(&e).unwrap();
        let back: Error = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back, e);
        assert_eq!((back.kind(), back.backend(), back.code()), (ErrorKind::Transfer, Some("nixl"), Some(-3)));
        assert_eq!(back.to_string(), "transfer failed [nixl]: peer gone (status -3)");

        let hostile = WireError {
            kind: ErrorKind::Io,
            message: "m".repeat(1 << 20),
            backend: Some("b".repeat(1 << 16)),
            code: None,
        };
        let back: Error = rmp_serde::from_slice(&rmp_serde::to_vec_named(&hostile).unwrap()).unwrap();
        assert!(back.message().len() <= MAX_MESSAGE_LEN + 3);
        assert!(back.backend().is_some_and(|b| b.len() <= MAX_BACKEND_LEN + 3));
        let unknown = br#"{"kind":"NoSuchKind","message":"x","backend":null,"code":null}"#;
        assert!(serde_json::from_slice::<Error>(unknown).is_err(), "an unknown kind is refused");
    }
}
