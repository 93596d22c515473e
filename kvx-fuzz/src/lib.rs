#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
// Targets exist to panic on a broken invariant: `assert!` and `panic!` are their failure reports.

pub mod engine;
pub mod input;
pub mod seeds;
pub mod targets;

use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvx_core::wire::WireMessage;

pub use engine::{Report, RunConfig};
pub use seeds::Seed;

/// The native library a target needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Native {
    /// Nothing beyond Rust.
    None,
    /// Debian's UCX, through kvx-ucx (cargo feature `ucx`).
    Ucx,
    /// The NIXL wheel, through kvx-nixl (cargo feature `nixl`).
    Nixl,
}

/// Whether a target can run in this build, on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    /// It can.
    Ready,
    /// This build lacks the cargo feature it needs (named).
    NotBuilt(&'static str),
    /// Its library is built in but does not load or work here: why.
    Unavailable(String),
}

/// One fuzz target: a decoder of peer or client bytes, the seeds it starts from and the tokens
/// its mutations may insert.
pub struct Target {
    /// Its name: the corpus directory, the `KVX_FUZZ_TARGETS` and command-line name.
    pub name: &'static str,
    /// What it feeds the bytes to.
    pub about: String,
    /// The target itself. It must not panic, whatever the bytes.
    pub run: fn(&[u8]),
    seeds: Box<dyn Fn() -> Vec<Seed> + Send + Sync>,
    /// Tokens the mutator inserts (field names, magic strings, JSON keywords).
    pub dict: Vec<Vec<u8>>,
    /// The native library it needs.
    pub native: Native,
    /// A format nested in its input that mutations also work inside.
    pub nest: Option<seeds::Nest>,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("name", &self.name)
            .field("native", &self.native)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// A target that needs nothing native and has no dictionary.
    pub fn new(
        name: &'static str,
        about: impl Into<String>,
        run: fn(&[u8]),
        seeds: impl Fn() -> Vec<Seed> + Send + Sync + 'static,
    ) -> Self {
        Target {
            name,
            about: about.into(),
            run,
            seeds: Box::new(seeds),
            dict: Vec::new(),
            native: Native::None,
            nest: None,
        }
    }

    /// The wire envelope of message type `T` ([`targets::wire_envelope`]), seeded with `samples`
    /// encoded and hostile variants of them.
    pub fn wire<T: WireMessage + PartialEq + fmt::Debug + 'static>(
        name: &'static str,
        samples: fn() -> Vec<(&'static str, T)>,
    ) -> Self {
        let about = format!("the wire envelope of {} (wire::decode)", std::any::type_name::<T>());
        Target::new(name, about, targets::wire_envelope::<T>, move || targets::wire_type_seeds(samples))
            .with_dict(dict::msgpack())
            .with_nest(seeds::ENVELOPE_BODY)
    }

    /// With a nested format that mutations also work inside.
    pub fn with_nest(mut self, nest: seeds::Nest) -> Self {
        self.nest = Some(nest);
        self
    }

    /// With a dictionary.
    pub fn with_dict(mut self, dict: Vec<Vec<u8>>) -> Self {
        self.dict = dict;
        self
    }

    /// Needing a native library.
    pub fn with_native(mut self, native: Native) -> Self {
        self.native = native;
        self
    }

    /// The seeds it starts from, made now (some from live agents and workers).
    pub fn seeds(&self) -> Vec<Seed> {
        (self.seeds)()
    }

    /// Whether it can run here. Call it on the thread that runs the target: native fixtures are
    /// made per thread.
    pub fn availability(&self) -> Availability {
        let result = match self.native {
            Native::None => return Availability::Ready,
            Native::Ucx if !cfg!(feature = "ucx") => return Availability::NotBuilt("ucx"),
            Native::Nixl if !cfg!(feature = "nixl") => return Availability::NotBuilt("nixl"),
            Native::Ucx => targets::ucx_available(),
            Native::Nixl => targets::nixl_available(),
        };
        match result {
            Ok(()) => Availability::Ready,
            Err(why) => Availability::Unavailable(why),
        }
    }

    /// Whether a run must fail rather than skip when the library is unavailable:
    /// `KVX_REQUIRE_NIXL=1` for NIXL (as scripts/test.sh sets), `KVX_REQUIRE_UCX=1` for UCX.
    pub fn library_required(&self) -> bool {
        let var = match self.native {
            Native::None => return false,
            Native::Ucx => "KVX_REQUIRE_UCX",
            Native::Nixl => "KVX_REQUIRE_NIXL",
        };
        std::env::var(var).as_deref() == Ok("1")
    }
}

/// Every target.
pub fn targets() -> Vec<Target> {
    targets::all()
}

/// What happened to one target of [`run_targets`].
#[derive(Debug, Clone)]
pub enum Outcome {
    /// It ran.
    Ran(Report),
    /// It could not run here.
    Skipped {
        /// The target.
        target: &'static str,
        /// Why.
        why: Availability,
        /// Whether the environment requires its library (the skip is a failure).
        required: bool,
    },
}

impl Outcome {
    /// Whether this outcome fails a run: a panic, or a required library missing.
    pub fn failed(&self) -> bool {
        match self {
            Outcome::Ran(report) => report.failure.is_some(),
            Outcome::Skipped { why: Availability::Unavailable(_), required, .. } => *required,
            Outcome::Skipped { .. } => false,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Ran(report) => report.fmt(f),
            Outcome::Skipped { target, why: Availability::NotBuilt(feature), .. } => {
                write!(f, "{target:<26} not built: `cargo test -p kvx-fuzz --features {feature}` runs it")
            }
            Outcome::Skipped { target, why: Availability::Unavailable(why), required } => {
                let verdict = if *required { "FAILED (its library is required here)" } else { "SKIPPED" };
                write!(f, "{target:<26} {verdict}: its library is unavailable: {why}")
            }
            Outcome::Skipped { target, why: Availability::Ready, .. } => write!(f, "{target:<26} skipped"),
        }
    }
}

/// Runs the selected targets of `all` on `threads` threads (each target on one thread, start to
/// end), calling `done` as each finishes. Outcomes come back in `all`'s order.
pub fn run_targets(
    all: Vec<Target>,
    config: &RunConfig,
    threads: usize,
    done: impl Fn(&Outcome) + Sync,
) -> Vec<Outcome> {
    let selected: Vec<Target> = all.into_iter().filter(|t| config.selects(t.name)).collect();
    let next = AtomicUsize::new(0);
    let outcomes: Mutex<Vec<Option<Outcome>>> = Mutex::new(vec![None; selected.len()]);
    std::thread::scope(|scope| {
        for i in 0..threads.clamp(1, selected.len().max(1)) {
            let (selected, next, outcomes, done) = (&selected, &next, &outcomes, &done);
            let spawned =
                std::thread::Builder::new().name(format!("kvx-fuzz-{i}")).spawn_scoped(scope, move || {
                    loop {
                        let at = next.fetch_add(1, Ordering::Relaxed);
                        let Some(target) = selected.get(at) else { break };
                        let outcome = match target.availability() {
                            Availability::Ready => Outcome::Ran(engine::fuzz(target, config)),
                            why => Outcome::Skipped {
                                target: target.name,
                                why,
                                required: target.library_required(),
                            },
                        };
                        done(&outcome);
                        if let Ok(mut all) = outcomes.lock() {
                            all[at] = Some(outcome);
                        }
                    }
                });
            if let Err(e) = spawned {
                panic!("spawning a fuzz thread: {e}");
            }
        }
    });
    outcomes.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().flatten().collect()
}

/// Dictionaries of the formats the targets decode.
pub mod dict {
    /// MessagePack strings of kvx's wire field names and kinds, and its magic.
    pub fn msgpack() -> Vec<Vec<u8>> {
        let words = [
            "KVX1",
            "magic",
            "version",
            "kind",
            "body",
            "Handshake",
            "ConnectorMetadata",
            "FinishedReport",
            "MetadataRequest",
            "HoldRelease",
            "HoldStatus",
            "RenewLeases",
            "engine_id",
            "rank",
            "world_size",
            "agent_name",
            "agent_metadata",
            "region_bases",
            "num_blocks",
            "block_len",
            "compat_hash",
            "reqs_to_recv",
            "reqs_to_send",
            "request_id",
            "remote_request_id",
            "local_block_ids",
            "remote_block_ids",
            "remote",
            "host",
            "port",
            "finished",
            "sending",
            "recving",
            "failed_recving",
            "reason",
            "prefill",
            "decode",
            "instance",
            "nonce",
            "mac",
            "reply_to",
            "engine",
            "held",
            "holds",
            "heartbeats",
            "first",
            "ids",
        ];
        let mut dict: Vec<Vec<u8>> = words.iter().filter_map(|w| rmp_serde::to_vec(w).ok()).collect();
        dict.extend([
            vec![0xc0],
            vec![0xc3],
            vec![0xdd, 0xff, 0xff, 0xff, 0xff],
            vec![0xc6, 0xff, 0xff, 0xff, 0xff],
        ]);
        dict
    }

    /// JSON keywords and vLLM's `kv_transfer_params` keys.
    pub fn json() -> Vec<Vec<u8>> {
        [
            "null",
            "true",
            "false",
            "[]",
            "{}",
            "[[",
            "]]",
            "\"\"",
            ",",
            ":",
            "\"do_remote_prefill\":true,",
            "\"do_remote_decode\":true,",
            "\"remote_block_ids\":",
            "\"kvx_group_first\":[",
            "\"remote_engine_id\":\"prefill-0\",",
            "\"remote_request_id\":\"cmpl-1-0\",",
            "\"remote_host\":\"10.0.0.1\",",
            "\"remote_port\":5600,",
            "[[1,2],[3]]",
            "\\u0000",
            "\\ud800",
            "1e400",
            "-1",
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect()
    }

    /// Agent metadata's keys and values: the envelope's, and each backend's body's.
    pub fn agent_metadata() -> Vec<Vec<u8>> {
        [
            "backend",
            "version",
            "agent",
            "body",
            "loopback",
            "ucx",
            "nixl",
            "fabric",
            "instance",
            "regions",
            "id",
            "addr",
            "len",
            "worker_address",
            "rkey",
            "kind",
            "device",
            "Dram",
            "Vram",
        ]
        .iter()
        .filter_map(|w| rmp_serde::to_vec(w).ok())
        .collect()
    }
}
