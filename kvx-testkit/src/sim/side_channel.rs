//! Side channels for simulated engines: an in-process registry, and real TCP side channels
//! (`kvx_net::SideChannel`) on consecutive ports.
//!
//! A scheduler hands decode engines one base port; rank `r` of the prefill engine serves its
//! payload on `base + r`. Both kinds bind all of an engine's ranks at once on consecutive ports.

use async_trait::async_trait;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

use kvx_core::{Clock, Endpoint, Error, ErrorKind, MetadataExchange, PeerLocator, Result};
use kvx_net::{NetConfig, SideChannel};

use super::model::mix;
use super::rng::SimRng;

/// One side channel per rank of an engine, on `base_port + rank`.
#[derive(Debug)]
pub struct BoundSideChannels {
    /// The port of rank 0.
    pub base_port: u16,
    /// One side channel per rank.
    pub ranks: Vec<Arc<dyn MetadataExchange>>,
    /// The same side channels, over TCP (for their servers' counters); empty in-process.
    pub tcp: Vec<Arc<SideChannel>>,
}

/// Seeded faults of an in-process side channel's fetches, each fetch struck independently: it
/// is refused, answered late, or never answered (it then fails with `Timeout` once its timeout
/// has passed). A fetch's fate is a function of the seed, the two addresses and how many fetches
/// went between them before, not of the order fetches between other addresses interleave. Time is `clock`'s: a simulation's manual clock makes late answers and timeouts
/// cost no wall time. A late or silent fetch completes only when polled after its time, as a
/// driver with [`Handshakes::OnStepThread`](kvx_net::Handshakes) does at every call.
#[derive(Debug, Clone)]
pub struct HandshakeFaults {
    /// The time of late answers and timeouts.
    pub clock: Arc<dyn Clock>,
    /// The seed of the chances.
    pub seed: u64,
    /// Chance that a fetch is refused (`Handshake`).
    pub refuse: f64,
    /// Chance that a fetch is answered late, after up to `max_delay`.
    pub delay: f64,
    /// The longest late answer.
    pub max_delay: Duration,
    /// Chance that a fetch is never answered.
    pub silent: f64,
}

/// Fetches the faults struck, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandshakeFaultCounts {
    /// Fetches refused.
    pub refused: u64,
    /// Fetches answered late.
    pub delayed: u64,
    /// Fetches never answered.
    pub silent: u64,
}

/// An in-process side-channel "network": a map from `host:port` to the payload served there.
/// Engines of one test share it (cheap to clone; clones are the same registry).
#[derive(Debug, Clone, Default)]
pub struct InProcessSideChannels {
    registry: Arc<Mutex<Registry>>,
}

#[derive(Debug, Default)]
struct Registry {
    /// What each bound address serves.
    served: HashMap<(String, u16), Served>,
    next_port: u16,
    next_binding: u64,
    faults: Option<HandshakeFaults>,
    counts: HandshakeFaultCounts,
    /// Fetches so far, and between each pair of addresses (from, to).
    fetches: u64,
    attempts: HashMap<Pair, u64>,
    /// Late and silent fetches not yet complete, by fetch number: when each completes.
    waiting: BTreeMap<u64, Instant>,
}

/// The addresses a fetch goes from and to.
type Pair = ((String, u16), (String, u16));

/// One bound address.
#[derive(Debug)]
struct Served {
    /// Which binding of the address this is (a later one, after a restart, is another).
    binding: u64,
    /// `None` until published.
    payload: Option<Vec<u8>>,
}

/// What becomes of one fetch.
enum Fate {
    Answer,
    Refuse,
    AnswerAt(u64, Instant),
    TimeOutAt(u64, Instant),
}

impl InProcessSideChannels {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty registry whose fetches meet `faults`.
    pub fn with_faults(faults: HandshakeFaults) -> Self {
        let channels = Self::default();
        if let Ok(mut reg) = channels.registry.lock() {
            reg.faults = Some(faults);
        }
        channels
    }

    /// Binds `ranks` consecutive ports on `host`, after every port bound so far.
    pub fn bind(&self, host: &str, ranks: u32) -> Result<BoundSideChannels> {
        let base = self.lock()?.next_port.max(1);
        self.bind_at(host, base, ranks)
    }

    /// Binds `ranks` consecutive ports on `host` from `base`: a restarted engine takes the ports of
    /// the engine it replaces, once that one is dropped (an engine's ports are unbound when its
    /// side channels are dropped). A port still bound is an `Io` error, as with TCP.
    pub fn bind_at(&self, host: &str, base: u16, ranks: u32) -> Result<BoundSideChannels> {
        let mut reg = self.lock()?;
        let end = u32::from(base) + ranks;
        let end = u16::try_from(end).map_err(|_| Error::new(ErrorKind::Io, "in-process ports exhausted"))?;
        if let Some(port) = (base..end).find(|&p| reg.served.contains_key(&(host.to_owned(), p))) {
            return Err(Error::new(ErrorKind::Io, format!("in-process address {host}:{port} is in use")));
        }
        reg.next_port = reg.next_port.max(end);
        let mut out = Vec::with_capacity(ranks as usize);
        for port in base..end {
            reg.next_binding += 1;
            let binding = reg.next_binding;
            reg.served.insert((host.to_owned(), port), Served { binding, payload: None });
            out.push(Arc::new(InProcessSideChannel {
                channels: self.clone(),
                host: host.to_owned(),
                port,
                binding,
            }) as Arc<dyn MetadataExchange>);
        }
        Ok(BoundSideChannels { base_port: base, ranks: out, tcp: Vec::new() })
    }

    /// The faults struck so far.
    pub fn fault_counts(&self) -> Result<HandshakeFaultCounts> {
        Ok(self.lock()?.counts)
    }

    /// When the first late or silent fetch completes; `None` when none waits. A simulation on a
    /// manual clock may jump to it.
    pub fn next_event(&self) -> Result<Option<Instant>> {
        Ok(self.lock()?.waiting.values().min().copied())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Registry>> {
        self.registry.lock().map_err(|_| Error::new(ErrorKind::State, "side-channel registry lock poisoned"))
    }

    fn fate(&self, from: (&str, u16), to: (&str, u16), timeout: Duration) -> Result<Fate> {
        let mut reg = self.lock()?;
        reg.fetches += 1;
        let n = reg.fetches;
        let pair = ((from.0.to_owned(), from.1), (to.0.to_owned(), to.1));
        let attempt = reg.attempts.entry(pair).or_insert(0);
        *attempt += 1;
        let key = [from.0.as_bytes(), &from.1.to_le_bytes(), to.0.as_bytes(), &to.1.to_le_bytes()]
            .iter()
            .fold(*attempt, |h, part| {
                part.iter().fold(mix(h, part.len() as u64), |h, &b| mix(h, u64::from(b)))
            });
        let Some(f) = &reg.faults else { return Ok(Fate::Answer) };
        let mut rng = SimRng::stream(f.seed, key);
        let (refused, delayed, silent) = (rng.chance(f.refuse), rng.chance(f.delay), rng.chance(f.silent));
        let now = f.clock.now();
        let delay = rng.duration(Duration::ZERO, f.max_delay);
        let fate = if refused {
            reg.counts.refused += 1;
            Fate::Refuse
        } else if silent {
            reg.counts.silent += 1;
            Fate::TimeOutAt(n, now + timeout)
        } else if delayed {
            reg.counts.delayed += 1;
            Fate::AnswerAt(n, now + delay)
        } else {
            Fate::Answer
        };
        if let Fate::AnswerAt(n, at) | Fate::TimeOutAt(n, at) = fate {
            reg.waiting.insert(n, at);
        }
        Ok(fate)
    }

    fn answer(&self, host: &str, port: u16) -> Result<Vec<u8>> {
        match self.lock()?.served.get(&(host.to_owned(), port)) {
            Some(Served { payload: Some(payload), .. }) => Ok(payload.clone()),
            Some(Served { payload: None, .. }) => {
                Err(Error::new(ErrorKind::Handshake, format!("{host}:{port} has published nothing yet")))
            }
            None => Err(Error::new(ErrorKind::Handshake, format!("nothing listens at {host}:{port}"))),
        }
    }
}

/// One rank's end of [`InProcessSideChannels`]; dropping it unbinds its port.
#[derive(Debug)]
struct InProcessSideChannel {
    channels: InProcessSideChannels,
    host: String,
    port: u16,
    /// Which binding of the address this is (a later one, after a restart, is another).
    binding: u64,
}

impl Drop for InProcessSideChannel {
    fn drop(&mut self) {
        if let Ok(mut reg) = self.channels.lock() {
            let key = (self.host.clone(), self.port);
            if reg.served.get(&key).is_some_and(|s| s.binding == self.binding) {
                reg.served.remove(&key);
            }
        }
    }
}

#[async_trait]
impl MetadataExchange for InProcessSideChannel {
    async fn publish(&self, payload: Vec<u8>) -> Result<()> {
        match self.channels.lock()?.served.get_mut(&(self.host.clone(), self.port)) {
            Some(served) if served.binding == self.binding => {
                served.payload = Some(payload);
                Ok(())
            }
            _ => Err(Error::new(ErrorKind::State, format!("{}:{} is no longer bound", self.host, self.port))),
        }
    }

    async fn fetch(&self, peer: &PeerLocator, timeout: Duration) -> Result<Vec<u8>> {
        let Some(Endpoint { host, port }) = &peer.endpoint else {
            return Err(Error::invalid_argument(format!(
                "in-process side channels fetch from a host and port, and none was given for engine {}",
                peer.engine_id
            )));
        };
        let (host, port) = (host.as_str(), *port);
        match self.channels.fate((&self.host, self.port), (host, port), timeout)? {
            Fate::Answer => self.channels.answer(host, port),
            Fate::Refuse => Err(Error::new(
                ErrorKind::Handshake,
                format!("{host}:{port} refused the connection (injected fault)"),
            )),
            Fate::AnswerAt(n, at) => {
                Until { channels: &self.channels, fetch: n, at }.await?;
                self.channels.answer(host, port)
            }
            Fate::TimeOutAt(n, at) => {
                Until { channels: &self.channels, fetch: n, at }.await?;
                Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{host}:{port} did not answer within {timeout:?}"),
                ))
            }
        }
    }
}

/// Ready once the faults' clock reaches `at`; takes its fetch off the waiting list when it
/// completes or is dropped.
struct Until<'a> {
    channels: &'a InProcessSideChannels,
    fetch: u64,
    at: Instant,
}

impl Future for Until<'_> {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        let reg = self.channels.lock()?;
        let now = reg.faults.as_ref().map(|f| f.clock.now());
        if now.is_some_and(|now| now < self.at) { Poll::Pending } else { Poll::Ready(Ok(())) }
    }
}

impl Drop for Until<'_> {
    fn drop(&mut self) {
        if let Ok(mut reg) = self.channels.lock() {
            reg.waiting.remove(&self.fetch);
        }
    }
}

/// Binds real TCP side channels for `ranks` ranks on consecutive ports of `host` from `base_port`,
/// with `config`'s limits and key, served by `runtime` (multi-threaded). With `base_port` 0, rank 0
/// takes a free port from the OS; when a port after it is taken, all are dropped and another base
/// is tried (a bounded number of times). A given `base_port` is tried once (a restarted engine
/// binds the ports it had).
pub fn bind_tcp(
    runtime: &Handle,
    host: &str,
    base_port: u16,
    ranks: u32,
    config: &NetConfig,
) -> Result<BoundSideChannels> {
    let attempts = if base_port == 0 { 32 } else { 1 };
    let mut last = None;
    for _ in 0..attempts {
        let attempt = runtime.block_on(async {
            let first = Arc::new(SideChannel::bind_with(host, base_port, config.clone()).await?);
            let base = first.port();
            let mut tcp = vec![first];
            for r in 1..ranks {
                let port = u16::try_from(u32::from(base) + r)
                    .map_err(|_| Error::new(ErrorKind::Io, format!("port {base} + {r} overflows")))?;
                tcp.push(Arc::new(SideChannel::bind_with(host, port, config.clone()).await?));
            }
            let ranks = tcp.iter().map(|s| Arc::clone(s) as Arc<dyn MetadataExchange>).collect();
            Ok::<_, Error>(BoundSideChannels { base_port: base, ranks, tcp })
        });
        match attempt {
            Ok(b) => return Ok(b),
            Err(e) if e.kind() == ErrorKind::Io => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| Error::new(ErrorKind::Io, "no side-channel ports")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 0's worker at `host:port`.
    fn at(host: &str, port: u16) -> PeerLocator {
        PeerLocator { engine_id: "peer".into(), rank: 0, endpoint: Some(Endpoint::new(host, port)) }
    }

    #[test]
    fn in_process_channels_serve_what_each_rank_published() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let net = InProcessSideChannels::new();
        let a = net.bind("h", 2).unwrap();
        let b = net.bind("h", 1).unwrap();
        assert_eq!(b.base_port, a.base_port + 2);
        rt.block_on(async {
            let t = Duration::from_secs(1);
            let e = b.ranks[0].fetch(&at("h", a.base_port + 1), t).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Handshake);
            a.ranks[1].publish(b"one".to_vec()).await.unwrap();
            assert_eq!(b.ranks[0].fetch(&at("h", a.base_port + 1), t).await.unwrap(), b"one");
            assert!(b.ranks[0].fetch(&at("other", a.base_port + 1), t).await.is_err());
            let by_id = PeerLocator { endpoint: None, ..at("h", a.base_port + 1) };
            assert_eq!(b.ranks[0].fetch(&by_id, t).await.unwrap_err().kind(), ErrorKind::InvalidArgument);
        });
    }

    #[test]
    fn dropped_channels_unbind_and_a_restart_binds_the_same_ports() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let net = InProcessSideChannels::new();
        let a = net.bind("h", 2).unwrap();
        let other = net.bind("h", 1).unwrap();
        let base = a.base_port;
        assert_eq!(net.bind_at("h", base + 1, 1).unwrap_err().kind(), ErrorKind::Io, "still bound");
        drop(a);
        let t = Duration::from_secs(1);
        let e = rt.block_on(other.ranks[0].fetch(&at("h", base), t)).unwrap_err();
        assert!(e.to_string().contains("nothing listens"), "{e}");
        let again = net.bind_at("h", base, 2).unwrap();
        rt.block_on(again.ranks[0].publish(b"new".to_vec())).unwrap();
        assert_eq!(rt.block_on(other.ranks[0].fetch(&at("h", base), t)).unwrap(), b"new");
        assert_eq!(net.bind("h", 1).unwrap().base_port, other.base_port + 1, "fresh ports come after");
    }

    #[test]
    fn faulty_fetches_are_refused_late_or_silent_in_the_clock_s_time() {
        use kvx_core::ManualClock;
        use std::task::Waker;
        let clock = ManualClock::new();
        let faults = |refuse, delay, silent| HandshakeFaults {
            clock: Arc::new(clock.clone()),
            seed: 1,
            refuse,
            delay,
            max_delay: Duration::from_secs(2),
            silent,
        };
        let t = Duration::from_secs(5);
        let mut cx = Context::from_waker(Waker::noop());
        for (f, late, outcome) in [
            (faults(1.0, 0.0, 0.0), false, Some(ErrorKind::Handshake)),
            (faults(0.0, 1.0, 0.0), true, None),
            (faults(0.0, 0.0, 1.0), true, Some(ErrorKind::Timeout)),
        ] {
            let net = InProcessSideChannels::with_faults(f);
            let bound = net.bind("h", 1).unwrap();
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(bound.ranks[0].publish(b"p".to_vec())).unwrap();
            let peer = at("h", bound.base_port);
            let mut fetch = bound.ranks[0].fetch(&peer, t);
            let first = fetch.as_mut().poll(&mut cx);
            assert_eq!(first.is_pending(), late);
            if late {
                let at = net.next_event().unwrap().unwrap();
                assert!(at > clock.now() && at <= clock.now() + t);
                assert!(fetch.as_mut().poll(&mut cx).is_pending(), "the clock stands still");
                clock.advance_to(at);
            }
            let Poll::Ready(result) = (if late { fetch.as_mut().poll(&mut cx) } else { first }) else {
                panic!("not ready after its time")
            };
            assert_eq!(result.as_ref().err().map(Error::kind), outcome);
            assert_eq!(net.next_event().unwrap(), None);
            let c = net.fault_counts().unwrap();
            assert_eq!(c.refused + c.delayed + c.silent, 1);
        }
    }

    #[test]
    fn tcp_channels_bind_consecutive_ports() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let bound = bind_tcp(rt.handle(), "127.0.0.1", 0, 3, &NetConfig::default()).unwrap();
        assert_eq!(bound.ranks.len(), 3);
        rt.block_on(async {
            bound.ranks[2].publish(b"r2".to_vec()).await.unwrap();
            let got =
                bound.ranks[0].fetch(&at("127.0.0.1", bound.base_port + 2), Duration::from_secs(5)).await;
            assert_eq!(got.unwrap(), b"r2");
        });
    }

    #[test]
    fn tcp_channels_rebind_a_given_base_port() {
        let rt =
            || tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        // Between the release and the rebind another process (a parallel test) may take one of
        // the freed ports: then try again with other ports, at most 5 times.
        let (again, base, bound) = (0..5)
            .find_map(|_| {
                let first = rt();
                let base =
                    bind_tcp(first.handle(), "127.0.0.1", 0, 2, &NetConfig::default()).unwrap().base_port;
                // The runtime's shutdown drops the servers and their listeners.
                drop(first);
                let again = rt();
                let bound = bind_tcp(again.handle(), "127.0.0.1", base, 2, &NetConfig::default()).ok()?;
                Some((again, base, bound))
            })
            .expect("rebinding freed ports failed 5 times");
        assert_eq!(bound.base_port, base);
        let taken = bind_tcp(again.handle(), "127.0.0.1", base, 2, &NetConfig::default()).unwrap_err();
        assert_eq!(taken.kind(), ErrorKind::Io, "{taken}");
    }
}
