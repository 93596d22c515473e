//! `kvx demo`: a prefill engine and a decode engine in one process.

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::time::{Duration, Instant};

use kvx_core::Result;
use kvx_testkit::sim::{Cluster, EngineConfig, InProcessSideChannels, SimEngine};

use crate::backend::Backend;
use crate::roles::AuthArgs;
use crate::summary::Summary;
use crate::workload::{ModelArgs, WorkloadArgs};

/// Options of `kvx demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Transfer backend.
    #[arg(long, value_enum, default_value_t = Backend::Loopback)]
    backend: Backend,
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
    println!("kvx demo: {} backend, {}", args.backend.name(), args.model.describe());
    let net = InProcessSideChannels::new();
    let auth_key = args.auth.key()?;
    let engine = |id: &str| {
        let config = EngineConfig {
            auth_key: auth_key.clone(),
            ..EngineConfig::new(id, args.model.tp, args.model.blocks, args.model.model(), &net)
        };
        SimEngine::new(config, &backend)
    };
    let mut cluster = Cluster::new(vec![engine("prefill")?], engine("decode")?)?;
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
        let s = c.decodes[0].stats();
        bar.set_position(s.finished + s.failed);
    })?;
    bar.finish_and_clear();
    let mut summary = Summary::of_engine(&cluster.decodes[0], args.workload.requests, start.elapsed());
    for prefill in &cluster.prefills {
        summary.check(prefill);
    }
    Ok(summary)
}
