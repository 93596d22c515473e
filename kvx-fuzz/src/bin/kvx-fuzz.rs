//! `kvx-fuzz`: run the fuzz targets for longer than the test does, replay inputs, and write the
//! seed corpus. See the crate README.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use kvx_fuzz::engine::{self, RunConfig};
use kvx_fuzz::{Outcome, Target};

const USAGE: &str = "\
usage: kvx-fuzz list
       kvx-fuzz run [--secs S] [--iters N] [--seed S] [--threads N] [TARGET...]
       kvx-fuzz replay TARGET FILE...
       kvx-fuzz seed-corpus [TARGET...]

run        fuzz the targets (all by default): corpus, then mutations; stops a target at its
           first panic and saves the input under target/kvx-fuzz/<target>/ (default 60 s each;
           KVX_FUZZ_SECS, KVX_FUZZ_ITERS, KVX_FUZZ_SEED, KVX_FUZZ_MAX_LEN, KVX_FUZZ_TRACE=1 apply)
replay     run files through a target, reporting each panic
seed-corpus  write each target's seeds (real messages and hostile variants) to
           kvx-fuzz/corpus/<target>/, replacing files of the same name";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("list") => list(),
        Some("run") => run(&args[1..]),
        Some("replay") => replay(&args[1..]),
        Some("seed-corpus") => seed_corpus(&args[1..]),
        _ => Err(USAGE.to_owned()),
    };
    match result {
        Ok(code) => code,
        Err(msg) => {
            let _ = writeln!(std::io::stderr(), "{msg}");
            ExitCode::from(2)
        }
    }
}

fn find(name: &str) -> Result<Target, String> {
    kvx_fuzz::targets()
        .into_iter()
        .find(|t| t.name == name)
        .ok_or_else(|| format!("no target {name:?}; `kvx-fuzz list` names them"))
}

fn list() -> Result<ExitCode, String> {
    for t in kvx_fuzz::targets() {
        println!("{:<26} {}", t.name, t.about);
    }
    Ok(ExitCode::SUCCESS)
}

fn run(args: &[String]) -> Result<ExitCode, String> {
    let mut config = RunConfig::from_env(60.0)?;
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut it = args.iter();
    let mut names = Vec::new();
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().cloned().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "--secs" => {
                let v = value("--secs")?;
                let secs: f64 = v.parse().map_err(|e| format!("--secs {v}: {e}"))?;
                config.time =
                    std::time::Duration::try_from_secs_f64(secs).map_err(|e| format!("--secs {v}: {e}"))?;
            }
            "--iters" => {
                let v = value("--iters")?;
                config.iters = v.parse().map_err(|e| format!("--iters {v}: {e}"))?;
            }
            "--seed" => {
                let v = value("--seed")?;
                config.seed = engine::parse_u64(&v).ok_or_else(|| format!("--seed {v}: not a number"))?;
            }
            "--threads" => {
                let v = value("--threads")?;
                threads = v.parse().map_err(|e| format!("--threads {v}: {e}"))?;
            }
            flag if flag.starts_with("--") => return Err(format!("unknown option {flag}\n{USAGE}")),
            name => {
                find(name)?;
                names.push(name.to_owned());
            }
        }
    }
    if !names.is_empty() {
        config.only = names;
    }
    println!(
        "kvx-fuzz: seed {:#x}, {:.0} s and at most {} mutated inputs per target, {threads} threads",
        config.seed,
        config.time.as_secs_f64(),
        config.iters
    );
    let outcomes = kvx_fuzz::run_targets(kvx_fuzz::targets(), &config, threads, |o| println!("{o}"));
    let failed = outcomes.iter().filter(|o| o.failed()).count();
    let ran = outcomes.iter().filter(|o| matches!(o, Outcome::Ran(_))).count();
    println!("kvx-fuzz: {ran} targets ran, {failed} failed");
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn replay(args: &[String]) -> Result<ExitCode, String> {
    let (name, files) = args.split_first().ok_or_else(|| USAGE.to_owned())?;
    let target = find(name)?;
    let availability = target.availability();
    if availability != kvx_fuzz::Availability::Ready {
        return Err(format!("{name} cannot run here: {availability:?}"));
    }
    let mut failed = 0;
    for file in files {
        let bytes = std::fs::read(file).map_err(|e| format!("{file}: {e}"))?;
        match engine::run_catching(target.run, &bytes) {
            Ok(()) => println!("{file}: ok"),
            Err(panic) => {
                failed += 1;
                println!("{file}: PANIC\n  {}", panic.replace('\n', "\n  "));
            }
        }
    }
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn seed_corpus(args: &[String]) -> Result<ExitCode, String> {
    for target in kvx_fuzz::targets() {
        if !args.is_empty() && !args.iter().any(|a| a == target.name) {
            continue;
        }
        if let other @ (kvx_fuzz::Availability::NotBuilt(_) | kvx_fuzz::Availability::Unavailable(_)) =
            target.availability()
        {
            println!("{:<26} not written: {other:?}", target.name);
            continue;
        }
        let dir: PathBuf = engine::corpus_dir(target.name);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let seeds = target.seeds();
        for seed in &seeds {
            let path = dir.join(&seed.name);
            std::fs::write(&path, &seed.bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        println!("{:<26} {} seeds written to {}", target.name, seeds.len(), dir.display());
    }
    Ok(ExitCode::SUCCESS)
}
