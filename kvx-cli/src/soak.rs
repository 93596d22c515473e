//! `kvx soak`: the deterministic fault soak (`kvx_testkit::soak`) from the command line, on any
//! backend (the chaos layer injects the transport's faults into each).

use clap::Args;
use std::process::ExitCode;
use std::time::Instant;

use kvx_core::Result;
use kvx_testkit::soak::{FaultRates, SoakConfig, run_soak_on};

use crate::backend::Backend;
use crate::workload::Mode;

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
    /// Transfer backend: the engines' agents, in the chaos layer. Loopback replays a seed exactly;
    /// over a real transport the READs take real time and a replay may differ in what completes
    /// when, never in what must be zero.
    #[arg(long, value_enum, default_value_t = Backend::Loopback)]
    backend: Backend,
    /// How the KV moves: READs by the decode engine (pull) or WRITEs by the prefill engine
    /// (push: both legs of a request go out at its arrival).
    #[arg(long, value_enum, default_value_t = Mode::Pull)]
    mode: Mode,
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
    config.mode = args.mode.transfer_mode();
    let backend = args.backend.sim_backend(false, &kvx_tcp::TcpConfig::default())?;
    let start = Instant::now();
    let report = run_soak_on(&config, &backend)?;
    let wall = start.elapsed();
    print!("{report}");
    let mut flags = if args.no_faults { " --no-faults".to_owned() } else { String::new() };
    if args.backend != Backend::Loopback {
        flags += &format!(" --backend {}", args.backend.name());
    }
    if args.mode != Mode::Pull {
        flags += &format!(" --mode {}", args.mode.name());
    }
    println!(
        "  {:<22} kvx soak --requests {} --seed {} --prefills {} --decodes {}{flags}",
        "replay", args.requests, args.seed, config.prefills, config.decodes
    );
    eprintln!(
        "kvx soak: {} backend, {} mode, wall time {:.3} s ({:.0} requests/s, {:.0}x simulated time)",
        args.backend.name(),
        args.mode.name(),
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
