//! Each backend's agent metadata, through its public entry point `TransferAgent::load_remote`
//! (the body decoders are private to their crates): kvx-core's envelope
//! (`kvx_core::wire::agent_metadata`), then the backend's body, which the engine also mutates
//! inside the envelope (`seeds::AGENT_METADATA_BODY`).
//!
//! Each target keeps, per thread, an agent that loads and a peer whose metadata the seeds are,
//! so mutations of live metadata get past the checks that need a live peer. After a load that
//! succeeds, the target prepares a descriptor list over the peer's real memory and forgets the
//! peer, which must work.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use kvx_core::{BlockList, DlistOwner, HostMemory, KvMemory, MemKind, TransferAgent};

use super::fixture::must;
use crate::seeds::{Seed, agent_metadata_hostile};

/// An agent that loads peers, and the metadata of the peers it may load.
struct LoadFixture {
    loader: Box<dyn TransferAgent>,
    /// The peer's registered memory, for a descriptor list.
    peer_memory: kvx_core::MemRegion,
    /// Live metadata: the peer's, the loader's own, and others the backend offers.
    seeds: Vec<Seed>,
    /// The peers (alive, so their metadata stays current), progressed after every load as
    /// their engines would.
    peers: Vec<Box<dyn TransferAgent>>,
    /// Keeps the rest alive (memory, a fabric).
    _keep: Vec<Box<dyn std::any::Any>>,
}

impl LoadFixture {
    /// Lets every agent finish what a load started (UCX: endpoint wire-up and close).
    fn progress(&self) {
        let _ = self.loader.progress();
        for peer in &self.peers {
            let _ = peer.progress();
        }
    }
}

/// Loads `data` with the fixture's loader; on success prepares a list over the peer's memory
/// (which may fail: the metadata need not describe it) and forgets the peer (which must work).
fn load(fixture: &LoadFixture, data: &[u8]) {
    let name = match fixture.loader.load_remote(data) {
        Ok(name) => name,
        Err(_) => {
            fixture.progress();
            return;
        }
    };
    let list = BlockList {
        kind: MemKind::Dram,
        device: 0,
        bases: vec![fixture.peer_memory.addr],
        num_blocks: 4,
        block_len: fixture.peer_memory.len / 4,
    };
    let _ = fixture.loader.prep_dlist(&DlistOwner::Remote(name.clone()), &list);
    if let Err(e) = fixture.loader.forget_remote(&name) {
        panic!("a peer that loaded ({name}) cannot be forgotten: {e}");
    }
    fixture.progress();
}

fn seeds_of(fixture: &LoadFixture) -> Vec<Seed> {
    let mut seeds = fixture.seeds.clone();
    if let Some(first) = fixture.seeds.first() {
        seeds.extend(agent_metadata_hostile(&first.bytes));
    }
    seeds
}

fn host_memory(len: usize) -> Arc<HostMemory> {
    Arc::new(must(HostMemory::new(len), "host memory"))
}

// --- loopback ------------------------------------------------------------------------------

thread_local! {
    static LOOPBACK: RefCell<Option<Rc<LoadFixture>>> = const { RefCell::new(None) };
}

fn loopback_fixture() -> Rc<LoadFixture> {
    LOOPBACK.with(|f| {
        f.borrow_mut()
            .get_or_insert_with(|| {
                let fabric = kvx_loopback::Fabric::new();
                let loader = must(fabric.agent("loader"), "loader");
                let peer = must(fabric.agent("peer"), "peer");
                let memory = host_memory(4096);
                must(peer.register(memory.clone()), "registering");
                must(peer.register(host_memory(64)), "registering");
                let gone = {
                    let gone = must(fabric.agent("gone"), "a short-lived agent");
                    must(gone.register(host_memory(64)), "registering");
                    must(gone.local_metadata(), "metadata")
                };
                let elsewhere = {
                    let other = kvx_loopback::Fabric::new();
                    let agent = must(other.agent("peer"), "an agent on another fabric");
                    must(agent.local_metadata(), "metadata")
                };
                let seeds = vec![
                    Seed::new("live-peer", must(peer.local_metadata(), "metadata")),
                    Seed::new("own-metadata", must(loader.local_metadata(), "metadata")),
                    Seed::new("hostile-stale-peer", gone),
                    Seed::new("hostile-other-fabric", elsewhere),
                ];
                Rc::new(LoadFixture {
                    loader: Box::new(loader),
                    peer_memory: memory.region(),
                    seeds,
                    peers: vec![Box::new(peer)],
                    _keep: vec![Box::new(fabric), Box::new(memory)],
                })
            })
            .clone()
    })
}

/// kvx-loopback's agent metadata, loaded by a loopback agent.
pub fn loopback_metadata(data: &[u8]) {
    load(&loopback_fixture(), data);
}

pub(crate) fn loopback_metadata_seeds() -> Vec<Seed> {
    seeds_of(&loopback_fixture())
}

// --- UCX -----------------------------------------------------------------------------------

#[cfg(feature = "ucx")]
mod ucx {
    use super::*;
    use kvx_core::wire::agent_metadata;
    use kvx_ucx::{UcxAgent, UcxConfig};
    use serde::Deserialize;

    /// The UCX agents, and the worker addresses and rkeys they made.
    pub(super) struct UcxFixture {
        pub(super) load: LoadFixture,
        live: Vec<Blobs>,
    }

    /// One agent's worker address and packed rkeys.
    struct Blobs {
        address: Vec<u8>,
        rkeys: Vec<Vec<u8>>,
    }

    /// The blobs of kvx-ucx's metadata body (`kvx_ucx::wire::AgentMetadata`, private), opened
    /// as kvx-ucx opens it, its other keys skipped: whatever kvx-ucx decodes has this shape. Used
    /// only to keep foreign worker addresses and rkeys away from UCX: `ucp_ep_create` and
    /// `ucp_ep_rkey_unpack` take no length and abort the process on malformed bytes (UCX 1.13's
    /// `ucp_address_unpack` calls `ucs_fatal_error`). Fuzzing them is fuzzing UCX; kvx's part is
    /// everything around them.
    #[derive(Deserialize)]
    struct Shape {
        #[serde(with = "serde_bytes")]
        worker_address: Vec<u8>,
        regions: Vec<RegionShape>,
    }

    #[derive(Deserialize)]
    struct RegionShape {
        #[serde(with = "serde_bytes")]
        rkey: Vec<u8>,
    }

    fn shape(data: &[u8]) -> kvx_core::Result<Shape> {
        agent_metadata::open::<Shape>("ucx", data).map(|opened| opened.body)
    }

    impl UcxFixture {
        /// Whether UCX's own parsers would see only bytes a live agent made: then kvx-ucx's
        /// decoder and checks run on `data`. Bytes that do not have the shape are refused by
        /// kvx-ucx's decoder before UCX sees them.
        pub(super) fn safe_for_ucx(&self, data: &[u8]) -> bool {
            match shape(data) {
                Err(_) => true,
                Ok(s) => self.live.iter().any(|b| {
                    b.address == s.worker_address && s.regions.iter().all(|r| b.rkeys.contains(&r.rkey))
                }),
            }
        }
    }

    thread_local! {
        static UCX: RefCell<Option<Rc<UcxFixture>>> = const { RefCell::new(None) };
    }

    /// Shared memory and loopback transports only: a peer's address cannot send UCX to dial
    /// other hosts.
    fn config() -> UcxConfig {
        UcxConfig::default().with_transports("sm,self")
    }

    pub(super) fn fixture() -> kvx_core::Result<Rc<UcxFixture>> {
        UCX.with(|f| {
            if let Some(existing) = f.borrow().as_ref() {
                return Ok(existing.clone());
            }
            let loader = UcxAgent::with_config("fuzz-loader", &config())?;
            let peer = UcxAgent::with_config("fuzz-peer", &config())?;
            let memory = host_memory(4096);
            peer.register(memory.clone())?;
            peer.register(host_memory(64))?;
            let tcp_peer =
                UcxAgent::with_config("fuzz-tcp-peer", &UcxConfig::default().with_transports("tcp"))?;
            tcp_peer.register(host_memory(64))?;
            let seeds = vec![
                Seed::new("live-peer", peer.local_metadata()?),
                Seed::new("own-metadata", loader.local_metadata()?),
                Seed::new("tcp-peer", tcp_peer.local_metadata()?),
            ];
            let mut live = Vec::new();
            for seed in &seeds {
                match shape(&seed.bytes) {
                    Ok(s) => live.push(Blobs {
                        address: s.worker_address,
                        rkeys: s.regions.into_iter().map(|r| r.rkey).collect(),
                    }),
                    Err(e) => panic!(
                        "kvx-fuzz's copy of kvx-ucx's metadata shape is out of date ({e}): update `Shape` \
                         in kvx-fuzz/src/targets/backends.rs"
                    ),
                }
            }
            let load = LoadFixture {
                loader: Box::new(loader),
                peer_memory: memory.region(),
                seeds,
                peers: vec![Box::new(peer), Box::new(tcp_peer)],
                _keep: vec![Box::new(memory)],
            };
            let fixture = Rc::new(UcxFixture { load, live });
            *f.borrow_mut() = Some(fixture.clone());
            Ok(fixture)
        })
    }
}

/// kvx-ucx's agent metadata (a worker address and packed rkeys), loaded by a UCX agent. Inputs
/// whose worker address or rkeys are not ones a live agent made are not loaded (see `Shape`):
/// UCX itself aborts on malformed ones.
pub fn ucx_metadata(data: &[u8]) {
    #[cfg(feature = "ucx")]
    {
        let fixture = must(ucx::fixture(), "UCX agents");
        if fixture.safe_for_ucx(data) {
            load(&fixture.load, data);
        }
    }
    #[cfg(not(feature = "ucx"))]
    let _ = data;
}

pub(crate) fn ucx_metadata_seeds() -> Vec<Seed> {
    #[cfg(feature = "ucx")]
    return seeds_of(&must(ucx::fixture(), "UCX agents").load);
    #[cfg(not(feature = "ucx"))]
    Vec::new()
}

/// Whether UCX agents can be made here.
pub(crate) fn ucx_available() -> Result<(), String> {
    #[cfg(feature = "ucx")]
    return ucx::fixture().map(|_| ()).map_err(|e| e.to_string());
    #[cfg(not(feature = "ucx"))]
    Ok(())
}

// --- NIXL ----------------------------------------------------------------------------------

#[cfg(feature = "nixl")]
mod nixl {
    use super::*;
    use kvx_core::wire::agent_metadata;
    use kvx_nixl::{NixlAgent, NixlConfig};
    use serde::Deserialize;

    /// The NIXL agents, and the NIXL blobs they made.
    pub(super) struct NixlFixture {
        pub(super) load: LoadFixture,
        live: Vec<Vec<u8>>,
    }

    /// NIXL's blob in kvx-nixl's metadata body (`kvx_nixl::metadata::AgentMetadata`, private),
    /// opened as kvx-nixl opens it, its other keys skipped: whatever kvx-nixl decodes has this
    /// shape. Used only to keep foreign NIXL blobs away from NIXL: the blob carries UCX worker
    /// addresses, which NIXL hands to its bundled UCX, and a malformed one aborts the process
    /// there (`address.c: Assertion *addr_version == UCP_OBJECT_VERSION_V2 failed`, found by this
    /// target).
    #[derive(Deserialize)]
    struct Shape {
        #[serde(with = "serde_bytes")]
        nixl: Vec<u8>,
    }

    fn shape(data: &[u8]) -> kvx_core::Result<Shape> {
        agent_metadata::open::<Shape>("nixl", data).map(|opened| opened.body)
    }

    impl NixlFixture {
        /// Whether NIXL would see only a blob a live agent made: then kvx-nixl's decoder and
        /// checks run on `data`. Bytes without the shape are refused by kvx-nixl's decoder before
        /// NIXL sees them.
        pub(super) fn safe_for_nixl(&self, data: &[u8]) -> bool {
            match shape(data) {
                Err(_) => true,
                Ok(s) => self.live.contains(&s.nixl),
            }
        }
    }

    thread_local! {
        static NIXL: RefCell<Option<Rc<NixlFixture>>> = const { RefCell::new(None) };
    }

    pub(super) fn fixture() -> kvx_core::Result<Rc<NixlFixture>> {
        NIXL.with(|f| {
            if let Some(existing) = f.borrow().as_ref() {
                return Ok(existing.clone());
            }
            kvx_nixl::check_library()?;
            let loader = NixlAgent::new("fuzz-loader", &NixlConfig::default())?;
            let peer = NixlAgent::new("fuzz-peer", &NixlConfig::default())?;
            let memory = host_memory(4096);
            peer.register(memory.clone())?;
            let seeds = vec![
                Seed::new("live-peer", peer.local_metadata()?),
                Seed::new("own-metadata", loader.local_metadata()?),
            ];
            let mut live = Vec::new();
            for seed in &seeds {
                match shape(&seed.bytes) {
                    Ok(s) => live.push(s.nixl),
                    Err(e) => panic!(
                        "kvx-fuzz's copy of kvx-nixl's metadata shape is out of date ({e}): update `Shape` \
                         in kvx-fuzz/src/targets/backends.rs"
                    ),
                }
            }
            let load = LoadFixture {
                loader: Box::new(loader),
                peer_memory: memory.region(),
                seeds,
                peers: vec![Box::new(peer)],
                _keep: vec![Box::new(memory)],
            };
            let fixture = Rc::new(NixlFixture { load, live });
            *f.borrow_mut() = Some(fixture.clone());
            Ok(fixture)
        })
    }
}

/// kvx-nixl's agent metadata (NIXL's own blob and the agent's regions), loaded by a NIXL agent.
/// Inputs whose NIXL blob is not one a live agent made are not loaded (see `Shape`): NIXL's UCX
/// aborts on malformed addresses inside it.
pub fn nixl_metadata(data: &[u8]) {
    #[cfg(feature = "nixl")]
    {
        let fixture = must(nixl::fixture(), "NIXL agents");
        if fixture.safe_for_nixl(data) {
            load(&fixture.load, data);
        }
    }
    #[cfg(not(feature = "nixl"))]
    let _ = data;
}

pub(crate) fn nixl_metadata_seeds() -> Vec<Seed> {
    #[cfg(feature = "nixl")]
    return seeds_of(&must(nixl::fixture(), "NIXL agents").load);
    #[cfg(not(feature = "nixl"))]
    Vec::new()
}

/// Whether the NIXL library loads and agents can be made here.
pub(crate) fn nixl_available() -> Result<(), String> {
    #[cfg(feature = "nixl")]
    return nixl::fixture().map(|_| ()).map_err(|e| e.to_string());
    #[cfg(not(feature = "nixl"))]
    Ok(())
}
