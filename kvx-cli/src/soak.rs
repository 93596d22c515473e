//! `kvx soak`: the deterministic fault soak (`kvx_testkit::soak`) from the command line.

use clap::Args;
use std::process::ExitCode;
use std::time::Instant;

use kvx_core::Result;
use kvx_testkit::soak::{FaultRates, SoakConfig, run_soak};

/// Options of `kvx soak`.
#[derive(Debug, Args)]
pub(crate) struct SoakArgs {
    /// Requests to run.
    #[arg(long, default_value_t = 2000)]
    requests: u64,
    /// The seed of the workload and of every fault: the same seed replays the same run.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Prefill engines.
    #[arg(long, default_value_t = 2)]
    prefills: usize,
    /// Decode engines.
    #[arg(long, default_value_t = 2)]
    decodes: usize,
    /// Inject no faults (the soak's own sanity check: every request must finish).
    #[arg(long)]
    no_faults: bool,
}

/// Runs the soak, prints its report (the wall time goes to stderr, so that two runs of a seed
/// print the same), and fails when a must-be-zero figure is not zero.
pub(crate) fn run(args: &SoakArgs) -> Result<ExitCode> {
    let mut config = SoakConfig::new(args.requests, args.seed);
    config.prefills = args.prefills.max(1);
    config.decodes = args.decodes.max(1);
    if args.no_faults {
        config.faults = FaultRates::none();
    }
    let start = Instant::now();
    let report = run_soak(&config)?;
    let wall = start.elapsed();
    print!("{report}");
    let flags = if args.no_faults { " --no-faults" } else { "" };
    println!(
        "  {:<22} kvx soak --requests {} --seed {} --prefills {} --decodes {}{flags}",
        "replay", args.requests, args.seed, config.prefills, config.decodes
    );
    eprintln!(
        "kvx soak: wall time {:.3} s ({:.0} requests/s, {:.0}x simulated time)",
        wall.as_secs_f64(),
        args.requests as f64 / wall.as_secs_f64().max(1e-9),
        report.virtual_time.as_secs_f64() / wall.as_secs_f64().max(1e-9)
    );
    if report.is_clean() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("kvx soak: FAILED: {} not 0", report.violations().join(", "));
        Ok(ExitCode::FAILURE)
    }
}
