//! kvx's TCP framing, as a server reads a connection.

use std::cell::RefCell;
use std::time::Duration;

use kvx_core::wire;
use kvx_net::MetadataRequest;
use kvx_net::frame::{FrameError, HEADER_LEN, read_frame};
use kvx_net::session::SessionRequest;

use super::fixture::must;
use crate::seeds::Seed;

/// The largest frame the target's reader accepts.
const MAX_FRAME: usize = 4096;

thread_local! {
    static RUNTIME: RefCell<Option<tokio::runtime::Runtime>> = const { RefCell::new(None) };
}

/// Runs `f` on this thread's current-thread runtime (with a clock, for the frame timeouts).
fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    RUNTIME.with(|rt| {
        let mut rt = rt.borrow_mut();
        let rt = rt.get_or_insert_with(|| {
            let built = tokio::runtime::Builder::new_current_thread().enable_time().build();
            must(built.map_err(|e| kvx_core::Error::new(kvx_core::ErrorKind::Io, e.to_string())), "a runtime")
        });
        rt.block_on(f)
    })
}

/// The bytes as a connection's stream: frames read one after another with
/// `net::frame::read_frame` (limit 4 KiB) until the stream ends or a frame is refused, each
/// body decoded as the `SessionRequest` a server expects. A frame is never longer than the limit,
/// the frames never take more bytes than arrived, and an in-memory stream never times out.
pub fn net_frames(data: &[u8]) {
    block_on(async {
        let mut stream = data;
        let mut consumed = 0usize;
        loop {
            let second = Duration::from_secs(1);
            match read_frame(&mut stream, MAX_FRAME, second, second).await {
                Ok(body) => {
                    assert!(
                        body.len() <= MAX_FRAME,
                        "a frame of {} bytes passed a {MAX_FRAME}-byte limit",
                        body.len()
                    );
                    consumed += HEADER_LEN + body.len();
                    assert!(consumed <= data.len(), "frames of {consumed} bytes out of {}", data.len());
                    let _ = wire::decode::<SessionRequest>(&body);
                }
                Err(FrameError::Closed | FrameError::Oversize { .. } | FrameError::Truncated { .. }) => break,
                Err(e) => panic!("reading frames from memory failed: {e}"),
            }
        }
    });
}

fn frame(body: &[u8]) -> Vec<u8> {
    [&(body.len() as u32).to_be_bytes()[..], body].concat()
}

/// Seeds: frames of real session requests, one after another, and broken frames.
pub(crate) fn net_frames_seeds() -> Vec<Seed> {
    let request = must(wire::encode(&MetadataRequest {}), "encoding");
    let requests: Vec<Vec<u8>> = [
        SessionRequest::Request { body: request.clone() },
        SessionRequest::Hello { challenge: vec![0x11; 16] },
        SessionRequest::Proof { tag: vec![0x22; 32], body: request },
    ]
    .iter()
    .map(|r| must(wire::encode(r), "encoding"))
    .collect();
    let all: Vec<u8> = requests.iter().flat_map(|r| frame(r)).collect();
    vec![
        Seed::new("one-request", frame(&requests[0])),
        Seed::new(
            "hello-proof-request",
            [frame(&requests[1]), frame(&requests[2]), frame(&requests[0])].concat(),
        ),
        Seed::new("empty-frame", frame(&[])),
        Seed::new("hostile-header-only", 16u32.to_be_bytes()),
        Seed::new("hostile-oversize-header", [&u32::MAX.to_be_bytes()[..], &[0; 8]].concat()),
        Seed::new("hostile-just-over-the-limit", frame(&[0; MAX_FRAME + 1])),
        Seed::new("hostile-truncated-body", &all[..all.len() - 3]),
        Seed::new("hostile-short-header", [0, 0]),
    ]
}
