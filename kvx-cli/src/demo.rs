//! `kvx demo`: prefill engines and decode engines in one process, a router between them.

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::time::{Duration, Instant};

use kvx_core::Result;
use kvx_testkit::sim::{Cluster, EngineConfig, InProcessSideChannels, RequestState, SimEngine};

use crate::backend::Backend;
use crate::roles::AuthArgs;
use crate::summary::Summary;
use crate::workload::{Mode, ModelArgs, WorkloadArgs};

/// The most engines of each kind (each has its own pool, runtime and agents).
const MAX_ENGINES: i64 = 16;

/// Options of `kvx demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Transfer backend.
    #[arg(long, value_enum, default_value_t = Backend::Loopback)]
    backend: Backend,
    /// Prefill engines; each request goes to the one with the fewest outstanding requests.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_ENGINES))]
    prefill_engines: u32,
    /// Decode engines; each prefill engine's params go to the one with the fewest outstanding
    /// requests.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_ENGINES))]
    decode_engines: u32,
    /// Tensor-parallel ranks of each prefill engine (default: `--tp`); with `--decode-tp`, the
    /// engines' TP sizes may differ.
    #[arg(long, conflicts_with = "tp", value_parser = clap::value_parser!(u32).range(1..))]
    prefill_tp: Option<u32>,
    /// Tensor-parallel ranks of each decode engine (default: `--tp`).
    #[arg(long, conflicts_with = "tp", value_parser = clap::value_parser!(u32).range(1..))]
    decode_tp: Option<u32>,
    /// How the KV moves: READs by the decode engine (pull) or WRITEs by the prefill engine
    /// (push: the router sends both legs of a request at once).
    #[arg(long, value_enum, default_value_t = Mode::Pull)]
    mode: Mode,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    auth: AuthArgs,
}

/// Runs the demo and returns its summary.
pub(crate) fn run(args: &DemoArgs) -> Result<Summary> {
    let backend = args.backend.sim_backend(false, &kvx_tcp::TcpConfig::default())?;
    let (p, d) = (args.prefill_engines, args.decode_engines);
    let tps = (args.prefill_tp.unwrap_or(args.model.tp), args.decode_tp.unwrap_or(args.model.tp));
    let shape = if (p, d) == (1, 1) { String::new() } else { format!("engines: {p} prefill, {d} decode, ") };
    let model = match tps {
        (pt, dt) if pt == dt => args.model.describe_with(&format!("TP={pt}")),
        (pt, dt) => args.model.describe_with(&format!("TP={pt} prefill, TP={dt} decode")),
    };
    println!("kvx demo: {} backend, {} mode, {shape}{model}", args.backend.name(), args.mode.name());
    let net = InProcessSideChannels::new();
    let auth_key = args.auth.key()?;
    let engine = |id: String, tp: u32| {
        let config = EngineConfig {
            auth_key: auth_key.clone(),
            ..EngineConfig::new(&id, tp, args.model.blocks, args.model.model(), &net)
        };
        SimEngine::new(config, &backend)
    };
    // `prefill` and `decode` when alone, `prefill-0`, `prefill-1`, ... otherwise.
    let engines = |role: &str, n: u32, tp: u32| -> Result<Vec<SimEngine>> {
        (0..n).map(|i| engine(if n == 1 { role.to_owned() } else { format!("{role}-{i}") }, tp)).collect()
    };
    let mut cluster = Cluster::xpyd(engines("prefill", p, tps.0)?, engines("decode", d, tps.1)?)?
        .with_mode(args.mode.transfer_mode());
    let prompts = args.workload.prompts();
    let bar = ProgressBar::new(prompts.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {bar:40} {pos}/{len} requests {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    for (id, prompt) in prompts {
        cluster.submit(id, prompt, args.workload.max_new_tokens)?;
    }
    cluster.run_until_idle_with(Duration::from_secs(args.workload.timeout), |c| {
        bar.set_position(c.decodes.iter().map(|e| e.stats().finished + e.stats().failed).sum());
    })?;
    bar.finish_and_clear();
    // Why requests failed, on stderr: the first of them (the summary counts all).
    let failure = cluster.decodes.iter_mut().flat_map(SimEngine::take_ended).find_map(|r| match r.state {
        RequestState::Failed(why) => Some((r.id, why)),
        _ => None,
    });
    if let Some((id, why)) = failure {
        eprintln!("kvx demo: request {id} failed: {why}");
    }
    let mut summary = Summary::of_engines(&cluster.decodes, args.workload.requests, start.elapsed());
    for prefill in &cluster.prefills {
        summary.check(prefill);
        summary.add_written(prefill);
    }
    if (p, d) != (1, 1) {
        summary.set_served(cluster.engines());
    }
    Ok(summary)
}
