#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod backend;
mod bench;
mod demo;
mod discovery;
mod roles;
mod soak;
mod summary;
mod workload;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

use summary::Summary;

/// kvx: move LLM KV-cache blocks between a prefill and a decode engine.
#[derive(Debug, Parser)]
#[command(name = "kvx", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A prefill engine and a decode engine in one process; every moved byte is checked.
    Demo(demo::DemoArgs),
    /// The prefill engine as its own process: serves prompts to a `kvx decode` process.
    Prefill(roles::PrefillArgs),
    /// The decode engine as its own process: sends prompts to `kvx prefill`, loads their KV.
    Decode(roles::DecodeArgs),
    /// An OpenAI-compatible HTTP router in front of vLLM prefill and decode servers: each
    /// completion goes to a prefill server, then with its KV to a decode server.
    Router(kvx_router::RouterArgs),
    /// READ bandwidth of scattered blocks per backend, transport and block size, each beside a
    /// baseline measured in the same run (memcpy of the same blocks; a TCP stream over TCP).
    Bench(bench::BenchArgs),
    /// The deterministic fault soak: engines, requests and a seeded schedule of faults, in
    /// simulated time; fails when a request never ends, a byte is wrong or a block leaks.
    Soak(soak::SoakArgs),
}

fn main() -> ExitCode {
    // `kvx bench` starts this binary again as a READ target or a TCP baseline's sender.
    if let Some(outcome) = bench::serve_child_role() {
        return outcome.map_or_else(
            |e| {
                eprintln!("kvx: {e}");
                ExitCode::from(2)
            },
            |()| ExitCode::SUCCESS,
        );
    }
    let cli = Cli::parse();
    let outcome = match &cli.command {
        Command::Demo(args) => demo::run(args).map(report),
        Command::Prefill(args) => roles::prefill(args).map(report),
        Command::Decode(args) => roles::decode(args).map(report),
        Command::Router(args) => kvx_router::run(args).map(|()| ExitCode::SUCCESS),
        Command::Bench(args) => bench::run(args).map(|()| ExitCode::SUCCESS),
        Command::Soak(args) => soak::run(args),
    };
    outcome.unwrap_or_else(|e| {
        eprintln!("kvx: {e}");
        ExitCode::from(2)
    })
}

/// Prints a run's summary; failure when a request failed, a byte was wrong or a block leaked.
fn report(summary: Summary) -> ExitCode {
    print!("{summary}");
    for e in summary.errors() {
        eprintln!("kvx: {e}");
    }
    if summary.is_correct() {
        ExitCode::SUCCESS
    } else {
        eprintln!("kvx: FAILED: failed requests, wrong bytes or leaked blocks");
        ExitCode::FAILURE
    }
}
