//! `cargo xtask tidy`: the house rules that a compiler does not check, also run by
//! `cargo test` (see the test at the bottom), so CI enforces them.
//!
//! - every `.rs` file of the workspace starts with a `//!` header;
//! - no module is named `utils`, `helpers` or `common`;
//! - no test is marked `ignore` or `should_panic` (assert on the `Err` instead);
//! - ARCHITECTURE.md has one `### crates/<name>` heading per crate folder, and no heading
//!   for a folder that does not exist.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use crate::project_root;

pub(crate) fn run() -> Result<()> {
    let problems = check(&project_root());
    if problems.is_empty() {
        println!("tidy: ok");
        return Ok(());
    }
    for problem in &problems {
        eprintln!("tidy: {problem}");
    }
    bail!("{} tidy problem(s)", problems.len())
}

fn check(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let mut files = Vec::new();
    for folder in ["crates", "xtask", "examples", "benches", "src"] {
        collect_rust_files(&root.join(folder), &mut files);
    }
    for file in &files {
        let relative = file
            .strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string();
        let Ok(text) = std::fs::read_to_string(file) else {
            problems.push(format!("{relative}: unreadable"));
            continue;
        };
        if !text.trim_start().starts_with("//!") {
            problems.push(format!("{relative}: does not start with a `//!` header"));
        }
        let stem = file
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        if ["utils", "helpers", "common"].contains(&stem) {
            problems.push(format!("{relative}: name the module after its concept"));
        }
        for banned in [concat!("#[", "ignore"), concat!("#[", "should_panic")] {
            if text.contains(banned) {
                problems.push(format!("{relative}: uses {banned}]"));
            }
        }
    }
    problems.extend(check_code_map(root));
    problems
}

fn check_code_map(root: &Path) -> Vec<String> {
    let Ok(architecture) = std::fs::read_to_string(root.join("ARCHITECTURE.md")) else {
        return vec!["ARCHITECTURE.md is missing".into()];
    };
    let headings: Vec<&str> = architecture
        .lines()
        .filter_map(|line| line.strip_prefix("### crates/"))
        .map(str::trim)
        .collect();
    let mut crates: Vec<String> = std::fs::read_dir(root.join("crates"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.path().join("Cargo.toml").exists())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    crates.sort();
    let mut problems = Vec::new();
    for krate in &crates {
        if !headings.contains(&krate.as_str()) {
            problems.push(format!(
                "ARCHITECTURE.md has no `### crates/{krate}` section"
            ));
        }
    }
    for heading in headings {
        if !crates.iter().any(|krate| krate == heading) {
            problems.push(format!(
                "ARCHITECTURE.md describes crates/{heading}, which does not exist"
            ));
        }
    }
    problems
}

fn collect_rust_files(folder: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|name| name == "target") {
                continue;
            }
            collect_rust_files(&path, files);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_workspace_is_tidy() {
        let problems = super::check(&crate::project_root());
        assert!(
            problems.is_empty(),
            "tidy problems:\n{}",
            problems.join("\n")
        );
    }
}
