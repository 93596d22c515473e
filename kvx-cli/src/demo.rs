//! `kvx demo`: prefill engines and decode engines in one process, a router between them.

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::time::{Duration, Instant};

use kvx_core::Result;
use kvx_testkit::sim::{Cluster, EngineConfig, InProcessSideChannels, SimEngine};

use crate::backend::Backend;
use crate::roles::AuthArgs;
use crate::summary::Summary;
use crate::workload::{ModelArgs, WorkloadArgs};

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
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    auth: AuthArgs,
}

/// Runs the demo and returns its summary.
pub(crate) fn run(args: &DemoArgs) -> Result<Summary> {
    let backend = args.backend.sim_backend(false)?;
    let (p, d) = (args.prefill_engines, args.decode_engines);
    let shape = if (p, d) == (1, 1) { String::new() } else { format!("engines: {p} prefill, {d} decode, ") };
    println!("kvx demo: {} backend, {shape}{}", args.backend.name(), args.model.describe());
    let net = InProcessSideChannels::new();
    let auth_key = args.auth.key()?;
    let engine = |id: String| {
        let config = EngineConfig {
            auth_key: auth_key.clone(),
            ..EngineConfig::new(&id, args.model.tp, args.model.blocks, args.model.model(), &net)
        };
        SimEngine::new(config, &backend)
    };
    // `prefill` and `decode` when alone, `prefill-0`, `prefill-1`, ... otherwise.
    let engines = |role: &str, n: u32| -> Result<Vec<SimEngine>> {
        (0..n).map(|i| engine(if n == 1 { role.to_owned() } else { format!("{role}-{i}") })).collect()
    };
    let mut cluster = Cluster::xpyd(engines("prefill", p)?, engines("decode", d)?)?;
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
    let mut summary = Summary::of_engines(&cluster.decodes, args.workload.requests, start.elapsed());
    for prefill in &cluster.prefills {
        summary.check(prefill);
    }
    if (p, d) != (1, 1) {
        summary.set_served(cluster.engines());
    }
    Ok(summary)
}
