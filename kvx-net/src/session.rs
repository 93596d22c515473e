//! The session layer of a kvx TCP connection: what the frames carry, and the optional
//! challenge-response that authenticates both ends with the deployment's [`AuthKey`].
//!
//! Each frame holds one kvx wire message ([`kvx_core::wire`]: magic, version, kind, MessagePack), a
//! [`SessionRequest`] from the client or a [`SessionReply`] from the server. Without a key:
//!
//! ```text
//! client: Request { body }          server: Reply { body, tag: None }     (repeat)
//! ```
//!
//! With a key (`c` and `s` are 16 random bytes each, fresh per connection):
//!
//! ```text
//! client: Hello { c }               server: Challenge { s }
//! client: Proof { tag: HMAC(key, HandshakeRequest, [c, s]), body }
//!                                   server: Reply { body', tag: HMAC(key, HandshakeReply, [c, s, body']) }
//! client: Request { body }          server: Reply { body, tag: None }     (repeat, same connection)
//! ```
//!
//! The server answers the first request only after the client proved the key over the server's
//! fresh challenge (so a proof recorded from another connection is worthless), and the client
//! returns the first reply only after checking the server's tag over its own fresh challenge and
//! that reply (so a server without the key, or a replayed reply, is refused). Later requests on
//! the connection ride on that authenticated TCP connection; kvx does not encrypt, so the key
//! keeps out peers that lack it, not an attacker on the path. A server with a key refuses a
//! client without one, a server without a key refuses a client that offers a challenge, and
//! either way the client fails with [`ErrorKind::Unauthenticated`].

use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;
use tokio::net::TcpStream;

use crate::frame::{FrameError, read_frame, write_frame};
use crate::{NetConfig, endpoint};
use kvx_core::auth::{AuthKey, Purpose, random_bytes};
use kvx_core::error::{Error, ErrorKind, Result, quote};
use kvx_core::wire::{self, MessageKind, WireMessage};

/// Bytes of a challenge.
pub const CHALLENGE_LEN: usize = 16;

/// A client's frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SessionRequest {
    /// Opens an authenticated session with the client's challenge.
    Hello {
        /// 16 random bytes.
        #[serde(with = "serde_bytes")]
        challenge: Vec<u8>,
    },
    /// Proves the key over both challenges, with the session's first request.
    Proof {
        /// `HMAC(key, HandshakeRequest, [client challenge, server challenge])`.
        #[serde(with = "serde_bytes")]
        tag: Vec<u8>,
        /// The request.
        #[serde(with = "serde_bytes")]
        body: Vec<u8>,
    },
    /// A request: on a server without a key, or after the proof on the same connection.
    Request {
        /// The request.
        #[serde(with = "serde_bytes")]
        body: Vec<u8>,
    },
}

impl WireMessage for SessionRequest {
    const KIND: MessageKind = MessageKind::SessionRequest;
}

/// Why a server refused a request (and closed the connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    /// Missing, unexpected or wrong authentication.
    Unauthenticated,
    /// The frame was not a message the server understands.
    Malformed,
    /// The service refused the request.
    Rejected,
}

/// A server's frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SessionReply {
    /// The server's challenge, answering a `Hello`.
    Challenge {
        /// 16 random bytes.
        #[serde(with = "serde_bytes")]
        challenge: Vec<u8>,
    },
    /// The answer to a request.
    Reply {
        /// The answer.
        #[serde(with = "serde_bytes")]
        body: Vec<u8>,
        /// On the first reply of an authenticated session,
        /// `HMAC(key, HandshakeReply, [client challenge, server challenge, body])`.
        #[serde(with = "serde_bytes")]
        tag: Option<Vec<u8>>,
    },
    /// The request is refused and the connection closes.
    Refused {
        /// Why.
        refusal: Refusal,
        /// The server's explanation.
        reason: String,
    },
}

impl WireMessage for SessionReply {
    const KIND: MessageKind = MessageKind::SessionReply;
}

/// What the server does with a frame, as [`ServerSession::on_frame`] decides.
#[derive(Debug)]
pub(crate) enum Step {
    /// Send this reply and wait for the next frame.
    Send(SessionReply),
    /// Hand the body to the service; with challenges (an authenticated session's first
    /// request), tag its answer over them.
    Call { body: Vec<u8>, tag_with: Option<([u8; CHALLENGE_LEN], [u8; CHALLENGE_LEN])> },
    /// Send this refusal and close.
    Refuse(Refusal, String),
}

impl Refusal {
    /// How a server refuses a request its service failed with `kind`: `Unauthenticated` as such,
    /// `Wire`, `InvalidPeerData` and `Incompatible` as malformed, any other kind as rejected.
    pub(crate) fn of(kind: ErrorKind) -> Refusal {
        match kind {
            ErrorKind::Unauthenticated => Refusal::Unauthenticated,
            ErrorKind::Wire | ErrorKind::InvalidPeerData | ErrorKind::Incompatible => Refusal::Malformed,
            _ => Refusal::Rejected,
        }
    }

    /// The kind of error the server's end reports for a connection it refused this way.
    fn kind(self) -> ErrorKind {
        match self {
            Refusal::Unauthenticated => ErrorKind::Unauthenticated,
            Refusal::Malformed => ErrorKind::InvalidPeerData,
            Refusal::Rejected => ErrorKind::Handshake,
        }
    }
}

/// The server's answer to a served request: `body`, tagged over both challenges on the first
/// reply of a keyed session (`tag_with`, from [`Step::Call`]).
pub(crate) fn served_reply(
    key: Option<&AuthKey>,
    body: Vec<u8>,
    tag_with: Option<([u8; CHALLENGE_LEN], [u8; CHALLENGE_LEN])>,
) -> SessionReply {
    let tag = match (key, tag_with) {
        (Some(key), Some((c, s))) => Some(key.tag(Purpose::HandshakeReply, &[&c, &s, &body]).to_vec()),
        _ => None,
    };
    SessionReply::Reply { body, tag }
}

/// The server's end of a session's opening, for a protocol that takes the connection over after
/// its first exchange (kvx-tcp's data connections; the client's end is [`Connection::request`]
/// then [`Connection::into_stream`]). Reads the client's frames (each at most `max_frame`
/// bytes, each within `exchange`), runs the challenge-response with `key`, and answers the first
/// request with the reply body `answer` makes of it (tagged over both challenges with a key).
/// Returns what `answer` returned beside the body, once the reply is written.
///
/// A frame the session refuses, or an error from `answer`, is sent to the client as a refusal
/// and returned (`Unauthenticated`; `InvalidPeerData` for a malformed frame; `Handshake` for a
/// rejected request, the service's message kept). Bound the whole opening with the handshake
/// deadline and the admission policy's eviction: this waits for as long as the client sends
/// nothing.
pub async fn accept_opening<T>(
    stream: &mut TcpStream,
    key: Option<AuthKey>,
    max_frame: usize,
    exchange: Duration,
    answer: impl FnOnce(Vec<u8>) -> Result<(Vec<u8>, T)>,
) -> Result<T> {
    let mut session = ServerSession::new(key.clone());
    let mut answer = Some(answer);
    let frame_error =
        |e: FrameError| Error::new(ErrorKind::Handshake, format!("session opening: {e}")).with_source(e);
    loop {
        let frame = read_frame(stream, max_frame, NO_LIMIT, exchange).await.map_err(frame_error)?;
        let (reply, outcome) = match session.on_frame(&frame) {
            Step::Send(reply) => (reply, None),
            Step::Refuse(refusal, reason) => {
                let e = Error::new(refusal.kind(), reason.clone());
                (SessionReply::Refused { refusal, reason }, Some(Err(e)))
            }
            Step::Call { body, tag_with } => match answer.take().map(|answer| answer(body)) {
                None => {
                    // Unreachable: a session's first call ends the opening.
                    let e = Error::new(ErrorKind::State, "a second request in a session opening");
                    (
                        SessionReply::Refused { refusal: Refusal::Rejected, reason: e.message().to_owned() },
                        Some(Err(e)),
                    )
                }
                Some(answered) => match answered {
                    Ok((body, value)) => (served_reply(key.as_ref(), body, tag_with), Some(Ok(value))),
                    Err(e) => {
                        let refusal = Refusal::of(e.kind());
                        let reply = SessionReply::Refused { refusal, reason: e.message().to_owned() };
                        (reply, Some(Err(e)))
                    }
                },
            },
        };
        write_frame(stream, &wire::encode(&reply)?, exchange).await.map_err(frame_error)?;
        if let Some(outcome) = outcome {
            return outcome;
        }
    }
}

/// The server's end of one connection's session.
#[derive(Debug)]
pub(crate) enum ServerSession {
    /// No key: requests go straight to the service.
    Open,
    /// Keyed, waiting for the client's `Hello`.
    AwaitHello(AuthKey),
    /// Keyed, the challenge sent, waiting for the proof.
    AwaitProof { key: AuthKey, client: [u8; CHALLENGE_LEN], server: [u8; CHALLENGE_LEN] },
    /// Keyed and proven.
    Authenticated,
}

impl ServerSession {
    pub(crate) fn new(key: Option<AuthKey>) -> Self {
        match key {
            Some(key) => ServerSession::AwaitHello(key),
            None => ServerSession::Open,
        }
    }

    /// The next step for a frame from the client.
    pub(crate) fn on_frame(&mut self, frame: &[u8]) -> Step {
        let msg = match wire::decode::<SessionRequest>(frame) {
            Ok(m) => m,
            Err(e) => return Step::Refuse(Refusal::Malformed, e.to_string()),
        };
        let state = std::mem::replace(self, ServerSession::Authenticated);
        let unauth = |why: &str| Step::Refuse(Refusal::Unauthenticated, why.to_owned());
        match (state, msg) {
            (ServerSession::Open, SessionRequest::Request { body }) => {
                *self = ServerSession::Open;
                Step::Call { body, tag_with: None }
            }
            (ServerSession::Open, _) => unauth("this server has no auth key; connect without one"),
            (ServerSession::AwaitHello(key), SessionRequest::Hello { challenge }) => {
                let Ok(client) = <[u8; CHALLENGE_LEN]>::try_from(challenge.as_slice()) else {
                    return Step::Refuse(Refusal::Malformed, "a challenge is 16 bytes".into());
                };
                let server = match random_bytes::<CHALLENGE_LEN>() {
                    Ok(s) => s,
                    Err(e) => return Step::Refuse(Refusal::Rejected, e.to_string()),
                };
                *self = ServerSession::AwaitProof { key, client, server };
                Step::Send(SessionReply::Challenge { challenge: server.to_vec() })
            }
            (ServerSession::AwaitHello(_), _) => unauth("this server requires authentication (an auth key)"),
            (ServerSession::AwaitProof { key, client, server }, SessionRequest::Proof { tag, body }) => {
                match key.verify(Purpose::HandshakeRequest, &[&client, &server], &tag) {
                    Ok(()) => Step::Call { body, tag_with: Some((client, server)) },
                    Err(_) => unauth("the client's proof does not verify (a different auth key?)"),
                }
            }
            (ServerSession::AwaitProof { .. }, _) => unauth("expected the client's proof"),
            (ServerSession::Authenticated, SessionRequest::Request { body }) => {
                Step::Call { body, tag_with: None }
            }
            (ServerSession::Authenticated, _) => {
                Step::Refuse(Refusal::Malformed, "the session is already authenticated".into())
            }
        }
    }
}

/// The client's end of a kvx connection: one request at a time, each answered. The first request
/// on a connection with a key runs the challenge-response. Bound calls with a timeout (the
/// connection waits for as long as the peer does not answer).
pub struct Connection {
    stream: TcpStream,
    peer: String,
    key: Option<AuthKey>,
    max_frame: usize,
    authenticated: bool,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection").field("peer", &self.peer).finish_non_exhaustive()
    }
}

/// Writes and reads are bounded by the caller's timeout; within it, frames get all the time.
const NO_LIMIT: Duration = Duration::from_secs(365 * 24 * 3600);

impl Connection {
    /// Connects to `host:port`. A refused or unreachable peer fails now, with `Handshake`.
    pub async fn connect(host: &str, port: u16, config: &NetConfig) -> Result<Self> {
        let peer = endpoint(host, port);
        let stream = TcpStream::connect((host, port)).await.map_err(|e| {
            Error::new(ErrorKind::Handshake, format!("connecting to {peer}: {e}")).with_source(e)
        })?;
        // Each frame is one write; nothing is gained by delaying it.
        let _ = stream.set_nodelay(true);
        Ok(Connection {
            stream,
            peer,
            key: config.auth_key.clone(),
            max_frame: config.limits.max_frame,
            authenticated: false,
        })
    }

    /// The peer, as `host:port`.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Hands the connection's socket over, for a protocol that takes the connection over after
    /// its first exchange (the server's end is [`accept_opening`]). After a successful
    /// [`request`](Self::request) both ends are proven (with a key) and no session frame is left
    /// unread.
    pub fn into_stream(self) -> TcpStream {
        self.stream
    }

    /// Sends `body` and returns the answer (at most `max_frame` bytes, checked before it is read).
    pub async fn request(&mut self, body: Vec<u8>) -> Result<Vec<u8>> {
        match self.key.clone() {
            Some(key) if !self.authenticated => {
                let reply = self.authenticate(&key, body).await?;
                self.authenticated = true;
                Ok(reply)
            }
            _ => match self.exchange(&SessionRequest::Request { body }).await? {
                SessionReply::Reply { body, tag: None } => Ok(body),
                SessionReply::Reply { tag: Some(_), .. } if self.key.is_none() => {
                    Err(self.unauthenticated("answered as an authenticated server; this end has no key"))
                }
                other => Err(self.unexpected(other)),
            },
        }
    }

    async fn authenticate(&mut self, key: &AuthKey, body: Vec<u8>) -> Result<Vec<u8>> {
        let client = random_bytes::<CHALLENGE_LEN>()?;
        let server = match self.exchange(&SessionRequest::Hello { challenge: client.to_vec() }).await? {
            SessionReply::Challenge { challenge } => <[u8; CHALLENGE_LEN]>::try_from(challenge.as_slice())
                .map_err(|_| self.unauthenticated("sent a challenge that is not 16 bytes"))?,
            SessionReply::Reply { .. } => {
                return Err(self.unauthenticated("answered without authenticating (it has no auth key)"));
            }
            other => return Err(self.unexpected(other)),
        };
        let tag = key.tag(Purpose::HandshakeRequest, &[&client, &server]).to_vec();
        match self.exchange(&SessionRequest::Proof { tag, body }).await? {
            SessionReply::Reply { body, tag: Some(tag) } => {
                key.verify(Purpose::HandshakeReply, &[&client, &server, &body], &tag).map_err(|_| {
                    self.unauthenticated("the reply's tag does not verify (a different auth key?)")
                })?;
                Ok(body)
            }
            SessionReply::Reply { tag: None, .. } => Err(self.unauthenticated("sent an untagged reply")),
            other => Err(self.unexpected(other)),
        }
    }

    async fn exchange(&mut self, msg: &SessionRequest) -> Result<SessionReply> {
        let frame = wire::encode(msg)?;
        write_frame(&mut self.stream, &frame, NO_LIMIT).await.map_err(|e| self.frame_error("sending", e))?;
        let reply = read_frame(&mut self.stream, self.max_frame, NO_LIMIT, NO_LIMIT)
            .await
            .map_err(|e| self.frame_error("receiving", e))?;
        wire::decode::<SessionReply>(&reply).map_err(|e| {
            let kind = if e.kind() == ErrorKind::Incompatible { e.kind() } else { ErrorKind::Handshake };
            Error::new(
                kind,
                format!("{} sent a frame that is not a kvx reply: {}", self.peer, quote(e.message())),
            )
        })
    }

    /// Whether `e`, from [`request`](Self::request), says the server dropped the connection
    /// without answering (closed, reset, cut mid-frame): what a server making room for a newcomer
    /// does to a connection that has not been served. A request that is safe to repeat can be
    /// sent again on a new connection.
    pub fn dropped_unanswered(e: &Error) -> bool {
        let frame = std::error::Error::source(e).and_then(|s| s.downcast_ref::<FrameError>());
        match frame {
            Some(FrameError::Closed | FrameError::Truncated { .. }) => true,
            Some(FrameError::Io(io)) => matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            ),
            _ => false,
        }
    }

    fn frame_error(&self, what: &str, e: FrameError) -> Error {
        let msg = match &e {
            FrameError::Closed => format!("{} closed the connection without a reply", self.peer),
            _ => format!("{what} from {}: {e}", self.peer),
        };
        Error::new(ErrorKind::Handshake, msg).with_source(e)
    }

    fn unauthenticated(&self, why: &str) -> Error {
        Error::new(ErrorKind::Unauthenticated, format!("{} {why}", self.peer))
    }

    fn unexpected(&self, reply: SessionReply) -> Error {
        match reply {
            SessionReply::Refused { refusal: Refusal::Unauthenticated, reason } => {
                self.unauthenticated(&format!("refused: {}", quote(&reason)))
            }
            // The server did not understand what this end sent: another kvx version, or a
            // request it does not take (retrying it will not help).
            SessionReply::Refused { refusal: Refusal::Malformed, reason } => Error::new(
                ErrorKind::Incompatible,
                format!("{} refused the request as malformed: {}", self.peer, quote(&reason)),
            ),
            SessionReply::Refused { refusal: Refusal::Rejected, reason } => Error::new(
                ErrorKind::Handshake,
                format!("{} refused the request: {}", self.peer, quote(&reason)),
            ),
            SessionReply::Challenge { .. } => {
                self.unauthenticated("asked for authentication; this end has no auth key")
            }
            SessionReply::Reply { .. } => {
                Error::new(ErrorKind::Handshake, format!("{} sent an unexpected reply", self.peer))
            }
        }
    }
}
