//! `cargo xtask tables [--check]`: every table of measured figures in the READMEs is rendered
//! from a committed raw result, and `--check` (which tidy runs too) fails on a table that is not.
//!
//! A table sits between two HTML comments, which GitHub does not show:
//!
//! - `<!-- table: KIND FILE... -->`: KIND (one function of [`kinds`]) renders the table from the
//!   FILEs, raw results under `results/<date>-<commit>/` or `crates/<name>/bench/results/`, each
//!   with its provenance (`meta`: date, commit, machine, versions, command; `results/README.md`);
//! - `<!-- table: pending PHASE... -->`: a table measured before raw results were kept. It stays
//!   as written, and the line under it says which phases of `scripts/gpu-measure.sh` measure it
//!   again into `results/` (`none`: no script does yet);
//! - `<!-- table: prose -->`: a table of words, without figures;
//! - `<!-- /table -->` closes each.
//!
//! `tables` rewrites every block from its source; `--check` changes nothing and names each block
//! whose text is not what its source renders. [`tidy_problems`] adds what tidy checks: no
//! Markdown table outside a block, every block's files present and with their provenance, no
//! stale block; it reports how many blocks are pending. The documents are the root README.md
//! (and BENCHMARKS.md once it exists), `crates/*/README.md` and `examples/*/README.md`: a block
//! moves between them unchanged.
//!
//! This module knows the markers, the documents and the results' layout; what a table says of
//! its results is [`kinds`]' business, and how the results were measured is neither's.

mod blocks;
mod kinds;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use blocks::{Block, Source};
use kinds::ResultFile;

/// `cargo xtask tables --help`'s description.
pub(crate) const LONG_ABOUT: &str = "Renders each measured table of README.md, BENCHMARKS.md, \
     crates/*/README.md and examples/*/README.md from its committed raw result.\n\n\
     A table sits between `<!-- table: KIND FILE... -->` and `<!-- /table -->`, KIND rendering it \
     from FILEs under results/ (results/README.md); a `pending PHASE...` block keeps a table \
     measured before raw results were kept, with a line naming the scripts/gpu-measure.sh phases \
     that measure it again; a `prose` block holds a table without figures. --check changes \
     nothing and fails naming each stale block (tidy runs it).";

/// What `cargo xtask tables --help` says after the options: each kind and what it reads, from
/// the kinds' table.
pub(crate) fn kinds_help() -> String {
    let mut text = "Kinds (xtask/src/tables/kinds/), and what each reads:".to_owned();
    for kind in kinds::KINDS {
        text += &format!("\n  {:<24} {}", kind.name, kind.reads);
    }
    text
}

/// The sentence the pending line starts with; a pending block's own line is recognised by it.
const UNSOURCED: &str = "_Unsourced:";

/// Where the phases of a pending block are looked up.
const GPU_MEASURE: &str = "scripts/gpu-measure.sh";

/// `cargo xtask tables [--check]`: rewrites the stale blocks, or with `check` fails naming them.
pub(crate) fn run(check: bool) -> Result<()> {
    let root = crate::project_root();
    let mut problems = Vec::new();
    let mut stale = Vec::new();
    let mut counts = Counts::default();
    for path in documents(&root) {
        let relative = relative_name(&root, &path);
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {relative}"))?;
        let outcome = process(&root, &relative, &text);
        problems.extend(outcome.problems);
        counts.add(&outcome.counts);
        if outcome.stale.is_empty() {
            continue;
        }
        if check {
            stale.extend(outcome.stale);
        } else {
            std::fs::write(&path, &outcome.text).with_context(|| format!("writing {relative}"))?;
            for block in &outcome.stale {
                println!("tables: rewrote {block}");
            }
        }
    }
    println!(
        "tables: {} rendered from results, {} pending a raw result, {} prose",
        counts.rendered, counts.pending, counts.prose
    );
    for line in problems.iter().chain(&stale) {
        eprintln!("tables: {line}");
    }
    if !stale.is_empty() {
        bail!(
            "{} table block(s) differ from what their sources render; run `cargo xtask tables`",
            stale.len()
        );
    }
    if !problems.is_empty() {
        bail!("{} table problem(s)", problems.len());
    }
    Ok(())
}

/// What tidy reports of the documents' tables: each problem and each stale block, one line
/// each. Prints how many blocks are pending (not a problem).
pub(crate) fn tidy_problems(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let mut counts = Counts::default();
    for path in documents(root) {
        let relative = relative_name(root, &path);
        let Ok(text) = std::fs::read_to_string(&path) else {
            problems.push(format!("{relative}: unreadable"));
            continue;
        };
        let outcome = process(root, &relative, &text);
        problems.extend(outcome.problems);
        problems.extend(
            outcome
                .stale
                .into_iter()
                .map(|block| format!("{block} is stale: run `cargo xtask tables`")),
        );
        counts.add(&outcome.counts);
    }
    if counts.pending > 0 {
        eprintln!(
            "tidy: {} README table(s) pending a raw result (`<!-- table: pending -->`), {} \
             rendered from results/",
            counts.pending, counts.rendered
        );
    }
    problems
}

/// The documents whose tables are checked, in a fixed order.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut documents: Vec<PathBuf> = ["README.md", "BENCHMARKS.md"]
        .iter()
        .map(|name| root.join(name))
        .filter(|path| path.is_file())
        .collect();
    for folder in ["crates", "examples"] {
        let mut readmes: Vec<PathBuf> = std::fs::read_dir(root.join(folder))
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.path().join("README.md"))
            .filter(|path| path.is_file())
            .collect();
        readmes.sort();
        documents.extend(readmes);
    }
    documents
}

fn relative_name(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// How many blocks of each source a document holds.
#[derive(Debug, Default, PartialEq)]
struct Counts {
    rendered: usize,
    pending: usize,
    prose: usize,
}

impl Counts {
    fn add(&mut self, other: &Counts) {
        self.rendered += other.rendered;
        self.pending += other.pending;
        self.prose += other.prose;
    }
}

/// One document, processed: its text with every block that could be rendered rewritten, the
/// problems (`FILE:LINE: what`), the stale blocks (`FILE:LINE (source)`) and the counts.
#[derive(Debug)]
struct Outcome {
    text: String,
    problems: Vec<String>,
    stale: Vec<String>,
    counts: Counts,
}

/// Parses `text` (the document `name`), renders each block from its source under `root` and
/// compares.
fn process(root: &Path, name: &str, text: &str) -> Outcome {
    let lines: Vec<&str> = text.lines().collect();
    let parsed = blocks::parse(&lines);
    let mut problems: Vec<String> = parsed
        .problems
        .iter()
        .map(|(line, what)| format!("{name}:{line}: {what}"))
        .collect();
    for start in blocks::table_starts(&lines) {
        let inside = parsed
            .blocks
            .iter()
            .any(|block| block.body.contains(&start));
        if !inside {
            problems.push(format!(
                "{name}:{}: a table outside `<!-- table: … -->` … `<!-- /table -->`: render it \
                 from a raw result, or mark it `pending PHASE` or `prose` (results/README.md)",
                start + 1
            ));
        }
    }
    let phases = gpu_measure_phases(root);
    let mut out: Vec<String> = Vec::with_capacity(lines.len());
    let mut stale = Vec::new();
    let mut counts = Counts::default();
    let mut next = 0;
    for block in &parsed.blocks {
        out.extend(
            lines[next..block.body.start]
                .iter()
                .map(|line| line.to_string()),
        );
        let body = &lines[block.body.clone()];
        // The opening marker's 1-based line.
        let label = format!("{name}:{} ({})", block.body.start, block.source);
        match expected_body(root, block, body, &phases) {
            Ok(expected) => {
                if expected.iter().map(String::as_str).ne(body.iter().copied()) {
                    stale.push(label);
                }
                out.extend(expected);
            }
            Err(err) => {
                problems.push(format!("{label}: {err:#}"));
                out.extend(body.iter().map(|line| line.to_string()));
            }
        }
        match block.source {
            Source::Rendered { .. } => counts.rendered += 1,
            Source::Pending { .. } => counts.pending += 1,
            Source::Prose => counts.prose += 1,
        }
        next = block.body.end;
    }
    out.extend(lines[next..].iter().map(|line| line.to_string()));
    let mut text_out = out.join("\n");
    if text.ends_with('\n') {
        text_out.push('\n');
    }
    Outcome {
        text: text_out,
        problems,
        stale,
        counts,
    }
}

/// What a block's lines between its markers should be: rendered from its files, the pending
/// table with its line under it, or (prose) what they are.
fn expected_body(
    root: &Path,
    block: &Block,
    body: &[&str],
    phases: &Result<Vec<String>>,
) -> Result<Vec<String>> {
    let lines = match &block.source {
        Source::Prose => return Ok(body.iter().map(|line| line.to_string()).collect()),
        Source::Pending { phases: wanted } => {
            if wanted.iter().any(|phase| phase != "none") {
                let known = phases.as_ref().map_err(|err| anyhow::anyhow!("{err:#}"))?;
                if let Some(unknown) = wanted.iter().find(|phase| !known.contains(phase)) {
                    bail!(
                        "`{unknown}` is no phase of {GPU_MEASURE} ({}; or `none`)",
                        known.join(" ")
                    );
                }
            }
            pending_body(body, wanted)
        }
        Source::Rendered { kind, files } => {
            kinds::find(kind)?;
            let files = files
                .iter()
                .map(|file| load_result(root, file))
                .collect::<Result<Vec<_>>>()?;
            kinds::render(kind, &files)?
        }
    };
    Ok(indented(&block.indent, lines))
}

/// A pending block's lines (without indentation): its table as written, a blank line and the
/// line that says it has no raw result.
fn pending_body(body: &[&str], phases: &[String]) -> Vec<String> {
    let kept: Vec<&str> = body
        .iter()
        .map(|line| line.trim_start())
        .filter(|line| !line.starts_with(UNSOURCED))
        .collect();
    let first = kept.iter().position(|line| !line.is_empty());
    let last = kept.iter().rposition(|line| !line.is_empty());
    let mut lines: Vec<String> = match (first, last) {
        (Some(first), Some(last)) => kept[first..=last].iter().map(|l| l.to_string()).collect(),
        _ => Vec::new(),
    };
    lines.push(String::new());
    lines.push(pending_line(phases));
    lines
}

/// The visible line under a pending table.
fn pending_line(phases: &[String]) -> String {
    if phases.iter().all(|phase| phase == "none") {
        format!(
            "{UNSOURCED} measured before raw results were kept, and no script measures it into \
             `results/` yet._"
        )
    } else {
        format!(
            "{UNSOURCED} measured before raw results were kept; `bash {GPU_MEASURE} {}` \
             measures it again into `results/`._",
            phases.join(" ")
        )
    }
}

fn indented(indent: &str, lines: Vec<String>) -> Vec<String> {
    lines
        .into_iter()
        .map(|line| {
            if line.is_empty() {
                line
            } else {
                format!("{indent}{line}")
            }
        })
        .collect()
}

/// The phases `scripts/gpu-measure.sh` accepts: the arms of its `case $phase in` (a line that
/// is a lone `name)`).
fn gpu_measure_phases(root: &Path) -> Result<Vec<String>> {
    let script = std::fs::read_to_string(root.join(GPU_MEASURE))
        .with_context(|| format!("reading {GPU_MEASURE}"))?;
    let phases: Vec<String> = script
        .lines()
        .filter_map(|line| line.trim().strip_suffix(')'))
        .filter(|name| {
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        })
        .map(str::to_owned)
        .collect();
    if phases.is_empty() {
        bail!("{GPU_MEASURE} has no `PHASE)` arms");
    }
    Ok(phases)
}

/// The provenance every raw result carries (`results/README.md`).
const META_KEYS: &[&str] = &["date", "commit", "machine", "versions", "command"];

/// Reads the results file `relative` (to the workspace root) with its provenance, checking
/// where it lies.
fn load_result(root: &Path, relative: &str) -> Result<ResultFile> {
    if let Some(problem) = results_place_problem(relative) {
        bail!("{relative}: {problem}");
    }
    let path = root.join(relative);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{relative}: no such results file (commit its raw result)"))?;
    let meta = meta_of(&path, &text).with_context(|| format!("{relative}: its provenance"))?;
    Ok(ResultFile {
        path: relative.to_owned(),
        text,
        meta,
    })
}

/// Why a results path is not where raw results live, if it is not: `results/<YYYY-MM-DD>-
/// <commit>/…`, or `crates/<name>/bench/results/…` (a crate's own bench scripts write there).
fn results_place_problem(relative: &str) -> Option<String> {
    let parts: Vec<&str> = relative.split('/').collect();
    match parts.as_slice() {
        ["results", run, _, ..] => {
            let dated = run.len() > 11
                && run.as_bytes()[10] == b'-'
                && run[..10].chars().enumerate().all(|(idx, c)| {
                    if idx == 4 || idx == 7 {
                        c == '-'
                    } else {
                        c.is_ascii_digit()
                    }
                })
                && run[11..].len() >= 7
                && run[11..].chars().all(|c| c.is_ascii_hexdigit());
            (!dated).then(|| {
                format!("`results/{run}/` is not named `<YYYY-MM-DD>-<commit>` (results/README.md)")
            })
        }
        ["crates", _, "bench", "results", _, ..] => None,
        _ => Some(
            "raw results live under results/<YYYY-MM-DD>-<commit>/ or crates/<name>/bench/results/"
                .to_owned(),
        ),
    }
}

/// A results file's provenance: its own (`{"meta": …}` as the first line of a `.jsonl`, the
/// top-level `meta` of a `.json` object), else its folder's `meta.json`, whose fields hold for
/// every file of the folder and whose `files.<name>` object overrides them for one file. It
/// must name every key of [`META_KEYS`].
fn meta_of(path: &Path, text: &str) -> Result<Value> {
    let own = match path.extension().and_then(|ext| ext.to_str()) {
        Some("jsonl") => text
            .lines()
            .find(|line| !line.trim().is_empty())
            .and_then(|line| serde_json::from_str::<Value>(line).ok())
            .and_then(|first| first.get("meta").cloned()),
        Some("json") => serde_json::from_str::<Value>(text)
            .ok()
            .and_then(|value| value.get("meta").cloned()),
        _ => None,
    };
    let meta = match own {
        Some(meta) => meta,
        None => {
            let folder_meta = path.with_file_name("meta.json");
            let text = std::fs::read_to_string(&folder_meta).with_context(|| {
                format!(
                    "no `meta` of its own and no {} beside it",
                    folder_meta
                        .file_name()
                        .unwrap_or_default()
                        .to_string_lossy()
                )
            })?;
            let folder: Value = serde_json::from_str(&text).context("meta.json is not JSON")?;
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            let mut meta = folder.clone();
            if let Some(object) = meta.as_object_mut() {
                object.remove("files");
                if let Some(own) = folder["files"][name.as_ref()].as_object() {
                    for (key, value) in own {
                        object.insert(key.clone(), value.clone());
                    }
                }
            }
            meta
        }
    };
    let missing: Vec<&str> = META_KEYS
        .iter()
        .copied()
        .filter(|key| meta.get(key).is_none_or(Value::is_null))
        .collect();
    if !missing.is_empty() {
        bail!(
            "its meta lacks {} (results/README.md)",
            missing
                .iter()
                .map(|key| format!("`{key}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(meta)
}
