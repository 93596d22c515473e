//! The bounded fuzz run of `cargo test`: every target replays its committed corpus and the seeds
//! it makes, then mutates them for `KVX_FUZZ_SECS` seconds (default 4) per target, on all cores.
//! Zero panics. Summary lines go straight to stderr, past the test harness's capture.

use std::io::Write;

use kvx_fuzz::engine::{self, RunConfig};
use kvx_fuzz::{Availability, Outcome};

/// Seconds of mutation per target when `KVX_FUZZ_SECS` is unset.
/// (4 s: 20 targets take about as long as 17 took at 5 s.)
const DEFAULT_SECS: f64 = 4.0;

fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

#[test]
fn every_target_survives_its_corpus_and_mutations() {
    let config = match RunConfig::from_env(DEFAULT_SECS) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    say(&format!(
        "kvx-fuzz: seed {:#x}, {:.1} s of mutations per target on {threads} threads \
         (KVX_FUZZ_SECS, KVX_FUZZ_SEED, KVX_FUZZ_TARGETS to change)",
        config.seed,
        config.time.as_secs_f64()
    ));
    let outcomes =
        kvx_fuzz::run_targets(kvx_fuzz::targets(), &config, threads, |o| say(&format!("kvx-fuzz: {o}")));
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| o.failed()).collect();
    assert!(failed.is_empty(), "{} fuzz targets failed:\n{}", failed.len(), {
        failed.iter().map(|o| o.to_string()).collect::<Vec<_>>().join("\n")
    });
    let names: Vec<&str> = kvx_fuzz::targets().iter().map(|t| t.name).collect();
    for wanted in &config.only {
        assert!(names.contains(&wanted.as_str()), "KVX_FUZZ_TARGETS names {wanted:?}, which is no target");
    }
}

#[test]
fn every_target_has_a_committed_corpus_and_every_corpus_a_target() {
    let names: Vec<&str> = kvx_fuzz::targets().iter().map(|t| t.name).collect();
    for name in &names {
        let entries = engine::read_corpus(name).unwrap_or_default();
        assert!(
            !entries.is_empty(),
            "kvx-fuzz/corpus/{name}/ is empty or missing: `cargo run -p kvx-fuzz -- seed-corpus {name}` writes it"
        );
    }
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for entry in std::fs::read_dir(&corpus).unwrap() {
        let dir = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(names.contains(&dir.as_str()), "kvx-fuzz/corpus/{dir}/ belongs to no target");
    }
}

#[test]
fn every_seed_a_target_makes_is_in_its_committed_corpus() {
    // Seeds from live agents differ byte for byte between processes; their names do not (see
    // `seeds::msgpack_hostile`).
    for target in kvx_fuzz::targets() {
        if target.availability() != Availability::Ready {
            continue;
        }
        let committed: Vec<String> =
            engine::read_corpus(target.name).unwrap_or_default().into_iter().map(|(n, _)| n).collect();
        for seed in target.seeds() {
            assert!(
                committed.contains(&seed.name),
                "seed {} of {} is not committed: `cargo run -p kvx-fuzz -- seed-corpus {}`",
                seed.name,
                target.name,
                target.name
            );
        }
    }
}

#[test]
fn the_cargo_fuzz_harness_has_a_binary_for_every_target() {
    let fuzz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let manifest = std::fs::read_to_string(fuzz.join("Cargo.toml")).unwrap();
    for target in kvx_fuzz::targets() {
        let name = target.name;
        assert!(manifest.contains(&format!("name = \"{name}\"")), "fuzz/Cargo.toml has no [[bin]] {name}");
        let source = std::fs::read_to_string(fuzz.join(format!("fuzz_targets/{name}.rs"))).unwrap();
        assert!(
            source.contains(&format!("run(\"{name}\", data)")),
            "fuzz/fuzz_targets/{name}.rs runs another target"
        );
    }
}
