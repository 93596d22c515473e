//! The stable fuzz engine: replays a target's corpus, then mutates it for a bounded time and
//! number of runs, catching panics. No coverage feedback (that needs nightly's sanitizer
//! instrumentation; see the `fuzz/` cargo-fuzz harness): the mutations are aimed at the formats
//! kvx decodes instead (MessagePack markers and length fields, JSON numbers and nesting).

use std::cell::{Cell, RefCell};
use std::fmt;
use std::io::Write;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::time::{Duration, Instant};

use crate::Target;

mod mutate;

use mutate::splitmix64;
pub use mutate::{Mutator, Rng, fnv1a};

/// How long and how hard to fuzz.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunConfig {
    /// Mutation time per target (the corpus replay comes on top).
    pub time: Duration,
    /// Mutated runs per target, at most.
    pub iters: u64,
    /// The base seed; each target mixes its name in.
    pub seed: u64,
    /// Mutated inputs stay under this many bytes (corpus entries may be longer).
    pub max_len: usize,
    /// Write each input to `<crash dir>/<target>/current` before running it, so that an abort
    /// (which no `catch_unwind` sees) leaves its input behind. Slow.
    pub trace: bool,
    /// Only these targets (all when empty).
    pub only: Vec<String>,
}

impl RunConfig {
    /// The configuration from the environment: `KVX_FUZZ_SECS` (per target, fractions allowed;
    /// default `default_secs`), `KVX_FUZZ_ITERS`, `KVX_FUZZ_SEED` (decimal or 0x-hex; default from
    /// the clock), `KVX_FUZZ_MAX_LEN` (default 64 KiB), `KVX_FUZZ_TRACE=1`, `KVX_FUZZ_TARGETS`
    /// (comma-separated names).
    pub fn from_env(default_secs: f64) -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let secs = match var("KVX_FUZZ_SECS") {
            Some(v) => v.trim().parse::<f64>().map_err(|e| format!("KVX_FUZZ_SECS={v}: {e}"))?,
            None => default_secs,
        };
        let time = Duration::try_from_secs_f64(secs).map_err(|e| format!("KVX_FUZZ_SECS={secs}: {e}"))?;
        let iters = match var("KVX_FUZZ_ITERS") {
            Some(v) => v.trim().parse().map_err(|e| format!("KVX_FUZZ_ITERS={v}: {e}"))?,
            None => u64::MAX,
        };
        let seed = match var("KVX_FUZZ_SEED") {
            Some(v) => parse_u64(&v).ok_or_else(|| format!("KVX_FUZZ_SEED={v}: not a number"))?,
            None => clock_seed(),
        };
        let max_len = match var("KVX_FUZZ_MAX_LEN") {
            Some(v) => v.trim().parse().map_err(|e| format!("KVX_FUZZ_MAX_LEN={v}: {e}"))?,
            None => 64 << 10,
        };
        let trace = var("KVX_FUZZ_TRACE").is_some_and(|v| v != "0");
        let only = var("KVX_FUZZ_TARGETS")
            .map(|v| v.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect())
            .unwrap_or_default();
        Ok(RunConfig { time, iters, seed, max_len, trace, only })
    }

    /// Whether `target` is selected.
    pub fn selects(&self, target: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|t| t == target)
    }

    /// The seed `target` runs with.
    pub fn target_seed(&self, target: &str) -> u64 {
        self.seed ^ fnv1a(target.as_bytes())
    }
}

/// Parses `123` or `0x7b`.
pub fn parse_u64(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

fn clock_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    splitmix64(nanos ^ u64::from(std::process::id()))
}

/// A panic that a target raised, with the input that raised it.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The panic message and location (and a backtrace when one was captured).
    pub panic: String,
    /// The input as run.
    pub input: Vec<u8>,
    /// A shorter input that panics at the same place, when minimising found one.
    pub minimized: Option<Vec<u8>>,
    /// Where the input (and the minimised one) were written.
    pub saved: Vec<PathBuf>,
    /// Which run found it: a corpus entry's name, or `mutation #n`.
    pub found_by: String,
}

/// What one target's run did.
#[derive(Debug, Clone)]
pub struct Report {
    /// The target.
    pub target: &'static str,
    /// The seed it ran with.
    pub seed: u64,
    /// Corpus entries replayed (committed files and seeds made in this process).
    pub corpus_runs: u64,
    /// Mutated inputs run.
    pub mutation_runs: u64,
    /// Wall time of the whole run.
    pub elapsed: Duration,
    /// The first panic, if any (the run stops there).
    pub failure: Option<Failure>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<26} {:>3} corpus + {:>8} mutated inputs in {:>5.1} s, seed {:#018x}: ",
            self.target,
            self.corpus_runs,
            self.mutation_runs,
            self.elapsed.as_secs_f64(),
            self.seed
        )?;
        let Some(failure) = &self.failure else { return f.write_str("0 panics") };
        writeln!(f, "PANIC ({})", failure.found_by)?;
        writeln!(f, "  {}", failure.panic.replace('\n', "\n  "))?;
        writeln!(f, "  input ({} bytes):", failure.input.len())?;
        write!(f, "{}", hex_dump(&failure.input, 4096))?;
        if let Some(min) = &failure.minimized {
            writeln!(f, "  minimised input ({} bytes):", min.len())?;
            write!(f, "{}", hex_dump(min, 4096))?;
        }
        for path in &failure.saved {
            writeln!(f, "  saved to {}", path.display())?;
        }
        writeln!(
            f,
            "  replay: cargo run -p kvx-fuzz -- replay {} <file>; once fixed, copy the file into \
             kvx-fuzz/corpus/{}/",
            self.target, self.target
        )?;
        write!(
            f,
            "  rerun the same mutations: KVX_FUZZ_SEED={:#x} KVX_FUZZ_TARGETS={} (inputs from live seeds \
             differ in addresses between processes)",
            self.seed ^ fnv1a(self.target.as_bytes()),
            self.target
        )
    }
}

/// A classic hex dump (offset, 16 bytes, ASCII), cut after `limit` bytes.
pub fn hex_dump(bytes: &[u8], limit: usize) -> String {
    let mut out = String::new();
    for (row, chunk) in bytes[..bytes.len().min(limit)].chunks(16).enumerate() {
        let hex: Vec<String> = chunk.iter().map(|b| format!("{b:02x}")).collect();
        let ascii: String =
            chunk.iter().map(|&b| if b.is_ascii_graphic() || b == b' ' { b as char } else { '.' }).collect();
        out.push_str(&format!("    {:08x}  {:<47}  |{ascii}|\n", row * 16, hex.join(" ")));
    }
    if bytes.len() > limit {
        out.push_str(&format!("    ... {} more bytes (the saved file has them all)\n", bytes.len() - limit));
    }
    out
}

thread_local! {
    /// Whether this thread is inside a target run (its panics are captured, not printed).
    static CAPTURING: Cell<bool> = const { Cell::new(false) };
    /// The last captured panic of this thread.
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Installs (once) a panic hook that records the panics of target runs instead of printing them,
/// and leaves every other panic to the previous hook.
fn install_panic_hook() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if CAPTURING.with(Cell::get) {
                let backtrace = std::backtrace::Backtrace::force_capture();
                let text = format!("{info}\n{}", short_backtrace(&backtrace.to_string()));
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(text));
            } else {
                previous(info);
            }
        }));
    });
}

/// The frames of a backtrace that are kvx's own code (the rest is std and the engine).
fn short_backtrace(full: &str) -> String {
    let lines: Vec<&str> = full.lines().collect();
    let mut keep = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let frame = line.trim_start();
        let is_symbol = frame.split_once(": ").is_some_and(|(n, _)| n.chars().all(|c| c.is_ascii_digit()));
        if is_symbol && (frame.contains("kvx_") && !frame.contains("kvx_fuzz::engine")) {
            keep.push(frame.to_owned());
            if let Some(at) = lines.get(i + 1).filter(|l| l.trim_start().starts_with("at ")) {
                keep.push(format!("    {}", at.trim_start()));
            }
        }
    }
    if keep.is_empty() { String::from("(no kvx frames in the backtrace)") } else { keep.join("\n") }
}

/// Runs `run(input)`, returning the panic's text if it panicked.
pub fn run_catching(run: fn(&[u8]), input: &[u8]) -> Result<(), String> {
    install_panic_hook();
    LAST_PANIC.with(|p| p.borrow_mut().take());
    CAPTURING.with(|c| c.set(true));
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| run(input)));
    CAPTURING.with(|c| c.set(false));
    outcome.map_err(|payload| {
        LAST_PANIC.with(|p| p.borrow_mut().take()).unwrap_or_else(|| {
            payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with a non-string payload".to_owned())
        })
    })
}

/// The first line of a panic's text: where it panicked.
fn panic_site(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}

/// Where crashing inputs go: `$KVX_FUZZ_CRASH_DIR`, else `$CARGO_TARGET_DIR/kvx-fuzz`, else the
/// workspace's `target/kvx-fuzz`.
pub fn crash_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVX_FUZZ_CRASH_DIR") {
        return PathBuf::from(dir);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("kvx-fuzz")
}

/// The committed corpus of a target: `kvx-fuzz/corpus/<target>/`.
pub fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(target)
}

/// The committed corpus entries of `target`, sorted by file name.
pub fn read_corpus(target: &str) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let dir = corpus_dir(target);
    let mut entries = Vec::new();
    if !dir.is_dir() {
        return Ok(entries);
    }
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if path.is_file() && !name.starts_with('.') {
            entries.push((name, std::fs::read(&path)?));
        }
    }
    entries.sort();
    Ok(entries)
}

/// Runs `target`: its committed corpus, the seeds it makes in this process, then mutations until
/// the time or the run budget is spent or a run panics.
pub fn fuzz(target: &Target, config: &RunConfig) -> Report {
    let start = Instant::now();
    let seed = config.target_seed(target.name);
    let mut report = Report {
        target: target.name,
        seed,
        corpus_runs: 0,
        mutation_runs: 0,
        elapsed: Duration::ZERO,
        failure: None,
    };
    let trace_file = config.trace.then(|| crash_dir().join(target.name).join("current"));
    let run = |input: &[u8], found_by: String| -> Option<Failure> {
        if let Some(path) = &trace_file {
            let _ = path.parent().map(std::fs::create_dir_all);
            let _ = std::fs::write(path, input);
        }
        run_catching(target.run, input).err().map(|panic| Failure {
            panic,
            input: input.to_vec(),
            minimized: None,
            saved: Vec::new(),
            found_by,
        })
    };

    let mut pool: Vec<Vec<u8>> = Vec::new();
    // Mutation bases: entries not named `hostile-`, picked 7 times in 8.
    let mut bases: Vec<usize> = Vec::new();
    let mut named: Vec<(String, Vec<u8>)> = match read_corpus(target.name) {
        Ok(entries) => entries.into_iter().map(|(n, b)| (format!("corpus/{}/{n}", target.name), b)).collect(),
        Err(e) => {
            report.failure = Some(Failure {
                panic: format!("reading the corpus at {}: {e}", corpus_dir(target.name).display()),
                input: Vec::new(),
                minimized: None,
                saved: Vec::new(),
                found_by: "corpus".into(),
            });
            report.elapsed = start.elapsed();
            return report;
        }
    };
    // Seeds made here, from live agents and workers: they reach past checks that committed bytes
    // cannot (a loopback fabric's id, say, differs in every process).
    let mut seeds = Vec::new();
    let made = run_catching_value(|| seeds = target.seeds());
    if let Err(panic) = made {
        report.failure = Some(Failure {
            panic: format!("making the seeds panicked: {panic}"),
            input: Vec::new(),
            minimized: None,
            saved: Vec::new(),
            found_by: "seeds".into(),
        });
        report.elapsed = start.elapsed();
        return report;
    }
    named.extend(seeds.into_iter().map(|s| (format!("seed {}", s.name), s.bytes)));

    for (name, bytes) in named {
        report.corpus_runs += 1;
        let hostile = name.rsplit(['/', ' ']).next().is_some_and(|n| n.starts_with("hostile-"));
        if let Some(failure) = run(&bytes, name) {
            report.failure = Some(finish_failure(target, failure));
            report.elapsed = start.elapsed();
            return report;
        }
        if !hostile {
            bases.push(pool.len());
        }
        pool.push(bytes);
    }
    let inner_pool: Vec<Vec<u8>> = match target.nest {
        Some(nest) => pool.iter().filter_map(|b| (nest.unwrap)(b)).collect(),
        None => Vec::new(),
    };

    let mut mutator = Mutator::new(seed, &target.dict, config.max_len);
    let deadline = start + config.time;
    let mut current: Vec<u8> = Vec::new();
    while report.mutation_runs < config.iters && Instant::now() < deadline {
        // Mostly keep mutating the last input (walks a few steps away from the corpus), sometimes
        // start again from a corpus entry.
        if current.is_empty() || mutator.rng().one_in(2) {
            current = if !bases.is_empty() && !mutator.rng().one_in(8) {
                pool[bases[mutator.rng().below(bases.len())]].clone()
            } else {
                match pool.len() {
                    0 => Vec::new(),
                    n => pool[mutator.rng().below(n)].clone(),
                }
            };
        }
        let inner = match target.nest {
            Some(nest) if mutator.rng().one_in(2) => (nest.unwrap)(&current).map(|i| (nest, i)),
            _ => None,
        };
        match inner {
            Some((nest, mut inner)) => {
                mutator.mutate(&mut inner, &inner_pool);
                current = (nest.wrap)(&current, &inner);
            }
            None => mutator.mutate(&mut current, &pool),
        }
        report.mutation_runs += 1;
        if let Some(failure) = run(&current, format!("mutation #{}", report.mutation_runs)) {
            report.failure = Some(finish_failure(target, failure));
            break;
        }
    }
    report.elapsed = start.elapsed();
    report
}

fn run_catching_value(f: impl FnOnce()) -> Result<(), String> {
    install_panic_hook();
    CAPTURING.with(|c| c.set(true));
    let outcome = panic::catch_unwind(AssertUnwindSafe(f));
    CAPTURING.with(|c| c.set(false));
    outcome.map_err(|_| LAST_PANIC.with(|p| p.borrow_mut().take()).unwrap_or_default())
}

/// Minimises a failing input (bounded), then saves both.
fn finish_failure(target: &Target, mut failure: Failure) -> Failure {
    let site = panic_site(&failure.panic).to_owned();
    let minimized = minimize(target.run, &failure.input, &site);
    if minimized.len() < failure.input.len() {
        failure.minimized = Some(minimized);
    }
    let dir = crash_dir().join(target.name);
    let mut save = |bytes: &[u8]| {
        let path = dir.join(format!("crash-{:016x}", fnv1a(bytes)));
        match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, bytes)) {
            Ok(()) => failure.saved.push(path),
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "kvx-fuzz: could not save {}: {e}", path.display());
            }
        }
    };
    save(&failure.input.clone());
    if let Some(min) = failure.minimized.clone() {
        save(&min);
    }
    failure
}

/// Removes chunks (halves down to single bytes) while the input still panics at `site`, for at
/// most 2000 runs.
fn minimize(run: fn(&[u8]), input: &[u8], site: &str) -> Vec<u8> {
    let mut best = input.to_vec();
    let mut budget = 2000u32;
    let mut chunk = best.len() / 2;
    while chunk > 0 && budget > 0 {
        let mut at = 0;
        while at < best.len() && budget > 0 {
            let mut candidate = best.clone();
            let end = (at + chunk).min(candidate.len());
            candidate.drain(at..end);
            budget -= 1;
            match run_catching(run, &candidate) {
                Err(panic) if panic_site(&panic) == site => best = candidate,
                _ => at += chunk,
            }
        }
        chunk /= 2;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_are_caught_with_their_site_and_others_pass() {
        fn boom(data: &[u8]) {
            if data.first() == Some(&1) {
                panic!("boom {}", data.len());
            }
        }
        assert!(run_catching(boom, &[0]).is_ok());
        let err = run_catching(boom, &[1, 2, 3]).unwrap_err();
        assert!(err.contains("boom 3"), "{err}");
        assert_eq!(minimize(boom, &[1, 2, 3, 4, 5], panic_site(&err)), vec![1]);
    }

    #[test]
    fn hex_dump_shows_offsets_bytes_and_ascii() {
        let dump = hex_dump(b"KVX1\x00\xff", 4096);
        assert!(dump.contains("00000000  4b 56 58 31 00 ff"), "{dump}");
        assert!(dump.contains("|KVX1..|"), "{dump}");
        assert!(hex_dump(&[0; 40], 16).contains("24 more bytes"));
    }
}
