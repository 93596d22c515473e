//! The user docs stay true to the code and to each other:
//!
//! - every code pointer that docs/CONTRACT.md and docs/DESIGN.md cite (a path with `::` in
//!   backticks, and a test name in a table's Test, Check or Where column or after "Tests:") names
//!   something declared in the workspace's source;
//! - every relative link of the user docs names a file that exists, and a heading of it where
//!   the link has an anchor;
//! - no user doc cites this project's own issue numbers;
//! - README.md's first screen has the two commands and the crate map, and the README stays short.
//!
//! The matching is textual on purpose (no parser, std only): a name counts as declared when some
//! `.rs` file of the workspace declares it (`fn`, `struct`, `enum`, `trait`, `type`, `const`,
//! `static`, `mod`, `union`, `macro_rules!`), has it as a field or an enum variant, or has a file
//! or directory of that name. A pointer `Type::member` needs `Type` declared as a type and
//! `member` declared anywhere; it does not check that the member belongs to that type.

#![allow(clippy::expect_used)] // Test helpers: a failed expect is a failed test.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The docs whose code pointers are checked.
const POINTER_DOCS: [&str; 2] = ["docs/CONTRACT.md", "docs/DESIGN.md"];

/// First segments of paths into other projects: not checked.
const FOREIGN: [&str; 22] = [
    "std",
    "core",
    "alloc",
    "tokio",
    "serde",
    "rmp_serde",
    "hyper",
    "etcd_client",
    "pyo3",
    "nixl_sys",
    "torch",
    "vllm",
    "u8",
    "u16",
    "u32",
    "u64",
    "usize",
    "i32",
    "i64",
    "isize",
    "f32",
    "f64",
];

/// The first screen of README.md, in lines.
const FIRST_SCREEN: usize = 60;
/// The longest README.md may be, in lines.
const README_MAX_LINES: usize = 300;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("kvx-testkit lives in the workspace").to_path_buf()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// What the workspace's Rust source declares.
#[derive(Default)]
struct Source {
    /// Names declared as items: `fn`, `struct`, `enum`, `trait`, `type`, `const`, `static`,
    /// `mod`, `union`, `macro_rules!`.
    items: HashSet<String>,
    /// Names declared as types: `struct`, `enum`, `trait`, `type`, `union`.
    types: HashSet<String>,
    /// Fields (`name: T` at the start of a line) and enum variants (`Name,`, `Name(..)`,
    /// `Name {..}`, `Name = ..` at the start of a line).
    members: HashSet<String>,
    /// Stems of `.rs` files and names of directories.
    paths: HashSet<String>,
    /// The workspace's crates, as Rust names (`kvx_core`).
    crates: HashSet<String>,
}

impl Source {
    fn load(root: &Path) -> Source {
        let mut source = Source::default();
        source.walk(root);
        source
    }

    fn walk(&mut self, dir: &Path) {
        let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            if path.is_dir() {
                if name == "target" || name.starts_with('.') || name == "corpus" {
                    continue;
                }
                if path.join("Cargo.toml").is_file() {
                    self.crates.insert(name.replace('-', "_"));
                }
                self.paths.insert(name);
                self.walk(&path);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                self.paths.insert(stem.to_string());
                self.scan(&read(&path));
            }
        }
    }

    fn scan(&mut self, text: &str) {
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or_default();
            let words = identifiers(code);
            for pair in words.windows(2) {
                let (keyword, name) = (pair[0], pair[1]);
                match keyword {
                    "struct" | "enum" | "trait" | "type" | "union" => {
                        self.types.insert(name.to_string());
                        self.items.insert(name.to_string());
                    }
                    "fn" | "const" | "static" | "mod" | "macro_rules" => {
                        self.items.insert(name.to_string());
                    }
                    _ => {}
                }
            }
            if let Some(member) = member(code) {
                self.members.insert(member.to_string());
            }
        }
    }

    /// Why `path` (segments joined by `::`) names nothing declared, if it does not.
    fn check_path(&self, path: &str) -> Result<(), String> {
        let segments: Vec<&str> = path.split("::").collect();
        if FOREIGN.contains(&segments[0]) {
            return Ok(());
        }
        for (i, &segment) in segments.iter().enumerate() {
            let last = i + 1 == segments.len();
            if segment == "*" || ["crate", "self", "super"].contains(&segment) {
                continue;
            }
            if i == 0 && self.crates.contains(segment) {
                continue;
            }
            let upper = segment.starts_with(|c: char| c.is_ascii_uppercase());
            let found = match (upper, last) {
                // `Type::..`: a type.
                (true, false) => self.types.contains(segment),
                // A type, a constant or an enum variant.
                (true, true) => self.items.contains(segment) || self.members.contains(segment),
                // A module (file, directory, `mod`), a crate, or a function with a test module.
                (false, false) => {
                    self.paths.contains(segment)
                        || self.items.contains(segment)
                        || self.crates.contains(segment)
                }
                // A function, module, field or file.
                (false, true) => {
                    self.items.contains(segment)
                        || self.members.contains(segment)
                        || self.paths.contains(segment)
                }
            };
            if !found {
                return Err(format!("`{segment}` is declared nowhere"));
            }
        }
        Ok(())
    }

    /// Why `name` (a test or function name) names nothing declared, if it does not.
    fn check_name(&self, name: &str) -> Result<(), String> {
        if self.items.contains(name) || self.members.contains(name) || self.paths.contains(name) {
            Ok(())
        } else {
            Err("declared nowhere".into())
        }
    }
}

/// The identifiers of a line of code, in order.
fn identifiers(code: &str) -> Vec<&str> {
    code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
        .collect()
}

/// The field or enum variant a line declares, roughly: `[pub[(..)]] name: T` for a field, `Name`
/// followed by `,`, `(`, `{`, `=` or nothing for a variant.
fn member(code: &str) -> Option<&str> {
    let mut rest = code.trim_start();
    if let Some(after) = rest.strip_prefix("pub") {
        rest = after.trim_start();
        if rest.starts_with('(') {
            rest = rest.split_once(')')?.1.trim_start();
        }
    }
    let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
    let (name, after) = rest.split_at(end);
    let after = after.trim_start();
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    if name.starts_with(|c: char| c.is_ascii_uppercase()) {
        let variant = after.is_empty() || after.starts_with([',', '(', '{']) || after.starts_with("= ");
        variant.then_some(name)
    } else {
        (after.starts_with(':') && !after.starts_with("::")).then_some(name)
    }
}

/// The text of a Markdown document outside fenced code blocks, line by line.
fn prose_lines(doc: &str) -> Vec<&str> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for line in doc.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            lines.push(line);
        }
    }
    lines
}

/// The code spans (between single backticks) of a line or a paragraph.
fn code_spans(text: &str) -> impl Iterator<Item = &str> {
    text.split('`').skip(1).step_by(2)
}

/// A document's text in the units a code span cannot cross: each table row, each heading, and
/// each paragraph (or list item) joined into one line.
fn blocks(lines: &[&str]) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut paragraph = String::new();
    for line in lines {
        let trimmed = line.trim_start();
        let numbered = trimmed
            .split_once(". ")
            .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()));
        let starts_item = trimmed.starts_with("- ") || numbered;
        if trimmed.is_empty() || trimmed.starts_with('|') || trimmed.starts_with('#') || starts_item {
            blocks.push(std::mem::take(&mut paragraph));
        }
        if trimmed.starts_with('|') || trimmed.starts_with('#') {
            blocks.push(trimmed.to_string());
        } else if !trimmed.is_empty() {
            paragraph.push(' ');
            paragraph.push_str(trimmed);
        }
    }
    blocks.push(paragraph);
    blocks.retain(|b| !b.is_empty());
    blocks
}

/// The `a::b::c` paths in a code span.
fn paths_in(span: &str) -> Vec<&str> {
    span.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '*'))
        .map(|run| run.trim_matches(':'))
        .filter(|run| run.contains("::"))
        .filter(|run| {
            run.split("::").all(|s| s == "*" || s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
        })
        .collect()
}

/// Whether `word` looks like a test name: snake case with at least three underscores.
fn is_test_name(word: &str) -> bool {
    word.starts_with(|c: char| c.is_ascii_lowercase())
        && word.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && word.matches('_').count() >= 3
}

/// The cells of a table row, split at `|` outside code spans.
fn cells(row: &str) -> Vec<String> {
    let (mut cells, mut cell, mut in_code) = (Vec::new(), String::new(), false);
    for c in row.trim().trim_matches('|').chars() {
        match c {
            '`' => {
                in_code = !in_code;
                cell.push(c);
            }
            '|' if !in_code => cells.push(std::mem::take(&mut cell)),
            _ => cell.push(c),
        }
    }
    cells.push(cell);
    cells
}

/// The test names a document presents as such: in the Test, Tests, Check or Where column of a
/// table, and in a paragraph that starts with "Tests:".
fn test_names(lines: &[&str]) -> Vec<String> {
    let mut names = Vec::new();
    let mut take = |text: &str| {
        for span in code_spans(text) {
            names.extend(
                span.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|w| is_test_name(w))
                    .map(String::from),
            );
        }
    };
    let mut columns: Vec<usize> = Vec::new();
    let mut in_table = false;
    let mut in_tests_paragraph = false;
    for line in lines {
        if line.trim_start().starts_with('|') {
            let row = cells(line);
            if !in_table {
                columns = (row.iter().enumerate())
                    .filter(|(_, h)| {
                        ["test", "tests", "check", "where"].contains(&h.trim().to_lowercase().as_str())
                    })
                    .map(|(i, _)| i)
                    .collect();
                in_table = true;
            } else {
                columns.iter().filter_map(|&i| row.get(i)).for_each(|cell| take(cell));
            }
            continue;
        }
        in_table = false;
        if line.trim().is_empty() {
            in_tests_paragraph = false;
        } else if line.starts_with("Tests:") {
            in_tests_paragraph = true;
        }
        if in_tests_paragraph {
            take(line);
        }
    }
    names
}

#[test]
fn code_pointers_in_the_contract_and_the_design_name_existing_code() {
    let root = root();
    let source = Source::load(&root);
    let mut stale = Vec::new();
    let mut checked = 0;
    for doc in POINTER_DOCS {
        let text = read(&root.join(doc));
        let lines = prose_lines(&text);
        let blocks = blocks(&lines);
        let mut seen = HashSet::new();
        for (path, why) in (blocks.iter().flat_map(|b| code_spans(b)).flat_map(paths_in))
            .filter(|p| seen.insert(p.to_string()))
            .map(|p| (p, source.check_path(p)))
        {
            checked += 1;
            if let Err(why) = why {
                stale.push(format!("{doc}: `{path}`: {why}"));
            }
        }
        for name in test_names(&lines).into_iter().filter(|n| seen.insert(n.clone())) {
            checked += 1;
            if let Err(why) = source.check_name(&name) {
                stale.push(format!("{doc}: test `{name}`: {why}"));
            }
        }
    }
    assert!(checked > 100, "only {checked} pointers found: is the extraction broken?");
    assert!(stale.is_empty(), "{} stale code pointers:\n{}", stale.len(), stale.join("\n"));
}

/// The user docs: the README, everything under docs/, and the CLI's and the vLLM crate's READMEs.
fn user_docs(root: &Path) -> Vec<PathBuf> {
    let mut docs =
        vec![root.join("README.md"), root.join("kvx-cli/README.md"), root.join("kvx-vllm/README.md")];
    let mut under_docs: Vec<PathBuf> = (fs::read_dir(root.join("docs")).expect("docs/"))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    under_docs.sort();
    docs.extend(under_docs);
    docs
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    (heading.trim().to_lowercase().chars())
        .filter(|c| c.is_alphanumeric() || [' ', '-', '_'].contains(c))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(doc: &str) -> HashSet<String> {
    prose_lines(doc).iter().filter(|l| l.starts_with('#')).map(|l| slug(l.trim_start_matches('#'))).collect()
}

/// The targets of a line's Markdown links, outside code spans.
fn link_targets(line: &str) -> Vec<&str> {
    let outside: Vec<&str> = line.split('`').step_by(2).collect();
    let mut targets = Vec::new();
    for part in outside {
        let mut rest = part;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            targets.push(&rest[..end]);
            rest = &rest[end..];
        }
    }
    targets
}

#[test]
fn relative_links_between_the_docs_resolve() {
    let root = root();
    let mut broken = Vec::new();
    for doc in user_docs(&root) {
        let text = read(&doc);
        let dir = doc.parent().expect("a doc's directory");
        let name = doc.strip_prefix(&root).unwrap_or(&doc).display().to_string();
        for target in prose_lines(&text).iter().flat_map(|l| link_targets(l)) {
            // External links, and rustdoc's intra-doc links of crate READMEs.
            if target.contains("://")
                || target.starts_with("mailto:")
                || target.contains("::")
                || target.contains('@')
            {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let path = if file.is_empty() { doc.clone() } else { dir.join(file) };
            if !path.exists() {
                broken.push(format!("{name}: ({target}): {} does not exist", path.display()));
                continue;
            }
            if !anchor.is_empty()
                && path.extension().is_some_and(|e| e == "md")
                && !anchors(&read(&path)).contains(anchor)
            {
                broken.push(format!("{name}: ({target}): no heading #{anchor}"));
            }
        }
    }
    assert!(broken.is_empty(), "{} broken links:\n{}", broken.len(), broken.join("\n"));
}

/// Upstream projects whose issues the docs may cite.
const UPSTREAM: [&str; 8] = ["vllm", "dynamo", "nixl", "ucx", "mooncake", "rust", "tokio", "pyo3"];

#[test]
fn user_docs_cite_no_issue_numbers_of_this_project() {
    let root = root();
    let mut cited = Vec::new();
    for doc in user_docs(&root) {
        let text = read(&doc);
        let name = doc.strip_prefix(&root).unwrap_or(&doc).display().to_string();
        for (n, line) in text.lines().enumerate() {
            let lower = line.to_lowercase();
            let digit_at = |at: usize| lower[at..].starts_with(|c: char| c.is_ascii_digit());
            // "issue 14", "issues 14", "issue #14"; "#14".
            let after_issue = lower.match_indices("issue").map(|(at, _)| {
                let rest = &lower[at + "issue".len()..];
                let rest = rest.strip_prefix('s').unwrap_or(rest).trim_start_matches(' ');
                (at, lower.len() - rest.strip_prefix('#').unwrap_or(rest).len())
            });
            let after_hash = lower.match_indices('#').map(|(at, _)| (at, at + 1));
            let internal =
                after_issue.chain(after_hash).filter(|&(_, number)| digit_at(number)).any(|(at, _)| {
                    // An upstream project's issue names the project right before: "vllm #1234".
                    let before = lower[..at].trim_end();
                    let before = before.strip_suffix("'s").unwrap_or(before);
                    !UPSTREAM.iter().any(|u| before.ends_with(u))
                });
            if internal {
                cited.push(format!("{name}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(cited.is_empty(), "issue numbers of this project in user docs:\n{}", cited.join("\n"));
}

#[test]
fn the_readme_shows_the_two_commands_and_the_crate_map_on_its_first_screen() {
    let readme = read(&root().join("README.md"));
    let lines: Vec<&str> = readme.lines().collect();
    let first_screen = lines[..lines.len().min(FIRST_SCREEN)].join("\n");
    for wanted in ["cargo run --release -p kvx-cli -- demo", "scripts/test.sh"] {
        assert!(first_screen.contains(wanted), "README.md's first {FIRST_SCREEN} lines lack `{wanted}`");
    }
    assert!(
        lines[..lines.len().min(FIRST_SCREEN)].contains(&"## Crate map"),
        "README.md's first {FIRST_SCREEN} lines lack the heading `## Crate map`"
    );
    assert!(
        lines.len() <= README_MAX_LINES,
        "README.md has {} lines, at most {README_MAX_LINES}",
        lines.len()
    );
}

#[test]
fn the_extraction_finds_what_the_docs_write() {
    assert_eq!(paths_in("kvx_net::admission"), ["kvx_net::admission"]);
    assert_eq!(
        paths_in("SideChannel::bind_with(host, NetConfig::with_key(k))"),
        ["SideChannel::bind_with", "NetConfig::with_key"]
    );
    assert_eq!(paths_in("kvx-ucx tests (tcp::*)"), ["tcp::*"]);
    assert!(paths_in("http://10.0.0.1:9100/metrics").is_empty());
    assert_eq!(member("    pub lease_duration: Duration,"), Some("lease_duration"));
    assert_eq!(member("    Join { rank: u32, world_size: u32 },"), Some("Join"));
    assert_eq!(member("    pub(crate) held: bool,"), Some("held"));
    assert_eq!(member("    Done,"), Some("Done"));
    assert_eq!(member("    foo(bar);"), None);
    assert_eq!(member("    let x: u32 = 1;"), None);
    assert!(is_test_name("a_failed_handshake_fails"));
    assert!(!is_test_name("post_read"));
    let table = [
        "| Failure | Effect | Test |",
        "|---|---|---|",
        "| x | `a_b_c_d` | `one_two_three_four`, `x::five_six_seven_eight` |",
    ];
    assert_eq!(test_names(&table), ["one_two_three_four", "five_six_seven_eight"]);
    let paragraph = ["A `TcpGroup`'s rank 0 and", "`kvx_net::admission` across", "1 line,", "", "- `a::b`"];
    assert_eq!(
        blocks(&paragraph),
        [" A `TcpGroup`'s rank 0 and `kvx_net::admission` across 1 line,", " - `a::b`"]
    );
    assert_eq!(
        slug("Posting: descriptors named once, coalesced"),
        "posting-descriptors-named-once-coalesced"
    );
    assert_eq!(slug("`kvx bench`"), "kvx-bench");
}
