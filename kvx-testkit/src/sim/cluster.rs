//! [`Cluster`]: prefill engines, one decode engine and the router between them.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvx_core::{Error, ErrorKind, RequestId, Result, TransferParams};

use super::engine::SimEngine;

/// A request a client hands the decode engine: id, prompt, tokens to generate, params.
pub type ClientRequest = (RequestId, Vec<u32>, usize, TransferParams);

/// What a client does with a prefill engine's params before the decode engine gets them: the
/// requests it submits instead (for tests of hostile clients: forged, replayed or edited params).
pub type ClientHook = Box<dyn FnMut(ClientRequest) -> Vec<ClientRequest> + Send>;

/// Prefill engines feeding one decode engine through a router, as a disaggregated deployment
/// runs: a request goes to a prefill engine (round robin) with `do_remote_decode`; when that
/// engine hands back its params, the router submits the request with them to the decode engine.
pub struct Cluster {
    /// The prefill engines.
    pub prefills: Vec<SimEngine>,
    /// The decode engine.
    pub decode: SimEngine,
    /// Requests not yet handed to the decode engine: prompt and tokens to generate.
    in_prefill: HashMap<RequestId, (Vec<u32>, usize)>,
    next_prefill: usize,
    client: Option<ClientHook>,
}

impl Cluster {
    /// A cluster of at least one prefill engine and a decode engine.
    pub fn new(prefills: Vec<SimEngine>, decode: SimEngine) -> Result<Self> {
        if prefills.is_empty() {
            return Err(Error::invalid_argument("a cluster needs a prefill engine"));
        }
        Ok(Cluster { prefills, decode, in_prefill: HashMap::new(), next_prefill: 0, client: None })
    }

    /// Routes every prefill engine's params through `hook` (a client between the engines): the
    /// decode engine gets the requests it returns.
    pub fn with_client(
        mut self,
        hook: impl FnMut(ClientRequest) -> Vec<ClientRequest> + Send + 'static,
    ) -> Self {
        self.client = Some(Box::new(hook));
        self
    }

    /// Sends a request to the next prefill engine; the decode engine generates `max_new_tokens`.
    pub fn submit(&mut self, id: RequestId, prompt: Vec<u32>, max_new_tokens: usize) -> Result<()> {
        let n = self.prefills.len();
        let engine = &mut self.prefills[self.next_prefill % n];
        self.next_prefill += 1;
        let params = TransferParams { do_remote_decode: true, ..Default::default() };
        engine.add_request(id.clone(), &prompt, 1, Some(params))?;
        self.in_prefill.insert(id, (prompt, max_new_tokens));
        Ok(())
    }

    /// Steps every engine once and routes finished prefills to the decode engine.
    pub fn step(&mut self) -> Result<()> {
        for engine in &mut self.prefills {
            engine.step()?;
            for (id, params) in engine.take_transfer_params() {
                let Some((prompt, max_new_tokens)) = self.in_prefill.remove(&id) else {
                    return Err(Error::new(ErrorKind::State, format!("params for unknown request {id}")));
                };
                let request = (id, prompt, max_new_tokens, params);
                let requests = match &mut self.client {
                    Some(hook) => hook(request),
                    None => vec![request],
                };
                for (id, prompt, max_new_tokens, params) in requests {
                    self.decode.add_request(id, &prompt, max_new_tokens, Some(params))?;
                }
            }
        }
        self.decode.step()
    }

    /// Whether every request went through and every engine is idle.
    pub fn is_idle(&self) -> bool {
        self.in_prefill.is_empty() && self.decode.is_idle() && self.prefills.iter().all(SimEngine::is_idle)
    }

    /// Steps until idle, calling `on_step` after each step; a `Timeout` error after `limit`.
    /// Yields the thread between steps, so that handshakes on the engines' runtimes go on.
    pub fn run_until_idle_with(&mut self, limit: Duration, mut on_step: impl FnMut(&Cluster)) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            self.step()?;
            on_step(self);
            if self.is_idle() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("cluster not idle after {limit:?}: {self:?}"),
                ));
            }
            std::thread::yield_now();
        }
    }

    /// Steps until idle; a `Timeout` error after `limit`.
    pub fn run_until_idle(&mut self, limit: Duration) -> Result<()> {
        self.run_until_idle_with(limit, |_| {})
    }

    /// Blocks not free in any engine's pool (0 once idle, unless something leaked).
    pub fn blocks_in_use(&self) -> usize {
        self.prefills
            .iter()
            .chain([&self.decode])
            .map(|e| e.pool().num_blocks() as usize - e.pool().num_free())
            .sum()
    }
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("prefills", &self.prefills)
            .field("decode", &self.decode)
            .field("in_prefill", &self.in_prefill.len())
            .field("client", &self.client.is_some())
            .finish()
    }
}
